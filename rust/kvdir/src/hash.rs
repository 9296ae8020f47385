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
    push_digests(&mut digests, None, token_ids, page_size);
    Ok(digests.iter().map(hash_of).collect())
}

pub(crate) fn check_page_size(page_size: usize) -> Result<()> {
    if page_size == 0 {
        return Err(Error::invalid("page_size", "must be at least 1"));
    }
    Ok(())
}

/// Appends the digests of the full pages of `tokens`, chained from the last digest already in
/// `digests`, else from `prior` (none: the first page of a prompt).
pub(crate) fn push_digests(
    digests: &mut Vec<[u8; 32]>,
    prior: Option<&[u8; 32]>,
    tokens: &[u32],
    page_size: usize,
) {
    let mut prior = digests.last().or(prior).copied();
    for page in tokens.chunks_exact(page_size) {
        let mut hasher = Sha256::new();
        if let Some(p) = &prior {
            hasher.update(p);
        }
        for &t in page {
            hasher.update(t.to_le_bytes());
        }
        let digest: [u8; 32] = hasher.finalize().into();
        digests.push(digest);
        prior = Some(digest);
    }
}

/// A digest's block hash: its first 8 bytes read big-endian.
pub(crate) fn hash_of(digest: &[u8; 32]) -> BlockHash {
    let mut head = [0u8; 8];
    head.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(head) as i64
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
