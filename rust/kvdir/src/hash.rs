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

#[cfg(test)]
mod tests {
    use super::*;

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
