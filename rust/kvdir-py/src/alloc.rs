//! The native module's allocator: small allocations from mimalloc, large ones from the system.
//!
//! The directory's small buffers (holder lists moving on and off the heap as blocks gain and lose
//! a second place, the eviction candidates popped per call, the vectors handed back to Python)
//! come and go by the thousand per call: glibc's `malloc`, `malloc_consolidate` and
//! `unlink_chunk` were ~10% of a simulation's time, and mimalloc cut a simulated hour's CPU by
//! about a quarter (docs/simulator.md, "Speed"). Its large blocks, though, stay resident after
//! a buffer grows (the slab and the hash index double by copying, and mimalloc keeps the old
//! pages mapped, freed lazily): memory per block in `benches/compare_dynamo.py` went from 71 to
//! 130 bytes (Dynamo's radix tree: 79). Buffers from `LARGE` bytes on go to the system
//! allocator, whose `mremap` grows them in place and whose `free` unmaps them, as before: 73
//! bytes with a 64 KiB threshold (81 with 1 MiB), and the simulation keeps most of the gain.

use std::alloc::{GlobalAlloc, Layout, System};

use mimalloc::MiMalloc;

/// Allocations of at least this many bytes go to the system allocator (see the module's note).
const LARGE: usize = 1 << 16;

/// Routes each allocation by its size; a size decides the allocator at allocation and at
/// deallocation alike, and a reallocation across `LARGE` moves the buffer between them.
pub struct SmallInMimalloc;

// SAFETY: every method forwards to an allocator chosen by the layout's size alone, so a block
// is always freed or resized by the allocator that made it; a move across the threshold copies
// `min(old, new)` bytes into a block from the other allocator before freeing the old one.
unsafe impl GlobalAlloc for SmallInMimalloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract (a non-zero size) is passed on unchanged.
        unsafe {
            if layout.size() >= LARGE {
                System.alloc(layout)
            } else {
                MiMalloc.alloc(layout)
            }
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        unsafe {
            if layout.size() >= LARGE {
                System.alloc_zeroed(layout)
            } else {
                MiMalloc.alloc_zeroed(layout)
            }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` was allocated with `layout`, so by the allocator its size selects.
        unsafe {
            if layout.size() >= LARGE {
                System.dealloc(ptr, layout);
            } else {
                MiMalloc.dealloc(ptr, layout);
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let (was_large, is_large) = (layout.size() >= LARGE, new_size >= LARGE);
        // SAFETY: the same allocator resizes its own block; otherwise a new block of the new
        // layout (same alignment, a valid size by the caller's contract) receives the bytes
        // both sizes cover before the old block is freed by the allocator that made it.
        unsafe {
            match (was_large, is_large) {
                (true, true) => System.realloc(ptr, layout, new_size),
                (false, false) => MiMalloc.realloc(ptr, layout, new_size),
                _ => {
                    let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
                    let new = self.alloc(new_layout);
                    if !new.is_null() {
                        std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                        self.dealloc(ptr, layout);
                    }
                    new
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_grow_and_shrink_across_the_threshold() {
        // A vector grown from small to large and shrunk back keeps its contents each way.
        let a = SmallInMimalloc;
        for start in [16, LARGE - 8, LARGE, 3 * LARGE] {
            for end in [8, LARGE - 1, LARGE, 4 * LARGE] {
                let layout = Layout::from_size_align(start, 16).unwrap();
                // SAFETY: non-zero sizes, the layouts passed back are the ones allocated with.
                unsafe {
                    let p = a.alloc(layout);
                    assert!(!p.is_null());
                    for i in 0..start.min(end) {
                        p.add(i).write((i % 251) as u8);
                    }
                    let q = a.realloc(p, layout, end);
                    assert!(!q.is_null());
                    assert_eq!(q as usize % 16, 0, "alignment kept");
                    for i in 0..start.min(end) {
                        assert_eq!(
                            q.add(i).read(),
                            (i % 251) as u8,
                            "byte {i} of {start} -> {end}"
                        );
                    }
                    a.dealloc(q, Layout::from_size_align(end, 16).unwrap());
                }
            }
        }
    }
}
