//! Records the controlplane refused for good, set aside so they never block the records behind
//! them: appended as JSON lines to `dead-letter.jsonl` beside the spool's segments, fsynced,
//! and counted in `nm_records_dead_lettered_total`. An operator can read (and, once the cause
//! is fixed, re-send) them; nothing reads the file back automatically.
//!
//! One line per record: `{"at_ms", "reason", "record": {...}}` with the record's fields by
//! name. The file is capped ([`MAX_BYTES`]); past the cap, refused records are only counted
//! and logged.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};

use nm_types::record::RequestRecord;
use serde_json::json;

/// The file's name in the spool directory.
pub const FILE_NAME: &str = "dead-letter.jsonl";
/// Largest the file grows (64 MiB).
pub const MAX_BYTES: u64 = 64 * 1024 * 1024;

#[derive(Debug, Clone)]
pub struct DeadLetters {
    path: PathBuf,
}

impl DeadLetters {
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            path: dir.join(FILE_NAME),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends the refused records with their reasons and syncs the file. Blocking I/O.
    pub fn append(&self, refused: &[(&RequestRecord, &str)], at_ms: i64) -> std::io::Result<()> {
        let mut lines = Vec::new();
        for (record, reason) in refused {
            let line = json!({"at_ms": at_ms, "reason": reason, "record": record_json(record)});
            serde_json::to_writer(&mut lines, &line)?;
            lines.push(b'\n');
        }
        let size = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        if size + lines.len() as u64 > MAX_BYTES {
            return Err(std::io::Error::other(format!(
                "{} is full ({MAX_BYTES} bytes)",
                self.path.display()
            )));
        }
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)?;
        file.write_all(&lines)?;
        file.sync_data()
    }
}

fn record_json(r: &RequestRecord) -> serde_json::Value {
    let u = &r.usage;
    json!({
        "request_id": r.request_id,
        "started_at_ms": r.started_at_ms,
        "key_id": &*r.key_id,
        "provider": &*r.provider,
        "method": &*r.method,
        "path": r.path,
        "model": r.model,
        "agent": r.agent,
        "session_id": r.session_id.as_ref().map(nm_types::SessionId::as_str),
        "env": r.env.map(nm_types::Env::as_str),
        "user_id": r.user_id,
        "status": r.status,
        "latency_ms": r.latency_ms,
        "ttfb_ms": r.ttfb_ms,
        "streamed": r.streamed,
        "error_code": r.error_code.as_deref(),
        "response_bytes": r.response_bytes,
        "answered_model": u.model,
        "input_tokens": u.input_tokens,
        "output_tokens": u.output_tokens,
        "cached_input_tokens": u.cached_input_tokens,
        "cache_write_tokens": u.cache_write_tokens,
        "reasoning_tokens": u.reasoning_tokens,
        "finish_reason": u.finish_reason,
        "cost_micros": r.cost_micros,
        "usage_status": r.usage_status.as_str(),
        "budget_micros": r.budget_micros,
    })
}
