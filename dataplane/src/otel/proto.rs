//! Protobuf, written by hand for OTLP: the wire's primitives and the OTLP `KeyValue` message.
//! A span's attributes are written with these as they are set ([`super::span::Open`]), so an
//! ended span carries them already encoded, and the export thread (the root's `otel::otlp`)
//! frames the rest of the request with the same primitives.
//!
//! The bytes are prost's for opentelemetry-proto's messages (the root's `otel::otlp_tests`
//! compares): fields in tag order, a scalar at its default value left out, a `oneof` member and
//! a present message always written. A length is computed before its content when it is known
//! (an attribute's), else written in front of the content once it is, in room reserved by a
//! guess (a wrong guess moves the content once).

use opentelemetry::{Array, KeyValue, Value};

// Wire types.
pub const VARINT: u32 = 0;
pub const FIXED64: u32 = 1;
pub const LEN: u32 = 2;
pub const FIXED32: u32 = 5;

/// `Span.attributes`.
pub const SPAN_ATTRIBUTE: u32 = 9;

/// An attribute's value, when it is one of the scalars (the common case, written in one pass).
#[derive(Debug, Clone, Copy)]
pub enum Scalar<'a> {
    Str(&'a str),
    Bool(bool),
    I64(i64),
    F64(f64),
}

/// A `KeyValue` message as field `field`.
pub fn attribute(out: &mut Vec<u8>, field: u32, kv: &KeyValue) {
    key_value(out, field, kv.key.as_str(), &kv.value);
}

/// A `KeyValue` message, `key` and `value`, as field `field`.
pub fn key_value(out: &mut Vec<u8>, field: u32, key: &str, value: &Value) {
    let scalar = match value {
        Value::String(s) => Scalar::Str(s.as_str()),
        Value::Bool(b) => Scalar::Bool(*b),
        Value::I64(i) => Scalar::I64(*i),
        Value::F64(f) => Scalar::F64(*f),
        _ => {
            nested(out, field, |out| {
                string(out, 1, key);
                // KeyValue.value: always present.
                nested(out, 2, |out| any_value(out, value));
            });
            return;
        }
    };
    scalar_key_value(out, field, key, scalar);
}

/// A `KeyValue` message with a scalar value as field `field` (below 16, as every field here):
/// its lengths are known up front, so it is written in one pass after one `reserve`, no length
/// patched (it is on every traced request's path, two dozen times).
pub fn scalar_key_value(out: &mut Vec<u8>, field: u32, key: &str, value: Scalar<'_>) {
    // The AnyValue's member: its tag byte, then its length (a string, whose text follows) or
    // its number.
    let mut member = [0u8; 11];
    let (member_len, text): (usize, &[u8]) = match value {
        Scalar::Str(s) => {
            member[0] = (1 << 3) | LEN as u8;
            (put_varint(&mut member, 1, s.len() as u64), s.as_bytes())
        }
        Scalar::Bool(b) => {
            member[0] = (2 << 3) | VARINT as u8;
            (put_varint(&mut member, 1, u64::from(b)), b"")
        }
        Scalar::I64(i) => {
            member[0] = (3 << 3) | VARINT as u8;
            (put_varint(&mut member, 1, i as u64), b"")
        }
        Scalar::F64(f) => {
            member[0] = (4 << 3) | FIXED64 as u8;
            member[1..9].copy_from_slice(&f.to_bits().to_le_bytes());
            (9, b"")
        }
    };
    let any = (member_len + text.len()) as u64;
    let key_field = if key.is_empty() {
        0
    } else {
        1 + varint_len(key.len() as u64) + key.len()
    };
    // KeyValue.key, then KeyValue.value (always present).
    let kv = (key_field + 1 + varint_len(any)) as u64 + any;
    out.reserve(1 + varint_len(kv) + kv as usize);
    out.push(((field << 3) | LEN) as u8);
    varint(out, kv);
    if !key.is_empty() {
        out.push((1 << 3) | LEN as u8);
        varint(out, key.len() as u64);
        out.extend_from_slice(key.as_bytes());
    }
    out.push((2 << 3) | LEN as u8);
    varint(out, any);
    out.extend_from_slice(&member[..member_len]);
    out.extend_from_slice(text);
}

/// Writes `v` as a varint into `buf` at `at`; returns where it ends.
fn put_varint(buf: &mut [u8], mut at: usize, mut v: u64) -> usize {
    while v >= 0x80 {
        buf[at] = (v as u8) | 0x80;
        v >>= 7;
        at += 1;
    }
    buf[at] = v as u8;
    at + 1
}

/// A `KeyValue` message whose value is an array of strings, as field `field` (the bytes of
/// [`key_value`] with `Value::Array(Array::String(..))`, without building one).
pub fn strings_key_value(out: &mut Vec<u8>, field: u32, key: &str, values: &[&str]) {
    nested(out, field, |out| {
        string(out, 1, key);
        nested(out, 2, |out| {
            nested(out, 5, |out| {
                for s in values {
                    nested(out, 1, |out| {
                        tag(out, 1, LEN);
                        varint(out, s.len() as u64);
                        out.extend_from_slice(s.as_bytes());
                    });
                }
            });
        });
    });
}

/// An `AnyValue`'s content: its `oneof` member, written whatever its value.
pub fn any_value(out: &mut Vec<u8>, value: &Value) {
    match value {
        Value::String(s) => {
            tag(out, 1, LEN);
            varint(out, s.as_str().len() as u64);
            out.extend_from_slice(s.as_str().as_bytes());
        }
        Value::Bool(b) => {
            tag(out, 2, VARINT);
            varint(out, u64::from(*b));
        }
        Value::I64(i) => {
            tag(out, 3, VARINT);
            varint(out, *i as u64);
        }
        Value::F64(f) => {
            tag(out, 4, FIXED64);
            out.extend_from_slice(&f.to_bits().to_le_bytes());
        }
        Value::Array(array) => nested(out, 5, |out| array_value(out, array)),
        // `Value` is non-exhaustive: a kind this encoder does not know goes as an empty
        // `AnyValue` (the exporter it replaces could not have sent one either).
        _ => {}
    }
}

/// An `ArrayValue`'s content.
pub fn array_value(out: &mut Vec<u8>, array: &Array) {
    fn each<T>(out: &mut Vec<u8>, items: &[T], one: impl Fn(&T) -> Value) {
        for item in items {
            nested(out, 1, |out| any_value(out, &one(item)));
        }
    }
    match array {
        Array::Bool(v) => each(out, v, |b| Value::Bool(*b)),
        Array::I64(v) => each(out, v, |i| Value::I64(*i)),
        Array::F64(v) => each(out, v, |f| Value::F64(*f)),
        Array::String(v) => {
            for s in v {
                nested(out, 1, |out| {
                    tag(out, 1, LEN);
                    varint(out, s.as_str().len() as u64);
                    out.extend_from_slice(s.as_str().as_bytes());
                });
            }
        }
        _ => {}
    }
}

// === the wire ===

pub fn tag(out: &mut Vec<u8>, field: u32, wire: u32) {
    varint(out, u64::from((field << 3) | wire));
}

pub fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A varint's bytes, for a length known only after its content.
pub fn varint_bytes(mut v: u64) -> ([u8; 10], usize) {
    let mut bytes = [0u8; 10];
    let mut n = 0;
    while v >= 0x80 {
        bytes[n] = (v as u8) | 0x80;
        v >>= 7;
        n += 1;
    }
    bytes[n] = v as u8;
    (bytes, n + 1)
}

/// A length-delimited field whose content `write` appends; its length is put in front once
/// known, in one reserved byte (widened when the content is 128 bytes or more).
pub fn nested(out: &mut Vec<u8>, field: u32, write: impl FnOnce(&mut Vec<u8>)) {
    nested_sized(out, field, 1, write);
}

/// [`nested`] with `guess` bytes reserved for the length: a guess that fits the content's
/// length class (2 for a span, more for a batch) leaves the content where it was written,
/// rather than moving all of it to make room.
pub fn nested_sized(out: &mut Vec<u8>, field: u32, guess: usize, write: impl FnOnce(&mut Vec<u8>)) {
    tag(out, field, LEN);
    let at = out.len();
    out.resize(at + guess, 0);
    write(out);
    let end = out.len();
    let len = end - at - guess;
    let (bytes, n) = varint_bytes(len as u64);
    if n != guess {
        // Move the content to fit the length's bytes.
        if n > guess {
            out.resize(end + n - guess, 0);
        }
        out.copy_within(at + guess..end, at + n);
        out.truncate(at + n + len);
    }
    out[at..at + n].copy_from_slice(&bytes[..n]);
}

/// How many bytes `v` takes as a varint.
pub fn varint_len(v: u64) -> usize {
    // 1 byte per 7 bits, at least 1.
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

/// A string field, left out when empty.
pub fn string(out: &mut Vec<u8>, field: u32, s: &str) {
    bytes(out, field, s.as_bytes());
}

/// A bytes field, left out when empty.
pub fn bytes(out: &mut Vec<u8>, field: u32, b: &[u8]) {
    if !b.is_empty() {
        tag(out, field, LEN);
        varint(out, b.len() as u64);
        out.extend_from_slice(b);
    }
}

/// A varint field (`uint32`, an enum), left out when 0.
pub fn uint(out: &mut Vec<u8>, field: u32, v: u64) {
    if v != 0 {
        tag(out, field, VARINT);
        varint(out, v);
    }
}

pub fn fixed32(out: &mut Vec<u8>, field: u32, v: u32) {
    if v != 0 {
        tag(out, field, FIXED32);
        out.extend_from_slice(&v.to_le_bytes());
    }
}

pub fn fixed64(out: &mut Vec<u8>, field: u32, v: u64) {
    if v != 0 {
        tag(out, field, FIXED64);
        out.extend_from_slice(&v.to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn varint_lengths_are_the_bytes_written() {
        for v in [
            0,
            1,
            127,
            128,
            16_383,
            16_384,
            u64::from(u32::MAX),
            u64::MAX,
        ] {
            let mut out = Vec::new();
            super::varint(&mut out, v);
            assert_eq!(super::varint_len(v), out.len(), "{v}");
        }
    }
}
