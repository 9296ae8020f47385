//! Differential test: random operation streams applied to `kvdir::Directory` and to the
//! reference model of the `kvdir-reference` crate (the fuzz targets' too), compared after every step (proptest shrinks a failing
//! stream to a minimal one). Hashes come from a small fixed forest (±1..=20, parent h/2) so that
//! chains share prefixes, plus arbitrary chains that exercise validation errors.

#![allow(
    clippy::many_single_char_names,
    reason = "d: directory, r: reference, as in the module docs"
)]

mod common;

use std::collections::BTreeMap;

use common::msgpack::{self, V};
use kvdir::{BranchId, Directory, Tier};
use kvdir_reference::{same_kind, Model, ModelEvent};
use proptest::prelude::*;

const NODES: u32 = 3;
const UNIVERSE: i64 = 20;

fn universe_parent(h: i64) -> Option<i64> {
    (h.abs() >= 2).then(|| h.signum() * (h.abs() / 2))
}

/// The path from the root of `h`'s tree down to `h`.
fn path_to(h: i64) -> Vec<i64> {
    let mut p = vec![h];
    while let Some(x) = universe_parent(*p.last().unwrap()) {
        p.push(x);
    }
    p.reverse();
    p
}

fn tier() -> impl Strategy<Value = Tier> {
    prop_oneof![Just(Tier::L1), Just(Tier::L2)]
}

fn hash() -> impl Strategy<Value = i64> {
    (1..=UNIVERSE, any::<bool>()).prop_map(|(h, neg)| if neg { -h } else { h })
}

/// A consistent chain (a downward path of the forest) with its true parent, or an arbitrary one.
fn chain() -> impl Strategy<Value = (Vec<i64>, Option<i64>)> {
    prop_oneof![
        4 => (hash(), 0usize..5).prop_map(|(end, len)| {
            let path = path_to(end);
            let start = path.len().saturating_sub(len.max(1));
            let parent = start.checked_sub(1).map(|i| path[i]);
            (path[start..].to_vec(), parent)
        }),
        1 => (prop::collection::vec(hash(), 0..4), prop::option::of(hash())),
    ]
}

/// A chain from a first page (for match, touch, branches).
fn rooted() -> impl Strategy<Value = Vec<i64>> {
    prop_oneof![
        4 => (hash(), 0usize..6).prop_map(|(end, len)| {
            let path = path_to(end);
            path[..len.min(path.len())].to_vec()
        }),
        1 => prop::collection::vec(hash(), 0..4),
    ]
}

fn branch() -> impl Strategy<Value = BranchId> {
    prop_oneof![
        (0i64..3).prop_map(BranchId::Int),
        Just(BranchId::Str("agent".into()))
    ]
}

#[derive(Debug, Clone)]
enum Op {
    Store(u32, Tier, Vec<i64>, Option<i64>),
    Remove(u32, Tier, Vec<i64>),
    Clear(u32, Option<Tier>),
    Touch(u32, Vec<i64>),
    BranchSet(BranchId, Vec<i64>, Option<i64>),
    BranchFork(BranchId, BranchId),
    BranchEnd(BranchId),
    Evict(u32, Tier, usize),
    Demote(u32, usize),
    Events(u32, Vec<ModelEvent>, bool),
}

fn medium() -> impl Strategy<Value = (Option<&'static str>, Option<Tier>)> {
    prop_oneof![
        Just((None, Some(Tier::L1))),
        Just((Some("GPU"), Some(Tier::L1))),
        Just((Some("CPU_PINNED"), Some(Tier::L2))),
        Just((Some("CPU"), Some(Tier::L2))),
        Just((Some("DISK"), None)),
    ]
}

fn event() -> impl Strategy<Value = (ModelEvent, Option<&'static str>)> {
    prop_oneof![
        4 => (chain(), medium()).prop_map(|((hs, p), (m, t))| (ModelEvent::Stored(hs, p, t), m)),
        2 => (prop::collection::vec(hash(), 0..3), medium()).prop_map(|(hs, (m, t))| (ModelEvent::Removed(hs, t), m)),
        1 => Just((ModelEvent::Cleared, None)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let node = 0..NODES;
    prop_oneof![
        6 => (node.clone(), tier(), chain()).prop_map(|(n, t, (c, p))| Op::Store(n, t, c, p)),
        2 => (node.clone(), tier(), prop::collection::vec(hash(), 0..4)).prop_map(|(n, t, c)| Op::Remove(n, t, c)),
        1 => (node.clone(), prop::option::of(tier())).prop_map(|(n, t)| Op::Clear(n, t)),
        2 => (node.clone(), rooted()).prop_map(|(n, c)| Op::Touch(n, c)),
        3 => (branch(), rooted(), prop::option::of(0i64..4)).prop_map(|(b, c, v)| Op::BranchSet(b, c, v)),
        1 => (branch(), branch()).prop_map(|(a, b)| Op::BranchFork(a, b)),
        1 => branch().prop_map(Op::BranchEnd),
        2 => (node.clone(), tier(), 0usize..4).prop_map(|(n, t, k)| Op::Evict(n, t, k)),
        2 => (node.clone(), 0usize..5).prop_map(|(n, k)| Op::Demote(n, k)),
        2 => (node, prop::collection::vec(event(), 0..4), any::<bool>()).prop_map(|(n, evs, positional)| {
            // Mediums are folded into the events' tiers; keep the wire spelling for encoding.
            let mut events = Vec::new();
            let mut wire = Vec::new();
            for (e, m) in evs {
                wire.push(match &e {
                    ModelEvent::Stored(hs, p, _) => if positional { msgpack::stored_positional(hs, *p, m) } else { msgpack::stored_map(hs, *p, m) },
                    ModelEvent::Removed(hs, _) => if positional { msgpack::removed_positional(hs, m) } else { msgpack::removed_map(hs, m) },
                    ModelEvent::Cleared => if positional { V::Arr(vec![msgpack::s("AllBlocksCleared")]) } else { msgpack::cleared_map() },
                    ModelEvent::Unknown => unreachable!("`event()` makes no unknown events"),
                });
                events.push(e);
            }
            let _ = wire;
            Op::Events(n, events, positional)
        }),
    ]
}

/// Re-encodes reference events (positional or map), mediums chosen to match their tiers.
fn encode(events: &[ModelEvent], positional: bool) -> Vec<u8> {
    let med = |t: &Option<Tier>| match t {
        Some(Tier::L1) => Some("GPU"),
        Some(Tier::L2) => Some("CPU_PINNED"),
        None => Some("DISK"),
    };
    msgpack::batch(
        events
            .iter()
            .map(|e| match e {
                ModelEvent::Stored(hs, p, t) if positional => {
                    msgpack::stored_positional(hs, *p, med(t))
                }
                ModelEvent::Stored(hs, p, t) => msgpack::stored_map(hs, *p, med(t)),
                ModelEvent::Removed(hs, t) if positional => msgpack::removed_positional(hs, med(t)),
                ModelEvent::Removed(hs, t) => msgpack::removed_map(hs, med(t)),
                ModelEvent::Cleared if positional => V::Arr(vec![msgpack::s("AllBlocksCleared")]),
                ModelEvent::Cleared => msgpack::cleared_map(),
                ModelEvent::Unknown => unreachable!("`event()` makes no unknown events"),
            })
            .collect(),
    )
}

fn compare(d: &Directory, r: &Model) -> Result<(), TestCaseError> {
    d.check_invariants();
    prop_assert_eq!(d.len(), r.parent.len(), "known blocks");
    for h in (-UNIVERSE..=UNIVERSE).filter(|&h| h != 0) {
        prop_assert_eq!(d.contains(h), r.parent.contains_key(&h), "contains {}", h);
        prop_assert_eq!(d.refcount(h), r.refcount(h), "refcount {}", h);
        let q = path_to(h);
        let m = d.match_prefix(&q);
        let (nodes, pool, cluster) = r.match_prefix(&q);
        let got: BTreeMap<u32, (u32, u32)> = m
            .node_ids()
            .iter()
            .zip(m.l1().iter().zip(m.l12()))
            .map(|(&n, (&a, &b))| (n, (a, b)))
            .collect();
        prop_assert_eq!(got, nodes, "match nodes {:?}", q);
        prop_assert_eq!((m.pool, m.cluster), (pool, cluster), "pool/cluster {:?}", q);
    }
    for node in 0..NODES {
        for t in Tier::ALL {
            prop_assert_eq!(
                d.eviction_order(node, t, None),
                r.eviction_order(node, t),
                "order {} {:?}",
                node,
                t
            );
        }
    }
    Ok(())
}

/// How the harness removes blocks from the directory under test: `Directory::remove`, or, in
/// the self-test, a directory that drops removals.
type Remove = fn(&mut Directory, u32, Tier, &[i64]);

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    run_with(ops, Directory::remove)
}

fn run_with(ops: Vec<Op>, remove: Remove) -> Result<(), TestCaseError> {
    let mut d = Directory::new();
    let mut r = Model::default();
    for (step, op) in ops.into_iter().enumerate() {
        // Half-steps make equal times common, so the depth and hash tie-breaks get exercised.
        let now = (step / 2) as f64;
        match op {
            Op::Store(n, t, c, p) => {
                let (a, b) = (d.store(n, t, &c, p, now), r.store(n, t, &c, p, now));
                if let (Err(x), Err(y)) = (&a, &b) {
                    prop_assert!(same_kind(x, y), "{:?} vs {:?}", x, y);
                } else {
                    prop_assert_eq!(a.is_ok(), b.is_ok(), "store {:?} {:?}", a, b);
                }
            }
            Op::Remove(n, t, c) => {
                remove(&mut d, n, t, &c);
                r.remove(n, t, &c);
            }
            Op::Clear(n, t) => {
                d.clear(n, t);
                r.clear(n, t);
            }
            Op::Touch(n, c) => {
                d.touch(n, &c, now).unwrap();
                r.touch(n, &c, now).unwrap();
            }
            Op::BranchSet(b, c, v) => {
                let (x, y) = (d.branch_set(b.clone(), &c, v), r.branch_set(b, &c, v));
                if let (Err(e), Err(f)) = (&x, &y) {
                    prop_assert!(same_kind(e, f));
                } else {
                    prop_assert_eq!(x, y);
                }
            }
            Op::BranchFork(a, b) => {
                let (x, y) = (d.branch_fork(&a, b.clone()), r.branch_fork(&a, b));
                if let (Err(e), Err(f)) = (&x, &y) {
                    prop_assert!(same_kind(e, f));
                } else {
                    prop_assert_eq!(x.is_ok(), y.is_ok());
                }
            }
            Op::BranchEnd(b) => prop_assert_eq!(d.branch_end(&b), r.branch_end(&b)),
            Op::Evict(n, t, k) => prop_assert_eq!(d.evict(n, t, k), r.evict(n, t, k)),
            Op::Demote(n, k) => {
                // The reference: the blocks `evict` would take from L1, each stored in L2 (parents
                // first, while all are still known), then removed from L1.
                let order = r.clone().evict(n, Tier::L1, k);
                let parents: Vec<Option<i64>> = order.iter().map(|h| r.parent[h]).collect();
                for (h, p) in order.iter().zip(&parents).rev() {
                    let stored = r.store(n, Tier::L2, &[*h], *p, now);
                    prop_assert!(stored.is_ok(), "a demoted block's parent is known");
                }
                for h in &order {
                    r.remove(n, Tier::L1, &[*h]);
                }
                let want: Vec<(i64, Option<i64>)> = order.into_iter().zip(parents).collect();
                prop_assert_eq!(d.demote(n, k, now), Ok(want));
            }
            Op::Events(n, evs, positional) => {
                // Capacity is not state: a refused one-store batch may have reserved room in the
                // block index before it found the chain invalid, as a refused `store` may.
                let state = |d: &Directory| {
                    let mut s = d.stats();
                    s.memory_bytes = 0;
                    (d.len(), s)
                };
                let before = state(&d);
                let x = d.apply_events(n, &encode(&evs, positional), now);
                let y = r.apply(n, &evs, now);
                if let (Err(e), Err(f)) = (&x, &y) {
                    prop_assert!(same_kind(e, f), "{:?} vs {:?}", e, f);
                    prop_assert_eq!(before, state(&d), "a refused batch changed state");
                } else {
                    prop_assert_eq!(x, y);
                }
            }
        }
        compare(&d, &r)?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn directory_matches_reference(ops in prop::collection::vec(op(), 1..40)) {
        run(ops)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Arbitrary bytes never panic the decoder, and a refused batch changes nothing.
    #[test]
    fn arbitrary_event_bytes_are_refused_cleanly(bytes in prop::collection::vec(any::<u8>(), 0..64)) {
        let mut d = Directory::new();
        d.store(0, Tier::L1, &[1, 2, 3], None, 0.0).unwrap();
        let before = d.stats();
        if d.apply_events(0, &bytes, 1.0).is_err() {
            prop_assert_eq!(before, d.stats());
        }
        d.check_invariants();
    }

    /// Every strict prefix of a valid batch is refused (truncation is always detected).
    #[test]
    fn truncated_batches_are_refused(cut in 0usize..1000) {
        let payload = msgpack::batch(vec![
            msgpack::stored_map(&[1, 2, 3], None, Some("GPU")),
            msgpack::removed_map(&[3], Some("GPU")),
        ]);
        let cut = cut % payload.len();
        let mut d = Directory::new();
        prop_assert!(d.apply_events(0, &payload[..cut], 0.0).is_err());
        prop_assert!(d.is_empty());
    }
}

/// The harness can fail: a directory that ignores `remove` is caught (the same streams, from a
/// fixed seed, as `directory_matches_reference` draws).
#[test]
fn the_harness_fails_a_directory_that_drops_removals() {
    use proptest::test_runner::{RngAlgorithm, TestRng, TestRunner};
    let config = ProptestConfig {
        cases: 256,
        failure_persistence: None,
        max_shrink_iters: 0,
        ..ProptestConfig::default()
    };
    let mut runner =
        TestRunner::new_with_rng(config, TestRng::deterministic_rng(RngAlgorithm::ChaCha));
    let found = runner.run(&prop::collection::vec(op(), 1..40), |ops| {
        run_with(ops, |_, _, _, _| {})
    });
    assert!(
        found.is_err(),
        "a directory that drops removals passed the differential test"
    );
}
