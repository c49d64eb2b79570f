//! Arize Phoenix, a real OpenTelemetry backend with a UI, as a child process on free loopback
//! ports, for end-to-end checks that what the gateway exports is what a backend shows.
//! `.ci/run` installs it into `target/phoenix-venv` and sets `NM_TEST_PHOENIX` to its `phoenix`
//! script; without it [`start`] prints a `SKIPPED` line and returns `None`.
//!
//! What Phoenix (arize-phoenix 20.26) does with spans, learned against the installed version:
//! - Ingest: OTLP/gRPC on `PHOENIX_GRPC_PORT` (it binds all interfaces: send to 127.0.0.1 only)
//!   and OTLP/HTTP protobuf at `http://127.0.0.1:PHOENIX_PORT/v1/traces`. Ready when
//!   `GET /healthz` answers 200 (about 8 to 11 s here after start, a fresh SQLite database in
//!   `PHOENIX_WORKING_DIR`).
//! - Projects: a span lands in the project named by the *resource* attribute
//!   `openinference.project.name` (or an `x-project-name` header on OTLP/HTTP), else in
//!   `default`. `service.name` does NOT pick the project. `GET /v1/projects` lists them
//!   (`{"data":[{"name","id","description"}],"next_cursor"}`).
//! - Read back: `GET /v1/projects/{name}/spans?trace_id=..&limit=..` gives `{"data":[..],
//!   "next_cursor"}`, each span `{"id","name","context":{"trace_id","span_id"},"span_kind",
//!   "parent_id","start_time","end_time","status_code","status_message","attributes":{..},
//!   "events":[{"name","timestamp","attributes"}]}`; ids in lower-case hex; attributes a flat
//!   object keyed by the full dotted name (`"gen_ai.request.model": "gpt-4o"`, ints as numbers,
//!   arrays as arrays). No resource attributes and no links in this view.
//! - `span_kind` is the OpenInference kind, not the OTel one: `LLM` for a span carrying
//!   `gen_ai.*` attributes (Phoenix adds `openinference.span.kind`), else `UNKNOWN`; OTel's
//!   SERVER/CLIENT is not kept (`/spans/otlpv1` reports every span as `SPAN_KIND_INTERNAL`).
//! - It derives OpenInference attributes from the GenAI ones and returns both:
//!   `gen_ai.request.model` -> `llm.model_name`, `gen_ai.provider.name` -> `llm.provider` and
//!   `llm.system`, `gen_ai.usage.input_tokens`/`output_tokens` -> `llm.token_count.prompt`/
//!   `completion` (+ `llm.token_count.total`).
//! - `status_code` is `OK`, `ERROR` or `UNSET`, with `status_message`.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use super::http::{TestClient, client, read, request, send};

/// How long Phoenix may take to answer `/healthz` (it needs about 8 to 25 s).
const READY_WITHIN: Duration = Duration::from_secs(90);

/// A running Phoenix; `Drop` kills it and anything it started.
pub struct Phoenix {
    child: Child,
    http_port: u16,
    grpc_port: u16,
    log: PathBuf,
    client: TestClient,
    // Last: removed after the process is gone.
    _dir: tempfile::TempDir,
}

impl std::fmt::Debug for Phoenix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Phoenix")
            .field("pid", &self.child.id())
            .field("http_port", &self.http_port)
            .field("grpc_port", &self.grpc_port)
            .finish()
    }
}

/// Starts Phoenix from `NM_TEST_PHOENIX` on free ports with a fresh working directory, and waits
/// until it answers. `None` (after a `SKIPPED` line) when the variable is not set.
pub async fn start() -> Option<Phoenix> {
    let Ok(bin) = std::env::var("NM_TEST_PHOENIX") else {
        eprintln!(
            "SKIPPED Phoenix check: set NM_TEST_PHOENIX to an arize-phoenix `phoenix` script (.ci/run installs one into target/phoenix-venv)"
        );
        return None;
    };
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
    let http_port = free_port("127.0.0.1:0");
    // Phoenix's gRPC server binds every interface: the port must be free on all of them.
    let grpc_port = free_port("0.0.0.0:0");
    let log = dir.path().join("phoenix.log");
    let out = std::fs::File::create(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
    let err = out
        .try_clone()
        .unwrap_or_else(|e| panic!("{}: {e}", log.display()));
    let mut cmd = Command::new(&bin);
    cmd.arg("serve")
        .env("PHOENIX_HOST", "127.0.0.1")
        .env("PHOENIX_PORT", http_port.to_string())
        .env("PHOENIX_GRPC_PORT", grpc_port.to_string())
        .env("PHOENIX_WORKING_DIR", dir.path())
        // No requests to the internet, no pixels, no assistant (which dials a docs server).
        .env("PHOENIX_TELEMETRY_ENABLED", "false")
        .env("PHOENIX_ALLOW_EXTERNAL_RESOURCES", "false")
        .env("PHOENIX_DISABLE_AGENT_ASSISTANT", "true")
        .env("PHOENIX_ENABLE_MCP_SERVER", "false")
        // An OTEL_* setting of the test run must not turn Phoenix's own tracing on.
        .env_remove("OTEL_EXPORTER_OTLP_ENDPOINT")
        .env_remove("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        .stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err));
    // Its own process group, so Drop can kill whatever it forks too.
    std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
    let started = std::time::Instant::now();
    let child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {bin}: {e}"));
    let mut phoenix = Phoenix {
        child,
        http_port,
        grpc_port,
        log,
        client: client(),
        _dir: dir,
    };
    phoenix.wait_ready().await;
    eprintln!(
        "Phoenix ready in {:.1} s (http {}, grpc {})",
        started.elapsed().as_secs_f64(),
        http_port,
        grpc_port
    );
    Some(phoenix)
}

fn free_port(addr: &str) -> u16 {
    TcpListener::bind(addr)
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("free port on {addr}: {e}"))
}

// === impl Phoenix ===

impl Phoenix {
    /// OTLP/gRPC: `http://127.0.0.1:G`.
    pub fn grpc_endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.grpc_port)
    }

    /// The HTTP server (UI, REST, OTLP/HTTP at `/v1/traces`): `http://127.0.0.1:P`.
    pub fn http_endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port)
    }

    /// The spans of the `default` project (where spans without `openinference.project.name`
    /// go), newest first.
    pub async fn spans(&self) -> Value {
        self.spans_in("default").await
    }

    /// Every span of a project, newest first, as a JSON array (all pages).
    pub async fn spans_in(&self, project: &str) -> Value {
        self.pages(&format!("/v1/projects/{project}/spans?limit=1000"))
            .await
    }

    /// The names of all projects.
    pub async fn projects(&self) -> Vec<String> {
        let projects = self.pages("/v1/projects?limit=100").await;
        projects
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|p| p["name"].as_str().map(str::to_owned))
            .collect()
    }

    /// Polls every project until the trace has a span, and returns its spans (a JSON array).
    /// Spans of one export arrive together; use [`Phoenix::wait_for_trace_spans`] for more.
    pub async fn wait_for_trace(&self, trace_id: &str, timeout: Duration) -> Value {
        self.wait_for_trace_spans(trace_id, 1, timeout).await
    }

    /// Polls every project until the trace has at least `at_least` spans, and returns them.
    pub async fn wait_for_trace_spans(
        &self,
        trace_id: &str,
        at_least: usize,
        timeout: Duration,
    ) -> Value {
        let what = format!("{at_least} span(s) of trace {trace_id} in Phoenix");
        let spans = super::eventually_with(
            timeout,
            &what,
            || self.log_tail(),
            || async {
                let mut spans = Vec::new();
                for project in self.projects().await {
                    let found = self
                        .pages(&format!(
                            "/v1/projects/{project}/spans?limit=1000&trace_id={trace_id}"
                        ))
                        .await;
                    spans.extend(found.as_array().into_iter().flatten().cloned());
                }
                (spans.len() >= at_least).then_some(spans)
            },
        )
        .await;
        Value::Array(spans)
    }

    /// The last lines of Phoenix's stdout and stderr.
    pub fn log_tail(&self) -> String {
        tail(&self.log)
    }

    /// GETs a paginated list and concatenates its `data` arrays.
    async fn pages(&self, path_and_query: &str) -> Value {
        let mut all = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let url = match &cursor {
                Some(c) => format!("{}{path_and_query}&cursor={c}", self.http_endpoint()),
                None => format!("{}{path_and_query}", self.http_endpoint()),
            };
            let a = read(send(&self.client, request("GET", &url, &[], "")).await).await;
            assert_eq!(
                a.status,
                200,
                "Phoenix GET {url}: {}\n{}",
                String::from_utf8_lossy(&a.body),
                self.log_tail()
            );
            let page = a.json();
            all.extend(page["data"].as_array().into_iter().flatten().cloned());
            match page["next_cursor"].as_str() {
                Some(c) if !c.is_empty() => cursor = Some(c.to_owned()),
                _ => return Value::Array(all),
            }
        }
    }

    /// Until `/healthz` answers 200 and the gRPC port accepts connections; panics with the log's
    /// tail if Phoenix exits or takes longer than [`READY_WITHIN`].
    async fn wait_ready(&mut self) {
        let health = format!("{}/healthz", self.http_endpoint());
        let grpc = SocketAddr::from(([127, 0, 0, 1], self.grpc_port));
        let (log, client) = (&self.log, &self.client);
        let child = std::sync::Mutex::new(&mut self.child);
        super::eventually_with(
            READY_WITHIN,
            "Phoenix to be ready",
            || tail(log),
            || async {
                if let Ok(mut c) = child.lock()
                    && let Ok(Some(status)) = c.try_wait()
                {
                    panic!(
                        "Phoenix exited ({status}) before it was ready\n{}",
                        tail(log)
                    );
                }
                let healthy = match client.request(request("GET", &health, &[], "")).await {
                    Ok(r) => r.status() == 200,
                    Err(_) => false,
                };
                (healthy && TcpStream::connect_timeout(&grpc, Duration::from_secs(1)).is_ok())
                    .then_some(())
            },
        )
        .await
    }
}

/// The last 40 lines of the log at `path`, for a panic's message.
fn tail(path: &std::path::Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    format!(
        "--- phoenix.log (tail) ---\n{}",
        lines[lines.len().saturating_sub(40)..].join("\n")
    )
}

impl Drop for Phoenix {
    fn drop(&mut self) {
        // The group's id is the child's pid (process_group(0)).
        let _ = rustix::process::kill_process_group(
            rustix::process::Pid::from_child(&self.child),
            rustix::process::Signal::KILL,
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
