//! Conversions between protobuf messages and the halves' own types.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prost_types::Timestamp;

use super::pb;

pub fn ms_to_timestamp(ms: i64) -> Timestamp {
    Timestamp {
        seconds: ms.div_euclid(1000),
        nanos: (ms.rem_euclid(1000) * 1_000_000) as i32,
    }
}

pub fn timestamp_to_ms(ts: &Timestamp) -> i64 {
    ts.seconds
        .saturating_mul(1000)
        .saturating_add(i64::from(ts.nanos) / 1_000_000)
}

pub fn system_time_to_timestamp(t: SystemTime) -> Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

pub fn api_key(m: nm_controlplane::store::entity::api_key::Model) -> pb::ApiKey {
    pb::ApiKey {
        id: m.id,
        name: m.name,
        admin: m.admin,
        display_prefix: m.display_prefix,
        created_at: Some(ms_to_timestamp(m.created_at_ms)),
        revoked_at: m.revoked_at_ms.map(ms_to_timestamp),
    }
}

/// Dataplane record -> wire.
pub fn record_to_pb(r: nm_dataplane::RequestRecord) -> pb::RequestRecord {
    pb::RequestRecord {
        request_id: r.request_id,
        started_at: Some(system_time_to_timestamp(r.started_at)),
        key_id: r.key_id.to_string(),
        provider: r.provider.to_string(),
        method: r.method,
        path: r.path,
        model: r.model,
        agent: r.agent,
        session_id: r.session_id,
        env: r.env.map(|e| e.as_str().to_owned()),
        user_id: r.user_id,
        status: u32::from(r.status),
        latency_ms: millis(r.latency),
        ttfb_ms: r.ttfb.map(millis),
        streamed: r.streamed,
        error_code: r.error_code.map(str::to_owned),
        response_bytes: r.response_bytes,
    }
}

/// Wire -> controlplane record.
pub fn record_from_pb(r: pb::RequestRecord) -> nm_controlplane::RequestRecord {
    nm_controlplane::RequestRecord {
        request_id: r.request_id,
        started_at_ms: r.started_at.as_ref().map_or(0, timestamp_to_ms),
        key_id: r.key_id,
        provider: r.provider,
        method: r.method,
        path: r.path,
        model: r.model,
        agent: r.agent,
        session_id: r.session_id,
        env: r.env,
        user_id: r.user_id,
        status: u16::try_from(r.status).unwrap_or(0),
        latency_ms: r.latency_ms,
        ttfb_ms: r.ttfb_ms,
        streamed: r.streamed,
        error_code: r.error_code,
        response_bytes: r.response_bytes,
    }
}

/// Dataplane signal -> wire.
pub fn signal_to_pb(s: nm_dataplane::SignalSubmission) -> pb::Signal {
    pb::Signal {
        session_id: s.session_id.to_string(),
        action: s.action.as_str().to_owned(),
        edit_distance: s.edit_distance,
        custom_label_json: s.custom_label,
        agent_hint: s.agent_hint,
        idempotency_key: s.idempotency_key,
        key_id: s.key_id.to_string(),
        request_id: s.id,
        received_at: Some(system_time_to_timestamp(s.received_at)),
    }
}

/// Wire -> controlplane signal; a bad action is an invalid argument.
pub fn signal_from_pb(s: pb::Signal) -> Result<nm_controlplane::NewSignal, nm_controlplane::Error> {
    let action = s
        .action
        .parse::<nm_types::Action>()
        .map_err(|e| nm_controlplane::Error::InvalidArgument(e.to_string()))?;
    Ok(nm_controlplane::NewSignal {
        id: s.request_id,
        received_at_ms: s
            .received_at
            .as_ref()
            .map_or_else(|| chrono::Utc::now().timestamp_millis(), timestamp_to_ms),
        session_id: s.session_id,
        action,
        edit_distance: s.edit_distance,
        custom_label: s.custom_label_json,
        key_id: s.key_id,
        idempotency_key: s.idempotency_key,
        agent_hint: s.agent_hint,
    })
}

pub fn action_counts(c: &nm_controlplane::signals::ActionCounts) -> pb::ActionCounts {
    use nm_types::Action::*;
    pb::ActionCounts {
        accepted: c.get(Accepted),
        edited: c.get(Edited),
        regenerated: c.get(Regenerated),
        abandoned: c.get(Abandoned),
        thumbs_up: c.get(ThumbsUp),
        thumbs_down: c.get(ThumbsDown),
        published: c.get(Published),
        sent: c.get(Sent),
    }
}

/// A proto time range -> (since, until) in milliseconds.
pub fn range_ms(r: Option<&pb::TimeRange>) -> (Option<i64>, Option<i64>) {
    r.map_or((None, None), |r| {
        (
            r.since.as_ref().map(timestamp_to_ms),
            r.until.as_ref().map(timestamp_to_ms),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_round_trip() {
        for ms in [0, 1, 999, 1_700_000_000_123, -1] {
            assert_eq!(timestamp_to_ms(&ms_to_timestamp(ms)), ms);
        }
    }
}
