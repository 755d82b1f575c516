//! The process allocator: mimalloc, with one change: allocations of [`HUGE_BYTES`] or
//! more are anonymous mappings made with `MAP_NORESERVE`, so the kernel's overcommit
//! heuristic does not refuse them up front.
//!
//! Why mimalloc rather than glibc's malloc: fetch and produce move multi-megabyte buffers
//! through every request. glibc returns such memory to the kernel on free
//! (`munmap`/`madvise`) and the next request faults it in again, page by page: about a
//! third of the server's CPU on a consume run (docs/performance.md). mimalloc keeps
//! freed pages in its thread-local heaps for reuse.
//!
//! Why: `kafka-protocol`'s decoders reserve `Vec` capacity for the element count an
//! array claims before reading the elements. A hostile or corrupt frame claiming 2^31
//! elements asks for hundreds of GiB; the system allocator refuses, and Rust aborts the
//! process on a failed allocation (it cannot be caught). With the reservation merely
//! mapped, the decoder runs out of bytes at the first missing element, returns an error
//! (the connection is closed) and the untouched mapping is unmapped: no memory is used.
//! Legitimate allocations of this size (none are expected) work as before: the pages
//! are allocated when touched.

use std::alloc::{GlobalAlloc, Layout};

use mimalloc::MiMalloc;

/// Allocations at least this large are mapped without reservation.
pub const HUGE_BYTES: usize = 1 << 30;
/// Mappings are page-aligned; larger alignments go to the system allocator.
const PAGE_BYTES: usize = 4096;

/// The allocator described in the module doc.
pub struct HugeAllocGuard;

fn is_huge(layout: &Layout) -> bool {
    layout.size() >= HUGE_BYTES && layout.align() <= PAGE_BYTES
}

// SAFETY: every pointer comes from `MiMalloc` or from `mmap` of `layout.size()` bytes; the
// same `is_huge` test on the same layout routes it back to its own release function.
unsafe impl GlobalAlloc for HugeAllocGuard {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !is_huge(&layout) {
            return MiMalloc.alloc(layout);
        }
        let p = libc::mmap(
            std::ptr::null_mut(),
            layout.size(),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            std::ptr::null_mut()
        } else {
            p.cast()
        }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if is_huge(&layout) {
            // Fresh anonymous mappings read as zeros.
            self.alloc(layout)
        } else {
            MiMalloc.alloc_zeroed(layout)
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if is_huge(&layout) {
            libc::munmap(ptr.cast(), layout.size());
        } else {
            MiMalloc.dealloc(ptr, layout);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
        if !is_huge(&layout) && !is_huge(&new_layout) {
            return MiMalloc.realloc(ptr, layout, new_size);
        }
        let new = self.alloc(new_layout);
        if !new.is_null() {
            std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
            self.dealloc(ptr, layout);
        }
        new
    }
}

#[global_allocator]
static ALLOCATOR: HugeAllocGuard = HugeAllocGuard;

#[cfg(test)]
mod tests {
    #[test]
    fn an_absurd_reservation_succeeds_without_using_memory() {
        // 256 GiB: far beyond this machine, refused by the system allocator.
        let mut v: Vec<u64> = Vec::with_capacity(32 << 30);
        v.push(1);
        assert_eq!(v[0], 1);
        let mut small: Vec<u8> = Vec::with_capacity(16);
        small.extend_from_slice(b"ok");
        small.reserve(HUGE_BYTES);
        assert_eq!(&small[..2], b"ok");
    }

    use super::HUGE_BYTES;
}
