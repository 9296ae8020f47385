//! The directory: which (node, tier) holds which block, with last-access times and the eviction
//! index, plus validation and garbage collection (DESIGN §2).
//!
//! Invariants (checked by `Directory::check_invariants`, `invariants.rs`, in tests):
//! - every holder's `held_children` is the number of the block's children held at its place;
//! - a place's candidate set holds exactly the blocks held there with `held_children == 0`,
//!   each under the key built from its current refcount, time, depth and hash;
//! - a known block is held somewhere, referenced by a branch, or has children (garbage rule).

use hashbrown::HashMap;

use crate::branches::Branch;
use crate::events::{decode_batch, Event, EventBatch};
use crate::eviction::{EvKey, PlaceState, CANDIDATE_BYTES};
use crate::holder_list::{Holder, HolderList};
use crate::holders::ChainPlace;
use crate::table::{fold, Blocks, NIL};
use crate::wide::WideLists;
use crate::{check_time, BlockHash, BranchId, Error, NodeId, Place, Result, Tier};
use hashbrown::HashTable;

/// How many blocks ahead `store` and `touch` start loading the holders of a known prefix's blocks.
pub(crate) const PREFETCH_HOLDERS: usize = 4;

/// Sizes of the directory (`stats()` in Python).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Known blocks.
    pub blocks: u64,
    /// Known blocks no node holds (kept for a branch or as an inner node).
    pub placeholders: u64,
    /// Held (node, tier, block) triples.
    pub locations: u64,
    /// Held in L1.
    pub locations_l1: u64,
    /// Held in L2.
    pub locations_l2: u64,
    /// Nodes holding at least one block.
    pub nodes: u64,
    /// Live branches.
    pub branches: u64,
    /// Entries in the eviction indexes.
    pub candidates: u64,
    /// Events skipped by `apply_events` (DISK/EXTERNAL media, unknown event types).
    pub events_skipped: u64,
    /// Bytes held by the directory's structures, from their capacities.
    pub memory_bytes: u64,
}

/// Parents of blocks that earlier events of the same batch create (for batch validation).
type Overlay = HashMap<BlockHash, Option<BlockHash>>;

/// The cluster-wide KV directory. Not internally synchronised: the Python wrapper puts it behind
/// a read-write lock.
#[derive(Default)]
pub struct Directory {
    pub(crate) blocks: Blocks,
    pub(crate) places: HashMap<Place, PlaceState>,
    pub(crate) branches: HashMap<BranchId, Branch>,
    /// Rooted-node lists of wide blocks (see `wide`).
    pub(crate) wide: WideLists,
    /// While applying an event batch, blocks that may have become garbage; collected at the end
    /// so that a batch can be validated as a whole before it starts.
    deferred: Option<Vec<u32>>,
    events_skipped: u64,
    /// Slab indices of a stored chain's known prefix, kept between calls to spare an allocation.
    scratch: Vec<u32>,
}

impl Directory {
    /// An empty directory.
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of known blocks.
    #[must_use]
    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// Whether no block is known.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.blocks.len() == 0
    }

    /// Whether `hash` is a known block.
    #[must_use]
    pub fn contains(&self, hash: BlockHash) -> bool {
        self.blocks.find(hash).is_some()
    }

    /// `R_b`: live branches whose context contains `hash` (0 if unknown).
    #[must_use]
    pub fn refcount(&self, hash: BlockHash) -> u32 {
        self.blocks
            .find(hash)
            .map_or(0, |i| self.blocks.get(i).refcount)
    }

    /// Of `hashes`, those some node other than `node` holds in `tier`, in the order given
    /// (unknown hashes are not held anywhere). The simulator's shared pool keeps one host-memory
    /// copy of a block cluster-wide, as a key-value store does: a node demoting a block the pool
    /// already holds drops its own copy (`sim.kv.NodeKv`).
    #[must_use]
    pub fn held_elsewhere(&self, node: NodeId, tier: Tier, hashes: &[BlockHash]) -> Vec<BlockHash> {
        hashes
            .iter()
            .copied()
            .filter(|&h| {
                self.blocks.find(h).is_some_and(|i| {
                    self.blocks
                        .get(i)
                        .holders
                        .iter()
                        .any(|x| x.place.tier() == tier && x.place.node() != node)
                })
            })
            .collect()
    }

    /// Blocks `node` holds in `tier` (in both tiers, counted once per tier, when `None`).
    #[must_use]
    pub fn held(&self, node: NodeId, tier: Option<Tier>) -> u64 {
        let at = |t: Tier| self.places.get(&Place::new(node, t)).map_or(0, |s| s.held);
        match tier {
            Some(t) => at(t),
            None => at(Tier::L1) + at(Tier::L2),
        }
    }

    // ---- validation -------------------------------------------------------------------------

    /// The recorded parent of `hash`: `None` if unknown, `Some(None)` for a first page.
    #[allow(
        clippy::option_option,
        reason = "unknown vs first page vs child: the three cases"
    )]
    fn known_parent(
        &self,
        hash: BlockHash,
        overlay: Option<&Overlay>,
    ) -> Option<Option<BlockHash>> {
        match self.blocks.find(hash) {
            Some(idx) => {
                let p = self.blocks.get(idx).parent;
                Some((p != NIL).then(|| self.blocks.hash(p)))
            }
            None => overlay.and_then(|o| o.get(&hash).copied()),
        }
    }

    /// Checks that `hashes` under `parent` keeps the forest consistent.
    pub(crate) fn validate_chain(
        &self,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
    ) -> Result<()> {
        self.check_chain(parent, hashes, None, None)
    }

    /// Validation of one stored event of a batch: blocks created by earlier events (`overlay`)
    /// count as known; with `record`, the blocks this chain creates are added to it.
    fn validate_chain_in_batch(
        &self,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        overlay: &mut Overlay,
        record: bool,
    ) -> Result<()> {
        let mut created = Vec::new();
        self.check_chain(
            parent,
            hashes,
            Some(overlay),
            record.then_some(&mut created),
        )?;
        overlay.extend(created);
        Ok(())
    }

    /// The checks of `validate_chain`, reading blocks an event batch creates from `overlay` and
    /// collecting the ones this chain would create into `created`.
    fn check_chain(
        &self,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        overlay: Option<&Overlay>,
        mut created: Option<&mut Vec<(BlockHash, Option<BlockHash>)>>,
    ) -> Result<()> {
        if let Some(p) = parent {
            if self.known_parent(p, overlay).is_none() {
                return Err(Error::UnknownParent { parent: p });
            }
        }
        if let Some(hash) = first_duplicate(hashes, parent) {
            return Err(Error::DuplicateHash { hash });
        }
        let mut prev = parent;
        for (i, &h) in hashes.iter().enumerate() {
            self.blocks.prefetch_walk(hashes, i);
            match self.known_parent(h, overlay) {
                Some(known) if known != prev => {
                    return Err(Error::ParentMismatch {
                        hash: h,
                        parent: prev,
                        known_parent: known,
                    });
                }
                Some(_) => {}
                None => {
                    if let Some(c) = created.as_deref_mut() {
                        c.push((h, prev));
                    }
                }
            }
            prev = Some(h);
        }
        Ok(())
    }

    // ---- garbage ---------------------------------------------------------------------------

    /// Drops `idx` if it is garbage (held nowhere, no branch, no children), then its parent, …
    pub(crate) fn collect(&mut self, mut idx: u32) {
        if let Some(pending) = &mut self.deferred {
            pending.push(idx);
            return;
        }
        while idx != NIL && self.blocks.is_live(idx) {
            let b = self.blocks.get(idx);
            if !b.holders.is_empty() || b.refcount > 0 || b.first_child != NIL {
                break;
            }
            idx = self.blocks.drop_block(idx);
        }
    }

    /// The slab index of `hash`, created under `parent` if unknown (the caller validated).
    pub(crate) fn find_or_insert(&mut self, hash: BlockHash, parent: u32) -> u32 {
        match self.blocks.find(hash) {
            Some(idx) => {
                debug_assert_eq!(self.blocks.get(idx).parent, parent);
                idx
            }
            None => self.blocks.insert(hash, parent),
        }
    }

    // ---- public operations -----------------------------------------------------------------

    /// `(node, tier)` now holds the chain `hashes`; `parent` is the parent of `hashes[0]`.
    /// Every stored block's last-access time there becomes `now`.
    pub fn store(
        &mut self,
        node: NodeId,
        tier: Tier,
        hashes: &[BlockHash],
        parent: Option<BlockHash>,
        now: f64,
    ) -> Result<()> {
        let now = check_time(now)?;
        let place = Place::new(node, tier);
        let mut slots = std::mem::take(&mut self.scratch);
        slots.clear();
        // One pass validates, finds the known prefix and claims slots for the new tail; anything
        // unusual (an error to report, whichever it is) takes the full validation, which names
        // the right one.
        let scanned = self.scan_chain(parent, hashes, &mut slots);
        if let Some((parent_idx, known)) = scanned {
            self.store_scanned(place, parent_idx, &slots, known, hashes, now);
            self.scratch = slots;
            return Ok(());
        }
        self.scratch = slots;
        self.validate_chain(parent, hashes)?;
        self.store_valid(place, hashes, parent, now, true);
        Ok(())
    }

    /// The fast validation of `store`: `Some((parent's slab index, k))` when `hashes` is a known
    /// prefix of `k` blocks chained under `parent` followed by distinct unknown hashes — exactly
    /// the chains `validate_chain` accepts, as long as it returns `Some`: a known prefix whose
    /// parent links match is a downward path in the forest, so it repeats no hash and not
    /// `parent`; the rest is unknown, so it repeats none of those either. `slots` gets the slab
    /// indices of all of `hashes`: the known prefix's, then slots claimed for the new blocks
    /// (to `fill`). `None` means "ask `validate_chain`" (which may still accept a chain this pass
    /// did not); the directory is then unchanged.
    fn scan_chain(
        &mut self,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        slots: &mut Vec<u32>,
    ) -> Option<(u32, usize)> {
        let parent_idx = match parent {
            Some(p) => self.blocks.find(p)?,
            None => NIL,
        };
        let mut prev = parent_idx;
        let mut known = 0;
        let mut in_slab = false;
        for (i, &h) in hashes.iter().enumerate() {
            // A known chain is usually in consecutive slots (`next_in_slab`): no look-up.
            if prev != NIL {
                if let Some(idx) = self.blocks.next_in_slab(prev, h) {
                    in_slab = true;
                    slots.push(idx);
                    prev = idx;
                    known += 1;
                    continue;
                }
            }
            if !in_slab {
                self.blocks.prefetch_walk(hashes, i);
            }
            in_slab = false;
            let Some(idx) = self.blocks.find(h) else {
                break;
            };
            if self.blocks.get(idx).parent != prev {
                return None;
            }
            slots.push(idx);
            prev = idx;
            known += 1;
        }
        if known < hashes.len() {
            self.blocks.reserve(hashes.len() - known);
            for (i, &h) in hashes.iter().enumerate().skip(known) {
                self.blocks.prefetch_walk(hashes, i);
                let Ok(idx) = self.blocks.find_or_claim(h) else {
                    // A known block or a repeat after a new one: give the claims back.
                    for i in (known..slots.len()).rev() {
                        self.blocks.unclaim(slots[i], hashes[i]);
                    }
                    return None;
                };
                slots.push(idx);
            }
        }
        Some((parent_idx, known))
    }

    /// Stores a chain `scan_chain` accepted: `slots` are the slab indices of `hashes`, the first
    /// `known` of them known blocks, the rest claimed slots for new ones.
    fn store_scanned(
        &mut self,
        place: Place,
        parent_idx: u32,
        slots: &[u32],
        known: usize,
        hashes: &[BlockHash],
        now: f64,
    ) {
        let last = hashes.len().saturating_sub(1);
        let mut ctx = self.chain_place(place);
        let mut prev = parent_idx;
        for (i, &idx) in slots[..known].iter().enumerate() {
            if let Some(&ahead) = slots[..known].get(i + PREFETCH_HOLDERS) {
                // Where this place's entry was in the last block is where it most likely is there.
                self.blocks.get(ahead).holders.prefetch(ctx.hint());
            }
            self.add_holder(idx, &mut ctx, now, i < last, i > 0);
            prev = idx;
        }
        if known < hashes.len() {
            let idx = slots[known];
            self.blocks.fill(idx, hashes[known], prev, None);
            self.add_holder(idx, &mut ctx, now, known < last, known > 0);
            self.store_new_tail(
                place,
                idx,
                &slots[known + 1..],
                &hashes[known + 1..],
                now,
                &mut ctx,
            );
        }
        self.finish_chain(&ctx);
    }

    /// Stores a validated chain. `tail_is_new`: validation ran without an overlay, so once a hash
    /// is unknown every later one is too and can be inserted without another look-up.
    fn store_valid(
        &mut self,
        place: Place,
        hashes: &[BlockHash],
        parent: Option<BlockHash>,
        now: f64,
        tail_is_new: bool,
    ) {
        let mut prev = parent.map_or(NIL, |p| self.blocks.find(p).expect("validated parent"));
        let last = hashes.len().saturating_sub(1);
        let mut known = true;
        let mut ctx = self.chain_place(place);
        let mut i = 0;
        while i < hashes.len() {
            let h = hashes[i];
            let idx = if let Some(idx) = known.then(|| self.blocks.find(h)).flatten() {
                idx
            } else {
                known = !tail_is_new;
                self.blocks.insert(h, prev)
            };
            self.add_holder(idx, &mut ctx, now, i < last, i > 0);
            prev = idx;
            i += 1;
            if !known {
                break;
            }
        }
        if i < hashes.len() {
            let rest = &hashes[i..];
            self.blocks.reserve(rest.len());
            let slots: Vec<u32> = rest
                .iter()
                .map(|&h| {
                    self.blocks
                        .find_or_claim(h)
                        .unwrap_or_else(|_| unreachable!("validated: the tail is new"))
                })
                .collect();
            self.store_new_tail(place, prev, &slots, rest, now, &mut ctx);
        }
        self.finish_chain(&ctx);
    }

    /// The rest of a new tail under `prev`, the new block just stored: each block is new,
    /// childless and held only here. Nothing to look up, scan or re-index but the last block.
    fn store_new_tail(
        &mut self,
        place: Place,
        mut prev: u32,
        slots: &[u32],
        tail: &[BlockHash],
        now: f64,
        ctx: &mut ChainPlace,
    ) {
        if tail.is_empty() {
            return;
        }
        for (&idx, &h) in slots.iter().zip(tail) {
            let parent = self.blocks.get_mut(prev);
            debug_assert_eq!(parent.holders.len(), 1);
            let ph = &mut parent.holders[0];
            ph.add_held_children(1);
            let holder = Holder::new(place, 0, now, ph.root_tier(), ph.root_node());
            self.blocks.fill(idx, h, prev, Some(holder));
            prev = idx;
        }
        ctx.newly_held += tail.len() as u64;
        let key = self.key(prev, &self.blocks.get(prev).holders[0]);
        self.places.entry(place).or_default().candidates.insert(key);
    }

    /// `(node, tier)` no longer holds `hashes`; unknown or not-held hashes are ignored.
    pub fn remove(&mut self, node: NodeId, tier: Tier, hashes: &[BlockHash]) {
        let place = Place::new(node, tier);
        // Engines evict leaf first: when the next hash is this block's parent, the parent leaves
        // too, so it never enters the eviction index in between (two B-tree updates saved).
        let mut next = hashes.first().and_then(|&h| self.blocks.find(h));
        let mut indexed = true;
        for i in 0..hashes.len() {
            // A block that leaves the directory leaves the index too (`drop_block`): hint the
            // index's lines for the blocks ahead, whose look-ups would each wait on memory.
            self.blocks.prefetch_walk(hashes, i);
            let current = next;
            // Leaf first, the next hash is usually the current block's parent: read from its
            // record, not looked up in the index.
            next = hashes.get(i + 1).and_then(|&h| {
                current
                    .map(|c| self.blocks.get(c).parent)
                    .filter(|&p| p != NIL && self.blocks.hash(p) == h)
                    .or_else(|| self.blocks.find(h))
            });
            let Some(idx) = current else {
                indexed = true;
                continue;
            };
            let parent = self.blocks.get(idx).parent;
            let parent_next = parent != NIL && next == Some(parent) && {
                let p = self.blocks.get(parent);
                // The next step compares the grandparent's hash with the hash after next: the
                // record and the hash column's entry are asked for now.
                if p.parent != NIL {
                    self.blocks.prefetch(p.parent);
                }
                p.holder(place).is_some()
            };
            if self.remove_holder_in_chain(idx, place, indexed, !parent_next, false) {
                self.collect(idx);
                indexed = !parent_next;
            } else {
                indexed = true;
            }
        }
    }

    /// Drops everything `node` holds, in `tier` or (with `None`) in both tiers.
    pub fn clear(&mut self, node: NodeId, tier: Option<Tier>) {
        for t in Tier::ALL
            .into_iter()
            .filter(|&t| tier.is_none_or(|x| x == t))
        {
            let place = Place::new(node, t);
            // Every held block is a candidate or an ancestor of one through held blocks, so
            // evicting until the index is empty removes exactly the place's holdings.
            while let Some(key) = self
                .places
                .get(&place)
                .and_then(|s| s.candidates.first().copied())
            {
                self.remove_holder(key.idx, place);
                self.collect(key.idx);
            }
            debug_assert!(!self.places.contains_key(&place));
        }
    }

    /// The current eviction candidates of `(node, tier)`, first to evict first.
    #[must_use]
    pub fn eviction_order(&self, node: NodeId, tier: Tier, limit: Option<usize>) -> Vec<BlockHash> {
        self.places
            .get(&Place::new(node, tier))
            .map_or_else(Vec::new, |s| {
                s.candidates
                    .iter()
                    .take(limit.unwrap_or(usize::MAX))
                    .map(|k| k.hash)
                    .collect()
            })
    }

    /// Removes up to `n` blocks from `(node, tier)`, one at a time, always the first candidate;
    /// returns them in the order removed.
    pub fn evict(&mut self, node: NodeId, tier: Tier, n: usize) -> Vec<BlockHash> {
        self.pop_candidates(Place::new(node, tier), n, false)
            .into_iter()
            .map(|k| k.hash)
            .collect()
    }

    /// Removes up to `n` of `place`'s candidates, always the first, and returns their keys in
    /// order. Evicted, garbage goes as each block leaves (`evict`); demoted, the caller holds the
    /// blocks in the node's other tier before anything reads the directory (`demote`).
    fn pop_candidates(&mut self, place: Place, n: usize, demoted: bool) -> Vec<EvKey> {
        let mut out = Vec::new();
        while out.len() < n {
            // Popped, not read then removed: one B-tree descent per block instead of two.
            let Some(key) = self
                .places
                .get_mut(&place)
                .and_then(|s| s.candidates.pop_first())
            else {
                break;
            };
            let b = self.blocks.get(key.idx);
            if !demoted && b.holders.len() == 1 && b.refcount == 0 && b.parent != NIL {
                // Evicting walks a chain up from its leaf. This block leaves the index (its last
                // holder goes), so its parent, likely popped next, probably will too: hint the
                // parent's bucket now. (Where blocks stay held elsewhere, the hint is a waste.)
                self.blocks.prefetch_hash(self.blocks.hash(b.parent));
            }
            self.remove_holder_in_chain(key.idx, place, false, true, demoted);
            if !demoted {
                self.collect(key.idx);
            }
            out.push(key);
        }
        out
    }

    /// Evicts up to `n` blocks from `node`'s L1 in eviction order, as `evict` does, and holds each
    /// in the node's L2 with last access `now` (`HiCache`'s write-back of what leaves the GPU).
    /// Returns the blocks in the order evicted (children before parents), each with its parent
    /// (`None` for a first page): reversed, the blocks form runs of parent-child chains, each
    /// under a block the node still holds in L1 or a first page, which is how an engine reports
    /// them (one `BlockStored` per run).
    ///
    /// NOTE: one call instead of `evict` then a `store` per run: the blocks never leave the
    /// directory in between, so a caller needs no record of their parents (the simulator kept
    /// one of every chain it ever stored for this), and L2 is written parents first, so only a
    /// run's first block can be an orphan there.
    pub fn demote(
        &mut self,
        node: NodeId,
        n: usize,
        now: f64,
    ) -> Result<Vec<(BlockHash, Option<BlockHash>)>> {
        let now = check_time(now)?;
        // Not collected: the blocks are about to be held in L2.
        let victims: Vec<u32> = self
            .pop_candidates(Place::new(node, Tier::L1), n, true)
            .iter()
            .map(|k| k.idx)
            .collect();
        let mut ctx = self.chain_place(Place::new(node, Tier::L2));
        ctx.moving = true;
        let parent_of = |d: &Self, i: usize| d.blocks.get(victims[i]).parent;
        for i in (0..victims.len()).rev() {
            // Reversed, a victim's parent is the one just held when the run goes on, and the
            // next one is its child when the run goes on (`add_holder`'s shortcuts).
            let parent_in_chain = i + 1 < victims.len() && parent_of(self, i) == victims[i + 1];
            let leaf_follows = i > 0 && parent_of(self, i - 1) == victims[i];
            self.add_holder(victims[i], &mut ctx, now, leaf_follows, parent_in_chain);
        }
        self.finish_chain(&ctx);
        // One pass over the victims: each list gets its tight buffer back, and its block's
        // record, in cache for that, gives the result.
        let mut out = Vec::with_capacity(victims.len());
        for &idx in &victims {
            self.blocks.with_holders(idx, HolderList::shrink_to_fit);
            let b = self.blocks.get(idx);
            out.push((
                self.blocks.hash(idx),
                (b.parent != NIL).then(|| self.blocks.hash(b.parent)),
            ));
        }
        Ok(out)
    }

    /// Decodes one SGLang `KVEventBatch` and applies it as `node`'s events; returns the number of
    /// events applied. Nothing changes if the bytes are corrupt or a chain is invalid.
    pub fn apply_events(&mut self, node: NodeId, payload: &[u8], now: f64) -> Result<usize> {
        let batch = decode_batch(payload)?;
        self.apply_batch(node, &batch, now)
    }

    /// Applies a decoded batch (see [`Directory::apply_events`]).
    pub fn apply_batch(&mut self, node: NodeId, batch: &EventBatch, now: f64) -> Result<usize> {
        let now = check_time(now)?;
        // A batch of one store (an engine iteration that cached one chain, the common case) is
        // exactly a `store`: it validates while it looks blocks up, and fails with nothing changed.
        if let [Event::Stored {
            hashes,
            parent,
            tier: Some(tier),
        }] = batch.events.as_slice()
        {
            self.store(node, *tier, hashes, *parent, now)?;
            return Ok(1);
        }
        let mut overlay = Overlay::new();
        // Per event: whether its chain touches a block an earlier event of the batch creates. If
        // not, what validation found unknown is still unknown when the event applies, and the
        // chain's new tail takes the fast path of a direct `store`.
        let mut fresh_tail = Vec::with_capacity(batch.events.len());
        let stores = |ev: &Event| matches!(ev, Event::Stored { tier: Some(_), .. });
        let last_store = batch.events.iter().rposition(stores);
        for (i, ev) in batch.events.iter().enumerate() {
            if let Event::Stored {
                hashes,
                parent,
                tier: Some(_),
            } = ev
            {
                let touched = !overlay.is_empty()
                    && hashes.iter().chain(parent).any(|h| overlay.contains_key(h));
                fresh_tail.push(!touched);
                // No later event consults what the last store creates: do not record it.
                let record = Some(i) != last_store;
                self.validate_chain_in_batch(*parent, hashes, &mut overlay, record)?;
            }
        }
        self.deferred = Some(Vec::new());
        let mut applied = 0;
        let mut fresh_tail = fresh_tail.into_iter();
        for ev in &batch.events {
            match ev {
                Event::Stored {
                    hashes,
                    parent,
                    tier: Some(tier),
                } => {
                    let fresh = fresh_tail.next().unwrap_or(false);
                    self.store_valid(Place::new(node, *tier), hashes, *parent, now, fresh);
                }
                Event::Removed {
                    hashes,
                    tier: Some(tier),
                } => self.remove(node, *tier, hashes),
                Event::Cleared => self.clear(node, None),
                Event::Stored { tier: None, .. }
                | Event::Removed { tier: None, .. }
                | Event::Unknown => {
                    self.events_skipped += 1;
                    continue;
                }
            }
            applied += 1;
        }
        for idx in self.deferred.take().unwrap_or_default() {
            self.collect(idx);
        }
        Ok(applied)
    }

    /// Sizes and memory of the directory: O(nodes), from counters.
    #[must_use]
    pub fn stats(&self) -> Stats {
        let (mut l1, mut l2) = (0u64, 0u64);
        let mut nodes: Vec<NodeId> = Vec::with_capacity(self.places.len());
        let mut candidates = 0u64;
        for (place, s) in &self.places {
            match place.tier() {
                Tier::L1 => l1 += s.held,
                Tier::L2 => l2 += s.held,
            }
            candidates += s.candidates.len() as u64;
            nodes.push(place.node());
        }
        nodes.sort_unstable();
        nodes.dedup();

        let branch_bytes: usize = self
            .branches
            .values()
            .map(|b| {
                b.context.capacity() * 4
                    + b.hashes.capacity() * 8
                    + std::mem::size_of::<(BranchId, Branch)>()
                    + 1
            })
            .sum();
        let place_bytes = self.places.capacity() * (std::mem::size_of::<(Place, PlaceState)>() + 1);
        let memory = self.blocks.memory_bytes()
            + candidates as usize * CANDIDATE_BYTES
            + branch_bytes
            + place_bytes
            + self.wide.memory_bytes();
        Stats {
            blocks: self.blocks.len() as u64,
            placeholders: self.blocks.unheld() as u64,
            locations: l1 + l2,
            locations_l1: l1,
            locations_l2: l2,
            nodes: nodes.len() as u64,
            branches: self.branches.len() as u64,
            candidates,
            events_skipped: self.events_skipped,
            memory_bytes: memory as u64,
        }
    }
}

/// The first hash that occurs twice in `parent` + `hashes`, if any.
fn first_duplicate(hashes: &[BlockHash], parent: Option<BlockHash>) -> Option<BlockHash> {
    let n = hashes.len() + usize::from(parent.is_some());
    if n <= 16 {
        let all: smallvec::SmallVec<[BlockHash; 16]> =
            parent.into_iter().chain(hashes.iter().copied()).collect();
        return all
            .iter()
            .enumerate()
            .find(|&(i, h)| all[..i].contains(h))
            .map(|(_, &h)| h);
    }
    let mut seen: HashTable<BlockHash> = HashTable::with_capacity(n);
    for h in parent.into_iter().chain(hashes.iter().copied()) {
        match seen.entry(fold(h), |&x| x == h, |&x| fold(x)) {
            hashbrown::hash_table::Entry::Occupied(_) => return Some(h),
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(h);
            }
        }
    }
    None
}
