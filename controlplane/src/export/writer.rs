//! One day's file, written row by row: JSON lines straight through a buffered file, Parquet
//! column by column in row groups of at most [`ROW_GROUP_ROWS`](super::ROW_GROUP_ROWS) rows.
//! Nothing written depends on when or where it runs.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;
use std::sync::Arc;

use chrono::{DateTime, SecondsFormat};
use parquet::basic::{Compression, LogicalType, Repetition, TimeUnit, Type as Physical};
use parquet::data_type::{BoolType, ByteArray, ByteArrayType, Int64Type};
use parquet::file::metadata::KeyValue;
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::types::Type;

use super::{Col, ExportIoError, Format, Kind, ROW_GROUP_ROWS, Ty, Val};

type Out = BufWriter<File>;

/// A day's file being written (to its `.partial` name).
pub struct DayWriter {
    cols: &'static [Col],
    inner: Inner,
}

enum Inner {
    Jsonl {
        out: Out,
        tag: String,
        line: Vec<u8>,
    },
    Parquet {
        out: Box<SerializedFileWriter<Out>>,
        bufs: Vec<ColBuf>,
        rows: usize,
    },
}

/// One column's values for the row group being built, and for a nullable column its
/// definition levels (1: a value, 0: null), one per row.
struct ColBuf {
    data: Data,
    defs: Option<Vec<i16>>,
}

enum Data {
    Bytes(Vec<ByteArray>),
    Int(Vec<i64>),
    Bool(Vec<bool>),
}

impl DayWriter {
    /// Creates (or truncates) `path`.
    pub fn create(path: &Path, kind: Kind, format: Format) -> Result<Self, ExportIoError> {
        let out = BufWriter::with_capacity(1 << 16, File::create(path)?);
        let cols = kind.columns();
        let inner = match format {
            Format::Jsonl => Inner::Jsonl {
                out,
                tag: kind.schema_tag(),
                line: Vec::with_capacity(1024),
            },
            Format::Parquet => {
                let props = WriterProperties::builder()
                    .set_compression(Compression::SNAPPY)
                    .set_max_row_group_row_count(Some(ROW_GROUP_ROWS))
                    .set_key_value_metadata(Some(vec![KeyValue::new(
                        "nm.schema".to_owned(),
                        kind.schema_tag(),
                    )]))
                    .build();
                let writer =
                    SerializedFileWriter::new(out, Arc::new(schema(kind)?), Arc::new(props))?;
                Inner::Parquet {
                    out: Box::new(writer),
                    bufs: cols.iter().map(|c| ColBuf::new(c.ty)).collect(),
                    rows: 0,
                }
            }
        };
        Ok(Self { cols, inner })
    }

    /// Appends rows (each in column order).
    pub fn write(&mut self, rows: Vec<Vec<Val>>) -> Result<(), ExportIoError> {
        match &mut self.inner {
            Inner::Jsonl { out, tag, line } => {
                for row in rows {
                    line.clear();
                    json_line(line, tag, self.cols, row)?;
                    out.write_all(line)?;
                }
            }
            Inner::Parquet {
                out,
                bufs,
                rows: held,
            } => {
                for row in rows {
                    for (buf, v) in bufs.iter_mut().zip(row) {
                        buf.push(v);
                    }
                    *held += 1;
                    if *held == ROW_GROUP_ROWS {
                        flush_row_group(out, bufs)?;
                        *held = 0;
                    }
                }
            }
        }
        Ok(())
    }

    /// Writes what is held, the footer, and syncs the file to disk.
    pub fn finish(self) -> Result<(), ExportIoError> {
        let out = match self.inner {
            Inner::Jsonl { out, .. } => out,
            Inner::Parquet {
                mut out,
                mut bufs,
                rows,
            } => {
                if rows > 0 {
                    flush_row_group(&mut out, &mut bufs)?;
                }
                out.into_inner()?
            }
        };
        let file = out.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        Ok(())
    }
}

fn flush_row_group(
    out: &mut SerializedFileWriter<Out>,
    bufs: &mut [ColBuf],
) -> Result<(), ExportIoError> {
    let mut rg = out.next_row_group()?;
    for buf in bufs.iter_mut() {
        let Some(mut col) = rg.next_column()? else {
            break;
        };
        let defs = buf.defs.as_deref();
        match &buf.data {
            Data::Bytes(v) => {
                col.typed::<ByteArrayType>().write_batch(v, defs, None)?;
            }
            Data::Int(v) => {
                col.typed::<Int64Type>().write_batch(v, defs, None)?;
            }
            Data::Bool(v) => {
                col.typed::<BoolType>().write_batch(v, defs, None)?;
            }
        }
        col.close()?;
        buf.clear();
    }
    rg.close()?;
    Ok(())
}

impl ColBuf {
    fn new(ty: Ty) -> Self {
        let data = match ty {
            Ty::Str | Ty::OptStr => Data::Bytes(Vec::new()),
            Ty::I64 | Ty::OptI64 | Ty::Time => Data::Int(Vec::new()),
            Ty::Bool => Data::Bool(Vec::new()),
        };
        Self {
            data,
            defs: ty.nullable().then(Vec::new),
        }
    }

    /// A null in a required column cannot happen (the row builders give values there); were it
    /// to, the row group's value count would not match and the writer would refuse it.
    fn push(&mut self, v: Val) {
        let present = match (&mut self.data, v) {
            (Data::Bytes(vals), Val::Str(s)) => {
                vals.push(ByteArray::from(s.into_bytes()));
                true
            }
            (Data::Int(vals), Val::I64(i)) => {
                vals.push(i);
                true
            }
            (Data::Bool(vals), Val::Bool(b)) => {
                vals.push(b);
                true
            }
            _ => false,
        };
        if let Some(defs) = &mut self.defs {
            defs.push(i16::from(present));
        }
    }

    fn clear(&mut self) {
        match &mut self.data {
            Data::Bytes(v) => v.clear(),
            Data::Int(v) => v.clear(),
            Data::Bool(v) => v.clear(),
        }
        if let Some(d) = &mut self.defs {
            d.clear();
        }
    }
}

/// The Parquet schema of `kind`: required columns without definition levels, nullable ones
/// `OPTIONAL`.
fn schema(kind: Kind) -> Result<Type, ExportIoError> {
    let mut fields = Vec::new();
    for col in kind.columns() {
        let rep = if col.ty.nullable() {
            Repetition::OPTIONAL
        } else {
            Repetition::REQUIRED
        };
        let (physical, logical) = match col.ty {
            Ty::Str | Ty::OptStr => (Physical::BYTE_ARRAY, Some(LogicalType::String)),
            Ty::I64 | Ty::OptI64 => (Physical::INT64, None),
            Ty::Time => (
                Physical::INT64,
                Some(LogicalType::timestamp(true, TimeUnit::MILLIS)),
            ),
            Ty::Bool => (Physical::BOOLEAN, None),
        };
        fields.push(Arc::new(
            Type::primitive_type_builder(col.name, physical)
                .with_repetition(rep)
                .with_logical_type(logical)
                .build()?,
        ));
    }
    Ok(Type::group_type_builder("schema")
        .with_fields(fields)
        .build()?)
}

/// `{"nm_schema":"records/1","request_id":"...",...}\n`: every column, nulls as `null`, times
/// as RFC 3339 UTC with milliseconds.
pub(super) fn json_line(
    line: &mut Vec<u8>,
    tag: &str,
    cols: &[Col],
    row: Vec<Val>,
) -> Result<(), ExportIoError> {
    line.extend_from_slice(b"{\"nm_schema\":");
    serde_json::to_writer(&mut *line, tag)?;
    for (col, v) in cols.iter().zip(row) {
        line.push(b',');
        serde_json::to_writer(&mut *line, col.name)?;
        line.push(b':');
        match v {
            Val::Null => line.extend_from_slice(b"null"),
            Val::I64(ms) if col.ty == Ty::Time => {
                let t = DateTime::from_timestamp_millis(ms).unwrap_or_default();
                serde_json::to_writer(&mut *line, &t.to_rfc3339_opts(SecondsFormat::Millis, true))?;
            }
            Val::I64(i) => serde_json::to_writer(&mut *line, &i)?,
            Val::Str(s) => serde_json::to_writer(&mut *line, &s)?,
            Val::Bool(b) => serde_json::to_writer(&mut *line, &b)?,
        }
    }
    line.extend_from_slice(b"}\n");
    Ok(())
}
