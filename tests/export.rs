//! `nm-gateway export` end to end, on SQLite and PostgreSQL: records and signals made through a
//! real gateway (mock provider), exported as Parquet and JSON lines by the real binary, read back
//! with DuckDB and pyarrow and compared value by value with the gRPC answers (`GetUsage` per
//! session, `ListSignals`); a re-run and an export killed (`kill -9`) mid-run then re-run give
//! byte-identical files; an upload to S3 (moto's server, started here) gives the same bytes;
//! bad arguments and settings exit 64 naming what is wrong; the scheduled export writes
//! yesterday's files at start.
//!
//! The readers need `NM_TEST_EXPORT_PYTHON`, a python with duckdb, pyarrow, boto3 and moto
//! (`.ci/run` makes `target/export-venv`); without it those checks are SKIPPED with a message.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use chrono::{Days, Utc};
use nm_gateway::grpc::pb::{self, agents_client::AgentsClient, usage_client::UsageClient};
use serde_json::Value;

use crate::common::eventually;
use crate::common::gateway::{ADMIN_KEY, Db, TestGateway, admin};
use crate::common::mock::MockProvider;

const BIN: &str = env!("CARGO_BIN_EXE_nm-gateway");
const AGENTS: [&str; 2] = ["exp-a", "exp-b"];
const REQUESTS: usize = 24;

fn python() -> Option<String> {
    let p = std::env::var("NM_TEST_EXPORT_PYTHON").ok();
    if p.is_none() {
        eprintln!(
            "SKIPPED export read-back: set NM_TEST_EXPORT_PYTHON to a python with duckdb, pyarrow, boto3 and moto (.ci/run makes target/export-venv)"
        );
    }
    p
}

/// Runs `nm-gateway export ARGS` against `db_url`; returns (exit code, stdout, stderr).
fn export(db_url: &str, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.arg("export")
        .args(args)
        .env("NM_DATABASE_URL", db_url)
        .env_remove("AWS_ACCESS_KEY_ID")
        .env_remove("AWS_SECRET_ACCESS_KEY")
        .env_remove("AWS_ENDPOINT_URL");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap_or_else(|e| panic!("{BIN}: {e}"));
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn export_ok(db_url: &str, args: &[&str], env: &[(&str, &str)]) -> String {
    let (code, out, err) = export(db_url, args, env);
    assert_eq!(code, 0, "export {args:?}: {out}{err}");
    out
}

/// Runs a python script with `args`; its stdout as JSON.
fn py(python: &str, script: &str, args: &[&str]) -> Value {
    let out = Command::new(python)
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{python}: {e}"));
    assert!(
        out.status.success(),
        "python: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "python output: {e}: {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Reads a Parquet file with pyarrow and with DuckDB, and a JSON-lines file with DuckDB: each as a
/// list of rows (times as epoch milliseconds), plus the Parquet file's `nm.schema`.
const READ: &str = r#"
import json, sys, duckdb, pyarrow.parquet as pq
pq_path, jl_path = sys.argv[1], sys.argv[2]
t = pq.read_table(pq_path)
meta = {k.decode(): v.decode() for k, v in (t.schema.metadata or {}).items()}
def ms(v):
    return None if v is None else int(v.timestamp() * 1000 + 0.5) if hasattr(v, 'timestamp') else v
rows_pa = [{k: ms(v) for k, v in r.items()} for r in t.to_pylist()]
types = {f.name: str(f.type) for f in t.schema}
con = duckdb.connect()
def q(sql):
    cur = con.execute(sql)
    cols = [d[0] for d in cur.description]
    return [{c: ms(v) for c, v in zip(cols, r)} for r in cur.fetchall()]
rows_dd = q(f"SELECT * FROM read_parquet('{pq_path}')")
rows_jl = q(f"SELECT * FROM read_json('{jl_path}', format='newline_delimited', timestampformat='%Y-%m-%dT%H:%M:%S.%gZ')")
print(json.dumps({"meta": meta, "types": types, "pa": rows_pa, "duckdb": rows_dd, "jsonl": rows_jl}, default=str))
"#;

fn by_id(rows: &Value, id: &str) -> BTreeMap<String, Value> {
    rows.as_array()
        .unwrap_or_else(|| panic!("rows: {rows}"))
        .iter()
        .map(|r| (r[id].as_str().unwrap_or_default().to_owned(), r.clone()))
        .collect()
}

fn sha(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every file under `dir` (relative name -> bytes), `.partial` ones included.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    for kind in ["records", "signals"] {
        let Ok(rd) = std::fs::read_dir(dir.join(kind)) else {
            continue;
        };
        for e in rd.flatten() {
            let name = format!("{kind}/{}", e.file_name().to_string_lossy());
            out.insert(name, sha(&e.path()));
        }
    }
    out
}

async fn load(gw: &TestGateway) {
    for i in 0..REQUESTS {
        let agent = AGENTS[i % 2];
        let session = format!("sess_exp{i:03}");
        let user = format!("user-{}", i % 3);
        let env = ["production", "staging"][i % 2];
        let a = gw
            .chat(&[
                ("nm-agent", agent),
                ("nm-session", &session),
                ("nm-user", &user),
                ("nm-env", env),
            ])
            .await;
        assert_eq!(a.status, 200);
        if i % 3 != 2 {
            let action = ["accepted", "edited"][i % 2];
            let extra = if action == "edited" {
                r#","edit_distance":17"#
            } else {
                ""
            };
            let body = format!(r#"{{"session_id":"{session}","action":"{action}"{extra}}}"#);
            let s = gw
                .raw(
                    "POST",
                    "/v1/signal",
                    &[
                        ("nm-key", ADMIN_KEY),
                        ("content-type", "application/json"),
                        ("nm-agent", agent),
                    ],
                    body,
                )
                .await;
            assert_eq!(s.status, 200, "{}", String::from_utf8_lossy(&s.body));
        }
    }
    let want = REQUESTS as i64;
    eventually(Duration::from_secs(20), "records stored", || async {
        (gw.count("SELECT COUNT(*) AS n FROM requests").await == want).then_some(())
    })
    .await;
}

async fn usage_by_session(gw: &TestGateway) -> BTreeMap<String, pb::UsageRow> {
    let report = UsageClient::new(gw.grpc_channel().await)
        .get_usage(admin(pb::GetUsageRequest {
            group_by: vec![pb::UsageDimension::Session as i32],
            limit: 10_000,
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner();
    report
        .rows
        .into_iter()
        .map(|r| {
            let k = r.key[0].value.clone().unwrap_or_default();
            (k, r)
        })
        .collect()
}

async fn signals_of(gw: &TestGateway, agent: &str) -> Vec<pb::StoredSignal> {
    AgentsClient::new(gw.grpc_channel().await)
        .list_signals(admin(pb::ListSignalsRequest {
            agent: agent.to_owned(),
            page_size: 1000,
            ..Default::default()
        }))
        .await
        .unwrap_or_else(|e| panic!("{e}"))
        .into_inner()
        .signals
}

fn s(v: &Value) -> Option<String> {
    v.as_str().map(str::to_owned)
}

async fn exported_values_match_the_grpc_answers(db: Db) {
    let mock = MockProvider::json(crate::common::fixture("openai/chat_response.json"))
        .start()
        .await;
    let Some(gw) = TestGateway::builder()
        .db(db)
        .upstream("openai", &mock.url)
        .start()
        .await
    else {
        return;
    };
    load(&gw).await;
    let today = Utc::now().date_naive();
    let since = today.to_string();
    let until = today
        .checked_add_days(Days::new(1))
        .unwrap_or(today)
        .to_string();
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let to = dir.path().to_string_lossy().into_owned();
    for kind in ["records", "signals"] {
        for format in ["parquet", "jsonl"] {
            let out = export_ok(
                &gw.db_url,
                &[
                    kind, "--since", &since, "--until", &until, "--format", format, "--to", &to,
                ],
                &[],
            );
            assert!(out.contains(&format!("{kind}/{today}.{format}")), "{out}");
        }
    }
    let path = |kind: &str, ext: &str| dir.path().join(format!("{kind}/{today}.{ext}"));
    // A re-run writes the same bytes.
    let first = files(dir.path());
    export_ok(
        &gw.db_url,
        &["records", "--since", &since, "--until", &until, "--to", &to],
        &[],
    );
    assert_eq!(files(dir.path()), first, "a re-run changed the files");

    let Some(python) = python() else {
        gw.stop().await;
        return;
    };
    let rec_pq = path("records", "parquet");
    let rec_jl = path("records", "jsonl");
    let read = py(
        &python,
        READ,
        &[&rec_pq.to_string_lossy(), &rec_jl.to_string_lossy()],
    );
    assert_eq!(read["meta"]["nm.schema"], "records/1");
    assert_eq!(read["types"]["started_at"], "timestamp[ms, tz=UTC]");
    assert_eq!(read["types"]["cost_micros"], "int64");
    // pyarrow, DuckDB on Parquet and DuckDB on JSON lines read the same rows.
    assert_eq!(read["pa"], read["duckdb"]);
    let pa = by_id(&read["pa"], "request_id");
    let jl = by_id(&read["jsonl"], "request_id");
    assert_eq!(pa.len(), REQUESTS);
    for (id, row) in &pa {
        let j = &jl[id];
        for (k, v) in row.as_object().into_iter().flatten() {
            assert_eq!(&j[k], v, "{id}: column {k}: jsonl {} parquet {v}", j[k]);
        }
        assert_eq!(j["nm_schema"], "records/1");
    }
    // Every value against the controlplane's gRPC usage, one session per request.
    let usage = usage_by_session(&gw).await;
    assert_eq!(usage.len(), REQUESTS);
    for row in pa.values() {
        let session = s(&row["session_id"]).unwrap_or_default();
        let u = &usage[&session];
        let n = |v: &Value| v.as_u64().unwrap_or(0);
        assert_eq!(u.requests, 1);
        assert_eq!(u.input_tokens, n(&row["input_tokens"]), "{session}");
        assert_eq!(u.output_tokens, n(&row["output_tokens"]), "{session}");
        assert_eq!(u.cached_input_tokens, n(&row["cached_input_tokens"]));
        assert_eq!(u.reasoning_tokens, n(&row["reasoning_tokens"]));
        assert_eq!(u.cost_micros, n(&row["cost_micros"]), "{session}");
        assert_eq!(u.errors, u64::from(n(&row["status"]) >= 400));
        let i: usize = session
            .trim_start_matches("sess_exp")
            .parse()
            .unwrap_or_else(|e| panic!("{session}: {e}"));
        assert_eq!(s(&row["agent"]).as_deref(), Some(AGENTS[i % 2]));
        assert_eq!(s(&row["user_id"]), Some(format!("user-{}", i % 3)));
        assert_eq!(
            s(&row["env"]).as_deref(),
            Some(["production", "staging"][i % 2])
        );
        assert_eq!(s(&row["provider"]).as_deref(), Some("openai"));
        assert_eq!(s(&row["model"]).as_deref(), Some("gpt-4o-mini"));
        assert_eq!(row["status"], 200);
        assert_eq!(s(&row["usage_status"]).as_deref(), Some("reported"));
    }
    // Rows in (time, id) order.
    let order: Vec<(i64, String)> = read["pa"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| {
            (
                r["started_at"].as_i64().unwrap_or(0),
                s(&r["request_id"]).unwrap_or_default(),
            )
        })
        .collect();
    let mut sorted = order.clone();
    sorted.sort();
    assert_eq!(order, sorted);

    // Signals: every value against ListSignals.
    let read = py(
        &python,
        READ,
        &[
            &path("signals", "parquet").to_string_lossy(),
            &path("signals", "jsonl").to_string_lossy(),
        ],
    );
    assert_eq!(read["meta"]["nm.schema"], "signals/1");
    assert_eq!(read["pa"], read["duckdb"]);
    let pa = by_id(&read["pa"], "id");
    let jl = by_id(&read["jsonl"], "id");
    let mut listed = Vec::new();
    for agent in AGENTS {
        listed.extend(signals_of(&gw, agent).await);
    }
    assert!(!listed.is_empty());
    assert_eq!(pa.len(), listed.len());
    for sig in &listed {
        let row = &pa[&sig.id];
        for (k, v) in row.as_object().into_iter().flatten() {
            assert_eq!(&jl[&sig.id][k], v, "{}: column {k}", sig.id);
        }
        assert_eq!(s(&row["action"]).as_deref(), Some(sig.action.as_str()));
        assert_eq!(s(&row["source"]).as_deref(), Some(sig.source.as_str()));
        assert_eq!(s(&row["rule"]), sig.rule);
        assert_eq!(s(&row["request_id"]), sig.request_id);
        assert_eq!(row["edit_distance"].as_u64(), sig.edit_distance);
        assert_eq!(s(&row["session_id"]).unwrap_or_default(), sig.session_id);
        assert_eq!(s(&row["agent"]), sig.agent);
        assert_eq!(s(&row["env"]), sig.env);
        let at = sig.received_at.unwrap_or_default();
        assert_eq!(
            row["received_at"].as_i64(),
            Some(at.seconds * 1000 + i64::from(at.nanos) / 1_000_000)
        );
    }

    interrupted_export_rerun_gives_the_same_files(&gw, &until).await;
    to_s3(&gw, &python, &since, &until, &rec_pq).await;
    gw.stop().await;
}

/// Forty days, most of them empty: killed with SIGKILL once the first day is reported, then run
/// again: the same files as an uninterrupted run, and no `.partial` left.
async fn interrupted_export_rerun_gives_the_same_files(gw: &TestGateway, until: &str) {
    let from = "40d";
    let clean = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let clean_to = clean.path().to_string_lossy().into_owned();
    export_ok(
        &gw.db_url,
        &[
            "records", "--since", from, "--until", until, "--to", &clean_to,
        ],
        &[],
    );
    let want = files(clean.path());
    assert!(want.len() >= 40, "{:?}", want.keys());

    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let to = dir.path().to_string_lossy().into_owned();
    let mut child = Command::new(BIN)
        .args([
            "export", "records", "--since", from, "--until", until, "--to", &to,
        ])
        .env("NM_DATABASE_URL", &gw.db_url)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{e}"));
    if let Some(out) = child.stdout.take() {
        use std::io::BufRead;
        let mut line = String::new();
        let _ = std::io::BufReader::new(out).read_line(&mut line);
    }
    let _ = child.kill();
    let _ = child.wait();
    let partial = files(dir.path());
    // What the killed run left: whole files of the uninterrupted run, and perhaps `.partial` ones.
    for (name, bytes) in &partial {
        if !name.ends_with(".partial") {
            assert_eq!(Some(bytes), want.get(name), "{name} after kill -9");
        }
    }
    assert!(
        partial.len() < want.len() + 1,
        "the killed run finished: {} files",
        partial.len()
    );
    export_ok(
        &gw.db_url,
        &["records", "--since", from, "--until", until, "--to", &to],
        &[],
    );
    assert_eq!(files(dir.path()), want);
}

/// moto's S3 server on a free port: the upload's bytes are the folder export's.
async fn to_s3(gw: &TestGateway, python: &str, since: &str, until: &str, local: &Path) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or_else(|e| panic!("{e}"));
    let moto = Path::new(python).with_file_name("moto_server");
    let mut server = Command::new(&moto)
        .args(["-H", "127.0.0.1", "-p", &port.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", moto.display()));
    let endpoint = format!("http://127.0.0.1:{port}");
    let aws = [
        ("AWS_ACCESS_KEY_ID", "testing"),
        ("AWS_SECRET_ACCESS_KEY", "testing"),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ENDPOINT_URL", endpoint.as_str()),
    ];
    const S3: &str = r#"
import json, sys, boto3
s3 = boto3.client("s3", endpoint_url=sys.argv[1], region_name="us-east-1",
                  aws_access_key_id="testing", aws_secret_access_key="testing")
if sys.argv[2] == "create":
    s3.create_bucket(Bucket="warehouse")
    print("{}")
else:
    b = s3.get_object(Bucket="warehouse", Key=sys.argv[3])["Body"].read()
    print(json.dumps({"hex": b.hex()}))
"#;
    eventually(Duration::from_secs(30), "moto_server up", || async {
        let out = Command::new(python)
            .args(["-c", S3, &endpoint, "create"])
            .output()
            .ok()?;
        out.status.success().then_some(())
    })
    .await;
    export_ok(
        &gw.db_url,
        &[
            "records",
            "--since",
            since,
            "--until",
            until,
            "--to",
            "s3://warehouse/nm/prod",
        ],
        &aws,
    );
    let key = format!("nm/prod/records/{since}.parquet");
    let got = py(python, S3, &[&endpoint, "get", &key]);
    let want: String = sha(local).iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(got["hex"].as_str(), Some(want.as_str()));
    // A wrong secret: refused by the server, said, exit 1.
    let mut bad = aws;
    bad[1] = ("AWS_SECRET_ACCESS_KEY", "wrong");
    let (code, _, _) = export(
        &gw.db_url,
        &[
            "records",
            "--since",
            since,
            "--until",
            until,
            "--to",
            "s3://nosuchbucket/x",
        ],
        &bad,
    );
    assert_eq!(code, 1);
    let _ = server.kill();
    let _ = server.wait();
}

#[tokio::test]
async fn exported_values_match_the_grpc_answers_sqlite() {
    exported_values_match_the_grpc_answers(Db::Sqlite).await;
}

#[tokio::test]
async fn exported_values_match_the_grpc_answers_postgres() {
    exported_values_match_the_grpc_answers(Db::Postgres).await;
}

#[tokio::test]
async fn bad_export_arguments_exit_64_naming_them() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let db = format!("sqlite://{}/db.sqlite?mode=rwc", dir.path().display());
    let to = dir.path().join("out").to_string_lossy().into_owned();
    let cases: [(&[&str], &str); 8] = [
        (&["requests", "--to", &to], "`records` or `signals`"),
        (&["records", "--format", "csv", "--to", &to], "--format"),
        (
            &["records", "--since", "yesterday-ish", "--to", &to],
            "--since",
        ),
        (
            &[
                "records",
                "--since",
                "2026-11-28",
                "--until",
                "2026-11-28",
                "--to",
                &to,
            ],
            "--since",
        ),
        (&["records", "--to", "ftp://host/x"], "--to"),
        (&["records", "--to", "s3://A_B/x"], "--to"),
        (&["records", "--to", "s3://bucket/../x"], "--to"),
        (&["records", "--to", "s3://bucket/x"], "AWS_ACCESS_KEY_ID"),
    ];
    for (args, needle) in cases {
        let (code, _, err) = export(&db, args, &[]);
        assert_eq!(code, 64, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    // Bad scheduled-export settings stop the start, naming the setting.
    for (k, v, extra) in [
        (
            "NM_EXPORT_FORMAT",
            "csv",
            Some(("NM_EXPORT_TO", to.as_str())),
        ),
        ("NM_EXPORT_TO", "gs://bucket/x", None),
        ("NM_EXPORT_TO", "s3://bucket/x", None),
    ] {
        let mut cmd = Command::new(BIN);
        cmd.arg("serve")
            .env(k, v)
            .env("NM_DATABASE_URL", &db)
            .env_remove("AWS_ACCESS_KEY_ID")
            .current_dir(dir.path());
        if let Some((k2, v2)) = extra {
            cmd.env(k2, v2);
        }
        let out = cmd.output().unwrap_or_else(|e| panic!("{e}"));
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(64), "{k}={v}: {err}");
        assert!(err.contains(k), "{k}={v}: {err}");
    }
}

#[tokio::test]
async fn the_scheduled_export_writes_yesterday_at_start() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let to = dir.path().to_string_lossy().into_owned();
    let Some(gw) = TestGateway::builder()
        .env("NM_EXPORT_TO", &to)
        .env("NM_EXPORT_FORMAT", "jsonl")
        .start()
        .await
    else {
        return;
    };
    let today = Utc::now().date_naive();
    let yesterday = today.checked_sub_days(Days::new(1)).unwrap_or(today);
    for kind in ["records", "signals"] {
        let p = dir.path().join(format!("{kind}/{yesterday}.jsonl"));
        eventually(Duration::from_secs(20), "yesterday's file", || {
            let there = p.exists();
            async move { there.then_some(()) }
        })
        .await;
    }
    gw.stop().await;
}
