//! The eviction index: per (node, tier), the candidates (blocks held there with no child held
//! there) ordered by `(R_b > 0, T_b, -depth, hash)` ascending (DESIGN §2).
//!
//! A `BTreeSet` per place keeps the order incrementally: a candidate's key changes only when its
//! time is refreshed (`store`, `touch`), when `R_b` crosses zero, or when it gains or loses its
//! last held child, and each of those is one remove and one insert. Nothing is sorted per call.

use std::collections::BTreeSet;

use crate::BlockHash;

/// `f64` seconds mapped to `u64` so that integer order is numeric order (finite values only;
/// callers reject NaN and infinities, and normalise -0.0).
#[inline]
pub(crate) fn time_bits(t: f64) -> u64 {
    let b = t.to_bits();
    if b >> 63 == 1 {
        !b
    } else {
        b | 1 << 63
    }
}

/// Sort key of a candidate. Field order is the eviction order; `idx` only makes the key carry its
/// slab slot (hashes are unique, so it never decides).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct EvKey {
    pub(crate) needed: bool,
    pub(crate) time: u64,
    /// `u32::MAX - depth`: deeper blocks first among equal times.
    pub(crate) shallowness: u32,
    pub(crate) hash: BlockHash,
    pub(crate) idx: u32,
}

impl EvKey {
    pub(crate) fn new(needed: bool, time: f64, depth: u32, hash: BlockHash, idx: u32) -> Self {
        EvKey {
            needed,
            time: time_bits(time),
            shallowness: u32::MAX - depth,
            hash,
            idx,
        }
    }
}

/// What the directory keeps per (node, tier).
#[derive(Default, Debug)]
pub(crate) struct PlaceState {
    /// Blocks held here.
    pub(crate) held: u64,
    /// Blocks held here whose parent is not (a gap in a prefix). While there are none, a block
    /// newly held here cannot have a child held here, and no child list needs scanning.
    pub(crate) orphans: u64,
    /// Eviction candidates, in eviction order.
    pub(crate) candidates: BTreeSet<EvKey>,
}

/// Approximate bytes of a `BTreeSet<EvKey>` entry: the key plus B-tree node overhead (nodes hold
/// up to 11 keys and are about two thirds full).
pub(crate) const CANDIDATE_BYTES: usize = std::mem::size_of::<EvKey>() * 3 / 2;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_bits_preserve_order() {
        let ts = [-1e9, -2.5, -1e-300, 0.0, 1e-300, 1.0, 2.5, 1e9];
        for w in ts.windows(2) {
            assert!(time_bits(w[0]) < time_bits(w[1]), "{} < {}", w[0], w[1]);
        }
    }

    #[test]
    fn key_order_is_the_contract() {
        // Unneeded before needed; then older first; then deeper first; then smaller hash.
        let late = EvKey::new(false, 5.0, 0, 9, 0);
        let needed = EvKey::new(true, 1.0, 0, 1, 1);
        assert!(late < needed);
        let early = EvKey::new(false, 1.0, 0, 9, 2);
        assert!(early < late);
        let deep = EvKey::new(false, 1.0, 3, 9, 3);
        assert!(deep < early);
        let small_hash = EvKey::new(false, 1.0, 3, -4, 4);
        assert!(small_hash < deep);
    }
}
