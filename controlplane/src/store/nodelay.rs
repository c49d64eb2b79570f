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
//! nothing. Remove it once a sqlx release sets the option again: the test
//! `sqlx_still_leaves_nagle_on` fails on that day. The foreign calls are in [`super::ffi`].

#[cfg(target_os = "linux")]
use super::ffi;

/// Sets `TCP_NODELAY` on every socket of this process connected to a peer on `port`; returns
/// how many it set.
#[cfg(target_os = "linux")]
pub(crate) fn set_on_sockets_to(port: u16) -> usize {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return 0;
    };
    fds.flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<libc::c_int>().ok())
        .filter(|&fd| ffi::peer_port(fd) == Some(port) && ffi::set_nodelay(fd))
        .count()
}

/// The descriptors of this process's TCP sockets connected to a peer on `port`, with whether
/// `TCP_NODELAY` is set on each.
#[cfg(all(test, target_os = "linux"))]
pub(crate) fn sockets_to(port: u16) -> Vec<(libc::c_int, bool)> {
    let Ok(fds) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    fds.flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<libc::c_int>().ok())
        .filter(|&fd| ffi::peer_port(fd) == Some(port))
        .filter_map(|fd| Some((fd, ffi::nodelay(fd)?)))
        .collect()
}

#[cfg(not(target_os = "linux"))]
pub(crate) fn set_on_sockets_to(_port: u16) -> usize {
    0
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

    /// The store's own connections get it: every socket it opens to the server has Nagle's
    /// algorithm off (each statement would otherwise wait for a delayed acknowledgement).
    #[tokio::test]
    async fn the_stores_postgres_connections_have_nodelay() {
        let Some(db) = crate::scratch::ScratchPg::for_tests().await else {
            return;
        };
        let opts: sea_orm::sqlx::postgres::PgConnectOptions = db.url.parse().unwrap();
        if opts.get_host().starts_with('/') {
            eprintln!("SKIPPED: NM_TEST_POSTGRES_URL names a Unix socket, not TCP");
            return;
        }
        let store = crate::store::Store::connect(&db.url).await.unwrap();
        let sockets = sockets_to(opts.get_port());
        assert!(!sockets.is_empty(), "the store opened no connection");
        assert!(
            sockets.iter().all(|(_, on)| *on),
            "a connection of the store has Nagle's algorithm on: {sockets:?}"
        );
        store.close().await.unwrap();
        crate::scratch::drop_test_db(&db.url).await;
    }

    /// The canary for this module: a connection sqlx opens by itself still has Nagle's
    /// algorithm on. The day this fails, a sqlx release sets `TCP_NODELAY` again: delete this
    /// module and its call in `Store::connect`.
    #[tokio::test]
    async fn sqlx_still_leaves_nagle_on() {
        use sea_orm::sqlx::{Connection, PgConnection};
        let Ok(server) = std::env::var(crate::scratch::TEST_POSTGRES_ENV) else {
            eprintln!("SKIPPED PostgreSQL variant: set NM_TEST_POSTGRES_URL to run it");
            return;
        };
        let opts: sea_orm::sqlx::postgres::PgConnectOptions = server.parse().unwrap();
        if opts.get_host().starts_with('/') {
            eprintln!("SKIPPED: NM_TEST_POSTGRES_URL names a Unix socket, not TCP");
            return;
        }
        let port = opts.get_port();
        let before: Vec<libc::c_int> = sockets_to(port).into_iter().map(|(fd, _)| fd).collect();
        let mut conn = PgConnection::connect_with(&opts).await.unwrap();
        conn.ping().await.unwrap();
        let new: Vec<(libc::c_int, bool)> = sockets_to(port)
            .into_iter()
            .filter(|(fd, _)| !before.contains(fd))
            .collect();
        assert!(!new.is_empty(), "no new socket to port {port} found");
        assert!(
            new.iter().all(|(_, on)| !on),
            "sqlx now sets TCP_NODELAY itself on its PostgreSQL sockets: remove \
             controlplane/src/store/nodelay.rs and its after_connect hook in Store::connect"
        );
        conn.close().await.unwrap();
    }
}
