//! HTML text: the one escape function every value from the data goes through ([`escape`]),
//! the page frame ([`page`]) and the number formats the pages and their test share.
//!
//! Everything a page shows (agent names, model names, messages) is data someone else chose: it
//! reaches the HTML only through [`escape`] (text and quoted attribute values) or, inside a URL
//! path, [`path_segment`] first. No markup is built from a value any other way.

use std::fmt::Write as _;

/// Escapes text for an HTML text node or a double-quoted attribute value.
pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            // Control characters have no business on a page (and some break it).
            c if c.is_control() && c != '\n' && c != '\t' => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

/// A value as one URL path segment: every byte but unreserved ones percent-encoded (the result
/// still goes through [`escape`] in an attribute, which leaves it unchanged).
pub fn path_segment(text: &str) -> String {
    const SET: &percent_encoding::AsciiSet = &percent_encoding::NON_ALPHANUMERIC
        .remove(b'-')
        .remove(b'_')
        .remove(b'.')
        .remove(b'~');
    percent_encoding::utf8_percent_encode(text, SET).to_string()
}

/// Micro-dollars as dollars: `$12.3456` (four decimals below $100, two above).
pub fn usd(micros: u64) -> String {
    let dollars = micros / 1_000_000;
    let frac = micros % 1_000_000;
    if dollars >= 100 {
        format!("${dollars}.{:02}", frac / 10_000)
    } else {
        format!("${dollars}.{:04}", frac / 100)
    }
}

/// A rate in 0..=1 as a percentage with one decimal.
pub fn pct(rate: f64) -> String {
    if rate.is_finite() {
        format!("{:.1}%", rate * 100.0)
    } else {
        "–".to_owned()
    }
}

/// A whole number with thin spaces between thousands (`1 234 567`).
pub fn count(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push('\u{202f}');
        }
        out.push(c);
    }
    out
}

/// A protobuf timestamp as `2026-11-29 08:43 UTC`.
pub fn time(t: Option<&prost_types::Timestamp>) -> String {
    t.and_then(|t| chrono::DateTime::from_timestamp(t.seconds, 0))
        .map_or_else(
            || "–".to_owned(),
            |d| d.format("%Y-%m-%d %H:%M UTC").to_string(),
        )
}

/// A protobuf timestamp as a date, `2026-11-29`.
pub fn date(t: Option<&prost_types::Timestamp>) -> String {
    t.and_then(|t| chrono::DateTime::from_timestamp(t.seconds, 0))
        .map_or_else(|| "–".to_owned(), |d| d.format("%Y-%m-%d").to_string())
}

/// Which top-level page a page belongs to (the navigation marks it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Nav {
    Agents,
    Experiments,
    Usage,
    None,
}

/// The whole document: head, navigation (with the sign-out form when signed in), `body`.
pub fn page(title: &str, nav: Nav, signed_in: Option<&SignedIn<'_>>, body: &str) -> String {
    let mut out = String::with_capacity(body.len() + 1500);
    let _ = write!(
        out,
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{} · nm-gateway</title>\
         <link rel=\"icon\" href=\"/favicon.svg\" type=\"image/svg+xml\">\
         <link rel=\"stylesheet\" href=\"/style.css\"></head><body>\
         <header><a class=\"brand\" href=\"/agents\">nm-gateway</a>",
        escape(title)
    );
    if let Some(s) = signed_in {
        out.push_str("<nav aria-label=\"Pages\"><ul>");
        for (item, href, label) in [
            (Nav::Agents, "/agents", "Agents"),
            (Nav::Experiments, "/experiments", "Experiments"),
            (Nav::Usage, "/usage", "Usage and budgets"),
        ] {
            let current = if item == nav {
                " aria-current=\"page\""
            } else {
                ""
            };
            let _ = write!(out, "<li><a href=\"{href}\"{current}>{label}</a></li>");
        }
        let _ = write!(
            out,
            "</ul></nav><form class=\"signout\" method=\"post\" action=\"/sign-out\">\
             <input type=\"hidden\" name=\"csrf\" value=\"{}\">\
             <span>{} ({})</span> <button type=\"submit\">Sign out</button></form>",
            escape(s.csrf),
            escape(s.key_id),
            escape(s.role)
        );
    }
    let _ = writeln!(
        out,
        "</header><main id=\"main\"><h1>{}</h1>{body}</main></body></html>",
        escape(title)
    );
    out
}

/// Who is signed in, for the page's header.
#[derive(Debug)]
pub struct SignedIn<'a> {
    pub key_id: &'a str,
    pub role: &'a str,
    pub csrf: &'a str,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escape_neutralises_markup_quotes_and_controls() {
        assert_eq!(
            escape("<script>alert('x')</script>&\"a\""),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;&quot;a&quot;"
        );
        assert_eq!(escape("a\u{0}b\u{1b}c"), "a\u{fffd}b\u{fffd}c");
        assert_eq!(escape("plain agent-1 é"), "plain agent-1 é");
        assert_eq!(escape(""), "");
    }

    #[test]
    fn escaped_text_never_contains_a_raw_special_character() {
        let nasty: String = (0u8..=127).map(char::from).filter(|c| *c != ';').collect();
        let e = escape(&nasty);
        assert!(!e.contains(['<', '>', '"', '\'']), "{e}");
        assert_eq!(e.matches('&').count(), e.matches(';').count());
    }

    #[test]
    fn path_segments_are_percent_encoded() {
        assert_eq!(path_segment("a b/../c"), "a%20b%2F..%2Fc");
        assert_eq!(path_segment("support-bot_2.x"), "support-bot_2.x");
        assert_eq!(path_segment("\"><"), "%22%3E%3C");
    }

    #[test]
    fn numbers_read_as_people_write_them() {
        assert_eq!(usd(0), "$0.0000");
        assert_eq!(usd(1_234_567), "$1.2345");
        assert_eq!(usd(123_456_789), "$123.45");
        assert_eq!(pct(0.5), "50.0%");
        assert_eq!(pct(f64::NAN), "–");
        assert_eq!(count(0), "0");
        assert_eq!(count(1_234_567), "1\u{202f}234\u{202f}567");
        assert_eq!(count(123), "123");
    }
}
