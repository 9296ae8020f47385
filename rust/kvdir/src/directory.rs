//! The directory: which (node, tier) holds which block, with last-access times and the eviction
//! index, plus validation and garbage collection (DESIGN §2).
//!
//! Invariants (checked by `Directory::check_invariants` in tests):
//! - every holder's `held_children` is the number of the block's children held at its place;
//! - a place's candidate set holds exactly the blocks held there with `held_children == 0`,
//!   each under the key built from its current refcount, time, depth and hash;
//! - a known block is held somewhere, referenced by a branch, or has children (garbage rule).

use hashbrown::HashMap;

use crate::branches::Branch;
use crate::events::{decode_batch, Event, EventBatch};
use crate::eviction::{EvKey, PlaceState, CANDIDATE_BYTES};
use crate::table::{Block, Blocks, Holder, NIL};
use crate::{check_time, BlockHash, BranchId, Error, NodeId, Place, Result, Tier};

/// How much of a query chain each place holds (the result of [`Directory::match_prefix`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Nodes with `l12 > 0`, ascending.
    pub node_ids: Vec<NodeId>,
    /// Leading query blocks in each node's L1.
    pub l1: Vec<u32>,
    /// Leading query blocks in each node's L1 ∪ L2.
    pub l12: Vec<u32>,
    /// Leading query blocks each held in the L2 of at least one node.
    pub pool: u32,
    /// Leading query blocks each held somewhere.
    pub cluster: u32,
}

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
    places: HashMap<Place, PlaceState>,
    pub(crate) branches: HashMap<BranchId, Branch>,
    /// While applying an event batch, blocks that may have become garbage; collected at the end
    /// so that a batch can be validated as a whole before it starts.
    deferred: Option<Vec<u32>>,
    events_skipped: u64,
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
                Some((p != NIL).then(|| self.blocks.get(p).hash))
            }
            None => overlay.and_then(|o| o.get(&hash).copied()),
        }
    }

    /// Checks that `hashes` under `parent` keeps the forest consistent. With an overlay (batch
    /// validation), blocks the chain would create are recorded in it.
    pub(crate) fn validate_chain(
        &self,
        parent: Option<BlockHash>,
        hashes: &[BlockHash],
        mut overlay: Option<&mut Overlay>,
    ) -> Result<()> {
        if let Some(p) = parent {
            if self.known_parent(p, overlay.as_deref()).is_none() {
                return Err(Error::UnknownParent { parent: p });
            }
        }
        if hashes.len() > 1 || parent.is_some() {
            let mut sorted: Vec<BlockHash> = hashes.iter().copied().chain(parent).collect();
            sorted.sort_unstable();
            if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                return Err(Error::DuplicateHash { hash: w[0] });
            }
        }
        let mut prev = parent;
        for &h in hashes {
            match self.known_parent(h, overlay.as_deref()) {
                Some(known) if known != prev => {
                    return Err(Error::ParentMismatch {
                        hash: h,
                        parent: prev,
                        known_parent: known,
                    });
                }
                Some(_) => {}
                None => {
                    if let Some(o) = overlay.as_deref_mut() {
                        o.insert(h, prev);
                    }
                }
            }
            prev = Some(h);
        }
        Ok(())
    }

    // ---- holders and the eviction index ----------------------------------------------------

    fn key(&self, idx: u32, holder: &Holder) -> EvKey {
        let b = self.blocks.get(idx);
        EvKey::new(b.refcount > 0, holder.time, b.depth, b.hash, idx)
    }

    fn place_mut(&mut self, place: Place) -> &mut PlaceState {
        self.places.entry(place).or_default()
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
    /// (the next block of a stored chain), so `idx` is never entered in the index here. With
    /// `parent_in_chain` the parent is the previous block of that chain, already out of the index.
    fn add_holder(
        &mut self,
        idx: u32,
        place: Place,
        now: f64,
        leaf_follows: bool,
        parent_in_chain: bool,
    ) {
        let b = self.blocks.get(idx);
        if let Some(pos) = b.holders.iter().position(|h| h.place == place) {
            let old = b.holders[pos];
            if old.held_children == 0 {
                let key = self.key(idx, &old);
                self.unindex(place, &key);
            }
            let h = &mut self.blocks.get_mut(idx).holders[pos];
            h.time = now;
            let h = *h;
            if h.held_children == 0 && !leaf_follows {
                let key = self.key(idx, &h);
                self.place_mut(place).candidates.insert(key);
            }
            return;
        }
        let held_children = if b.first_child == NIL {
            0
        } else {
            self.blocks
                .children(idx)
                .filter(|&c| self.blocks.get(c).holder(place).is_some())
                .count() as u32
        };
        let parent = b.parent;
        let holder = Holder {
            place,
            held_children,
            time: now,
        };
        let holders = &mut self.blocks.get_mut(idx).holders;
        let pos = holders.partition_point(|h| h.place < place);
        holders.insert(pos, holder);
        if parent != NIL {
            self.child_held(parent, place, !parent_in_chain);
        }
        let key = (held_children == 0 && !leaf_follows).then(|| self.key(idx, &holder));
        let state = self.place_mut(place);
        state.held += 1;
        if let Some(key) = key {
            state.candidates.insert(key);
        }
    }

    /// A child of `parent` became held at `place`.
    fn child_held(&mut self, parent: u32, place: Place, maintain_index: bool) {
        let Some(ph) = self.blocks.get_mut(parent).holder_mut(place) else {
            return;
        };
        ph.held_children += 1;
        if ph.held_children == 1 && maintain_index {
            let ph = *ph;
            let key = self.key(parent, &ph);
            self.unindex(place, &key);
        }
    }

    /// `place` no longer holds `idx`. Returns whether it did. Garbage is not collected here.
    fn remove_holder(&mut self, idx: u32, place: Place) -> bool {
        let b = self.blocks.get(idx);
        let Some(pos) = b.holders.iter().position(|h| h.place == place) else {
            return false;
        };
        let old = b.holders[pos];
        let parent = b.parent;
        if old.held_children == 0 {
            let key = self.key(idx, &old);
            self.unindex(place, &key);
        }
        let holders = &mut self.blocks.get_mut(idx).holders;
        holders.remove(pos);
        if holders.len() <= 1 {
            holders.shrink_to_fit();
        }
        if parent != NIL {
            if let Some(ph) = self.blocks.get_mut(parent).holder_mut(place) {
                ph.held_children -= 1;
                if ph.held_children == 0 {
                    let ph = *ph;
                    let key = self.key(parent, &ph);
                    self.place_mut(place).candidates.insert(key);
                }
            }
        }
        let state = self
            .places
            .get_mut(&place)
            .expect("a held block's place has a state");
        state.held -= 1;
        if state.held == 0 {
            debug_assert!(state.candidates.is_empty());
            self.places.remove(&place);
        }
        true
    }

    /// Sets the last-access time of a block already held at `place`.
    fn refresh(&mut self, idx: u32, place: Place, now: f64) {
        let Some(h) = self.blocks.get(idx).holder(place).copied() else {
            return;
        };
        if h.held_children == 0 {
            let key = self.key(idx, &h);
            self.unindex(place, &key);
        }
        let h = self.blocks.get_mut(idx).holder_mut(place).expect("held");
        h.time = now;
        let h = *h;
        if h.held_children == 0 {
            let key = self.key(idx, &h);
            self.place_mut(place).candidates.insert(key);
        }
    }

    /// Re-keys a block's candidate entries when `R_b > 0` flips (the key's first field).
    pub(crate) fn set_refcount(&mut self, idx: u32, refcount: u32) {
        let b = self.blocks.get_mut(idx);
        let flips = (b.refcount > 0) != (refcount > 0);
        if !flips {
            b.refcount = refcount;
            return;
        }
        let holders: Vec<Holder> = b
            .holders
            .iter()
            .filter(|h| h.held_children == 0)
            .copied()
            .collect();
        for h in &holders {
            let key = self.key(idx, h);
            self.unindex(h.place, &key);
        }
        self.blocks.get_mut(idx).refcount = refcount;
        for h in &holders {
            let key = self.key(idx, h);
            self.place_mut(h.place).candidates.insert(key);
        }
    }

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
        self.validate_chain(parent, hashes, None)?;
        self.store_valid(Place::new(node, tier), hashes, parent, now);
        Ok(())
    }

    fn store_valid(
        &mut self,
        place: Place,
        hashes: &[BlockHash],
        parent: Option<BlockHash>,
        now: f64,
    ) {
        let mut prev = parent.map_or(NIL, |p| self.blocks.find(p).expect("validated parent"));
        let last = hashes.len().saturating_sub(1);
        for (i, &h) in hashes.iter().enumerate() {
            let idx = self.find_or_insert(h, prev);
            self.add_holder(idx, place, now, i < last, i > 0);
            prev = idx;
        }
    }

    /// `(node, tier)` no longer holds `hashes`; unknown or not-held hashes are ignored.
    pub fn remove(&mut self, node: NodeId, tier: Tier, hashes: &[BlockHash]) {
        let place = Place::new(node, tier);
        for &h in hashes {
            if let Some(idx) = self.blocks.find(h) {
                if self.remove_holder(idx, place) {
                    self.collect(idx);
                }
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

    /// How much of the query chain (from its first page) each place holds.
    #[must_use]
    pub fn match_prefix(&self, hashes: &[BlockHash]) -> PrefixMatch {
        // (node, l1, l12), ascending by node; an entry is still counting while l12 == i.
        let mut active: Vec<(NodeId, u32, u32)> = Vec::new();
        let mut alive = 0usize;
        let (mut pool, mut cluster, mut pool_alive) = (0u32, 0u32, true);
        let mut prev = NIL;
        for (i, &h) in hashes.iter().enumerate() {
            let Some(idx) = self.blocks.find(h) else {
                break;
            };
            let b: &Block = self.blocks.get(idx);
            if b.parent != prev || b.holders.is_empty() {
                break;
            }
            prev = idx;
            cluster += 1;
            if pool_alive {
                if b.holders.iter().any(|x| x.place.tier() == Tier::L2) {
                    pool += 1;
                } else {
                    pool_alive = false;
                }
            }
            let i = i as u32;
            if i == 0 {
                for x in &b.holders {
                    let (node, in_l1) = (x.place.node(), u32::from(x.place.tier() == Tier::L1));
                    match active.last_mut() {
                        Some(e) if e.0 == node => e.1 |= in_l1,
                        _ => active.push((node, in_l1, 1)),
                    }
                }
                alive = active.len();
            } else if alive > 0 {
                // Merge the still-counting entries with this block's holders (both sorted).
                let mut j = 0;
                for e in active.iter_mut().filter(|e| e.2 == i) {
                    while j < b.holders.len() && b.holders[j].place.node() < e.0 {
                        j += 1;
                    }
                    let mut any = false;
                    let mut in_l1 = false;
                    while j < b.holders.len() && b.holders[j].place.node() == e.0 {
                        any = true;
                        in_l1 |= b.holders[j].place.tier() == Tier::L1;
                        j += 1;
                    }
                    if any {
                        e.2 += 1;
                        if in_l1 && e.1 == i {
                            e.1 += 1;
                        }
                    } else {
                        alive -= 1;
                    }
                }
            }
        }
        PrefixMatch {
            node_ids: active.iter().map(|e| e.0).collect(),
            l1: active.iter().map(|e| e.1).collect(),
            l12: active.iter().map(|e| e.2).collect(),
            pool,
            cluster,
        }
    }

    /// Last-access time := `now` for the leading query blocks `node` holds, in every tier it
    /// holds them in; stops at the first block the node holds in no tier.
    pub fn touch(&mut self, node: NodeId, hashes: &[BlockHash], now: f64) -> Result<()> {
        let now = check_time(now)?;
        let places = [Place::new(node, Tier::L1), Place::new(node, Tier::L2)];
        let mut prev = NIL;
        for &h in hashes {
            let Some(idx) = self.blocks.find(h) else {
                break;
            };
            let b = self.blocks.get(idx);
            let held = places.map(|p| b.holder(p).is_some());
            if b.parent != prev || !held.contains(&true) {
                break;
            }
            for (p, _) in places.iter().zip(held).filter(|(_, held)| *held) {
                self.refresh(idx, *p, now);
            }
            prev = idx;
        }
        Ok(())
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
        let place = Place::new(node, tier);
        let mut out = Vec::new();
        while out.len() < n {
            let Some(key) = self
                .places
                .get(&place)
                .and_then(|s| s.candidates.first().copied())
            else {
                break;
            };
            self.remove_holder(key.idx, place);
            self.collect(key.idx);
            out.push(key.hash);
        }
        out
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
        let mut overlay = Overlay::new();
        for ev in &batch.events {
            if let Event::Stored {
                hashes,
                parent,
                tier: Some(_),
            } = ev
            {
                self.validate_chain(*parent, hashes, Some(&mut overlay))?;
            }
        }
        self.deferred = Some(Vec::new());
        let mut applied = 0;
        for ev in &batch.events {
            match ev {
                Event::Stored {
                    hashes,
                    parent,
                    tier: Some(tier),
                } => {
                    self.store_valid(Place::new(node, *tier), hashes, *parent, now);
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

    /// Sizes and memory of the directory. Walks the slab: O(blocks).
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
        let held_blocks = self.blocks_held();
        let branch_bytes: usize = self
            .branches
            .values()
            .map(|b| b.context.capacity() * 4 + std::mem::size_of::<(BranchId, Branch)>() + 1)
            .sum();
        let place_bytes = self.places.capacity() * (std::mem::size_of::<(Place, PlaceState)>() + 1);
        let memory = self.blocks.memory_bytes()
            + candidates as usize * CANDIDATE_BYTES
            + branch_bytes
            + place_bytes;
        Stats {
            blocks: self.blocks.len() as u64,
            placeholders: self.blocks.len() as u64 - held_blocks,
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

    fn blocks_held(&self) -> u64 {
        let mut n = 0;
        self.for_each_block(|_, b| n += u64::from(!b.holders.is_empty()));
        n
    }

    fn for_each_block(&self, mut f: impl FnMut(u32, &Block)) {
        // Reached through the places' candidates would miss unheld blocks; walk the slab.
        let mut idx = 0u32;
        while (idx as usize) < self.blocks.slab_len() {
            if self.blocks.is_live(idx) {
                f(idx, self.blocks.get(idx));
            }
            idx += 1;
        }
    }

    /// Checks every invariant of the module docs; panics with a message on the first violation.
    /// O(blocks × holders); for tests.
    #[doc(hidden)]
    pub fn check_invariants(&self) {
        let mut expected: HashMap<Place, Vec<EvKey>> = HashMap::new();
        let mut held: HashMap<Place, u64> = HashMap::new();
        self.for_each_block(|idx, b| {
            assert_eq!(
                self.blocks.find(b.hash),
                Some(idx),
                "table entry of {}",
                b.hash
            );
            assert!(
                !b.holders.is_empty() || b.refcount > 0 || b.first_child != NIL,
                "garbage block {} survived",
                b.hash
            );
            assert!(
                b.holders.windows(2).all(|w| w[0].place < w[1].place),
                "holders sorted"
            );
            for h in &b.holders {
                let n = self
                    .blocks
                    .children(idx)
                    .filter(|&c| self.blocks.get(c).holder(h.place).is_some())
                    .count() as u32;
                assert_eq!(
                    h.held_children, n,
                    "held_children of {} at {:?}",
                    b.hash, h.place
                );
                *held.entry(h.place).or_default() += 1;
                if n == 0 {
                    expected.entry(h.place).or_default().push(self.key(idx, h));
                }
            }
            if b.parent == NIL {
                assert_eq!(b.depth, 0);
            } else {
                let p = self.blocks.get(b.parent);
                assert_eq!(b.depth, p.depth + 1, "depth of {}", b.hash);
                assert!(
                    self.blocks.children(b.parent).any(|c| c == idx),
                    "child link of {}",
                    b.hash
                );
            }
        });
        assert_eq!(held.len(), self.places.len(), "places with holdings");
        for (place, s) in &self.places {
            assert_eq!(Some(&s.held), held.get(place), "held count at {place:?}");
            let mut want = expected.remove(place).unwrap_or_default();
            want.sort_unstable();
            let got: Vec<EvKey> = s.candidates.iter().copied().collect();
            assert_eq!(got, want, "candidates at {place:?}");
        }
        assert!(expected.is_empty(), "candidates of places without state");
        let mut refs: HashMap<u32, u32> = HashMap::new();
        for b in self.branches.values() {
            for &i in &b.context {
                *refs.entry(i).or_default() += 1;
            }
        }
        self.for_each_block(|idx, b| {
            assert_eq!(
                b.refcount,
                refs.get(&idx).copied().unwrap_or(0),
                "refcount of {}",
                b.hash
            );
        });
    }
}
