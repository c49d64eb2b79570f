//! Money as integer micro-dollars (1e-6 USD): parsing decimal dollar amounts exactly and
//! printing them back. No floating point ever touches an amount.

/// Micro-dollars in a dollar.
pub const MICROS_PER_USD: u64 = 1_000_000;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoneyError {
    #[error("{0:?} is not a dollar amount (digits with at most 6 decimals, like 5 or 0.25)")]
    Syntax(String),
    #[error("{0:?} is too large")]
    Overflow(String),
}

/// Parses a non-negative decimal dollar amount (`5`, `0.25`, `$1.50`, `1_000`) into micro-dollars,
/// exactly. More than 6 decimals is refused rather than rounded.
pub fn parse_usd(text: &str) -> Result<u64, MoneyError> {
    let syntax = || MoneyError::Syntax(text.to_owned());
    let s = text.trim();
    let s = s.strip_prefix('$').unwrap_or(s).replace('_', "");
    let (whole, frac) = s.split_once('.').unwrap_or((&s, ""));
    if (whole.is_empty() && frac.is_empty())
        || frac.len() > 6
        || !whole.bytes().all(|b| b.is_ascii_digit())
        || !frac.bytes().all(|b| b.is_ascii_digit())
    {
        return Err(syntax());
    }
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole
            .parse()
            .map_err(|_| MoneyError::Overflow(text.to_owned()))?
    };
    let frac_micros: u64 = if frac.is_empty() {
        0
    } else {
        let digits: u64 = frac.parse().map_err(|_| syntax())?;
        digits * 10u64.pow(6 - frac.len() as u32)
    };
    whole
        .checked_mul(MICROS_PER_USD)
        .and_then(|w| w.checked_add(frac_micros))
        .ok_or_else(|| MoneyError::Overflow(text.to_owned()))
}

/// `$1.5`, `$0.000123`, `$12`: dollars with the trailing zeros of the micro-dollars dropped.
pub fn format_usd(micros: u64) -> String {
    let whole = micros / MICROS_PER_USD;
    let frac = micros % MICROS_PER_USD;
    if frac == 0 {
        return format!("${whole}");
    }
    let frac = format!("{frac:06}");
    format!("${whole}.{}", frac.trim_end_matches('0'))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn parses_exactly() {
        assert_eq!(parse_usd("5"), Ok(5_000_000));
        assert_eq!(parse_usd("0.25"), Ok(250_000));
        assert_eq!(parse_usd("$1.50"), Ok(1_500_000));
        assert_eq!(parse_usd(".000001"), Ok(1));
        assert_eq!(parse_usd("1_000"), Ok(1_000_000_000));
        for bad in ["", ".", "-1", "1.0000001", "1e3", "abc", "1.2.3", "nan"] {
            assert!(parse_usd(bad).is_err(), "{bad}");
        }
        assert!(matches!(
            parse_usd("99999999999999999999"),
            Err(MoneyError::Overflow(_))
        ));
    }

    #[test]
    fn formats() {
        assert_eq!(format_usd(0), "$0");
        assert_eq!(format_usd(1_500_000), "$1.5");
        assert_eq!(format_usd(123), "$0.000123");
    }

    proptest! {
        #[test]
        fn round_trips(micros in 0u64..u64::MAX / 2) {
            prop_assert_eq!(parse_usd(&format_usd(micros)), Ok(micros));
        }
    }
}
