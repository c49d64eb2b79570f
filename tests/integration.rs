//! Integration tests: real gateways on loopback ports, mock providers, real SQLite files and
//! PostgreSQL databases, real gRPC. One binary; one module per area.

mod common;

mod access;
mod alerts;
mod analytics;
mod answer_signals;
mod budget_levels;
mod budgets;
mod docs;
mod errors;
mod experiments;
mod experiments_proxy;
mod export;
mod faults;
mod forget;
mod implicit;
mod implicit_signals;
mod imports;
mod keys;
mod link;
mod link_rules;
mod metrics;
mod otel;
mod otel_harness;
mod partitions;
mod process;
mod proxy;
mod records;
mod retention;
mod routes;
mod sdk;
mod signals;
mod streaming;
mod ui;
mod ui_browser;
mod usage;
