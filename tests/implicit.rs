//! Implicit signals end to end: real gateways in the split shape, mock providers of the three
//! wire formats answering JSON and streams, and the records read back as the dataplane shipped
//! them (`RequestRecord::inferred`): with the controlplane stopped first, every record goes to
//! the dataplane's spool, read once the dataplane has stopped. (What the controlplane stores of
//! them is tested beside its ingest.)
//!
//! Each rule in each wire format, JSON and streamed; `client_disconnect`; rules switched off
//! (globally, per agent) leave nothing; a session spread over two dataplanes, measured; the
//! memory cap under many sessions; no prompt or answer text in the spool or the database
//! (canary).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nm_dataplane::spool::Spool;
use nm_types::record::RequestRecord;
use nm_types::signal::Rule;

use crate::common::eventually;
use crate::common::gateway::{ADMIN_KEY, Shape, TestGateway};
use crate::common::mock::{MockProvider, RunningMock};

/// In every prompt and every answer: it must never reach the disk.
const CANARY: &str = "CANARY-7f3a9e";

fn answer_text() -> String {
    format!("Voilà — the plan {CANARY}: café ☕, 日本語.")
}

fn q(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_default()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Format {
    OpenAi,
    Anthropic,
    Gemini,
}

/// The providers the test gateway knows: `(prefix, format, streamed)`.
const PROVIDERS: [(&str, Format, bool); 6] = [
    ("openai", Format::OpenAi, false),
    ("openaistream", Format::OpenAi, true),
    ("anthropic", Format::Anthropic, false),
    ("anthropicstream", Format::Anthropic, true),
    ("gemini", Format::Gemini, false),
    ("geministream", Format::Gemini, true),
];

fn path(format: Format, streamed: bool) -> &'static str {
    match (format, streamed) {
        (Format::OpenAi, _) => "/v1/chat/completions",
        (Format::Anthropic, _) => "/v1/messages",
        (Format::Gemini, false) => "/v1beta/models/gemini-2.0-flash:generateContent",
        (Format::Gemini, true) => "/v1beta/models/gemini-2.0-flash:streamGenerateContent?alt=sse",
    }
}

/// A request body: turns `(is_user, text)` after a system prompt.
fn body(format: Format, turns: &[(bool, &str)]) -> String {
    let list: Vec<String> = turns
        .iter()
        .map(|(user, text)| match format {
            Format::OpenAi => format!(
                r#"{{"role":"{}","content":{}}}"#,
                if *user { "user" } else { "assistant" },
                q(text)
            ),
            Format::Anthropic => format!(
                r#"{{"role":"{}","content":[{{"type":"text","text":{}}}]}}"#,
                if *user { "user" } else { "assistant" },
                q(text)
            ),
            Format::Gemini => format!(
                r#"{{"role":"{}","parts":[{{"text":{}}}]}}"#,
                if *user { "user" } else { "model" },
                q(text)
            ),
        })
        .collect();
    let list = list.join(",");
    let system = format!("You are terse. {CANARY}");
    match format {
        Format::OpenAi => format!(
            r#"{{"model":"gpt-4o-mini","messages":[{{"role":"system","content":{}}},{list}]}}"#,
            q(&system)
        ),
        Format::Anthropic => format!(
            r#"{{"model":"claude-sonnet-4-5","max_tokens":64,"system":{},"messages":[{list}]}}"#,
            q(&system)
        ),
        Format::Gemini => format!(
            r#"{{"contents":[{list}],"systemInstruction":{{"parts":[{{"text":{}}}]}}}}"#,
            q(&system)
        ),
    }
}

/// The mock answering `text` in the format, JSON or streamed (in pieces).
fn mock(format: Format, streamed: bool, text: &str) -> MockProvider {
    let pieces: Vec<String> = {
        let chars: Vec<char> = text.chars().collect();
        chars.chunks(4).map(|c| c.iter().collect()).collect()
    };
    if !streamed {
        return MockProvider::json(match format {
            Format::OpenAi => format!(
                r#"{{"id":"c","object":"chat.completion","model":"gpt-4o-mini","choices":[{{"index":0,"message":{{"role":"assistant","content":{}}},"finish_reason":"stop"}}],"usage":{{"prompt_tokens":5,"completion_tokens":7}}}}"#,
                q(text)
            ),
            Format::Anthropic => format!(
                r#"{{"id":"m","type":"message","model":"claude-sonnet-4-5","content":[{{"type":"text","text":{}}}],"stop_reason":"end_turn","usage":{{"input_tokens":5,"output_tokens":7}}}}"#,
                q(text)
            ),
            Format::Gemini => format!(
                r#"{{"candidates":[{{"content":{{"parts":[{{"text":{}}}],"role":"model"}},"index":0,"finishReason":"STOP"}}],"modelVersion":"gemini-2.0-flash"}}"#,
                q(text)
            ),
        });
    }
    let chunks: Vec<String> = match format {
        Format::OpenAi => pieces
            .iter()
            .map(|p| {
                format!(
                    "data: {{\"model\":\"gpt-4o-mini\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}},\"finish_reason\":null}}]}}\n\n",
                    q(p)
                )
            })
            .chain(["data: [DONE]\n\n".to_owned()])
            .collect(),
        Format::Anthropic => std::iter::once(
            "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"claude-sonnet-4-5\",\"usage\":{\"input_tokens\":5}}}\n\n".to_owned(),
        )
        .chain(pieces.iter().map(|p| {
            format!(
                "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":{}}}}}\n\n",
                q(p)
            )
        }))
        .chain(["event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n".to_owned()])
        .collect(),
        Format::Gemini => pieces
            .iter()
            .map(|p| {
                format!(
                    "data: {{\"candidates\":[{{\"content\":{{\"parts\":[{{\"text\":{}}}],\"role\":\"model\"}},\"index\":0}}]}}\r\n\r\n",
                    q(p)
                )
            })
            .collect(),
    };
    MockProvider::sse(chunks.into_iter().map(bytes::Bytes::from).collect())
}

/// A split gateway whose providers are mocks of every format, JSON and streamed, plus a
/// trickling stream (`trickle`), with `env` on top.
async fn gateway(env: &[(&str, &str)], dir: &Path) -> (TestGateway, Vec<RunningMock>) {
    let text = answer_text();
    let mut mocks = Vec::new();
    let mut toml = String::new();
    for (name, format, streamed) in PROVIDERS {
        let m = mock(format, streamed, &text).start().await;
        let (auth, format) = match format {
            Format::OpenAi => ("bearer", "openai"),
            Format::Anthropic => ("x_api_key", "anthropic"),
            Format::Gemini => ("goog_api_key", "gemini"),
        };
        toml.push_str(&format!(
            "[providers.{name}]\nbase_url = \"{}\"\nauth = \"{auth}\"\nformat = \"{format}\"\n",
            m.url
        ));
        mocks.push(m);
    }
    let trickle = MockProvider::trickle(
        "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"x\"}}]}\n\n",
        Duration::from_millis(20),
    )
    .start()
    .await;
    toml.push_str(&format!(
        "[providers.trickle]\nbase_url = \"{}\"\nauth = \"bearer\"\nformat = \"openai\"\n",
        trickle.url
    ));
    mocks.push(trickle);
    let db = format!("sqlite://{}/nm.db?mode=rwc", dir.display());
    let mut b = TestGateway::builder()
        .shape(Shape::Split)
        .config_toml(&toml)
        .env("NM_DATABASE_URL", &db);
    for (k, v) in env {
        b = b.env(k, v);
    }
    (b.run().await, mocks)
}

/// Sends one request; returns its request id.
async fn ask(
    gw: &TestGateway,
    at: Option<std::net::SocketAddr>,
    provider: &str,
    format: Format,
    streamed: bool,
    headers: &[(&str, &str)],
    turns: &[(bool, &str)],
) -> String {
    let mut h = vec![("nm-key", ADMIN_KEY), ("content-type", "application/json")];
    h.extend_from_slice(headers);
    let p = format!("/{provider}{}", path(format, streamed));
    let b = body(format, turns);
    let a = match at {
        Some(http) => gw.raw_at(http, "POST", &p, &h, b).await,
        None => gw.raw("POST", &p, &h, b).await,
    };
    assert_eq!(a.status, 200, "{p}: {:?}", String::from_utf8_lossy(&a.body));
    a.header("nm-request-id").unwrap_or_default().to_owned()
}

/// Stops the dataplanes (the controlplane is already stopped, so every record is spooled) and
/// reads every record from their spools, by request id.
async fn spooled(gw: &mut TestGateway, expected: usize) -> HashMap<String, RequestRecord> {
    eventually(Duration::from_secs(20), "records spooled", || async {
        let m = gw.get("/metrics").await;
        let text = String::from_utf8_lossy(&m.body).into_owned();
        let n: usize = text
            .lines()
            .find_map(|l| l.strip_prefix("nm_spool_records ")?.trim().parse().ok())
            .unwrap_or(0);
        (n >= expected).then_some(())
    })
    .await;
    let dirs = gw.stop_dataplanes().await;
    read_spools(&dirs)
}

/// Reads every record from the spools, after checking that no file of theirs holds the
/// canary.
fn read_spools(dirs: &[PathBuf]) -> HashMap<String, RequestRecord> {
    let mut out = HashMap::new();
    for dir in dirs {
        no_canary_under(dir);
        let mut spool = Spool::open(dir, u64::MAX).unwrap_or_else(|e| panic!("{e}"));
        while let Some(batch) = spool.peek().unwrap_or_else(|e| panic!("{e}")) {
            for r in nm_types::link::decode_batch(&batch.bytes).unwrap_or_else(|e| panic!("{e}")) {
                let r = r.unwrap_or_else(|e| panic!("{e}"));
                out.insert(r.request_id.clone(), r);
            }
            spool.pop().unwrap_or_else(|e| panic!("{e}"));
        }
    }
    out
}

fn inferred(
    records: &HashMap<String, RequestRecord>,
    id: &str,
) -> Vec<(Rule, String, Option<u64>)> {
    let r = records
        .get(id)
        .unwrap_or_else(|| panic!("no record for {id}"));
    r.inferred
        .iter()
        .map(|i| (i.rule, i.answer.as_str().to_owned(), i.edit_distance))
        .collect()
}

/// The four-request conversation every format goes through: asked, asked again (reask of the
/// first), continued with the answer unchanged (continued of the second), continued with it
/// edited (history_edit of the third). Returns the request ids.
async fn conversation(
    gw: &TestGateway,
    hops: [Option<std::net::SocketAddr>; 4],
    provider: &str,
    format: Format,
    streamed: bool,
    headers: &[(&str, &str)],
) -> [String; 4] {
    let text = answer_text();
    let edited = format!("{text} (fixed)");
    let q1 = format!("What is the plan? {CANARY}");
    let r1 = ask(
        gw,
        hops[0],
        provider,
        format,
        streamed,
        headers,
        &[(true, &q1)],
    )
    .await;
    let r2 = ask(
        gw,
        hops[1],
        provider,
        format,
        streamed,
        headers,
        &[(true, &q1)],
    )
    .await;
    let r3 = ask(
        gw,
        hops[2],
        provider,
        format,
        streamed,
        headers,
        &[(true, &q1), (false, &text), (true, "And then?")],
    )
    .await;
    let r4 = ask(
        gw,
        hops[3],
        provider,
        format,
        streamed,
        headers,
        &[
            (true, &q1),
            (false, &text),
            (true, "And then?"),
            (false, &edited),
            (true, "Thanks"),
        ],
    )
    .await;
    [r1, r2, r3, r4]
}

#[tokio::test]
async fn each_rule_in_each_format_json_and_streamed_rides_on_the_records() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (mut gw, _mocks) = gateway(&[("NM_IMPLICIT_RULES_OFF", "quiet:all")], dir.path()).await;
    gw.stop_controlplane().await;
    let mut runs = Vec::new();
    for (i, (provider, format, streamed)) in PROVIDERS.into_iter().enumerate() {
        let session = format!("sess_rules{i}");
        let headers = [("nm-session", session.as_str()), ("nm-agent", "bot")];
        let ids = conversation(&gw, [None; 4], provider, format, streamed, &headers).await;
        runs.push((provider, ids));
    }
    // An agent with every rule off, and a request without a session.
    let quiet = [("nm-session", "sess_quiet"), ("nm-agent", "quiet")];
    let quiet_ids = conversation(&gw, [None; 4], "openai", Format::OpenAi, false, &quiet).await;
    let q1 = format!("What is the plan? {CANARY}");
    let no_session = ask(
        &gw,
        None,
        "openai",
        Format::OpenAi,
        false,
        &[],
        &[(true, &q1)],
    )
    .await;
    // A client that leaves a stream: abandoned.
    let resp = gw
        .send(
            "POST",
            "/trickle/v1/chat/completions",
            &[("nm-key", ADMIN_KEY), ("nm-session", "sess_gone")],
            body(Format::OpenAi, &[(true, &q1)]),
        )
        .await;
    let gone = resp
        .headers()
        .get("nm-request-id")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    let mut b = resp.into_body();
    let _ = http_body_util::BodyExt::frame(&mut b).await;
    drop(b);

    let records = spooled(&mut gw, runs.len() * 4 + 4 + 1 + 1).await;
    for (provider, [r1, r2, r3, r4]) in &runs {
        assert_eq!(inferred(&records, r1), [], "{provider}");
        assert_eq!(
            inferred(&records, r2),
            [(Rule::Reask, r1.clone(), None)],
            "{provider}"
        );
        assert_eq!(
            inferred(&records, r3),
            [(Rule::Continued, r2.clone(), None)],
            "{provider}"
        );
        assert_eq!(
            inferred(&records, r4),
            [(Rule::HistoryEdit, r3.clone(), Some(" (fixed)".len() as u64))],
            "{provider}"
        );
    }
    for id in quiet_ids.iter().chain([&no_session]) {
        assert_eq!(inferred(&records, id), [], "rules off or no session");
    }
    assert_eq!(
        inferred(&records, &gone),
        [(Rule::ClientDisconnect, gone.clone(), None)]
    );

    gw.stop().await;
}

/// No file under `dir` holds the canary.
fn no_canary_under(dir: &Path) {
    let files = walk(dir);
    for file in &files {
        let bytes = std::fs::read(file).unwrap_or_default();
        assert!(
            !bytes.windows(CANARY.len()).any(|w| w == CANARY.as_bytes()),
            "{} holds the canary",
            file.display()
        );
    }
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

#[tokio::test]
async fn rules_switched_off_globally_leave_nothing() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (mut gw, _mocks) = gateway(&[("NM_IMPLICIT_RULES", "off")], dir.path()).await;
    gw.stop_controlplane().await;
    let headers = [("nm-session", "sess_off")];
    let ids = conversation(
        &gw,
        [None; 4],
        "openaistream",
        Format::OpenAi,
        true,
        &headers,
    )
    .await;
    let metrics = String::from_utf8_lossy(&gw.get("/metrics").await.body).into_owned();
    assert!(
        metrics.contains("nm_implicit_memory_bytes 0"),
        "something was kept: {metrics}"
    );
    let records = spooled(&mut gw, 4).await;
    for id in &ids {
        assert_eq!(inferred(&records, id), []);
    }
    gw.stop().await;
}

/// A session spread over two dataplanes: a rule sees a pair of requests only when both reach
/// the same dataplane. Each session's four requests go to dataplanes picked at random
/// (seeded); what is found is exactly the pairs that stayed together, about half.
#[tokio::test]
async fn a_session_split_over_two_dataplanes_is_judged_only_where_it_stays() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (mut gw, _mocks) = gateway(&[], dir.path()).await;
    let second = gw.add_dataplane().await;
    gw.stop_controlplane().await;
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut coin = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed & 1 == 1
    };
    let sessions = 16;
    let mut runs = Vec::new();
    // What one dataplane can see: R2 re-asks R1 (both there); R3 brings back the answer to
    // that conversation (R1's or R2's, the same text: whichever of them was there last); R4
    // brings back R3's answer (R3 there).
    let mut seen = 0;
    for s in 0..sessions {
        let hops: [Option<std::net::SocketAddr>; 4] =
            std::array::from_fn(|_| coin().then_some(second));
        seen += usize::from(hops[0] == hops[1])
            + usize::from(hops[2] == hops[0] || hops[2] == hops[1])
            + usize::from(hops[3] == hops[2]);
        let session = format!("sess_split{s}");
        let ids = conversation(
            &gw,
            hops,
            "openai",
            Format::OpenAi,
            false,
            &[("nm-session", session.as_str())],
        )
        .await;
        runs.push(ids);
    }
    // Both dataplanes' spools.
    eventually(Duration::from_secs(20), "records spooled", || async {
        let count = |text: String| -> usize {
            text.lines()
                .find_map(|l| l.strip_prefix("nm_spool_records ")?.trim().parse().ok())
                .unwrap_or(0)
        };
        let a = count(String::from_utf8_lossy(&gw.get("/metrics").await.body).into_owned());
        let b = count(
            String::from_utf8_lossy(&gw.raw_at(second, "GET", "/metrics", &[], "").await.body)
                .into_owned(),
        );
        (a + b >= sessions * 4).then_some(())
    })
    .await;
    let records = read_spools(&gw.stop_dataplanes().await);
    let found: usize = runs
        .iter()
        .flat_map(|ids| ids.iter())
        .map(|id| inferred(&records, id).len())
        .sum();
    let possible = sessions * 3;
    eprintln!(
        "split over two dataplanes at random: {found} of {possible} implicit signals found ({:.0}%)",
        100.0 * found as f64 / possible as f64
    );
    assert_eq!(found, seen, "found exactly what stayed together");
    assert!(found < possible, "the seed kept every session together");
    gw.stop().await;
}

/// Many sessions against a small memory cap: it holds, and what it forgets is counted.
#[tokio::test]
async fn the_memory_cap_holds_under_many_sessions() {
    let cap = 256 * 1024;
    let mock = mock(Format::OpenAi, false, &"long answer ".repeat(400))
        .start()
        .await;
    let gw = TestGateway::builder()
        .upstream("openai", &mock.url)
        .env("NM_IMPLICIT_MEMORY_BYTES", &cap.to_string())
        .run()
        .await;
    for s in 0..200 {
        let session = format!("sess_many{s}");
        ask(
            &gw,
            None,
            "openai",
            Format::OpenAi,
            false,
            &[("nm-session", session.as_str())],
            &[(true, "hello")],
        )
        .await;
    }
    let metrics = eventually(Duration::from_secs(10), "evictions counted", || async {
        let text = String::from_utf8_lossy(&gw.get("/metrics").await.body).into_owned();
        text.contains("nm_implicit_memory_evicted_total{reason=\"cap\"}")
            .then_some(text)
    })
    .await;
    let value = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or(u64::MAX)
    };
    assert!(value("nm_implicit_memory_bytes ") <= cap, "{metrics}");
    assert!(
        value("nm_implicit_memory_evicted_total{reason=\"cap\"} ") > 0,
        "{metrics}"
    );
    gw.stop().await;
}

/// The canary through a dataplane process of its own (its log on stderr, at `trace`), tracing
/// to a collector, records journaled on disk (`NM_RECORD_DURABILITY=spool`) and stored: no
/// prompt or answer text in the log, the spans, the spool or the database.
#[tokio::test]
async fn no_prompt_or_answer_text_reaches_the_disk_the_log_or_the_spans() {
    use crate::common::child::DataplaneProcess;
    use crate::common::gateway::LINK_SECRET;
    use crate::common::otlp::OtlpReceiver;

    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let otlp = OtlpReceiver::start().await;
    let text = answer_text();
    let json = mock(Format::OpenAi, false, &text).start().await;
    let stream = mock(Format::Anthropic, true, &text).start().await;
    let db = format!("sqlite://{}/nm.db?mode=rwc", dir.path().display());
    let gw = TestGateway::builder()
        .shape(Shape::Split)
        .env("NM_DATABASE_URL", &db)
        .run()
        .await;
    let spool = dir.path().join("spool-process").display().to_string();
    let cp = gw.grpc_url();
    let collector = otlp.grpc_endpoint();
    let env = [
        ("NM_CONTROLPLANE_URL", cp.as_str()),
        ("NM_LINK_SECRET", LINK_SECRET),
        ("NM_UPSTREAM_OPENAI", json.url.as_str()),
        ("NM_UPSTREAM_ANTHROPIC", stream.url.as_str()),
        ("NM_SPOOL_DIR", spool.as_str()),
        ("NM_RECORD_DURABILITY", "spool"),
        ("NM_LOG", "trace"),
        ("OTEL_EXPORTER_OTLP_ENDPOINT", collector.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "50"),
    ];
    let dp = DataplaneProcess::start(&env).await;
    eventually(
        Duration::from_secs(15),
        "the dataplane has its keys",
        || async {
            let a = gw.raw_at(dp.http, "GET", "/health", &[], "").await;
            (a.status == 200).then_some(())
        },
    )
    .await;
    let hops = [Some(dp.http); 4];
    let json_ids = conversation(
        &gw,
        hops,
        "openai",
        Format::OpenAi,
        false,
        &[("nm-session", "sess_canary1")],
    )
    .await;
    let stream_ids = conversation(
        &gw,
        hops,
        "anthropic",
        Format::Anthropic,
        true,
        &[("nm-session", "sess_canary2")],
    )
    .await;
    eventually(Duration::from_secs(20), "every record stored", || async {
        (gw.count("SELECT COUNT(*) AS n FROM requests").await == 8).then_some(())
    })
    .await;
    let spans = otlp
        .wait_for("every request's spans", Duration::from_secs(20), |s| {
            s.len() >= 16
        })
        .await;
    // The rules did fire (the records carry them, read from the journal's replay path).
    let metrics =
        String::from_utf8_lossy(&gw.raw_at(dp.http, "GET", "/metrics", &[], "").await.body)
            .into_owned();
    for rule in ["reask", "continued", "history_edit"] {
        assert!(
            metrics.contains(&format!("nm_implicit_signals_total{{rule=\"{rule}\"}} 2")),
            "{rule}: {metrics}"
        );
    }
    let log = dp.stderr();
    assert!(
        log.lines().count() > 16,
        "the log is too short to mean anything: {log}"
    );
    assert!(!log.contains(CANARY), "the log holds the canary");
    for span in &spans {
        assert!(
            !span.all_text().contains(CANARY),
            "a span holds the canary: {span:?}"
        );
    }
    no_canary_under(dir.path());
    let _ = (json_ids, stream_ids);
    drop(dp);
    gw.stop().await;
}

/// The two halves together: what a real dataplane infers is stored by the controlplane as
/// implicit signals (source, rule, the judged answer, the edit distance), each once; the
/// database's files keep no text of the conversation.
#[tokio::test]
async fn inferred_signals_reach_the_database_through_the_link() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let (gw, _mocks) = gateway(&[], dir.path()).await;
    for (i, (provider, format, streamed)) in [PROVIDERS[0], PROVIDERS[3]].into_iter().enumerate() {
        let session = format!("sess_stored{i}");
        let headers = [("nm-session", session.as_str()), ("nm-agent", "stored")];
        let [r1, r2, r3, _r4] =
            conversation(&gw, [None; 4], provider, format, streamed, &headers).await;
        // The second asked the first's conversation again; the third brought the second's answer
        // back unchanged; the fourth brought the third's back edited ("(fixed)": 8 characters).
        for (rule, answer, distance) in [
            ("reask", &r1, "IS NULL"),
            ("continued", &r2, "IS NULL"),
            ("history_edit", &r3, "= 8"),
        ] {
            let sql = format!(
                "SELECT COUNT(*) AS n FROM signals WHERE source = 'implicit' AND rule = '{rule}' \
                 AND request_id = '{answer}' AND session_id = '{session}' AND agent = 'stored' \
                 AND edit_distance {distance}"
            );
            eventually(Duration::from_secs(20), &sql, || async {
                (gw.count(&sql).await == 1).then_some(())
            })
            .await;
        }
    }
    let implicit = gw
        .count("SELECT COUNT(*) AS n FROM signals WHERE source = 'implicit'")
        .await;
    assert_eq!(
        implicit, 6,
        "three rules in two conversations, each stored once"
    );
    let explicit = gw
        .count("SELECT COUNT(*) AS n FROM signals WHERE source = 'explicit'")
        .await;
    assert_eq!(explicit, 0);
    gw.stop().await;
    no_canary_under(dir.path());
}
