//! Serde building blocks shared by the dialect readers: a token count, a piece of text and the
//! first element of an array, each read leniently and without needless copies.
//!
//! Provider payloads are not ours to validate. A count sent as `null`, as `"12"` or as `12.0`, or
//! a model name sent as a number, must not make a whole event unreadable: these types accept any
//! JSON value and keep only what reads as what they hold, so one odd field costs that field, not
//! the event's usage.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// A token count: a non-negative integer, an integral float or a decimal string (proto3 JSON
/// writes 64-bit integers as strings). Anything else, `null` included, is unknown.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Count(pub Option<u64>);

/// A JSON string, borrowed from the input when it holds no escape (the common case, so the
/// model name repeated on every chunk costs no allocation). Any other JSON value is absent.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct Text<'a>(pub Option<Cow<'a, str>>);

/// The first element of a JSON array, the rest skipped unread; `null` or `[]` give `None`.
#[derive(Debug)]
pub(super) struct First<T>(pub Option<T>);

impl<T> Default for First<T> {
    fn default() -> Self {
        Self(None)
    }
}

// === impl Count ===

impl<'de> Deserialize<'de> for Count {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(CountVisitor).map(Count)
    }
}

struct CountVisitor;

impl<'de> Visitor<'de> for CountVisitor {
    type Value = Option<u64>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a token count")
    }

    fn visit_u64<E>(self, v: u64) -> Result<Self::Value, E> {
        Ok(Some(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Self::Value, E> {
        Ok(u64::try_from(v).ok())
    }

    fn visit_f64<E>(self, v: f64) -> Result<Self::Value, E> {
        // Some OpenAI-compatible servers write counts as `12.0`; a fraction is not a count.
        // The bound is 2^64, the first float past `u64::MAX`, so the cast cannot saturate.
        let integral =
            v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v < 18_446_744_073_709_551_616.0;
        Ok(integral.then_some(v as u64))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(v.parse().ok())
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        drain_seq(seq).map(|()| None)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        drain_map(map).map(|()| None)
    }
}

// === impl Text ===

impl<'de: 'a, 'a> Deserialize<'de> for Text<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TextVisitor(PhantomData)).map(Text)
    }
}

struct TextVisitor<'a>(PhantomData<&'a ()>);

impl<'de: 'a, 'a> Visitor<'de> for TextVisitor<'a> {
    type Value = Option<Cow<'a, str>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a string")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Some(Cow::Borrowed(v)))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Some(Cow::Owned(v.to_owned())))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<Self::Value, A::Error> {
        drain_seq(seq).map(|()| None)
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
        drain_map(map).map(|()| None)
    }
}

// === impl First ===

impl<'de, T: Deserialize<'de>> Deserialize<'de> for First<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(FirstVisitor(PhantomData))
    }
}

struct FirstVisitor<T>(PhantomData<T>);

impl<'de, T: Deserialize<'de>> Visitor<'de> for FirstVisitor<T> {
    type Value = First<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("an array")
    }

    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(First(None))
    }

    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(First(None))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let first = seq.next_element::<T>()?;
        drain_seq(seq)?;
        Ok(First(first))
    }
}

fn drain_seq<'de, A: SeqAccess<'de>>(mut seq: A) -> Result<(), A::Error> {
    while seq.next_element::<IgnoredAny>()?.is_some() {}
    Ok(())
}

fn drain_map<'de, A: MapAccess<'de>>(mut map: A) -> Result<(), A::Error> {
    while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_lenient() {
        let read = |json: &str| serde_json::from_str::<Count>(json).unwrap().0;
        assert_eq!(read("12"), Some(12));
        assert_eq!(read("12.0"), Some(12));
        assert_eq!(read("\"12\""), Some(12));
        assert_eq!(read("12.5"), None);
        assert_eq!(read("-3"), None);
        assert_eq!(read("1e300"), None);
        assert_eq!(read("null"), None);
        assert_eq!(read("true"), None);
        assert_eq!(read("[1,2]"), None);
        assert_eq!(read("{\"a\":1}"), None);
    }

    #[test]
    fn text_borrows_when_it_can() {
        let plain = serde_json::from_str::<Text<'_>>("\"gpt-4o\"").unwrap().0;
        assert!(matches!(plain, Some(Cow::Borrowed("gpt-4o"))));
        let escaped = serde_json::from_str::<Text<'_>>("\"a\\\"b\"").unwrap().0;
        assert_eq!(escaped.as_deref(), Some("a\"b"));
        assert_eq!(serde_json::from_str::<Text<'_>>("42").unwrap().0, None);
        assert_eq!(
            serde_json::from_str::<Text<'_>>("{\"x\":[1]}").unwrap().0,
            None
        );
    }

    #[test]
    fn first_takes_the_first_element() {
        let first = |json: &str| serde_json::from_str::<First<Count>>(json).unwrap().0;
        assert_eq!(first("[7, {\"x\": 1}, [2]]"), Some(Count(Some(7))));
        assert_eq!(first("[]"), None);
        assert_eq!(first("null"), None);
    }
}
