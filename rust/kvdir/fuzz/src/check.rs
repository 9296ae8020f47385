//! The oracle both targets share: the directory's own invariant checker, then everything
//! observable compared with the reference model.

use std::collections::{BTreeMap, BTreeSet};

use kvdir::{BlockHash, Directory, NodeId, Tier};

use crate::model::{Model, ModelMatch};

/// `match_prefix` in the model's shape, after checking the result's own consistency.
#[must_use]
pub fn match_of(d: &Directory, q: &[BlockHash]) -> ModelMatch {
    let m = d.match_prefix(q);
    assert!(
        m.node_ids().windows(2).all(|w| w[0] < w[1]),
        "node_ids ascending: {m:?}"
    );
    assert_eq!(
        (m.l1().len(), m.l12().len()),
        (m.len(), m.len())
    );
    assert!(m.pool <= m.cluster, "{m:?}");
    let nodes = m
        .node_ids()
        .iter()
        .zip(m.l1().iter().zip(m.l12()))
        .map(|(&n, (&l1, &l12))| {
            assert!(0 < l12 && l1 <= l12 && l12 <= m.cluster, "{m:?}");
            (n, (l1, l12))
        })
        .collect();
    (nodes, m.pool, m.cluster)
}

/// Panics unless the directory's invariants hold and it agrees with the model on: the known
/// blocks and their refcounts (every block the model knows, and every hash of `queries`), `match`
/// of each query, the eviction order and holdings of every (node, tier) the model has holdings at
/// and of those of `nodes`, `stats()` but memory, and branch versions.
pub fn compare(d: &Directory, m: &Model, nodes: &[NodeId], queries: &[Vec<BlockHash>]) {
    d.check_invariants();
    assert_eq!(d.len(), m.parent.len(), "known blocks");
    let probes: BTreeSet<BlockHash> = m
        .parent
        .keys()
        .chain(queries.iter().flatten())
        .copied()
        .collect();
    for h in probes {
        assert_eq!(d.contains(h), m.parent.contains_key(&h), "contains {h}");
        assert_eq!(d.refcount(h), m.refcount(h), "refcount {h}");
    }
    for q in queries {
        assert_eq!(match_of(d, q), m.match_prefix(q), "match {q:?}");
    }
    // Every place the model has holdings at, and those of `nodes` (which must have none if the
    // model has none there).
    let mut places: BTreeSet<(NodeId, Tier)> = m.held.keys().copied().collect();
    places.extend(nodes.iter().flat_map(|&n| Tier::ALL.map(|t| (n, t))));
    let mut locations: BTreeMap<Tier, u64> = BTreeMap::new();
    let mut candidates = 0;
    for (node, t) in places {
        let want = m.eviction_order(node, t);
        assert_eq!(
            d.eviction_order(node, t, None),
            want,
            "eviction order {node} {t:?}"
        );
        candidates += want.len() as u64;
        let held = m.held.get(&(node, t)).map_or(0, |x| x.len() as u64);
        assert_eq!(d.held(node, Some(t)), held, "held {node} {t:?}");
        *locations.entry(t).or_default() += held;
    }
    let s = d.stats();
    let at = |t| locations.get(&t).copied().unwrap_or(0);
    let held_nodes: BTreeSet<NodeId> = m.held.keys().map(|p| p.0).collect();
    let want = (
        m.parent.len() as u64,
        m.placeholders(),
        at(Tier::L1) + at(Tier::L2),
        at(Tier::L1),
        at(Tier::L2),
        held_nodes.len() as u64,
        m.branches.len() as u64,
        candidates,
        m.events_skipped,
    );
    let got = (
        s.blocks,
        s.placeholders,
        s.locations,
        s.locations_l1,
        s.locations_l2,
        s.nodes,
        s.branches,
        s.candidates,
        s.events_skipped,
    );
    assert_eq!(
        got, want,
        "stats (blocks, placeholders, locations, l1, l2, nodes, branches, candidates, skipped)"
    );
    for (b, (v, _)) in &m.branches {
        assert_eq!(d.branch_version(b), Some(*v), "version of {b}");
    }
}

/// The path from a root down to `h` by the model's parent links (just `[h]` if unknown).
#[must_use]
pub fn root_path(m: &Model, h: BlockHash) -> Vec<BlockHash> {
    let mut p = vec![h];
    while let Some(Some(x)) = m.parent.get(p.last().expect("non-empty")) {
        p.push(*x);
    }
    p.reverse();
    p
}
