//! `TCP_NODELAY` on the PostgreSQL connections.
//!
//! sqlx 0.9.0 no longer sets `TCP_NODELAY` on its sockets (transact-rs/sqlx#4335; the fix,
//! #4336, is not in a release yet). With Nagle's algorithm on, the last small segment of a
//! statement written in several waits until the server acknowledges the previous one, and the
//! server delays that acknowledgement (40 ms on Linux). Storing a batch of 1,000 request records
//! paid it on most of its statements: 3,000 records/s on PostgreSQL, against 31,600 with the
//! option set; signals and every other query paid it too.
//!
//! sqlx does not hand out its sockets, so after each new connection [`set_on_sockets_to`] looks
//! through the process's open descriptors for TCP sockets connected to the database's port and
//! sets the option on them. On another socket that happens to talk to the same port it is
//! equally right. It costs a `getpeername` per open descriptor, once per new database
//! connection (the pool holds at most 16). Linux only (`/proc/self/fd`); elsewhere it does
//! nothing. Remove it once a sqlx release sets the option again.

/// Sets `TCP_NODELAY` on every socket of this process connected to a peer on `port`; returns
/// how many it set.
#[cfg(target_os = "linux")]
pub(crate) fn set_on_sockets_to(port: u16) -> usize {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return 0;
    };
    fds.flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<libc::c_int>().ok())
        .filter(|&fd| peer_port(fd) == Some(port) && set_nodelay(fd))
        .count()
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn set_on_sockets_to(_port: u16) -> usize {
    0
}

/// The port of the peer `fd` is connected to, if it is a connected IPv4 or IPv6 socket.
///
/// `fd` is only a number here: one that was closed meanwhile, or is not a socket, makes the
/// call fail, and one reused by another socket is judged by its own peer.
#[cfg(target_os = "linux")]
#[allow(unsafe_code, reason = "getpeername is a foreign function")]
fn peer_port(fd: libc::c_int) -> Option<u16> {
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
#[allow(unsafe_code, reason = "setsockopt is a foreign function")]
fn set_nodelay(fd: libc::c_int) -> bool {
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

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    /// Only sockets talking to the given port get the option, and they do get it.
    #[tokio::test]
    async fn sets_nodelay_on_connections_to_the_port() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let client = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .unwrap();
        let (served, _) = listener.accept().await.unwrap();
        assert!(!client.nodelay().unwrap());
        assert!(set_on_sockets_to(port) >= 1);
        assert!(client.nodelay().unwrap());
        // The server's end is peered to the client's ephemeral port, not to `port`.
        assert!(!served.nodelay().unwrap());
    }
}
