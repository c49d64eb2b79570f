//! The sampler's rules (the SDK's, compared rule for rule in the root's `otel::tracer_tests`).

use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};

use super::{Root, Sampler, by_ratio};

fn trace(low: u64) -> TraceId {
    TraceId::from(u128::from(low) | (0xabcd_u128 << 64))
}

#[test]
fn the_ratio_reads_the_trace_ids_low_63_bits() {
    assert!(by_ratio(1.0, trace(u64::MAX)));
    assert!(by_ratio(2.0, trace(u64::MAX)));
    assert!(!by_ratio(0.0, trace(0)));
    assert!(!by_ratio(f64::NAN, trace(0)));
    assert!(by_ratio(0.5, trace(0)));
    // Low 64 bits shifted right once, against 0.5 × 2⁶³ = 2⁶².
    assert!(by_ratio(0.5, trace((1 << 63) - 1)));
    assert!(!by_ratio(0.5, trace(1 << 63)));
    // The high half does not count.
    assert_eq!(
        by_ratio(0.5, TraceId::from(u128::MAX << 64)),
        by_ratio(0.5, trace(0))
    );
}

#[test]
fn a_parent_based_sampler_follows_an_active_parent_else_its_root() {
    let parent = |flags| {
        SpanContext::new(
            trace(1),
            SpanId::from(2),
            flags,
            true,
            TraceState::default(),
        )
    };
    let sampled = parent(TraceFlags::SAMPLED);
    let unsampled = parent(TraceFlags::default());
    let on = Sampler::ParentBased(Root::AlwaysOn);
    let off = Sampler::ParentBased(Root::AlwaysOff);
    assert!(on.samples(None, trace(1)));
    assert!(!off.samples(None, trace(1)));
    assert!(off.samples(Some(&sampled), trace(1)));
    assert!(!on.samples(Some(&unsampled), trace(1)));
    // The others ignore the parent.
    assert!(Sampler::AlwaysOn.samples(Some(&unsampled), trace(1)));
    assert!(!Sampler::AlwaysOff.samples(Some(&sampled), trace(1)));
}
