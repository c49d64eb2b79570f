//! Keys and budgets: the admin keys a start or the CLI brings, and what a budget reservation
//! assumes.

use super::decl::{Chart, Default, Flag, Group, Kind, Lit, declare};
use super::{link, parse};

declare! { Group::Budgets;
    /// this key exists with admin rights (created at start if missing; a revoked one stays revoked); must be of generated strength (see "Secrets" below)
    BOOTSTRAP_KEY: String => link::secret, {
        env: "NM_BOOTSTRAP_KEY",
        file: Some(("bootstrap_key", Kind::Str)),
        chart: Chart::Template,
    };
    /// key the CLI presents to the controlplane
    ADMIN_KEY: String => parse::text, {
        env: "NM_ADMIN_KEY",
        flag: Some(Flag { long: "admin-key", get: |f| f.admin_key.as_deref() }),
        file: Some(("admin_key", Kind::Str)),
        chart: Chart::Template,
    };
    /// answer length a budget reservation assumes when a request sets no `max_tokens`
    RESERVE_OUTPUT_TOKENS: u64 => parse::whole, {
        env: "NM_RESERVE_OUTPUT_TOKENS",
        file: Some(("reserve_output_tokens", Kind::Int)),
        default: Default::Is(Lit::Int(nm_dataplane::DEFAULT_RESERVE_OUTPUT_TOKENS)),
        chart: Chart::Value("reserveOutputTokens"),
    };
    /// answer length (tokens) a token budget (per minute or per period) reserves when a request sets no `max_tokens`; settled from the metered usage
    TPM_DEFAULT_MAX_TOKENS: u64 => parse::whole, {
        env: "NM_TPM_DEFAULT_MAX_TOKENS",
        file: Some(("tpm_default_max_tokens", Kind::Int)),
        default: Default::Is(Lit::Int(nm_dataplane::DEFAULT_TPM_DEFAULT_MAX_TOKENS)),
        chart: Chart::No,
    };
}
