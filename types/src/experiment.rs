//! Experiments' assignment: which arm of an experiment a session is in. Sticky and the same on
//! every dataplane with no lookup: the arm is a pure function of the experiment's salt, the
//! session id and the arms' names and weights.
//!
//! The rule is weighted rendezvous hashing ("highest random weight"): each arm draws a score from
//! a keyed hash of (salt, session, arm name), `-ln(u) / weight` with `u` uniform in (0, 1), and
//! the lowest score wins. Each score is an exponential variable with rate `weight`, so arm `i`
//! wins with probability `weight_i / Σ weight` exactly. And a session moves only when the new
//! weights must move it: when one arm's weight goes up, sessions move only to that arm; when it
//! goes down, only away from it; an arm added takes sessions from the others in proportion and
//! moves none between them; the order of the arms never matters.
//!
//! The keyed hash is SipHash-2-4 under the experiment's 128-bit salt, so nobody who does not know
//! the salt can pick session ids to land in an arm.

use std::fmt;
use std::hash::Hasher;
use std::str::FromStr;
use std::sync::Arc;

use siphasher::sip::SipHasher24;

use crate::Env;
use crate::{MAX_MODEL_LEN, MAX_NAME_LEN, text_ok};

/// Most arms one experiment may have.
pub const MAX_ARMS: usize = 16;
/// Largest weight of an arm (weights are relative: 1:1 and 50:50 are the same split).
pub const MAX_WEIGHT: u32 = 1_000_000;
/// Longest arm name.
pub const MAX_ARM_NAME_LEN: usize = 64;
/// Longest experiment id (the same characters as an arm name).
pub const MAX_EXPERIMENT_ID_LEN: usize = 64;

/// Why a set of arms was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ArmsError {
    #[error("an experiment needs 2 to {MAX_ARMS} arms")]
    Count,
    #[error(
        "arm names must be 1 to {MAX_ARM_NAME_LEN} characters of a-z, A-Z, 0-9, '_', '-' or '.'"
    )]
    Name,
    #[error("arm names must be unique")]
    Duplicate,
    #[error("arm weights must be whole numbers from 1 to {MAX_WEIGHT}")]
    Weight,
}

/// An experiment's secret salt: the key of its assignment hash, drawn at random when the
/// experiment is created and never changed (a new salt would reshuffle every session).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Salt([u8; 16]);

impl Salt {
    pub const fn new(bytes: [u8; 16]) -> Self {
        Self(bytes)
    }

    pub const fn bytes(&self) -> [u8; 16] {
        self.0
    }
}

/// The salt is a secret: its `Debug` does not show it.
impl fmt::Debug for Salt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Salt(..)")
    }
}

/// 32 lower-case hex digits, as stored.
impl fmt::Display for Salt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl FromStr for Salt {
    type Err = &'static str;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        const RULE: &str = "a salt is 32 lower-case hex digits";
        let b = s.as_bytes();
        if b.len() != 32 {
            return Err(RULE);
        }
        let digit = |c: u8| match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            _ => Err(RULE),
        };
        let mut out = [0u8; 16];
        for (o, pair) in out.iter_mut().zip(b.chunks_exact(2)) {
            *o = (digit(pair[0])? << 4) | digit(pair[1])?;
        }
        Ok(Self(out))
    }
}

/// One arm as the assignment sees it: its name and weight.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arm {
    pub name: String,
    pub weight: u32,
}

/// An experiment's arms, checked: 2 to [`MAX_ARMS`], unique valid names, weights from 1 to
/// [`MAX_WEIGHT`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Arms(Vec<Arm>);

impl Arms {
    pub fn new(arms: Vec<Arm>) -> Result<Self, ArmsError> {
        if !(2..=MAX_ARMS).contains(&arms.len()) {
            return Err(ArmsError::Count);
        }
        for (i, arm) in arms.iter().enumerate() {
            if !valid_name(&arm.name) {
                return Err(ArmsError::Name);
            }
            if arms[..i].iter().any(|a| a.name == arm.name) {
                return Err(ArmsError::Duplicate);
            }
            if !(1..=MAX_WEIGHT).contains(&arm.weight) {
                return Err(ArmsError::Weight);
            }
        }
        Ok(Self(arms))
    }

    pub fn as_slice(&self) -> &[Arm] {
        &self.0
    }

    /// The arm `session` is in (its index in [`Arms::as_slice`]).
    pub fn assign(&self, salt: &Salt, session: &str) -> usize {
        lowest(salt, session, self.0.iter().map(|a| (&*a.name, a.weight)))
    }
}

/// The index of the arm with the lowest score; ties (never seen: they need equal 53-bit draws)
/// go to the arm named first. One arm alone wins without a hash.
fn lowest<'a>(
    salt: &Salt,
    session: &str,
    arms: impl ExactSizeIterator<Item = (&'a str, u32)>,
) -> usize {
    if arms.len() == 1 {
        return 0;
    }
    // The session's part of the hash once; each arm's name continues a copy of it.
    let mut session_part = SipHasher24::new_with_key(&salt.0);
    session_part.write(session.as_bytes());
    session_part.write_u8(0xff);
    let mut best = (f64::INFINITY, 0);
    for (i, (name, weight)) in arms.enumerate() {
        let score = score(session_part, name, weight);
        if score < best.0 {
            best = (score, i);
        }
    }
    best.1
}

/// One arm as dataplanes apply it: its name and weight, and where its requests go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LiveArm {
    pub name: Arc<str>,
    pub weight: u32,
    /// The provider, by its configured name, the arm's requests are sent to. When it is not
    /// the provider the client addressed, the request goes there with the operator's
    /// credential for it, never the client's.
    pub provider: Arc<str>,
    /// The model the arm's requests name instead of the one the client asked for.
    pub model: Arc<str>,
}

/// An experiment as dataplanes apply it, carried by the key stream (`KeyVerifiers`). Only
/// experiments that change traffic travel: a running one with the arms that were not rolled
/// back, or a promoted one with its winner alone (every session goes to it). A paused,
/// decided, stopped or otherwise finished experiment is absent: its requests pass unchanged.
///
/// It applies to a request with an `NM-Session`, of its agent (and env, when it has one),
/// that names a model, unless the request opts out (`NM-Experiment: off`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Live {
    /// `[A-Za-z0-9_.-]{1,64}`: with the arm, the answer's `NM-Variant: <id>/<arm>`.
    pub id: Arc<str>,
    pub agent: Arc<str>,
    /// `None`: every env.
    pub env: Option<Env>,
    pub salt: Salt,
    /// 1 to [`MAX_ARMS`] arms (one: promoted, or the others rolled back).
    pub arms: Vec<LiveArm>,
}

impl Live {
    /// The rules a live experiment meets (the controlplane makes them so; a dataplane checks
    /// what it is sent and applies only experiments that pass).
    pub fn check(&self) -> Result<(), &'static str> {
        if !valid_name(&self.id) || self.id.len() > MAX_EXPERIMENT_ID_LEN {
            return Err("an experiment id is 1 to 64 characters of a-z, A-Z, 0-9, '_', '-', '.'");
        }
        crate::parse_agent(&self.agent)
            .map_err(|_| "agent must be 1 to 128 printable characters")?;
        if !(1..=MAX_ARMS).contains(&self.arms.len()) {
            return Err("a live experiment has 1 to 16 arms");
        }
        for (i, arm) in self.arms.iter().enumerate() {
            if !valid_name(&arm.name) || self.arms[..i].iter().any(|a| a.name == arm.name) {
                return Err("arm names must be unique names of a-z, A-Z, 0-9, '_', '-' or '.'");
            }
            if !(1..=MAX_WEIGHT).contains(&arm.weight) {
                return Err("arm weights must be whole numbers from 1 to 1000000");
            }
            if !text_ok(&arm.provider, MAX_NAME_LEN) || !text_ok(&arm.model, MAX_MODEL_LEN) {
                return Err("an arm's provider and model must be printable names");
            }
        }
        Ok(())
    }

    /// The arm `session` is in.
    pub fn assign(&self, session: &str) -> &LiveArm {
        let i = lowest(
            &self.salt,
            session,
            self.arms.iter().map(|a| (&*a.name, a.weight)),
        );
        &self.arms[i]
    }
}

/// Which arm of which experiment served a request: stored with its record, and the answer's
/// `NM-Variant: <experiment>/<arm>`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Variant {
    pub experiment: Arc<str>,
    pub arm: Arc<str>,
    /// The model the client named, when the arm sent another one (the record's `model` is the
    /// one served). `None`: the arm's model was the one asked for.
    pub requested_model: Option<String>,
}

impl Variant {
    /// The rules a record's variant meets ([`crate::record::RequestRecord::check`]).
    pub fn check(&self) -> Result<(), &'static str> {
        if !valid_name(&self.experiment) || self.experiment.len() > MAX_EXPERIMENT_ID_LEN {
            return Err("experiment must be 1 to 64 characters of a-z, A-Z, 0-9, '_', '-', '.'");
        }
        if !valid_name(&self.arm) {
            return Err("arm must be 1 to 64 characters of a-z, A-Z, 0-9, '_', '-', '.'");
        }
        if self
            .requested_model
            .as_deref()
            .is_some_and(|m| !text_ok(m, MAX_MODEL_LEN))
        {
            return Err("requested_model must be 1 to 256 printable characters");
        }
        Ok(())
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_ARM_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.'))
}

/// An arm's score for a session: `-ln(u) / weight`, `u` uniform in (0, 1) from the keyed hash
/// of the session and the arm's name (0xff between them: a byte no UTF-8 text holds, so no two
/// pairs hash the same bytes).
/// `session_part` has hashed the session and the 0xff.
fn score(mut h: SipHasher24, arm: &str, weight: u32) -> f64 {
    h.write(arm.as_bytes());
    let bits = h.finish() >> 11;
    // 53 random bits, centred in their interval: never 0, never 1.
    let u = (bits as f64 + 0.5) * (1.0 / (1u64 << 53) as f64);
    -u.ln() / f64::from(weight)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arms(spec: &[(&str, u32)]) -> Arms {
        Arms::new(
            spec.iter()
                .map(|(n, w)| Arm {
                    name: (*n).to_owned(),
                    weight: *w,
                })
                .collect(),
        )
        .unwrap()
    }

    const SALT: Salt = Salt::new(*b"0123456789abcdef");

    fn session(i: u32) -> String {
        format!("sess_{i}")
    }

    #[test]
    fn the_salt_reads_back_and_stays_secret_in_debug() {
        let s = SALT.to_string();
        assert_eq!(s, "30313233343536373839616263646566");
        assert_eq!(s.parse::<Salt>(), Ok(SALT));
        assert_eq!(format!("{SALT:?}"), "Salt(..)");
        for bad in [
            "",
            "3031",
            "3031323334353637383961626364656F",
            "3031323334353637383961626364656g",
            "303132333435363738396162636465660",
        ] {
            assert!(bad.parse::<Salt>().is_err(), "{bad}");
        }
    }

    #[test]
    fn bad_arms_are_refused_by_rule() {
        let arm = |n: &str, w| Arm {
            name: n.to_owned(),
            weight: w,
        };
        let cases = [
            (vec![arm("a", 1)], ArmsError::Count),
            (vec![arm("a", 1); MAX_ARMS + 1], ArmsError::Count),
            (vec![arm("a", 1), arm("", 1)], ArmsError::Name),
            (vec![arm("a", 1), arm("b c", 1)], ArmsError::Name),
            (vec![arm("a", 1), arm(&"b".repeat(65), 1)], ArmsError::Name),
            (vec![arm("a", 1), arm("a", 1)], ArmsError::Duplicate),
            (vec![arm("a", 1), arm("b", 0)], ArmsError::Weight),
            (
                vec![arm("a", MAX_WEIGHT + 1), arm("b", 1)],
                ArmsError::Weight,
            ),
        ];
        for (spec, why) in cases {
            assert_eq!(Arms::new(spec), Err(why));
        }
    }

    /// The hash is SipHash-2-4 (the reference's test vector), so the assignment is the same on
    /// every dataplane, platform and version.
    #[test]
    fn the_keyed_hash_is_siphash_2_4() {
        let key: [u8; 16] = std::array::from_fn(|i| i as u8);
        let mut h = SipHasher24::new_with_key(&key);
        let msg: Vec<u8> = (0..15).collect();
        h.write(&msg);
        assert_eq!(h.finish(), 0xa129ca6149be45e5);
    }

    /// Assignments of a few sessions, written down: a change of rule (hash, score, separator)
    /// would move sessions of running experiments, and must fail here first.
    #[test]
    fn assignments_are_stable() {
        let a = arms(&[("control", 1), ("candidate", 1)]);
        let got: Vec<usize> = (0..16).map(|i| a.assign(&SALT, &session(i))).collect();
        assert_eq!(got, STABLE);
    }
    const STABLE: [usize; 16] = [0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 1];

    #[test]
    fn arms_get_their_share() {
        let a = arms(&[("a", 1), ("b", 2), ("c", 7)]);
        let n = 100_000;
        let mut counts = [0u32; 3];
        for i in 0..n {
            counts[a.assign(&SALT, &session(i))] += 1;
        }
        for (count, share) in counts.iter().zip([0.1, 0.2, 0.7]) {
            let expected = share * f64::from(n);
            // Five standard deviations of a binomial count.
            let sd = (expected * (1.0 - share)).sqrt();
            assert!(
                (f64::from(*count) - expected).abs() < 5.0 * sd,
                "{counts:?}"
            );
        }
    }

    proptest! {
        /// One arm's weight changed: every session that moves, moves to that arm (its weight went
        /// up) or away from it (down); none moves between the others.
        #[test]
        fn a_weight_change_moves_only_the_sessions_it_must(
            weights in prop::collection::vec(1u32..100, 2..6),
            which in 0usize..6,
            new_weight in 1u32..100,
            salt in any::<[u8; 16]>(),
        ) {
            let which = which % weights.len();
            let names: Vec<String> = (0..weights.len()).map(|i| format!("arm{i}")).collect();
            let make = |w: &[u32]| Arms::new(
                names.iter().zip(w).map(|(n, w)| Arm { name: n.clone(), weight: *w }).collect(),
            ).unwrap();
            let before = make(&weights);
            let mut changed = weights.clone();
            changed[which] = new_weight;
            let after = make(&changed);
            let salt = Salt::new(salt);
            for i in 0..300 {
                let s = session(i);
                let (x, y) = (before.assign(&salt, &s), after.assign(&salt, &s));
                if x != y {
                    if new_weight > weights[which] {
                        prop_assert_eq!(y, which);
                    } else {
                        prop_assert_eq!(x, which);
                    }
                }
            }
        }

        /// The order the arms are listed in never moves a session; an arm added takes sessions
        /// from the others and moves none between them.
        #[test]
        fn order_never_matters_and_a_new_arm_only_takes(
            weights in prop::collection::vec(1u32..100, 2..6),
            salt in any::<[u8; 16]>(),
        ) {
            let spec: Vec<Arm> = weights.iter().enumerate()
                .map(|(i, w)| Arm { name: format!("arm{i}"), weight: *w }).collect();
            let forward = Arms::new(spec.clone()).unwrap();
            let backward = Arms::new(spec.iter().rev().cloned().collect()).unwrap();
            let mut more = spec.clone();
            more.push(Arm { name: "new".to_owned(), weight: 10 });
            let more = Arms::new(more).unwrap();
            let salt = Salt::new(salt);
            let n = spec.len();
            for i in 0..300 {
                let s = session(i);
                let f = forward.assign(&salt, &s);
                prop_assert_eq!(n - 1 - backward.assign(&salt, &s), f);
                let m = more.assign(&salt, &s);
                prop_assert!(m == f || m == n, "moved from {} to {}", f, m);
            }
        }
    }
}
