//! Sorted lists of the nodes that hold a *wide* block's whole prefix, kept where `match` reads
//! them: at first pages and where the count of such nodes falls below the parent's.
//!
//! `match` finds the nodes that drop out at a block by comparing the nodes still counting with
//! the block's rooted holders. For a block held by a few nodes that is a short merge over its
//! holders; for a block under a prefix shared by hundreds of nodes (a system prompt, a forked
//! agent's history) a merge would cost a pass over hundreds of holders at every block where one
//! node drops out. Wide blocks therefore keep their rooted nodes as a plain sorted `u32` list, and
//! the drop-outs are the gaps between two such lists (`matching::Alive::keep_only`).
//!
//! `match` reads a block's rooted nodes only at a first page and where the count falls (a block
//! whose count equals its parent's drops no node), so only such blocks get a list. NOTE: a list on
//! every wide block cost an insert into each block's list when a node stored a shared prefix (a
//! 1,500-block prefix held by ~32 nodes: a third of a store's time, 5 bytes per entry), for lists
//! that `match` never read. Whether a block falls is judged when its own count changes, against its
//! parent's count then: a chain stored or removed in order keeps each block's fall as it was, so
//! lists are neither built nor dropped along it. A parent's later change can leave a list on a
//! block that no longer falls (kept exact, dropped at the block's next change) or a falling block
//! without one (`match` merges its holders instead): results never depend on the lists.
//!
//! A block gets a list when its count reaches `WIDE` and loses it below `NARROW` (the gap keeps a
//! block that hovers around the threshold from building and dropping its list on every change).

use hashbrown::HashMap;

use crate::table::Block;
use crate::{NodeId, Tier};

// Debug builds (all tests) use tiny thresholds so that the lists are built, updated and dropped
// constantly, including in the three-node differential test; results never depend on them.
pub(crate) const WIDE: u32 = if cfg!(debug_assertions) { 2 } else { 32 };
const NARROW: u32 = if cfg!(debug_assertions) { 1 } else { 16 };

/// Which rooted set a list holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Nodes holding the whole prefix in some tier (`ROOT_NODE`, counted by `full_node`).
    Node,
    /// Nodes holding the whole prefix in L1 (`ROOT_TIER`, counted by `full_l1`).
    L1,
}

impl Kind {
    pub(crate) fn count(self, b: &Block) -> u32 {
        match self {
            Kind::Node => b.full_node,
            Kind::L1 => b.full_l1,
        }
    }

    /// The block's rooted nodes of this kind, ascending (holders are sorted by place).
    pub(crate) fn rooted(self, b: &Block) -> Vec<NodeId> {
        let mut out = Vec::with_capacity(b.holders.len());
        out.extend(
            b.holders
                .iter()
                .filter(|h| match self {
                    Kind::Node => h.root_node(),
                    Kind::L1 => h.place.tier() == Tier::L1 && h.root_tier(),
                })
                .map(|h| h.place.node()),
        );
        out.dedup();
        out
    }
}

/// The lists of both kinds, keyed by slab index.
#[derive(Default)]
pub(crate) struct WideLists {
    node: HashMap<u32, Vec<NodeId>>,
    l1: HashMap<u32, Vec<NodeId>>,
}

impl WideLists {
    fn map(&mut self, kind: Kind) -> &mut HashMap<u32, Vec<NodeId>> {
        match kind {
            Kind::Node => &mut self.node,
            Kind::L1 => &mut self.l1,
        }
    }

    /// The list of a wide block (`has`: its flag says it has one).
    pub(crate) fn get(&self, kind: Kind, idx: u32, has: bool) -> Option<&[NodeId]> {
        if !has {
            return None;
        }
        match kind {
            Kind::Node => self.node.get(&idx),
            Kind::L1 => self.l1.get(&idx),
        }
        .map(Vec::as_slice)
    }

    /// The block's rooted nodes of this kind, ascending: its list if it has one (4 bytes a node),
    /// else from its holders (16 bytes an entry).
    pub(crate) fn rooted(&self, kind: Kind, idx: u32, has: bool, b: &Block) -> Vec<NodeId> {
        self.get(kind, idx, has)
            .map_or_else(|| kind.rooted(b), <[NodeId]>::to_vec)
    }

    /// `node` gained (`on`) or lost its rooted flag of `kind` on block `idx`, whose count and
    /// flags are already updated; `has`: the block has a list; `falls`: its count is below its
    /// parent's (or it is a first page), asked only where it decides. Returns whether the block
    /// has a list after.
    #[inline]
    #[allow(
        clippy::too_many_arguments,
        reason = "the change, and what the caller knows of it"
    )]
    pub(crate) fn changed(
        &mut self,
        kind: Kind,
        idx: u32,
        b: &Block,
        has: bool,
        falls: impl FnOnce() -> bool,
        node: NodeId,
        on: bool,
    ) -> bool {
        if !has && kind.count(b) < WIDE {
            return false;
        }
        self.update(kind, idx, b, has, falls(), node, on)
    }

    /// `changed` for a block with a list before or after the change (out of line: most blocks
    /// have none, and `store` called `changed` once per stored block only to return).
    #[inline(never)]
    #[allow(clippy::too_many_arguments, reason = "changed's arguments, passed on")]
    fn update(
        &mut self,
        kind: Kind,
        idx: u32,
        b: &Block,
        has: bool,
        falls: bool,
        node: NodeId,
        on: bool,
    ) -> bool {
        let count = kind.count(b);
        let map = self.map(kind);
        if !has {
            if falls {
                map.insert(idx, kind.rooted(b));
            }
            return falls;
        }
        if count < NARROW || !falls {
            map.remove(&idx);
            return false;
        }
        let list = map.get_mut(&idx).expect("a flagged block has a list");
        match (list.binary_search(&node), on) {
            (Err(pos), true) => list.insert(pos, node),
            (Ok(pos), false) => {
                list.remove(pos);
            }
            _ => debug_assert!(false, "list of {idx} already says {on} for node {node}"),
        }
        true
    }

    /// Bytes held by the lists.
    pub(crate) fn memory_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(u32, Vec<NodeId>)>() + 1;
        [&self.node, &self.l1]
            .iter()
            .map(|m| m.capacity() * entry + m.values().map(|v| v.capacity() * 4).sum::<usize>())
            .sum()
    }

    /// Checks the lists against the blocks (tests): a block has a list exactly when its flag
    /// says so, and a list is exactly its block's rooted nodes, at `NARROW` or more.
    pub(crate) fn check(&self, idx: u32, hash: crate::BlockHash, b: &Block, has: [bool; 2]) {
        for (kind, has) in [Kind::Node, Kind::L1].into_iter().zip(has) {
            let list = self.get(kind, idx, true);
            assert_eq!(list.is_some(), has, "{kind:?} list flag of {hash}");
            if let Some(list) = list {
                assert!(kind.count(b) >= NARROW, "list of narrow block {hash}");
                assert_eq!(list, kind.rooted(b).as_slice(), "{kind:?} list of {hash}");
            }
        }
    }

    /// Blocks with a list of each kind (tests).
    #[cfg(test)]
    pub(crate) fn lists(&self) -> [usize; 2] {
        [self.node.len(), self.l1.len()]
    }
}
