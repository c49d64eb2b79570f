//! Durations as people write them on a command line or in a setting: one or more `<n><unit>`
//! groups, units `s`, `m`, `h`, `d` (24 h) and `w` (7 d), as in `30s`, `12h`, `90d`, `1h30m`.
//! Anything else (a bare number, a sign, a space, an unknown unit, a value past a century) is
//! refused with a message naming the accepted forms.

use std::time::Duration;

/// Longest duration accepted: 100 years (a key's expiry or a grace period beyond is a typo).
pub const MAX: Duration = Duration::from_secs(100 * 365 * 86_400);

/// Why a duration was refused; the message names the accepted forms.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a duration: write <n><unit>, units s, m, h, d, w (e.g. 30s, 12h, 90d, 1h30m)"
)]
pub struct DurationError(pub String);

/// Parses `30s`, `12h`, `90d`, `2w`, `1h30m` (groups add up).
pub fn parse(text: &str) -> Result<Duration, DurationError> {
    let fail = || DurationError(text.chars().take(64).collect());
    let mut rest = text.as_bytes();
    if rest.is_empty() {
        return Err(fail());
    }
    let mut total: u64 = 0;
    while !rest.is_empty() {
        let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 || digits > 12 {
            return Err(fail());
        }
        let n: u64 = std::str::from_utf8(&rest[..digits])
            .ok()
            .and_then(|d| d.parse().ok())
            .ok_or_else(fail)?;
        let unit: u64 = match rest.get(digits) {
            Some(b's') => 1,
            Some(b'm') => 60,
            Some(b'h') => 3_600,
            Some(b'd') => 86_400,
            Some(b'w') => 7 * 86_400,
            _ => return Err(fail()),
        };
        total = n
            .checked_mul(unit)
            .and_then(|s| total.checked_add(s))
            .filter(|s| *s <= MAX.as_secs())
            .ok_or_else(fail)?;
        rest = &rest[digits + 1..];
    }
    Ok(Duration::from_secs(total))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn durations() {
        for (text, secs) in [
            ("0s", 0),
            ("30s", 30),
            ("5m", 300),
            ("12h", 43_200),
            ("90d", 7_776_000),
            ("2w", 1_209_600),
            ("1h30m", 5_400),
            ("1d1s", 86_401),
        ] {
            assert_eq!(parse(text), Ok(Duration::from_secs(secs)), "{text}");
        }
        for bad in [
            "",
            "30",
            "s",
            "-1h",
            "+1h",
            "1 h",
            "1H",
            "1y",
            "1.5h",
            "h1",
            "1hh",
            "99999999999999d",
            "36500d1s",
            "1h ",
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(parse("36500d"), Ok(MAX));
        assert!(
            parse("soon")
                .err()
                .is_some_and(|e| e.to_string().contains("12h"))
        );
    }

    proptest! {
        /// Every sum of groups written out parses to its total; nothing panics on any input.
        #[test]
        fn written_durations_round_trip(groups in proptest::collection::vec((0u64..1_000, 0usize..5), 1..5)) {
            let units = [('s', 1u64), ('m', 60), ('h', 3_600), ('d', 86_400), ('w', 604_800)];
            let text: String = groups.iter().map(|(n, u)| format!("{n}{}", units[*u].0)).collect();
            let total: u64 = groups.iter().map(|(n, u)| n * units[*u].1).sum();
            prop_assert_eq!(parse(&text), Ok(Duration::from_secs(total)));
        }

        #[test]
        fn never_panics(text in ".{0,24}") {
            let _ = parse(&text);
        }
    }
}
