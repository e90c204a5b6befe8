//! A global allocator that measures what one thread allocates while "armed": the largest
//! single request and the peak of (allocated - freed) bytes on that thread.
//!
//! The corruption cases arm it around opening and walking a damaged image, after the image
//! bytes are in the RAM device, so any large allocation it sees was sized by something the
//! engine read from the image. Other threads (and the test thread building images) are not
//! measured.
//!
//! Being the `#[global_allocator]`, it serves the library's whole unit-test binary (every unit
//! test and white-box suite; a binary has one global allocator), not just the suites that arm
//! it: unarmed threads pay a thread-local check per call, and large buffers take the mapping
//! below.
//!
//! Buffers of [`HUGE`] bytes or more (the test images, copied for every case) are
//! mapped directly, 2 MiB aligned, with transparent huge pages requested: faulting in 4 KiB
//! pages was most of the suite's run time.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

pub(crate) struct Tracking;

#[global_allocator]
static GLOBAL: Tracking = Tracking;

thread_local! {
    static ARMED: Cell<bool> = const { Cell::new(false) };
    static MAX_ONE: Cell<usize> = const { Cell::new(0) };
    static LIVE: Cell<i64> = const { Cell::new(0) };
    static PEAK: Cell<i64> = const { Cell::new(0) };
}

fn note_alloc(size: usize) {
    let _ = ARMED.try_with(|a| {
        if a.get() {
            let _ = MAX_ONE.try_with(|m| m.set(m.get().max(size)));
            let _ = LIVE.try_with(|l| {
                let v = l.get() + size as i64;
                l.set(v);
                let _ = PEAK.try_with(|p| p.set(p.get().max(v)));
            });
        }
    });
}

fn note_free(size: usize) {
    let _ = ARMED.try_with(|a| {
        if a.get() {
            let _ = LIVE.try_with(|l| l.set(l.get() - size as i64));
        }
    });
}

/// Allocations at least this large get their own huge-page mapping.
pub(crate) const HUGE: usize = 4 << 20;
const TWO_MB: usize = 2 << 20;

fn map_len(size: usize) -> usize {
    (size + 4095) & !4095
}

/// Maps `size` bytes (zeroed), 2 MiB aligned, asking for huge pages. Null on failure.
unsafe fn map_huge(size: usize) -> *mut u8 {
    let len = map_len(size);
    // SAFETY: an anonymous private mapping; the unaligned head and the tail are unmapped
    // again, leaving exactly [q, q + len) mapped.
    unsafe {
        let p = libc::mmap(
            std::ptr::null_mut(),
            len + TWO_MB,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        let p = p as usize;
        let q = (p + TWO_MB - 1) & !(TWO_MB - 1);
        if q > p {
            libc::munmap(p as *mut libc::c_void, q - p);
        }
        let tail = p + len + TWO_MB - (q + len);
        if tail > 0 {
            libc::munmap((q + len) as *mut libc::c_void, tail);
        }
        libc::madvise(q as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        q as *mut u8
    }
}

// SAFETY: small calls are forwarded unchanged to the system allocator; large ones get a private
// anonymous mapping (zeroed, page aligned, which satisfies any alignment up to 2 MiB) that is
// unmapped with the same rounded length. The bookkeeping only touches const-initialised thread
// locals without destructors.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        if layout.size() >= HUGE && layout.align() <= TWO_MB {
            return unsafe { map_huge(layout.size()) };
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note_alloc(layout.size());
        if layout.size() >= HUGE && layout.align() <= TWO_MB {
            return unsafe { map_huge(layout.size()) };
        }
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        note_free(layout.size());
        if layout.size() >= HUGE && layout.align() <= TWO_MB {
            unsafe { libc::munmap(ptr.cast(), map_len(layout.size())) };
            return;
        }
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.size() < HUGE && new_size < HUGE {
            note_free(layout.size());
            note_alloc(new_size);
            return unsafe { System.realloc(ptr, layout, new_size) };
        }
        // Crossing or above the threshold: allocate, copy, free (counted by those calls).
        // SAFETY: the new layout is valid (same alignment, non-zero size per the contract).
        unsafe {
            let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
            let q = self.alloc(new_layout);
            if !q.is_null() {
                std::ptr::copy_nonoverlapping(ptr, q, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            q
        }
    }
}

/// What the armed thread allocated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct AllocReport {
    /// Largest single allocation request, bytes.
    pub max_single: usize,
    /// Peak of bytes allocated minus bytes freed on this thread since arming.
    pub peak_live: i64,
}

/// Starts measuring on the current thread (resets the counters).
pub(crate) fn arm() {
    MAX_ONE.with(|m| m.set(0));
    LIVE.with(|l| l.set(0));
    PEAK.with(|p| p.set(0));
    ARMED.with(|a| a.set(true));
}

/// Stops measuring on the current thread and returns the report.
pub(crate) fn disarm() -> AllocReport {
    ARMED.with(|a| a.set(false));
    AllocReport {
        max_single: MAX_ONE.with(|m| m.get()),
        peak_live: PEAK.with(|p| p.get()),
    }
}
