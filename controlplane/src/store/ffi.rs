//! Every `unsafe` call of the controlplane, in one place. Each is a foreign function with its
//! contract stated beside it; the rest of the crate calls only the safe wrappers here, and every
//! other module of the workspace's library crates is compiled with `unsafe_code` forbidden.
//!
//! - [`borrow_sqlite`]: rusqlite on sqlx's own SQLite connection, inside a write transaction
//!   (`sqlite_write.rs`: the request rows of an ingest).
//! - [`peer_port`], [`set_nodelay`], [`nodelay`]: `TCP_NODELAY` on sqlx's PostgreSQL sockets,
//!   which sqlx 0.9.0 leaves off (`nodelay.rs`).
#![expect(
    unsafe_code,
    reason = "this module is the crate's one place for foreign calls"
)]

use std::ptr::NonNull;

/// A rusqlite connection on a handle it does not own: dropping it finalizes the statements
/// prepared on it, never the connection.
///
/// The caller must hold sqlx's handle lock (`LockedSqliteHandle`) while it makes this call, and
/// make every later call into the result (its statements, its drop) only while sqlx's worker
/// makes none on the handle: under that lock again, or while no command sent to the worker may
/// still be running. It must drop the result before sqlx closes the connection.
pub(crate) fn borrow_sqlite(
    raw: NonNull<rusqlite::ffi::sqlite3>,
) -> rusqlite::Result<rusqlite::Connection> {
    // SAFETY: `raw` is an open connection (sqlx's, from `LockedSqliteHandle`), which outlives
    // the result, and on which no two threads make calls at once: `sqlite_write::WriteConn`
    // touches the result only under the handle lock or while sqlx's worker is idle, and drops
    // it before the sqlx connection.
    unsafe { rusqlite::Connection::from_handle(raw.as_ptr()) }
}

/// The port of the peer `fd` is connected to, if it is a connected IPv4 or IPv6 socket.
///
/// `fd` is only a number here: one that was closed meanwhile, or is not a socket, makes the
/// call fail, and one reused by another socket is judged by its own peer.
#[cfg(target_os = "linux")]
pub(crate) fn peer_port(fd: libc::c_int) -> Option<u16> {
    // SAFETY: an all-zero `sockaddr_storage` is a valid value of that plain C struct.
    let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::sockaddr_storage>()).ok()?;
    // SAFETY: `addr` is writable for `len` bytes and `len` is a valid pointer; the kernel
    // writes at most `len` bytes and checks the descriptor itself.
    let rc = unsafe { libc::getpeername(fd, (&raw mut addr).cast(), &raw mut len) };
    if rc != 0 {
        return None;
    }
    match libc::c_int::from(addr.ss_family) {
        libc::AF_INET => {
            // SAFETY: for AF_INET the kernel wrote a `sockaddr_in`, which fits in the storage
            // and has no stricter alignment.
            let v4 = unsafe { &*(&raw const addr).cast::<libc::sockaddr_in>() };
            Some(u16::from_be(v4.sin_port))
        }
        libc::AF_INET6 => {
            // SAFETY: as above, for `sockaddr_in6`.
            let v6 = unsafe { &*(&raw const addr).cast::<libc::sockaddr_in6>() };
            Some(u16::from_be(v6.sin6_port))
        }
        _ => None,
    }
}

/// Sets `TCP_NODELAY` on `fd`; false when the call failed (not a TCP socket, closed).
#[cfg(target_os = "linux")]
pub(crate) fn set_nodelay(fd: libc::c_int) -> bool {
    let on: libc::c_int = 1;
    let Ok(len) = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>()) else {
        return false;
    };
    // SAFETY: `on` is a readable `c_int` of `len` bytes; the kernel checks the descriptor.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&raw const on).cast(),
            len,
        )
    };
    rc == 0
}

/// Whether `TCP_NODELAY` is set on `fd`; `None` when it is not a TCP socket (or closed).
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn nodelay(fd: libc::c_int) -> Option<bool> {
    let mut value: libc::c_int = 0;
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::c_int>()).ok()?;
    // SAFETY: `value` is writable for `len` bytes and `len` is a valid pointer; the kernel
    // checks the descriptor.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_NODELAY,
            (&raw mut value).cast(),
            &raw mut len,
        )
    };
    (rc == 0).then_some(value != 0)
}
