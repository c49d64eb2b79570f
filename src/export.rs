//! `nm-gateway export records|signals` and the scheduled export (`NM_EXPORT_TO`): the days'
//! files written by `nm_controlplane::export`, into a folder or uploaded to S3 (docs/export.md).
//!
//! The command reads the database itself (`NM_DATABASE_URL`, like `demo`), not the controlplane's
//! gRPC: an export reads millions of rows, which through the admin API would be serialised twice
//! and compete with the dataplanes' record ingest on the controlplane; beside the database it is
//! one indexed range scan per page, works while the controlplane is down, and needs the database
//! credentials (an operator's), not an admin key. The scheduled export runs inside the
//! controlplane, on its own pool connection, after each UTC midnight.
//!
//! S3: each finished day's file is uploaded in one `PUT` (signature V4, `UNSIGNED-PAYLOAD`, the
//! body streamed from the staged file), so a reader sees the whole object or the previous one,
//! never a part. Credentials and place from the standard variables: `AWS_ACCESS_KEY_ID`,
//! `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN` (optional), `AWS_REGION` (or
//! `AWS_DEFAULT_REGION`, else `us-east-1`), `AWS_ENDPOINT_URL` (a compatible server, addressed
//! path-style; unset: `https://BUCKET.s3.REGION.amazonaws.com`). One PUT takes up to 5 GiB: a
//! day's file beyond that fails with S3's answer (multipart upload is not implemented).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use chrono::{Days, NaiveDate, Utc};
use http_body_util::{BodyExt, Limited, StreamBody};
use hyper::body::Frame;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use nm_controlplane::export::{self, DayExport, Format, Kind};
use nm_controlplane::store::Store;
use sha2::{Digest, Sha256};
use tokio::io::AsyncReadExt;

/// A mistake in the command line or the `AWS_*` variables, the user's to fix (exit 64).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// A date (`2026-11-28`), an RFC 3339 time, or an age before `now` (`7d`, `12h`): its UTC day.
/// (The admin commands' `--since` accepts the same forms.)
fn parse_day(v: &str, now: chrono::DateTime<Utc>) -> Option<NaiveDate> {
    if let Ok(t) = chrono::DateTime::parse_from_rfc3339(v) {
        return Some(t.with_timezone(&Utc).date_naive());
    }
    if let Ok(d) = NaiveDate::parse_from_str(v, "%Y-%m-%d") {
        return Some(d);
    }
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: i64 = num.parse().ok().filter(|n| *n >= 0)?;
    let age = match unit {
        "d" => chrono::Duration::try_days(n)?,
        "h" => chrono::Duration::try_hours(n)?,
        "m" => chrono::Duration::try_minutes(n)?,
        "s" => chrono::Duration::try_seconds(n)?,
        _ => return None,
    };
    Some(now.checked_sub_signed(age)?.date_naive())
}

/// The most days one command exports (ten years).
const MAX_DAYS: u64 = 3_660;

/// `nm-gateway export` arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct ExportArgs {
    /// `records` (request records) or `signals`.
    pub kind: String,
    /// First UTC day exported: a date (`2026-11-28`), an RFC 3339 time or an age (`7d`), taken
    /// as the UTC day it falls in. Default: the day before --until.
    #[arg(long)]
    pub since: Option<String>,
    /// The UTC day the export stops before (not exported), same forms. Default: today, so
    /// yesterday is the last day exported.
    #[arg(long)]
    pub until: Option<String>,
    /// `parquet` (default) or `jsonl`.
    #[arg(long, default_value = "parquet")]
    pub format: String,
    /// A folder, or `s3://BUCKET/PREFIX`.
    #[arg(long)]
    pub to: String,
    /// Database URL (env NM_DATABASE_URL).
    #[arg(long)]
    pub database_url: Option<String>,
}

/// Where the files go.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Destination {
    Dir(PathBuf),
    S3 { bucket: String, prefix: String },
}

impl Destination {
    /// A folder or `s3://BUCKET[/PREFIX]`.
    pub fn parse(v: &str) -> Result<Self, String> {
        let v = v.trim();
        if v.is_empty() {
            return Err("is empty; give a folder or s3://BUCKET/PREFIX".into());
        }
        if let Some(rest) = v.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            let ok_bucket = (3..=63).contains(&bucket.len())
                && bucket.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.'
                });
            if !ok_bucket {
                return Err(format!(
                    "names the bucket {bucket:?}: a bucket name is 3 to 63 lower-case letters, digits, '-' or '.'"
                ));
            }
            let prefix = prefix.trim_matches('/').to_owned();
            if prefix.len() > 512 || prefix.split('/').any(|s| s == "." || s == "..") {
                return Err("has a prefix that is too long or holds '.' or '..'".into());
            }
            return Ok(Self::S3 {
                bucket: bucket.to_owned(),
                prefix,
            });
        }
        if v.contains("://") {
            return Err(format!(
                "is {v:?}: only a folder or s3://BUCKET/PREFIX is supported"
            ));
        }
        Ok(Self::Dir(PathBuf::from(v)))
    }
}

/// A day range and what to write.
#[derive(Clone, Debug)]
pub struct Plan {
    pub kind: Kind,
    pub format: Format,
    pub since: NaiveDate,
    pub until: NaiveDate,
    pub to: Destination,
}

impl Plan {
    /// Checks the command line; every error is the user's to fix (exit 64).
    pub fn from_args(a: &ExportArgs, now: chrono::DateTime<Utc>) -> Result<Self, UsageError> {
        let kind = Kind::parse(&a.kind).ok_or_else(|| {
            UsageError(format!(
                "export: the kind is {:?}; use `records` or `signals`",
                a.kind
            ))
        })?;
        let format = Format::parse(&a.format).ok_or_else(|| {
            UsageError(format!(
                "export: --format is {:?}; use `parquet` or `jsonl`",
                a.format
            ))
        })?;
        let day = |flag: &str, v: &str| {
            parse_day(v, now).ok_or_else(|| {
                UsageError(format!(
                    "export: {flag} is {v:?}; use a date (2026-11-28), an RFC 3339 time or an age (7d)"
                ))
            })
        };
        let until = match &a.until {
            Some(v) => day("--until", v)?,
            None => now.date_naive(),
        };
        let since = match &a.since {
            Some(v) => day("--since", v)?,
            None => until
                .checked_sub_days(Days::new(1))
                .ok_or_else(|| UsageError("export: --until is out of range".into()))?,
        };
        if since >= until {
            return Err(UsageError(format!(
                "export: --since ({since}) must be a day before --until ({until}): --until is not exported"
            )));
        }
        if (until - since).num_days() as u64 > MAX_DAYS {
            return Err(UsageError(format!(
                "export: at most {MAX_DAYS} days at once; split the range"
            )));
        }
        let to = Destination::parse(&a.to).map_err(|e| UsageError(format!("export: --to {e}")))?;
        Ok(Self {
            kind,
            format,
            since,
            until,
            to,
        })
    }
}

/// `nm-gateway export`: one line per day written (`records/2026-11-28.parquet 1234 rows 56789
/// bytes`), then a total.
pub async fn run(
    store: &Store,
    plan: &Plan,
    env: &HashMap<String, String>,
    out: &mut impl std::io::Write,
) -> anyhow::Result<()> {
    let s3 = match &plan.to {
        Destination::S3 { bucket, prefix } => Some(S3::from_env(env, bucket, prefix)?),
        Destination::Dir(_) => None,
    };
    let started = std::time::Instant::now();
    let mut total = 0u64;
    for day in export::days(plan.since, plan.until) {
        let done = write_day(store, plan.kind, plan.format, &plan.to, s3.as_ref(), day).await?;
        total += done.rows;
        writeln!(
            out,
            "{} {} rows {} bytes",
            done.relative, done.rows, done.bytes
        )?;
    }
    let secs = started.elapsed().as_secs_f64();
    writeln!(out, "exported {total} {} in {secs:.1} s", plan.kind.name())?;
    Ok(())
}

/// Writes one day to the destination: in place in a folder, or staged in a temporary folder
/// and uploaded.
pub async fn write_day(
    store: &Store,
    kind: Kind,
    format: Format,
    to: &Destination,
    s3: Option<&S3>,
    day: NaiveDate,
) -> anyhow::Result<DayExport> {
    match (to, s3) {
        (Destination::Dir(dir), _) => Ok(export::export_day(store, kind, format, dir, day).await?),
        (Destination::S3 { .. }, Some(s3)) => {
            let staging = tempfile::Builder::new()
                .prefix("nm-export-")
                .tempdir()
                .context("cannot make a staging folder for the S3 upload")?;
            let done = export::export_day(store, kind, format, staging.path(), day).await?;
            s3.put(&done.relative, &done.path, done.bytes).await?;
            Ok(done)
        }
        (Destination::S3 { .. }, None) => anyhow::bail!("S3 destination without credentials"),
    }
}

// === impl S3 ===

/// One bucket and prefix, with the credentials to PUT objects there.
pub struct S3 {
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, S3Body>,
    bucket: String,
    prefix: String,
    key_id: String,
    secret: String,
    token: Option<String>,
    region: String,
    /// `http(s)://host[:port]` of a compatible server (path-style), or None for AWS.
    endpoint: Option<String>,
}

type S3Body =
    StreamBody<tokio_stream::wrappers::ReceiverStream<Result<Frame<Bytes>, std::io::Error>>>;

impl S3 {
    pub fn from_env(
        env: &HashMap<String, String>,
        bucket: &str,
        prefix: &str,
    ) -> Result<Self, UsageError> {
        let get = |k: &str| {
            env.get(k)
                .map(|v| v.trim().to_owned())
                .filter(|v| !v.is_empty())
        };
        let key_id = get("AWS_ACCESS_KEY_ID")
            .ok_or_else(|| UsageError("export to S3: AWS_ACCESS_KEY_ID is not set".into()))?;
        let secret = get("AWS_SECRET_ACCESS_KEY")
            .ok_or_else(|| UsageError("export to S3: AWS_SECRET_ACCESS_KEY is not set".into()))?;
        let region = get("AWS_REGION")
            .or_else(|| get("AWS_DEFAULT_REGION"))
            .unwrap_or_else(|| "us-east-1".into());
        let endpoint = match get("AWS_ENDPOINT_URL") {
            Some(e) if e.starts_with("http://") || e.starts_with("https://") => {
                Some(e.trim_end_matches('/').to_owned())
            }
            Some(e) => {
                return Err(UsageError(format!(
                    "AWS_ENDPOINT_URL is {e:?}: it must start with http:// or https://"
                )));
            }
            None => None,
        };
        let roots = rustls::RootCertStore {
            roots: webpki_roots::TLS_SERVER_ROOTS.to_vec(),
        };
        let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
        let tls = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| UsageError(format!("export to S3: TLS: {e}")))?
            .with_root_certificates(roots)
            .with_no_client_auth();
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        http.set_connect_timeout(Some(Duration::from_secs(10)));
        let https = hyper_rustls::HttpsConnectorBuilder::new()
            .with_tls_config(tls)
            .https_or_http()
            .enable_http1()
            .wrap_connector(http);
        Ok(Self {
            client: Client::builder(TokioExecutor::new()).build(https),
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
            key_id,
            secret,
            token: get("AWS_SESSION_TOKEN"),
            region,
            endpoint,
        })
    }

    /// The object key of `relative` (`prefix/records/2026-11-28.parquet`).
    pub fn key(&self, relative: &str) -> String {
        if self.prefix.is_empty() {
            relative.to_owned()
        } else {
            format!("{}/{relative}", self.prefix)
        }
    }

    /// PUTs the file as one object, its body streamed from disk.
    pub async fn put(&self, relative: &str, file: &Path, len: u64) -> anyhow::Result<()> {
        let key = self.key(relative);
        let encoded_key = uri_encode_path(&key);
        let (base, host, path) = match &self.endpoint {
            Some(e) => {
                let host = e
                    .split_once("://")
                    .map(|(_, h)| h)
                    .unwrap_or(e)
                    .split('/')
                    .next()
                    .unwrap_or_default()
                    .to_owned();
                (e.clone(), host, format!("/{}/{encoded_key}", self.bucket))
            }
            None => {
                let host = format!("{}.s3.{}.amazonaws.com", self.bucket, self.region);
                (format!("https://{host}"), host, format!("/{encoded_key}"))
            }
        };
        let now = Utc::now();
        let amz_date = now.format("%Y%m%dT%H%M%SZ").to_string();
        let date = now.format("%Y%m%d").to_string();
        let mut headers: Vec<(&str, String)> = vec![
            ("host", host.clone()),
            ("x-amz-content-sha256", "UNSIGNED-PAYLOAD".into()),
            ("x-amz-date", amz_date.clone()),
        ];
        if let Some(t) = &self.token {
            headers.push(("x-amz-security-token", t.clone()));
        }
        let signed: Vec<&str> = headers.iter().map(|(k, _)| *k).collect();
        let signed = signed.join(";");
        let canonical = format!(
            "PUT\n{path}\n\n{}\n{signed}\nUNSIGNED-PAYLOAD",
            headers
                .iter()
                .map(|(k, v)| format!("{k}:{v}\n"))
                .collect::<String>()
        );
        let scope = format!("{date}/{}/s3/aws4_request", self.region);
        let to_sign = format!(
            "AWS4-HMAC-SHA256\n{amz_date}\n{scope}\n{}",
            hex(&Sha256::digest(canonical.as_bytes()))
        );
        let mut k =
            nm_types::hmac_sha256(format!("AWS4{}", self.secret).as_bytes(), date.as_bytes());
        for part in [self.region.as_str(), "s3", "aws4_request"] {
            k = nm_types::hmac_sha256(&k, part.as_bytes());
        }
        let signature = hex(&nm_types::hmac_sha256(&k, to_sign.as_bytes()));
        let authorization = format!(
            "AWS4-HMAC-SHA256 Credential={}/{scope}, SignedHeaders={signed}, Signature={signature}",
            self.key_id
        );

        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let mut f = tokio::fs::File::open(file)
            .await
            .with_context(|| format!("cannot read {}", file.display()))?;
        let reader = tokio::spawn(async move {
            loop {
                let mut buf = vec![0u8; 256 * 1024];
                match f.read(&mut buf).await {
                    Ok(0) => break,
                    Ok(n) => {
                        buf.truncate(n);
                        if tx.send(Ok(Frame::data(Bytes::from(buf)))).await.is_err() {
                            break;
                        }
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e)).await;
                        break;
                    }
                }
            }
        });
        let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
        let mut req = http::Request::put(format!("{base}{path}"))
            .header("content-length", len)
            .header("authorization", authorization);
        for (k, v) in &headers {
            if *k != "host" {
                req = req.header(*k, v.as_str());
            }
        }
        let req = req.body(body).context("the S3 request cannot be built")?;
        let answer = self
            .client
            .request(req)
            .await
            .with_context(|| format!("S3 PUT {key}: no answer"))?;
        reader.abort();
        let status = answer.status();
        let body = Limited::new(answer.into_body(), 16 * 1024)
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        if !status.is_success() {
            anyhow::bail!("S3 PUT {key}: {status}: {}", s3_error_code(&body));
        }
        Ok(())
    }
}

/// The `<Code>` of an S3 error answer (its message can echo request details).
fn s3_error_code(body: &str) -> &str {
    body.split_once("<Code>")
        .and_then(|(_, r)| r.split_once("</Code>"))
        .map_or("no error code", |(c, _)| c)
}

fn hex(b: &[u8]) -> String {
    use std::fmt::Write;
    b.iter()
        .fold(String::with_capacity(b.len() * 2), |mut s, x| {
            let _ = write!(s, "{x:02x}");
            s
        })
}

/// SigV4's URI encoding of an object key: every byte but `A-Za-z0-9-._~` and `/` as `%XX`.
fn uri_encode_path(key: &str) -> String {
    let mut out = String::with_capacity(key.len());
    for b in key.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~' | b'/') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

// === scheduled export ===

/// Settings of the scheduled export (`NM_EXPORT_TO`, `NM_EXPORT_FORMAT`, `NM_EXPORT_KINDS`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Schedule {
    pub to: Destination,
    pub format: Format,
    pub kinds: Vec<Kind>,
}

/// After each UTC midnight, writes yesterday's files; at start, catches up yesterday if its file
/// is missing from a folder destination (an S3 destination is written again: a PUT of the same
/// bytes). Errors are logged and the day is tried again an hour later.
pub fn spawn_schedule(
    store: Store,
    schedule: Schedule,
    env: HashMap<String, String>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<()>> {
    let s3 = match &schedule.to {
        Destination::S3 { bucket, prefix } => Some(S3::from_env(&env, bucket, prefix)?),
        Destination::Dir(_) => None,
    };
    Ok(tokio::spawn(async move {
        let mut done: Option<NaiveDate> = None;
        loop {
            let today = Utc::now().date_naive();
            let yesterday = today.checked_sub_days(Days::new(1)).unwrap_or(today);
            let mut retry = false;
            if done != Some(yesterday) {
                for kind in &schedule.kinds {
                    let present = match &schedule.to {
                        Destination::Dir(d) => d
                            .join(export::relative_name(*kind, schedule.format, yesterday))
                            .exists(),
                        Destination::S3 { .. } => false,
                    };
                    if present && done.is_none() {
                        continue;
                    }
                    match write_day(
                        &store,
                        *kind,
                        schedule.format,
                        &schedule.to,
                        s3.as_ref(),
                        yesterday,
                    )
                    .await
                    {
                        Ok(d) => {
                            tracing::info!(file = %d.relative, rows = d.rows, bytes = d.bytes, "scheduled export written")
                        }
                        Err(e) => {
                            tracing::error!(error = %format!("{e:#}"), day = %yesterday, kind = kind.name(), "scheduled export failed; trying again in an hour");
                            retry = true;
                        }
                    }
                }
                if !retry {
                    done = Some(yesterday);
                }
            }
            // Sleep until just after the next UTC midnight (or an hour, to retry).
            let next = today
                .checked_add_days(Days::new(1))
                .and_then(|d| d.and_hms_opt(0, 5, 0))
                .map(|t| t.and_utc());
            let wait = match next {
                Some(t) if !retry => (t - Utc::now()).to_std().unwrap_or(Duration::from_secs(60)),
                _ => Duration::from_secs(3600),
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stop.changed() => return,
            }
            if *stop.borrow() {
                return;
            }
        }
    }))
}
