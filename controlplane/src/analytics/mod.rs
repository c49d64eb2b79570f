//! Agent analytics: recommendations from signals joined with their sessions' usage.
//!
//! [`outcome`] maps the eight signal actions to outcomes; [`stats`] holds the statistics that
//! decide whether the evidence supports a recommendation.

pub mod outcome;
pub mod stats;
