//! Holdings and everything derived from them, kept up to date incrementally:
//! - each holder's count of children held at the same place, and the eviction index of candidates
//!   (holders with no held child), keyed `(R_b > 0, T_b, -depth, hash)`;
//! - the "rooted" flags and the per-block counts `full_node`/`full_l1` of places that hold the
//!   block's whole prefix, which `match` uses to skip blocks where no node drops out.
//!
//! Storing a chain under a held parent and evicting a leaf touch O(1) index entries and scan no
//! child lists; only holdings that open or close a gap inside a node's prefix walk down the node's
//! held descendants.

use crate::directory::Directory;
use crate::eviction::EvKey;
use crate::holder_list::Holder;
use crate::table::{lower_bound, lower_bound_near, NIL};
use crate::wide::Kind;
use crate::{NodeId, Place, Tier};
use smallvec::SmallVec;

/// Counters of the place a chain is being stored at, read once per chain and written back once
/// (`Directory::store_valid`), so that storing a block costs no look-up in the places map.
pub(crate) struct ChainPlace {
    pub(crate) place: Place,
    /// Orphans at `place` and at the node's other tier, kept current while the chain is stored.
    pub(crate) orphans: u64,
    pub(crate) other_orphans: u64,
    pub(crate) newly_held: u64,
    /// The chain's blocks are moving here from the node's other tier (`demote`): the node holds
    /// them throughout, so its whole-prefix flags and counts stay as they are.
    pub(crate) moving: bool,
    /// The block `add_holder` held last: the next block's parent while the chain goes on.
    last: Option<LastHeld>,
}

/// A block just held at a chain's place: where its entry sits in the block's holders and the
/// entry's flags. The next block of the chain reads its parent's state from here instead of
/// binary-searching the parent's holders three times (a known prefix shared by tens of nodes
/// made those searches the largest part of `store`). Nothing moves the entry in between: the
/// next block's `add_holder` changes only the parent's held-children count.
#[derive(Clone, Copy)]
struct LastHeld {
    idx: u32,
    pos: u32,
    root_tier: bool,
    root_node: bool,
}

impl ChainPlace {
    /// Where the last block held this place's entry: a guess for the next block's list.
    pub(crate) fn hint(&self) -> usize {
        self.last.map_or(0, |l| l.pos as usize)
    }
}

impl Directory {
    pub(crate) fn chain_place(&self, place: Place) -> ChainPlace {
        let orphans = |p: Place| self.places.get(&p).map_or(0, |s| s.orphans);
        ChainPlace {
            place,
            orphans: orphans(place),
            other_orphans: orphans(other_tier(place)),
            newly_held: 0,
            moving: false,
            last: None,
        }
    }

    /// Writes a chain's counters back.
    pub(crate) fn finish_chain(&mut self, ctx: &ChainPlace) {
        if ctx.newly_held > 0 {
            let state = self.places.entry(ctx.place).or_default();
            state.held += ctx.newly_held;
            state.orphans = ctx.orphans;
        }
    }

    pub(crate) fn key(&self, idx: u32, holder: &Holder) -> EvKey {
        let b = self.blocks.get(idx);
        EvKey::new(
            b.refcount > 0,
            holder.time,
            b.depth,
            self.blocks.hash(idx),
            idx,
        )
    }

    fn index(&mut self, place: Place, key: EvKey) {
        self.places.entry(place).or_default().candidates.insert(key);
    }

    fn unindex(&mut self, place: Place, key: &EvKey) {
        let removed = self
            .places
            .get_mut(&place)
            .is_some_and(|s| s.candidates.remove(key));
        debug_assert!(
            removed,
            "candidate {key:?} missing from the index of {place:?}"
        );
    }

    /// Holds `idx` at `place` with time `now` (refreshing it if already held). With `leaf_follows`
    /// the caller guarantees a child of `idx` will be held at `place` before the call returns
    /// (the next block of a stored chain), so `idx` is not entered in the index here. With
    /// `parent_in_chain` the parent is the previous block of that chain, already out of the index.
    pub(crate) fn add_holder(
        &mut self,
        idx: u32,
        ctx: &mut ChainPlace,
        now: f64,
        leaf_follows: bool,
        parent_in_chain: bool,
    ) {
        let place = ctx.place;
        let node = place.node();
        let b = self.blocks.get(idx);
        // One search finds the node's entries (adjacent: places sort by node, then tier), this
        // place's position among them and the node's entry in its other tier.
        let start = match ctx.last {
            // A chain's blocks are held by much the same places, so the place sits about where it
            // sat in the parent's list: search outward from there.
            Some(l) if l.idx == b.parent => {
                lower_bound_near(&b.holders, Place::node_start(node), l.pos as usize)
            }
            _ => lower_bound(&b.holders, Place::node_start(node)),
        };
        let mut pos = start;
        while b.holders.get(pos).is_some_and(|h| h.place < place) {
            pos += 1;
        }
        if b.holders.get(pos).is_some_and(|h| h.place == place) {
            self.refresh_held(idx, pos, ctx, now, leaf_follows);
            return;
        }
        // Not held here: any entry of the node is its other tier's.
        let other_tier = b
            .holders
            .get(start)
            .filter(|h| h.place.node() == node)
            .map(Holder::root_node);
        // A child of `idx` held here (or, for the node-level flag, held by the node in either tier)
        // would be an orphan there: with no orphans, no child list needs scanning.
        let scan_node = b.first_child != NIL && (ctx.orphans > 0 || ctx.other_orphans > 0);
        let held_children = if b.first_child == NIL || ctx.orphans == 0 {
            0
        } else {
            self.blocks
                .children(idx)
                .filter(|&c| self.blocks.get(c).holder(place).is_some())
                .count() as u32
        };
        let parent = b.parent;
        let parent_here = self.parent_entry(ctx, parent);
        let root_tier = place.tier() == Tier::L1
            && (parent == NIL || parent_here.is_some_and(|(_, rooted, _)| rooted));
        let root_node = other_tier.unwrap_or_else(|| {
            if parent == NIL {
                return true;
            }
            // Every entry of a node carries its ROOT_NODE flag.
            if let Some((_, _, rooted)) = parent_here {
                return rooted;
            }
            let p = self.blocks.get(parent);
            p.node_entries(node)
                .next()
                .is_some_and(|i| p.holders[i].root_node())
        });
        let orphan = parent != NIL && parent_here.is_none();
        // A block moving from the other tier was the node's all along: `full_node` and the
        // descendants' flags already count it (`remove_holder_in_chain` with `node_stays`).
        let node_new = other_tier.is_none() && !ctx.moving;
        let holder = Holder::new(place, held_children, now, root_tier, root_node);
        self.blocks.with_holders(idx, |hs| hs.insert(pos, holder));
        let block = self.blocks.get_mut(idx);
        if root_tier {
            block.full_l1 += 1;
            self.wide_changed(Kind::L1, idx, node, true, false);
        }
        if node_new && root_node {
            self.blocks.get_mut(idx).full_node += 1;
            self.wide_changed(Kind::Node, idx, node, true, false);
        }
        if let Some((ppos, _, _)) = parent_here {
            self.child_held_at(parent, ppos, place, !parent_in_chain);
        }
        if root_tier && held_children > 0 {
            self.propagate_root_tier(idx, place, true);
        }
        if node_new && root_node && scan_node {
            self.propagate_root_node(idx, node, true);
        }
        ctx.newly_held += 1;
        ctx.orphans = ctx.orphans + u64::from(orphan) - u64::from(held_children);
        ctx.last = Some(LastHeld {
            idx,
            pos: pos as u32,
            root_tier,
            root_node,
        });
        if held_children == 0 && !leaf_follows {
            let key = self.key(idx, &holder);
            self.index(place, key);
        }
    }

    /// `add_holder` of a block already held at the chain's place, at `pos`: a new time.
    fn refresh_held(
        &mut self,
        idx: u32,
        pos: usize,
        ctx: &mut ChainPlace,
        now: f64,
        leaf_follows: bool,
    ) {
        let place = ctx.place;
        let old = self.blocks.get(idx).holders[pos];
        if old.held_children() == 0 {
            let key = self.key(idx, &old);
            self.unindex(place, &key);
        }
        let h = &mut self.blocks.get_mut(idx).holders[pos];
        h.time = now;
        let h = *h;
        if h.held_children() == 0 && !leaf_follows {
            let key = self.key(idx, &h);
            self.index(place, key);
        }
        ctx.last = Some(LastHeld {
            idx,
            pos: pos as u32,
            root_tier: h.root_tier(),
            root_node: h.root_node(),
        });
    }

    /// The entry of `parent` (or `NIL`) at the chain's place, if any: (position, `ROOT_TIER`,
    /// `ROOT_NODE`), from the chain's last block when that is the parent.
    fn parent_entry(&self, ctx: &ChainPlace, parent: u32) -> Option<(usize, bool, bool)> {
        match ctx.last {
            _ if parent == NIL => None,
            Some(l) if l.idx == parent => Some((l.pos as usize, l.root_tier, l.root_node)),
            _ => {
                let p = self.blocks.get(parent);
                p.position(ctx.place)
                    .map(|i| (i, p.holders[i].root_tier(), p.holders[i].root_node()))
            }
        }
    }

    /// A child of `parent` became held at `place`, where `parent`'s entry is at `pos`.
    fn child_held_at(&mut self, parent: u32, pos: usize, place: Place, maintain_index: bool) {
        let ph = &mut self.blocks.get_mut(parent).holders[pos];
        debug_assert!(ph.place == place, "stale position of a parent's entry");
        ph.add_held_children(1);
        if ph.held_children() == 1 && maintain_index {
            let ph = *ph;
            let key = self.key(parent, &ph);
            self.unindex(place, &key);
        }
    }

    /// `place` no longer holds `idx`. Returns whether it did. Garbage is not collected here.
    pub(crate) fn remove_holder(&mut self, idx: u32, place: Place) -> bool {
        self.remove_holder_in_chain(idx, place, true, true, false)
    }

    /// `remove_holder` for a chain removed leaf first: with `!indexed` the caller left `idx` out
    /// of the index when its last child went (it was next), and with `!index_parent` the parent
    /// is removed next, so it is not entered in the index only to leave it again. With
    /// `node_stays` the caller holds the block in the node's other tier before anything reads
    /// the directory (`demote`), so the node-level flags and counts are left as they are.
    ///
    /// NOTE: without `node_stays`, demoting a block whose descendants the node holds in L2 (the
    /// chain's tail, demoted earlier) cleared their `ROOT_NODE` flags here and set them again in
    /// `add_holder`: two walks down the tail per demoted block, quadratic in a chain demoted a
    /// few blocks at a time (12% of a steady 3,072-GPU simulation).
    pub(crate) fn remove_holder_in_chain(
        &mut self,
        idx: u32,
        place: Place,
        indexed: bool,
        index_parent: bool,
        node_stays: bool,
    ) -> bool {
        let b = self.blocks.get(idx);
        let Some(pos) = b.position(place) else {
            return false;
        };
        let old = b.holders[pos];
        let parent = b.parent;
        // The parent's entry here, found once: nothing below changes the parent's list before
        // its held-children count is updated.
        let parent_pos = (parent != NIL)
            .then(|| self.blocks.get(parent).position(place))
            .flatten();
        let orphan = parent != NIL && parent_pos.is_none();
        let other_orphans = self.places.get(&other_tier(place)).map_or(0, |s| s.orphans);
        if old.held_children() == 0 && indexed {
            let key = self.key(idx, &old);
            self.unindex(place, &key);
        }
        // Demoted, the node's other-tier entry takes this one's place next: keep the buffer.
        self.blocks.with_holders(idx, |hs| {
            if node_stays {
                hs.remove_keep(pos)
            } else {
                hs.remove(pos)
            }
        });
        let node = place.node();
        let block = self.blocks.get_mut(idx);
        if old.root_tier() {
            block.full_l1 -= 1;
            self.wide_changed(Kind::L1, idx, node, false, !index_parent);
        }
        let block = self.blocks.get_mut(idx);
        let node_left = !node_stays && block.node_entries(node).is_empty();
        if node_left && old.root_node() {
            block.full_node -= 1;
            self.wide_changed(Kind::Node, idx, node, false, !index_parent);
        }
        if let Some(ppos) = parent_pos {
            let ph = &mut self.blocks.get_mut(parent).holders[ppos];
            ph.add_held_children(-1);
            if ph.held_children() == 0 && index_parent {
                let ph = *ph;
                let key = self.key(parent, &ph);
                self.index(place, key);
            }
        }
        if old.root_tier() && old.held_children() > 0 {
            self.propagate_root_tier(idx, place, false);
        }
        // The node's held children of `idx` are here (counted) or orphans in the other tier.
        if node_left && old.root_node() && (old.held_children() > 0 || other_orphans > 0) {
            self.propagate_root_node(idx, place.node(), false);
        }
        let state = self
            .places
            .get_mut(&place)
            .expect("a held block's place has a state");
        state.held -= 1;
        state.orphans = state.orphans + u64::from(old.held_children()) - u64::from(orphan);
        if state.held == 0 {
            debug_assert!(state.candidates.is_empty());
            self.places.remove(&place);
        }
        true
    }

    /// `node` gained (`on`) or lost its rooted flag of `kind` on block `idx`, whose count is
    /// already updated: its wide list follows, if it has or now needs one (`wide.rs`). With
    /// `parent_follows` the parent loses the same holder next (a chain removed leaf first), so
    /// the block's count will equal its parent's again: it gets no list meanwhile.
    #[inline]
    fn wide_changed(&mut self, kind: Kind, idx: u32, node: NodeId, on: bool, parent_follows: bool) {
        let b = self.blocks.get(idx);
        let has = self.blocks.has_wide(idx, kind);
        let falls = || {
            !parent_follows
                && (b.parent == NIL || kind.count(b) < kind.count(self.blocks.get(b.parent)))
        };
        let now = self.wide.changed(kind, idx, b, has, falls, node, on);
        if now != has {
            self.blocks.set_wide(idx, kind, now);
        }
    }

    /// The L1 place's holdings below `idx` gained (`on`) or lost their whole prefix at `place`.
    fn propagate_root_tier(&mut self, idx: u32, place: Place, on: bool) {
        let mut stack = vec![idx];
        while let Some(b) = stack.pop() {
            let kids: Vec<u32> = self
                .blocks
                .children(b)
                .filter(|&c| {
                    self.blocks
                        .get(c)
                        .holder(place)
                        .is_some_and(|h| h.root_tier() != on)
                })
                .collect();
            for c in kids {
                let block = self.blocks.get_mut(c);
                let h = block.holder_mut(place).expect("filtered on holding");
                h.set_root_tier(on);
                let has_children = h.held_children() > 0;
                if on {
                    block.full_l1 += 1;
                } else {
                    block.full_l1 -= 1;
                }
                self.wide_changed(Kind::L1, c, place.node(), on, false);
                if has_children {
                    stack.push(c);
                }
            }
        }
    }

    /// The node's holdings below `idx` (any tier) gained or lost their whole prefix.
    fn propagate_root_node(&mut self, idx: u32, node: NodeId, on: bool) {
        let mut stack = vec![idx];
        while let Some(b) = stack.pop() {
            let kids: Vec<u32> = self
                .blocks
                .children(b)
                .filter(|&c| {
                    let block = self.blocks.get(c);
                    block
                        .node_entries(node)
                        .next()
                        .is_some_and(|i| block.holders[i].root_node() != on)
                })
                .collect();
            for c in kids {
                let block = self.blocks.get_mut(c);
                for i in block.node_entries(node) {
                    block.holders[i].set_root_node(on);
                }
                if on {
                    block.full_node += 1;
                } else {
                    block.full_node -= 1;
                }
                self.wide_changed(Kind::Node, c, node, on, false);
                stack.push(c);
            }
        }
    }

    /// Sets the last-access time of the block's holder at `pos`; only a candidate (no held
    /// child) moves in the eviction index.
    pub(crate) fn refresh_at(&mut self, idx: u32, pos: usize, now: f64) {
        let old = self.blocks.get(idx).holders[pos];
        if old.held_children() == 0 {
            let key = self.key(idx, &old);
            self.unindex(old.place, &key);
        }
        let h = &mut self.blocks.get_mut(idx).holders[pos];
        h.time = now;
        let h = *h;
        if h.held_children() == 0 {
            let key = self.key(idx, &h);
            self.index(h.place, key);
        }
    }

    /// Sets `R_b`, re-keying the block's candidate entries when `R_b > 0` flips (the key's first
    /// field).
    pub(crate) fn set_refcount(&mut self, idx: u32, refcount: u32) {
        let b = self.blocks.get_mut(idx);
        if (b.refcount > 0) == (refcount > 0) {
            b.refcount = refcount;
            return;
        }
        let leaves: SmallVec<[Holder; 4]> = b
            .holders
            .iter()
            .filter(|h| h.held_children() == 0)
            .copied()
            .collect();
        for h in &leaves {
            let key = self.key(idx, h);
            self.unindex(h.place, &key);
        }
        self.blocks.get_mut(idx).refcount = refcount;
        for h in &leaves {
            let key = self.key(idx, h);
            self.index(h.place, key);
        }
    }
}

/// The same node's other tier.
fn other_tier(place: Place) -> Place {
    Place::new(
        place.node(),
        if place.tier() == Tier::L1 {
            Tier::L2
        } else {
            Tier::L1
        },
    )
}
