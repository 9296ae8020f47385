//! Where a chat request's messages lie in its JSON body, so that the router parses only the
//! messages a turn adds (`evolving_infra.router.bodies`).
//!
//! An agent re-sends its whole context every turn: at 100k tokens the body is ~400 KB of JSON,
//! and decoding it was the largest cost left in the router once nothing was tokenized again.
//! `message_spans` finds the byte span of each element of the top-level `"messages"` array
//! without decoding anything (string contents are skipped with `memchr`); the router compares
//! the new body with the branch's last one, byte for byte, and decodes only what follows the
//! messages both share. It does not validate JSON: every byte it points at was, or is then,
//! decoded by a real parser; it only has to find the boundaries of valid JSON and turn down
//! anything it cannot read unambiguously (a key with an escape, `"messages"` twice).

use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// The top-level `"messages"` array of a JSON object: its `[` and `]`, and each element's span.
#[derive(Debug, PartialEq, Eq)]
struct Messages {
    open: usize,
    close: usize,
    spans: Vec<(usize, usize)>,
}

/// `body`'s messages, scanned from the start, or (`resume` = `(open, at)`) from `at`, the end
/// of an element of the array opened at `open` (the body up to `at` known to hold that array's
/// earlier elements): then only the elements after `at` are returned. None: not an object with
/// one `"messages"` array, or not readable here.
fn scan(body: &[u8], resume: Option<(usize, usize)>) -> Option<Messages> {
    let mut s = Scanner { body, at: 0 };
    let mut found = None;
    if let Some((open, at)) = resume {
        if open >= at || at > body.len() || body.get(open) != Some(&b'[') {
            return None;
        }
        s.at = at;
        found = Some(s.elements_after(open, Vec::new())?);
    } else {
        s.ws();
        s.eat(b'{')?;
        s.ws();
        if s.peek() == Some(b'}') {
            return None; // no messages
        }
        while !s.member(&mut found)? {}
        return s.end().then_some(found).flatten();
    }
    // Resumed inside the array: the rest of the top-level object follows it.
    s.ws();
    match s.next()? {
        b'}' => {}
        b',' => while !s.member(&mut found)? {},
        _ => return None,
    }
    s.end().then_some(found).flatten()
}

struct Scanner<'a> {
    body: &'a [u8],
    at: usize,
}

impl Scanner<'_> {
    fn peek(&self) -> Option<u8> {
        self.body.get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.at += 1;
        Some(b)
    }

    fn eat(&mut self, want: u8) -> Option<()> {
        (self.next()? == want).then_some(())
    }

    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// Only whitespace is left.
    fn end(&mut self) -> bool {
        self.ws();
        self.at == self.body.len()
    }

    /// One `"key": value` of the top-level object, then its `,` or `}` (true: that was the
    /// `}`). The `"messages"` array is recorded in `found` (a second one: None).
    fn member(&mut self, found: &mut Option<Messages>) -> Option<bool> {
        self.ws();
        let key_start = self.at + 1;
        self.string()?;
        let key = &self.body[key_start..self.at - 1];
        if key.contains(&b'\\') {
            return None; // an escaped key may spell "messages": not comparable as bytes
        }
        self.ws();
        self.eat(b':')?;
        self.ws();
        if key == b"messages" {
            if found.is_some() || self.peek() != Some(b'[') {
                return None;
            }
            let open = self.at;
            self.at += 1;
            self.ws();
            *found = Some(if self.peek() == Some(b']') {
                self.at += 1;
                Messages {
                    open,
                    close: self.at - 1,
                    spans: Vec::new(),
                }
            } else {
                let start = self.at;
                self.value()?;
                self.elements_after(open, vec![(start, self.at)])?
            });
        } else {
            self.value()?;
        }
        self.ws();
        match self.next()? {
            b',' => Some(false),
            b'}' => Some(true),
            _ => None,
        }
    }

    /// The elements after the one that ended at `self.at`, to the array's `]`.
    fn elements_after(&mut self, open: usize, mut spans: Vec<(usize, usize)>) -> Option<Messages> {
        loop {
            self.ws();
            match self.next()? {
                b']' => {
                    return Some(Messages {
                        open,
                        close: self.at - 1,
                        spans,
                    })
                }
                b',' => {
                    self.ws();
                    let start = self.at;
                    if self.peek() == Some(b']') {
                        return None; // a trailing comma
                    }
                    self.value()?;
                    spans.push((start, self.at));
                }
                _ => return None,
            }
        }
    }

    /// Past one value (its literals are not checked: a parser reads them).
    fn value(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.string(),
            b'{' | b'[' => self.nested(),
            b'}' | b']' | b',' | b':' => None,
            _ => {
                let start = self.at;
                while let Some(b) = self.peek() {
                    if matches!(b, b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r') {
                        break;
                    }
                    self.at += 1;
                }
                (self.at > start).then_some(())
            }
        }
    }

    /// Past a string, from its opening quote.
    fn string(&mut self) -> Option<()> {
        if self.peek() != Some(b'"') {
            return None;
        }
        self.at += 1;
        loop {
            let i = memchr::memchr2(b'"', b'\\', &self.body[self.at..])?;
            self.at += i + 1;
            if self.body[self.at - 1] == b'"' {
                return Some(());
            }
            self.at += 1; // the escaped byte (a quote or a backslash included)
        }
    }

    /// Past an object or array, from its opening bracket: brackets counted outside strings.
    fn nested(&mut self) -> Option<()> {
        let mut depth: Vec<u8> = Vec::new();
        loop {
            match self.peek()? {
                b'"' => {
                    self.string()?;
                    continue;
                }
                b @ (b'{' | b'[') => depth.push(if b == b'{' { b'}' } else { b']' }),
                b @ (b'}' | b']') => {
                    if depth.pop()? != b {
                        return None;
                    }
                    if depth.is_empty() {
                        self.at += 1;
                        return Some(());
                    }
                }
                _ => {}
            }
            self.at += 1;
        }
    }
}

/// `message_spans`' answer: the array's `[` and `]`, and each element's `[start, end)`.
type Found = (usize, usize, Vec<(usize, usize)>);

/// The top-level `"messages"` array of a chat request body: `(open, close, spans)`, the
/// offsets of its `[` and `]` and the `[start, end)` span of each element; or None where the
/// body is not an object with exactly one such array, or it cannot be read without decoding
/// (a key with an escape). With `resume=(open, at)`, the body is known to hold, up to `at`,
/// the array opened at `open` through one of its elements, which ends at `at`: the scan starts
/// there and returns only the elements after it. Nothing is validated: decode the body too.
#[pyfunction]
#[pyo3(signature = (body, resume = None))]
pub fn message_spans(
    py: Python<'_>,
    body: &Bound<'_, PyBytes>,
    resume: Option<(usize, usize)>,
) -> Option<Found> {
    let body = body.as_bytes();
    let scanned = if body.len() > 1 << 16 {
        py.detach(|| scan(body, resume))
    } else {
        scan(body, resume)
    };
    scanned.map(|m| (m.open, m.close, m.spans))
}

/// Bytes `a` and `b` start with in common.
#[pyfunction]
pub fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    const STEP: usize = 256;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + STEP <= n && a[i..i + STEP] == b[i..i + STEP] {
        i += STEP;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spans(body: &str) -> Option<Vec<&str>> {
        scan(body.as_bytes(), None).map(|m| m.spans.iter().map(|&(a, b)| &body[a..b]).collect())
    }

    #[test]
    fn finds_each_message() {
        let body = r#"{"model": "m", "messages": [{"role":"user","content":"a \"}] b"}, {"x": [1, {"y": "\\"}]} ,3], "n": {"messages": 1}}"#;
        assert_eq!(
            spans(body).unwrap(),
            vec![
                r#"{"role":"user","content":"a \"}] b"}"#,
                r#"{"x": [1, {"y": "\\"}]}"#,
                "3"
            ]
        );
        assert_eq!(
            spans(r#" { "messages" : [ ] } "#).unwrap(),
            Vec::<&str>::new()
        );
    }

    #[test]
    fn turns_down_what_it_cannot_read() {
        for body in [
            r#"{"messages": [1], "messages": [2]}"#,
            r#"{"messag\u0065s": [1], "messages": [2]}"#,
            r#"{"messages": [1,]}"#,
            r#"{"messages": [1 2]}"#,
            r#"{"messages": {"a": 1}}"#,
            r#"{"messages": [{"a": 1]}"#,
            r#"{"messages": [1]} x"#,
            r#"{"model": "m"}"#,
            "[1]",
            r#"{"messages": ["abc]}"#,
        ] {
            assert_eq!(spans(body), None, "{body}");
        }
    }

    #[test]
    fn resumes_after_a_kept_element() {
        let body = r#"{"a": 1, "messages": [{"k": 1}, {"k": 2}, {"k": 3}], "z": [true], "y": 0}"#;
        let all = scan(body.as_bytes(), None).unwrap();
        let at = all.spans[0].1;
        let rest = scan(body.as_bytes(), Some((all.open, at))).unwrap();
        assert_eq!(rest.spans, all.spans[1..]);
        assert_eq!((rest.open, rest.close), (all.open, all.close));
        let last = all.spans[2].1;
        assert_eq!(
            scan(body.as_bytes(), Some((all.open, last))).unwrap().spans,
            vec![]
        );
        assert_eq!(scan(body.as_bytes(), Some((all.open, 3))), None); // not after an element
    }

    #[test]
    fn common_prefix_counts_equal_leading_bytes() {
        let a = vec![7u8; 1000];
        let mut b = a.clone();
        assert_eq!(common_prefix(&a, &b), 1000);
        b[700] = 0;
        assert_eq!(common_prefix(&a, &b), 700);
        assert_eq!(common_prefix(&a[..10], &b), 10);
        assert_eq!(common_prefix(b"", &b), 0);
    }
}
