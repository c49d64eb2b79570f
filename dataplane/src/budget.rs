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
//!
//! Across dataplanes, the feed arrives too late to stop a burst spread over several of them, so
//! a request must also fit this dataplane's **lease** of the budget (see
//! `nm_types::budget::grant` and docs/budgets.md): per end user and period, the spend (and per
//! minute, the requests) the controlplane let this dataplane add. A request is admitted while
//! the unused lease is positive and takes its reservation from it; the answer's settlement gives
//! back what it did not use. [`Budgets::lease_request`] builds the report a background task sends
//! about once a second (and at once when a lease runs out, [`Budgets::wait_for_lease`]), and
//! [`Budgets::apply_grants`] adds what was granted. A lease not renewed within its time to live
//! is not spent any more: a dataplane cut off from its controlplane spends at most what it held.

use foldhash::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nm_types::budget::{
    BudgetRule, LeaseClaim, LeaseKey, LeaseRequest, LeaseResponse, MINUTE_MS, Period, day_of,
    minute_of, month_of_day,
};
pub use nm_types::budget::{Feed, LeaseUnit, Spend};

/// A lease unused this long goes back to the controlplane.
const LEASE_IDLE_MS: i64 = 3_000;
/// A lease is renewed once less than this many of its latest reservations are left (or less
/// than was taken since the last round).
const LEASE_LOW_WATER: u64 = 2;
/// What a dataplane asks for at once: this many of its latest reservations, or twice what was
/// taken since the last round.
const LEASE_ASK: u64 = 4;

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
    /// What this dataplane holds of the budget is used up: the rest is spent or leased to
    /// other dataplanes. Wait for a lease round ([`Budgets::wait_for_lease`]) and ask again.
    NoLease {
        unit: LeaseUnit,
        rule: BudgetRule,
        retry_after: Duration,
    },
    /// This dataplane's leases expired: no lease round was answered for their time to live (or
    /// none yet). Wait for a round ([`Budgets::wait_for_lease`]) and ask again; if it still
    /// stands, the controlplane is unreachable.
    LeaseExpired,
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

/// This dataplane's lease of one end user's budget in one period.
#[derive(Debug, Clone, Copy)]
struct Slot {
    period: i64,
    /// Lease left to admit from; below zero by at most one reservation.
    unused: i64,
    /// The latest reservation (what to ask for).
    last_reservation: u64,
    /// Taken since the last report (the pace to ask for).
    taken: u64,
    last_used_ms: i64,
}

impl Slot {
    fn new(period: i64, reservation: u64, now_ms: i64) -> Self {
        Slot {
            period,
            unused: 0,
            last_reservation: reservation.max(1),
            taken: 0,
            last_used_ms: now_ms,
        }
    }
}

/// One end user's leases: of the spend limit and of the request rate.
#[derive(Debug, Default, Clone, Copy)]
struct UserLeases {
    micros: Option<Slot>,
    requests: Option<Slot>,
}

#[derive(Debug, Default)]
struct Ledger {
    synced: bool,
    leases: HashMap<String, UserLeases>,
    /// Leases are spent only before this (Unix ms): the send time of the last answered report
    /// plus the lease time to live.
    lease_valid_until_ms: i64,
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
#[derive(Debug, Clone)]
pub struct Budgets {
    ledger: Arc<Mutex<Ledger>>,
    leasing: Arc<Leasing>,
}

/// The lease rounds: who asks for one now, and which have ended.
#[derive(Debug)]
struct Leasing {
    instance: u64,
    /// Woken when a lease ran out.
    needed: tokio::sync::Notify,
    /// Rounds started.
    started: AtomicU64,
    /// The number of the last round that ended.
    ended: tokio::sync::watch::Sender<u64>,
}

impl Default for Budgets {
    fn default() -> Self {
        Budgets {
            ledger: Arc::default(),
            leasing: Arc::new(Leasing {
                instance: rand::random::<u64>() | 1,
                needed: tokio::sync::Notify::new(),
                started: AtomicU64::new(0),
                ended: tokio::sync::watch::channel(0).0,
            }),
        }
    }
}

/// An admitted request's hold on its user's budget. Settle it with what the request counts;
/// dropping it unsettled counts the reservation.
#[derive(Debug)]
pub struct Reservation {
    budgets: Budgets,
    user: String,
    request_id: String,
    reserved: u64,
    /// The spend lease's period the reservation was taken from.
    lease_period: Option<i64>,
    settled: bool,
}

impl Reservation {
    pub fn reserved_micros(&self) -> u64 {
        self.reserved
    }

    /// Replaces the reservation with what the request counts against the budget.
    pub fn settle(mut self, micros: u64) {
        self.settled = true;
        self.budgets.settle(
            &self.user,
            &self.request_id,
            micros,
            self.reserved,
            self.lease_period,
        );
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            self.budgets.settle(
                &self.user,
                &self.request_id,
                self.reserved,
                self.reserved,
                self.lease_period,
            );
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
        let lease_period = take_leases(&mut l, user, rule, estimate_micros, now_ms)?;

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
            lease_period,
            settled: false,
        }))
    }

    fn settle(
        &self,
        user: &str,
        request_id: &str,
        micros: u64,
        reserved: u64,
        lease_period: Option<i64>,
    ) {
        let mut l = self.lock();
        // What the request did not use goes back to the lease (what it used past its
        // reservation comes out of it).
        if let Some(slot) = l
            .leases
            .get_mut(user)
            .and_then(|u| u.micros.as_mut())
            .filter(|s| Some(s.period) == lease_period)
        {
            slot.unused = slot
                .unused
                .saturating_add(i64::try_from(reserved).unwrap_or(i64::MAX))
                .saturating_sub(i64::try_from(micros).unwrap_or(i64::MAX));
        }
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

    /// This dataplane's report for the next lease round: every end user's claim (admitted
    /// spend not in the feed yet, plus the unused lease) and what more to ask for. Returns the
    /// report; idle leases are given back and forgotten leases dropped first.
    pub fn lease_request(&self, dataplane: &str, now_ms: i64) -> LeaseRequest {
        self.leasing.started.fetch_add(1, Ordering::SeqCst);
        let mut l = self.lock();
        let l = &mut *l;
        // Unanswered for the time to live: the controlplane has taken back what was unused, so
        // it must not be claimed (or spent) again.
        let expired = l.lease_valid_until_ms != 0 && l.lease_valid_until_ms <= now_ms;
        let mut claims = Vec::new();
        l.leases.retain(|user, leases| {
            let rule = l.overrides.get(user).or(l.default.as_ref());
            let totals = l.local.get(user).map(|u| &u.totals);
            for (slot, unit) in [
                (&mut leases.micros, LeaseUnit::Micros),
                (&mut leases.requests, LeaseUnit::Requests),
            ] {
                let Some(s) = slot else { continue };
                let current = match (unit, rule) {
                    (LeaseUnit::Micros, Some(r)) if r.limit_micros.is_some() => {
                        Some(r.period.index_of(now_ms))
                    }
                    (LeaseUnit::Requests, Some(r)) if r.requests_per_minute.is_some() => {
                        Some(minute_of(now_ms))
                    }
                    _ => None,
                };
                // The rule is gone or the period is over: the lease means nothing now.
                if current != Some(s.period) {
                    *slot = None;
                    continue;
                }
                let idle = now_ms - s.last_used_ms >= LEASE_IDLE_MS;
                if idle || expired {
                    s.unused = s.unused.min(0);
                }
                let unrecorded = match (unit, rule) {
                    (LeaseUnit::Micros, Some(r)) => totals.map_or(0, |t| t.spent(r.period, now_ms)),
                    _ => totals.map_or(0, |t| u64::from(t.started_in(s.period))),
                };
                let unused = u64::try_from(s.unused).unwrap_or(0);
                let claim = unrecorded.saturating_add(unused);
                // Enough for two rounds at the pace of the last one, and a few requests at least.
                let pace = std::mem::take(&mut s.taken);
                let low = (LEASE_LOW_WATER * s.last_reservation).max(pace);
                let want = if !idle && unused < low {
                    (LEASE_ASK * s.last_reservation).max(pace.saturating_mul(2))
                } else {
                    0
                };
                if claim == 0 && want == 0 {
                    *slot = None;
                    continue;
                }
                claims.push(LeaseClaim {
                    key: LeaseKey {
                        user: user.clone(),
                        unit,
                        period: s.period,
                    },
                    claim,
                    want,
                });
            }
            leases.micros.is_some() || leases.requests.is_some()
        });
        LeaseRequest {
            dataplane: dataplane.to_owned(),
            instance: self.leasing.instance,
            claims,
        }
    }

    /// Adds what a round granted (`request` is the report sent at `sent_ms`), and keeps the
    /// leases spendable for the answer's time to live from then.
    pub fn apply_grants(&self, request: &LeaseRequest, response: &LeaseResponse, sent_ms: i64) {
        let mut l = self.lock();
        for (claim, granted) in request.claims.iter().zip(&response.granted) {
            if *granted == 0 {
                continue;
            }
            let slot = l
                .leases
                .get_mut(&claim.key.user)
                .and_then(|u| match claim.key.unit {
                    LeaseUnit::Micros => u.micros.as_mut(),
                    LeaseUnit::Requests => u.requests.as_mut(),
                });
            if let Some(s) = slot.filter(|s| s.period == claim.key.period) {
                s.unused = s
                    .unused
                    .saturating_add(i64::try_from(*granted).unwrap_or(i64::MAX));
            }
        }
        l.lease_valid_until_ms =
            sent_ms.saturating_add(i64::try_from(response.ttl_ms).unwrap_or(i64::MAX));
    }

    /// Ends a lease round (answered or not): wakes the requests waiting for it.
    pub fn round_ended(&self, round: u64) {
        self.leasing.ended.send_replace(round);
    }

    /// The number of the round [`Self::lease_request`] last started.
    pub fn round_started(&self) -> u64 {
        self.leasing.started.load(Ordering::SeqCst)
    }

    /// Resolves when a lease is needed at once (a request found its lease used up).
    pub async fn lease_needed(&self) {
        self.leasing.needed.notified().await;
    }

    /// Asks for a lease round at once and waits (at most `wait`) until one that started after
    /// this call has ended.
    pub async fn wait_for_lease(&self, wait: Duration) {
        let target = self.leasing.started.load(Ordering::SeqCst) + 1;
        let mut ended = self.leasing.ended.subscribe();
        self.leasing.needed.notify_one();
        let _ = tokio::time::timeout(wait, ended.wait_for(|r| *r >= target)).await;
    }

    /// [`Self::admit`], with a lease round that grants whatever is asked when the lease is used
    /// up: one dataplane alone, for tests of everything but the leases.
    #[cfg(test)]
    pub(crate) fn admit_leased(
        &self,
        user: &str,
        request_id: &str,
        estimate_micros: u64,
        now_ms: i64,
    ) -> Result<Option<Reservation>, Refusal> {
        match self.admit(user, request_id, estimate_micros, now_ms) {
            Err(Refusal::NoLease { .. } | Refusal::LeaseExpired) => {
                let req = self.lease_request("test", now_ms);
                let granted = req.claims.iter().map(|c| c.want.max(1) * 1_000).collect();
                let resp = LeaseResponse {
                    granted,
                    ttl_ms: 40 * 86_400_000,
                };
                self.apply_grants(&req, &resp, now_ms);
                self.admit(user, request_id, estimate_micros, now_ms)
            }
            other => other,
        }
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

/// Takes the request's reservation from the user's spend lease and one request from their
/// rate lease, or refuses when either is used up; the spend lease's period when one was taken.
fn take_leases(
    l: &mut Ledger,
    user: &str,
    rule: BudgetRule,
    estimate_micros: u64,
    now_ms: i64,
) -> Result<Option<i64>, Refusal> {
    if rule.limit_micros.is_none() && rule.requests_per_minute.is_none() {
        return Ok(None);
    }
    // Unanswered for the time to live (or never answered): what is held may have been taken
    // back, so nothing is spent before the next answered round.
    let expired = l.lease_valid_until_ms <= now_ms;
    let leases = match l.leases.get_mut(user) {
        Some(u) => u,
        None => l.leases.entry(user.to_owned()).or_default(),
    };
    let micros_period = rule.period.index_of(now_ms);
    let minute = minute_of(now_ms);
    let mut short = None;
    if rule.limit_micros.is_some() {
        let s = leases
            .micros
            .get_or_insert_with(|| Slot::new(micros_period, estimate_micros, now_ms));
        if s.period != micros_period {
            *s = Slot::new(micros_period, estimate_micros, now_ms);
        }
        s.last_reservation = estimate_micros.max(1);
        s.last_used_ms = now_ms;
        if s.unused <= 0 {
            short = Some((LeaseUnit::Micros, rule.period.end_ms(now_ms)));
        }
    }
    if rule.requests_per_minute.is_some() {
        let s = leases
            .requests
            .get_or_insert_with(|| Slot::new(minute, 1, now_ms));
        if s.period != minute {
            *s = Slot::new(minute, 1, now_ms);
        }
        s.last_used_ms = now_ms;
        if s.unused <= 0 && short.is_none() {
            short = Some((LeaseUnit::Requests, (minute + 1) * MINUTE_MS));
        }
    }
    if expired {
        return Err(Refusal::LeaseExpired);
    }
    if let Some((unit, end_ms)) = short {
        // Others may give theirs back when idle: worth a retry before the period ends.
        let retry = until(end_ms, now_ms).min(Duration::from_millis(2 * LEASE_IDLE_MS as u64));
        return Err(Refusal::NoLease {
            unit,
            rule,
            retry_after: retry,
        });
    }
    let mut taken = None;
    if let Some(s) = leases
        .micros
        .as_mut()
        .filter(|_| rule.limit_micros.is_some())
    {
        s.unused = s
            .unused
            .saturating_sub(i64::try_from(estimate_micros).unwrap_or(i64::MAX));
        s.taken = s.taken.saturating_add(estimate_micros);
        taken = Some(s.period);
    }
    if let Some(s) = leases
        .requests
        .as_mut()
        .filter(|_| rule.requests_per_minute.is_some())
    {
        s.unused -= 1;
        s.taken += 1;
    }
    Ok(taken)
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
            match b.admit_leased("u", &format!("r{i}"), 300, NOW) {
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
        assert!(b.admit_leased("u", "next", 300, NOW).is_ok());
        // Another user is untouched.
        assert!(b.admit_leased("v", "x", 300, NOW).is_ok());
    }

    #[test]
    fn delivered_spend_moves_from_the_ledger_to_the_feed() {
        let b = budgets(dollars(1_000));
        b.admit_leased("u", "r1", 600, NOW)
            .unwrap()
            .unwrap()
            .settle(700);
        b.delivered([("u", "r1")], 7, 3);
        assert_eq!(b.local_entries("u"), 1, "feed not caught up yet");
        assert!(b.admit_leased("u", "r2", 1, NOW).is_ok());
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
            b.admit_leased("u", "r3", 1, NOW),
            Err(Refusal::Spent { .. })
        ));
        // The next day starts from zero.
        let tomorrow = day_from_civil(2026, 11, 23) * DAY_MS;
        assert!(b.admit_leased("u", "r4", 1, tomorrow).is_ok());
    }

    #[test]
    fn a_new_epoch_full_state_covers_everything_acknowledged() {
        let b = budgets(dollars(1_000));
        b.admit_leased("u", "r1", 10, NOW)
            .unwrap()
            .unwrap()
            .settle(10);
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
        assert!(b.admit_leased("u", "1", 0, NOW).is_ok());
        assert!(b.admit_leased("u", "2", 0, NOW + 10).is_ok());
        assert!(matches!(
            b.admit_leased("u", "3", 0, NOW + 20),
            Err(Refusal::Rate { rpm: 2, .. })
        ));
        assert!(b.admit_leased("u", "4", 0, NOW + MINUTE_MS).is_ok());
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
        assert!(matches!(
            b.admit_leased("anyone", "r", 1_000_000, NOW),
            Ok(None)
        ));
        assert!(matches!(b.admit_leased("vip", "r", 10, NOW), Ok(Some(_))));
    }

    /// A lease round whose controlplane grants `amounts` in turn (the rest nothing).
    fn round(b: &Budgets, now: i64, amounts: &[u64]) -> LeaseRequest {
        let req = b.lease_request("test", now);
        let granted = (0..req.claims.len())
            .map(|i| amounts.get(i).copied().unwrap_or(0))
            .collect();
        b.apply_grants(
            &req,
            &LeaseResponse {
                granted,
                ttl_ms: 5_000,
            },
            now,
        );
        req
    }

    #[test]
    fn a_lease_admits_while_unused_and_asks_for_more_when_low() {
        let b = budgets(dollars(1_000_000));
        // No lease round answered yet: refused, and the next round asks for four reservations.
        assert_eq!(
            b.admit("u", "r0", 300, NOW).err(),
            Some(Refusal::LeaseExpired)
        );
        let req = round(&b, NOW, &[700]);
        assert_eq!(req.claims.len(), 1);
        assert_eq!(
            (req.claims[0].claim, req.claims[0].want),
            (0, LEASE_ASK * 300)
        );
        assert_eq!(req.claims[0].key.period, day_of(NOW));
        // 700 leased: 300 and 300 fit, the third goes past by one reservation, then none.
        let held: Vec<_> = (1..=3)
            .map(|i| b.admit("u", &format!("r{i}"), 300, NOW).unwrap().unwrap())
            .collect();
        assert!(matches!(
            b.admit("u", "r4", 300, NOW),
            Err(Refusal::NoLease { .. })
        ));
        // The claim: 900 admitted and not in the feed, nothing unused; it asks for twice the
        // 900 taken since the last round.
        let req = round(&b, NOW + 1, &[]);
        assert_eq!((req.claims[0].claim, req.claims[0].want), (900, 1_800));
        // Answers cheaper than reserved give the difference back to the lease.
        for r in held {
            r.settle(100);
        }
        assert!(b.admit("u", "r5", 300, NOW + 2).is_ok());
        let req = round(&b, NOW + 3, &[]);
        // 300 + 3 x 100 admitted; 700 - 900 + 600 - 300 = 100 unused.
        assert_eq!(req.claims[0].claim, 600 + 100);
    }

    #[test]
    fn an_idle_lease_goes_back_and_an_unanswered_one_expires() {
        let b = budgets(dollars(1_000_000));
        let _ = b.admit("u", "r0", 300, NOW);
        round(&b, NOW, &[10_000]);
        b.admit("u", "r1", 300, NOW).unwrap().unwrap().settle(300);
        // Idle for LEASE_IDLE_MS: the unused lease is not claimed any more, only the spend the
        // feed has not counted yet.
        let req = round(&b, NOW + LEASE_IDLE_MS, &[]);
        assert_eq!((req.claims[0].claim, req.claims[0].want), (300, 0));
        // Once the feed has it, nothing is left to claim: the lease is dropped.
        b.delivered([("u", "r1")], 7, 1);
        b.apply_feed(Feed {
            epoch: 7,
            seq: 1,
            day: day_of(NOW),
            month: month_of_day(day_of(NOW)),
            ..Default::default()
        });
        assert!(round(&b, NOW + LEASE_IDLE_MS, &[]).claims.is_empty());

        // A fresh lease, then the controlplane stops answering: spendable until its time to
        // live from the last answered round, then refused as expired (503, not 429).
        let _ = b.admit("u", "r2", 300, NOW);
        round(&b, NOW, &[10_000]);
        assert!(b.admit("u", "r3", 300, NOW + 4_999).is_ok());
        assert_eq!(
            b.admit("u", "r4", 300, NOW + 5_000).err(),
            Some(Refusal::LeaseExpired)
        );
        // Its next report claims no unused lease (the controlplane took it back).
        let req = b.lease_request("test", NOW + 5_000);
        assert_eq!(req.claims[0].claim, 300);
    }

    #[test]
    fn a_rate_lease_counts_requests_per_minute() {
        let b = budgets(BudgetRule {
            limit_micros: None,
            period: Period::Day,
            requests_per_minute: Some(100),
        });
        assert_eq!(
            b.admit("u", "r0", 0, NOW).err(),
            Some(Refusal::LeaseExpired)
        );
        let req = round(&b, NOW, &[2]);
        assert_eq!(req.claims[0].key.unit, LeaseUnit::Requests);
        assert_eq!(req.claims[0].key.period, minute_of(NOW));
        assert!(b.admit("u", "r1", 0, NOW).is_ok());
        assert!(b.admit("u", "r2", 0, NOW).is_ok());
        assert!(matches!(
            b.admit("u", "r3", 0, NOW),
            Err(Refusal::NoLease {
                unit: LeaseUnit::Requests,
                ..
            })
        ));
        // The next minute starts a new lease.
        let next = (minute_of(NOW) + 1) * MINUTE_MS;
        // (A round answered meanwhile keeps the leases spendable.)
        round(&b, next - 1_000, &[]);
        assert!(matches!(
            b.admit("u", "r4", 0, next),
            Err(Refusal::NoLease { .. })
        ));
        let req = round(&b, next, &[1]);
        assert_eq!(req.claims.len(), 1, "the past minute's lease is dropped");
        assert!(b.admit("u", "r5", 0, next).is_ok());
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
                        if let Ok(Some(r)) = b.admit_leased("u", &format!("r{id}"), micros, at) {
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
