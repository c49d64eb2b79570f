//! A dataplane as a process of its own (the real binary), for faults that need one: `kill -9`.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use super::eventually;

const BIN: &str = env!("CARGO_BIN_EXE_nm-gateway");

/// A spawned `nm-gateway dataplane`, its stderr collected line by line.
pub struct DataplaneProcess {
    child: Child,
    stderr: Arc<Mutex<Vec<String>>>,
    pub http: SocketAddr,
}

impl DataplaneProcess {
    /// Starts `nm-gateway dataplane` on a free loopback port with `env`, and waits until it
    /// listens.
    pub async fn start(env: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(BIN);
        cmd.args(["dataplane", "--http-addr", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {BIN}: {e}"));
        let stderr = Arc::new(Mutex::new(Vec::new()));
        if let Some(pipe) = child.stderr.take() {
            let sink = stderr.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                    if let Ok(mut l) = sink.lock() {
                        l.push(line);
                    }
                }
            });
        }
        let needle = "dataplane HTTP listening on ";
        let lines = stderr.clone();
        let http = eventually(Duration::from_secs(30), needle, || {
            let found = lines.lock().ok().and_then(|l| {
                l.iter().find_map(|line| {
                    let rest = &line[line.find(needle)? + needle.len()..];
                    rest.split([' ', '"', ',']).next()?.parse().ok()
                })
            });
            async move { found }
        })
        .await;
        Self {
            child,
            stderr,
            http,
        }
    }

    /// Everything it logged so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().map(|l| l.join("\n")).unwrap_or_default()
    }

    /// `kill -9`, and waits until it is gone.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for DataplaneProcess {
    fn drop(&mut self) {
        self.kill9();
    }
}
