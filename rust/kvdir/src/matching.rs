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
use std::cmp::Ordering;

use crate::table::{Block, Holder, NIL};
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
        let mut path = self.walk(hashes).map(|i| self.blocks.get(i));
        let Some(first) = path.next().filter(|b| !b.holders.is_empty()) else {
            return PrefixMatch::default();
        };
        // One result per node holding the first block: exactly the nodes with l12 > 0.
        // (node, l1, l12); counts are filled in when a node drops out or the walk ends.
        let mut res: Vec<(NodeId, u32, u32)> = Vec::with_capacity(first.holders.len());
        // (node, index into res) of the nodes still counting l12, and l1.
        let mut alive1: Vec<(NodeId, u32)> = Vec::with_capacity(first.holders.len());
        for h in &first.holders {
            if res.last().is_none_or(|r| r.0 != h.place.node()) {
                res.push((h.place.node(), 0, 0));
            }
            if h.place.tier() == Tier::L1 {
                alive1.push((h.place.node(), res.len() as u32 - 1));
            }
        }
        let mut alive: Vec<(NodeId, u32)> = res
            .iter()
            .enumerate()
            .map(|(i, r)| (r.0, i as u32))
            .collect();
        let has_l2 = |b: &Block| b.holders.iter().any(|h| h.place.tier() == Tier::L2);
        let mut pool = u32::from(has_l2(first));
        let mut depth = 1u32;
        // While every node still counting l12 also counts l1 (L1 holds their whole prefix so far),
        // one pass serves both counts: the common case of clusters without host-tier holdings.
        let mut shared = alive1.len() == alive.len();
        for b in path {
            if b.holders.is_empty() {
                break;
            }
            if shared && b.full_l1 != b.full_node {
                shared = false;
                alive1.clone_from(&alive);
            }
            if (b.full_node as usize) < alive.len() {
                let missing = alive.len() - b.full_node as usize;
                drop_out(
                    &mut alive,
                    missing,
                    b,
                    |h, node| h.place.node().cmp(&node),
                    Holder::root_node,
                    |ri| {
                        let r = &mut res[ri as usize];
                        r.2 = depth;
                        if shared {
                            r.1 = depth;
                        }
                    },
                );
            }
            if !shared && (b.full_l1 as usize) < alive1.len() {
                let missing = alive1.len() - b.full_l1 as usize;
                drop_out(
                    &mut alive1,
                    missing,
                    b,
                    |h, node| h.place.cmp(&Place::new(node, Tier::L1)),
                    Holder::root_tier,
                    |ri| res[ri as usize].1 = depth,
                );
            }
            if pool == depth && has_l2(b) {
                pool += 1;
            }
            depth += 1;
        }
        for &(_, r) in &alive {
            res[r as usize].2 = depth;
        }
        for &(_, r) in if shared { &alive } else { &alive1 } {
            res[r as usize].1 = depth;
        }
        PrefixMatch {
            node_ids: res.iter().map(|r| r.0).collect(),
            l1: res.iter().map(|r| r.1).collect(),
            l12: res.iter().map(|r| r.2).collect(),
            pool,
            cluster: depth,
        }
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

/// Removes from `alive` (sorted by node) the `missing` nodes that no longer hold the whole prefix
/// at `b`, calling `dropped` with each one's result index. One merge pass over the block's holders
/// (sorted the same way), stopping as soon as all `missing` nodes are found.
fn drop_out(
    alive: &mut Vec<(NodeId, u32)>,
    mut missing: usize,
    b: &Block,
    cmp: impl Fn(&Holder, NodeId) -> Ordering,
    rooted: impl Fn(&Holder) -> bool,
    mut dropped: impl FnMut(u32),
) {
    let hs = &b.holders;
    let (mut j, mut w) = (0, 0);
    for r in 0..alive.len() {
        let (node, ri) = alive[r];
        if missing == 0 {
            alive.copy_within(r.., w);
            w += alive.len() - r;
            break;
        }
        while j < hs.len() && cmp(&hs[j], node) == Ordering::Less {
            j += 1;
        }
        if j < hs.len() && cmp(&hs[j], node) == Ordering::Equal && rooted(&hs[j]) {
            alive[w] = alive[r];
            w += 1;
        } else {
            dropped(ri);
            missing -= 1;
        }
    }
    alive.truncate(w);
}
