//! `nm-gateway`: the allocator, then the command line ([`nm_gateway::command`]).

use std::process::ExitCode;

/// mimalloc instead of the system allocator: a proxied request makes a few hundred small
/// allocations, and glibc's malloc and free were a fifth of the gateway's instructions under load.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `purge_delay` option (`mi_option_purge_delay` in `mimalloc.h`; the Rust bindings
/// name only some options).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// How long mimalloc keeps freed memory before returning it to the OS. Its default (10 ms)
/// returns pages between bursts of requests only to fault them back in moments later: under
/// load that was 0.7 page faults per request and about a tenth of the gateway's CPU. A second
/// keeps steady traffic fault-free and still hands memory back after a burst.
const ALLOCATOR_PURGE_DELAY_MS: std::ffi::c_long = 1_000;

/// The crate's one `unsafe`: a foreign call that sets an integer option.
#[allow(unsafe_code, reason = "mi_option_set is a foreign function")]
fn tune_allocator() {
    // SAFETY: `mi_option_set` takes plain integers and may be called at any time; mimalloc
    // reads its options atomically.
    unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, ALLOCATOR_PURGE_DELAY_MS) };
}

fn main() -> ExitCode {
    tune_allocator();
    nm_gateway::command::main()
}
