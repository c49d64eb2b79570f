//! Sending an encoded batch to the collector: over one of the two OTLP protocols
//! ([`super::grpc`], [`super::http`]), retried as the OTLP specification recommends (and as the
//! OpenTelemetry exporter this replaces did): up to 3 retries of a transient failure, after
//! 100 ms doubling to at most 1.6 s plus up to 100 ms of jitter, or after the delay a throttling
//! collector asks for (at most 30 s), all within the export timeout.

use std::time::{Duration, Instant};

use bytes::Bytes;

use super::grpc::GrpcSender;
use super::http::OtlpHttpClient;
use super::settings::{Export, Protocol};
use super::wire::{BuildError, ExportResponse, SendError};

const MAX_RETRIES: u32 = 3;
const INITIAL_DELAY: Duration = Duration::from_millis(100);
const MAX_DELAY: Duration = Duration::from_millis(1600);
const MAX_JITTER_MS: u64 = 100;
/// The longest a throttling collector is waited for between two attempts.
const MAX_THROTTLE: Duration = Duration::from_secs(30);

/// The exporter of one of the two protocols.
#[derive(Debug, Clone)]
pub enum Sender {
    Grpc(Box<GrpcSender>),
    Http(Box<OtlpHttpClient>),
}

impl Sender {
    /// The sender `export` asks for. Must be called inside the Tokio runtime it will run on.
    pub fn new(export: &Export) -> Result<Self, BuildError> {
        Ok(match export.protocol {
            Protocol::Grpc => Self::Grpc(Box::new(GrpcSender::new(export)?)),
            Protocol::HttpProtobuf => Self::Http(Box::new(OtlpHttpClient::new(export)?)),
        })
    }

    async fn send_once(&self, body: Bytes) -> Result<ExportResponse, SendError> {
        match self {
            Self::Grpc(g) => g.send(body).await,
            Self::Http(h) => h.send(body).await,
        }
    }

    /// Sends `body`, retrying transient failures until `deadline` has passed since the first
    /// attempt; the answer is the collector's last.
    pub async fn send(&self, body: Bytes, deadline: Duration) -> Result<ExportResponse, SendError> {
        let start = Instant::now();
        let mut delay = INITIAL_DELAY;
        let mut cap = MAX_DELAY;
        let mut attempt = 0;
        loop {
            let err = match self.send_once(body.clone()).await {
                Ok(answer) => return Ok(answer),
                Err(e) => e,
            };
            attempt += 1;
            if attempt > MAX_RETRIES || start.elapsed() >= deadline {
                return Err(err);
            }
            match &err {
                SendError::Final(_) => return Err(err),
                SendError::Retryable(_) => {}
                SendError::Throttled { after, .. } => {
                    let after = (*after).min(MAX_THROTTLE);
                    // A throttle longer than the usual backoff lets it grow that far.
                    if after > cap {
                        cap = MAX_THROTTLE;
                    }
                    delay = delay.max(after);
                }
            }
            let wait = (delay + jitter()).min(cap);
            if wait >= deadline.saturating_sub(start.elapsed()) {
                return Err(err);
            }
            tokio::time::sleep(wait).await;
            delay = (delay * 2).min(cap);
        }
    }
}

/// Up to [`MAX_JITTER_MS`] milliseconds, so exporters that failed together do not retry
/// together.
fn jitter() -> Duration {
    use std::hash::{BuildHasher as _, Hasher as _};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    h.write_u32(now.map_or(0, |d| d.subsec_nanos()));
    Duration::from_millis(h.finish() % (MAX_JITTER_MS + 1))
}

#[cfg(test)]
mod tests {
    use super::super::wire::PartialSuccess;
    use super::*;

    #[test]
    fn jitter_is_bounded() {
        for _ in 0..100 {
            assert!(jitter() <= Duration::from_millis(MAX_JITTER_MS));
        }
    }

    #[test]
    fn the_answer_decodes_the_collectors_partial_success() {
        use prost::Message as _;
        let answer = ExportResponse {
            partial_success: Some(PartialSuccess {
                rejected_spans: 3,
                error_message: "too old".to_owned(),
            }),
        };
        let bytes = answer.encode_to_vec();
        let decoded = ExportResponse::decode(bytes.as_slice()).unwrap();
        assert_eq!(decoded, answer);
        // The wire of opentelemetry-proto's message.
        let theirs =
            opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceResponse::decode(
                bytes.as_slice(),
            )
            .unwrap();
        let p = theirs.partial_success.unwrap();
        assert_eq!((p.rejected_spans, p.error_message.as_str()), (3, "too old"));
    }
}
