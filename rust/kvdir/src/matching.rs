//! `match` and `touch`: walks of a query chain from its first page (DESIGN §2, "Match is
//! prefix-only").
//!
//! The walk follows child links rather than hashing every query block: a block's next query
//! block must be one of its children, and most blocks have one or a few. Per-node counts use the
//! blocks' `full_node`/`full_l1` counts (places holding the block's whole prefix): while a block's
//! count equals the number of nodes still counting, none of them dropped out and the block costs
//! O(1) however many nodes hold it; only at blocks where some node drops out are the still-counting
//! nodes checked against the block's holders. A 100-block query shared by 64 nodes thus costs about
//! 100 child steps plus one check per drop-out, not 6,400 holder visits.

use crate::directory::{Directory, PrefixMatch};
use crate::table::{Block, Holder, NIL};
use crate::wide::{dropped_between, Kind};
use crate::{BlockHash, NodeId, Place, Tier};

/// Children checked by following the sibling list before falling back to the hash table.
const SIBLING_SCAN: usize = 4;

impl Directory {
    /// The child of `idx` whose hash is `hash`.
    fn child(&self, idx: u32, hash: BlockHash) -> Option<u32> {
        let mut c = self.blocks.get(idx).first_child;
        for _ in 0..SIBLING_SCAN {
            if c == NIL {
                return None;
            }
            let b = self.blocks.get(c);
            if b.hash == hash {
                return Some(c);
            }
            c = b.next_sibling;
        }
        if c == NIL {
            return None;
        }
        self.blocks
            .find(hash)
            .filter(|&n| self.blocks.get(n).parent == idx)
    }

    /// Slab indices of the leading query blocks that are known and chained by parent links.
    fn walk<'a>(&'a self, hashes: &'a [BlockHash]) -> impl Iterator<Item = u32> + 'a {
        let mut prev = NIL;
        hashes.iter().map_while(move |&h| {
            let next = if prev == NIL {
                self.blocks
                    .find(h)
                    .filter(|&i| self.blocks.get(i).parent == NIL)
            } else {
                self.child(prev, h)
            }?;
            prev = next;
            Some(next)
        })
    }

    /// How much of the query chain (from its first page) each node, the pool and the cluster hold.
    #[must_use]
    pub fn match_prefix(&self, hashes: &[BlockHash]) -> PrefixMatch {
        let mut path = self.walk(hashes);
        let Some(first) = path
            .next()
            .map(|i| self.blocks.get(i))
            .filter(|b| !b.holders.is_empty())
        else {
            return PrefixMatch::default();
        };
        // Every node with l12 > 0 holds the first block; `res` is ascending by node.
        let mut res = PrefixMatch::default();
        for h in &first.holders {
            let node = h.place.node();
            if res.node_ids.last() != Some(&node) {
                res.node_ids.push(node);
            }
        }
        res.l1.resize(res.node_ids.len(), 0);
        res.l12.resize(res.node_ids.len(), 0);
        // The nodes still counting, ascending: those holding the whole path so far (in some tier;
        // in L1). While both sets agree, `alive1` stays empty and `alive` serves both counts.
        let mut alive: Vec<NodeId> = res.node_ids.clone();
        let mut alive1: Vec<NodeId> = Kind::L1.rooted(first);
        let mut shared = alive1 == alive;
        if shared {
            alive1.clear();
        }
        let has_l2 = |b: &Block| b.holders.iter().any(|h| h.place.tier() == Tier::L2);
        let (mut pool, mut depth) = (u32::from(has_l2(first)), 1u32);
        for idx in path {
            let b = self.blocks.get(idx);
            if b.holders.is_empty() {
                break;
            }
            if shared && b.full_l1 != b.full_node {
                shared = false;
                alive1.clone_from(&alive);
            }
            let set =
                |counts: &mut Vec<u32>, node: NodeId| set_count(&res.node_ids, counts, node, depth);
            if (b.full_node as usize) < alive.len() {
                self.drop_out(&mut alive, Kind::Node, idx, |n| {
                    set(&mut res.l12, n);
                    if shared {
                        set(&mut res.l1, n);
                    }
                });
            }
            if !shared && (b.full_l1 as usize) < alive1.len() {
                self.drop_out(&mut alive1, Kind::L1, idx, |n| set(&mut res.l1, n));
            }
            if pool == depth && has_l2(b) {
                pool += 1;
            }
            depth += 1;
        }
        for (counts, nodes) in [
            (&mut res.l12, &alive),
            (&mut res.l1, if shared { &alive } else { &alive1 }),
        ] {
            for &n in nodes {
                set_count(&res.node_ids, counts, n, depth);
            }
        }
        res.pool = pool;
        res.cluster = depth;
        res
    }

    /// Removes from `alive` (ascending) the nodes that do not hold block `idx`'s whole prefix
    /// (`kind`), calling `dropped` for each. A wide block's rooted list is the new `alive`; for
    /// other blocks, one merge pass over the block's holders.
    fn drop_out(
        &self,
        alive: &mut Vec<NodeId>,
        kind: Kind,
        idx: u32,
        mut dropped: impl FnMut(NodeId),
    ) {
        if let Some(kept) = self.wide.get(kind, idx) {
            dropped_between(alive, kept, dropped);
            alive.clear();
            alive.extend_from_slice(kept);
            return;
        }
        let b = self.blocks.get(idx);
        let rooted = |h: &Holder| match kind {
            Kind::Node => h.root_node(),
            Kind::L1 => h.place.tier() == Tier::L1 && h.root_tier(),
        };
        let hs = &b.holders;
        let mut j = 0;
        alive.retain(|&node| {
            while j < hs.len() && hs[j].place.node() < node {
                j += 1;
            }
            // A node's entries are adjacent: check each (L1 first) for the flag.
            let mut k = j;
            let mut keep = false;
            while k < hs.len() && hs[k].place.node() == node {
                keep |= rooted(&hs[k]);
                k += 1;
            }
            if !keep {
                dropped(node);
            }
            keep
        });
    }

    /// Last-access time := `now` for the leading query blocks `node` holds, in every tier it
    /// holds them in; stops at the first block the node holds in no tier.
    pub fn touch(&mut self, node: NodeId, hashes: &[BlockHash], now: f64) -> crate::Result<()> {
        let now = crate::check_time(now)?;
        let places = [Place::new(node, Tier::L1), Place::new(node, Tier::L2)];
        let mut held = Vec::new();
        for idx in self.walk(hashes) {
            let b = self.blocks.get(idx);
            let tiers = places.map(|p| b.holder(p).is_some());
            if !tiers.contains(&true) {
                break;
            }
            held.push((idx, tiers));
        }
        for (idx, tiers) in held {
            for (p, _) in places.iter().zip(tiers).filter(|(_, t)| *t) {
                self.refresh(idx, *p, now);
            }
        }
        Ok(())
    }
}

/// `counts[i] = depth` for `node_ids[i] == node` (every node still counting held the first block,
/// so it is in `node_ids`).
fn set_count(node_ids: &[NodeId], counts: &mut [u32], node: NodeId, depth: u32) {
    let found = node_ids.binary_search(&node);
    debug_assert!(
        found.is_ok(),
        "node {node} counted without holding the first block"
    );
    if let Ok(i) = found {
        counts[i] = depth;
    }
}
