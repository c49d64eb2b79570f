//! The process's log output ([`lines`]: a bounded queue and a writer thread, so a stalled stderr
//! never stalls a worker) and the access log written into it ([`access`]: one line per proxied
//! request, made once from the request's record).

pub mod access;
pub mod lines;

pub use access::{AccessLine, AccessLog, LogFormat};
pub use lines::LogLines;
