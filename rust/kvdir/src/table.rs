//! Block storage: a slab of [`Block`] records addressed by `u32` and a hash table from block hash
//! to slab index.
//!
//! NOTE: the table stores only the 4-byte slab index; equality is checked against the slab's
//! copy of the hash. With hashbrown's one control byte per bucket this costs ~5 bytes per bucket
//! instead of 17 for a `HashMap<i64, u32>`, which is what keeps memory per block below Dynamo's.

use hashbrown::HashTable;

use crate::holder_list::{prefetch_addr, Holder, HolderList};
use crate::wide::Kind;
use crate::{BlockHash, NodeId, Place};

/// "No block": the parent of a first page, the end of a child list.
pub(crate) const NIL: u32 = u32::MAX;

/// A known block. Children form a doubly linked sibling list so that a child is unlinked in O(1)
/// and a parent can count its held children when a place stores it after them.
///
/// The block's hash is not here but in [`Blocks`]' hash column, beside the records: a walk down
/// a chain compares hashes only, and reads 8 bytes a block instead of a record's line.
///
/// NOTE: `repr(C)` to keep the parent, the rooted counts and the holder list's first word (what
/// `match` reads at a drop-out) in the first 32 bytes of the 48.
#[derive(Debug, Clone)]
#[repr(C)]
pub(crate) struct Block {
    pub(crate) parent: u32,
    /// Nodes holding this block and all its ancestors (any tier): entries with `ROOT_NODE`.
    pub(crate) full_node: u32,
    /// L1 places holding this block and all its ancestors: entries with `ROOT_TIER`.
    pub(crate) full_l1: u32,
    pub(crate) depth: u32,
    /// Sorted by place; one holder lives inline (the common case of a chain on one node).
    pub(crate) holders: HolderList,
    pub(crate) first_child: u32,
    pub(crate) next_sibling: u32,
    pub(crate) prev_sibling: u32,
    /// `R_b`: live branches whose context contains the block.
    pub(crate) refcount: u32,
}

impl Block {
    /// A block with no parent, children, branches or holders.
    pub(crate) fn unlinked(depth: u32) -> Self {
        Block {
            parent: NIL,
            depth,
            first_child: NIL,
            next_sibling: NIL,
            prev_sibling: NIL,
            refcount: 0,
            full_node: 0,
            full_l1: 0,
            holders: HolderList::new(),
        }
    }

    pub(crate) fn position(&self, place: Place) -> Option<usize> {
        let i = lower_bound(&self.holders, place.raw());
        self.holders
            .get(i)
            .is_some_and(|h| h.place == place)
            .then_some(i)
    }

    pub(crate) fn holder(&self, place: Place) -> Option<&Holder> {
        self.position(place).map(|i| &self.holders[i])
    }

    pub(crate) fn holder_mut(&mut self, place: Place) -> Option<&mut Holder> {
        self.position(place).map(|i| &mut self.holders[i])
    }

    /// The node's entries (one per tier it holds the block in), adjacent because places sort by node.
    pub(crate) fn node_entries(&self, node: NodeId) -> std::ops::Range<usize> {
        let start = lower_bound(&self.holders, Place::node_start(node));
        self.node_entries_from(node, start)
    }

    /// `node_entries`, searched outward from `hint` (where the node's entries likely start).
    pub(crate) fn node_entries_near(&self, node: NodeId, hint: usize) -> std::ops::Range<usize> {
        let start = lower_bound_near(&self.holders, Place::node_start(node), hint);
        self.node_entries_from(node, start)
    }

    fn node_entries_from(&self, node: NodeId, start: usize) -> std::ops::Range<usize> {
        let end = start
            + self.holders[start..]
                .iter()
                .take_while(|h| h.place.node() == node)
                .count();
        start..end
    }
}

/// Lists up to this long are binary-searched; longer ones interpolate first.
const INTERPOLATE_FROM: usize = 16;

/// `hs.partition_point(|h| h.place.raw() < raw)`: where `raw` sits in a list sorted by place.
///
/// NOTE: a prefix every node holds has a list of up to two entries per node (24 KiB at 768
/// nodes), and a binary search over it is a chain of a dozen dependent cache misses: 80% of
/// removing a holder in a steady 3,072-GPU simulation. Places are node ids (times two) and a
/// long list covers most nodes about evenly, so the position interpolated between the two ends
/// is within a few entries of the answer, and a search outward from there reads a line or two.
pub(crate) fn lower_bound(hs: &[Holder], raw: u32) -> usize {
    let n = hs.len();
    if n <= INTERPOLATE_FROM {
        // Counted, not binary-searched: the list is sorted, so the count of smaller places is
        // the position. NOTE: a short list on the heap spans up to four cache lines, and a binary
        // search loads them one after the other, each address waiting on the last comparison
        // (three quarters of `position`'s time in a 3,072-GPU simulation's evictions went to
        // that wait); the count's loads are independent, so the lines arrive together (`demote`
        // and `evict` there ~8% faster).
        return hs.iter().map(|h| usize::from(h.place.raw() < raw)).sum();
    }
    let (first, last) = (hs[0].place.raw(), hs[n - 1].place.raw());
    if raw <= first {
        return 0;
    }
    if raw > last {
        return n;
    }
    let guess = u64::from(raw - first) * (n as u64 - 1) / u64::from(last - first);
    lower_bound_near(hs, raw, guess as usize)
}

/// `lower_bound`, searched outward from `hint` in steps of 1, 2, 4, ...: when the answer is near
/// the hint this reads a cache line or two.
pub(crate) fn lower_bound_near(hs: &[Holder], raw: u32, hint: usize) -> usize {
    let below = |i: usize| hs[i].place.raw() < raw;
    let n = hs.len();
    let hint = hint.min(n);
    let (lo, hi) = if hint < n && below(hint) {
        // The answer is past `hint`; `below(lo - 1)` holds throughout.
        let (mut lo, mut step) = (hint + 1, 1);
        while lo + step - 1 < n && below(lo + step - 1) {
            lo += step;
            step *= 2;
        }
        (lo, (lo + step - 1).min(n))
    } else {
        // The answer is at or before `hi`: `hi == n` or `!below(hi)` holds throughout.
        let (mut hi, mut step) = (hint, 1);
        while hi >= step && !below(hi - step) {
            hi -= step;
            step *= 2;
        }
        (if hi >= step { hi - step + 1 } else { 0 }, hi)
    };
    let at = lo + hs[lo..hi].partition_point(|h| h.place.raw() < raw);
    debug_assert_eq!(at, hs.partition_point(|h| h.place.raw() < raw));
    at
}

#[inline]
pub(crate) fn fold(hash: BlockHash) -> u64 {
    // Real hashes are SHA-256 prefixes and already uniform, but tests and traces use small ints:
    // a multiply spreads them over hashbrown's high (tag) and low (bucket) bits alike.
    let x = (hash as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    x ^ (x >> 29)
}

/// Where the index keeps its control bytes, for prefetch hints: the address of bucket 0's control
/// byte and the bucket mask (`ctrl == 0`: unknown, no hints).
///
/// NOTE: hashbrown keeps a table's control bytes in one array and its buckets just below it, in
/// reverse (bucket i at `ctrl - (i + 1) * size_of::<T>()`), and starts probing for `hash` at
/// bucket `hash & mask`. None of this is its API, but a prefetch is only a hint: a wrong address
/// costs a wasted load, never a wrong answer. `a_probe_hint_points_at_the_buckets` (below) says
/// when a hashbrown upgrade has moved things.
#[derive(Clone, Copy, Default)]
struct ProbeHint {
    ctrl: usize,
    mask: usize,
}

impl ProbeHint {
    fn of(index: &HashTable<u32>) -> Self {
        let Some((j, bucket)) = index
            .iter_buckets()
            .next()
            .and_then(|j| Some((j, index.get_bucket(j)?)))
        else {
            return Self::default();
        };
        let addr = std::ptr::from_ref(bucket).addr();
        Self {
            ctrl: addr + (j + 1) * std::mem::size_of::<u32>(),
            mask: index.num_buckets() - 1,
        }
    }
}

/// How many query blocks ahead a walk asks for the index's lines (`prefetch_hash`).
const PREFETCH_INDEX: usize = 12;

/// From this many bytes on, a column grows by an eighth (`room_for_one`): glibc's largest
/// threshold for serving an allocation from its own mapping (`DEFAULT_MMAP_THRESHOLD_MAX`).
const REMAPPED_BYTES: usize = 32 << 20;

/// Makes room in `v` for one more item: doubling while it is small, by an eighth of its length
/// from `REMAPPED_BYTES` on.
///
/// NOTE: doubling, a slab of 1.4 M blocks had room for 2.1 M: ~40 MB allocated for nothing, 14
/// of the 55 bytes per entry counted in `make bench-peer`'s cluster workload. A buffer this
/// large is a mapping of its own in the system allocator (the Python module sends allocations
/// from 64 KiB on there, `kvdir-py/src/alloc.rs`), and `realloc` grows it by remapping its pages,
/// without copying, so growing it often costs little. Below that size `realloc` copies, and
/// growing by an eighth made stores into a growing directory ~13% slower: small buffers double.
/// (A slab in fixed chunks, which never moves, left less unused still, but the extra load on
/// every access cost 10-20% of a store and a removal.)
fn room_for_one<T>(v: &mut Vec<T>) {
    if v.len() == v.capacity() {
        let step = if v.len() * std::mem::size_of::<T>() >= REMAPPED_BYTES {
            v.len() / 8
        } else {
            v.len().max(16)
        };
        v.reserve_exact(step);
    }
}

/// `Blocks::flags` bit: the slot's block is live and its parent is the slot before.
const CHAINED: u8 = 1;
/// `Blocks::flags` bit: the slot's block is live and held somewhere.
const HELD: u8 = 2;
/// `Blocks::flags` bits: the block has a wide list of `Kind::Node` / `Kind::L1` (`wide.rs`), so
/// that a block without one costs no look-up in the lists' map.
const WIDE_NODE: u8 = 4;
const WIDE_L1: u8 = 8;
/// `Blocks::flags` bit: the slot holds a live block (filled, not dropped): a freed or claimed
/// slot's flags are all zero.
const LIVE: u8 = 16;

const fn wide_bit(kind: Kind) -> u8 {
    match kind {
        Kind::Node => WIDE_NODE,
        Kind::L1 => WIDE_L1,
    }
}

/// How many slots a walk compares at once along a chain in consecutive slots (`chain_run`).
const RUN_CHUNK: usize = 16;
/// A chunk of `RUN_CHUNK` flags, each `CHAINED | HELD`, read as one word.
const RUN_FLAGS: u128 = u128::from_ne_bytes([CHAINED | HELD; RUN_CHUNK]);

/// Slab + index, and two columns beside the slab, the hashes and the flags, that a walk and an
/// index rebuild read instead of the records.
///
/// NOTE: a chain stored in one event fills consecutive slots, and a query walks it from its
/// first page. Records are 48 bytes, so walking them read a cache line a block (a query of
/// 1,700 blocks over a 1M-block directory: ~100 KB, ~5.6 ns a block, where Dynamo's compressed
/// radix tree compares contiguous edge hashes at ~2 ns). The hash and flag columns hold what a
/// walk needs in 9 bytes a slot, compared a chunk at a time.
#[derive(Default)]
pub(crate) struct Blocks {
    slab: Vec<Block>,
    /// Each slot's block hash (a freed slot keeps its last one; `flags` says it is not live).
    hashes: Vec<BlockHash>,
    /// Each slot's `LIVE`, `CHAINED`, `HELD` and wide-list bits (zero for a freed or claimed
    /// slot).
    flags: Vec<u8>,
    free: Vec<u32>,
    index: HashTable<u32>,
    hint: ProbeHint,
    /// Known blocks with no holder (placeholders), kept so `stats` need not walk the slab.
    unheld: usize,
    /// Heap bytes of holder vectors that outgrew their inline slot.
    spilled_bytes: usize,
}

impl Blocks {
    #[inline]
    pub(crate) fn find(&self, hash: BlockHash) -> Option<u32> {
        let hashes = &self.hashes;
        self.index
            .find(fold(hash), |&i| hashes[i as usize] == hash)
            .copied()
    }

    /// The block `hash` if it is held somewhere and `parent`'s child (a walk's step where no run
    /// goes on).
    ///
    /// NOTE: the index's candidates are compared in the hash column, and the record is read
    /// after: each candidate's record is hinted before its hash is compared, so that the two
    /// misses overlap instead of following each other.
    #[inline]
    pub(crate) fn find_held_child(&self, hash: BlockHash, parent: u32) -> Option<u32> {
        let (slab, hashes) = (&self.slab, &self.hashes);
        let &idx = self.index.find(fold(hash), |&i| {
            prefetch_addr(slab.as_ptr().wrapping_add(i as usize).addr());
            hashes[i as usize] == hash
        })?;
        let b = self.get(idx);
        (b.parent == parent && !b.holders.is_empty()).then_some(idx)
    }

    /// Asks the CPU to start loading slot `idx`'s record and hash (a walk up a chain knows the
    /// next block a step before it reads it).
    #[inline]
    pub(crate) fn prefetch(&self, idx: u32) {
        let i = idx as usize;
        prefetch_addr(self.slab.as_ptr().wrapping_add(i).addr());
        prefetch_addr(self.hashes.as_ptr().wrapping_add(i).addr());
    }

    /// The hash of the block in slot `idx`.
    #[inline]
    pub(crate) fn hash(&self, idx: u32) -> BlockHash {
        self.hashes[idx as usize]
    }

    /// Whether the live block in slot `idx` is held somewhere.
    #[inline]
    pub(crate) fn held(&self, idx: u32) -> bool {
        self.flags[idx as usize] & HELD != 0
    }

    /// Whether the block in slot `idx` has a wide list of `kind`.
    #[inline]
    pub(crate) fn has_wide(&self, idx: u32, kind: Kind) -> bool {
        self.flags[idx as usize] & wide_bit(kind) != 0
    }

    /// Records whether the block in slot `idx` has a wide list of `kind`.
    pub(crate) fn set_wide(&mut self, idx: u32, kind: Kind, on: bool) {
        let f = &mut self.flags[idx as usize];
        *f = if on {
            *f | wide_bit(kind)
        } else {
            *f & !wide_bit(kind)
        };
    }

    /// Whether slot `idx` says its live block's parent is the slot before (for the invariants).
    pub(crate) fn chained(&self, idx: u32) -> bool {
        self.flags[idx as usize] & CHAINED != 0
    }

    /// Asks the CPU to start loading the index's control byte and bucket where a look-up of
    /// `hash` starts. A walk down a long chain in a large directory waits on three dependent
    /// misses per block (control group, bucket, slab record); hinted a few blocks ahead, the
    /// first two are in cache when the look-up comes.
    #[inline]
    pub(crate) fn prefetch_hash(&self, hash: BlockHash) {
        let ProbeHint { ctrl, mask } = self.hint;
        if ctrl != 0 {
            let i = (fold(hash) as usize) & mask;
            prefetch_addr(ctrl.wrapping_add(i));
            prefetch_addr(ctrl.wrapping_sub((i + 1) * std::mem::size_of::<u32>()));
        }
    }

    /// Step `i` of a walk that looks up each of `hashes` in turn: hints the look-up
    /// `PREFETCH_INDEX` steps ahead (and, at step 0, the first ones).
    #[inline]
    pub(crate) fn prefetch_walk(&self, hashes: &[BlockHash], i: usize) {
        if i == 0 {
            for &h in hashes.iter().take(PREFETCH_INDEX) {
                self.prefetch_hash(h);
            }
        }
        if let Some(&h) = hashes.get(i + PREFETCH_INDEX) {
            self.prefetch_hash(h);
        }
    }

    #[inline]
    pub(crate) fn get(&self, idx: u32) -> &Block {
        &self.slab[idx as usize]
    }

    #[inline]
    pub(crate) fn get_mut(&mut self, idx: u32) -> &mut Block {
        &mut self.slab[idx as usize]
    }

    pub(crate) fn len(&self) -> usize {
        self.index.len()
    }

    /// Changes a block's holders through `f`, keeping the placeholder and heap counters right.
    pub(crate) fn with_holders<R>(&mut self, idx: u32, f: impl FnOnce(&mut HolderList) -> R) -> R {
        let holders = &mut self.slab[idx as usize].holders;
        let (was_empty, bytes) = (holders.is_empty(), holders.heap_bytes());
        let out = f(holders);
        let (is_empty, now_bytes) = (holders.is_empty(), holders.heap_bytes());
        if is_empty != was_empty {
            self.flags[idx as usize] ^= HELD;
        }
        self.unheld = self.unheld + usize::from(is_empty) - usize::from(was_empty);
        self.spilled_bytes = self.spilled_bytes + now_bytes - bytes;
        out
    }

    /// Known blocks that no place holds.
    pub(crate) fn unheld(&self) -> usize {
        self.unheld
    }

    /// Slots in the slab, live or freed.
    pub(crate) fn slab_len(&self) -> usize {
        self.slab.len()
    }

    /// The live block in the slot after `idx` if it is `hash`'s child of `idx`: a chain stored
    /// in one event fills consecutive slots (freed slots are reused last freed first, and
    /// chains leave leaf first, so a reused run comes back in chain order too), so a walk down
    /// a chain finds each next block here without a look-up in the index, reading the records
    /// in address order.
    #[inline]
    pub(crate) fn next_in_slab(&self, idx: u32, hash: BlockHash) -> Option<u32> {
        let next = idx.checked_add(1)?;
        let at = next as usize;
        (self.hashes.get(at) == Some(&hash) && self.flags[at] & CHAINED != 0).then_some(next)
    }

    /// How many of `hashes` follow the live block `idx` in the slots after it, each held
    /// somewhere and the child of the one before (a chunk of slots compared at a time).
    #[inline]
    pub(crate) fn chain_run(&self, idx: u32, hashes: &[BlockHash]) -> usize {
        let start = idx as usize + 1;
        let room = self.hashes.len().saturating_sub(start).min(hashes.len());
        let (col, flags) = (
            &self.hashes[start..start + room],
            &self.flags[start..start + room],
        );
        let mut n = 0;
        // A chunk at a time, without branches inside it: the differences OR-ed together, the
        // chunk's flags read as one word.
        while n + RUN_CHUNK <= room {
            let diff = col[n..n + RUN_CHUNK]
                .iter()
                .zip(&hashes[n..n + RUN_CHUNK])
                .fold(0, |acc, (&a, &b)| acc | (a ^ b));
            let f: [u8; RUN_CHUNK] = flags[n..n + RUN_CHUNK].try_into().expect("a chunk");
            if diff != 0 || u128::from_ne_bytes(f) & RUN_FLAGS != RUN_FLAGS {
                break;
            }
            n += RUN_CHUNK;
        }
        while n < room && col[n] == hashes[n] && flags[n] & (CHAINED | HELD) == CHAINED | HELD {
            n += 1;
        }
        n
    }

    pub(crate) fn is_live(&self, idx: u32) -> bool {
        self.flags.get(idx as usize).is_some_and(|&f| f & LIVE != 0)
    }

    /// Inserts a new block (the caller checked it is unknown) under `parent` (or `NIL`).
    pub(crate) fn insert(&mut self, hash: BlockHash, parent: u32) -> u32 {
        // Before the block joins the slab: the rebuild re-inserts every live slab block.
        if self.index.len() == self.index.capacity() {
            self.rebuild_index(1);
        }
        let idx = self.alloc_slot(hash);
        let hashes = &self.hashes;
        self.index
            .insert_unique(fold(hash), idx, |&i| fold(hashes[i as usize]));
        self.refresh_hint();
        self.fill(idx, hash, parent, None);
        idx
    }

    /// A slab slot for a new block (a freed one if any), holding `hash` but not yet live.
    fn alloc_slot(&mut self, hash: BlockHash) -> u32 {
        if let Some(idx) = self.free.pop() {
            self.hashes[idx as usize] = hash;
            return idx;
        }
        let idx = u32::try_from(self.slab.len()).expect("fewer than 2^32 blocks");
        assert!(idx != NIL, "directory is full (2^32 - 1 blocks)");
        self.grow();
        self.slab.push(Block::unlinked(0));
        self.hashes.push(hash);
        self.flags.push(0);
        idx
    }

    /// Makes room for one more slot in the slab and its columns (`room_for_one`).
    fn grow(&mut self) {
        room_for_one(&mut self.slab);
        room_for_one(&mut self.hashes);
        room_for_one(&mut self.flags);
    }

    /// Looks `hash` up and, if unknown, claims a slot for it in one probe of the index: `Ok(idx)`
    /// of the claimed slot, or `Err(idx)` of the known block (a block claimed earlier counts as
    /// known, so a repeat is found too). The caller either `fill`s every claimed slot or gives
    /// them all back with `unclaim`, in reverse order, before anything else reads the directory.
    ///
    /// NOTE: this is `store`'s fast path: the look-up that checks a new block is unknown also
    /// finds its bucket, where a separate look-up and insert probed the index twice, plus a sort
    /// to find repeats. `reserve` must have made room first.
    pub(crate) fn find_or_claim(&mut self, hash: BlockHash) -> Result<u32, u32> {
        debug_assert!(self.index.capacity() > self.index.len(), "reserve first");
        let Self { hashes, index, .. } = self;
        match index.entry(
            fold(hash),
            |&i| hashes[i as usize] == hash,
            |&i| fold(hashes[i as usize]),
        ) {
            hashbrown::hash_table::Entry::Occupied(e) => Err(*e.get()),
            hashbrown::hash_table::Entry::Vacant(e) => {
                // The slot's hash is written before anything probes the index again.
                let idx = self
                    .free
                    .last()
                    .copied()
                    .unwrap_or(u32::try_from(self.slab.len()).expect("fewer than 2^32 blocks"));
                e.insert(idx);
                let got = self.alloc_slot(hash);
                debug_assert_eq!(got, idx);
                Ok(idx)
            }
        }
    }

    /// Gives back a slot `find_or_claim` claimed for `hash` (the last one not yet given back).
    pub(crate) fn unclaim(&mut self, idx: u32, hash: BlockHash) {
        let hashes = &self.hashes;
        let entry = self
            .index
            .find_entry(fold(hash), |&i| i == idx && hashes[i as usize] == hash)
            .unwrap_or_else(|_| unreachable!("a claimed slot is in the index"));
        entry.remove();
        if idx as usize + 1 == self.slab.len() {
            self.slab.pop();
            self.hashes.pop();
            self.flags.pop();
        } else {
            self.free.push(idx);
        }
    }

    /// Makes room in the index for `n` more blocks, so that `find_or_claim` never rehashes.
    pub(crate) fn reserve(&mut self, n: usize) {
        if self.index.capacity() - self.index.len() < n {
            self.rebuild_index(n);
        } else {
            self.refresh_hint();
        }
    }

    /// An index built while empty gave no hint: the first block stored since tells where the
    /// buckets are.
    #[inline]
    fn refresh_hint(&mut self) {
        if self.hint.ctrl == 0 && !self.index.is_empty() {
            self.hint = ProbeHint::of(&self.index);
        }
    }

    /// Makes a claimed slot the live block `hash` under `parent` (or `NIL`), held by `holder`
    /// if given (its `full_*` counts follow the holder's flags).
    pub(crate) fn fill(&mut self, idx: u32, hash: BlockHash, parent: u32, holder: Option<Holder>) {
        let (depth, next_sibling) = if parent == NIL {
            (0, NIL)
        } else {
            let p = self.get(parent);
            (p.depth + 1, p.first_child)
        };
        let block = Block {
            parent,
            depth,
            first_child: NIL,
            next_sibling,
            prev_sibling: NIL,
            refcount: 0,
            full_node: holder.map_or(0, |h| u32::from(h.root_node())),
            full_l1: holder.map_or(0, |h| u32::from(h.root_tier())),
            holders: holder.map_or_else(HolderList::new, HolderList::one),
        };
        debug_assert_eq!(self.flags[idx as usize], 0, "fill a claimed slot");
        self.slab[idx as usize] = block;
        self.hashes[idx as usize] = hash;
        let chained = if parent != NIL && parent.wrapping_add(1) == idx {
            CHAINED
        } else {
            0
        };
        let held = if holder.is_some() { HELD } else { 0 };
        self.flags[idx as usize] = LIVE | chained | held;
        if parent != NIL {
            if next_sibling != NIL {
                self.get_mut(next_sibling).prev_sibling = idx;
            }
            self.get_mut(parent).first_child = idx;
        }
        self.unheld += usize::from(holder.is_none());
    }

    /// Grows the index (or clears its tombstones) before an insert would make hashbrown rehash.
    ///
    /// NOTE: the table holds slab indices, so a rehash reads every block's hash from the slab.
    /// hashbrown's own rehash reads them in bucket order, a cache miss each (~13% of bulk
    /// `store`s into a growing directory); rebuilding from the slab reads them in slab order.
    #[cold]
    fn rebuild_index(&mut self, room: usize) {
        let live = self.index.len();
        let mut index = HashTable::with_capacity((2 * live).max(live + room).max(16));
        // From the columns (9 bytes a slot), not the records (48).
        for (i, (&f, &hash)) in self.flags.iter().zip(&self.hashes).enumerate() {
            if f & LIVE != 0 {
                index.insert_unique(fold(hash), i as u32, |_| {
                    unreachable!("the table was sized for every live block")
                });
            }
        }
        debug_assert_eq!(index.len(), live);
        self.index = index;
        self.hint = ProbeHint::of(&self.index);
    }

    /// Drops a block that has no children, unlinking it from its parent. Returns the parent.
    pub(crate) fn drop_block(&mut self, idx: u32) -> u32 {
        let b = self.get(idx);
        debug_assert!(b.first_child == NIL && b.holders.is_empty() && b.refcount == 0);
        let (hash, parent, prev, next) = (self.hash(idx), b.parent, b.prev_sibling, b.next_sibling);
        if prev != NIL {
            self.get_mut(prev).next_sibling = next;
        } else if parent != NIL {
            self.get_mut(parent).first_child = next;
        }
        if next != NIL {
            self.get_mut(next).prev_sibling = prev;
        }
        let hashes = &self.hashes;
        if let Ok(entry) = self
            .index
            .find_entry(fold(hash), |&i| hashes[i as usize] == hash)
        {
            entry.remove();
        }
        self.flags[idx as usize] = 0;
        self.free.push(idx);
        self.unheld -= 1;
        parent
    }

    /// Indices of `idx`'s children.
    pub(crate) fn children(&self, idx: u32) -> impl Iterator<Item = u32> + '_ {
        let mut next = self.get(idx).first_child;
        std::iter::from_fn(move || {
            (next != NIL).then(|| {
                let cur = next;
                next = self.get(cur).next_sibling;
                cur
            })
        })
    }

    /// Bytes held by the slab, the free list, spilled holder vectors and the hash table.
    pub(crate) fn memory_bytes(&self) -> usize {
        self.slab.capacity() * std::mem::size_of::<Block>()
            + self.hashes.capacity() * std::mem::size_of::<BlockHash>()
            + self.flags.capacity()
            + self.free.capacity() * 4
            + self.index.capacity() * (std::mem::size_of::<u32>() + 1)
            + self.spilled_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Tier;

    #[test]
    fn a_probe_hint_points_at_the_buckets() {
        // If a hashbrown upgrade moves its buckets, prefetch hints go astray (results stay
        // right): this says so, so that `ProbeHint` is mended or dropped.
        let mut b = Blocks::default();
        for h in 0..5_000 {
            b.insert(h, NIL);
        }
        let hint = b.hint;
        assert_ne!(hint.ctrl, 0);
        assert_eq!(hint.mask + 1, b.index.num_buckets());
        for j in b.index.iter_buckets().take(500) {
            let at = std::ptr::from_ref(b.index.get_bucket(j).unwrap()).addr();
            assert_eq!(at, hint.ctrl - (j + 1) * 4, "bucket {j}");
        }
        // A look-up of `hash` starts at bucket `fold(hash) & mask`: some full bucket in the
        // probe group from there holds it (the group is 16 control bytes wide).
        for h in (0..5_000).step_by(7) {
            let j = b
                .index
                .find_bucket_index(fold(h), |&i| b.hashes[i as usize] == h);
            let start = (fold(h) as usize) & hint.mask;
            let dist = (j.unwrap() + hint.mask + 1 - start) & hint.mask;
            assert!(dist < 16 * 4, "hash {h}: bucket {j:?} far from {start}");
        }
    }

    /// Sorted, deduplicated holder lists of random places: `len` draws over nodes `0..nodes`.
    fn lists(nodes: u64) -> Vec<Vec<Holder>> {
        let mut seed = 7u64;
        let mut next = || {
            seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            seed >> 33
        };
        (0..80)
            .map(|len| {
                let mut places: Vec<Place> = (0..len)
                    .map(|_| {
                        let tier = if next() % 2 == 0 { Tier::L1 } else { Tier::L2 };
                        Place::new((next() % nodes) as NodeId, tier)
                    })
                    .collect();
                places.sort();
                places.dedup();
                places
                    .iter()
                    .map(|&p| Holder::new(p, 0, 0.0, false, false))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn searches_agree_with_a_binary_search() {
        // Short and long lists (interpolated from 17 entries on), dense (nodes 0..30) and sparse
        // (0..1000), queried for every place below, inside and beyond them, from every hint.
        for nodes in [30, 1000] {
            for hs in lists(nodes) {
                let max = hs.last().map_or(0, |h| h.place.raw()) + 3;
                for raw in (0..=max).step_by(if nodes > 100 { 7 } else { 1 }) {
                    let want = hs.partition_point(|h| h.place.raw() < raw);
                    assert_eq!(lower_bound(&hs, raw), want, "len {} raw {raw}", hs.len());
                    for hint in 0..=hs.len() + 2 {
                        assert_eq!(
                            lower_bound_near(&hs, raw, hint),
                            want,
                            "len {} raw {raw} hint {hint}",
                            hs.len()
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn positions_and_node_entries_in_long_lists() {
        let mut b = Block::unlinked(0);
        // Every third node, both tiers on even nodes: 68 entries.
        for node in (0..135).step_by(3) {
            for tier in [Tier::L1, Tier::L2] {
                if tier == Tier::L1 || node % 2 == 0 {
                    let i = b.holders.len();
                    b.holders
                        .insert(i, Holder::new(Place::new(node, tier), 0, 0.0, false, false));
                }
            }
        }
        for node in 0..140 {
            let held = node % 3 == 0 && node < 135;
            let both = held && node % 2 == 0;
            let entries = b.node_entries(node);
            assert_eq!(
                entries.len(),
                usize::from(held) + usize::from(both),
                "node {node}"
            );
            assert_eq!(b.position(Place::new(node, Tier::L1)).is_some(), held);
            assert_eq!(b.position(Place::new(node, Tier::L2)).is_some(), both);
            for hint in [0, 10, 40, 68, 100] {
                assert_eq!(b.node_entries_near(node, hint), entries);
            }
        }
    }
}
