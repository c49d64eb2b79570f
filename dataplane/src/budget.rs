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

use foldhash::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nm_types::budget::{BudgetRule, MINUTE_MS, Period, day_of, minute_of, month_of_day};
pub use nm_types::budget::{Feed, Spend};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EntryState {
    InFlight,
    Settled,
    Delivered { epoch: u64, seq: u64 },
}

#[derive(Debug, Clone)]
struct Entry {
    started_ms: i64,
    micros: u64,
    state: EntryState,
}

/// Running totals over one end user's entries, by the period each entry started in: buckets of
/// `(period index, micros, entries)` — a handful at most, since entries live until the feed
/// catches up, a second or so.
#[derive(Debug, Default)]
struct Totals {
    days: Buckets,
    months: Buckets,
    /// Micros unused: only the entry count matters per minute.
    minutes: Buckets,
}

/// `(period index, micros, entries)`.
type Buckets = Vec<(i64, u64, u32)>;

impl Totals {
    fn buckets(&mut self, e: &Entry) -> [(&mut Buckets, i64); 3] {
        [
            (&mut self.days, Period::Day.index_of(e.started_ms)),
            (&mut self.months, Period::Month.index_of(e.started_ms)),
            (&mut self.minutes, minute_of(e.started_ms)),
        ]
    }

    fn add(&mut self, e: &Entry) {
        for (buckets, key) in self.buckets(e) {
            match buckets.iter_mut().find(|(k, _, _)| *k == key) {
                Some((_, sum, n)) => {
                    *sum = sum.saturating_add(e.micros);
                    *n += 1;
                }
                None => buckets.push((key, e.micros, 1)),
            }
        }
    }

    fn remove(&mut self, e: &Entry) {
        for (buckets, key) in self.buckets(e) {
            if let Some(i) = buckets.iter().position(|(k, _, _)| *k == key) {
                let (_, sum, n) = &mut buckets[i];
                *sum = sum.saturating_sub(e.micros);
                *n -= 1;
                if *n == 0 {
                    buckets.swap_remove(i);
                }
            }
        }
    }

    fn bucket(buckets: &[(i64, u64, u32)], key: i64) -> (u64, u32) {
        buckets
            .iter()
            .find(|(k, _, _)| *k == key)
            .map_or((0, 0), |(_, micros, n)| (*micros, *n))
    }

    /// Micros of the entries started in `period`'s period containing `now_ms`.
    fn spent(&self, period: Period, now_ms: i64) -> u64 {
        let buckets = match period {
            Period::Day => &self.days,
            Period::Month => &self.months,
        };
        Self::bucket(buckets, period.index_of(now_ms)).0
    }

    /// Entries started in the minute `minute`.
    fn started_in(&self, minute: i64) -> u32 {
        Self::bucket(&self.minutes, minute).1
    }
}

/// One end user's local entries, by request id, with their running totals, so admitting,
/// settling and retiring a request cost the same however many a user has in flight.
#[derive(Debug, Default)]
struct UserLedger {
    entries: HashMap<String, Entry>,
    totals: Totals,
}

impl UserLedger {
    fn insert(&mut self, request_id: &str, entry: Entry) {
        self.totals.add(&entry);
        if let Some(old) = self.entries.insert(request_id.to_owned(), entry) {
            self.totals.remove(&old);
        }
    }

    /// Keeps the entries `keep` says to, keeping the totals right.
    fn retain(&mut self, mut keep: impl FnMut(&Entry) -> bool) {
        let UserLedger { entries, totals } = self;
        entries.retain(|_, e| {
            let kept = keep(e);
            if !kept {
                totals.remove(e);
            }
            kept
        });
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Remote {
    spend: Spend,
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
    local: HashMap<String, UserLedger>,
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
        let totals = l.local.get(user).map(|u| &u.totals);

        if let Some(limit) = rule.limit_micros {
            let remote_spent = match rule.period {
                Period::Day if remote.day == day => remote.spend.day_micros,
                Period::Month if remote.month == month => remote.spend.month_micros,
                _ => 0,
            };
            let local_spent = totals.map_or(0, |t| t.spent(rule.period, now_ms));
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
            let local_count = totals.map_or(0, |t| t.started_in(minute));
            let used = u64::from(remote_count) + u64::from(local_count);
            if used >= u64::from(rpm) {
                return Err(Refusal::Rate {
                    rpm,
                    retry_after: until((minute + 1) * MINUTE_MS, now_ms),
                });
            }
        }

        let entry = Entry {
            started_ms: now_ms,
            micros: estimate_micros,
            state: EntryState::InFlight,
        };
        match l.local.get_mut(user) {
            Some(u) => u.insert(request_id, entry),
            None => {
                let mut u = UserLedger::default();
                u.insert(request_id, entry);
                l.local.insert(user.to_owned(), u);
            }
        }
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
        let Some(u) = l.local.get_mut(user) else {
            return;
        };
        if let Some(e) = u.entries.get_mut(request_id)
            && e.state == EntryState::InFlight
        {
            u.totals.remove(e);
            e.micros = micros;
            e.state = EntryState::Settled;
            u.totals.add(e);
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
                .and_then(|u| u.entries.get_mut(request_id))
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
                for u in l.local.values_mut() {
                    u.retain(|e| !matches!(e.state, EntryState::Delivered { .. }));
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
        self.lock().local.get(user).map_or(0, |u| u.entries.len())
    }
}

/// Drops delivered entries the feed has caught up with, and entries of past months (their
/// record never made it; they no longer count toward any period).
fn retire(l: &mut Ledger) {
    let (epoch, seq, month) = (l.epoch, l.seq, l.month);
    l.local.retain(|_, u| {
        u.retain(|e| match e.state {
            EntryState::Delivered { epoch: ep, seq: s } => !(ep == epoch && s <= seq),
            _ => month_of_day(day_of(e.started_ms)) >= month,
        });
        !u.entries.is_empty()
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
                Spend {
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

    proptest::proptest! {
        /// The running totals always equal a sum over the entries, whatever the order of
        /// admits, settlements, deliveries and retirements, across minute and day boundaries.
        #[test]
        fn totals_match_the_entries(ops in proptest::collection::vec((0u8..4, 0u64..40, 0u64..1_000, 0i64..3), 1..200)) {
            let b = budgets(BudgetRule {
                limit_micros: Some(u64::MAX),
                period: Period::Day,
                requests_per_minute: None,
            });
            let mut held = Vec::new();
            let mut seq = 0;
            for (op, id, micros, step) in ops {
                // Times spread over three minutes on either side of a day boundary.
                let at = (day_of(NOW) + 1) * DAY_MS - MINUTE_MS + step * MINUTE_MS;
                match op {
                    0 => {
                        if let Ok(Some(r)) = b.admit("u", &format!("r{id}"), micros, at) {
                            held.push(r);
                        }
                    }
                    1 => {
                        if !held.is_empty() {
                            held.swap_remove(usize::try_from(id).unwrap() % held.len()).settle(micros);
                        }
                    }
                    2 => {
                        seq += 1;
                        b.delivered([("u", format!("r{id}").as_str())], 7, seq);
                    }
                    _ => b.apply_feed(Feed { epoch: 7, seq, day: day_of(at), month: month_of_day(day_of(at)), ..Default::default() }),
                }
                let l = b.lock();
                if let Some(u) = l.local.get("u") {
                    for t in [NOW, at, at + DAY_MS] {
                        for period in [Period::Day, Period::Month] {
                            let want: u64 = u.entries.values().filter(|e| period.index_of(e.started_ms) == period.index_of(t)).map(|e| e.micros).sum();
                            proptest::prop_assert_eq!(u.totals.spent(period, t), want);
                        }
                        let want = u.entries.values().filter(|e| minute_of(e.started_ms) == minute_of(t)).count();
                        proptest::prop_assert_eq!(u.totals.started_in(minute_of(t)) as usize, want);
                    }
                }
            }
        }
    }
}
