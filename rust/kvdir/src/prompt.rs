//! `PagedPrompt`: a prompt's token ids, page digests and decimal text, kept per agent branch by
//! the router so that the next turn hashes and writes only what it adds.
//!
//! A prompt is a row of shared chunks of `CHUNK_TOKENS`-ish ids (`Arc`), each with the digests
//! of its pages and its ids' text, so that a turn that extends the last one shares every chunk
//! wholly before the cut and copies at most one (issue 29): a 100k-token prompt copied whole
//! into fresh buffers each turn was ~1.2 MB, ~0.5 ms of page faults on a router that maps its
//! large buffers afresh (`evolving_infra/malloc.py`); a chunk is small enough to come from the
//! allocator's reused pages. A fork's prompts share their parent's chunks the same way.

use std::sync::Arc;

use crate::hash::{check_page_size, hash_of, push_digests};
use crate::{common_prefix, BlockHash, Result};

/// About this many ids a chunk: ~16 KiB of ids and ~25 KiB of text, under both allocators'
/// large-buffer thresholds (`kvdir-py`'s `alloc.rs`, glibc's mmap threshold).
const CHUNK_TOKENS: usize = 4096;

/// A run of a prompt's ids, whole pages of them but for a prompt's last chunk.
#[derive(Debug, Default)]
struct Chunk {
    ids: Vec<u32>,
    /// The digest of each full page within `ids`.
    digests: Vec<[u8; 32]>,
    /// The ids in decimal, each after a comma: this chunk's part of the JSON array (the
    /// prompt's first comma is its `[`), so that chunks join with no separator between them.
    text: Vec<u8>,
}

impl Chunk {
    /// A copy of the first `n` ids (at most `ids.len()`), their full pages' digests and text.
    fn prefix(&self, n: usize, page_size: usize) -> Self {
        Self {
            ids: self.ids[..n].to_vec(),
            digests: self.digests[..n / page_size].to_vec(),
            text: self.text[..self.text_end(n)].to_vec(),
        }
    }

    /// Where the text of the first `n` ids ends: at the comma before id `n`, found from
    /// whichever end is nearer.
    fn text_end(&self, n: usize) -> usize {
        let len = self.ids.len();
        if n >= len {
            return self.text.len();
        }
        let commas = self.text.iter().enumerate().filter(|&(_, &b)| b == b',');
        let at = if n < len - n {
            commas.map(|(i, _)| i).nth(n)
        } else {
            // The comma before id `n` is the (len - n)th from the end.
            commas.map(|(i, _)| i).nth_back(len - n - 1)
        };
        at.expect("one comma before each id")
    }

    /// Appends `ids`: their text, and the digests of the pages they complete, chained from
    /// `prior` (the digest of the page before this chunk's first) while this chunk has none.
    fn push(&mut self, ids: &[u32], page_size: usize, prior: Option<&[u8; 32]>) {
        if ids.is_empty() {
            return;
        }
        let start = self.digests.len() * page_size;
        self.ids.extend_from_slice(ids);
        push_digests(&mut self.digests, prior, &self.ids[start..], page_size);
        let at = self.text.len();
        self.text.resize(at + digits_len(ids), b',');
        write_digits(ids, &mut self.text[at..]);
    }

    fn bytes(&self) -> usize {
        self.ids.len() * 4 + self.digests.len() * 32 + self.text.len()
    }
}

/// A prompt's token ids and the digests of its full pages, kept so that the next prompt of the
/// same agent branch hashes only what it adds: an agent re-sends its whole context every turn,
/// and at 100k tokens hashing it all again is ~0.9 ms of a router's CPU per request.
///
/// `new` compares the prompt with the one it follows token by token (the prefix is verified,
/// not assumed): the pages wholly inside their common prefix keep their digests, the rest are
/// hashed from the last one kept. The ids' decimal text (what the engines' JSON bodies carry)
/// is kept too and reused the same way: at 100k ids, writing it again was ~0.15-0.3 ms a
/// request. ~12 bytes a token at 16-token pages (ids 4, digests 2, text ~6), shared with the
/// prompts it follows and is followed by (see the module's note).
#[derive(Clone, Debug)]
pub struct PagedPrompt {
    page_size: usize,
    /// Ids a chunk holds (all but the last chunk are full): whole pages, ~`CHUNK_TOKENS`.
    chunk: usize,
    chunks: Vec<Arc<Chunk>>,
    len: usize,
    reused: usize,
}

impl PagedPrompt {
    /// `token_ids` paged by `page_size`, reusing what `after` (a prompt of the same page size)
    /// hashed for the pages both start with.
    pub fn new(token_ids: Vec<u32>, page_size: usize, after: Option<&PagedPrompt>) -> Result<Self> {
        check_page_size(page_size)?;
        Ok(match after.filter(|b| b.page_size == page_size) {
            Some(before) => {
                let reused = before.common_prefix(&token_ids);
                before.build(reused, &token_ids[reused..])
            }
            None => Self::empty(page_size).build(0, &token_ids),
        })
    }

    /// The first `keep` tokens of `before` (verified equal by the caller, as the router does for
    /// chat messages by their text), then `tail`: only the pages past the kept ones are hashed,
    /// and the ids are never compared.
    #[must_use]
    pub fn extend(before: &PagedPrompt, keep: usize, tail: &[u32]) -> Self {
        before.build(keep.min(before.len), tail)
    }

    fn empty(page_size: usize) -> Self {
        Self {
            page_size,
            chunk: page_size * CHUNK_TOKENS.div_ceil(page_size),
            chunks: Vec::new(),
            len: 0,
            reused: 0,
        }
    }

    /// Tokens `ids` starts with in common with this prompt, compared chunk by chunk.
    fn common_prefix(&self, ids: &[u32]) -> usize {
        let mut at = 0;
        for c in &self.chunks {
            let n = common_prefix(&c.ids, &ids[at.min(ids.len())..]);
            at += n;
            if n < c.ids.len() {
                break;
            }
        }
        at
    }

    /// This prompt's first `reused` ids, then `rest`: the chunks wholly inside the first are
    /// shared, the one the cut falls in copied up to it, and `rest` paged and written after.
    fn build(&self, reused: usize, rest: &[u32]) -> Self {
        let (page, size) = (self.page_size, self.chunk);
        let whole = reused / size;
        let mut chunks: Vec<Arc<Chunk>> = Vec::with_capacity((reused + rest.len()).div_ceil(size));
        chunks.extend(self.chunks[..whole].iter().cloned());
        let mut open = match reused % size {
            0 => Chunk::default(),
            cut => self.chunks[whole].prefix(cut, page),
        };
        let len = reused + rest.len();
        let mut rest = rest;
        while !rest.is_empty() {
            let take = (size - open.ids.len()).min(rest.len());
            let prior = chunks.last().and_then(|c| c.digests.last());
            open.ids.reserve_exact(take);
            open.push(&rest[..take], page, prior);
            rest = &rest[take..];
            if open.ids.len() == size {
                chunks.push(Arc::new(std::mem::take(&mut open)));
            }
        }
        if !open.ids.is_empty() {
            chunks.push(Arc::new(open));
        }
        Self {
            page_size: page,
            chunk: size,
            chunks,
            len,
            reused,
        }
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
        let text: usize = self.chunks.iter().map(|c| c.text.len()).sum();
        // The first comma is the `[`; `[]` without one.
        text + 2 - usize::from(text > 0)
    }

    /// Writes `json`'s text into `out`, which is `json_len` bytes long (so that a caller can
    /// write it straight into a request body).
    ///
    /// # Panics
    /// When `out` is not `json_len` bytes long.
    pub fn write_json(&self, out: &mut [u8]) {
        assert_eq!(
            out.len(),
            self.json_len(),
            "write_json: out must be json_len bytes"
        );
        out[0] = b'[';
        let mut at = 1;
        for piece in self.text() {
            let text = piece.as_bytes();
            out[at..at + text.len()].copy_from_slice(text);
            at += text.len();
        }
        out[at] = b']';
    }

    /// The text between `json`'s brackets as it is kept, one piece a chunk, each holding its
    /// chunk (a body can be sent as `[`, these, `]`: no buffer the size of the prompt).
    pub fn text(&self) -> impl Iterator<Item = Text> + '_ {
        self.chunks.iter().enumerate().map(|(i, c)| Text {
            chunk: Arc::clone(c),
            // The prompt's first comma is not part of the array's text.
            skip: usize::from(i == 0),
        })
    }

    /// The block hash of every full page.
    pub fn hashes(&self) -> impl Iterator<Item = BlockHash> + '_ {
        self.chunks
            .iter()
            .flat_map(|c| c.digests.iter().map(hash_of))
    }

    /// Full pages (`hashes`' count).
    #[must_use]
    pub fn pages(&self) -> usize {
        self.len / self.page_size
    }

    /// The prompt's token ids, in order.
    pub fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.chunks.iter().flat_map(|c| c.ids.iter().copied())
    }

    /// The id at `index`, if the prompt is longer.
    #[must_use]
    pub fn get(&self, index: usize) -> Option<u32> {
        let c = self.chunks.get(index / self.chunk)?;
        c.ids.get(index % self.chunk).copied()
    }

    /// Tokens in the prompt.
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the prompt has no tokens.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
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

    /// Bytes held: 4 a token, 32 a page, and the text (shared chunks counted in every prompt
    /// that holds them).
    #[must_use]
    pub fn bytes(&self) -> usize {
        self.chunks.iter().map(|c| c.bytes()).sum()
    }
}

/// A chunk's text (`PagedPrompt::text`), kept alive by this handle; chunks never change once
/// shared.
#[derive(Clone, Debug)]
pub struct Text {
    chunk: Arc<Chunk>,
    skip: usize,
}

impl Text {
    /// The text.
    #[must_use]
    pub fn as_bytes(&self) -> &[u8] {
        &self.chunk.text[self.skip..]
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
    digits + ids.len()
}

/// `ids` in decimal, each after a comma, into `out` (exactly `digits_len(ids)` bytes). Ids below
/// `DIGITS_TABLE` (every vocabulary's most common ones) are copied from a table of their digits
/// 8 bytes at a time (~2x `itoa` per id), but the last few, where 8 bytes would run past
/// `out`, by their length.
fn write_digits(ids: &[u32], out: &mut [u8]) {
    let table = digits_table();
    let mut digits = itoa::Buffer::new();
    let end = out.len();
    let mut at = 0;
    for &t in ids {
        out[at] = b',';
        at += 1;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::block_hashes;
    use proptest::prelude::*;

    fn ids(p: &PagedPrompt) -> Vec<u32> {
        p.ids().collect()
    }

    fn hashes(p: &PagedPrompt) -> Vec<BlockHash> {
        p.hashes().collect()
    }

    #[test]
    fn a_paged_prompt_hashes_as_block_hashes_reusing_the_common_prefix() {
        let first: Vec<u32> = (0..1000).collect();
        let a = PagedPrompt::new(first.clone(), 16, None).unwrap();
        assert_eq!(hashes(&a), block_hashes(&first, 16).unwrap());
        assert_eq!(a.reused(), 0);
        // The next turn: the same 1000 tokens, 500 more; then one that diverges at 203.
        let second: Vec<u32> = (0..1500).collect();
        let b = PagedPrompt::new(second.clone(), 16, Some(&a)).unwrap();
        assert_eq!(b.reused(), 1000);
        assert_eq!(hashes(&b), block_hashes(&second, 16).unwrap());
        let mut third = second.clone();
        third[203] = 7;
        let c = PagedPrompt::new(third.clone(), 16, Some(&b)).unwrap();
        assert_eq!(c.reused(), 203);
        assert_eq!(hashes(&c), block_hashes(&third, 16).unwrap());
        // Shorter than the one before, or paged otherwise: still the prompt's own hashes.
        let d = PagedPrompt::new(first[..40].to_vec(), 16, Some(&c)).unwrap();
        assert_eq!((d.reused(), d.pages()), (40, 2));
        let e = PagedPrompt::new(second.clone(), 32, Some(&b)).unwrap();
        assert_eq!(e.reused(), 0);
        assert_eq!(hashes(&e), block_hashes(&second, 32).unwrap());
        // The text: every id after a comma (the first comma is the `[` of `json`).
        assert_eq!(b.bytes(), 1500 * 4 + 93 * 32 + b.json_len() - 1);
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
            assert_eq!(ids(&b), want);
            assert_eq!(b.reused(), keep.min(1000));
            assert_eq!(hashes(&b), block_hashes(&want, 16).unwrap());
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
    fn turns_share_the_chunks_before_the_cut() {
        // A 20k-token context, then a turn that keeps all but its last 3 ids and adds 500.
        let a = PagedPrompt::new((0..20_000).collect(), 16, None).unwrap();
        let b = PagedPrompt::extend(&a, 19_997, &[1; 500]);
        let shared = a
            .chunks
            .iter()
            .zip(&b.chunks)
            .take_while(|(x, y)| Arc::ptr_eq(x, y))
            .count();
        assert_eq!(
            shared,
            19_997 / a.chunk,
            "every chunk wholly kept is shared"
        );
        assert_eq!(b.get(19_996), Some(19_996));
        assert_eq!(b.get(19_997), Some(1));
        assert_eq!(b.get(20_497), None);
    }

    /// A prompt built from scratch: what every chain of `new` and `extend` must equal.
    fn check(p: &PagedPrompt, want: &[u32], page: usize) {
        assert_eq!(ids(p), want);
        assert_eq!(p.len(), want.len());
        assert_eq!(hashes(p), block_hashes(want, page).unwrap());
        assert_eq!(p.pages(), want.len() / page);
        let text: Vec<String> = want.iter().map(u32::to_string).collect();
        assert_eq!(p.json(), format!("[{}]", text.join(",")).into_bytes());
        let mut pieces = b"[".to_vec();
        for t in p.text() {
            pieces.extend_from_slice(t.as_bytes());
        }
        pieces.push(b']');
        assert_eq!(pieces, p.json());
        let chunked = p.chunks.iter().all(|c| c.ids.len() <= p.chunk);
        assert!(chunked && p.chunk % page == 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn chains_of_turns_equal_whole_prompts(
            page in prop::sample::select(vec![1usize, 3, 16, 64, 5000]),
            first in 0usize..12_000,
            turns in prop::collection::vec((0usize..13_000, 0usize..5000, any::<bool>()), 1..6),
        ) {
            let id = |i: usize| u32::try_from((i * 2_654_435_761) % 200_003).unwrap();
            let mut want: Vec<u32> = (0..first).map(id).collect();
            let mut p = PagedPrompt::new(want.clone(), page, None).unwrap();
            check(&p, &want, page);
            for (n, (keep, added, by_ids)) in turns.into_iter().enumerate() {
                let keep = keep.min(want.len());
                want.truncate(keep);
                want.extend((0..added).map(|i| id(i + 7 * n + 1)));
                p = if by_ids {
                    PagedPrompt::new(want.clone(), page, Some(&p)).unwrap()
                } else {
                    PagedPrompt::extend(&p, keep, &want[keep..])
                };
                prop_assert!(p.reused() >= keep);
                check(&p, &want, page);
            }
        }
    }
}
