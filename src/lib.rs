//! nm-gateway: the binary's library. It wires the two halves together — the dataplane
//! (`nm-dataplane`, HTTP proxy) and the controlplane (`nm-controlplane`, storage) — and owns
//! everything between them and the outside: settings ([`config`]), logging ([`telemetry`]), gRPC
//! ([`grpc`]), the process shapes ([`app`]), the admin CLI ([`cli`]), the web page ([`ui`]) and the demo data ([`demo`]).

#![forbid(unsafe_code)]

/// The gateway's version, as every process reports it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

pub mod app;
pub mod cli;
pub mod command;
pub mod config;
pub mod demo;
pub mod export;
pub mod grpc;
pub mod limits;
pub mod link;
pub mod otel;
pub mod telemetry;
pub mod ui;
pub mod webhooks;
