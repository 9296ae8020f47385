//! SGLang 0.5.23 page hashes (`mem_cache/utils.py`: `get_hash_str`, `hash_str_to_int64`).
//!
//! `digest_i = sha256(digest_{i-1} || token_0 || …)`, each token as 4 little-endian bytes, no
//! prefix for the first page; the block hash is the first 8 bytes of `digest_i` read big-endian
//! (the first 16 hex digits) as a two's-complement `i64`. A partial trailing page has no hash.

use sha2::{Digest, Sha256};

use crate::{BlockHash, Error, Result};

/// Page hashes of every full page of `token_ids`, exactly as SGLang 0.5.23 computes them.
pub fn block_hashes(token_ids: &[u32], page_size: usize) -> Result<Vec<BlockHash>> {
    if page_size == 0 {
        return Err(Error::invalid("page_size", "must be at least 1"));
    }
    let pages = token_ids.len() / page_size;
    let mut out = Vec::with_capacity(pages);
    let mut prior: Option<[u8; 32]> = None;
    for page in token_ids.chunks_exact(page_size) {
        let mut hasher = Sha256::new();
        if let Some(prior) = &prior {
            hasher.update(prior);
        }
        for &t in page {
            hasher.update(t.to_le_bytes());
        }
        let digest: [u8; 32] = hasher.finalize().into();
        let mut head = [0u8; 8];
        head.copy_from_slice(&digest[..8]);
        out.push(u64::from_be_bytes(head) as i64);
        prior = Some(digest);
    }
    Ok(out)
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
