//! OpenMetrics text held to a strict parser: Python `prometheus_client`'s
//! (`text_string_to_metric_families`, via `tests/metrics/openmetrics_check.py`), which refuses
//! what Prometheus' lenient scraper lets through (a missing `# EOF`, a unit that is not the name's
//! suffix, bad exemplars, histogram buckets out of order or without `+Inf`, ..).
//!
//! The interpreter is the one named by `NM_TEST_METRICS_PYTHON` (`.ci/run` makes
//! `target/metrics-venv` for it); without it [`python`] prints a `SKIPPED` line and returns
//! `None`.

use std::process::Stdio;

use tokio::io::AsyncWriteExt;

/// The Python with `prometheus_client`, or `None` after a `SKIPPED` line naming `check`.
pub fn python(check: &str) -> Option<String> {
    match std::env::var("NM_TEST_METRICS_PYTHON") {
        Ok(p) => Some(p),
        Err(_) => {
            eprintln!(
                "SKIPPED {check}: set NM_TEST_METRICS_PYTHON to a python with prometheus_client (.ci/run makes target/metrics-venv)"
            );
            None
        }
    }
}

/// Parses `text` strictly; panics with the parser's error and the numbered text if it fails.
/// Returns `{family: {"type", "unit", "help", "samples": [{"name", "labels", "value",
/// "exemplar"}]}}`.
pub async fn parse_strict(python: &str, text: &str) -> serde_json::Value {
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/metrics/openmetrics_check.py"
    );
    let mut child = tokio::process::Command::new(python)
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{python}: {e}"));
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(text.as_bytes())
            .await
            .unwrap_or_else(|e| panic!("writing to the parser: {e}"));
    }
    let out = child
        .wait_with_output()
        .await
        .unwrap_or_else(|e| panic!("{python}: {e}"));
    if !out.status.success() {
        let numbered: Vec<String> = text
            .lines()
            .enumerate()
            .map(|(i, l)| format!("{:5} {l}", i + 1))
            .collect();
        panic!(
            "strict OpenMetrics parse failed: {}\n--- text ---\n{}",
            String::from_utf8_lossy(&out.stderr),
            numbered.join("\n")
        );
    }
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("parser output is not JSON ({e})"))
}

/// The families of a parse (as [`parse_strict`] returns) with their type, for "declared" checks.
pub fn family_type<'a>(parsed: &'a serde_json::Value, family: &str) -> Option<&'a str> {
    parsed.get(family)?.get("type")?.as_str()
}
