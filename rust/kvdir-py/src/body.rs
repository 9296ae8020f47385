//! Where a request's context lies in its JSON body (a chat request's `"messages"`, a
//! completion's `"prompt"` of token ids), so that the router decodes only what a turn adds
//! (`evolving_infra.router.bodies`).
//!
//! An agent re-sends its whole context every turn: at 100k tokens the body is ~400-600 KB of
//! JSON, and decoding it was the largest cost left in the router once nothing was tokenized
//! again. `array_spans` finds a top-level array and the byte span of each of its elements
//! without decoding anything (string contents are skipped with `memchr`); the router compares
//! the new body with the branch's last one, byte for byte, and decodes only what follows the
//! elements both share. It does not validate JSON: every byte it points at was, or is then,
//! decoded by a real parser; it only has to find the boundaries of valid JSON and turn down
//! anything it cannot read unambiguously (a key with an escape, the key twice).

use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A top-level array of a JSON object: its `[` and `]`, and each element's span (when asked).
#[derive(Debug, PartialEq, Eq)]
struct Array {
    open: usize,
    close: usize,
    spans: Vec<(usize, usize)>,
}

/// The array under `key` of the object `body`, scanned from the start, or (`resume` =
/// `(open, at)`) from `at`, the end of an element of the array opened at `open` (the body up to
/// `at` known to hold that array's earlier elements): then only the elements after `at` are
/// returned. Spans are recorded only with `record`. None: not an object with one such array,
/// or not readable here.
fn scan(body: &[u8], key: &[u8], resume: Option<(usize, usize)>, record: bool) -> Option<Array> {
    let mut s = Scanner {
        body,
        at: 0,
        key,
        record,
    };
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
            return None; // no array
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
    key: &'a [u8],
    record: bool,
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
    /// `}`). The array under `self.key` is recorded in `found` (a second one: None).
    fn member(&mut self, found: &mut Option<Array>) -> Option<bool> {
        self.ws();
        let key_start = self.at + 1;
        self.string()?;
        let key = &self.body[key_start..self.at - 1];
        if key.contains(&b'\\') {
            return None; // an escaped key may spell ours: not comparable as bytes
        }
        self.ws();
        self.eat(b':')?;
        self.ws();
        if key == self.key {
            if found.is_some() || self.peek() != Some(b'[') {
                return None;
            }
            let open = self.at;
            self.at += 1;
            self.ws();
            *found = Some(if self.peek() == Some(b']') {
                self.at += 1;
                Array {
                    open,
                    close: self.at - 1,
                    spans: Vec::new(),
                }
            } else {
                let start = self.at;
                self.value()?;
                let first = if self.record {
                    vec![(start, self.at)]
                } else {
                    Vec::new()
                };
                self.elements_after(open, first)?
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
    fn elements_after(&mut self, open: usize, mut spans: Vec<(usize, usize)>) -> Option<Array> {
        loop {
            self.ws();
            match self.next()? {
                b']' => {
                    return Some(Array {
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
                    if self.record {
                        spans.push((start, self.at));
                    }
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

/// `array_spans`' answer: the array's `[` and `]`, and each element's `[start, end)`.
type Found = (usize, usize, Vec<(usize, usize)>);

/// The top-level array under `key` of a request body: `(open, close, spans)`, the offsets of
/// its `[` and `]` and (with `spans`) the `[start, end)` span of each element; or None where
/// the body is not an object with exactly one such array, or it cannot be read without
/// decoding (a key with an escape). With `resume=(open, at)`, the body is known to hold, up to
/// `at`, the array opened at `open` through one of its elements, which ends at `at` (or the
/// comma after it begins there): the scan starts there and returns only the elements after it.
/// Nothing is validated: decode the body too.
#[pyfunction]
#[pyo3(signature = (body, key, resume = None, spans = true))]
pub fn array_spans(
    py: Python<'_>,
    body: &Bound<'_, PyBytes>,
    key: &str,
    resume: Option<(usize, usize)>,
    spans: bool,
) -> Option<Found> {
    let body = body.as_bytes();
    let key = key.as_bytes();
    let scanned = if body.len() > 1 << 16 {
        py.detach(|| scan(body, key, resume, spans))
    } else {
        scan(body, key, resume, spans)
    };
    scanned.map(|m| (m.open, m.close, m.spans))
}

/// Bytes `a` and `b` start with in common.
#[pyfunction]
pub fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    kvdir::common_prefix(a, b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scan(body: &[u8], resume: Option<(usize, usize)>) -> Option<Array> {
        super::scan(body, b"messages", resume, true)
    }

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
    fn another_key_and_no_spans() {
        let body = br#"{"messages": [1], "prompt": [5, 6 ,7], "n": 2}"#;
        let found = super::scan(body, b"prompt", None, false).unwrap();
        assert_eq!((found.open, found.close, found.spans), (28, 36, vec![]));
        // Resumed after the second id, or at the comma after it: the third is what follows.
        for at in [33, 34] {
            let rest = super::scan(body, b"prompt", Some((28, at)), true).unwrap();
            assert_eq!((rest.close, rest.spans), (36, vec![(35, 36)]));
        }
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
