//! A size-capped on-disk spool of record batches.
