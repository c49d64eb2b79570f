//! The file names, the day range and the JSON line of the export (the files themselves are
//! read back by DuckDB and pyarrow in tests/export.rs).

use chrono::NaiveDate;

use super::*;

fn day(s: &str) -> NaiveDate {
    NaiveDate::parse_from_str(s, "%Y-%m-%d").unwrap_or_else(|e| panic!("{s}: {e}"))
}

#[test]
fn a_day_is_named_by_its_date_under_its_kind() {
    assert_eq!(
        relative_name(Kind::Records, Format::Parquet, day("2026-11-28")),
        "records/2026-11-28.parquet"
    );
    assert_eq!(
        relative_name(Kind::Signals, Format::Jsonl, day("2026-01-02")),
        "signals/2026-01-02.jsonl"
    );
}

#[test]
fn days_run_from_since_to_before_until() {
    let d: Vec<_> = days(day("2026-02-27"), day("2026-03-02")).collect();
    assert_eq!(
        d,
        vec![day("2026-02-27"), day("2026-02-28"), day("2026-03-01")]
    );
    assert_eq!(days(day("2026-03-02"), day("2026-03-02")).count(), 0);
}

#[test]
fn a_day_is_midnight_to_midnight_utc() {
    let (a, b) = day_bounds_ms(day("1970-01-02")).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!((a, b), (86_400_000, 172_800_000));
}

#[test]
fn a_json_line_has_the_schema_then_every_column() {
    let mut line = Vec::new();
    let cols = &[
        Col {
            name: "id",
            ty: Ty::Str,
        },
        Col {
            name: "at",
            ty: Ty::Time,
        },
        Col {
            name: "n",
            ty: Ty::OptI64,
        },
        Col {
            name: "b",
            ty: Ty::Bool,
        },
    ];
    let row = vec![
        Val::Str("a\"b".into()),
        Val::I64(1_764_288_000_123),
        Val::Null,
        Val::Bool(true),
    ];
    writer::json_line(&mut line, "records/1", cols, row).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        String::from_utf8_lossy(&line),
        "{\"nm_schema\":\"records/1\",\"id\":\"a\\\"b\",\"at\":\"2025-11-28T00:00:00.123Z\",\"n\":null,\"b\":true}\n"
    );
}
