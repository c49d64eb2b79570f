//! Request records written as `nm.link.v1.IngestRequestsRequest` bytes straight from
//! [`RequestRecord`], without the generated message in between: every record a dataplane ships
//! (and spools) would otherwise have each of its strings copied into a `pb::RequestRecord`, that
//! message's lengths computed, then all of it freed. The bytes are the ones prost writes for
//! [`super::record_to_pb`]'s message, field for field (a test compares them over arbitrary
//! records), so the controlplane decodes them with the generated code as before.

use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint};

use crate::UsageStatus;
use crate::record::RequestRecord;

/// `IngestRequestsRequest.records`.
const RECORDS: u32 = 1;

/// Appends the batch message of `records` to `out`; `scratch` holds one record's fields at a
/// time (reused, so a batch allocates nothing once both have grown).
pub(super) fn encode_batch_into(
    records: &[RequestRecord],
    out: &mut Vec<u8>,
    scratch: &mut Vec<u8>,
) {
    for r in records {
        scratch.clear();
        record_fields(r, scratch);
        encode_key(RECORDS, WireType::LengthDelimited, out);
        encode_varint(scratch.len() as u64, out);
        out.extend_from_slice(scratch);
    }
}

fn record_fields(r: &RequestRecord, out: &mut Vec<u8>) {
    let u = &r.usage;
    string(out, 1, &r.request_id);
    // started_at: a Timestamp, always present.
    let (seconds, nanos) = (
        r.started_at_ms.div_euclid(1000),
        r.started_at_ms.rem_euclid(1000) * 1_000_000,
    );
    let ts_len = int_len(1, seconds) + int_len(2, nanos);
    encode_key(2, WireType::LengthDelimited, out);
    encode_varint(ts_len as u64, out);
    int(out, 1, seconds);
    int(out, 2, nanos);
    string(out, 3, &r.key_id);
    string(out, 4, &r.provider);
    string(out, 5, &r.method);
    string(out, 6, &r.path);
    opt_string(out, 7, r.model.as_deref());
    opt_string(out, 8, r.agent.as_deref());
    opt_string(out, 9, r.session_id.as_ref().map(|s| s.as_str()));
    opt_string(out, 10, r.env.map(|e| e.as_str()));
    opt_string(out, 11, r.user_id.as_deref());
    uint(out, 12, u64::from(r.status));
    uint(out, 13, r.latency_ms);
    opt_uint(out, 14, r.ttfb_ms);
    uint(out, 15, u64::from(r.streamed));
    opt_string(out, 16, r.error_code.as_deref());
    uint(out, 17, r.response_bytes);
    opt_string(out, 18, u.model.as_deref());
    opt_uint(out, 19, u.input_tokens);
    opt_uint(out, 20, u.output_tokens);
    opt_uint(out, 21, u.cached_input_tokens);
    opt_uint(out, 22, u.cache_write_tokens);
    opt_uint(out, 23, u.reasoning_tokens);
    opt_string(out, 24, u.finish_reason.as_deref());
    opt_uint(out, 25, r.cost_micros);
    // The enum's numbers (link.proto's `UsageStatus`; 0, unspecified, is never sent).
    let status = match r.usage_status {
        UsageStatus::Reported => 1,
        UsageStatus::Partial => 2,
        UsageStatus::Missing => 3,
        UsageStatus::NotApplicable => 4,
    };
    uint(out, 26, status);
    opt_uint(out, 27, r.budget_micros);
    if let Some(t) = &r.trace {
        string(out, 41, t.trace_digits().as_str());
        string(out, 42, t.span_digits().as_str());
    }
    for i in &r.inferred {
        let (rule, answer) = (i.rule.name(), i.answer.as_str());
        let len = string_len(1, rule)
            + string_len(2, answer)
            + i.edit_distance.map_or(0, |d| 1 + encoded_len_varint(d));
        encode_key(43, WireType::LengthDelimited, out);
        encode_varint(len as u64, out);
        string(out, 1, rule);
        string(out, 2, answer);
        opt_uint(out, 3, i.edit_distance);
    }
    if let Some(v) = &r.variant {
        opt_string(out, 44, Some(&v.experiment));
        opt_string(out, 45, Some(&v.arm));
        opt_string(out, 46, v.requested_model.as_deref());
    }
}

/// A proto3 string: absent when empty.
fn string(out: &mut Vec<u8>, field: u32, s: &str) {
    if !s.is_empty() {
        opt_string(out, field, Some(s));
    }
}

/// An `optional string`: present whenever set, even empty.
fn opt_string(out: &mut Vec<u8>, field: u32, s: Option<&str>) {
    if let Some(s) = s {
        encode_key(field, WireType::LengthDelimited, out);
        encode_varint(s.len() as u64, out);
        out.extend_from_slice(s.as_bytes());
    }
}

fn string_len(field: u32, s: &str) -> usize {
    if s.is_empty() {
        0
    } else {
        key_len(field) + encoded_len_varint(s.len() as u64) + s.len()
    }
}

/// A proto3 unsigned (or bool, or enum) scalar: absent when zero.
fn uint(out: &mut Vec<u8>, field: u32, v: u64) {
    if v != 0 {
        opt_uint(out, field, Some(v));
    }
}

fn opt_uint(out: &mut Vec<u8>, field: u32, v: Option<u64>) {
    if let Some(v) = v {
        encode_key(field, WireType::Varint, out);
        encode_varint(v, out);
    }
}

/// A proto3 `int64`/`int32` (a negative one as its two's complement, ten bytes): absent when 0.
fn int(out: &mut Vec<u8>, field: u32, v: i64) {
    uint(out, field, v as u64);
}

fn int_len(field: u32, v: i64) -> usize {
    if v == 0 {
        0
    } else {
        key_len(field) + encoded_len_varint(v as u64)
    }
}

fn key_len(field: u32) -> usize {
    encoded_len_varint(u64::from(field << 3))
}
