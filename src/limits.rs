//! The process's open-file limit: raised to its hard limit at start, and the base of the
//! dataplane's default connection cap.
//!
//! Every client connection, upstream connection, database connection and spool file is a file
//! descriptor. Many systems start processes with a soft limit of 1,024 while allowing far more
//! (the hard limit); a gateway held to 1,024 runs out under ordinary load, and `accept` then
//! fails in a loop. So `main` raises the soft limit to the hard one before serving (a process
//! may always do that), and the connection cap, unless set, is derived from the result
//! ([`nm_dataplane::conns::max_connections_for`]) so that client connections alone can never
//! exhaust the table.

use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};

/// The soft open-file limit now (`None`: unlimited).
pub fn nofile() -> Option<u64> {
    getrlimit(Resource::Nofile).current
}

/// Raises the soft open-file limit to the hard limit; returns (before, after).
pub fn raise_nofile() -> std::io::Result<(Option<u64>, Option<u64>)> {
    let limit = getrlimit(Resource::Nofile);
    if limit.current == limit.maximum {
        return Ok((limit.current, limit.current));
    }
    setrlimit(
        Resource::Nofile,
        Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        },
    )?;
    Ok((limit.current, nofile()))
}

/// The connection cap to use: `configured`, or (0) the default for the open-file limit.
pub fn connection_cap(configured: usize) -> usize {
    if configured > 0 {
        return configured;
    }
    nm_dataplane::conns::max_connections_for(nofile().unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Run in a process of its own (nextest): lowers its own soft limit, then raises it back.
    #[test]
    fn raises_the_soft_limit_to_the_hard_one() {
        let limit = getrlimit(Resource::Nofile);
        let Some(hard) = limit.maximum else {
            return;
        };
        let low = hard.min(256);
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: Some(low),
                maximum: Some(hard),
            },
        )
        .unwrap();
        assert_eq!(nofile(), Some(low));
        let (before, after) = raise_nofile().unwrap();
        assert_eq!(before, Some(low));
        assert_eq!(after, Some(hard));
        assert_eq!(
            connection_cap(0),
            nm_dataplane::conns::max_connections_for(hard)
        );
        assert_eq!(connection_cap(7), 7);
    }
}
