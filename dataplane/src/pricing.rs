//! Model prices and cost arithmetic in integer micro-dollars.
//!
//! Money never touches floating point: a price is micro-dollars per million tokens (`u64`;
//! $2.50 / 1M tokens is `2_500_000`), a cost is micro-dollars, and a cost is one sum of
//! `tokens x price` in `u128`, divided by a million once at the end. Prices written by people
//! (the built-in table below, the config file) are decimal strings parsed exactly, so "0.075"
//! is 75_000 and never 74_999.
//!
//! The gateway ships a [`PriceTable::builtin`] table so costs work with no setup; price rows
//! from the config file ([`PriceSpec`]) add models or replace built-in prices
//! ([`PriceTable::with_overrides`]), which is how an operator corrects a stale or negotiated price.
//!
//! Model ids are matched exactly after stripping version decorations the providers add (dated
//! snapshots, `-latest`, Gemini's `models/`, Vertex's `@date`): `gpt-4o-2024-08-06` costs what
//! `gpt-4o` costs, but `gpt-4o-mini` never falls back to `gpt-4o`, and an unknown model is
//! reported as unknown rather than priced like a look-alike.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;

use foldhash::fast::RandomState;
use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};

use nm_types::money::{Fault, MAX_DECIMALS, parse_micros};

use crate::usage::Usage;

/// Micro-dollars in one dollar; also the token count a price is quoted for (one million).
const MILLION: u64 = 1_000_000;

// === Prices ===

/// What one model costs, in micro-dollars per million tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelPrice {
    /// Prompt tokens neither read from nor written to a cache.
    pub input: u64,
    /// Generated tokens, reasoning included.
    pub output: u64,
    /// Prompt tokens read from the provider's cache; `None` bills them at `input`.
    pub cached_input: Option<u64>,
    /// Prompt tokens written to the provider's cache; `None` bills them at `input`.
    pub cache_write: Option<u64>,
}

/// A price for one `(provider, model)`, as the config file gives it after parsing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PriceRow {
    pub provider: String,
    pub model: String,
    pub price: ModelPrice,
}

/// What an answer cost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cost {
    Known {
        micros: u64,
    },
    /// No model was named, or the table has no price for it.
    UnknownModel,
    /// The provider reported neither input nor output tokens.
    UnknownUsage,
}

/// What the table holds for one model at one provider (`None`: no price), as one lookup found
/// it: a budgeted request's reservation is priced with it, and its answer's cost reuses it when
/// the answer names the same model (or none), instead of looking it up again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Found(pub Option<ModelPrice>);

impl Cost {
    /// The cost of `usage` at `price`; [`Cost::UnknownModel`] without one.
    pub fn at(price: Option<&ModelPrice>, usage: &Usage) -> Cost {
        let Some(price) = price else {
            return Cost::UnknownModel;
        };
        match price.usage_micros(usage) {
            Some(micros) => Cost::Known { micros },
            None => Cost::UnknownUsage,
        }
    }

    pub fn micros(self) -> Option<u64> {
        match self {
            Self::Known { micros } => Some(micros),
            Self::UnknownModel | Self::UnknownUsage => None,
        }
    }
}

/// How to turn a micro-dollar-times-a-million numerator into micro-dollars.
#[derive(Debug, Clone, Copy)]
enum Rounding {
    /// Costs: the nearest micro-dollar, half a micro-dollar up.
    HalfUp,
    /// Reservations: never below the exact amount.
    Up,
}

// === impl ModelPrice ===

impl ModelPrice {
    /// The price of a cache read.
    pub fn cached_input_price(&self) -> u64 {
        self.cached_input.unwrap_or(self.input)
    }

    /// The price of a cache write.
    pub fn cache_write_price(&self) -> u64 {
        self.cache_write.unwrap_or(self.input)
    }

    /// The cost of `usage` in micro-dollars, rounded half up; `None` when the provider reported
    /// neither input nor output tokens.
    ///
    /// - Input tokens are split into cache reads, cache writes and the fresh rest, each at its own
    ///   price. The parts are bounded by the whole (reads first, then writes): `input_tokens` is
    ///   what the provider bills, so a report whose parts exceed it is not charged twice.
    /// - An unknown side counts as zero: known input with unknown output costs the input only,
    ///   and vice versa (with unknown input, cache counts are unknown parts of it and count zero).
    /// - The result saturates at `u64::MAX` micro-dollars (about $18 trillion) instead of
    ///   overflowing.
    pub fn usage_micros(&self, usage: &Usage) -> Option<u64> {
        if !usage.is_known() {
            return None;
        }
        let input = usage.input_tokens.unwrap_or(0);
        let cached = usage.cached_input_tokens.unwrap_or(0).min(input);
        let written = usage.cache_write_tokens.unwrap_or(0).min(input - cached);
        let fresh = input - cached - written;
        let numerator = weighted_sum(&[
            (fresh, self.input),
            (cached, self.cached_input_price()),
            (written, self.cache_write_price()),
            (usage.output_tokens.unwrap_or(0), self.output),
        ]);
        Some(to_micros(numerator, Rounding::HalfUp))
    }

    /// A budget reservation for `input_tokens` at the input price and `output_tokens` at the
    /// output price, rounded up so rounding never makes it short. Cache reads make the real
    /// cost lower; cache writes (Anthropic's 1.25x) can make it higher, since the request, not
    /// the estimate, decides what is written.
    pub fn estimate_micros(&self, input_tokens: u64, output_tokens: u64) -> u64 {
        let numerator = weighted_sum(&[(input_tokens, self.input), (output_tokens, self.output)]);
        to_micros(numerator, Rounding::Up)
    }
}

/// `sum(tokens x price)`: micro-dollars times a million. A product of two `u64` always fits in
/// `u128`; only the sum can overflow, and it saturates.
fn weighted_sum(terms: &[(u64, u64)]) -> u128 {
    terms.iter().fold(0u128, |sum, &(tokens, price)| {
        sum.saturating_add(u128::from(tokens) * u128::from(price))
    })
}

/// Divides by a million once, rounding as asked, saturating at `u64::MAX`.
fn to_micros(numerator: u128, rounding: Rounding) -> u64 {
    let million = u128::from(MILLION);
    let bias = match rounding {
        Rounding::HalfUp => million / 2,
        Rounding::Up => million - 1,
    };
    u64::try_from(numerator.saturating_add(bias) / million).unwrap_or(u64::MAX)
}

// === impl PriceTable ===

/// One provider's prices by model id.
type Models = HashMap<String, ModelPrice, RandomState>;

/// Prices by provider and model. Names are matched case-insensitively and kept in lower case.
#[derive(Debug, Clone, Default)]
pub struct PriceTable {
    /// provider -> model -> price. Hash maps: a look-up on every request (the answer's cost;
    /// for a budgeted request the reservation's, whose price the cost reuses, [`Found`]).
    providers: HashMap<String, Models, RandomState>,
}

impl PriceTable {
    /// The table shipped in the binary; the comment on its rows gives their date and sources.
    pub fn builtin() -> Self {
        Self::default().with_overrides(BUILTIN.iter().flat_map(|row| {
            row.models.iter().map(|model| PriceRow {
                provider: row.provider.to_owned(),
                model: (*model).to_owned(),
                price: row.price,
            })
        }))
    }

    /// Adds `rows`, replacing any price already held for the same `(provider, model)`.
    pub fn with_overrides(mut self, rows: impl IntoIterator<Item = PriceRow>) -> Self {
        for row in rows {
            self.providers
                .entry(row.provider.to_ascii_lowercase())
                .or_default()
                .insert(row.model.to_ascii_lowercase(), row.price);
        }
        self
    }

    /// Number of `(provider, model)` prices.
    pub fn len(&self) -> usize {
        self.providers.values().map(HashMap::len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every `(provider, model, price)`, sorted by provider then model.
    pub fn rows(&self) -> impl Iterator<Item = (&str, &str, &ModelPrice)> {
        let mut rows: Vec<_> = self
            .providers
            .iter()
            .flat_map(|(provider, models)| {
                models
                    .iter()
                    .map(move |(model, price)| (provider.as_str(), model.as_str(), price))
            })
            .collect();
        rows.sort_unstable_by(|a, b| (a.0, a.1).cmp(&(b.0, b.1)));
        rows.into_iter()
    }

    /// The price of `model` at `provider`.
    ///
    /// Tries the id as given, then strips one decoration at a time and tries again: a `models/`
    /// prefix, an `@...` suffix (Vertex), `-latest`, `-preview-MM-DD` / `-preview-MM-YYYY`
    /// (Gemini), and a trailing date or version number (`-2024-08-06`, `-20250929`, `-2411`,
    /// `-001`). Name parts are never stripped, so a model never takes a look-alike's price.
    /// Anthropic ids written with dots (`claude-sonnet-4.5`) mean the dashed id. At `openrouter`,
    /// an id without its own row is looked up as `vendor/model` at the vendor.
    pub fn lookup(&self, provider: &str, model: &str) -> Option<&ModelPrice> {
        let provider = lowercase(provider);
        let model = lowercase(model);
        if let Some(price) = self.lookup_at(&provider, &model) {
            return Some(price);
        }
        if provider != "openrouter" {
            return None;
        }
        let (vendor, vendor_model) = model.split_once('/')?;
        self.lookup_at(openrouter_vendor(vendor), vendor_model)
    }

    /// The cost of an answer from `model` at `provider`. A missing model or price wins over
    /// missing usage: [`Cost::UnknownModel`] says which of the two an operator can fix with a
    /// price row.
    pub fn cost(&self, provider: &str, model: Option<&str>, usage: &Usage) -> Cost {
        Cost::at(model.and_then(|model| self.lookup(provider, model)), usage)
    }

    /// What the table holds for `model` at `provider`, to keep ([`Found`]).
    pub fn find(&self, provider: &str, model: Option<&str>) -> Found {
        Found(
            model
                .and_then(|model| self.lookup(provider, model))
                .copied(),
        )
    }

    /// A budget reservation (see [`ModelPrice::estimate_micros`]); `None` for an unknown model.
    pub fn estimate_micros(
        &self,
        provider: &str,
        model: &str,
        input_tokens: u64,
        output_tokens: u64,
    ) -> Option<u64> {
        self.lookup(provider, model)
            .map(|price| price.estimate_micros(input_tokens, output_tokens))
    }

    /// Lookup within one provider's rows; both names already lower case.
    fn lookup_at(&self, provider: &str, model: &str) -> Option<&ModelPrice> {
        let models = self.providers.get(provider)?;
        find_undecorated(models, model).or_else(|| {
            // Anthropic's ids never contain dots; OpenRouter spells them `claude-sonnet-4.5`.
            (provider == "anthropic" && model.contains('.'))
                .then(|| model.replace('.', "-"))
                .and_then(|dashed| find_undecorated(models, &dashed))
        })
    }
}

fn lowercase(name: &str) -> Cow<'_, str> {
    if name.bytes().any(|b| b.is_ascii_uppercase()) {
        Cow::Owned(name.to_ascii_lowercase())
    } else {
        Cow::Borrowed(name)
    }
}

/// OpenRouter's vendor prefix -> the built-in provider that sells the model, where they differ.
fn openrouter_vendor(vendor: &str) -> &str {
    match vendor {
        "google" => "gemini",
        "x-ai" => "xai",
        "mistralai" => "mistral",
        other => other,
    }
}

/// `model` or the first of its undecorated forms that has a row.
fn find_undecorated<'t>(models: &'t Models, model: &str) -> Option<&'t ModelPrice> {
    let mut candidate = model;
    loop {
        if let Some(price) = models.get(candidate) {
            return Some(price);
        }
        candidate = strip_decoration(candidate)?;
    }
}

/// `model` without its outermost version decoration, or `None` when it has none.
fn strip_decoration(model: &str) -> Option<&str> {
    if let Some(rest) = model.strip_prefix("models/") {
        return Some(rest);
    }
    if let Some((base, _)) = model.rsplit_once('@') {
        return Some(base);
    }
    if let Some(base) = model.strip_suffix("-latest") {
        return Some(base);
    }
    // Gemini previews: `-preview-05-20`, `-preview-09-2025`.
    let preview = [&[2, 2][..], &[2, 4]]
        .into_iter()
        .find_map(|groups| strip_digit_groups(model, groups)?.strip_suffix("-preview"));
    if preview.is_some() {
        return preview;
    }
    // `-2024-08-06` (OpenAI), `-20250929` (Anthropic), `-2411` / `-0613` (Mistral YYMM,
    // OpenAI and xAI MMDD), `-001` (Gemini).
    [&[4, 2, 2][..], &[8], &[4], &[3]]
        .into_iter()
        .find_map(|groups| strip_digit_groups(model, groups))
}

/// `model` without a trailing `-`-separated run of digit groups of exactly these lengths
/// (`[4, 2, 2]` matches `-2024-08-06`).
fn strip_digit_groups<'m>(model: &'m str, groups: &[usize]) -> Option<&'m str> {
    groups.iter().rev().try_fold(model, |rest, &len| {
        let (head, tail) = rest.rsplit_once('-')?;
        (tail.len() == len && tail.bytes().all(|b| b.is_ascii_digit())).then_some(head)
    })
}

// === Config rows ===

/// One price row of the config file. Prices are dollars per million tokens, written as a
/// string (`"2.50"`, exact) or a number (`2.5`, read through its shortest decimal form).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PriceSpec {
    pub provider: String,
    pub model: String,
    pub input: Dollars,
    pub output: Dollars,
    #[serde(default)]
    pub cached_input: Option<Dollars>,
    #[serde(default)]
    pub cache_write: Option<Dollars>,
}

/// A dollar amount as the config wrote it, kept as decimal text until parsed exactly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dollars(String);

/// Why a price was rejected. Each variant names the value as written.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PriceError {
    #[error("price is empty: write dollars per million tokens, e.g. \"2.50\"")]
    Empty,
    #[error("price {value:?} is negative")]
    Negative { value: String },
    #[error("price {value:?} is not a decimal number of dollars per million tokens, e.g. \"2.50\"")]
    NotDecimal { value: String },
    #[error(
        "price {value:?} has more than {MAX_DECIMALS} decimal places \
         (one micro-dollar per million tokens is the smallest step)"
    )]
    TooManyDecimals { value: String },
    #[error("price {value:?} is too large")]
    Overflow { value: String },
    #[error("price row has an empty {field}")]
    EmptyName { field: &'static str },
    #[error("price row {provider}/{model}, {field}: {source}")]
    InRow {
        provider: String,
        model: String,
        field: &'static str,
        #[source]
        source: Box<PriceError>,
    },
}

/// Dollars per million tokens (`"2.50"`) -> micro-dollars per million tokens (`2_500_000`),
/// exactly: plain decimal digits with at most six decimal places, surrounding spaces ignored.
pub fn parse_dollars_per_mtok(text: &str) -> Result<u64, PriceError> {
    parse_micros(text).map_err(|fault| naming(fault, text))
}

/// Names the value a [`Fault`] was found in.
fn naming(fault: Fault, text: &str) -> PriceError {
    let value = text.to_owned();
    match fault {
        Fault::Empty => PriceError::Empty,
        Fault::Negative => PriceError::Negative { value },
        Fault::NotDecimal => PriceError::NotDecimal { value },
        Fault::TooManyDecimals => PriceError::TooManyDecimals { value },
        Fault::Overflow => PriceError::Overflow { value },
    }
}

// === impl Dollars ===

impl Dollars {
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Micro-dollars per million tokens.
    pub fn micros(&self) -> Result<u64, PriceError> {
        parse_dollars_per_mtok(&self.0)
    }
}

impl From<&str> for Dollars {
    fn from(text: &str) -> Self {
        Self(text.to_owned())
    }
}

impl From<u64> for Dollars {
    fn from(dollars: u64) -> Self {
        Self(dollars.to_string())
    }
}

impl From<i64> for Dollars {
    fn from(dollars: i64) -> Self {
        Self(dollars.to_string())
    }
}

impl From<f64> for Dollars {
    /// Through `Display`, the shortest decimal that reads back as the same float: `2.675` stays
    /// "2.675" where `2.675 * 1e6` would be 2_674_999.99...
    fn from(dollars: f64) -> Self {
        Self(dollars.to_string())
    }
}

impl<'de> Deserialize<'de> for Dollars {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct DollarsVisitor;

        impl Visitor<'_> for DollarsVisitor {
            type Value = Dollars;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("dollars per million tokens, as a string (\"2.50\") or a number")
            }

            fn visit_str<E: de::Error>(self, text: &str) -> Result<Dollars, E> {
                Ok(Dollars::from(text))
            }

            fn visit_u64<E: de::Error>(self, dollars: u64) -> Result<Dollars, E> {
                Ok(Dollars::from(dollars))
            }

            fn visit_i64<E: de::Error>(self, dollars: i64) -> Result<Dollars, E> {
                Ok(Dollars::from(dollars))
            }

            fn visit_f64<E: de::Error>(self, dollars: f64) -> Result<Dollars, E> {
                Ok(Dollars::from(dollars))
            }
        }

        deserializer.deserialize_any(DollarsVisitor)
    }
}

// === impl PriceSpec ===

impl TryFrom<PriceSpec> for PriceRow {
    type Error = PriceError;

    fn try_from(spec: PriceSpec) -> Result<Self, PriceError> {
        if spec.provider.trim().is_empty() {
            return Err(PriceError::EmptyName { field: "provider" });
        }
        if spec.model.trim().is_empty() {
            return Err(PriceError::EmptyName { field: "model" });
        }
        let field = |field: &'static str, dollars: &Dollars| {
            dollars.micros().map_err(|source| PriceError::InRow {
                provider: spec.provider.clone(),
                model: spec.model.clone(),
                field,
                source: Box::new(source),
            })
        };
        let optional =
            |name, dollars: &Option<Dollars>| dollars.as_ref().map(|d| field(name, d)).transpose();
        let price = ModelPrice {
            input: field("input", &spec.input)?,
            output: field("output", &spec.output)?,
            cached_input: optional("cached_input", &spec.cached_input)?,
            cache_write: optional("cache_write", &spec.cache_write)?,
        };
        Ok(Self {
            provider: spec.provider,
            model: spec.model,
            price,
        })
    }
}

// === Built-in table ===

/// One row of the built-in table: every id in `models` has this price.
struct Builtin {
    provider: &'static str,
    models: &'static [&'static str],
    price: ModelPrice,
}

/// Input and output prices in dollars per million tokens.
const fn row(
    provider: &'static str,
    models: &'static [&'static str],
    input: &str,
    output: &str,
) -> Builtin {
    Builtin {
        provider,
        models,
        price: ModelPrice {
            input: usd(input),
            output: usd(output),
            cached_input: None,
            cache_write: None,
        },
    }
}

impl Builtin {
    /// The cache-read price.
    const fn cached(mut self, dollars: &str) -> Self {
        self.price.cached_input = Some(usd(dollars));
        self
    }

    /// The cache-write price (Anthropic's 5-minute writes).
    const fn cache_write(mut self, dollars: &str) -> Self {
        self.price.cache_write = Some(usd(dollars));
        self
    }
}

/// A dollar literal of the built-in table; evaluated at compile time, so a typo fails the build.
const fn usd(dollars: &str) -> u64 {
    match parse_micros(dollars) {
        Ok(micros) => micros,
        Err(_) => panic!("invalid dollar literal in the built-in price table"),
    }
}

/// Published list prices (standard tier, USD per million tokens), taken on 2026-11-22 from the
/// providers' pricing pages (and copies of them dated April to November 2026). Prices change
/// often: the config file's price rows override any row here.
///
/// Where a provider has tiers, the row is the base tier and the comment says so; batch, flex
/// and priority tiers and audio input are not modelled.
#[rustfmt::skip]
static BUILTIN: &[Builtin] = &[
    // --- openai: developers.openai.com/api/docs/pricing ---
    row("openai", &["gpt-5.5"], "5.00", "30.00").cached("0.50"),
    row("openai", &["gpt-5.5-pro", "gpt-5.4-pro"], "30.00", "180.00"),
    // Base tier: GPT-5.4 bills prompts over 272K tokens at 2x input and 1.5x output.
    row("openai", &["gpt-5.4"], "2.50", "15.00").cached("0.25"),
    row("openai", &["gpt-5.4-mini"], "0.75", "4.50").cached("0.075"),
    row("openai", &["gpt-5.4-nano"], "0.20", "1.25").cached("0.02"),
    row("openai", &["gpt-5.2"], "1.75", "14.00").cached("0.175"),
    row("openai", &["gpt-5.2-pro"], "21.00", "168.00"),
    row("openai", &["gpt-5.1", "gpt-5.1-chat-latest", "gpt-5.1-codex", "gpt-5.1-codex-max"], "1.25", "10.00").cached("0.125"),
    row("openai", &["gpt-5", "gpt-5-chat-latest", "gpt-5-codex"], "1.25", "10.00").cached("0.125"),
    row("openai", &["gpt-5-mini", "gpt-5.1-codex-mini"], "0.25", "2.00").cached("0.025"),
    row("openai", &["gpt-5-nano"], "0.05", "0.40").cached("0.005"),
    row("openai", &["gpt-5-pro"], "15.00", "120.00"),
    row("openai", &["gpt-4.1"], "2.00", "8.00").cached("0.50"),
    row("openai", &["gpt-4.1-mini"], "0.40", "1.60").cached("0.10"),
    row("openai", &["gpt-4.1-nano"], "0.10", "0.40").cached("0.025"),
    row("openai", &["gpt-4o"], "2.50", "10.00").cached("1.25"),
    // The first gpt-4o snapshot kept its launch price.
    row("openai", &["gpt-4o-2024-05-13"], "5.00", "15.00"),
    row("openai", &["gpt-4o-mini"], "0.15", "0.60").cached("0.075"),
    row("openai", &["o3"], "2.00", "8.00").cached("0.50"),
    row("openai", &["o3-pro"], "20.00", "80.00"),
    row("openai", &["o3-mini", "o1-mini"], "1.10", "4.40").cached("0.55"),
    row("openai", &["o4-mini"], "1.10", "4.40").cached("0.275"),
    row("openai", &["o1"], "15.00", "60.00").cached("7.50"),
    row("openai", &["o1-pro"], "150.00", "600.00"),
    row("openai", &["text-embedding-3-small"], "0.02", "0"),
    row("openai", &["text-embedding-3-large"], "0.13", "0"),
    row("openai", &["text-embedding-ada-002"], "0.10", "0"),

    // --- anthropic: platform.claude.com/docs/en/about-claude/pricing ---
    // Cache reads are 0.1x input, 5-minute cache writes 1.25x (1-hour writes, 2x, are not
    // reported apart). Base tier: Sonnet 4 and 4.5 bill prompts over 200K tokens at $6 / $22.50.
    row("anthropic", &["claude-opus-4-8", "claude-opus-4-7", "claude-opus-4-6", "claude-opus-4-5"], "5.00", "25.00").cached("0.50").cache_write("6.25"),
    row("anthropic", &["claude-opus-4-1", "claude-opus-4", "claude-opus-4-0"], "15.00", "75.00").cached("1.50").cache_write("18.75"),
    row("anthropic", &["claude-sonnet-4-6", "claude-sonnet-4-5", "claude-sonnet-4", "claude-sonnet-4-0"], "3.00", "15.00").cached("0.30").cache_write("3.75"),
    row("anthropic", &["claude-3-7-sonnet", "claude-3-5-sonnet", "claude-3-5-sonnet-v2"], "3.00", "15.00").cached("0.30").cache_write("3.75"),
    row("anthropic", &["claude-haiku-4-5"], "1.00", "5.00").cached("0.10").cache_write("1.25"),
    row("anthropic", &["claude-3-5-haiku"], "0.80", "4.00").cached("0.08").cache_write("1.00"),
    row("anthropic", &["claude-3-haiku"], "0.25", "1.25").cached("0.03").cache_write("0.30"),

    // --- gemini: ai.google.dev/gemini-api/docs/pricing (paid tier, text/image/video input) ---
    // Base tier: the Pro models bill prompts over 200K tokens higher (3.x $4 / $18, cached
    // $0.40; 2.5 $2.50 / $15, cached $0.25). Gemini reports no cache writes (explicit caches
    // bill storage per hour, which is not a token price).
    row("gemini", &["gemini-3.1-pro-preview", "gemini-3-pro-preview"], "2.00", "12.00").cached("0.20"),
    row("gemini", &["gemini-3-flash-preview"], "0.50", "3.00").cached("0.05"),
    row("gemini", &["gemini-2.5-pro"], "1.25", "10.00").cached("0.125"),
    row("gemini", &["gemini-2.5-flash"], "0.30", "2.50").cached("0.03"),
    row("gemini", &["gemini-2.5-flash-lite"], "0.10", "0.40").cached("0.01"),
    row("gemini", &["gemini-2.0-flash"], "0.10", "0.40").cached("0.025"),
    row("gemini", &["gemini-2.0-flash-lite"], "0.075", "0.30"),

    // --- groq: groq.com/pricing ---
    row("groq", &["llama-3.3-70b-versatile"], "0.59", "0.79"),
    row("groq", &["llama-3.1-8b-instant"], "0.05", "0.08"),
    row("groq", &["openai/gpt-oss-120b"], "0.15", "0.60").cached("0.075"),
    row("groq", &["openai/gpt-oss-20b"], "0.075", "0.30"),
    row("groq", &["meta-llama/llama-4-scout-17b-16e-instruct"], "0.11", "0.34"),
    row("groq", &["meta-llama/llama-4-maverick-17b-128e-instruct"], "0.20", "0.60"),
    row("groq", &["qwen/qwen3-32b"], "0.29", "0.59"),
    row("groq", &["moonshotai/kimi-k2-instruct-0905", "moonshotai/kimi-k2-instruct"], "1.00", "3.00").cached("0.50"),

    // --- mistral: mistral.ai/pricing ---
    // `-latest` aliases follow the current generation: Large 3 and Medium 3.5 (since 2026-05);
    // the older dated snapshots keep their own prices.
    row("mistral", &["mistral-large"], "0.50", "1.50"),
    row("mistral", &["mistral-large-2411", "mistral-large-2407"], "2.00", "6.00"),
    row("mistral", &["mistral-medium", "mistral-medium-3.5", "mistral-medium-3"], "1.50", "7.50"),
    row("mistral", &["mistral-medium-2508", "mistral-medium-2505"], "0.40", "2.00"),
    row("mistral", &["mistral-small"], "0.10", "0.30"),
    row("mistral", &["codestral"], "0.30", "0.90"),
    row("mistral", &["magistral-medium"], "2.00", "5.00"),
    row("mistral", &["magistral-small"], "0.50", "1.50"),
    row("mistral", &["devstral-medium"], "0.40", "2.00"),
    row("mistral", &["devstral-small"], "0.10", "0.30"),
    row("mistral", &["open-mistral-nemo"], "0.15", "0.15"),
    row("mistral", &["mistral-embed"], "0.10", "0"),

    // --- deepseek: api-docs.deepseek.com/quick_start/pricing ---
    // `deepseek-chat` and `deepseek-reasoner` were aliases of V4-Flash (non-thinking and
    // thinking) until their retirement on 2026-07-24; cached = cache-hit input.
    row("deepseek", &["deepseek-v4-flash", "deepseek-chat", "deepseek-reasoner"], "0.14", "0.28").cached("0.0028"),

    // --- xai: docs.x.ai/docs/models ---
    // Base tier: Grok 4 models bill prompts over 128K tokens at a higher rate.
    row("xai", &["grok-4", "grok-3"], "3.00", "15.00").cached("0.75"),
    row("xai", &["grok-4-1-fast-reasoning", "grok-4-1-fast-non-reasoning"], "0.20", "0.50").cached("0.05"),
    row("xai", &["grok-4-fast-reasoning", "grok-4-fast-non-reasoning"], "0.20", "0.50").cached("0.05"),
    row("xai", &["grok-code-fast-1"], "0.20", "1.50").cached("0.02"),
    row("xai", &["grok-3-mini"], "0.30", "0.50").cached("0.075"),

    // --- together: together.ai/pricing (serverless) ---
    row("together", &["meta-llama/llama-3.3-70b-instruct-turbo"], "0.88", "0.88"),
    row("together", &["meta-llama/meta-llama-3.1-8b-instruct-turbo"], "0.18", "0.18"),
    row("together", &["meta-llama/llama-4-maverick-17b-128e-instruct-fp8"], "0.27", "0.85"),
    row("together", &["deepseek-ai/deepseek-v3"], "1.25", "1.25"),
    row("together", &["deepseek-ai/deepseek-r1"], "3.00", "7.00"),
    row("together", &["openai/gpt-oss-120b"], "0.15", "0.60"),
    row("together", &["openai/gpt-oss-20b"], "0.05", "0.20"),
    row("together", &["moonshotai/kimi-k2-instruct", "moonshotai/kimi-k2-instruct-0905"], "1.00", "3.00"),
    row("together", &["qwen/qwen2.5-72b-instruct-turbo"], "1.20", "1.20"),

    // --- fireworks: docs.fireworks.ai/serverless/pricing (standard tier) ---
    // Cached input is half the input price unless the page lists another rate.
    row("fireworks", &["accounts/fireworks/models/gpt-oss-120b"], "0.15", "0.60").cached("0.015"),
    row("fireworks", &["accounts/fireworks/models/gpt-oss-20b"], "0.07", "0.30").cached("0.035"),
    row("fireworks", &["accounts/fireworks/models/deepseek-v3p2", "accounts/fireworks/models/deepseek-v3p1"], "0.56", "1.68").cached("0.28"),
    row("fireworks", &["accounts/fireworks/models/deepseek-v4-pro"], "1.74", "3.48").cached("0.145"),
    row("fireworks", &["accounts/fireworks/models/kimi-k2p5"], "0.60", "3.00").cached("0.10"),
    row("fireworks", &["accounts/fireworks/models/kimi-k2-instruct"], "0.60", "2.50").cached("0.30"),
    row("fireworks", &["accounts/fireworks/models/glm-5p1"], "1.40", "4.40").cached("0.26"),
    row("fireworks", &["accounts/fireworks/models/glm-5"], "1.00", "3.20").cached("0.20"),
    row("fireworks", &["accounts/fireworks/models/glm-4p7"], "0.60", "2.20").cached("0.30"),
    row("fireworks", &["accounts/fireworks/models/minimax-m2p5"], "0.30", "1.20").cached("0.03"),
    row("fireworks", &["accounts/fireworks/models/llama-v3p3-70b-instruct"], "0.90", "0.90").cached("0.45"),

    // --- openrouter: no rows of its own. OpenRouter passes the vendor's token price through,
    // so `openai/gpt-4o` is looked up as openai's `gpt-4o` (see `PriceTable::lookup`).
];
#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use proptest::prelude::*;
    use serde_json::json;

    use super::*;

    fn usage(input: Option<u64>, output: Option<u64>) -> Usage {
        Usage {
            input_tokens: input,
            output_tokens: output,
            ..Usage::default()
        }
    }

    fn price(input: u64, output: u64) -> ModelPrice {
        ModelPrice {
            input,
            output,
            cached_input: None,
            cache_write: None,
        }
    }

    fn found(table: &PriceTable, provider: &str, model: &str) -> Option<ModelPrice> {
        table.lookup(provider, model).copied()
    }

    // --- cost arithmetic ---

    #[test]
    fn cost_of_plain_input_and_output() {
        let table = PriceTable::builtin();
        // gpt-4o: 1_000 x $2.50/M + 500 x $10/M = $0.0025 + $0.005.
        let cost = table.cost("openai", Some("gpt-4o"), &usage(Some(1_000), Some(500)));
        assert_eq!(cost, Cost::Known { micros: 7_500 });
    }

    #[test]
    fn cost_splits_cache_reads_and_writes_out_of_input() {
        let table = PriceTable::builtin();
        // claude-sonnet-4-5: 10_000 input of which 6_000 cache reads and 2_000 cache writes.
        // fresh 2_000 x $3 = 6_000; reads 6_000 x $0.30 = 1_800; writes 2_000 x $3.75 = 7_500;
        // output 1_000 x $15 = 15_000 micro-dollars.
        let usage = Usage {
            input_tokens: Some(10_000),
            output_tokens: Some(1_000),
            cached_input_tokens: Some(6_000),
            cache_write_tokens: Some(2_000),
            ..Usage::default()
        };
        let cost = table.cost("anthropic", Some("claude-sonnet-4-5-20250929"), &usage);
        assert_eq!(cost, Cost::Known { micros: 30_300 });
    }

    #[test]
    fn cache_prices_default_to_the_input_price() {
        let usage = Usage {
            input_tokens: Some(3_000_000),
            cached_input_tokens: Some(1_000_000),
            cache_write_tokens: Some(1_000_000),
            ..Usage::default()
        };
        assert_eq!(price(2, 0).usage_micros(&usage), Some(6));
    }

    #[test]
    fn cache_parts_are_bounded_by_input() {
        // A report whose parts exceed the whole: reads fill the 100 input tokens, writes get 0.
        let p = ModelPrice {
            input: 10_000_000,
            output: 0,
            cached_input: Some(1_000_000),
            cache_write: Some(100_000_000),
        };
        let usage = Usage {
            input_tokens: Some(100),
            cached_input_tokens: Some(150),
            cache_write_tokens: Some(50),
            ..Usage::default()
        };
        assert_eq!(p.usage_micros(&usage), Some(100));
    }

    #[test]
    fn rounds_half_a_micro_dollar_up_once_at_the_end() {
        let p = price(1, 1); // one micro-dollar per million tokens
        assert_eq!(p.usage_micros(&usage(Some(499_999), None)), Some(0));
        assert_eq!(p.usage_micros(&usage(Some(500_000), None)), Some(1));
        assert_eq!(p.usage_micros(&usage(Some(1_500_000), None)), Some(2));
        // Two halves make one micro-dollar, not two rounded-up halves.
        assert_eq!(
            p.usage_micros(&usage(Some(500_000), Some(500_000))),
            Some(1)
        );
        assert_eq!(
            p.usage_micros(&usage(Some(250_000), Some(250_000))),
            Some(1)
        );
        assert_eq!(
            p.usage_micros(&usage(Some(249_999), Some(250_000))),
            Some(0)
        );
    }

    #[test]
    fn huge_counts_use_wide_arithmetic_and_saturate() {
        // 10^12 tokens at $600/M: the numerator (6 x 10^20) overflows u64, the cost does not.
        let p = price(0, usd("600"));
        let cost = p.usage_micros(&usage(None, Some(1_000_000_000_000)));
        assert_eq!(cost, Some(600_000_000_000_000));
        let max = price(u64::MAX, u64::MAX);
        let all = Usage {
            input_tokens: Some(u64::MAX),
            output_tokens: Some(u64::MAX),
            cached_input_tokens: Some(u64::MAX),
            cache_write_tokens: Some(u64::MAX),
            ..Usage::default()
        };
        assert_eq!(max.usage_micros(&all), Some(u64::MAX));
        assert_eq!(max.estimate_micros(u64::MAX, u64::MAX), u64::MAX);
    }

    #[test]
    fn unknown_model_and_unknown_usage() {
        let table = PriceTable::builtin();
        let known = usage(Some(10), Some(10));
        assert_eq!(table.cost("openai", None, &known), Cost::UnknownModel);
        assert_eq!(
            table.cost("openai", Some("gpt-99"), &known),
            Cost::UnknownModel
        );
        assert_eq!(
            table.cost("nope", Some("gpt-4o"), &known),
            Cost::UnknownModel
        );
        let unknown = Usage {
            cached_input_tokens: Some(10),
            ..Usage::default()
        };
        assert_eq!(
            table.cost("openai", Some("gpt-4o"), &unknown),
            Cost::UnknownUsage
        );
        // The model is what an operator can fix, so it is reported first.
        assert_eq!(table.cost("openai", None, &unknown), Cost::UnknownModel);
        assert_eq!(Cost::UnknownUsage.micros(), None);
        assert_eq!(Cost::Known { micros: 3 }.micros(), Some(3));
    }

    #[test]
    fn one_unknown_side_counts_the_known_side_only() {
        let p = ModelPrice {
            cached_input: Some(1_000_000),
            ..price(2_000_000, 8_000_000)
        };
        assert_eq!(p.usage_micros(&usage(Some(1_000), None)), Some(2_000));
        assert_eq!(p.usage_micros(&usage(None, Some(1_000))), Some(8_000));
        // Without input, its cached part is unknown too.
        let output_only = Usage {
            output_tokens: Some(1_000),
            cached_input_tokens: Some(1_000),
            ..Usage::default()
        };
        assert_eq!(p.usage_micros(&output_only), Some(8_000));
    }

    #[test]
    fn estimate_rounds_up() {
        let table = PriceTable::builtin();
        // gpt-4o-mini: 1 x $0.15/M = 0.15 micro-dollars -> 1.
        assert_eq!(
            table.estimate_micros("openai", "gpt-4o-mini", 1, 0),
            Some(1)
        );
        assert_eq!(
            table.estimate_micros("openai", "gpt-4o-mini", 0, 0),
            Some(0)
        );
        // 1M in + 1M out: exactly $0.15 + $0.60.
        assert_eq!(
            table.estimate_micros("openai", "gpt-4o-mini", 1_000_000, 1_000_000),
            Some(750_000)
        );
        assert_eq!(
            table.estimate_micros("openai", "gpt-4o-mini", 1_000_001, 1_000_000),
            Some(750_001)
        );
        assert_eq!(table.estimate_micros("openai", "gpt-99", 1, 1), None);
    }

    // --- decimal parsing ---

    #[test]
    fn parses_decimal_dollars_exactly() {
        for (text, micros) in [
            ("2.50", 2_500_000),
            ("2.5", 2_500_000),
            ("2", 2_000_000),
            ("0", 0),
            ("0.075", 75_000),
            ("0.000001", 1),
            ("600.000000", 600_000_000),
            (" 1.25 ", 1_250_000),
            ("007.5", 7_500_000),
            ("18446744073709", 18_446_744_073_709_000_000),
            ("18446744073709.551615", u64::MAX),
        ] {
            assert_eq!(parse_dollars_per_mtok(text), Ok(micros), "{text}");
        }
    }

    #[test]
    fn rejects_bad_dollars_naming_the_value() {
        let value = |text: &str| text.to_owned();
        assert_eq!(parse_dollars_per_mtok(""), Err(PriceError::Empty));
        assert_eq!(parse_dollars_per_mtok("  "), Err(PriceError::Empty));
        assert_eq!(
            parse_dollars_per_mtok("-1"),
            Err(PriceError::Negative { value: value("-1") })
        );
        assert_eq!(
            parse_dollars_per_mtok("0.0000001"),
            Err(PriceError::TooManyDecimals {
                value: value("0.0000001")
            })
        );
        assert_eq!(
            parse_dollars_per_mtok("18446744073710"),
            Err(PriceError::Overflow {
                value: value("18446744073710")
            })
        );
        assert_eq!(
            parse_dollars_per_mtok("18446744073709.551616"),
            Err(PriceError::Overflow {
                value: value("18446744073709.551616")
            })
        );
        assert_eq!(
            parse_dollars_per_mtok("99999999999999999999999"),
            Err(PriceError::Overflow {
                value: value("99999999999999999999999")
            })
        );
        for text in [
            "NaN", "inf", "abc", ".5", "5.", "1.2.3", "+1", "1e3", "$2", "2,50", "1 000",
        ] {
            assert_eq!(
                parse_dollars_per_mtok(text),
                Err(PriceError::NotDecimal { value: value(text) }),
                "{text}"
            );
        }
        let message = parse_dollars_per_mtok("-0.5")
            .map_err(|e| e.to_string())
            .unwrap_err();
        assert!(message.contains("\"-0.5\""), "{message}");
    }

    #[test]
    fn six_decimals_are_allowed_seven_are_not() {
        assert_eq!(parse_dollars_per_mtok("1.123456"), Ok(1_123_456));
        assert!(matches!(
            parse_dollars_per_mtok("1.1234567"),
            Err(PriceError::TooManyDecimals { .. })
        ));
        assert!(matches!(
            parse_dollars_per_mtok("1.1234560"),
            Err(PriceError::TooManyDecimals { .. })
        ));
    }

    #[test]
    fn floats_go_through_their_shortest_decimal() {
        // 2.675 and 4.35 are just below those decimals as floats; `x * 1e6` truncates wrongly.
        assert_eq!(Dollars::from(2.675).micros(), Ok(2_675_000));
        assert_eq!(Dollars::from(4.35).micros(), Ok(4_350_000));
        assert_eq!(Dollars::from(0.1).micros(), Ok(100_000));
        assert_eq!(Dollars::from(10.0).micros(), Ok(10_000_000));
        assert!(matches!(
            Dollars::from(1e-7).micros(),
            Err(PriceError::TooManyDecimals { .. })
        ));
        assert!(matches!(
            Dollars::from(f64::NAN).micros(),
            Err(PriceError::NotDecimal { value }) if value == "NaN"
        ));
        assert!(matches!(
            Dollars::from(f64::INFINITY).micros(),
            Err(PriceError::NotDecimal { .. })
        ));
        assert!(matches!(
            Dollars::from(-2.5).micros(),
            Err(PriceError::Negative { .. })
        ));
        assert!(matches!(
            Dollars::from(1e30).micros(),
            Err(PriceError::Overflow { .. })
        ));
    }

    #[test]
    fn price_spec_deserialises_strings_integers_and_floats() {
        let spec: PriceSpec = serde_json::from_value(json!({
            "provider": "openai",
            "model": "gpt-4o",
            "input": "2.50",
            "output": 10,
            "cached_input": 1.25,
        }))
        .unwrap();
        assert_eq!(spec.input.as_str(), "2.50");
        assert_eq!(spec.output.as_str(), "10");
        assert_eq!(
            spec.cached_input.as_ref().map(Dollars::as_str),
            Some("1.25")
        );
        assert_eq!(spec.cache_write, None);
        let row = PriceRow::try_from(spec).unwrap();
        assert_eq!(
            row,
            PriceRow {
                provider: "openai".to_owned(),
                model: "gpt-4o".to_owned(),
                price: ModelPrice {
                    input: 2_500_000,
                    output: 10_000_000,
                    cached_input: Some(1_250_000),
                    cache_write: None,
                },
            }
        );
    }

    #[test]
    fn price_spec_rejects_unknown_fields_and_bad_values() {
        let unknown = serde_json::from_value::<PriceSpec>(json!({
            "provider": "openai", "model": "m", "input": 1, "output": 1, "cache_read": 1,
        }));
        assert!(unknown.is_err());
        let not_a_price = serde_json::from_value::<PriceSpec>(json!({
            "provider": "openai", "model": "m", "input": true, "output": 1,
        }));
        assert!(not_a_price.is_err());

        let spec: PriceSpec = serde_json::from_value(json!({
            "provider": "openai", "model": "m", "input": "1", "output": 1, "cache_write": -3,
        }))
        .unwrap();
        let err = PriceRow::try_from(spec).unwrap_err();
        assert_eq!(
            err,
            PriceError::InRow {
                provider: "openai".to_owned(),
                model: "m".to_owned(),
                field: "cache_write",
                source: Box::new(PriceError::Negative {
                    value: "-3".to_owned()
                }),
            }
        );
        assert_eq!(
            err.to_string(),
            "price row openai/m, cache_write: price \"-3\" is negative"
        );

        let spec = PriceSpec {
            provider: "openai".to_owned(),
            model: " ".to_owned(),
            input: Dollars::from("1"),
            output: Dollars::from("1"),
            cached_input: None,
            cache_write: None,
        };
        assert_eq!(
            PriceRow::try_from(spec),
            Err(PriceError::EmptyName { field: "model" })
        );
    }

    // --- lookup ---

    #[test]
    fn dated_snapshots_and_aliases_take_the_base_price() {
        let table = PriceTable::builtin();
        let same = |provider: &str, model: &str, base: &str| {
            assert_eq!(
                found(&table, provider, model),
                found(&table, provider, base),
                "{provider}/{model} should cost what {base} costs"
            );
            assert!(found(&table, provider, base).is_some(), "{provider}/{base}");
        };
        same("openai", "gpt-4o-2024-08-06", "gpt-4o");
        same("openai", "gpt-4o-mini-2024-07-18", "gpt-4o-mini");
        same("openai", "gpt-5-2025-08-07", "gpt-5");
        same("openai", "o1-mini-2024-09-12", "o1-mini");
        same("openai", "GPT-4o", "gpt-4o");
        same(
            "anthropic",
            "claude-sonnet-4-5-20250929",
            "claude-sonnet-4-5",
        );
        same("anthropic", "claude-opus-4-20250514", "claude-opus-4");
        same("anthropic", "claude-3-5-sonnet-latest", "claude-3-5-sonnet");
        same(
            "anthropic",
            "claude-3-7-sonnet-20250219",
            "claude-3-7-sonnet",
        );
        same(
            "anthropic",
            "claude-sonnet-4-5@20250929",
            "claude-sonnet-4-5",
        );
        same(
            "anthropic",
            "claude-3-5-sonnet-v2@20241022",
            "claude-3-5-sonnet",
        );
        same("anthropic", "claude-sonnet-4.5", "claude-sonnet-4-5");
        same("gemini", "models/gemini-2.5-flash", "gemini-2.5-flash");
        same("gemini", "gemini-2.5-pro-preview-06-05", "gemini-2.5-pro");
        same(
            "gemini",
            "models/gemini-2.5-flash-lite-preview-06-17",
            "gemini-2.5-flash-lite",
        );
        same(
            "gemini",
            "gemini-2.5-flash-preview-09-2025",
            "gemini-2.5-flash",
        );
        same("gemini", "gemini-2.0-flash-001", "gemini-2.0-flash");
        same("mistral", "mistral-large-latest", "mistral-large");
        same("mistral", "mistral-small-2506", "mistral-small");
        same("mistral", "codestral-2508", "codestral");
        same("xai", "grok-4-0709", "grok-4");
        same("xai", "grok-3-mini-latest", "grok-3-mini");
        same(
            "together",
            "meta-llama/Llama-3.3-70B-Instruct-Turbo",
            "meta-llama/llama-3.3-70b-instruct-turbo",
        );
    }

    #[test]
    fn look_alikes_never_share_a_price() {
        let table = PriceTable::builtin();
        let gpt_4o = found(&table, "openai", "gpt-4o");
        assert_ne!(found(&table, "openai", "gpt-4o-mini"), gpt_4o);
        assert_ne!(found(&table, "openai", "gpt-4o-mini-2024-07-18"), gpt_4o);
        assert_ne!(
            found(&table, "openai", "o1-mini"),
            found(&table, "openai", "o1")
        );
        assert_ne!(
            found(&table, "gemini", "gemini-2.5-flash-lite-preview-06-17"),
            found(&table, "gemini", "gemini-2.5-flash")
        );
        assert_ne!(
            found(&table, "xai", "grok-3-mini"),
            found(&table, "xai", "grok-3")
        );
        // Ids without a row are unknown, not priced like their prefix.
        for (provider, model) in [
            ("openai", "gpt-4o-mini-search-preview-2025-03-11"),
            ("openai", "gpt-4o-audio-preview"),
            ("openai", "gpt-4.1-mini-finetuned"),
            ("openai", "o1-preview"),
            ("openai", "ft:gpt-4o-mini-2024-07-18:acme::abc123"),
            ("anthropic", "claude-opus-4-9"),
            ("anthropic", "claude-3-5"),
            ("gemini", "gemini-2.5-pro-exp-03-25"),
            ("gemini", "gemini-2.5"),
            ("xai", "grok-3-fast"),
            ("groq", "gpt-oss-120b"),
        ] {
            assert_eq!(table.lookup(provider, model), None, "{provider}/{model}");
        }
    }

    #[test]
    fn exact_rows_win_over_stripped_ones() {
        let table = PriceTable::builtin();
        // The first gpt-4o snapshot and the older Mistral Large keep their own prices.
        assert_eq!(
            found(&table, "openai", "gpt-4o-2024-05-13").map(|p| p.input),
            Some(5_000_000)
        );
        assert_eq!(
            found(&table, "openai", "gpt-4o-2024-11-20").map(|p| p.input),
            Some(2_500_000)
        );
        assert_eq!(
            found(&table, "mistral", "mistral-large-2411").map(|p| p.input),
            Some(2_000_000)
        );
        assert_eq!(
            found(&table, "mistral", "mistral-large-2512").map(|p| p.input),
            Some(500_000)
        );
    }

    #[test]
    fn openrouter_routes_by_vendor() {
        let table = PriceTable::builtin();
        let via = |model: &str| found(&table, "openrouter", model);
        assert_eq!(via("openai/gpt-4o"), found(&table, "openai", "gpt-4o"));
        assert_ne!(via("openai/gpt-4o-mini"), via("openai/gpt-4o"));
        assert_eq!(
            via("anthropic/claude-sonnet-4.5"),
            found(&table, "anthropic", "claude-sonnet-4-5")
        );
        assert_eq!(
            via("google/gemini-2.5-pro"),
            found(&table, "gemini", "gemini-2.5-pro")
        );
        assert_eq!(via("x-ai/grok-4"), found(&table, "xai", "grok-4"));
        assert_eq!(
            via("mistralai/mistral-large-2411"),
            found(&table, "mistral", "mistral-large-2411")
        );
        assert_eq!(
            via("deepseek/deepseek-chat"),
            found(&table, "deepseek", "deepseek-chat")
        );
        assert!(via("openai/gpt-4o").is_some());
        assert_eq!(via("gpt-4o"), None);
        assert_eq!(via("meta-llama/llama-3.3-70b-instruct"), None);
        assert_eq!(via("openrouter/auto"), None);
        // A row of OpenRouter's own wins over the vendor's.
        let own = price(1, 2);
        let table = table.with_overrides([PriceRow {
            provider: "openrouter".to_owned(),
            model: "openai/gpt-4o".to_owned(),
            price: own,
        }]);
        assert_eq!(found(&table, "openrouter", "openai/gpt-4o"), Some(own));
        let cost = table.cost(
            "openrouter",
            Some("openai/gpt-4o"),
            &usage(Some(1_000_000), None),
        );
        assert_eq!(cost, Cost::Known { micros: 1 });
    }

    #[test]
    fn strip_decoration_removes_one_layer_at_a_time() {
        assert_eq!(
            strip_decoration("models/gemini-2.0-flash-001"),
            Some("gemini-2.0-flash-001")
        );
        assert_eq!(
            strip_decoration("gemini-2.0-flash-001"),
            Some("gemini-2.0-flash")
        );
        assert_eq!(strip_decoration("gpt-4o-2024-08-06"), Some("gpt-4o"));
        assert_eq!(
            strip_decoration("gpt-3.5-turbo-0125"),
            Some("gpt-3.5-turbo")
        );
        assert_eq!(strip_decoration("gpt-4o"), None);
        assert_eq!(strip_decoration("gpt-oss-120b"), None);
        assert_eq!(strip_decoration("claude-sonnet-4-5"), None);
        assert_eq!(strip_decoration("gemini-3-pro-preview"), None);
        assert_eq!(strip_decoration("o1-12345"), None);
    }

    // --- overrides ---

    #[test]
    fn overrides_replace_a_builtin_and_add_new_models() {
        let builtin = PriceTable::builtin();
        let count = builtin.len();
        let cheaper = price(1_000_000, 4_000_000);
        let custom = price(7, 9);
        let table = builtin.with_overrides([
            PriceRow {
                provider: "openai".to_owned(),
                model: "gpt-4o".to_owned(),
                price: cheaper,
            },
            PriceRow {
                provider: "Local".to_owned(),
                model: "My-Model".to_owned(),
                price: custom,
            },
        ]);
        assert_eq!(table.len(), count + 1);
        assert_eq!(found(&table, "openai", "gpt-4o"), Some(cheaper));
        // Snapshots follow the overridden base price.
        assert_eq!(found(&table, "openai", "gpt-4o-2024-08-06"), Some(cheaper));
        assert_eq!(found(&table, "local", "my-model"), Some(custom));
        assert_eq!(found(&table, "LOCAL", "my-model-latest"), Some(custom));
        assert!(
            table
                .rows()
                .any(|(p, m, _)| p == "local" && m == "my-model")
        );
    }

    #[test]
    fn empty_table() {
        let table = PriceTable::default();
        assert!(table.is_empty());
        assert_eq!(table.lookup("openai", "gpt-4o"), None);
    }

    // --- the built-in table ---

    #[test]
    fn builtin_rows_are_sane_and_unique() {
        let mut seen = HashSet::new();
        for row in BUILTIN {
            for model in row.models {
                assert!(
                    seen.insert((row.provider, *model)),
                    "duplicate {}/{model}",
                    row.provider
                );
                let name = format!("{}/{model}", row.provider);
                for part in [row.provider, *model] {
                    assert!(!part.is_empty(), "{name}");
                    assert_eq!(part, part.to_ascii_lowercase(), "{name} is not lower case");
                    assert!(!part.contains(char::is_whitespace), "{name}");
                }
                let p = row.price;
                assert!(p.input > 0, "{name}: free input");
                assert!(
                    p.output > 0 || model.contains("embed"),
                    "{name}: free output on a generative model"
                );
                assert!(
                    p.cached_input_price() <= p.input,
                    "{name}: cache read above input"
                );
                assert!(
                    p.cache_write_price() >= p.input,
                    "{name}: cache write below input"
                );
                assert!(
                    p.input <= 1_000 * MILLION,
                    "{name}: input price looks like a typo"
                );
            }
        }
        let table = PriceTable::builtin();
        assert_eq!(table.len(), seen.len());
        assert_eq!(table.rows().count(), seen.len());
        for (provider, model, price) in table.rows() {
            assert_eq!(found(&table, provider, model), Some(*price));
        }
    }

    #[test]
    fn builtin_prices_every_builtin_provider() {
        let table = PriceTable::builtin();
        for (provider, _) in crate::providers::builtin() {
            let rows = table.rows().filter(|(p, _, _)| *p == provider).count();
            if provider == "openrouter" {
                assert_eq!(rows, 0, "openrouter is priced through its vendors");
            } else {
                assert!(rows >= 1, "no prices for {provider}");
            }
        }
        assert!(
            table
                .lookup("openrouter", "anthropic/claude-haiku-4.5")
                .is_some()
        );
    }

    #[test]
    fn anthropic_cache_prices_follow_the_published_multipliers() {
        // Reads 0.1x and 5-minute writes 1.25x input, except Haiku 3's rounded list prices.
        for (_, model, p) in PriceTable::builtin()
            .rows()
            .filter(|(provider, model, _)| *provider == "anthropic" && *model != "claude-3-haiku")
        {
            assert_eq!(p.cached_input, Some(p.input / 10), "{model}");
            assert_eq!(p.cache_write, Some(p.input / 4 * 5), "{model}");
        }
    }

    // --- properties ---

    fn tokens() -> impl Strategy<Value = Option<u64>> {
        proptest::option::of(prop_oneof![0u64..10_000_000, any::<u64>()])
    }

    fn dollars() -> impl Strategy<Value = u64> {
        prop_oneof![0u64..1_000_000_000, any::<u64>()]
    }

    fn any_price() -> impl Strategy<Value = ModelPrice> {
        (
            dollars(),
            dollars(),
            proptest::option::of(dollars()),
            proptest::option::of(dollars()),
        )
            .prop_map(|(input, output, cached_input, cache_write)| ModelPrice {
                input,
                output,
                cached_input,
                cache_write,
            })
    }

    fn any_usage() -> impl Strategy<Value = Usage> {
        (tokens(), tokens(), tokens(), tokens()).prop_map(|(input, output, cached, written)| {
            Usage {
                input_tokens: input,
                output_tokens: output,
                cached_input_tokens: cached,
                cache_write_tokens: written,
                ..Usage::default()
            }
        })
    }

    /// `count` plus one token, when there is a count to add to.
    fn plus_one(count: Option<u64>) -> Option<Option<u64>> {
        count.and_then(|n| n.checked_add(1)).map(Some)
    }

    proptest! {
        #[test]
        fn cost_is_monotonic_in_each_token_count(p in any_price(), u in any_usage()) {
            let cost = p.usage_micros(&u);
            prop_assert_eq!(cost.is_none(), u.input_tokens.is_none() && u.output_tokens.is_none());
            let _ = p.estimate_micros(u.input_tokens.unwrap_or(0), u.output_tokens.unwrap_or(0));

            // More input or output tokens never cost less.
            if let Some(input) = plus_one(u.input_tokens) {
                let more = Usage { input_tokens: input, ..u.clone() };
                prop_assert!(p.usage_micros(&more) >= cost);
            }
            if let Some(output) = plus_one(u.output_tokens) {
                let more = Usage { output_tokens: output, ..u.clone() };
                prop_assert!(p.usage_micros(&more) >= cost);
            }
            // Moving a prompt token into the cache moves the cost the way its price differs: a
            // cache read displaces a fresh token, or a cache write once reads and writes fill
            // the whole input.
            if let Some(cached) = plus_one(u.cached_input_tokens) {
                let more = p.usage_micros(&Usage { cached_input_tokens: cached, ..u.clone() });
                let read = p.cached_input_price();
                if read <= p.input && read <= p.cache_write_price() {
                    prop_assert!(more <= cost);
                }
                if read >= p.input && read >= p.cache_write_price() {
                    prop_assert!(more >= cost);
                }
            }
            if let Some(written) = plus_one(u.cache_write_tokens) {
                let more = p.usage_micros(&Usage { cache_write_tokens: written, ..u.clone() });
                if p.cache_write_price() >= p.input {
                    prop_assert!(more >= cost);
                } else {
                    prop_assert!(more <= cost);
                }
            }
        }

        #[test]
        fn estimate_is_monotonic_and_never_below_the_uncached_cost(
            p in any_price(),
            input in prop_oneof![0u64..10_000_000, any::<u64>()],
            output in prop_oneof![0u64..10_000_000, any::<u64>()],
        ) {
            let estimate = p.estimate_micros(input, output);
            let plain = ModelPrice { cached_input: None, cache_write: None, ..p };
            prop_assert!(Some(estimate) >= plain.usage_micros(&usage(Some(input), Some(output))));
            if let Some(more) = input.checked_add(1) {
                prop_assert!(p.estimate_micros(more, output) >= estimate);
            }
            if let Some(more) = output.checked_add(1) {
                prop_assert!(p.estimate_micros(input, more) >= estimate);
            }
        }

        #[test]
        fn parsing_round_trips_micro_dollars(micros in any::<u64>()) {
            let text = format!("{}.{:06}", micros / MILLION, micros % MILLION);
            prop_assert_eq!(parse_dollars_per_mtok(&text), Ok(micros));
        }

        #[test]
        fn parsing_never_panics(text in ".{0,40}") {
            let _ = parse_dollars_per_mtok(&text);
        }
    }
}
