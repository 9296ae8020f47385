//! Exact expectations on small directories (the habit of vLLM's prefix-caching tests): exact
//! block ids, exact counts, exact eviction order.

mod common;

use common::msgpack::{self, V};
use kvdir::{BranchId, Directory, Error, Tier};

/// (node, tier, chain, parent, now)
type Stored<'a> = (u32, Tier, &'a [i64], Option<i64>, f64);

fn dir_with(chains: &[Stored<'_>]) -> Directory {
    let mut d = Directory::new();
    for &(node, tier, hashes, parent, now) in chains {
        d.store(node, tier, hashes, parent, now).unwrap();
    }
    d.check_invariants();
    d
}

#[test]
fn match_counts_per_node_pool_and_cluster() {
    let d = dir_with(&[
        (0, Tier::L1, &[1, 2, 3, 4], None, 0.0),
        (1, Tier::L2, &[1, 2], None, 0.0),
        (2, Tier::L1, &[1], None, 0.0),
        (2, Tier::L2, &[2, 3], Some(1), 0.0),
    ]);
    let m = d.match_prefix(&[1, 2, 3, 4, 5]);
    assert_eq!(m.node_ids(), vec![0, 1, 2]);
    assert_eq!(m.l1(), vec![4, 0, 1]);
    assert_eq!(m.l12(), vec![4, 2, 3]);
    assert_eq!(m.pool, 3, "blocks 1-3 are each in some L2; 4 is in none");
    assert_eq!(m.cluster, 4);
    let m = d.match_prefix(&[2, 3]);
    assert_eq!(
        (m.len(), m.cluster),
        (0, 0),
        "a query starts at a first page"
    );
}

#[test]
fn eviction_prefers_unneeded_then_oldest_then_deepest() {
    let mut d = dir_with(&[
        (0, Tier::L1, &[1, 2, 3], None, 1.0),
        (0, Tier::L1, &[4, 5], Some(2), 1.0),
        (0, Tier::L1, &[6], None, 2.0),
    ]);
    // Leaves: 3 (depth 2), 5 (depth 3), both at t=1; 6 at t=2.
    assert_eq!(d.eviction_order(0, Tier::L1, None), vec![5, 3, 6]);
    d.branch_set(BranchId::Int(7), &[1, 2, 4, 5], None).unwrap();
    assert_eq!(d.eviction_order(0, Tier::L1, None), vec![3, 6, 5]);
    // Evicting cascades: once 3 is gone nothing new is a candidate (2 still has child 4).
    assert_eq!(d.evict(0, Tier::L1, 2), vec![3, 6]);
    assert_eq!(d.evict(0, Tier::L1, 10), vec![5, 4, 2, 1]);
    d.check_invariants();
    // The branch keeps its blocks known as placeholders.
    assert_eq!(d.len(), 4);
    assert!(d.branch_end(&BranchId::Int(7)));
    assert!(d.is_empty(), "garbage is dropped at once");
}

#[test]
fn validation_errors_change_nothing() {
    let mut d = dir_with(&[(0, Tier::L1, &[1, 2], None, 0.0)]);
    let before = d.stats();
    assert_eq!(
        d.store(0, Tier::L1, &[9], Some(8), 1.0),
        Err(Error::UnknownParent { parent: 8 })
    );
    assert_eq!(
        d.store(0, Tier::L1, &[2], None, 1.0),
        Err(Error::ParentMismatch {
            hash: 2,
            parent: None,
            known_parent: Some(1)
        })
    );
    assert_eq!(
        d.store(0, Tier::L1, &[5, 6, 5], None, 1.0),
        Err(Error::DuplicateHash { hash: 5 })
    );
    assert_eq!(
        d.store(0, Tier::L1, &[3, 2], Some(2), 1.0),
        Err(Error::DuplicateHash { hash: 2 })
    );
    assert!(matches!(
        d.store(0, Tier::L1, &[3], None, f64::NAN),
        Err(Error::InvalidArgument {
            argument: "now",
            ..
        })
    ));
    assert!(matches!(
        d.branch_set(BranchId::Int(1), &[2], None),
        Err(Error::ParentMismatch { .. })
    ));
    assert_eq!(before, d.stats());
    d.check_invariants();
}

/// A chain rejected after some of its new blocks were looked at (a repeat among them, a known
/// block after them) gives back every slot it claimed, freed slots included: nothing changes and
/// the same blocks store normally afterwards.
#[test]
fn rejected_new_tails_leave_no_trace() {
    let mut d = dir_with(&[
        (0, Tier::L1, &[1, 2], None, 0.0),
        (1, Tier::L1, &[20, 21, 22], None, 0.0),
    ]);
    d.remove(1, Tier::L1, &[22, 21, 20]); // three freed slab slots to reuse
    let before = d.stats();
    assert_eq!(
        d.store(0, Tier::L1, &[3, 4, 5, 4], Some(2), 1.0),
        Err(Error::DuplicateHash { hash: 4 })
    );
    assert!(matches!(
        d.store(0, Tier::L1, &[3, 4, 1], Some(2), 1.0),
        Err(Error::DuplicateHash { hash: 1 } | Error::ParentMismatch { hash: 1, .. })
    ));
    assert!(matches!(
        d.store(2, Tier::L2, &[1, 2, 7, 8, 2], None, 1.0),
        Err(Error::DuplicateHash { hash: 2 })
    ));
    assert_eq!(before, d.stats());
    for h in [3, 4, 5, 7, 8] {
        assert!(!d.contains(h), "{h} left behind");
    }
    d.check_invariants();
    d.store(0, Tier::L1, &[3, 4, 5, 6, 7, 8], Some(2), 2.0)
        .unwrap();
    d.check_invariants();
    assert_eq!(d.match_prefix(&[1, 2, 3, 4, 5, 6, 7, 8]).l1(), [8]);
    assert_eq!(d.len(), 8);
}

#[test]
fn branch_versions() {
    let mut d = Directory::new();
    let b = BranchId::Str("a".into());
    assert_eq!(d.branch_set(b.clone(), &[1, 2], None), Ok(true));
    assert_eq!(d.branch_version(&b), Some(0));
    assert_eq!(d.branch_set(b.clone(), &[1, 2, 3], None), Ok(true));
    assert_eq!(d.branch_version(&b), Some(1));
    assert_eq!(d.branch_set(b.clone(), &[1], Some(0)), Ok(false));
    assert_eq!(d.refcount(3), 1);
    assert_eq!(
        d.branch_set(b.clone(), &[7], Some(1)),
        Ok(true),
        "equal version applies"
    );
    assert_eq!(
        (d.refcount(1), d.refcount(7), d.len()),
        (0, 1, 1),
        "compaction drops history"
    );
    d.branch_fork(&b, BranchId::Int(2)).unwrap();
    assert_eq!(d.refcount(7), 2);
    assert!(matches!(
        d.branch_fork(&BranchId::Int(9), BranchId::Int(3)),
        Err(Error::UnknownBranch { .. })
    ));
    assert!(matches!(
        d.branch_fork(&b, BranchId::Int(2)),
        Err(Error::BranchExists { .. })
    ));
    d.check_invariants();
}

/// A new context that extends the branch's old one is checked only past the shared prefix, but
/// a refusal names what a check of the whole chain finds first, and changes nothing.
#[test]
fn extending_a_branch_is_refused_as_the_whole_chain_would_be() {
    let mut d = Directory::new();
    let b = BranchId::Int(1);
    assert_eq!(d.branch_set(b.clone(), &[1, 2, 3], None), Ok(true));
    d.store(0, Tier::L1, &[9, 4], None, 0.0).unwrap(); // 4 is known, under 9
    let before = (d.stats(), d.len(), d.branch_version(&b));
    // A block of the prefix repeated in the new part: a duplicate, not a parent mismatch.
    assert_eq!(
        d.branch_set(b.clone(), &[1, 2, 3, 5, 1], None),
        Err(Error::DuplicateHash { hash: 1 })
    );
    assert_eq!(
        d.branch_set(b.clone(), &[1, 2, 3, 2], None),
        Err(Error::DuplicateHash { hash: 2 })
    );
    assert!(matches!(
        d.branch_set(b.clone(), &[1, 2, 3, 4], None),
        Err(Error::ParentMismatch { hash: 4, .. })
    ));
    assert_eq!(before, (d.stats(), d.len(), d.branch_version(&b)));
    assert_eq!(d.branch_set(b.clone(), &[1, 2, 3, 5, 6], None), Ok(true));
    assert_eq!((d.refcount(3), d.refcount(6)), (1, 1));
    assert_eq!(d.branch_set(b.clone(), &[1, 2, 7], None), Ok(true)); // a fork off the prefix
    assert_eq!((d.refcount(2), d.refcount(3), d.refcount(7)), (1, 0, 1));
    assert!(!d.contains(6), "the old tail was released and collected");
    d.check_invariants();
}

#[test]
fn events_in_both_encodings_reach_the_same_state() {
    let batches = |positional: bool| {
        type Stored = fn(&[i64], Option<i64>, Option<&str>) -> V;
        type Removed = fn(&[i64], Option<&str>) -> V;
        let (st, rm): (Stored, Removed) = if positional {
            (msgpack::stored_positional, msgpack::removed_positional)
        } else {
            (msgpack::stored_map, msgpack::removed_map)
        };
        vec![
            msgpack::batch(vec![
                st(&[1, 2, 3], None, Some("GPU")),
                st(&[4], Some(3), None),
            ]),
            msgpack::batch(vec![
                st(&[1, 2], None, Some("CPU_PINNED")),
                st(&[5], Some(2), Some("DISK")),
            ]),
            msgpack::batch(vec![rm(&[4], Some("GPU"))]),
        ]
    };
    let mut states = Vec::new();
    for positional in [false, true] {
        let mut d = Directory::new();
        let applied: Vec<usize> = batches(positional)
            .iter()
            .map(|b| d.apply_events(0, b, 1.0).unwrap())
            .collect();
        assert_eq!(applied, vec![2, 1, 1], "the DISK event is skipped");
        let m = d.match_prefix(&[1, 2, 3, 4]);
        assert_eq!(
            (m.l1().to_vec(), m.l12().to_vec(), m.pool, m.cluster),
            (vec![3], vec![3], 2, 3)
        );
        assert_eq!(d.stats().events_skipped, 1);
        d.check_invariants();
        states.push(d.stats());
    }
    assert_eq!(states[0], states[1]);
}

#[test]
fn unsigned_hashes_and_cleared() {
    let mut d = Directory::new();
    let big = u64::MAX - 5; // read as the signed value -6
    let payload = msgpack::encode(&V::Arr(vec![
        V::F64(0.0),
        V::Arr(vec![V::Map(vec![
            ("type".into(), msgpack::s("BlockStored")),
            ("block_hashes".into(), V::Arr(vec![V::UInt(big)])),
            ("parent_block_hash".into(), V::Nil),
            (
                "extra_future_field".into(),
                V::Map(vec![("x".into(), V::Arr(vec![]))]),
            ),
        ])]),
        V::Nil,
        V::Str("trailing field".into()),
    ]));
    assert_eq!(d.apply_events(3, &payload, 0.0), Ok(1));
    assert!(d.contains(-6));
    assert_eq!(
        d.apply_events(3, &msgpack::batch(vec![msgpack::cleared_map()]), 0.0),
        Ok(1)
    );
    assert!(d.is_empty());
}

#[test]
fn a_batch_with_an_invalid_chain_changes_nothing() {
    let mut d = dir_with(&[(0, Tier::L1, &[1], None, 0.0)]);
    let before = d.stats();
    let payload = msgpack::batch(vec![
        msgpack::stored_map(&[2], Some(1), Some("GPU")),
        msgpack::stored_map(&[9], Some(8), Some("GPU")),
    ]);
    assert_eq!(
        d.apply_events(0, &payload, 1.0),
        Err(Error::UnknownParent { parent: 8 })
    );
    assert_eq!(before, d.stats());
    // A chain may hang under a block an earlier event of the same batch created.
    let payload = msgpack::batch(vec![
        msgpack::stored_map(&[2], Some(1), Some("GPU")),
        msgpack::stored_map(&[3], Some(2), Some("CPU_PINNED")),
    ]);
    assert_eq!(d.apply_events(0, &payload, 1.0), Ok(2));
    d.check_invariants();
}

#[test]
fn clear_one_tier_keeps_the_other() {
    let mut d = dir_with(&[
        (0, Tier::L1, &[1, 2, 3], None, 0.0),
        (0, Tier::L2, &[1, 2], None, 0.0),
        (1, Tier::L1, &[1], None, 0.0),
    ]);
    d.clear(0, Some(Tier::L1));
    let m = d.match_prefix(&[1, 2, 3]);
    assert_eq!(
        (m.node_ids(), m.l1(), m.l12()),
        (&[0, 1][..], &[0, 1][..], &[2, 1][..])
    );
    assert!(!d.contains(3));
    d.clear(0, None);
    d.clear(1, None);
    assert!(d.is_empty());
    assert_eq!(d.stats().locations, 0);
}

#[test]
fn a_parent_stored_after_its_child_counts_it() {
    // Remove a middle block, then store it again: it must see its held child.
    let mut d = dir_with(&[(0, Tier::L1, &[1, 2, 3], None, 0.0)]);
    d.remove(0, Tier::L1, &[2]);
    assert_eq!(d.eviction_order(0, Tier::L1, None), vec![3, 1]);
    d.store(0, Tier::L1, &[2], Some(1), 5.0).unwrap();
    assert_eq!(d.eviction_order(0, Tier::L1, None), vec![3]);
    d.check_invariants();
}

#[test]
fn leaf_first_removal_keeps_the_index_exact() {
    let mut d = dir_with(&[
        (0, Tier::L1, &[1, 2, 3, 4], None, 0.0),
        (0, Tier::L1, &[5], Some(2), 1.0),
    ]);
    // 4 and 3 leave leaf first (3 never enters the index in between); 2 goes too, so 1 (t=0)
    // becomes a candidate beside the orphaned 5 (t=1).
    d.remove(0, Tier::L1, &[4, 3, 2]);
    d.check_invariants();
    assert_eq!(d.eviction_order(0, Tier::L1, None), vec![1, 5]);
    d.remove(0, Tier::L1, &[5, 1]);
    d.check_invariants();
    assert!(d.eviction_order(0, Tier::L1, None).is_empty());
    assert!(d.is_empty());
    // A parent that is next in the list but not held here must not be skipped.
    let mut d = dir_with(&[
        (0, Tier::L1, &[1, 2], None, 0.0),
        (1, Tier::L1, &[1], None, 0.0),
    ]);
    d.remove(0, Tier::L1, &[2, 9, 1]);
    d.check_invariants();
    assert_eq!(d.eviction_order(1, Tier::L1, None), vec![1]);
}

#[test]
fn nodes_drop_out_at_wide_and_narrow_blocks() {
    // Many nodes share a prefix and leave it at different depths: in release builds the shared
    // blocks keep sorted rooted-node lists (debug builds use them from two nodes up). Both orders:
    // low node ids leaving first, and high ones.
    let chain: Vec<i64> = (1..=40).collect();
    for reversed in [false, true] {
        let len = |node: u32| {
            if reversed {
                40 - node as usize
            } else {
                node as usize + 1
            }
        };
        let mut d = Directory::new();
        for node in 0..40u32 {
            d.store(node, Tier::L1, &chain[..len(node)], None, 0.0)
                .unwrap();
            if node % 3 == 0 {
                d.store(node, Tier::L2, &chain[..len(node).div_ceil(2)], None, 0.0)
                    .unwrap();
            }
        }
        d.check_invariants();
        let m = d.match_prefix(&chain);
        let want: Vec<u32> = (0..40).map(|n| len(n) as u32).collect();
        assert_eq!(m.node_ids(), (0..40).collect::<Vec<_>>());
        assert_eq!(m.l12(), want);
        assert_eq!(m.l1(), want);
        assert_eq!((m.pool, m.cluster), (20, 40));
        // Node 38 leaves L1 from block 10 on and holds nothing in L2: both counts stop at 9.
        d.remove(38, Tier::L1, &chain[9..]);
        let m = d.match_prefix(&chain);
        assert_eq!(
            (m.l1()[38], m.l12()[38]),
            (9.min(len(38) as u32), 9.min(len(38) as u32))
        );
        // Node 39 (L2 holds its first half) leaves L1 from block 2: l1 = 1, l12 = its L2 half.
        d.remove(39, Tier::L1, &chain[1..]);
        let m = d.match_prefix(&chain);
        assert_eq!((m.l1()[39], m.l12()[39]), (1, len(39).div_ceil(2) as u32));
        d.check_invariants();
    }
}

#[test]
fn held_elsewhere_names_the_blocks_other_nodes_hold_in_a_tier() {
    let d = dir_with(&[
        (0, Tier::L2, &[1, 2, 3], None, 0.0),
        (1, Tier::L1, &[1, 2, 3, 4], None, 0.0),
        (1, Tier::L2, &[1, 2], None, 0.0),
        (2, Tier::L2, &[5], Some(4), 0.0),
    ]);
    // Node 1's own L2 copy of 1 and 2 does not count for node 1; node 0's does.
    assert_eq!(
        d.held_elsewhere(1, Tier::L2, &[1, 2, 3, 4, 5, 99]),
        vec![1, 2, 3, 5]
    );
    assert_eq!(d.held_elsewhere(0, Tier::L2, &[3, 2, 1]), vec![2, 1]);
    assert_eq!(d.held_elsewhere(0, Tier::L1, &[1, 4, 5]), vec![1, 4]);
    assert_eq!(d.held_elsewhere(2, Tier::L2, &[]), Vec::<i64>::new());
}
