//! `nm-gateway`: the allocator, then the command line ([`nm_gateway::command`]).

use std::alloc::{GlobalAlloc, Layout};
use std::ffi::c_void;
use std::process::ExitCode;

use libmimalloc_sys as mi;

/// mimalloc instead of the system allocator: a proxied request makes about fifty small
/// allocations, and glibc's malloc and free were a fifth of the gateway's instructions under load.
#[global_allocator]
static GLOBAL: MiMalloc = MiMalloc;

/// mimalloc, asked through its plain entry points whenever the layout allows. Every mimalloc
/// block is word-aligned (each size class is a whole number of words, each page starts aligned),
/// so a layout aligned to a word or less needs no aligned call; the `mimalloc` crate's
/// allocator makes every call an aligned one, which costs about 30 more instructions per
/// allocation (about fifty per proxied request).
struct MiMalloc;

/// The alignment every block `mi_malloc` returns has.
const WORD: usize = std::mem::size_of::<usize>();

/// A new block for `layout`, zeroed or not: mimalloc's plain calls when a word's alignment is
/// enough, its aligned ones above that.
///
/// # Safety
/// As [`GlobalAlloc::alloc`]: `layout` has a non-zero size.
#[allow(unsafe_code, reason = "calls into mimalloc")]
#[inline(always)]
unsafe fn new_block(layout: Layout, zeroed: bool) -> *mut u8 {
    let (size, align) = (layout.size(), layout.align());
    // SAFETY: mimalloc's allocation calls take any size, and the aligned ones any power of two.
    let p = unsafe {
        match (align <= WORD, zeroed) {
            (true, false) => mi::mi_malloc(size),
            (true, true) => mi::mi_zalloc(size),
            (false, false) => mi::mi_malloc_aligned(size, align),
            (false, true) => mi::mi_zalloc_aligned(size, align),
        }
    };
    p.cast()
}

// SAFETY (all four): the pointers passed back were returned by the same family of mimalloc
// calls (`mi_free` and `mi_realloc` take blocks of the aligned calls too), and a layout of
// alignment above a word goes to the aligned calls, which honour any power of two.
#[allow(
    unsafe_code,
    reason = "a global allocator is foreign calls by definition"
)]
unsafe impl GlobalAlloc for MiMalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        unsafe { new_block(layout, false) }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        unsafe { new_block(layout, true) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        unsafe { mi::mi_free(ptr.cast::<c_void>()) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let ptr = ptr.cast::<c_void>();
        let p = unsafe {
            if layout.align() <= WORD {
                mi::mi_realloc(ptr, new_size)
            } else {
                mi::mi_realloc_aligned(ptr, new_size, layout.align())
            }
        };
        p.cast()
    }
}

/// mimalloc's `purge_delay` option (`mi_option_purge_delay` in `mimalloc.h`; the Rust bindings
/// name only some options).
const MI_OPTION_PURGE_DELAY: mi::mi_option_t = 15;

/// How long mimalloc keeps freed memory before returning it to the OS. Its default (10 ms)
/// returns pages between bursts of requests only to fault them back in moments later: under
/// load that was 0.7 page faults per request and about a tenth of the gateway's CPU. A second
/// keeps steady traffic fault-free and still hands memory back after a burst.
const ALLOCATOR_PURGE_DELAY_MS: std::ffi::c_long = 1_000;

#[allow(unsafe_code, reason = "mi_option_set is a foreign function")]
fn tune_allocator() {
    // SAFETY: `mi_option_set` takes plain integers and may be called at any time; mimalloc
    // reads its options atomically.
    unsafe { mi::mi_option_set(MI_OPTION_PURGE_DELAY, ALLOCATOR_PURGE_DELAY_MS) };
}

fn main() -> ExitCode {
    tune_allocator();
    nm_gateway::command::main()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size up to a few pages, at every alignment up to a page: the block is aligned, holds
    /// what was written, and keeps it through growing and shrinking.
    #[test]
    #[allow(unsafe_code, reason = "calls the allocator directly")]
    fn blocks_are_aligned_and_keep_their_bytes() {
        let sizes = (1..=256).chain([511, 512, 1000, 4095, 4096, 10_000, 70_000, 1 << 20]);
        for size in sizes {
            for align in [1, 2, 4, 8, 16, 32, 64, 128, 4096] {
                let layout = Layout::from_size_align(size, align).expect("a valid layout");
                // SAFETY: a non-zero size; every block is freed with its layout.
                unsafe {
                    for zeroed in [false, true] {
                        let p = if zeroed {
                            GLOBAL.alloc_zeroed(layout)
                        } else {
                            GLOBAL.alloc(layout)
                        };
                        assert!(!p.is_null());
                        assert_eq!(p as usize % align, 0, "size {size}, align {align}");
                        if zeroed {
                            assert!(std::slice::from_raw_parts(p, size).iter().all(|b| *b == 0));
                        }
                        std::ptr::write_bytes(p, 0xa5, size);
                        let grown = GLOBAL.realloc(p, layout, size * 3);
                        assert_eq!(grown as usize % align, 0, "grown {size}, align {align}");
                        assert!(
                            std::slice::from_raw_parts(grown, size)
                                .iter()
                                .all(|b| *b == 0xa5)
                        );
                        let bigger = Layout::from_size_align(size * 3, align).expect("valid");
                        let shrunk = GLOBAL.realloc(grown, bigger, size.div_ceil(2));
                        assert_eq!(shrunk as usize % align, 0, "shrunk {size}, align {align}");
                        assert!(
                            std::slice::from_raw_parts(shrunk, size.div_ceil(2))
                                .iter()
                                .all(|b| *b == 0xa5)
                        );
                        let half = Layout::from_size_align(size.div_ceil(2), align).expect("valid");
                        GLOBAL.dealloc(shrunk, half);
                    }
                }
            }
        }
    }
}
