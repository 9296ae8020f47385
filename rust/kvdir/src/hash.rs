//! SGLang 0.5.23 page hashes (`mem_cache/utils.py`: `get_hash_str`, `hash_str_to_int64`).
//!
//! `digest_i = sha256(digest_{i-1} || token_0 || …)`, each token as 4 little-endian bytes, no
//! prefix for the first page; the block hash is the first 8 bytes of `digest_i` read big-endian
//! (the first 16 hex digits) as a two's-complement `i64`. A partial trailing page has no hash.

use sha2::{Digest, Sha256};

use crate::{BlockHash, Error, Result};

/// Page hashes of every full page of `token_ids`, exactly as SGLang 0.5.23 computes them.
pub fn block_hashes(token_ids: &[u32], page_size: usize) -> Result<Vec<BlockHash>> {
    check_page_size(page_size)?;
    let mut digests = Vec::with_capacity(token_ids.len() / page_size);
    push_digests(&mut digests, token_ids, page_size);
    Ok(digests.iter().map(hash_of).collect())
}

fn check_page_size(page_size: usize) -> Result<()> {
    if page_size == 0 {
        return Err(Error::invalid("page_size", "must be at least 1"));
    }
    Ok(())
}

/// Appends the digests of the full pages of `tokens`, chained from the last digest already in
/// `digests` (none: the first page of a prompt).
fn push_digests(digests: &mut Vec<[u8; 32]>, tokens: &[u32], page_size: usize) {
    for page in tokens.chunks_exact(page_size) {
        let mut hasher = Sha256::new();
        if let Some(prior) = digests.last() {
            hasher.update(prior);
        }
        for &t in page {
            hasher.update(t.to_le_bytes());
        }
        digests.push(hasher.finalize().into());
    }
}

/// A digest's block hash: its first 8 bytes read big-endian.
fn hash_of(digest: &[u8; 32]) -> BlockHash {
    let mut head = [0u8; 8];
    head.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(head) as i64
}

/// A prompt's token ids and the digests of its full pages, kept so that the next prompt of the
/// same agent branch hashes only what it adds: an agent re-sends its whole context every turn,
/// and at 100k tokens hashing it all again is ~0.9 ms of a router's CPU per request.
///
/// `new` compares the prompt with the one it follows token by token (the prefix is verified,
/// not assumed): the pages wholly inside their common prefix keep their digests, the rest are
/// hashed from the last one kept. The ids' decimal text (what the engines' JSON bodies carry)
/// is kept too and reused the same way: at 100k ids, writing it again was ~0.15-0.3 ms a
/// request, more than the rest of a warm turn's cost that grows with the context. ~12 bytes a
/// token at 16-token pages (ids 4, digests 2, text ~6).
#[derive(Clone, Debug)]
pub struct PagedPrompt {
    page_size: usize,
    ids: Vec<u32>,
    digests: Vec<[u8; 32]>,
    reused: usize,
    /// The ids in decimal, comma-separated: the JSON array without its brackets.
    text: Vec<u8>,
}

impl PagedPrompt {
    /// `token_ids` paged by `page_size`, reusing what `after` (a prompt of the same page size)
    /// hashed for the pages both start with.
    pub fn new(token_ids: Vec<u32>, page_size: usize, after: Option<&PagedPrompt>) -> Result<Self> {
        check_page_size(page_size)?;
        Ok(match after.filter(|b| b.page_size == page_size) {
            Some(before) => {
                let reused = common_prefix(&before.ids, &token_ids);
                Self::paged(token_ids, page_size, before, reused)
            }
            None => Self::paged(token_ids, page_size, &Self::empty(page_size), 0),
        })
    }

    /// The first `keep` tokens of `before` (verified equal by the caller, as the router does for
    /// chat messages by their text), then `tail`: only the pages past the kept ones are hashed,
    /// and the ids are never compared.
    #[must_use]
    pub fn extend(before: &PagedPrompt, keep: usize, tail: &[u32]) -> Self {
        let keep = keep.min(before.ids.len());
        let mut ids = Vec::with_capacity(keep + tail.len());
        ids.extend_from_slice(&before.ids[..keep]);
        ids.extend_from_slice(tail);
        Self::paged(ids, before.page_size, before, keep)
    }

    fn empty(page_size: usize) -> Self {
        Self {
            page_size,
            ids: Vec::new(),
            digests: Vec::new(),
            reused: 0,
            text: Vec::new(),
        }
    }

    /// `ids`, whose first `reused` tokens are `before`'s: the digests of the pages wholly
    /// inside them and their text are kept, the rest hashed from the last digest and written.
    fn paged(ids: Vec<u32>, page_size: usize, before: &PagedPrompt, reused: usize) -> Self {
        let mut digests = Vec::with_capacity(ids.len() / page_size);
        digests.extend_from_slice(&before.digests[..reused / page_size]);
        let start = digests.len() * page_size;
        push_digests(&mut digests, &ids[start..], page_size);
        let head = &before.text[..before.text_end(reused)];
        let new = &ids[reused..];
        let comma = usize::from(reused > 0 && !new.is_empty());
        let len = head.len() + comma + digits_len(new);
        let mut text = Vec::with_capacity(len);
        text.extend_from_slice(head);
        if comma == 1 {
            text.push(b',');
        }
        let at = text.len();
        // To `len`, not the capacity: an allocator may give more, which would be text.
        text.resize(len, 0);
        write_digits(new, &mut text[at..]);
        Self {
            page_size,
            ids,
            digests,
            reused,
            text,
        }
    }

    /// Where the text of the first `tokens` ids ends: at the comma after the last of them,
    /// found from whichever end is nearer (a next turn keeps all but a few tokens).
    fn text_end(&self, tokens: usize) -> usize {
        let n = self.ids.len();
        if tokens >= n {
            return self.text.len();
        }
        if tokens == 0 {
            return 0;
        }
        let commas = self.text.iter().enumerate().filter(|&(_, &b)| b == b',');
        let at = if tokens <= n - tokens {
            commas.map(|(i, _)| i).nth(tokens - 1)
        } else {
            // The comma after id `tokens - 1` is the (n - tokens)th from the end.
            commas.map(|(i, _)| i).nth_back(n - tokens - 1)
        };
        at.expect("one comma between each two ids")
    }

    /// The ids as the text of a JSON array without spaces (what SGLang's `input_ids` takes).
    #[must_use]
    pub fn json(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.json_len()];
        self.write_json(&mut out);
        out
    }

    /// Bytes of `json`'s text.
    #[must_use]
    pub fn json_len(&self) -> usize {
        self.text.len() + 2
    }

    /// Writes `json`'s text into `out`, which is `json_len` bytes long (so that a caller can
    /// write it straight into a request body: at 100k ids a scratch buffer and its copy cost
    /// as much again).
    ///
    /// # Panics
    /// When `out` is not `json_len` bytes long.
    pub fn write_json(&self, out: &mut [u8]) {
        assert_eq!(
            out.len(),
            self.json_len(),
            "write_json: out must be json_len bytes"
        );
        let end = out.len() - 1;
        out[0] = b'[';
        out[1..end].copy_from_slice(&self.text);
        out[end] = b']';
    }

    /// The block hash of every full page.
    pub fn hashes(&self) -> impl ExactSizeIterator<Item = BlockHash> + '_ {
        self.digests.iter().map(hash_of)
    }

    /// The prompt's token ids.
    #[must_use]
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Tokens a page.
    #[must_use]
    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Tokens this prompt shares with the one it followed, from the start (0 without one).
    #[must_use]
    pub fn reused(&self) -> usize {
        self.reused
    }

    /// Bytes held: 4 a token, 32 a page, and the text.
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.ids.len() * 4 + self.digests.len() * 32 + self.text.len()
    }
}

/// Ids with a precomputed decimal text (`PagedPrompt::json`): 128k covers most vocabularies.
const DIGITS_TABLE: usize = 1 << 17;

/// Each id below `DIGITS_TABLE` as up to 7 digit bytes, its digit count in the 8th.
fn digits_table() -> &'static [[u8; 8]] {
    static TABLE: std::sync::OnceLock<Vec<[u8; 8]>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        let mut digits = itoa::Buffer::new();
        (0..DIGITS_TABLE)
            .map(|t| {
                let text = digits.format(t).as_bytes();
                let mut entry = [0u8; 8];
                entry[..text.len()].copy_from_slice(text);
                entry[7] = u8::try_from(text.len()).expect("at most 6 digits");
                entry
            })
            .collect()
    })
}

/// Decimal digits of `t`.
fn decimal_len(t: u32) -> usize {
    t.checked_ilog10().map_or(1, |d| d as usize + 1)
}

/// Bytes of `write_digits`' text of `ids`.
fn digits_len(ids: &[u32]) -> usize {
    let table = digits_table();
    let digits: usize = ids
        .iter()
        .map(|&t| match table.get(t as usize) {
            Some(entry) => usize::from(entry[7]),
            None => decimal_len(t),
        })
        .sum();
    digits + ids.len().saturating_sub(1)
}

/// `ids` in decimal, comma-separated, into `out` (exactly `digits_len(ids)` bytes). Ids below
/// `DIGITS_TABLE` (every vocabulary's most common ones) are copied from a table of their digits
/// 8 bytes at a time (~2x `itoa` per id), but the last few, where 8 bytes would run past
/// `out`, by their length.
fn write_digits(ids: &[u32], out: &mut [u8]) {
    let table = digits_table();
    let mut digits = itoa::Buffer::new();
    let end = out.len();
    let mut at = 0;
    for (i, &t) in ids.iter().enumerate() {
        if i > 0 {
            out[at] = b',';
            at += 1;
        }
        if let Some(entry) = table.get(t as usize) {
            let len = usize::from(entry[7]);
            if at + 8 <= end {
                out[at..at + 8].copy_from_slice(entry);
            } else {
                out[at..at + len].copy_from_slice(&entry[..len]);
            }
            at += len;
        } else {
            let text = digits.format(t).as_bytes();
            out[at..at + text.len()].copy_from_slice(text);
            at += text.len();
        }
    }
    debug_assert_eq!(at, end, "write_digits: out must be digits_len bytes");
}

/// Length of the common prefix of `a` and `b`, compared 256 bytes at a time (a slice compare
/// the compiler turns into `memcmp`), then item by item.
pub fn common_prefix<T: PartialEq>(a: &[T], b: &[T]) -> usize {
    let step = (256 / std::mem::size_of::<T>()).max(1);
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + step <= n && a[i..i + step] == b[i..i + step] {
        i += step;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

/// The chain of trace block hashes `evolving_infra.workloads.blocks.chain_from` defines:
/// `digest_i = blake2b(digest_{i-1} || id_i)` with an 8-byte digest and `person`, `digest_{-1}`
/// being `seed` and each id 8 little-endian bytes; a hash is its digest read as a little-endian
/// `i64`. (The simulator hashes every new prompt block of its traces: ~3.5 µs a block in
/// Python, a few hundred ns here.)
pub fn trace_chain(seed: &[u8], ids: &[i64], person: &[u8]) -> Result<Vec<BlockHash>> {
    if person.len() > blake2b_simd::PERSONALBYTES {
        return Err(Error::invalid("person", "at most 16 bytes"));
    }
    let mut params = blake2b_simd::Params::new();
    params.hash_length(8).personal(person);
    let mut out = Vec::with_capacity(ids.len());
    let mut digest = [0u8; 8];
    for (i, id) in ids.iter().enumerate() {
        let mut state = params.to_state();
        state.update(if i == 0 { seed } else { &digest });
        state.update(&id.to_le_bytes());
        digest.copy_from_slice(state.finalize().as_bytes());
        out.push(i64::from_le_bytes(digest));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trace_chain_continues_from_its_last_hash() {
        let all = trace_chain(b"seed", &[1, 2, 3, 4], b"p").unwrap();
        let head = trace_chain(b"seed", &[1, 2], b"p").unwrap();
        let tail = trace_chain(&head[1].to_le_bytes(), &[3, 4], b"p").unwrap();
        assert_eq!(all, [head, tail].concat());
        assert_ne!(all, trace_chain(b"seed", &[1, 2, 3, 4], b"q").unwrap());
        assert!(trace_chain(b"seed", &[], b"p").unwrap().is_empty());
        assert!(trace_chain(b"seed", &[1], &[0; 17]).is_err());
    }

    #[test]
    fn partial_page_has_no_hash() {
        assert_eq!(block_hashes(&[1, 2, 3], 4).unwrap(), Vec::<i64>::new());
        assert_eq!(block_hashes(&[1, 2, 3, 4, 5], 4).unwrap().len(), 1);
    }

    #[test]
    fn chained_prefix_is_stable() {
        let a = block_hashes(&[1, 2, 3, 4, 5, 6, 7, 8], 4).unwrap();
        let b = block_hashes(&[1, 2, 3, 4, 9, 9, 9, 9], 4).unwrap();
        assert_eq!(a[0], b[0]);
        assert_ne!(a[1], b[1]);
    }

    #[test]
    fn a_paged_prompt_hashes_as_block_hashes_reusing_the_common_prefix() {
        let first: Vec<u32> = (0..1000).collect();
        let a = PagedPrompt::new(first.clone(), 16, None).unwrap();
        assert_eq!(
            a.hashes().collect::<Vec<_>>(),
            block_hashes(&first, 16).unwrap()
        );
        assert_eq!(a.reused(), 0);
        // The next turn: the same 1000 tokens, 500 more; then one that diverges at 203.
        let second: Vec<u32> = (0..1500).collect();
        let b = PagedPrompt::new(second.clone(), 16, Some(&a)).unwrap();
        assert_eq!(b.reused(), 1000);
        assert_eq!(
            b.hashes().collect::<Vec<_>>(),
            block_hashes(&second, 16).unwrap()
        );
        let mut third = second.clone();
        third[203] = 7;
        let c = PagedPrompt::new(third.clone(), 16, Some(&b)).unwrap();
        assert_eq!(c.reused(), 203);
        assert_eq!(
            c.hashes().collect::<Vec<_>>(),
            block_hashes(&third, 16).unwrap()
        );
        // Shorter than the one before, or paged otherwise: still the prompt's own hashes.
        let d = PagedPrompt::new(first[..40].to_vec(), 16, Some(&c)).unwrap();
        assert_eq!((d.reused(), d.hashes().len()), (40, 2));
        let e = PagedPrompt::new(second.clone(), 32, Some(&b)).unwrap();
        assert_eq!(e.reused(), 0);
        assert_eq!(
            e.hashes().collect::<Vec<_>>(),
            block_hashes(&second, 32).unwrap()
        );
        assert_eq!(b.bytes(), 1500 * 4 + 93 * 32 + b.json_len() - 2);
        assert!(PagedPrompt::new(first, 0, None).is_err());
    }

    #[test]
    fn an_extended_prompt_keeps_the_pages_before_the_cut() {
        let first: Vec<u32> = (0..1000).collect();
        let a = PagedPrompt::new(first.clone(), 16, None).unwrap();
        for keep in [0, 1, 15, 16, 17, 999, 1000, 5000] {
            let b = PagedPrompt::extend(&a, keep, &[7; 40]);
            let mut want = first[..keep.min(1000)].to_vec();
            want.extend([7; 40]);
            assert_eq!(b.ids(), want);
            assert_eq!(b.reused(), keep.min(1000));
            assert_eq!(
                b.hashes().collect::<Vec<_>>(),
                block_hashes(&want, 16).unwrap()
            );
        }
    }

    #[test]
    fn json_is_the_ids_array() {
        let ids = vec![0, 7, 10, 99, 131_071, 131_072, 999_999, 4_294_967_295, 5];
        let p = PagedPrompt::new(ids, 4, None).unwrap();
        assert_eq!(p.json(), b"[0,7,10,99,131071,131072,999999,4294967295,5]");
        assert_eq!(PagedPrompt::new(vec![], 4, None).unwrap().json(), b"[]");
    }

    #[test]
    fn kept_text_is_the_whole_prompts() {
        let ids: Vec<u32> = (0..200).map(|i| (i * 7919) % 150_000).collect();
        let whole = |ids: &[u32]| PagedPrompt::new(ids.to_vec(), 4, None).unwrap().json();
        let p = PagedPrompt::new(ids.clone(), 4, None).unwrap();
        for keep in [0, 1, 2, 99, 100, 101, 198, 199, 200] {
            for tail in [&[][..], &[5][..], &[123_456, 0, 131_072][..]] {
                let e = PagedPrompt::extend(&p, keep, tail);
                let expect: Vec<u32> = ids[..keep].iter().chain(tail).copied().collect();
                assert_eq!(e.json(), whole(&expect), "keep {keep} tail {tail:?}");
                let n = PagedPrompt::new(expect.clone(), 4, Some(&p)).unwrap();
                assert_eq!(
                    n.json(),
                    whole(&expect),
                    "new after, keep {keep} tail {tail:?}"
                );
            }
        }
    }

    #[test]
    fn common_prefix_finds_the_first_difference_anywhere() {
        let a: Vec<u32> = (0..300).collect();
        for at in [0, 1, 63, 64, 65, 127, 128, 250, 299] {
            let mut b = a.clone();
            b[at] += 1;
            assert_eq!(common_prefix(&a, &b), at);
        }
        assert_eq!(common_prefix(&a, &a[..130]), 130);
        assert_eq!(common_prefix(&a, &[]), 0);
    }

    #[test]
    fn zero_page_size_is_refused() {
        assert!(matches!(
            block_hashes(&[1], 0),
            Err(Error::InvalidArgument {
                argument: "page_size",
                ..
            })
        ));
    }
}
