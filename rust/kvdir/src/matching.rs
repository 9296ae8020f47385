//! `match` and `touch`: walks of a query chain from its first page (DESIGN §2, "Match is
//! prefix-only").
//!
//! The walk looks every query block up in the hash table and checks that its parent is the
//! previous query block. Following child links instead was slower: a block shared by many
//! sequences has many children, and scanning a sibling list is a chain of dependent cache misses,
//! while the table look-ups of successive query blocks are independent, so the CPU overlaps their
//! misses (a 100-block query over ~170k blocks: ~3.6 → ~2.6 µs). Per-node counts use the
//! blocks' `full_node`/`full_l1` counts (places holding the block's whole prefix): while a block's
//! count equals the number of nodes still counting, none of them dropped out and the block costs
//! O(1) however many nodes hold it; only at blocks where some node drops out are the still-counting
//! nodes checked against the block's holders. A 100-block query shared by 64 nodes thus costs about
//! 100 look-ups plus one check per drop-out, not 6,400 holder visits.

use smallvec::SmallVec;

use crate::directory::Directory;
use crate::holder_list::Holder;
use crate::table::{Block, NIL};
use crate::wide::Kind;
use crate::{BlockHash, NodeId, Tier};

/// How much of a query chain each place holds (the result of [`Directory::match_prefix`]).
///
/// The three per-node arrays share one buffer: `node_ids`, then `l12`, then `l1` only where it
/// differs from `l12` (a query no node holds in L2, the common case, has `l1 == l12`). NOTE: a
/// router keeps a match per request in flight, and each array of its own was an allocation and
/// fresh cache lines to write; one buffer of two arrays made a 100-block `match` over 64 nodes
/// ~0.1 µs faster when its results are kept (`benches/compare_dynamo.py`).
#[derive(Debug, Clone, Default)]
pub struct PrefixMatch {
    pub(crate) data: Vec<u32>,
    /// Nodes in the result: `data` holds `2 * len` or `3 * len` values.
    len: usize,
    /// Leading query blocks each held in the L2 of at least one node.
    pub pool: u32,
    /// Leading query blocks each held somewhere.
    pub cluster: u32,
}

impl PrefixMatch {
    /// A match from its arrays, which have one entry per node, ascending by node.
    ///
    /// # Panics
    /// If the arrays differ in length.
    #[must_use]
    pub fn new(node_ids: &[NodeId], l1: &[u32], l12: &[u32], pool: u32, cluster: u32) -> Self {
        assert!(
            l1.len() == node_ids.len() && l12.len() == node_ids.len(),
            "one l1 and one l12 per node"
        );
        let mut m = PrefixMatch::with_nodes(node_ids);
        m.data[node_ids.len()..].copy_from_slice(l12);
        if l1 != l12 {
            m.data.extend_from_slice(l1);
        }
        m.pool = pool;
        m.cluster = cluster;
        m
    }

    /// `node_ids` with `l1 == l12`, all zero (filled in by `match_prefix`).
    pub(crate) fn with_nodes(node_ids: &[NodeId]) -> Self {
        let len = node_ids.len();
        let mut data = Vec::with_capacity(2 * len);
        data.extend_from_slice(node_ids);
        data.resize(2 * len, 0);
        PrefixMatch {
            data,
            len,
            pool: 0,
            cluster: 0,
        }
    }

    /// Gives `l1` its own array, a copy of `l12` as it is now (`match_prefix`, at the first block
    /// where the two counts part).
    pub(crate) fn split_l1(&mut self) {
        if self.data.len() == 2 * self.len {
            self.data.extend_from_within(self.len..);
        }
    }

    /// `l12` (and `l1` while it has no array of its own) for writing.
    pub(crate) fn l12_mut(&mut self) -> &mut [u32] {
        &mut self.data[self.len..2 * self.len]
    }

    /// `l1` for writing, once it has its own array (`split_l1`).
    pub(crate) fn l1_mut(&mut self) -> &mut [u32] {
        debug_assert_eq!(self.data.len(), 3 * self.len, "l1 shares l12's array");
        &mut self.data[2 * self.len..]
    }

    /// Nodes with `l12 > 0`, ascending.
    #[must_use]
    pub fn node_ids(&self) -> &[NodeId] {
        &self.data[..self.len]
    }

    /// Leading query blocks in each node's L1.
    #[must_use]
    pub fn l1(&self) -> &[u32] {
        if self.data.len() == 3 * self.len {
            &self.data[2 * self.len..]
        } else {
            self.l12()
        }
    }

    /// Leading query blocks in each node's L1 ∪ L2.
    #[must_use]
    pub fn l12(&self) -> &[u32] {
        &self.data[self.len..2 * self.len]
    }

    /// Nodes in the result (those with `l12 > 0`).
    #[must_use]
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no node holds the query's first block.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// `(l1, l12)` of `node`, `(0, 0)` for a node holding none of the query: one binary search,
    /// where a map of every node costs a node per entry (a prefix 768 nodes hold).
    #[must_use]
    pub fn node(&self, node: NodeId) -> (u32, u32) {
        match self.node_ids().binary_search(&node) {
            Ok(i) => (self.l1()[i], self.l12()[i]),
            Err(_) => (0, 0),
        }
    }
}

/// Equal figures, however `l1` is stored.
impl PartialEq for PrefixMatch {
    fn eq(&self, other: &Self) -> bool {
        (
            self.node_ids(),
            self.l1(),
            self.l12(),
            self.pool,
            self.cluster,
        ) == (
            other.node_ids(),
            other.l1(),
            other.l12(),
            other.pool,
            other.cluster,
        )
    }
}

impl Eq for PrefixMatch {}

impl Directory {
    /// The leading query blocks that are known, held somewhere and chained by parent links.
    ///
    /// Along a chain in consecutive slots (`Blocks::chain_run`) the hashes are compared a chunk
    /// at a time in the hash column; the index is read where a run ends (a fork, another event's
    /// blocks). A block no place holds ends the walk: `match` counts nothing past it, and `touch`
    /// stops at the first block its node does not hold.
    fn walk(&self, hashes: &[BlockHash]) -> Path {
        let mut path = Path::default();
        let (mut prev, mut i) = (NIL, 0);
        // After a run, the index is read once to go on: hinting its lines ahead would only
        // spend memory bandwidth.
        let mut in_slab = false;
        while i < hashes.len() {
            if prev != NIL {
                let run = self.blocks.chain_run(prev, &hashes[i..]);
                if run > 0 {
                    path.push(prev + 1, run);
                    prev += run as u32;
                    i += run;
                    in_slab = true;
                    if i == hashes.len() {
                        break;
                    }
                }
            }
            if !in_slab {
                self.blocks.prefetch_walk(hashes, i);
            }
            in_slab = false;
            let Some(next) = self.blocks.find_held_child(hashes[i], prev) else {
                break;
            };
            path.push(next, 1);
            prev = next;
            i += 1;
        }
        path
    }

    /// How much of the query chain (from its first page) each node, the pool and the cluster hold.
    #[must_use]
    pub fn match_prefix(&self, hashes: &[BlockHash]) -> PrefixMatch {
        // Look every block up before using any: a tight loop of independent look-ups keeps
        // several cache misses in flight, where the counting below would hold up the next one.
        let path = self.walk(hashes);
        if path.len() == 0 {
            return PrefixMatch::default();
        }
        let first_idx = path.slot(0);
        let first = self.blocks.get(first_idx);
        // Every node with l12 > 0 holds the first block, and a first page is rooted wherever it is
        // held: its rooted nodes are the result's, ascending.
        let nodes = self.wide.rooted(
            Kind::Node,
            first_idx,
            self.blocks.has_wide(first_idx, Kind::Node),
            first,
        );
        let mut res = PrefixMatch::with_nodes(&nodes);
        // The nodes still counting: those holding the whole path so far (in some tier; in L1).
        // While both sets agree, `alive1` stays empty, `alive` serves both counts and `l1`
        // shares `l12`'s array.
        let mut alive = Alive::new(nodes);
        // A first page is rooted wherever it is held: the sets agree when every node has it in L1.
        let mut shared = first.full_l1 == first.full_node;
        let mut alive1 = Alive::default();
        if !shared {
            res.split_l1();
            let has = self.blocks.has_wide(first_idx, Kind::L1);
            alive1 = Alive::subset(&alive, self.wide.rooted(Kind::L1, first_idx, has, first));
        }
        let has_l2 = |b: &Block| b.holders.iter().any(|h| h.place.tier() == Tier::L2);
        // Each L1 entry of a first page is rooted in its tier: the rest are L2 entries.
        let first_l2 = first.holders.len() > first.full_l1 as usize;
        debug_assert_eq!(first_l2, has_l2(first), "first page {first_idx}");
        let pool = if first_l2 {
            1 + path
                .slots()
                .skip(1)
                .take_while(|&i| has_l2(self.blocks.get(i)))
                .count()
        } else {
            0
        };
        // Down a chain the places holding a block's whole prefix only thin out, so
        // `full_node + full_l1` never grows, and both counts change only where it falls: those
        // positions are searched for, the records between them are not read.
        let level = |p: usize| {
            let b = self.blocks.get(path.slot(p));
            b.full_node + b.full_l1
        };
        let mut at = 0;
        while let Some(p) = next_fall(path.len(), at, level) {
            let (idx, depth) = (path.slot(p), p as u32);
            let b = self.blocks.get(idx);
            if shared && b.full_l1 != b.full_node {
                shared = false;
                res.split_l1();
                alive1 = alive.clone();
            }
            if (b.full_node as usize) < alive.nodes.len() {
                let l12 = res.l12_mut();
                self.drop_out(&mut alive, Kind::Node, idx, b.full_node, |i| {
                    l12[i as usize] = depth;
                });
            }
            if !shared && (b.full_l1 as usize) < alive1.nodes.len() {
                let l1 = res.l1_mut();
                self.drop_out(&mut alive1, Kind::L1, idx, b.full_l1, |i| {
                    l1[i as usize] = depth;
                });
            }
            at = p;
        }
        let depth = path.len() as u32;
        let l12 = res.l12_mut();
        for &i in &alive.at {
            l12[i as usize] = depth;
        }
        if !shared {
            let l1 = res.l1_mut();
            for &i in &alive1.at {
                l1[i as usize] = depth;
            }
        }
        res.pool = pool as u32;
        res.cluster = depth;
        res
    }

    /// Removes from `alive` the nodes that do not hold block `idx`'s whole prefix (`kind`),
    /// calling `dropped` with each one's result index. A wide block's rooted list is the new
    /// `alive`; for other blocks, one merge pass over the block's holders.
    fn drop_out(
        &self,
        alive: &mut Alive,
        kind: Kind,
        idx: u32,
        kept: u32,
        dropped: impl FnMut(u32),
    ) {
        if let Some(kept) = self.wide.get(kind, idx, self.blocks.has_wide(idx, kind)) {
            alive.keep_only(kept, dropped);
            return;
        }
        let hs: &[Holder] = &self.blocks.get(idx).holders;
        let rooted = |h: &Holder| match kind {
            Kind::Node => h.root_node(),
            Kind::L1 => h.place.tier() == Tier::L1 && h.root_tier(),
        };
        let mut j = 0;
        alive.retain(
            alive.nodes.len() - kept as usize,
            |node| {
                while j < hs.len() && hs[j].place.node() < node {
                    j += 1;
                }
                // A node's entries are adjacent: any of them carries the flag.
                let mut keep = false;
                let mut k = j;
                while k < hs.len() && hs[k].place.node() == node {
                    keep |= rooted(&hs[k]);
                    k += 1;
                }
                keep
            },
            dropped,
        );
    }

    /// Last-access time := `now` for the leading query blocks `node` holds, in every tier it
    /// holds them in; stops at the first block the node holds in no tier.
    pub fn touch(&mut self, node: NodeId, hashes: &[BlockHash], now: f64) -> crate::Result<()> {
        let now = crate::check_time(now)?;
        // As in `match_prefix`: every look-up first, in a loop that keeps misses in flight.
        let path = self.walk(hashes);
        // The node's entries sit at about the same position down a chain: one search per block
        // from the last block's position, and that position says where to prefetch ahead.
        let mut hint = 0;
        let mut ahead = path.slots().skip(crate::directory::PREFETCH_HOLDERS);
        for idx in path.slots() {
            if let Some(a) = ahead.next() {
                self.blocks.get(a).holders.prefetch(hint);
            }
            let entries = self.blocks.get(idx).node_entries_near(node, hint);
            if entries.is_empty() {
                break;
            }
            hint = entries.start;
            for pos in entries {
                self.refresh_at(idx, pos, now);
            }
        }
        Ok(())
    }
}

/// The blocks a walk down a query chain found, as runs of consecutive slots: a chain stored in
/// one event is one run however long, where a list of slots cost a store per block and, past
/// 128 blocks, an allocation.
#[derive(Default)]
struct Path {
    /// Each run's end (the query position after its last block) and first slot.
    runs: SmallVec<[(u32, u32); 8]>,
}

impl Path {
    /// Blocks found.
    fn len(&self) -> usize {
        self.runs.last().map_or(0, |&(end, _)| end as usize)
    }

    /// Appends the `n` blocks in slots `slot..slot + n`.
    fn push(&mut self, slot: u32, n: usize) {
        let (len, start) = (self.len() as u32, self.runs_start());
        let end = len + n as u32;
        match self.runs.last_mut() {
            // Slots that go on from the last run's (a run after the block a look-up found): one run.
            Some(last) if last.1 + (len - start) == slot => last.0 = end,
            _ => self.runs.push((end, slot)),
        }
    }

    /// Where the last run starts in the query.
    fn runs_start(&self) -> u32 {
        match self.runs.len() {
            0 | 1 => 0,
            n => self.runs[n - 2].0,
        }
    }

    /// The slot of the block at query position `p` (below `len`).
    fn slot(&self, p: usize) -> u32 {
        if let [(_, slot)] = self.runs[..] {
            return slot + p as u32;
        }
        let r = self.runs.partition_point(|&(end, _)| end as usize <= p);
        let start = if r == 0 { 0 } else { self.runs[r - 1].0 };
        self.runs[r].1 + (p as u32 - start)
    }

    /// The slots in query order.
    fn slots(&self) -> impl Iterator<Item = u32> + '_ {
        let mut start = 0;
        self.runs.iter().flat_map(move |&(end, slot)| {
            let n = end - start;
            start = end;
            slot..slot + n
        })
    }
}

/// Positions `next_fall` reads one by one before it searches.
const NEAR: usize = 8;

/// The first position after `at` (and below `n`) whose `level` is below `at`'s, for a `level`
/// that never grows: the next `NEAR` positions read in turn (falls close together, a chain
/// many nodes hold to different depths, are read as cheaply as by a loop over every block),
/// then searched outward (steps 1, 2, 4, ...) and halved, so a fall `d` positions ahead costs
/// about `2 log2 d` reads.
fn next_fall(n: usize, at: usize, level: impl Fn(usize) -> u32) -> Option<usize> {
    let now = level(at);
    let near = (at + 1 + NEAR).min(n);
    if let Some(p) = (at + 1..near).find(|&p| level(p) < now) {
        return Some(p);
    }
    if near == n {
        return None;
    }
    // `level(lo) == now` throughout; `hi` is the first position seen below it.
    let (mut lo, mut step) = (near - 1, 1);
    let mut hi = loop {
        let probe = lo + step;
        if probe >= n {
            if lo + 1 >= n || level(n - 1) >= now {
                return None;
            }
            break n - 1;
        }
        if level(probe) < now {
            break probe;
        }
        lo = probe;
        step *= 2;
    };
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if level(mid) < now {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    debug_assert!((at + 1..hi).all(|p| level(p) == now), "a level that grew");
    Some(hi)
}

/// The nodes still counting, ascending, with each one's index in the result arrays (kept side by
/// side so that node lists compare as plain `u32` slices).
#[derive(Default, Clone)]
struct Alive {
    nodes: Vec<NodeId>,
    at: Vec<u32>,
}

impl Alive {
    /// All of `nodes`, which are the result's nodes in order.
    fn new(nodes: Vec<NodeId>) -> Self {
        let at = (0..nodes.len() as u32).collect();
        Alive { nodes, at }
    }

    /// The entries of `all` whose node is in `nodes` (ascending, a subset).
    fn subset(all: &Alive, nodes: Vec<NodeId>) -> Self {
        let mut out = all.clone();
        out.keep_only(&nodes, |_| {});
        out
    }

    /// Drops the `missing` nodes for which `keep` is false; the scan stops at the last of them.
    fn retain(
        &mut self,
        mut missing: usize,
        mut keep: impl FnMut(NodeId) -> bool,
        mut dropped: impl FnMut(u32),
    ) {
        let mut w = 0;
        for r in 0..self.nodes.len() {
            if missing == 0 {
                self.nodes.copy_within(r.., w);
                self.at.copy_within(r.., w);
                w += self.nodes.len() - r;
                break;
            }
            let node = self.nodes[r];
            if keep(node) {
                self.nodes[w] = node;
                self.at[w] = self.at[r];
                w += 1;
            } else {
                dropped(self.at[r]);
                missing -= 1;
            }
        }
        self.nodes.truncate(w);
        self.at.truncate(w);
    }

    /// Keeps exactly `kept` (ascending, a subset of the nodes); equal runs of the two node lists
    /// are skipped eight at a time, so the cost is the drop-outs plus a fast scan.
    fn keep_only(&mut self, kept: &[NodeId], mut dropped: impl FnMut(u32)) {
        const RUN: usize = 8;
        let n = self.nodes.len();
        // `i` reads the old lists, `j` (≤ i) is both the position in `kept` and the write index.
        let (mut i, mut j) = (0, 0);
        while j < kept.len() {
            while i + RUN <= n
                && j + RUN <= kept.len()
                && self.nodes[i..i + RUN] == kept[j..j + RUN]
            {
                if i != j {
                    self.at.copy_within(i..i + RUN, j);
                }
                i += RUN;
                j += RUN;
            }
            if j == kept.len() {
                break;
            }
            if self.nodes[i] == kept[j] {
                self.at[j] = self.at[i];
                j += 1;
            } else {
                dropped(self.at[i]);
            }
            i += 1;
        }
        for r in i..n {
            dropped(self.at[r]);
        }
        self.at.truncate(kept.len());
        self.nodes.clear();
        self.nodes.extend_from_slice(kept);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(node, l12)` of every node in `m`.
    fn held(m: &PrefixMatch) -> Vec<(NodeId, u32)> {
        m.node_ids()
            .iter()
            .copied()
            .zip(m.l12().iter().copied())
            .collect()
    }

    #[test]
    fn a_run_ends_where_the_query_leaves_the_chain_at_any_position() {
        // A 70-block chain in consecutive slots: the walk compares it 16 slots at a time, so a
        // query that leaves it at each position (before, at and after chunk boundaries) checks
        // the chunked compare and the tail loop.
        let chain: Vec<BlockHash> = (1..=70).collect();
        let mut d = Directory::new();
        d.store(1, Tier::L1, &chain, None, 1.0).unwrap();
        for k in 0..chain.len() {
            let mut q = chain.clone();
            q[k] = 1_000 + k as BlockHash;
            let m = d.match_prefix(&q);
            assert_eq!(m.cluster, k as u32, "query leaving at {k}");
            assert_eq!(held(&m), if k == 0 { vec![] } else { vec![(1, k as u32)] });
        }
        let m = d.match_prefix(&chain[..33]);
        assert_eq!((m.cluster, held(&m)), (33, vec![(1, 33)]));
    }

    #[test]
    fn a_run_stops_at_a_block_no_place_holds_and_at_a_fork() {
        let chain: Vec<BlockHash> = (1..=70).collect();
        for k in [1, 15, 16, 17, 31, 32, 48, 69] {
            let mut d = Directory::new();
            d.store(1, Tier::L1, &chain, None, 1.0).unwrap();
            // The block at `k` loses its only holder and stays known (it has a child).
            d.remove(1, Tier::L1, &chain[k..=k]);
            let m = d.match_prefix(&chain);
            assert_eq!(
                (m.cluster, held(&m)),
                (k as u32, vec![(1, k as u32)]),
                "gap at {k}"
            );
            d.check_invariants();
        }
        // Node 2 forks off at block 40 (its blocks follow in new slots), node 3 holds 25 blocks
        // in L2; node 1 holds the chain to its end.
        let mut d = Directory::new();
        d.store(1, Tier::L1, &chain, None, 1.0).unwrap();
        let fork: Vec<BlockHash> = (500..530).collect();
        d.store(2, Tier::L1, &chain[..40], None, 1.0).unwrap();
        d.store(2, Tier::L1, &fork, Some(40), 1.0).unwrap();
        d.store(3, Tier::L2, &chain[..25], None, 1.0).unwrap();
        let m = d.match_prefix(&chain);
        assert_eq!((m.cluster, m.pool), (70, 25));
        assert_eq!(held(&m), vec![(1, 70), (2, 40), (3, 25)]);
        assert_eq!(m.l1(), &[70, 40, 0]);
        let q: Vec<BlockHash> = chain[..40].iter().chain(&fork).copied().collect();
        let m = d.match_prefix(&q);
        assert_eq!((m.cluster, m.pool), (70, 25));
        assert_eq!(held(&m), vec![(1, 40), (2, 70), (3, 25)]);
        d.check_invariants();
    }

    #[test]
    fn wide_lists_sit_where_the_count_falls() {
        // WIDE + 1 nodes hold a 40-block chain: no block but the first page drops a node, so
        // only it has lists (one of each kind).
        let nodes = crate::wide::WIDE + 1;
        let chain: Vec<BlockHash> = (1..=40).collect();
        let mut d = Directory::new();
        for node in 1..=nodes {
            d.store(node, Tier::L1, &chain, None, 1.0).unwrap();
        }
        assert_eq!(d.wide.lists(), [1, 1]);
        // The last node leaves the chain from block 20 on, leaf first in one event: block 20
        // falls (to WIDE nodes) and gets lists; the blocks below it, whose parent went next, none.
        let mut tail: Vec<BlockHash> = chain[20..].to_vec();
        tail.reverse();
        d.remove(nodes, Tier::L1, &tail);
        assert_eq!(d.wide.lists(), [2, 2]);
        let m = d.match_prefix(&chain);
        let mut want: Vec<(NodeId, u32)> = (1..nodes).map(|n| (n, 40)).collect();
        want.push((nodes, 20));
        assert_eq!(held(&m), want);
        d.check_invariants();
        // Stored again in chain order, block 20 no longer falls and its lists go.
        d.store(nodes, Tier::L1, &chain[20..], Some(20), 2.0)
            .unwrap();
        assert_eq!(d.wide.lists(), [1, 1]);
        assert_eq!(held(&d.match_prefix(&chain)).last(), Some(&(nodes, 40)));
        d.check_invariants();
    }

    #[test]
    fn a_nodes_figures_are_found_by_its_id() {
        let mut d = Directory::new();
        let chain: Vec<BlockHash> = (1..=6).collect();
        d.store(3, Tier::L1, &chain[..4], None, 1.0).unwrap();
        d.store(3, Tier::L2, &chain[4..], Some(4), 1.0).unwrap();
        d.store(7, Tier::L2, &chain[..2], None, 1.0).unwrap();
        let m = d.match_prefix(&chain);
        assert_eq!(m.node(3), (4, 6));
        assert_eq!(m.node(7), (0, 2));
        for absent in [0, 4, 8, NodeId::MAX] {
            assert_eq!(m.node(absent), (0, 0));
        }
    }

    #[test]
    fn l1_shares_l12s_array_until_the_counts_part() {
        let mut d = Directory::new();
        let chain: Vec<BlockHash> = (1..=6).collect();
        d.store(1, Tier::L1, &chain, None, 1.0).unwrap();
        d.store(2, Tier::L1, &chain[..3], None, 1.0).unwrap();
        let m = d.match_prefix(&chain);
        assert_eq!(m.data.len(), 2 * m.len(), "no L2: one array serves both");
        assert_eq!((m.l1(), m.l12()), (&[6, 3][..], &[6, 3][..]));
        // Node 2's L2 copy of blocks 4 and 5 parts the counts at block 4.
        d.store(2, Tier::L2, &chain[3..5], Some(3), 1.0).unwrap();
        let m = d.match_prefix(&chain);
        assert_eq!(m.data.len(), 3 * m.len());
        assert_eq!((m.l1(), m.l12()), (&[6, 3][..], &[6, 5][..]));
        // Equal however stored: `new` shares equal arrays.
        let shared = PrefixMatch::new(&[1, 2], &[6, 3], &[6, 3], 0, 6);
        let mut split = shared.clone();
        split.split_l1();
        assert_eq!(shared.data.len(), 4);
        assert_eq!(split.data.len(), 6);
        assert_eq!(shared, split);
        assert_ne!(shared, PrefixMatch::new(&[1, 2], &[6, 2], &[6, 3], 0, 6));
    }

    #[test]
    fn keep_only_reports_every_gap_with_its_index() {
        let all: Vec<u32> = (0..100).map(|n| n * 3).collect();
        let mut alive = Alive::new(all.clone());
        let kept: Vec<u32> = all
            .iter()
            .copied()
            .filter(|n| n % 7 != 3 && *n != 297)
            .collect();
        let mut gone = Vec::new();
        alive.keep_only(&kept, |i| gone.push(all[i as usize]));
        let want: Vec<u32> = all
            .iter()
            .copied()
            .filter(|n| n % 7 == 3 || *n == 297)
            .collect();
        assert_eq!(gone, want);
        assert_eq!(alive.nodes, kept);
        assert!(alive
            .at
            .iter()
            .zip(&alive.nodes)
            .all(|(&i, &n)| all[i as usize] == n));
        gone.clear();
        alive.keep_only(&[], |i| gone.push(all[i as usize]));
        assert_eq!(gone, kept);
    }
}
