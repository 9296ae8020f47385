//! `Holder` (one place holding a block) and `HolderList`: a block's holders in 16 bytes — the
//! size of one holder; and `prefetch_addr`, the cache hint the list and the block table share.
//!
//! Almost every block is held by one place, so the list stores a single holder in place and
//! moves to the heap only from two holders on. A `SmallVec<[Holder; 1]>` does the same in 24 bytes
//! (it keeps a separate capacity word); here the first word tells the cases apart, because a
//! holder's place never takes the two largest `u32` values (nodes are below `MAX_NODE`), and a heap
//! list's capacity shares the length's word (its log2 in the top bits). Those 8 bytes per block
//! are what keeps the directory's memory per block below Dynamo's radix tree.
//!
//! Between calls a heap list has `len.next_power_of_two()` slots and at least two holders, as
//! little as a list of that length needs. Only within a `demote` does a list keep its buffer while
//! it shrinks (`remove_keep`): the node's L1 entry goes and its L2 entry comes right after, and
//! freeing the buffer to allocate it again a moment later cost two allocations per demoted
//! block, each a cache miss on a cold free list (the first 900 s of a 3,072-GPU simulation took
//! 204 CPU seconds with the buffer kept, against 224).

use std::alloc::{self, Layout};
use std::ops::{Deref, DerefMut};

use smallvec::SmallVec;

use crate::Place;

/// First word of an empty list.
const EMPTY: u32 = u32::MAX;
/// First word of a list on the heap.
const HEAP: u32 = u32::MAX - 1;

#[derive(Clone, Copy)]
#[repr(C)]
struct Heap {
    tag: u32,
    /// The length in the low `LEN_BITS` bits, log2 of the capacity above them.
    meta: u32,
    ptr: *mut Holder,
}

/// Bits of `Heap::meta` that hold the length: a list holds fewer than 2^27 holders (two per node,
/// and a directory of 2^26 nodes is far beyond any cluster).
const LEN_BITS: u32 = 27;
const LEN_MASK: u32 = (1 << LEN_BITS) - 1;

impl Heap {
    fn new(ptr: *mut Holder, len: usize, cap: usize) -> Self {
        assert!(len <= LEN_MASK as usize, "a holder list of {len} entries");
        debug_assert!(cap.is_power_of_two() && cap >= len);
        Heap {
            tag: HEAP,
            meta: len as u32 | cap.trailing_zeros() << LEN_BITS,
            ptr,
        }
    }

    fn len(self) -> usize {
        (self.meta & LEN_MASK) as usize
    }

    fn cap(self) -> usize {
        1 << (self.meta >> LEN_BITS)
    }

    /// The same buffer with `len` holders.
    fn with_len(self, len: usize) -> Self {
        Heap::new(self.ptr, len, self.cap())
    }
}

#[repr(C)]
union Repr {
    one: Holder,
    heap: Heap,
}

/// A block's holders, sorted by place by its users.
pub(crate) struct HolderList(Repr);

// SAFETY: the list owns its heap buffer exclusively, like a `Vec<Holder>`.
unsafe impl Send for HolderList {}
// SAFETY: shared access only reads, like a `Vec<Holder>`.
unsafe impl Sync for HolderList {}

fn layout(cap: usize) -> Layout {
    Layout::array::<Holder>(cap).expect("holder lists are small")
}

/// A buffer for `cap` (≥ 2) holders.
fn alloc_holders(cap: usize) -> *mut Holder {
    // SAFETY: the layout has a non-zero size (cap ≥ 2); a null result is handled.
    #[allow(
        clippy::cast_ptr_alignment,
        reason = "allocated with the layout of [Holder]"
    )]
    let ptr = unsafe { alloc::alloc(layout(cap)) }.cast::<Holder>();
    if ptr.is_null() {
        alloc::handle_alloc_error(layout(cap));
    }
    ptr
}

fn capacity(len: usize) -> usize {
    len.next_power_of_two()
}

impl HolderList {
    pub(crate) const fn new() -> Self {
        HolderList(Repr {
            heap: Heap {
                tag: EMPTY,
                meta: 0,
                ptr: std::ptr::null_mut(),
            },
        })
    }

    pub(crate) fn one(h: Holder) -> Self {
        debug_assert!(h.place.raw() < HEAP, "place collides with a list tag");
        HolderList(Repr { one: h })
    }

    fn tag(&self) -> u32 {
        // SAFETY: both variants start with an initialised u32 (a place or a tag).
        unsafe { self.0.heap.tag }
    }

    /// The heap part, if the list is on the heap.
    fn heap(&self) -> Option<Heap> {
        if self.tag() == HEAP {
            // SAFETY: the tag says the `heap` variant is the initialised one.
            Some(unsafe { self.0.heap })
        } else {
            None
        }
    }

    /// Starts loading the line of a heap list that holds entry `pos` (clamped to the list; a hint:
    /// no effect on results). A block shared by many places keeps its holders on the heap, where
    /// reading them is a cache miss that the store of a known prefix would otherwise wait for
    /// block by block.
    #[inline]
    pub(crate) fn prefetch(&self, pos: usize) {
        if let Some(h) = self.heap().filter(|h| h.len() > 0) {
            let at = pos.min(h.len() - 1);
            prefetch_addr(h.ptr.wrapping_add(at).addr());
        }
    }

    /// Bytes on the heap (0 while the list fits in place).
    pub(crate) fn heap_bytes(&self) -> usize {
        self.heap()
            .map_or(0, |h| h.cap() * std::mem::size_of::<Holder>())
    }

    /// Moves the holders into a heap buffer of `capacity(len)` slots (`len` ≥ 2).
    fn to_heap(items: &[Holder], len: usize) -> Heap {
        debug_assert!(len >= 2 && items.len() <= len);
        let ptr = alloc_holders(capacity(len));
        // SAFETY: the new buffer holds at least `items.len()` slots and does not overlap `items`.
        unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), ptr, items.len()) };
        Heap::new(ptr, items.len(), capacity(len))
    }

    fn free(h: Heap) {
        // SAFETY: `ptr` was allocated by `alloc_holders` with the capacity `meta` records.
        unsafe { alloc::dealloc(h.ptr.cast(), layout(h.cap())) };
    }

    /// Inserts `h` at `pos` (≤ len), shifting the rest right.
    pub(crate) fn insert(&mut self, pos: usize, h: Holder) {
        debug_assert!(h.place.raw() < HEAP, "place collides with a list tag");
        let len = self.len();
        assert!(pos <= len, "insert position {pos} beyond length {len}");
        if len == 0 {
            *self = HolderList::one(h);
            return;
        }
        if let Some(heap) = self.heap().filter(|h| h.cap() > len) {
            // SAFETY: the buffer has cap > len slots; the tail shifts right by one.
            unsafe {
                let p = heap.ptr.add(pos);
                std::ptr::copy(p, p.add(1), len - pos);
                p.write(h);
            }
            self.0.heap = heap.with_len(len + 1);
            return;
        }
        // Grow into a new buffer: the holders before `pos`, `h`, the rest.
        let ptr = alloc_holders(capacity(len + 1));
        // SAFETY: the new buffer has capacity(len + 1) > len slots and does not overlap the old
        // holders, which stay valid until the old buffer is freed below.
        unsafe {
            std::ptr::copy_nonoverlapping(self.as_ptr(), ptr, pos);
            ptr.add(pos).write(h);
            std::ptr::copy_nonoverlapping(self.as_ptr().add(pos), ptr.add(pos + 1), len - pos);
        }
        if let Some(old) = self.heap() {
            Self::free(old);
        }
        self.0 = Repr {
            heap: Heap::new(ptr, len + 1, capacity(len + 1)),
        };
    }

    /// Removes and returns the holder at `pos`.
    pub(crate) fn remove(&mut self, pos: usize) -> Holder {
        let len = self.len();
        assert!(pos < len, "remove position {pos} beyond length {len}");
        let out = self[pos];
        if let Some(heap) = self
            .heap()
            .filter(|h| len > 2 && capacity(len - 1) == h.cap())
        {
            Self::shift_out(heap, pos);
            self.0.heap = heap.with_len(len - 1);
            return out;
        }
        if len == 2 {
            // Back to one holder in place (the common way a heap list ends): the other one moves
            // in and the buffer goes (dropped with the old list), without the copies below.
            *self = HolderList::one(self[1 - pos]);
            return out;
        }
        let mut items: SmallVec<[Holder; 8]> = SmallVec::with_capacity(len - 1);
        items.extend_from_slice(&self[..pos]);
        items.extend_from_slice(&self[pos + 1..]);
        self.replace(&items);
        out
    }

    /// Removes and returns the holder at `pos`, keeping a heap buffer however short the list
    /// gets (down to one holder): a holder is about to take its place (`demote`). The caller
    /// calls `shrink_to_fit` before the call that started this returns.
    pub(crate) fn remove_keep(&mut self, pos: usize) -> Holder {
        let len = self.len();
        match self.heap() {
            Some(heap) if len >= 2 => {
                assert!(pos < len, "remove position {pos} beyond length {len}");
                let out = self[pos];
                Self::shift_out(heap, pos);
                self.0.heap = heap.with_len(len - 1);
                out
            }
            _ => self.remove(pos),
        }
    }

    /// Gives a list that `remove_keep` left with spare room the buffer its length needs (none
    /// for one holder).
    pub(crate) fn shrink_to_fit(&mut self) {
        if !self.is_tight() {
            let items: SmallVec<[Holder; 8]> = SmallVec::from_slice(self);
            self.replace(&items);
        }
    }

    /// Whether the list takes no more room than its length needs (between calls: see the module
    /// docs).
    pub(crate) fn is_tight(&self) -> bool {
        self.heap()
            .is_none_or(|h| h.len() >= 2 && capacity(h.len()) == h.cap())
    }

    /// Shifts the holders after `pos` left by one, over the one at `pos` (< len).
    fn shift_out(heap: Heap, pos: usize) {
        // SAFETY: pos < len (callers); the tail moves within the buffer's initialised slots.
        unsafe {
            let p = heap.ptr.add(pos);
            std::ptr::copy(p.add(1), p, heap.len() - pos - 1);
        }
    }

    /// Makes the list exactly `items`, reusing the heap buffer when its capacity is what
    /// `items` needs.
    fn replace(&mut self, items: &[Holder]) {
        let heap = self.heap();
        if let Some(h) = heap {
            if items.len() >= 2 && capacity(items.len()) == h.cap() {
                // SAFETY: the buffer has cap ≥ items.len() slots; `items` is a copy.
                unsafe { std::ptr::copy_nonoverlapping(items.as_ptr(), h.ptr, items.len()) };
                self.0.heap = h.with_len(items.len());
                return;
            }
        }
        let new = match items.len() {
            0 => HolderList::new(),
            1 => HolderList::one(items[0]),
            n => HolderList(Repr {
                heap: Self::to_heap(items, n),
            }),
        };
        if let Some(h) = heap {
            Self::free(h);
        }
        // The old heap buffer is freed above; forget `self` so its drop does not free it again.
        std::mem::forget(std::mem::replace(self, new));
    }
}

impl Deref for HolderList {
    type Target = [Holder];

    fn deref(&self) -> &[Holder] {
        match self.tag() {
            EMPTY => &[],
            // SAFETY: on the heap, `ptr` points to `len` initialised holders owned by the list.
            HEAP => unsafe { std::slice::from_raw_parts(self.0.heap.ptr, self.0.heap.len()) },
            // SAFETY: any other first word is a place: the `one` variant is initialised.
            _ => std::slice::from_ref(unsafe { &self.0.one }),
        }
    }
}

impl DerefMut for HolderList {
    fn deref_mut(&mut self) -> &mut [Holder] {
        match self.tag() {
            EMPTY => &mut [],
            // SAFETY: as in `deref`, and `&mut self` gives exclusive access.
            HEAP => unsafe { std::slice::from_raw_parts_mut(self.0.heap.ptr, self.0.heap.len()) },
            // SAFETY: as in `deref`. Callers must not change a holder's place to a tag value.
            _ => std::slice::from_mut(unsafe { &mut self.0.one }),
        }
    }
}

impl<'a> IntoIterator for &'a HolderList {
    type Item = &'a Holder;
    type IntoIter = std::slice::Iter<'a, Holder>;

    fn into_iter(self) -> Self::IntoIter {
        self.iter()
    }
}

impl Drop for HolderList {
    fn drop(&mut self) {
        if let Some(h) = self.heap() {
            Self::free(h);
        }
    }
}

impl Clone for HolderList {
    fn clone(&self) -> Self {
        let mut out = HolderList::new();
        out.replace(self);
        out
    }
}

impl Default for HolderList {
    fn default() -> Self {
        HolderList::new()
    }
}

impl std::fmt::Debug for HolderList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

/// One holding of a block: a (node, tier) pair, its last-access time, how many of the block's
/// children the same place holds (0 means the block is an eviction candidate there), and two
/// "rooted" flags that let `match` count per-node prefixes without visiting every holder of every
/// block: `ROOT_TIER` (L1 entries only) — this place also holds every ancestor; `ROOT_NODE` (on
/// every entry of the node) — the node holds every ancestor in some tier.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub(crate) struct Holder {
    pub(crate) place: Place,
    bits: u32,
    pub(crate) time: f64,
}

const ROOT_TIER: u32 = 1 << 30;
const ROOT_NODE: u32 = 1 << 31;
const COUNT: u32 = ROOT_TIER - 1;

impl Holder {
    pub(crate) fn new(
        place: Place,
        held_children: u32,
        time: f64,
        root_tier: bool,
        root_node: bool,
    ) -> Self {
        assert!(
            held_children <= COUNT,
            "more than 2^30 children held at one place"
        );
        let bits = held_children
            | if root_tier { ROOT_TIER } else { 0 }
            | if root_node { ROOT_NODE } else { 0 };
        Holder { place, bits, time }
    }

    /// Children of the block held at the same place.
    pub(crate) fn held_children(&self) -> u32 {
        self.bits & COUNT
    }

    pub(crate) fn add_held_children(&mut self, delta: i32) {
        let n = self
            .held_children()
            .checked_add_signed(delta)
            .expect("held-children count in range");
        assert!(n <= COUNT, "more than 2^30 children held at one place");
        self.bits = (self.bits & !COUNT) | n;
    }

    pub(crate) fn root_tier(&self) -> bool {
        self.bits & ROOT_TIER != 0
    }

    pub(crate) fn set_root_tier(&mut self, on: bool) {
        self.bits = if on {
            self.bits | ROOT_TIER
        } else {
            self.bits & !ROOT_TIER
        };
    }

    pub(crate) fn root_node(&self) -> bool {
        self.bits & ROOT_NODE != 0
    }

    pub(crate) fn set_root_node(&mut self, on: bool) {
        self.bits = if on {
            self.bits | ROOT_NODE
        } else {
            self.bits & !ROOT_NODE
        };
    }
}

/// Asks the CPU to start loading the cache line at `addr` (a hint: any address, no effect on
/// results).
#[inline]
pub(crate) fn prefetch_addr(addr: usize) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint that never faults and reads nothing in the language's sense,
    // whatever the address.
    unsafe {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        _mm_prefetch::<_MM_HINT_T0>(std::ptr::without_provenance::<i8>(addr));
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = addr;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Place, Tier};

    fn h(node: u32) -> Holder {
        Holder::new(
            Place::new(node, Tier::L1),
            node,
            f64::from(node),
            false,
            false,
        )
    }

    #[test]
    fn is_as_small_as_one_holder() {
        assert_eq!(
            std::mem::size_of::<HolderList>(),
            std::mem::size_of::<Holder>()
        );
    }

    #[test]
    fn grows_and_shrinks_through_every_size() {
        let mut list = HolderList::new();
        let mut model: Vec<u32> = Vec::new();
        for n in [5, 1, 9, 3, 7, 2, 8, 4, 6, 0] {
            let pos = model.partition_point(|&x| x < n);
            model.insert(pos, n);
            list.insert(pos, h(n));
            assert_eq!(
                list.iter().map(|x| x.place.node()).collect::<Vec<_>>(),
                model
            );
            assert_eq!(list.heap_bytes() > 0, model.len() >= 2);
        }
        let copy = list.clone();
        for pos in [3, 0, 5, 1, 0, 2, 1, 0, 1, 0] {
            let gone = list.remove(pos);
            assert_eq!(gone.place.node(), model.remove(pos));
            assert_eq!(
                list.iter().map(|x| x.place.node()).collect::<Vec<_>>(),
                model
            );
            assert_eq!(list.heap_bytes() > 0, model.len() >= 2);
        }
        assert!(list.is_empty());
        assert_eq!(copy.len(), 10);
    }

    #[test]
    fn remove_keep_keeps_the_buffer_until_shrunk() {
        let mut list = HolderList::new();
        for n in 0..5 {
            list.insert(n as usize, h(n));
        }
        assert_eq!(list.heap_bytes(), 8 * std::mem::size_of::<Holder>());
        for n in 0..4 {
            assert_eq!(list.remove_keep(0).place.node(), n);
            assert_eq!(list.heap_bytes(), 8 * std::mem::size_of::<Holder>());
            assert!(!list.is_tight());
        }
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].place.node(), 4);
        // Refilled in place, up to the buffer's capacity, without a new buffer.
        let buffer = list.as_ptr();
        for n in 5..12 {
            list.insert(list.len(), h(n));
        }
        assert_eq!(list.as_ptr(), buffer);
        assert!(list.is_tight());
        list.insert(0, h(0));
        assert_eq!(list.heap_bytes(), 16 * std::mem::size_of::<Holder>());
        for _ in 0..6 {
            list.remove_keep(3);
        }
        list.shrink_to_fit();
        assert!(list.is_tight());
        assert_eq!(
            list.iter().map(|x| x.place.node()).collect::<Vec<_>>(),
            [0, 4, 5]
        );
        assert_eq!(list.heap_bytes(), 4 * std::mem::size_of::<Holder>());
        list.remove_keep(0);
        list.remove_keep(0);
        list.shrink_to_fit();
        assert_eq!((list.len(), list.heap_bytes()), (1, 0));
        assert_eq!(list.remove_keep(0).place.node(), 5);
        assert!(list.is_empty() && list.is_tight());
    }

    #[test]
    fn largest_place_is_not_a_tag() {
        let top = Place::new(crate::MAX_NODE, Tier::L2);
        assert!(top.raw() < HEAP);
        let list = HolderList::one(Holder::new(top, 0, 0.0, false, false));
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].place, top);
    }
}
