//! Budgets at every level: the rule both halves agree on, the scopes a budget can name, and UTC
//! periods as integers, so the dataplane and the controlplane count a request's spend toward the
//! same day, week and month and agree on when a period resets.
//!
//! A day is a count of UTC days since the Unix epoch; a week (ISO, starting Monday) is a count of
//! weeks since Monday 1969-12-29; a month is `year * 12 + (month - 1)`. Conversions use Howard
//! Hinnant's civil-date algorithms (exact for the proleptic Gregorian calendar), so no calendar
//! library is needed on the hot path.

pub const DAY_MS: i64 = 86_400_000;
pub const MINUTE_MS: i64 = 60_000;

/// A budget's period.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Period {
    Day,
    Week,
    Month,
}

impl Period {
    pub fn as_str(self) -> &'static str {
        match self {
            Period::Day => "day",
            Period::Week => "week",
            Period::Month => "month",
        }
    }

    /// The period containing `ms` (Unix milliseconds): a day, week or month number.
    pub fn index_of(self, ms: i64) -> i64 {
        match self {
            Period::Day => day_of(ms),
            Period::Week => week_of_day(day_of(ms)),
            Period::Month => month_of_day(day_of(ms)),
        }
    }

    /// The period containing day number `day`.
    pub fn index_of_day(self, day: i64) -> i64 {
        match self {
            Period::Day => day,
            Period::Week => week_of_day(day),
            Period::Month => month_of_day(day),
        }
    }

    /// When the period containing `ms` ends (Unix milliseconds).
    pub fn end_ms(self, ms: i64) -> i64 {
        match self {
            Period::Day => (day_of(ms) + 1) * DAY_MS,
            Period::Week => first_day_of_week(week_of_day(day_of(ms)) + 1) * DAY_MS,
            Period::Month => first_day_of_month(month_of_day(day_of(ms)) + 1) * DAY_MS,
        }
    }
}

/// What a budget names: requests of one key, of keys with a label, of an agent, a model, an env,
/// or of one end user.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ScopeKind {
    User,
    Key,
    Label,
    Agent,
    Model,
    Env,
}

impl ScopeKind {
    pub const ALL: [ScopeKind; 6] = [
        ScopeKind::User,
        ScopeKind::Key,
        ScopeKind::Label,
        ScopeKind::Agent,
        ScopeKind::Model,
        ScopeKind::Env,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ScopeKind::User => "user",
            ScopeKind::Key => "key",
            ScopeKind::Label => "label",
            ScopeKind::Agent => "agent",
            ScopeKind::Model => "model",
            ScopeKind::Env => "env",
        }
    }

    /// Its index in [`Self::ALL`] (tables indexed by kind).
    pub fn index(self) -> usize {
        self as usize
    }
}

impl std::str::FromStr for ScopeKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ScopeKind::ALL
            .into_iter()
            .find(|k| k.as_str() == s)
            .ok_or_else(|| {
                format!("scope must be user, key, label, agent, model or env, got {s:?}")
            })
    }
}

/// One budget's ledger: a scope kind and its value (an end user, a key id, `name=value` of a
/// key label, an agent, a model, an env). Defaults have no ledger of their own: the default for
/// keys counts each key on its own ledger, the default for end users each end user.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Scope {
    pub kind: ScopeKind,
    pub value: String,
}

impl Scope {
    pub fn new(kind: ScopeKind, value: impl Into<String>) -> Self {
        Scope {
            kind,
            value: value.into(),
        }
    }

    pub fn user(value: impl Into<String>) -> Self {
        Scope::new(ScopeKind::User, value)
    }
}

impl std::fmt::Display for Scope {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.kind.as_str(), self.value)
    }
}

/// What a budget is set on: a scope, or the default of every key or every end user without a
/// budget of its own.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Subject {
    Scope(Scope),
    DefaultKey,
    DefaultUser,
}

impl Subject {
    /// The stored form: `default` (end users), `default-key`, or `<kind>:<value>`.
    pub fn to_stored(&self) -> String {
        match self {
            Subject::DefaultUser => "default".to_owned(),
            Subject::DefaultKey => "default-key".to_owned(),
            Subject::Scope(s) => format!("{}:{}", s.kind.as_str(), s.value),
        }
    }

    pub fn from_stored(s: &str) -> Result<Self, String> {
        match s {
            "default" => Ok(Subject::DefaultUser),
            "default-key" => Ok(Subject::DefaultKey),
            _ => {
                let (kind, value) = s
                    .split_once(':')
                    .ok_or_else(|| format!("unknown budget subject {s:?}"))?;
                Ok(Subject::Scope(Scope::new(kind.parse()?, value)))
            }
        }
    }
}

/// Checks a scope value a client or an admin sends: 1 to 128 printable characters.
pub fn check_scope_value(kind: ScopeKind, value: &str) -> Result<(), String> {
    if kind == ScopeKind::User {
        return crate::parse_user(value)
            .map(|_| ())
            .map_err(|e| e.to_string());
    }
    if value.is_empty() || value.len() > 128 || value.chars().any(char::is_control) {
        return Err(format!(
            "a {} must be 1 to 128 printable characters",
            kind.as_str()
        ));
    }
    if kind == ScopeKind::Label && !value.contains('=') {
        return Err("a label budget names a key label as name=value".to_owned());
    }
    Ok(())
}

/// A budget: per `period`, at most `limit_micros` of spend and/or `limit_tokens` tokens; per
/// minute, at most `requests_per_minute` requests and/or `tokens_per_minute` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct BudgetRule {
    pub limit_micros: Option<u64>,
    pub period: Period,
    pub requests_per_minute: Option<u32>,
    #[serde(default)]
    pub limit_tokens: Option<u64>,
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
}

impl BudgetRule {
    /// A rule with only a spend limit.
    pub fn usd(limit_micros: u64, period: Period) -> Self {
        BudgetRule {
            limit_micros: Some(limit_micros),
            period,
            requests_per_minute: None,
            limit_tokens: None,
            tokens_per_minute: None,
        }
    }

    /// A rule must limit something.
    pub fn validate(&self) -> Result<(), &'static str> {
        if self.limit_micros.is_none()
            && self.requests_per_minute.is_none()
            && self.limit_tokens.is_none()
            && self.tokens_per_minute.is_none()
        {
            return Err(
                "a budget needs a spend, token, requests-per-minute or tokens-per-minute limit",
            );
        }
        if self.requests_per_minute == Some(0) || self.tokens_per_minute == Some(0) {
            return Err("a per-minute limit must be at least 1 (delete the budget instead)");
        }
        for limit in [self.limit_micros, self.limit_tokens, self.tokens_per_minute]
            .into_iter()
            .flatten()
        {
            if i64::try_from(limit).is_err() {
                return Err("a limit is too large");
            }
        }
        Ok(())
    }

    /// Whether the rule limits anything per period (dollars or tokens).
    pub fn has_period_limit(&self) -> bool {
        self.limit_micros.is_some() || self.limit_tokens.is_some()
    }
}

impl std::str::FromStr for Period {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "day" | "daily" => Ok(Period::Day),
            "week" | "weekly" => Ok(Period::Week),
            "month" | "monthly" => Ok(Period::Month),
            other => Err(format!("period must be day, week or month, got {other:?}")),
        }
    }
}

/// ISO week number (weeks since Monday 1969-12-29, day -3) of a day number.
pub fn week_of_day(day: i64) -> i64 {
    (day + 3).div_euclid(7)
}

/// First day number (a Monday) of a week number.
pub fn first_day_of_week(week: i64) -> i64 {
    week * 7 - 3
}

/// UTC day number of Unix milliseconds `ms`.
pub fn day_of(ms: i64) -> i64 {
    ms.div_euclid(DAY_MS)
}

/// UTC minute number of Unix milliseconds `ms`.
pub fn minute_of(ms: i64) -> i64 {
    ms.div_euclid(MINUTE_MS)
}

/// (year, month 1..=12, day 1..=31) of a day number.
pub fn civil_from_day(day: i64) -> (i64, u32, u32) {
    let z = day + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m as u32, d as u32)
}

/// Day number of a civil date.
pub fn day_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(m);
    let mp = if m > 2 { m - 3 } else { m + 9 };
    let doy = (153 * mp + 2) / 5 + i64::from(d) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Month number (`year * 12 + month - 1`) of a day number.
pub fn month_of_day(day: i64) -> i64 {
    let (y, m, _) = civil_from_day(day);
    y * 12 + i64::from(m) - 1
}

/// First day number of a month number.
pub fn first_day_of_month(month: i64) -> i64 {
    let y = month.div_euclid(12);
    let m = month.rem_euclid(12) as u32 + 1;
    day_from_civil(y, m, 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn known_dates() {
        assert_eq!(civil_from_day(0), (1970, 1, 1));
        assert_eq!(day_from_civil(2026, 11, 22), 20_779);
        assert_eq!(civil_from_day(20_779), (2026, 11, 22));
        assert_eq!(civil_from_day(day_from_civil(2024, 2, 29)), (2024, 2, 29));
        assert_eq!(month_of_day(20_779), 2026 * 12 + 10);
        assert_eq!(
            first_day_of_month(2026 * 12 + 11),
            day_from_civil(2026, 12, 1)
        );
    }

    #[test]
    fn period_ends() {
        let ms = day_from_civil(2026, 12, 31) * DAY_MS + 5_000;
        assert_eq!(Period::Day.end_ms(ms), day_from_civil(2027, 1, 1) * DAY_MS);
        assert_eq!(
            Period::Month.end_ms(ms),
            day_from_civil(2027, 1, 1) * DAY_MS
        );
        let feb = day_from_civil(2028, 2, 10) * DAY_MS;
        assert_eq!(
            Period::Month.end_ms(feb),
            day_from_civil(2028, 3, 1) * DAY_MS
        );
        assert_eq!(day_of(-1), -1);
    }

    #[test]
    fn weeks_start_on_monday_utc() {
        // 2026-11-23 is a Monday; 2026-11-29 a Sunday.
        let monday = day_from_civil(2026, 11, 23);
        assert_eq!(week_of_day(monday), week_of_day(monday + 6));
        assert_eq!(week_of_day(monday) + 1, week_of_day(monday + 7));
        assert_eq!(week_of_day(monday - 1) + 1, week_of_day(monday));
        assert_eq!(first_day_of_week(week_of_day(monday + 4)), monday);
        // The last millisecond of Sunday is in the week; Monday 00:00 UTC starts the next.
        let sunday_end = (monday + 7) * DAY_MS - 1;
        assert_eq!(Period::Week.end_ms(sunday_end), (monday + 7) * DAY_MS);
        assert_eq!(
            Period::Week.end_ms((monday + 7) * DAY_MS),
            (monday + 14) * DAY_MS
        );
        assert_eq!(
            Period::Week.index_of(sunday_end) + 1,
            Period::Week.index_of(sunday_end + 1)
        );
        // A week across a year's end (2026-12-28 Monday .. 2027-01-03 Sunday) is one week.
        assert_eq!(
            week_of_day(day_from_civil(2026, 12, 28)),
            week_of_day(day_from_civil(2027, 1, 3))
        );
        // 1970-01-01 was a Thursday: its week began Monday 1969-12-29.
        assert_eq!(
            first_day_of_week(week_of_day(0)),
            day_from_civil(1969, 12, 29)
        );
        assert_eq!(week_of_day(-4), -1);
    }

    #[test]
    fn subjects_round_trip_their_stored_form() {
        for s in [
            Subject::DefaultUser,
            Subject::DefaultKey,
            Subject::Scope(Scope::user("alice")),
            Subject::Scope(Scope::new(ScopeKind::Label, "team=search")),
            Subject::Scope(Scope::new(ScopeKind::Model, "gpt-4o:latest")),
        ] {
            assert_eq!(Subject::from_stored(&s.to_stored()), Ok(s));
        }
        assert!(Subject::from_stored("nope:x").is_err());
        assert!(check_scope_value(ScopeKind::Label, "team").is_err());
        assert!(check_scope_value(ScopeKind::Agent, "").is_err());
    }

    proptest! {
        #[test]
        fn weeks_have_seven_days(day in -1_000_000i64..1_000_000) {
            let w = week_of_day(day);
            prop_assert!(first_day_of_week(w) <= day && day < first_day_of_week(w + 1));
            prop_assert_eq!(first_day_of_week(w + 1) - first_day_of_week(w), 7);
            // Monday: 1970-01-05 (day 4) was one.
            prop_assert_eq!((first_day_of_week(w) - 4).rem_euclid(7), 0);
        }

        #[test]
        fn civil_round_trips(day in -1_000_000i64..1_000_000) {
            let (y, m, d) = civil_from_day(day);
            prop_assert_eq!(day_from_civil(y, m, d), day);
            let month = month_of_day(day);
            prop_assert!(first_day_of_month(month) <= day);
            prop_assert!(first_day_of_month(month + 1) > day);
        }
    }
}

// === the budget feed ===

/// One scope's spend and tokens in the current periods, and its admitted requests and tokens in
/// the current minute, as the controlplane counts them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Spend {
    pub day_micros: u64,
    pub month_micros: u64,
    /// UTC minute (Unix minutes) that `minute_requests` and `minute_tokens` count.
    pub minute: i64,
    pub minute_requests: u32,
    pub week_micros: u64,
    pub day_tokens: u64,
    pub week_tokens: u64,
    pub month_tokens: u64,
    pub minute_tokens: u64,
}

impl Spend {
    /// `(micros, tokens)` in the current `period`.
    pub fn in_period(&self, period: Period) -> (u64, u64) {
        match period {
            Period::Day => (self.day_micros, self.day_tokens),
            Period::Week => (self.week_micros, self.week_tokens),
            Period::Month => (self.month_micros, self.month_tokens),
        }
    }
}

/// One message of the controlplane's budget feed to its dataplanes: a full state (rules and
/// every scope's spend), or the scopes whose spend changed, or (empty) a heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Feed {
    /// Changes whenever the controlplane restarts; `seq` counts ingested batches within it.
    pub epoch: u64,
    pub seq: u64,
    /// Replaces everything known (rules and spend).
    pub full: bool,
    /// With `full`: the default for end users, the default for keys, and the budgets of scopes.
    pub default: Option<BudgetRule>,
    pub default_key: Option<BudgetRule>,
    pub overrides: Vec<(Scope, BudgetRule)>,
    /// With `full`: the key ids holding each label a budget names (`name=value`).
    pub label_keys: Vec<(String, Vec<String>)>,
    pub spend: Vec<(Scope, Spend)>,
    /// The controlplane's current day and month the spend counts toward (the week is the day's).
    pub day: i64,
    pub month: i64,
}

// === leases: the bound across dataplanes ===
//
// Each dataplane may spend, per budget and period, only what the controlplane leased it. A
// dataplane's *claim* on a budget is what it may still add to the controlplane's recorded spend:
// its admitted requests whose spend is not in the feed yet, plus the unused part of its lease.
// The controlplane grants only from `limit - recorded spend - every live dataplane's claim`, so
// the claims never sum past what remains; a dataplane admits while its unused lease is positive,
// so it overshoots its own lease by at most one reservation. Total spend is then at most the
// limit plus one reservation per dataplane. See docs/budgets.md.

/// What a lease counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LeaseUnit {
    /// Micro-dollars in the period of the rule's spend limit (`period` is its day, week or month
    /// number).
    Micros,
    /// Requests started in one UTC minute (`period` is the minute number).
    Requests,
    /// Tokens in the period of the rule's token limit.
    Tokens,
    /// Tokens of requests started in one UTC minute.
    MinuteTokens,
}

impl LeaseUnit {
    pub const ALL: [LeaseUnit; 4] = [
        LeaseUnit::Micros,
        LeaseUnit::Requests,
        LeaseUnit::Tokens,
        LeaseUnit::MinuteTokens,
    ];

    /// Whether the unit counts per minute (else per the rule's period).
    pub fn per_minute(self) -> bool {
        matches!(self, LeaseUnit::Requests | LeaseUnit::MinuteTokens)
    }

    /// The rule's limit in this unit, if it has one.
    pub fn limit(self, rule: &BudgetRule) -> Option<u64> {
        match self {
            LeaseUnit::Micros => rule.limit_micros,
            LeaseUnit::Requests => rule.requests_per_minute.map(u64::from),
            LeaseUnit::Tokens => rule.limit_tokens,
            LeaseUnit::MinuteTokens => rule.tokens_per_minute,
        }
    }

    /// The period a lease of this unit under `rule` counts toward at `now_ms`.
    pub fn period_at(self, rule: &BudgetRule, now_ms: i64) -> i64 {
        if self.per_minute() {
            minute_of(now_ms)
        } else {
            rule.period.index_of(now_ms)
        }
    }

    /// What `spend` (the controlplane's) holds in this unit for `period` under `rule`: 0 for a
    /// period other than the spend's current one.
    pub fn recorded(self, rule: &BudgetRule, spend: &Spend, current: i64, period: i64) -> u64 {
        match self {
            LeaseUnit::Micros | LeaseUnit::Tokens => {
                if period != current {
                    return 0;
                }
                let (micros, tokens) = spend.in_period(rule.period);
                if self == LeaseUnit::Micros {
                    micros
                } else {
                    tokens
                }
            }
            LeaseUnit::Requests if spend.minute == period => u64::from(spend.minute_requests),
            LeaseUnit::MinuteTokens if spend.minute == period => spend.minute_tokens,
            _ => 0,
        }
    }
}

/// One budget in one period: a scope's spend, token or rate limit.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseKey {
    pub scope: Scope,
    pub unit: LeaseUnit,
    pub period: i64,
}

/// A dataplane's report on one budget: its claim now, and how much more it would like.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseClaim {
    pub key: LeaseKey,
    pub claim: u64,
    pub want: u64,
}

/// A dataplane's full report: every budget it holds a claim on (a budget missing from it is
/// released). `instance` is random per process, so two dataplanes never share claims.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaseRequest {
    pub dataplane: String,
    pub instance: u64,
    pub claims: Vec<LeaseClaim>,
}

/// What was granted, per budget of the request (same order), and for how long claims count
/// without a new report.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaseResponse {
    /// `granted[i]` is added to the unused lease of `claims[i]`; 0 when nothing was free.
    pub granted: Vec<u64>,
    pub ttl_ms: u64,
}

/// The controlplane's grant for one budget: what `want` may get when `limit` minus `spent`
/// (recorded) minus `others` (the live claims of the other dataplanes) minus `own` (the
/// requester's claim) is left, shared evenly with the `holders` other dataplanes that hold a
/// claim on it. Never more than what is free, so the claims never sum past the limit.
pub fn grant(limit: u64, spent: u64, others: u64, own: u64, want: u64, holders: usize) -> u64 {
    let free = limit
        .saturating_sub(spent)
        .saturating_sub(others)
        .saturating_sub(own);
    if free == 0 {
        return 0;
    }
    let share = free.div_ceil(holders as u64 + 1);
    want.min(share).max(1).min(free)
}

#[cfg(test)]
mod lease_tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn grants_share_what_is_free() {
        assert_eq!(grant(50_000, 0, 0, 0, 24_000, 0), 24_000);
        assert_eq!(grant(50_000, 0, 24_000, 0, 24_000, 1), 13_000);
        assert_eq!(grant(50_000, 10_000, 24_000, 16_000, 5, 1), 0);
        // A sliver left is still granted: it admits one request (the one reservation over).
        assert_eq!(grant(50_000, 49_999, 0, 0, 6_000, 3), 1);
        assert_eq!(grant(10, 20, 0, 0, 6_000, 0), 0);
    }

    proptest! {
        /// Whatever the order of grants to up to four dataplanes, each admitting while its
        /// unused lease is positive, spend never passes the limit plus one reservation each.
        #[test]
        fn spend_stays_within_the_bound(
            limit in 1u64..200_000,
            steps in proptest::collection::vec((0usize..4, 1u64..20_000, 0u8..3), 1..300),
        ) {
            let max_reservation = 20_000;
            // Per dataplane: unused lease (may go negative by one reservation) and spend.
            let mut unused = [0i64; 4];
            let mut spent = [0u64; 4];
            for (dp, amount, op) in steps {
                match op {
                    0 => {
                        let claims: Vec<u64> = (0..4).map(|d| spent[d] + unused[d].max(0) as u64).collect();
                        let others: u64 = (0..4).filter(|d| *d != dp).map(|d| claims[d]).sum();
                        // Recorded spend is already inside the claims here (nothing delivered).
                        let holders = (0..4).filter(|d| *d != dp && claims[*d] > 0).count();
                        let g = grant(limit, 0, others, claims[dp], amount, holders);
                        unused[dp] += g as i64;
                    }
                    1 => {
                        if unused[dp] > 0 {
                            unused[dp] -= amount as i64;
                            spent[dp] += amount;
                        }
                    }
                    _ => {
                        // Idle: return the unused lease.
                        unused[dp] = unused[dp].min(0);
                    }
                }
                let total: u64 = spent.iter().sum();
                prop_assert!(total <= limit + 4 * max_reservation, "{total} > {limit} + 4 reservations");
            }
        }
    }
}
