//! Money as integer micro-dollars (1e-6 USD): parsing decimal dollar amounts exactly and
//! printing them back. No floating point ever touches an amount.

/// Micro-dollars in a dollar.
pub const MICROS_PER_USD: u64 = 1_000_000;
/// Decimal places a micro-unit amount can have.
pub const MAX_DECIMALS: u32 = 6;

/// What [`parse_micros`] found wrong (no text, so it can run at compile time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    Empty,
    Negative,
    NotDecimal,
    TooManyDecimals,
    Overflow,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MoneyError {
    #[error("{0:?} is not a dollar amount (digits with at most 6 decimals, like 5 or 0.25)")]
    Syntax(String),
    #[error("{0:?} is too large")]
    Overflow(String),
}

/// The one decimal parser: a non-negative decimal with at most six decimals, to micro-units,
/// exactly. `const`, so literal tables (the built-in prices) are checked at compile time.
pub const fn parse_micros(text: &str) -> Result<u64, Fault> {
    let bytes = text.trim_ascii().as_bytes();
    if bytes.is_empty() {
        return Err(Fault::Empty);
    }
    if bytes[0] == b'-' {
        return Err(Fault::Negative);
    }
    let mut i = 0;
    let mut dollars: u64 = 0;
    while i < bytes.len() && bytes[i].is_ascii_digit() {
        dollars = match dollars.checked_mul(10) {
            Some(tens) => match tens.checked_add((bytes[i] - b'0') as u64) {
                Some(sum) => sum,
                None => return Err(Fault::Overflow),
            },
            None => return Err(Fault::Overflow),
        };
        i += 1;
    }
    if i == 0 {
        return Err(Fault::NotDecimal);
    }
    let Some(mut micros) = dollars.checked_mul(MICROS_PER_USD) else {
        return Err(Fault::Overflow);
    };
    if i == bytes.len() {
        return Ok(micros);
    }
    if bytes[i] != b'.' {
        return Err(Fault::NotDecimal);
    }
    i += 1;
    let mut place = MICROS_PER_USD;
    let mut decimals = 0;
    while i < bytes.len() && bytes[i].is_ascii_digit() {
        if decimals == MAX_DECIMALS {
            return Err(Fault::TooManyDecimals);
        }
        place /= 10;
        micros = match micros.checked_add((bytes[i] - b'0') as u64 * place) {
            Some(sum) => sum,
            None => return Err(Fault::Overflow),
        };
        decimals += 1;
        i += 1;
    }
    if decimals == 0 || i != bytes.len() {
        return Err(Fault::NotDecimal);
    }
    Ok(micros)
}

/// Parses a non-negative decimal dollar amount (`5`, `0.25`, `$1.50`, `1_000`) into micro-dollars,
/// exactly. More than 6 decimals is refused rather than rounded.
pub fn parse_usd(text: &str) -> Result<u64, MoneyError> {
    let trimmed = text.trim();
    let plain = trimmed
        .strip_prefix('$')
        .unwrap_or(trimmed)
        .replace('_', "");
    parse_micros(&plain).map_err(|fault| match fault {
        Fault::Overflow => MoneyError::Overflow(text.to_owned()),
        Fault::Empty | Fault::Negative | Fault::NotDecimal | Fault::TooManyDecimals => {
            MoneyError::Syntax(text.to_owned())
        }
    })
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
        assert_eq!(parse_usd("0.000001"), Ok(1));
        assert_eq!(parse_usd("1_000"), Ok(1_000_000_000));
        for bad in [
            "",
            ".",
            ".5",
            "5.",
            "-1",
            "1.0000001",
            "1e3",
            "abc",
            "1.2.3",
            "nan",
        ] {
            assert!(parse_usd(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_micros("1.1234567"), Err(Fault::TooManyDecimals));
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
