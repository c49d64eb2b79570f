//! The process's log output ([`lines`]: a bounded queue and a writer thread, so a stalled stderr
//! never stalls a worker) and the access log written into it ([`access`]: one line per proxied
//! request, made once from the request's record), and a request's log context ([`request`]: the
//! fields of the `request` span its lines are written in).

pub mod access;
pub mod lines;
pub mod request;

pub use access::{AccessLine, AccessLog, LogFormat, Val};
pub use lines::LogLines;
pub use request::RequestLog;
