//! Budgets at every level, enforced before forwarding, from memory.
//!
//! A request passes every budget that applies to it: its key's (else the default for keys), its
//! key's labels', its agent's, its model's, its env's, and its end user's (else the default for
//! end users). Each budget has its own ledger, keyed by scope (kind and value); only scopes that
//! have a budget are looked up, by borrowed `&str`, so a request no budget applies to costs a
//! handful of empty-map probes and allocates nothing.
//!
//! The controlplane is the source of truth: it feeds each dataplane the budget rules and every
//! scope's spend in the current UTC day, week and month ([`Budgets::apply_feed`]). What the feed
//! cannot know yet is this dataplane's own recent traffic, so each admitted request leaves an
//! entry in a local ledger, counted toward each of its budgets' scopes:
//!
//! 1. **in flight**: it holds a reservation, an estimate of its cost from the request
//!    (`max_tokens` times the output price, plus the prompt) and of its tokens;
//! 2. **settled**: the answer ended; the entry now holds what the request actually counts
//!    (its cost and tokens when known, else its reservation);
//! 3. **delivered**: its record was stored by the controlplane, whose acknowledgement says at
//!    which feed position `(epoch, seq)` the spend is included;
//! 4. gone, once the feed reaches that position (the spend is now in the feed's numbers).
//!
//! A scope's spend is then the feed's number plus its local entries, and a request is admitted
//! while that is below each limit. Because every admitted request's reservation is counted
//! before the next request is checked, concurrent requests cannot overshoot a budget by more
//! than one request's reservation on one dataplane. Requests and tokens per minute are counted
//! the same way: the feed's count for the scope's latest minute plus the local entries started
//! in this minute.
//!
//! Both numbers are kept per limit of the budget in force, in a meter for the limit's current
//! period (`Meter`): made when the rules arrive, its feed number set when the spend arrives,
//! its local number changed by each admission, settlement and retirement. Admitting a request
//! is then a comparison and an addition per limit; a meter moves to the next period at its
//! scope's first request there (a request's time is never taken before the last admitted
//! one's, so nothing local counts in a new period yet).
//!
//! Across dataplanes, the feed arrives too late to stop a burst spread over several of them, so
//! a request must also fit this dataplane's **lease** of every budget (see
//! `nm_types::budget::grant` and docs/budgets.md): per scope, unit and period, what the
//! controlplane let this dataplane add. A request is admitted while every unused lease it needs
//! is positive and takes its reservation from each; the answer's settlement gives back what it
//! did not use. [`Budgets::lease_request`] builds the report a background task sends twice a
//! second (and at once when a lease runs out, [`Budgets::wait_for_lease`]), and
//! [`Budgets::apply_grants`] adds what was granted. A lease not renewed within its time to live
//! is not spent any more: a dataplane cut off from its controlplane spends at most what it held.

use foldhash::HashMap;
use smallvec::SmallVec;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use nm_types::budget::{
    BudgetRule, LeaseClaim, LeaseKey, LeaseRequest, LeaseResponse, MINUTE_MS, Period, Scope,
    ScopeKind, day_of, first_day_of_month, minute_of, month_of_day, week_of_day,
};
pub use nm_types::budget::{Feed, LeaseUnit, Spend};

/// A lease unused this long goes back to the controlplane.
const LEASE_IDLE_MS: i64 = 3_000;
/// A lease is renewed once less than this many of its latest reservations are left (or less
/// than was taken since the last round).
const LEASE_LOW_WATER: u64 = 2;
/// What a dataplane asks for at once: this many of its latest reservations, or twice what was
/// taken since the last round. Eight, not fewer: a budget of an end user taking a few requests a
/// round ran out before the next one often enough to double the rounds (each a call, and a
/// wait for the request that ran out).
const LEASE_ASK: u64 = 8;
const KINDS: usize = ScopeKind::ALL.len();
const UNITS: usize = LeaseUnit::ALL.len();

/// What a request is: the scopes budgets may name.
#[derive(Debug, Clone, Copy, Default)]
pub struct Who<'a> {
    pub key: &'a str,
    pub agent: Option<&'a str>,
    pub model: Option<&'a str>,
    pub env: Option<&'a str>,
    pub user: Option<&'a str>,
}

/// The budget that refused a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetName {
    pub scope: Scope,
    /// The default for keys or for end users (the scope has no budget of its own).
    pub default: bool,
}

/// The limit of a budget that refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    Usd(u64, Period),
    Tokens(u64, Period),
    Rpm(u32),
    Tpm(u64),
}

impl Limit {
    /// A requests- or tokens-per-minute limit (`rate_limited`), else a budget per period.
    pub fn is_rate(self) -> bool {
        matches!(self, Limit::Rpm(_) | Limit::Tpm(_))
    }

    fn of(unit: LeaseUnit, rule: &BudgetRule) -> Limit {
        match unit {
            LeaseUnit::Micros => Limit::Usd(rule.limit_micros.unwrap_or(0), rule.period),
            LeaseUnit::Tokens => Limit::Tokens(rule.limit_tokens.unwrap_or(0), rule.period),
            LeaseUnit::Requests => Limit::Rpm(rule.requests_per_minute.unwrap_or(0)),
            LeaseUnit::MinuteTokens => Limit::Tpm(rule.tokens_per_minute.unwrap_or(0)),
        }
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// A budget's limit is reached; retry when its period (or minute) ends.
    Over {
        budget: BudgetName,
        limit: Limit,
        retry_after: Duration,
    },
    /// What this dataplane holds of a budget is used up: the rest is spent or leased to other
    /// dataplanes. Wait for a lease round ([`Budgets::wait_for_lease`]) and ask again.
    NoLease {
        budget: BudgetName,
        limit: Limit,
        retry_after: Duration,
    },
    /// This dataplane's leases expired: no lease round was answered for their time to live (or
    /// none yet). Wait for a round ([`Budgets::wait_for_lease`]) and ask again; if it still
    /// stands, the controlplane is unreachable.
    LeaseExpired,
    /// No budget state has arrived from the controlplane yet.
    NotLoaded,
}

/// What a meter counts in: the day, week or month of a rule's period, or the minute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Span {
    Day = 0,
    Week = 1,
    Month = 2,
    Minute = 3,
}

impl Span {
    /// The span a limit in `unit` under a rule of `period` counts in.
    fn of(unit: LeaseUnit, period: Period) -> Span {
        match (unit.per_minute(), period) {
            (true, _) => Span::Minute,
            (false, Period::Day) => Span::Day,
            (false, Period::Week) => Span::Week,
            (false, Period::Month) => Span::Month,
        }
    }
}

/// The periods a moment falls in, by [`Span`]: its day, week, month and minute numbers,
/// computed once per request (a month needs calendar arithmetic).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Periods([i64; 4]);

impl Periods {
    fn of_day(day: i64, minute: i64) -> Self {
        Periods([day, week_of_day(day), month_of_day(day), minute])
    }

    fn of(&self, span: Span) -> i64 {
        self.0[span as usize]
    }

    fn index(&self, period: Period) -> i64 {
        self.of(Span::of(LeaseUnit::Micros, period))
    }

    fn month(&self) -> i64 {
        self.of(Span::Month)
    }

    fn week(&self) -> i64 {
        self.of(Span::Week)
    }

    fn with_minute(self, minute: i64) -> Self {
        let mut p = self;
        p.0[Span::Minute as usize] = minute;
        p
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EntryState {
    InFlight,
    Settled,
    Delivered { epoch: u64, seq: u64 },
}

/// A request's id as a ledger key: the text itself, the 36 bytes of the gateway's own ids (a
/// UUID's hyphenated form) held inline, so keeping and finding an entry parses nothing and copies
/// no string (any other text is kept as it is).
#[derive(Debug, Clone, PartialEq, Eq)]
enum EntryKey {
    Id([u8; 36]),
    Other(Box<str>),
}

impl EntryKey {
    fn of(request_id: &str) -> Self {
        match <[u8; 36]>::try_from(request_id.as_bytes()) {
            Ok(bytes) => EntryKey::Id(bytes),
            Err(_) => EntryKey::Other(request_id.into()),
        }
    }
}

impl std::hash::Hash for EntryKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        match self {
            // The last 16 characters of the gateway's ids (UUIDv7) are 62 random bits and a
            // dash: hashed as one number, they spread the ids as well as all 36 bytes would, in
            // one step of the hasher. Equal keys still compare every byte.
            EntryKey::Id(bytes) => {
                let mut tail = [0; 16];
                tail.copy_from_slice(&bytes[20..]);
                state.write_u128(u128::from_ne_bytes(tail));
            }
            EntryKey::Other(text) => text.hash(state),
        }
    }
}

/// One budget an entry counts toward: its scope, and the units it took a lease of (a bit per
/// unit).
#[derive(Debug, Clone, Copy)]
struct Counted {
    scope: u32,
    taken: u8,
}

#[derive(Debug, Clone)]
struct Entry {
    /// Its request's id (what an acknowledgement names).
    key: EntryKey,
    /// When it was admitted (the tests check `at` against it).
    #[cfg(test)]
    started_ms: i64,
    at: Periods,
    micros: u64,
    tokens: u64,
    state: EntryState,
    /// Inline up to six budgets (key, label, agent, model, env, end user): no allocation for
    /// a request that passes all five kinds of scope.
    scopes: SmallVec<[Counted; 6]>,
}

impl Entry {
    /// What it counts in each unit, by `LeaseUnit as usize`.
    fn amounts(&self) -> [u64; UNITS] {
        amounts(self.micros, self.tokens)
    }
}

/// Where an entry is: its slot, and the slot's generation when the entry was put there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct EntryRef {
    slot: u32,
    generation: u32,
}

/// One place for an entry.
#[derive(Debug, Default)]
struct Slot {
    /// Moves on each time the slot is emptied: a reference to an entry since retired or
    /// replaced finds another generation here, and nothing.
    generation: u32,
    entry: Option<Entry>,
}

/// The ledger's entries, in slots: a reservation refers to its entry by slot (its settlement
/// finds it without a lookup), a slot emptied is reused, and an index by request id finds the
/// entries an acknowledgement names. One entry per request id: a request admitted under the id
/// of an entry still held replaces it.
#[derive(Debug, Default)]
struct Entries {
    slots: Vec<Slot>,
    /// Empty slots.
    free: Vec<u32>,
    by_key: HashMap<EntryKey, u32>,
}

impl Entries {
    /// Puts `entry` in a slot; returns where, and the entry of the same request id it replaced.
    fn insert(&mut self, entry: Entry) -> (EntryRef, Option<Entry>) {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(Slot::default());
                u32::try_from(self.slots.len() - 1).unwrap_or(u32::MAX)
            }
        };
        let replaced = match self.by_key.entry(entry.key.clone()) {
            std::collections::hash_map::Entry::Occupied(mut o) => {
                let old = std::mem::replace(o.get_mut(), slot);
                Self::empty(&mut self.slots, &mut self.free, old)
            }
            std::collections::hash_map::Entry::Vacant(v) => {
                v.insert(slot);
                None
            }
        };
        let s = &mut self.slots[slot as usize];
        s.entry = Some(entry);
        let at = EntryRef {
            slot,
            generation: s.generation,
        };
        (at, replaced)
    }

    /// Takes the entry out of `slot` and frees it (the index is the caller's to update).
    fn empty(slots: &mut [Slot], free: &mut Vec<u32>, slot: u32) -> Option<Entry> {
        let s = slots.get_mut(slot as usize)?;
        let entry = s.entry.take()?;
        s.generation = s.generation.wrapping_add(1);
        free.push(slot);
        Some(entry)
    }

    fn get(&self, at: EntryRef) -> Option<&Entry> {
        self.slots
            .get(at.slot as usize)
            .filter(|s| s.generation == at.generation)
            .and_then(|s| s.entry.as_ref())
    }

    fn get_mut(&mut self, at: EntryRef) -> Option<&mut Entry> {
        self.slots
            .get_mut(at.slot as usize)
            .filter(|s| s.generation == at.generation)
            .and_then(|s| s.entry.as_mut())
    }

    /// The entry of a request id.
    fn find(&self, key: &EntryKey) -> Option<EntryRef> {
        let slot = *self.by_key.get(key)?;
        let generation = self.slots.get(slot as usize)?.generation;
        Some(EntryRef { slot, generation })
    }

    /// Takes the entry at `at` out of the ledger.
    fn remove(&mut self, at: EntryRef) -> Option<Entry> {
        self.get(at)?;
        let entry = Self::empty(&mut self.slots, &mut self.free, at.slot)?;
        self.by_key.remove(&entry.key);
        Some(entry)
    }

    /// Every entry, and where it is.
    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = (EntryRef, &Entry)> {
        self.slots.iter().zip(0u32..).filter_map(|(s, slot)| {
            let at = EntryRef {
                slot,
                generation: s.generation,
            };
            s.entry.as_ref().map(|e| (at, e))
        })
    }

    fn values(&self) -> impl Iterator<Item = &Entry> {
        self.slots.iter().filter_map(|s| s.entry.as_ref())
    }

    /// Keeps the entries `keep` returns true for; gives the others to `removed`.
    fn retain(&mut self, mut keep: impl FnMut(&Entry) -> bool, mut removed: impl FnMut(Entry)) {
        for slot in 0..self.slots.len() {
            if self.slots[slot].entry.as_ref().is_some_and(|e| !keep(e)) {
                let slot = u32::try_from(slot).unwrap_or(u32::MAX);
                if let Some(e) = Self::empty(&mut self.slots, &mut self.free, slot) {
                    self.by_key.remove(&e.key);
                    removed(e);
                }
            }
        }
    }
}

/// Values by name: while few, a list compared in turn (a name compared costs less than one
/// hashed: most deployments have a few agents, models, envs and keys with budgets); past that,
/// a hash map. A lookup by borrowed `&str` allocates nothing; a name is copied only when first
/// inserted.
#[derive(Debug)]
struct Names<T> {
    few: Vec<(Box<str>, T)>,
    many: HashMap<String, T>,
}

/// Names compared in turn at most.
const FEW_NAMES: usize = 8;

impl<T> Default for Names<T> {
    fn default() -> Self {
        Names {
            few: Vec::new(),
            many: HashMap::default(),
        }
    }
}

impl<T> Names<T> {
    fn get(&self, name: &str) -> Option<&T> {
        if self.many.is_empty() {
            let name = name.as_bytes();
            self.few
                .iter()
                .find(|(n, _)| same_name(n.as_bytes(), name))
                .map(|(_, v)| v)
        } else {
            self.many.get(name)
        }
    }

    fn insert(&mut self, name: &str, v: T) {
        if let Some(slot) = self.few.iter_mut().find(|(n, _)| **n == *name) {
            slot.1 = v;
        } else if self.many.is_empty() && self.few.len() < FEW_NAMES {
            self.few.push((name.into(), v));
        } else {
            self.many
                .extend(self.few.drain(..).map(|(n, v)| (n.into_string(), v)));
            self.many.insert(name.to_owned(), v);
        }
    }

    fn remove(&mut self, name: &str) {
        if let Some(i) = self.few.iter().position(|(n, _)| **n == *name) {
            self.few.swap_remove(i);
        } else {
            self.many.remove(name);
        }
    }
}

/// `a == b`, a name of 4 to 16 bytes (most agents, models, envs and key ids) compared as two
/// overlapping words, not through a call to `memcmp`: a few names are compared on every request.
fn same_name(a: &[u8], b: &[u8]) -> bool {
    fn word<const N: usize>(s: &[u8], at: usize) -> [u8; N] {
        s.get(at..at + N)
            .and_then(|w| <[u8; N]>::try_from(w).ok())
            .unwrap_or([0; N])
    }
    let n = a.len();
    if n != b.len() {
        return false;
    }
    match n {
        4..8 => {
            u32::from_ne_bytes(word(a, 0)) == u32::from_ne_bytes(word(b, 0))
                && u32::from_ne_bytes(word(a, n - 4)) == u32::from_ne_bytes(word(b, n - 4))
        }
        8..=16 => {
            u64::from_ne_bytes(word(a, 0)) == u64::from_ne_bytes(word(b, 0))
                && u64::from_ne_bytes(word(a, n - 8)) == u64::from_ne_bytes(word(b, n - 8))
        }
        _ => a == b,
    }
}

/// Per scope kind, values by name.
#[derive(Debug)]
struct ByScope<T>([Names<T>; KINDS]);

impl<T> Default for ByScope<T> {
    fn default() -> Self {
        ByScope(std::array::from_fn(|_| Names::default()))
    }
}

impl<T> ByScope<T> {
    fn get(&self, kind: ScopeKind, value: &str) -> Option<&T> {
        self.0[kind.index()].get(value)
    }

    fn insert(&mut self, kind: ScopeKind, value: &str, v: T) {
        self.0[kind.index()].insert(value, v);
    }

    fn remove(&mut self, kind: ScopeKind, value: &str) {
        self.0[kind.index()].remove(value);
    }
}

/// The feed's spend of one scope, and the periods of the feed's day.
#[derive(Debug, Clone, Copy, Default)]
struct Remote {
    spend: Spend,
    at: Periods,
}

impl Remote {
    /// What the feed counts in `unit` under `rule` for `period` (a period of the unit's span).
    fn used(&self, unit: LeaseUnit, rule: &BudgetRule, period: i64) -> u64 {
        unit.recorded(rule, &self.spend, self.at.index(rule.period), period)
    }
}

/// This dataplane's lease of one limit in its meter's period.
#[derive(Debug, Clone, Copy)]
struct Lease {
    /// Lease left to admit from; below zero by at most one reservation.
    unused: i64,
    /// The latest reservation (what to ask for).
    last_reservation: u64,
    /// Taken since the last report (the pace to ask for).
    taken: u64,
    last_used_ms: i64,
}

impl Lease {
    fn new(now_ms: i64) -> Self {
        Lease {
            unused: 0,
            last_reservation: 1,
            taken: 0,
            last_used_ms: now_ms,
        }
    }
}

/// One limit of the budget in force for a scope, and what counts toward it in its current
/// period: the feed's number (`remote`), this dataplane's entries started in the period
/// (`local`: reservations, or what settled requests count) and this dataplane's lease. Kept
/// when the feed arrives (the rules, the spend) and by each admission, settlement and
/// retirement, so admitting is a comparison and an addition per limit. A meter moves to the
/// next period at its scope's first request in it, where nothing local counts yet: a request's
/// time is never before the last admitted one's ([`Ledger::clock_ms`]).
#[derive(Debug, Clone, Copy)]
struct Meter {
    unit: LeaseUnit,
    span: Span,
    limit: u64,
    period: i64,
    remote: u64,
    local: u64,
    lease: Option<Lease>,
}

impl Meter {
    /// Counts `from` as `to` for an entry started at `at`, if that is in the meter's period.
    fn change(&mut self, at: &Periods, from: &[u64; UNITS], to: &[u64; UNITS]) {
        if at.of(self.span) == self.period {
            let u = self.unit as usize;
            self.local = self.local.saturating_sub(from[u]).saturating_add(to[u]);
        }
    }
}

type Meters = SmallVec<[Meter; UNITS]>;

/// The budget in force for a scope: its own, else a default.
#[derive(Debug, Clone, Copy)]
struct InForce {
    rule: BudgetRule,
    default: bool,
}

/// Everything the ledger knows of one scope a budget applies to: its own budget, the one in
/// force and its meters, the feed's spend and how many entries count toward it. Found once per
/// request by its name; entries then refer to it by number.
#[derive(Debug)]
struct ScopeState {
    kind: ScopeKind,
    value: String,
    /// Its own budget (else a default may apply).
    rule: Option<BudgetRule>,
    in_force: Option<InForce>,
    /// One per limit of the budget in force.
    meters: Meters,
    /// Their units, a bit each: what an admission takes a lease of.
    units: u8,
    remote: Option<Remote>,
    /// Entries counted toward it.
    entries: u32,
    live: bool,
}

impl ScopeState {
    /// Nothing refers to it any more: no budget of its own, no spend in the feed, no entry, no
    /// lease.
    fn is_idle(&self) -> bool {
        self.rule.is_none()
            && self.remote.is_none()
            && self.entries == 0
            && self.meters.iter().all(|m| m.lease.is_none())
    }

    /// Makes the meters of the budget in force now, at `at`: the feed's numbers for their
    /// periods, nothing local (the caller counts the entries), the leases of the same limits
    /// and periods kept.
    fn remeter(&mut self, in_force: Option<InForce>, at: &Periods) {
        let old = std::mem::take(&mut self.meters);
        self.in_force = in_force;
        self.units = 0;
        let Some(f) = in_force else { return };
        for unit in LeaseUnit::ALL {
            let Some(limit) = unit.limit(&f.rule) else {
                continue;
            };
            let span = Span::of(unit, f.rule.period);
            let period = at.of(span);
            let lease = old
                .iter()
                .find(|m| m.unit == unit && m.span == span && m.period == period)
                .and_then(|m| m.lease);
            self.units |= bit(unit);
            self.meters.push(Meter {
                unit,
                span,
                limit,
                period,
                remote: self.remote.map_or(0, |r| r.used(unit, &f.rule, period)),
                local: 0,
                lease,
            });
        }
    }
}

#[derive(Debug, Default)]
struct Ledger {
    synced: bool,
    /// Leases are spent only before this (Unix ms): the send time of the last answered report
    /// plus the lease time to live.
    lease_valid_until_ms: i64,
    epoch: u64,
    seq: u64,
    /// The controlplane's current month.
    month: i64,
    default_user: Option<BudgetRule>,
    default_key: Option<BudgetRule>,
    /// Scope kinds a budget may apply to: one of their own, or a default.
    active: [bool; KINDS],
    /// Per key id, the scopes of its labels that have a budget.
    key_labels: HashMap<String, Vec<u32>>,
    /// Scopes by kind and name, and their states (freed ones reused).
    index: ByScope<u32>,
    scopes: Vec<ScopeState>,
    free: Vec<u32>,
    entries: Entries,
    /// The entries delivered, whose spend the feed has not caught up with yet (the only ones
    /// a feed or an acknowledgement may retire).
    delivered: Vec<EntryRef>,
    /// The last day whose periods were computed, and them.
    today: Option<(i64, Periods)>,
    /// The latest time a request was admitted at: a later request's clock read before it is
    /// taken as it, so meters only move forward.
    clock_ms: i64,
}

impl Ledger {
    /// The periods of `now_ms` (the month's calendar arithmetic once a day).
    fn periods(&mut self, now_ms: i64) -> Periods {
        let day = day_of(now_ms);
        let minute = minute_of(now_ms);
        match self.today {
            Some((d, p)) if d == day => p.with_minute(minute),
            _ => {
                let p = Periods::of_day(day, minute);
                self.today = Some((day, p));
                p
            }
        }
    }

    fn find(&self, kind: ScopeKind, value: &str) -> Option<u32> {
        self.index.get(kind, value).copied()
    }

    fn scope(&self, id: u32) -> &ScopeState {
        &self.scopes[id as usize]
    }

    fn scope_mut(&mut self, id: u32) -> &mut ScopeState {
        &mut self.scopes[id as usize]
    }

    fn default_for(&self, kind: ScopeKind) -> Option<BudgetRule> {
        match kind {
            ScopeKind::User => self.default_user,
            ScopeKind::Key => self.default_key,
            _ => None,
        }
    }

    /// The budget in force for a scope of `kind` whose own is `own`.
    fn in_force(&self, kind: ScopeKind, own: Option<BudgetRule>) -> Option<InForce> {
        match (own, self.default_for(kind)) {
            (Some(rule), _) => Some(InForce {
                rule,
                default: false,
            }),
            (None, Some(rule)) => Some(InForce {
                rule,
                default: true,
            }),
            (None, None) => None,
        }
    }

    /// The scope's state, made when first needed (with no budget of its own: a default's
    /// meters, if one applies).
    fn slot(&mut self, kind: ScopeKind, value: &str) -> u32 {
        if let Some(id) = self.find(kind, value) {
            return id;
        }
        let in_force = self.in_force(kind, None);
        let at = self.periods(self.clock_ms);
        let id = match self.free.pop() {
            Some(id) => {
                let s = self.scope_mut(id);
                s.kind = kind;
                s.value.clear();
                s.value.push_str(value);
                s.live = true;
                id
            }
            None => {
                self.scopes.push(ScopeState {
                    kind,
                    value: value.to_owned(),
                    rule: None,
                    in_force: None,
                    meters: Meters::new(),
                    units: 0,
                    remote: None,
                    entries: 0,
                    live: true,
                });
                u32::try_from(self.scopes.len() - 1).unwrap_or(u32::MAX)
            }
        };
        // No entry counts toward a new scope.
        self.scope_mut(id).remeter(in_force, &at);
        self.index.insert(kind, value, id);
        id
    }

    /// Frees the states nothing refers to any more.
    fn collect(&mut self) {
        for (id, s) in self.scopes.iter_mut().enumerate() {
            if s.live && s.is_idle() {
                s.live = false;
                s.in_force = None;
                s.meters.clear();
                self.index.remove(s.kind, &s.value);
                self.free.push(u32::try_from(id).unwrap_or(u32::MAX));
            }
        }
    }

    /// The scope a budget applies to under this name, if any.
    fn applies(&mut self, kind: ScopeKind, value: &str) -> Option<u32> {
        if !self.active[kind.index()] {
            return None;
        }
        let id = match self.find(kind, value) {
            Some(id) => id,
            None if self.default_for(kind).is_some() => self.slot(kind, value),
            None => return None,
        };
        self.scope(id).in_force.is_some().then_some(id)
    }

    /// Every scope's budget in force and meters anew (the rules changed), counting the entries.
    fn remeter(&mut self) {
        let at = self.periods(self.clock_ms);
        for i in 0..self.scopes.len() {
            let s = &self.scopes[i];
            let in_force = if s.live {
                self.in_force(s.kind, s.rule)
            } else {
                None
            };
            self.scopes[i].remeter(in_force, &at);
        }
        let Ledger {
            entries, scopes, ..
        } = self;
        let none = [0; UNITS];
        for e in entries.values() {
            let amounts = e.amounts();
            for c in &e.scopes {
                for m in &mut scopes[c.scope as usize].meters {
                    m.change(&e.at, &none, &amounts);
                }
            }
        }
    }

    /// Takes an entry out of its scopes' meters.
    fn uncount(scopes: &mut [ScopeState], e: &Entry) {
        let amounts = e.amounts();
        let none = [0; UNITS];
        for c in &e.scopes {
            let s = &mut scopes[c.scope as usize];
            s.entries = s.entries.saturating_sub(1);
            for m in &mut s.meters {
                m.change(&e.at, &amounts, &none);
            }
        }
    }

    /// Keeps the entries `keep` says to, keeping the meters right (visits them all).
    fn retain(&mut self, keep: impl FnMut(&Entry) -> bool) {
        let Ledger {
            entries, scopes, ..
        } = self;
        entries.retain(keep, |e| Self::uncount(scopes, &e));
    }

    /// Drops the delivered entries the feed has caught up with (visits only those delivered).
    fn retire_delivered(&mut self) {
        let Ledger {
            entries,
            scopes,
            delivered,
            epoch,
            seq,
            ..
        } = self;
        delivered.retain(|&at| match entries.get(at).map(|e| e.state) {
            Some(EntryState::Delivered { epoch: ep, seq: s }) => {
                if ep == *epoch && s <= *seq {
                    if let Some(e) = entries.remove(at) {
                        Self::uncount(scopes, &e);
                    }
                    false
                } else {
                    true
                }
            }
            // Gone, or admitted anew under the same id.
            _ => false,
        });
    }

    /// Drops the entries of past months not delivered (their record never made it; they no
    /// longer count toward any period): when the month changes.
    fn retire_past_months(&mut self) {
        // A week that began in the previous month still counts this month's first days.
        let month = self.month;
        let first_week = week_of_day(first_day_of_month(month));
        self.retain(|e| match e.state {
            EntryState::Delivered { .. } => true,
            _ => e.at.month() >= month || e.at.week() >= first_week,
        });
    }

    fn name(&self, id: u32) -> BudgetName {
        let s = self.scope(id);
        BudgetName {
            scope: Scope::new(s.kind, s.value.as_str()),
            default: s.in_force.is_some_and(|f| f.default),
        }
    }
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

/// What a request may cost, and when it starts (Unix ms).
#[derive(Debug, Clone, Copy)]
pub struct Estimate {
    pub micros: u64,
    pub tokens: u64,
    pub now_ms: i64,
}

/// An admitted request's hold on its budgets. Settle it with what the request counts; dropping
/// it unsettled counts the reservation.
#[derive(Debug)]
pub struct Reservation {
    ledger: Arc<Mutex<Ledger>>,
    entry: EntryRef,
    reserved: u64,
    reserved_tokens: u64,
    settled: bool,
}

impl Reservation {
    pub fn reserved_micros(&self) -> u64 {
        self.reserved
    }

    pub fn reserved_tokens(&self) -> u64 {
        self.reserved_tokens
    }

    /// Replaces the reservation with what the request counts against its budgets.
    pub fn settle(mut self, micros: u64, tokens: u64) {
        self.settled = true;
        settle(&self.ledger, self.entry, micros, tokens);
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if !self.settled {
            settle(
                &self.ledger,
                self.entry,
                self.reserved,
                self.reserved_tokens,
            );
        }
    }
}

/// What a request counts in each unit, by `LeaseUnit as usize`.
fn amounts(micros: u64, tokens: u64) -> [u64; UNITS] {
    let mut a = [0; UNITS];
    a[LeaseUnit::Micros as usize] = micros;
    a[LeaseUnit::Requests as usize] = 1;
    a[LeaseUnit::Tokens as usize] = tokens;
    a[LeaseUnit::MinuteTokens as usize] = tokens;
    a
}

fn bit(unit: LeaseUnit) -> u8 {
    1 << (unit as u8)
}

fn signed(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// Gives back what an admission took from these meters (and their leases): it was refused.
fn untake(meters: &mut [Meter], reservation: &[u64; UNITS]) {
    for m in meters {
        let n = reservation[m.unit as usize];
        m.local = m.local.saturating_sub(n);
        if let Some(lease) = m.lease.as_mut() {
            lease.unused = lease.unused.saturating_add(signed(n));
            lease.taken = lease.taken.saturating_sub(n);
        }
    }
}

/// [`untake`] for every scope an admission counted toward.
fn untake_all(scopes: &mut [ScopeState], counted: &[Counted], reservation: &[u64; UNITS]) {
    for c in counted {
        let s = &mut scopes[c.scope as usize];
        s.entries -= 1;
        untake(&mut s.meters, reservation);
    }
}

fn lock(ledger: &Mutex<Ledger>) -> MutexGuard<'_, Ledger> {
    // Plain numbers: a panic elsewhere cannot leave them half-updated in a harmful way.
    ledger.lock().unwrap_or_else(|p| p.into_inner())
}

/// Replaces an in-flight entry's reservation with what its request counts.
fn settle(ledger: &Mutex<Ledger>, entry: EntryRef, micros: u64, tokens: u64) {
    let mut guard = lock(ledger);
    let Ledger {
        entries, scopes, ..
    } = &mut *guard;
    // Gone when retired (or replaced under its id) before its request ended.
    let Some(e) = entries.get_mut(entry) else {
        return;
    };
    if e.state != EntryState::InFlight {
        return;
    }
    let (from, to) = (e.amounts(), amounts(micros, tokens));
    // What goes back to a lease: the reservation less what the request used.
    let back: [i64; UNITS] = std::array::from_fn(|u| signed(from[u]).saturating_sub(signed(to[u])));
    for c in &e.scopes {
        for m in &mut scopes[c.scope as usize].meters {
            let u = m.unit as usize;
            // Requests count one each way; amounts as reserved change nothing.
            if from[u] == to[u] || e.at.of(m.span) != m.period {
                continue;
            }
            m.local = m.local.saturating_sub(from[u]).saturating_add(to[u]);
            // What the request did not use goes back to the lease (what it used past its
            // reservation comes out of it).
            if c.taken & bit(m.unit) != 0
                && let Some(lease) = m.lease.as_mut()
            {
                lease.unused = lease.unused.saturating_add(back[u]);
            }
        }
    }
    e.micros = micros;
    e.tokens = tokens;
    e.state = EntryState::Settled;
}

impl Budgets {
    fn lock(&self) -> MutexGuard<'_, Ledger> {
        lock(&self.ledger)
    }

    /// Whether a feed has arrived since start.
    pub fn is_synced(&self) -> bool {
        self.lock().synced
    }

    /// Admits or refuses a request that may cost up to `estimate_micros` and `estimate_tokens`.
    /// `Ok(None)`: no budget applies to it. (The proxy calls [`Self::admit_with`].)
    #[cfg(test)]
    pub fn admit(
        &self,
        who: &Who<'_>,
        request_id: &str,
        estimate_micros: u64,
        estimate_tokens: u64,
        now_ms: i64,
    ) -> Result<Option<Reservation>, Refusal> {
        self.admit_with(who, request_id, || Estimate {
            micros: estimate_micros,
            tokens: estimate_tokens,
            now_ms,
        })
    }

    /// Admits or refuses a request that may cost up to the [`Estimate`] `estimate` gives, made
    /// only once a budget is found to apply: a request no budget applies to prices nothing and
    /// reads no clock. `Ok(None)`: no budget applies to it.
    pub fn admit_with(
        &self,
        who: &Who<'_>,
        request_id: &str,
        estimate: impl FnOnce() -> Estimate,
    ) -> Result<Option<Reservation>, Refusal> {
        let mut guard = self.lock();
        let l = &mut *guard;
        if !l.synced {
            // Before the first feed nothing is known; an end user's budget was always checked,
            // so their requests wait; others pass.
            return match who.user {
                Some(_) => Err(Refusal::NotLoaded),
                None => Ok(None),
            };
        }
        // The scopes whose budgets apply, found by borrowed names: one probe per kind that
        // has a budget, none for the others.
        let mut applied: SmallVec<[u32; 6]> = SmallVec::new();
        let scopes = [
            (ScopeKind::Key, Some(who.key)),
            (ScopeKind::Agent, who.agent),
            (ScopeKind::Model, who.model),
            (ScopeKind::Env, who.env),
            (ScopeKind::User, who.user),
        ];
        for (kind, value) in scopes {
            if let Some(id) = value.and_then(|v| l.applies(kind, v)) {
                applied.push(id);
            }
        }
        if let Some(labels) = (!l.key_labels.is_empty())
            .then(|| l.key_labels.get(who.key))
            .flatten()
        {
            for &id in labels {
                if l.scope(id).in_force.is_some() {
                    applied.push(id);
                }
            }
        }
        if applied.is_empty() {
            return Ok(None);
        }
        let Estimate {
            micros: estimate_micros,
            tokens: estimate_tokens,
            now_ms,
        } = estimate();
        // Never before the last admitted request: a meter's period only moves forward.
        let now_ms = now_ms.max(l.clock_ms);
        l.clock_ms = now_ms;
        let now = l.periods(now_ms);
        let reservation = amounts(estimate_micros, estimate_tokens);
        let (signed_reservation, asked) = (reservation.map(signed), reservation.map(|n| n.max(1)));

        // Every limit, from its meter, and every lease: each takes the reservation if its limit
        // is not reached; all must have had some lease left, else what was taken goes back.
        let expired = l.lease_valid_until_ms <= now_ms;
        let mut short = None;
        let mut counted: SmallVec<[Counted; 6]> = SmallVec::new();
        for &id in &applied {
            let ScopeState {
                in_force,
                meters,
                units,
                remote,
                entries,
                ..
            } = &mut l.scopes[id as usize];
            let Some(f) = *in_force else { continue };
            for (i, m) in meters.iter_mut().enumerate() {
                let period = now.of(m.span);
                if m.period != period {
                    // The scope's first request in a new period: nothing local counts there.
                    m.period = period;
                    m.local = 0;
                    m.remote = remote.map_or(0, |r| r.used(m.unit, &f.rule, period));
                    m.lease = None;
                }
                if m.remote.saturating_add(m.local) >= m.limit {
                    let unit = m.unit;
                    untake(&mut meters[..i], &reservation);
                    untake_all(&mut l.scopes, &counted, &reservation);
                    return Err(Refusal::Over {
                        budget: l.name(id),
                        limit: Limit::of(unit, &f.rule),
                        retry_after: until(period_end(unit, &f.rule, now_ms), now_ms),
                    });
                }
                let u = m.unit as usize;
                let lease = m.lease.get_or_insert_with(|| Lease::new(now_ms));
                lease.last_reservation = asked[u];
                lease.last_used_ms = now_ms;
                if lease.unused <= 0 && short.is_none() {
                    short = Some((id, m.unit, f.rule));
                }
                lease.unused = lease.unused.saturating_sub(signed_reservation[u]);
                lease.taken = lease.taken.saturating_add(reservation[u]);
                m.local = m.local.saturating_add(reservation[u]);
            }
            // Every meter took from its lease.
            *entries += 1;
            counted.push(Counted {
                scope: id,
                taken: *units,
            });
        }
        if expired || short.is_some() {
            untake_all(&mut l.scopes, &counted, &reservation);
        }
        if expired {
            return Err(Refusal::LeaseExpired);
        }
        if let Some((id, unit, rule)) = short {
            // Others may give theirs back when idle: worth a retry before the period ends.
            let retry = until(period_end(unit, &rule, now_ms), now_ms)
                .min(Duration::from_millis(2 * LEASE_IDLE_MS as u64));
            return Err(Refusal::NoLease {
                budget: l.name(id),
                limit: Limit::of(unit, &rule),
                retry_after: retry,
            });
        }
        let entry = Entry {
            key: EntryKey::of(request_id),
            #[cfg(test)]
            started_ms: now_ms,
            at: now,
            micros: estimate_micros,
            tokens: estimate_tokens,
            state: EntryState::InFlight,
            scopes: counted,
        };
        let (entry, replaced) = l.entries.insert(entry);
        if let Some(old) = replaced {
            Ledger::uncount(&mut l.scopes, &old);
        }
        Ok(Some(Reservation {
            ledger: self.ledger.clone(),
            entry,
            reserved: estimate_micros,
            reserved_tokens: estimate_tokens,
            settled: false,
        }))
    }

    /// The controlplane stored these requests' records; their spend is in the feed from
    /// position `(epoch, seq)` on.
    pub fn delivered<'a>(
        &self,
        request_ids: impl IntoIterator<Item = &'a str>,
        epoch: u64,
        seq: u64,
    ) {
        let mut guard = self.lock();
        let l = &mut *guard;
        for request_id in request_ids {
            let Some(at) = l.entries.find(&EntryKey::of(request_id)) else {
                continue;
            };
            if let Some(e) = l.entries.get_mut(at) {
                let listed = matches!(e.state, EntryState::Delivered { .. });
                e.state = EntryState::Delivered { epoch, seq };
                if !listed {
                    l.delivered.push(at);
                }
            }
        }
        l.retire_delivered();
    }

    /// Applies one feed message.
    pub fn apply_feed(&self, feed: Feed) {
        let mut guard = self.lock();
        let l = &mut *guard;
        if feed.full {
            l.default_user = feed.default;
            l.default_key = feed.default_key;
            for s in &mut l.scopes {
                s.rule = None;
                s.remote = None;
            }
            let mut ruled = [false; KINDS];
            for (scope, rule) in feed.overrides {
                let id = l.slot(scope.kind, &scope.value);
                l.scope_mut(id).rule = Some(rule);
                ruled[scope.kind.index()] = true;
            }
            l.active = ruled;
            l.active[ScopeKind::User.index()] |= l.default_user.is_some();
            l.active[ScopeKind::Key.index()] |= l.default_key.is_some();
            l.key_labels.clear();
            for (label, keys) in feed.label_keys {
                let Some(id) = l
                    .find(ScopeKind::Label, &label)
                    .filter(|id| l.scope(*id).rule.is_some())
                else {
                    continue;
                };
                for key in keys {
                    l.key_labels.entry(key).or_default().push(id);
                }
            }
            // A new epoch's full state was loaded from the database: it includes everything the
            // controlplane acknowledged before, whatever position it was acknowledged at.
            if feed.epoch != l.epoch {
                l.retain(|e| !matches!(e.state, EntryState::Delivered { .. }));
                l.delivered.clear();
            }
            l.remeter();
        }
        let at = Periods::of_day(feed.day, 0);
        for (scope, spend) in feed.spend {
            // Only scopes a budget may name are kept: labels, agents, models and envs without
            // one are dropped (a new budget comes with a full state).
            let own = l
                .find(scope.kind, &scope.value)
                .is_some_and(|id| l.scope(id).rule.is_some());
            if own || l.default_for(scope.kind).is_some() {
                let id = l.slot(scope.kind, &scope.value);
                let s = l.scope_mut(id);
                let remote = Remote { spend, at };
                s.remote = Some(remote);
                if let Some(f) = s.in_force {
                    for m in &mut s.meters {
                        m.remote = remote.used(m.unit, &f.rule, m.period);
                    }
                }
            }
        }
        let month_changed = feed.month != l.month;
        l.epoch = feed.epoch;
        l.seq = feed.seq;
        l.month = feed.month;
        l.synced = true;
        if month_changed {
            l.retire_past_months();
        }
        l.retire_delivered();
    }

    /// This dataplane's report for the next lease round: every budget's claim (admitted spend
    /// not in the feed yet, plus the unused lease) and what more to ask for. Returns the report;
    /// idle leases are given back and forgotten leases dropped first.
    pub fn lease_request(&self, dataplane: &str, now_ms: i64) -> LeaseRequest {
        self.leasing.started.fetch_add(1, Ordering::SeqCst);
        let mut guard = self.lock();
        let l = &mut *guard;
        // Unanswered for the time to live: the controlplane has taken back what was unused, so
        // it must not be claimed (or spent) again.
        let expired = l.lease_valid_until_ms != 0 && l.lease_valid_until_ms <= now_ms;
        let at = l.periods(now_ms);
        let mut claims = Vec::new();
        for s in l.scopes.iter_mut().filter(|s| s.live) {
            for m in &mut s.meters {
                let Some(lease) = m.lease.as_mut() else {
                    continue;
                };
                // The period is over: the lease means nothing now.
                if at.of(m.span) != m.period {
                    m.lease = None;
                    continue;
                }
                let idle = now_ms - lease.last_used_ms >= LEASE_IDLE_MS;
                if idle || expired {
                    lease.unused = lease.unused.min(0);
                }
                let unused = u64::try_from(lease.unused).unwrap_or(0);
                let claim = m.local.saturating_add(unused);
                // Enough for two rounds at the pace of the last one, and a few requests at
                // least.
                let pace = std::mem::take(&mut lease.taken);
                let low = (LEASE_LOW_WATER * lease.last_reservation).max(pace);
                let want = if !idle && unused < low {
                    (LEASE_ASK * lease.last_reservation).max(pace.saturating_mul(2))
                } else {
                    0
                };
                if claim == 0 && want == 0 {
                    m.lease = None;
                    continue;
                }
                claims.push(LeaseClaim {
                    key: LeaseKey {
                        scope: Scope::new(s.kind, s.value.as_str()),
                        unit: m.unit,
                        period: m.period,
                    },
                    claim,
                    want,
                });
            }
        }
        l.collect();
        LeaseRequest {
            dataplane: dataplane.to_owned(),
            instance: self.leasing.instance,
            claims,
        }
    }

    /// Adds what a round granted (`request` is the report sent at `sent_ms`), and keeps the
    /// leases spendable for the answer's time to live from then.
    pub fn apply_grants(&self, request: &LeaseRequest, response: &LeaseResponse, sent_ms: i64) {
        let mut guard = self.lock();
        let l = &mut *guard;
        for (claim, granted) in request.claims.iter().zip(&response.granted) {
            if *granted == 0 {
                continue;
            }
            let scope = &claim.key.scope;
            let Some(id) = l.find(scope.kind, &scope.value) else {
                continue;
            };
            let lease = l
                .scope_mut(id)
                .meters
                .iter_mut()
                .find(|m| m.unit == claim.key.unit && m.period == claim.key.period)
                .and_then(|m| m.lease.as_mut());
            if let Some(lease) = lease {
                lease.unused = lease.unused.saturating_add(signed(*granted));
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
        let who = Who {
            key: "key_test",
            user: Some(user),
            ..Who::default()
        };
        self.admit_granted(&who, request_id, estimate_micros, 0, now_ms)
    }

    /// [`Self::admit_leased`] for any request, tokens included.
    #[cfg(test)]
    fn admit_granted(
        &self,
        who: &Who<'_>,
        request_id: &str,
        estimate_micros: u64,
        estimate_tokens: u64,
        now_ms: i64,
    ) -> Result<Option<Reservation>, Refusal> {
        match self.admit(who, request_id, estimate_micros, estimate_tokens, now_ms) {
            Err(Refusal::NoLease { .. } | Refusal::LeaseExpired) => {
                // At the time the request was taken at (never before the last admitted one).
                let now_ms = now_ms.max(self.lock().clock_ms);
                let req = self.lease_request("test", now_ms);
                let granted = req.claims.iter().map(|c| c.want.max(1) * 1_000).collect();
                let resp = LeaseResponse {
                    granted,
                    ttl_ms: 40 * 86_400_000,
                };
                self.apply_grants(&req, &resp, now_ms);
                self.admit(who, request_id, estimate_micros, estimate_tokens, now_ms)
            }
            other => other,
        }
    }

    /// Rules in force: the defaults (if any) and the budgets of scopes.
    pub fn rules(&self) -> usize {
        let l = self.lock();
        usize::from(l.default_user.is_some())
            + usize::from(l.default_key.is_some())
            + l.scopes
                .iter()
                .filter(|s| s.live && s.rule.is_some())
                .count()
    }

    /// Entries counted right now toward one end user (for tests and diagnostics).
    pub fn local_entries(&self, user: &str) -> usize {
        let l = self.lock();
        let Some(id) = l.find(ScopeKind::User, user) else {
            return 0;
        };
        l.entries
            .values()
            .filter(|e| e.scopes.iter().any(|c| c.scope == id))
            .count()
    }
}

/// When the period of `unit` under `rule` containing `now_ms` ends.
fn period_end(unit: LeaseUnit, rule: &BudgetRule, now_ms: i64) -> i64 {
    if unit.per_minute() {
        (minute_of(now_ms) + 1) * MINUTE_MS
    } else {
        rule.period.end_ms(now_ms)
    }
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

    fn user(u: &str) -> Who<'_> {
        Who {
            key: "key_test",
            user: Some(u),
            ..Who::default()
        }
    }

    fn dollars(limit: u64) -> BudgetRule {
        BudgetRule {
            limit_micros: Some(limit),
            period: Period::Day,
            requests_per_minute: None,
            limit_tokens: None,
            tokens_per_minute: None,
        }
    }

    #[test]
    fn nothing_is_admitted_before_the_first_feed() {
        assert_eq!(
            Budgets::default().admit(&user("u"), "r", 1, 0, NOW).err(),
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
                Err(Refusal::Over { retry_after, .. }) => {
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
            r.settle(100, 0);
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
            .settle(700, 0);
        b.delivered(["r1"], 7, 3);
        assert_eq!(b.local_entries("u"), 1, "feed not caught up yet");
        assert!(b.admit_leased("u", "r2", 1, NOW).is_ok());
        b.apply_feed(Feed {
            epoch: 7,
            seq: 3,
            spend: vec![(
                Scope::user("u"),
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
            Err(Refusal::Over { .. })
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
            .settle(10, 0);
        b.delivered(["r1"], 7, 99);
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
            limit_tokens: None,
            tokens_per_minute: None,
        });
        assert!(b.admit_leased("u", "1", 0, NOW).is_ok());
        assert!(b.admit_leased("u", "2", 0, NOW + 10).is_ok());
        assert!(matches!(
            b.admit_leased("u", "3", 0, NOW + 20),
            Err(Refusal::Over {
                limit: Limit::Rpm(2),
                ..
            })
        ));
        assert!(b.admit_leased("u", "4", 0, NOW + MINUTE_MS).is_ok());
    }

    #[test]
    fn overrides_replace_the_default_and_no_rule_means_no_budget() {
        let b = Budgets::default();
        b.apply_feed(Feed {
            epoch: 1,
            full: true,
            overrides: vec![(Scope::user("vip"), dollars(5))],
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
        // No lease round answered yet: refused, and the next round asks for eight reservations.
        assert_eq!(
            b.admit(&user("u"), "r0", 300, 0, NOW).err(),
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
            .map(|i| {
                b.admit(&user("u"), &format!("r{i}"), 300, 0, NOW)
                    .unwrap()
                    .unwrap()
            })
            .collect();
        assert!(matches!(
            b.admit(&user("u"), "r4", 300, 0, NOW),
            Err(Refusal::NoLease { .. })
        ));
        // The claim: 900 admitted and not in the feed, nothing unused; it asks for eight
        // reservations (more than twice the 900 taken since the last round).
        let req = round(&b, NOW + 1, &[]);
        assert_eq!((req.claims[0].claim, req.claims[0].want), (900, 2_400));
        // Answers cheaper than reserved give the difference back to the lease.
        for r in held {
            r.settle(100, 0);
        }
        assert!(b.admit(&user("u"), "r5", 300, 0, NOW + 2).is_ok());
        let req = round(&b, NOW + 3, &[]);
        // 300 + 3 x 100 admitted; 700 - 900 + 600 - 300 = 100 unused.
        assert_eq!(req.claims[0].claim, 600 + 100);
    }

    #[test]
    fn an_idle_lease_goes_back_and_an_unanswered_one_expires() {
        let b = budgets(dollars(1_000_000));
        let _ = b.admit(&user("u"), "r0", 300, 0, NOW);
        round(&b, NOW, &[10_000]);
        b.admit(&user("u"), "r1", 300, 0, NOW)
            .unwrap()
            .unwrap()
            .settle(300, 0);
        // Idle for LEASE_IDLE_MS: the unused lease is not claimed any more, only the spend the
        // feed has not counted yet.
        let req = round(&b, NOW + LEASE_IDLE_MS, &[]);
        assert_eq!((req.claims[0].claim, req.claims[0].want), (300, 0));
        // Once the feed has it, nothing is left to claim: the lease is dropped.
        b.delivered(["r1"], 7, 1);
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
        let _ = b.admit(&user("u"), "r2", 300, 0, NOW);
        round(&b, NOW, &[10_000]);
        assert!(b.admit(&user("u"), "r3", 300, 0, NOW + 4_999).is_ok());
        assert_eq!(
            b.admit(&user("u"), "r4", 300, 0, NOW + 5_000).err(),
            Some(Refusal::LeaseExpired)
        );
        // Its next report claims no unused lease (the controlplane took it back).
        let req = b.lease_request("test", NOW + 5_000);
        assert_eq!(req.claims[0].claim, 300);
    }

    #[test]
    fn a_scope_nothing_refers_to_is_freed_and_its_state_is_not_inherited() {
        let b = budgets(dollars(1_000));
        b.admit_leased("u", "r1", 900, NOW)
            .unwrap()
            .unwrap()
            .settle(900, 0);
        b.delivered(["r1"], 7, 1);
        b.apply_feed(Feed {
            epoch: 7,
            seq: 1,
            day: day_of(NOW),
            month: month_of_day(day_of(NOW)),
            ..Default::default()
        });
        // No entry, no spend in the feed, an idle lease: the round drops the lease and frees
        // the scope.
        round(&b, NOW + LEASE_IDLE_MS, &[]);
        round(&b, NOW + LEASE_IDLE_MS, &[]);
        let freed = b.lock().free.len();
        assert_eq!(freed, 1, "u's scope is free");
        // Another end user takes the freed state: nothing of u's counts toward v.
        b.admit_leased("v", "r2", 900, NOW)
            .unwrap()
            .unwrap()
            .settle(900, 0);
        assert_eq!((b.local_entries("u"), b.local_entries("v")), (0, 1));
        assert_eq!(b.lock().free.len(), 0, "reused");
        // And u starts afresh (its spend reached the feed, which no longer names it).
        assert!(b.admit_leased("u", "r3", 900, NOW).unwrap().is_some());
        // v's own 900 is below the limit (u's 900 on top would not be), and then it is not.
        let _r4 = b.admit_leased("v", "r4", 900, NOW).unwrap().unwrap();
        assert!(matches!(
            b.admit_leased("v", "r5", 900, NOW),
            Err(Refusal::Over { .. })
        ));
    }

    #[test]
    fn a_rate_lease_counts_requests_per_minute() {
        let b = budgets(BudgetRule {
            limit_micros: None,
            period: Period::Day,
            requests_per_minute: Some(100),
            limit_tokens: None,
            tokens_per_minute: None,
        });
        assert_eq!(
            b.admit(&user("u"), "r0", 0, 0, NOW).err(),
            Some(Refusal::LeaseExpired)
        );
        let req = round(&b, NOW, &[2]);
        assert_eq!(req.claims[0].key.unit, LeaseUnit::Requests);
        assert_eq!(req.claims[0].key.period, minute_of(NOW));
        assert!(b.admit(&user("u"), "r1", 0, 0, NOW).is_ok());
        assert!(b.admit(&user("u"), "r2", 0, 0, NOW).is_ok());
        assert!(matches!(
            b.admit(&user("u"), "r3", 0, 0, NOW),
            Err(Refusal::NoLease {
                limit: Limit::Rpm(_),
                ..
            })
        ));
        // The next minute starts a new lease.
        let next = (minute_of(NOW) + 1) * MINUTE_MS;
        // (A round answered meanwhile keeps the leases spendable.)
        round(&b, next - 1_000, &[]);
        assert!(matches!(
            b.admit(&user("u"), "r4", 0, 0, next),
            Err(Refusal::NoLease { .. })
        ));
        let req = round(&b, next, &[1]);
        assert_eq!(req.claims.len(), 1, "the past minute's lease is dropped");
        assert!(b.admit(&user("u"), "r5", 0, 0, next).is_ok());
    }

    #[test]
    fn a_request_passes_every_budget_that_applies_and_a_refusal_names_its_own() {
        let b = Budgets::default();
        let rpm = |n| BudgetRule {
            limit_micros: None,
            period: Period::Day,
            requests_per_minute: Some(n),
            limit_tokens: None,
            tokens_per_minute: None,
        };
        b.apply_feed(Feed {
            epoch: 1,
            full: true,
            default: Some(rpm(100)),
            default_key: Some(rpm(100)),
            overrides: vec![
                (Scope::new(ScopeKind::Agent, "bot"), rpm(3)),
                (Scope::new(ScopeKind::Label, "team=a"), rpm(2)),
                (
                    Scope::new(ScopeKind::Model, "m"),
                    BudgetRule::usd(1_000, Period::Week),
                ),
            ],
            label_keys: vec![("team=a".to_owned(), vec!["k1".to_owned()])],
            day: day_of(NOW),
            month: month_of_day(day_of(NOW)),
            ..Default::default()
        });
        let who = |key, agent| Who {
            key,
            agent: Some(agent),
            model: Some("m"),
            env: None,
            user: Some("u"),
        };
        let grant_all = |b: &Budgets| {
            let req = b.lease_request("t", NOW);
            let granted = req.claims.iter().map(|c| c.want.max(1) * 1_000).collect();
            b.apply_grants(
                &req,
                &LeaseResponse {
                    granted,
                    ttl_ms: 60_000,
                },
                NOW,
            );
        };
        // Admits, with a lease round granting everything when a lease is missing.
        let admit = |b: &Budgets, w: &Who<'_>, id: &str| match b.admit(w, id, 10, 0, NOW) {
            Err(Refusal::NoLease { .. } | Refusal::LeaseExpired) => {
                grant_all(b);
                b.admit(w, id, 10, 0, NOW)
            }
            other => other,
        };
        // The first admission asks for every lease: agent, label, model, key, user.
        assert_eq!(
            b.admit(&who("k1", "bot"), "r0", 10, 0, NOW).err(),
            Some(Refusal::LeaseExpired)
        );
        grant_all(&b);
        let kinds: std::collections::BTreeSet<_> = b
            .lease_request("t", NOW)
            .claims
            .iter()
            .map(|c| c.key.scope.kind)
            .collect();
        assert_eq!(kinds.len(), 5, "{kinds:?}");
        grant_all(&b);
        let mut held = Vec::new();
        for i in 0..2 {
            held.push(
                b.admit(&who("k1", "bot"), &format!("r{i}"), 10, 0, NOW)
                    .unwrap()
                    .unwrap(),
            );
        }
        // The label (two a minute) refuses k1's third; another key without the label passes,
        // until the agent's three.
        match b.admit(&who("k1", "bot"), "r2", 10, 0, NOW) {
            Err(Refusal::Over {
                budget,
                limit: Limit::Rpm(2),
                ..
            }) => {
                assert_eq!(
                    budget,
                    BudgetName {
                        scope: Scope::new(ScopeKind::Label, "team=a"),
                        default: false
                    }
                );
            }
            other => panic!("{other:?}"),
        }
        held.push(admit(&b, &who("k2", "bot"), "r3").unwrap().unwrap());
        match admit(&b, &who("k2", "bot"), "r4") {
            Err(Refusal::Over {
                budget,
                limit: Limit::Rpm(3),
                ..
            }) => {
                assert_eq!(budget.scope, Scope::new(ScopeKind::Agent, "bot"));
            }
            other => panic!("{other:?}"),
        }
        // Another agent on k2: the model's weekly dollars (1,000 µ$) are spent by the three.
        for r in held {
            r.settle(400, 0);
        }
        match admit(&b, &who("k2", "other"), "r5") {
            Err(Refusal::Over {
                budget,
                limit: Limit::Usd(1_000, Period::Week),
                ..
            }) => {
                assert_eq!(budget.scope, Scope::new(ScopeKind::Model, "m"));
            }
            other => panic!("{other:?}"),
        }
        // No budget applies to a request of another model without a user on a default-less
        // key: nothing is reserved.
        let free = Budgets::default();
        free.apply_feed(Feed {
            epoch: 1,
            full: true,
            ..Default::default()
        });
        assert!(matches!(
            free.admit(
                &Who {
                    key: "k",
                    model: Some("x"),
                    ..Who::default()
                },
                "r",
                1,
                1,
                NOW
            ),
            Ok(None)
        ));
    }

    #[test]
    fn token_limits_reserve_and_settle_tokens() {
        let b = Budgets::default();
        b.apply_feed(Feed {
            epoch: 1,
            full: true,
            overrides: vec![(
                Scope::new(ScopeKind::Agent, "bot"),
                BudgetRule {
                    limit_micros: None,
                    period: Period::Day,
                    requests_per_minute: None,
                    limit_tokens: Some(10_000),
                    tokens_per_minute: Some(700),
                },
            )],
            day: day_of(NOW),
            month: month_of_day(day_of(NOW)),
            ..Default::default()
        });
        let who = Who {
            key: "k",
            agent: Some("bot"),
            ..Who::default()
        };
        let _ = b.admit(&who, "r0", 0, 600, NOW);
        let req = b.lease_request("t", NOW);
        let units: Vec<_> = req.claims.iter().map(|c| c.key.unit).collect();
        assert!(units.contains(&LeaseUnit::Tokens) && units.contains(&LeaseUnit::MinuteTokens));
        let granted = req.claims.iter().map(|_| 10_000).collect();
        b.apply_grants(
            &req,
            &LeaseResponse {
                granted,
                ttl_ms: 60_000,
            },
            NOW,
        );
        // 600 reserved: a second fits (600 < 700), a third does not (1,200 per minute).
        let r1 = b.admit(&who, "r1", 0, 600, NOW).unwrap().unwrap();
        let r2 = b.admit(&who, "r2", 0, 600, NOW).unwrap().unwrap();
        assert!(matches!(
            b.admit(&who, "r3", 0, 600, NOW),
            Err(Refusal::Over {
                limit: Limit::Tpm(700),
                ..
            })
        ));
        // Short answers give the tokens back: 2 x 100 metered.
        r1.settle(0, 100);
        r2.settle(0, 100);
        assert!(b.admit(&who, "r4", 0, 600, NOW).is_ok());
    }

    #[test]
    fn a_clock_read_before_the_last_admission_counts_in_its_period() {
        let b = budgets(BudgetRule {
            limit_micros: None,
            period: Period::Day,
            requests_per_minute: Some(2),
            limit_tokens: None,
            tokens_per_minute: None,
        });
        let next = (minute_of(NOW) + 1) * MINUTE_MS;
        assert!(b.admit_leased("u", "1", 0, next).is_ok());
        // Read its clock before the first (a worker thread behind another): the next minute's.
        assert!(b.admit_leased("u", "2", 0, next - 1).is_ok());
        assert!(matches!(
            b.admit_leased("u", "3", 0, NOW),
            Err(Refusal::Over {
                limit: Limit::Rpm(2),
                ..
            })
        ));
    }

    /// A reservation refers to its own entry: once that entry is replaced under its request id,
    /// or retired, settling or dropping the reservation changes nothing, though its slot now
    /// holds another request's entry.
    #[test]
    fn a_reservation_settles_its_own_entry_only() {
        let b = budgets(dollars(1_000_000));
        let local = |b: &Budgets| {
            let l = b.lock();
            l.find(ScopeKind::User, "u")
                .map_or(0, |id| l.scope(id).meters[0].local)
        };
        let first = b.admit_leased("u", "r1", 300, NOW).unwrap().unwrap();
        let second = b.admit_leased("u", "r1", 500, NOW).unwrap().unwrap();
        assert_eq!((b.local_entries("u"), local(&b)), (1, 500));
        first.settle(100_000, 0);
        assert_eq!(local(&b), 500);
        // Still in flight when the month changes: retired, its slot free for the next request.
        let month = month_of_day(day_of(NOW)) + 1;
        let later = first_day_of_month(month) * DAY_MS;
        b.apply_feed(Feed {
            epoch: 7,
            seq: 0,
            day: day_of(later),
            month,
            ..Default::default()
        });
        assert_eq!(b.local_entries("u"), 0);
        let third = b.admit_leased("u", "r3", 700, later).unwrap().unwrap();
        assert_eq!(third.entry.slot, second.entry.slot);
        assert_eq!(b.lock().entries.slots.len(), 2);
        // Unsettled: it would count its reservation, were its entry still there.
        drop(second);
        assert_eq!((b.local_entries("u"), local(&b)), (1, 700));
        third.settle(600, 0);
        assert_eq!(local(&b), 600);
    }

    proptest::proptest! {
        /// Names compared as words are equal exactly when their bytes are, whatever their
        /// length and wherever they differ.
        #[test]
        fn names_compared_as_words_are_equal_as_bytes(
            a in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..24),
            at in 0usize..24,
            flip in 1u8..=255,
        ) {
            let mut b = a.clone();
            proptest::prop_assert!(same_name(&a, &b));
            if !b.is_empty() {
                let i = at % b.len();
                b[i] ^= flip;
                proptest::prop_assert!(!same_name(&a, &b));
                b[i] ^= flip;
            }
            b.push(a.first().copied().unwrap_or(0));
            proptest::prop_assert!(!same_name(&a, &b));
        }
    }

    proptest::proptest! {
        /// Every meter counts exactly its scope's entries started in its period, whatever the
        /// order of admits, settlements, deliveries, feeds and lease rounds, across minute and day
        /// boundaries, with clocks read out of order.
        #[test]
        fn meters_match_the_entries(ops in proptest::collection::vec((0u8..5, 0u64..40, 0u64..1_000, 0i64..3), 1..200)) {
            let big = 1u64 << 60;
            let b = budgets(BudgetRule {
                limit_micros: Some(big),
                period: Period::Day,
                requests_per_minute: Some(u32::MAX),
                limit_tokens: Some(big),
                tokens_per_minute: Some(big),
            });
            let mut held = Vec::new();
            let mut seq = 0;
            for (op, id, micros, step) in ops {
                // Times spread over three minutes on either side of a day boundary.
                let at = (day_of(NOW) + 1) * DAY_MS - MINUTE_MS + step * MINUTE_MS;
                match op {
                    0 => {
                        if let Ok(Some(r)) = b.admit_granted(&user("u"), &format!("r{id}"), micros, micros / 3, at) {
                            held.push(r);
                        }
                    }
                    1 => {
                        if !held.is_empty() {
                            held.swap_remove(usize::try_from(id).unwrap() % held.len()).settle(micros, micros / 2);
                        }
                    }
                    2 => {
                        seq += 1;
                        b.delivered([format!("r{id}").as_str()], 7, seq);
                    }
                    3 => {
                        b.lease_request("test", at);
                    }
                    _ => b.apply_feed(Feed { epoch: 7, seq, day: day_of(at), month: month_of_day(day_of(at)), ..Default::default() }),
                }
                let l = b.lock();
                let entries: Vec<&Entry> = l.entries.values().collect();
                // One entry per request id, each found under it.
                proptest::prop_assert_eq!(l.entries.by_key.len(), entries.len());
                for (at, e) in l.entries.iter() {
                    proptest::prop_assert_eq!(l.entries.find(&e.key), Some(at));
                }
                for e in &entries {
                    // The periods computed once per request (a month through the day's cache),
                    // at a time never before an earlier admission's.
                    let day = day_of(e.started_ms);
                    proptest::prop_assert_eq!(e.at, Periods::of_day(day, minute_of(e.started_ms)));
                    proptest::prop_assert!(e.started_ms <= l.clock_ms);
                }
                match l.find(ScopeKind::User, "u") {
                    None => proptest::prop_assert!(entries.is_empty()),
                    Some(id) => {
                        let s = l.scope(id);
                        proptest::prop_assert_eq!(s.entries as usize, entries.len());
                        proptest::prop_assert_eq!(s.meters.len(), UNITS);
                        for m in &s.meters {
                            let want: u64 = entries
                                .iter()
                                .filter(|e| e.at.of(m.span) == m.period)
                                .map(|e| e.amounts()[m.unit as usize])
                                .sum();
                            proptest::prop_assert_eq!(m.local, want, "{:?}", m);
                            // No entry is counted past its meter's period.
                            proptest::prop_assert!(entries.iter().all(|e| e.at.of(m.span) <= m.period));
                        }
                    }
                }
                // Every delivered entry is listed for retirement.
                for (at, e) in l.entries.iter() {
                    if matches!(e.state, EntryState::Delivered { .. }) {
                        proptest::prop_assert!(l.delivered.contains(&at));
                    }
                }
            }
        }
    }
}
