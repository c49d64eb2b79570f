//! Per-end-user budgets, enforced before forwarding, from memory.
//!
//! The controlplane is the source of truth: it feeds each dataplane the budget rules and every
//! end user's spend in the current UTC day and month ([`Budgets::apply_feed`]). What the feed
//! cannot know yet is this dataplane's own recent traffic, so each admitted request leaves an
//! entry in a local ledger:
//!
//! 1. **in flight**: it holds a reservation, an estimate of its cost from the request
//!    (`max_tokens` times the output price, plus the prompt);
//! 2. **settled**: the answer ended; the entry now holds what the request actually counts
//!    (its cost when known, else its reservation);
//! 3. **delivered**: its record was stored by the controlplane, whose acknowledgement says at
//!    which feed position `(epoch, seq)` the spend is included;
//! 4. gone, once the feed reaches that position (the spend is now in the feed's numbers).
//!
//! An end user's spend is then the feed's number plus their local entries, and a request is
//! admitted while that is below the limit. Because every admitted request's reservation is
//! counted before the next request is checked, concurrent requests cannot overshoot a budget by
//! more than one request's reservation on one dataplane; across dataplanes, see ARCHITECTURE.md.
//! Requests per minute are counted the same way: the feed's count for the user's latest minute
//! plus the local entries started in this minute.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nm_types::budget::{BudgetRule, MINUTE_MS, Period, day_of, minute_of, month_of_day};

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The user's spend reached the limit; retry when the period resets.
    Spent {
        limit_micros: u64,
        period: Period,
        retry_after: Duration,
    },
    /// The user started `rpm` requests this minute.
    Rate { rpm: u32, retry_after: Duration },
    /// No budget state has arrived from the controlplane yet.
    NotLoaded,
}

/// One end user's spend as the controlplane last reported it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoteSpend {
    pub day_micros: u64,
    pub month_micros: u64,
    pub minute: i64,
    pub minute_requests: u32,
}

/// One message of the controlplane's budget feed.
#[derive(Debug, Clone, Default)]
pub struct Feed {
    pub epoch: u64,
    pub seq: u64,
    /// Replaces everything known (rules and spend).
    pub full: bool,
    /// With `full`: the default rule and the per-user overrides.
    pub default: Option<BudgetRule>,
    pub overrides: Vec<(String, BudgetRule)>,
    pub spend: Vec<(String, RemoteSpend)>,
    /// The controlplane's current day and month the spend counts toward.
    pub day: i64,
    pub month: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EntryState {
    InFlight,
    Settled,
    Delivered { epoch: u64, seq: u64 },
}

#[derive(Debug, Clone)]
struct Entry {
    request_id: String,
    started_ms: i64,
    micros: u64,
    state: EntryState,
}

#[derive(Debug, Clone, Copy, Default)]
struct Remote {
    spend: RemoteSpend,
    day: i64,
    month: i64,
}

#[derive(Debug, Default)]
struct Ledger {
    synced: bool,
    epoch: u64,
    seq: u64,
    /// The controlplane's current month.
    month: i64,
    default: Option<BudgetRule>,
    overrides: HashMap<String, BudgetRule>,
    remote: HashMap<String, Remote>,
    local: HashMap<String, Vec<Entry>>,
}

/// The dataplane's budget state. Cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Budgets {
    ledger: Arc<Mutex<Ledger>>,
}

/// An admitted request's hold on its user's budget. Settle it with what the request counts;
/// dropping it unsettled counts the reservation.
#[derive(Debug)]
pub struct Reservation {
    budgets: Budgets,
    user: String,
    request_id: String,
    reserved: u64,
    settled: bool,
}

impl Reservation {
    pub fn reserved_micros(&self) -> u64 {
        self.reserved
    }

    /// Replaces the reservation with what the request counts against the budget.
    pub fn settle(mut self, micros: u64) {
        self.settled = true;
        self.budgets.settle(&self.user, &self.request_id, micros);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            self.budgets
                .settle(&self.user, &self.request_id, self.reserved);
        }
    }
}

impl Budgets {
    fn lock(&self) -> MutexGuard<'_, Ledger> {
        // Plain numbers: a panic elsewhere cannot leave them half-updated in a harmful way.
        self.ledger.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a feed has arrived since start.
    pub fn is_synced(&self) -> bool {
        self.lock().synced
    }

    /// Admits or refuses a request of `user` that may cost up to `estimate_micros`. `Ok(None)`:
    /// no budget applies to the user.
    pub fn admit(
        &self,
        user: &str,
        request_id: &str,
        estimate_micros: u64,
        now_ms: i64,
    ) -> Result<Option<Reservation>, Refusal> {
        let mut l = self.lock();
        if !l.synced {
            return Err(Refusal::NotLoaded);
        }
        let Some(rule) = l.overrides.get(user).or(l.default.as_ref()).copied() else {
            return Ok(None);
        };
        let (day, month, minute) = (
            day_of(now_ms),
            month_of_day(day_of(now_ms)),
            minute_of(now_ms),
        );
        let remote = l.remote.get(user).copied().unwrap_or_default();
        let entries = l.local.get(user).map(Vec::as_slice).unwrap_or_default();

        if let Some(limit) = rule.limit_micros {
            let remote_spent = match rule.period {
                Period::Day if remote.day == day => remote.spend.day_micros,
                Period::Month if remote.month == month => remote.spend.month_micros,
                _ => 0,
            };
            let local_spent: u64 = entries
                .iter()
                .filter(|e| rule.period.index_of(e.started_ms) == rule.period.index_of(now_ms))
                .map(|e| e.micros)
                .sum();
            if remote_spent.saturating_add(local_spent) >= limit {
                return Err(Refusal::Spent {
                    limit_micros: limit,
                    period: rule.period,
                    retry_after: until(rule.period.end_ms(now_ms), now_ms),
                });
            }
        }
        if let Some(rpm) = rule.requests_per_minute {
            let remote_count = if remote.spend.minute == minute {
                remote.spend.minute_requests
            } else {
                0
            };
            let local_count = entries
                .iter()
                .filter(|e| minute_of(e.started_ms) == minute)
                .count();
            let used = u64::from(remote_count) + local_count as u64;
            if used >= u64::from(rpm) {
                return Err(Refusal::Rate {
                    rpm,
                    retry_after: until((minute + 1) * MINUTE_MS, now_ms),
                });
            }
        }

        l.local.entry(user.to_owned()).or_default().push(Entry {
            request_id: request_id.to_owned(),
            started_ms: now_ms,
            micros: estimate_micros,
            state: EntryState::InFlight,
        });
        Ok(Some(Reservation {
            budgets: self.clone(),
            user: user.to_owned(),
            request_id: request_id.to_owned(),
            reserved: estimate_micros,
            settled: false,
        }))
    }

    fn settle(&self, user: &str, request_id: &str, micros: u64) {
        let mut l = self.lock();
        if let Some(e) = l
            .local
            .get_mut(user)
            .and_then(|es| es.iter_mut().find(|e| e.request_id == request_id))
            && e.state == EntryState::InFlight
        {
            e.micros = micros;
            e.state = EntryState::Settled;
        }
    }

    /// The controlplane stored these `(user, request id)` records; their spend is in the feed
    /// from position `(epoch, seq)` on.
    pub fn delivered<'a>(
        &self,
        records: impl IntoIterator<Item = (&'a str, &'a str)>,
        epoch: u64,
        seq: u64,
    ) {
        let mut l = self.lock();
        for (user, request_id) in records {
            if let Some(e) = l
                .local
                .get_mut(user)
                .and_then(|es| es.iter_mut().find(|e| e.request_id == request_id))
            {
                e.state = EntryState::Delivered { epoch, seq };
            }
        }
        retire(&mut l);
    }

    /// Applies one feed message.
    pub fn apply_feed(&self, feed: Feed) {
        let mut l = self.lock();
        if feed.full {
            l.default = feed.default;
            l.overrides = feed.overrides.into_iter().collect();
            l.remote.clear();
            // A new epoch's full state was loaded from the database: it includes everything the
            // controlplane acknowledged before, whatever position it was acknowledged at.
            if feed.epoch != l.epoch {
                for es in l.local.values_mut() {
                    es.retain(|e| !matches!(e.state, EntryState::Delivered { .. }));
                }
            }
        }
        let (day, month) = (feed.day, feed.month);
        for (user, spend) in feed.spend {
            l.remote.insert(user, Remote { spend, day, month });
        }
        l.epoch = feed.epoch;
        l.seq = feed.seq;
        l.month = month;
        l.synced = true;
        retire(&mut l);
    }

    /// Rules in force: the default (if any) and the overrides.
    pub fn rules(&self) -> usize {
        let l = self.lock();
        usize::from(l.default.is_some()) + l.overrides.len()
    }

    /// Entries counted toward a user right now (for tests and diagnostics).
    pub fn local_entries(&self, user: &str) -> usize {
        self.lock().local.get(user).map_or(0, Vec::len)
    }
}

/// Drops delivered entries the feed has caught up with, and entries of past months (their
/// record never made it; they no longer count toward any period).
fn retire(l: &mut Ledger) {
    let (epoch, seq, month) = (l.epoch, l.seq, l.month);
    l.local.retain(|_, es| {
        es.retain(|e| match e.state {
            EntryState::Delivered { epoch: ep, seq: s } => !(ep == epoch && s <= seq),
            _ => month_of_day(day_of(e.started_ms)) >= month,
        });
        !es.is_empty()
    });
}

fn until(end_ms: i64, now_ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(end_ms - now_ms).unwrap_or(0).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use nm_types::budget::{DAY_MS, day_from_civil};

    const NOW: i64 = 20_779 * DAY_MS + 12 * 3_600_000;

    fn budgets(rule: BudgetRule) -> Budgets {
        let b = Budgets::default();
        b.apply_feed(Feed {
            epoch: 7,
            seq: 0,
            full: true,
            default: Some(rule),
            day: day_of(NOW),
            month: month_of_day(day_of(NOW)),
            ..Default::default()
        });
        b
    }

    fn dollars(limit: u64) -> BudgetRule {
        BudgetRule {
            limit_micros: Some(limit),
            period: Period::Day,
            requests_per_minute: None,
        }
    }

    #[test]
    fn nothing_is_admitted_before_the_first_feed() {
        assert_eq!(
            Budgets::default().admit("u", "r", 1, NOW).err(),
            Some(Refusal::NotLoaded)
        );
    }

    #[test]
    fn concurrent_reservations_overshoot_by_at_most_one() {
        let b = budgets(dollars(1_000));
        let mut held = Vec::new();
        let mut refused = 0;
        for i in 0..50 {
            match b.admit("u", &format!("r{i}"), 300, NOW) {
                Ok(Some(r)) => held.push(r),
                Ok(None) => panic!("a budget applies"),
                Err(Refusal::Spent { retry_after, .. }) => {
                    assert_eq!(retry_after, Duration::from_millis(12 * 3_600_000));
                    refused += 1;
                }
                Err(other) => panic!("{other:?}"),
            }
        }
        // 0, 300, 600, 900 are below 1000: four admitted, 1200 reserved (one reservation over).
        assert_eq!((held.len(), refused), (4, 46));
        // Answers that cost less free the rest for others.
        for r in held {
            r.settle(100);
        }
        assert!(b.admit("u", "next", 300, NOW).is_ok());
        // Another user is untouched.
        assert!(b.admit("v", "x", 300, NOW).is_ok());
    }

    #[test]
    fn delivered_spend_moves_from_the_ledger_to_the_feed() {
        let b = budgets(dollars(1_000));
        b.admit("u", "r1", 600, NOW).unwrap().unwrap().settle(700);
        b.delivered([("u", "r1")], 7, 3);
        assert_eq!(b.local_entries("u"), 1, "feed not caught up yet");
        assert!(b.admit("u", "r2", 1, NOW).is_ok());
        b.apply_feed(Feed {
            epoch: 7,
            seq: 3,
            spend: vec![(
                "u".to_owned(),
                RemoteSpend {
                    day_micros: 1_000,
                    month_micros: 1_000,
                    ..Default::default()
                },
            )],
            day: day_of(NOW),
            month: month_of_day(day_of(NOW)),
            ..Default::default()
        });
        assert_eq!(b.local_entries("u"), 1, "r1 retired, r2 still in flight");
        assert!(matches!(
            b.admit("u", "r3", 1, NOW),
            Err(Refusal::Spent { .. })
        ));
        // The next day starts from zero.
        let tomorrow = day_from_civil(2026, 11, 23) * DAY_MS;
        assert!(b.admit("u", "r4", 1, tomorrow).is_ok());
    }

    #[test]
    fn a_new_epoch_full_state_covers_everything_acknowledged() {
        let b = budgets(dollars(1_000));
        b.admit("u", "r1", 10, NOW).unwrap().unwrap().settle(10);
        b.delivered([("u", "r1")], 7, 99);
        b.apply_feed(Feed {
            epoch: 8,
            seq: 0,
            full: true,
            default: Some(dollars(1_000)),
            day: day_of(NOW),
            month: month_of_day(day_of(NOW)),
            ..Default::default()
        });
        assert_eq!(b.local_entries("u"), 0);
    }

    #[test]
    fn requests_per_minute() {
        let b = budgets(BudgetRule {
            limit_micros: None,
            period: Period::Day,
            requests_per_minute: Some(2),
        });
        assert!(b.admit("u", "1", 0, NOW).is_ok());
        assert!(b.admit("u", "2", 0, NOW + 10).is_ok());
        assert!(matches!(
            b.admit("u", "3", 0, NOW + 20),
            Err(Refusal::Rate { rpm: 2, .. })
        ));
        assert!(b.admit("u", "4", 0, NOW + MINUTE_MS).is_ok());
    }

    #[test]
    fn overrides_replace_the_default_and_no_rule_means_no_budget() {
        let b = Budgets::default();
        b.apply_feed(Feed {
            epoch: 1,
            full: true,
            overrides: vec![("vip".to_owned(), dollars(5))],
            day: day_of(NOW),
            month: month_of_day(day_of(NOW)),
            ..Default::default()
        });
        assert!(matches!(b.admit("anyone", "r", 1_000_000, NOW), Ok(None)));
        assert!(matches!(b.admit("vip", "r", 10, NOW), Ok(Some(_))));
    }
}
