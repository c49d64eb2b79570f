//! Splits `/<provider>/<native path>` and refuses native paths that could leave the provider's
//! API once joined to its base URL.
//!
//! The gateway never normalises a path (that would change what the provider sees); it refuses
//! anything a normaliser, a proxy or the provider itself might read as a different resource:
//! dot segments (`..`, `.`, also percent-encoded), encoded slashes or backslashes (`%2F` in a
//! model id), backslashes, userinfo markers (`@`), embedded URLs (`http://...`), a leading `//`,
//! and encoded control characters.
//!
//! A segment is judged at every level of percent-encoding it carries, not only the first:
//! `%252e%252e` decodes to `%2e%2e`, which a second decoder (a proxy in front of the provider,
//! a framework that decodes again) turns into `..`. So a segment is decoded until nothing
//! changes, each level checked by the same rules; a segment still encoded after
//! [`MAX_DECODE_LEVELS`] levels is refused as bad encoding (no real path nests that deep).

/// Why a native path was refused. The message is safe to show to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("path contains a '.' or '..' segment")]
    DotSegment,
    #[error("path contains an encoded '/' or '\\'")]
    EncodedSeparator,
    #[error("path contains a backslash")]
    Backslash,
    #[error("path contains '@'")]
    At,
    #[error("path contains an absolute URL or an empty leading segment")]
    AbsoluteUrl,
    #[error("path contains an encoded control character or invalid percent-encoding")]
    BadEncoding,
}

/// Levels of percent-encoding a segment may nest before it is refused.
pub const MAX_DECODE_LEVELS: usize = 4;

/// `/<prefix>/<rest>` -> (`prefix`, `/<rest>`). `None` when the path has no prefix segment.
pub fn split_prefix(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix('/')?;
    // A byte loop: the prefix is a short name, shorter than `find`'s set-up (three calls per
    // request).
    let (prefix, native) = match rest.bytes().position(|b| b == b'/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    (!prefix.is_empty()).then_some((prefix, native))
}

/// Checks a native path (still percent-encoded, starting with `/`).
pub fn check_native_path(native: &str) -> Result<(), PathError> {
    if native.starts_with("//") {
        return Err(PathError::AbsoluteUrl);
    }
    // Most paths hold none of the bytes the rules below look for: one pass clears them.
    if !native
        .bytes()
        .any(|b| matches!(b, b'\\' | b'@' | b'%' | b'.' | b':'))
    {
        return Ok(());
    }
    if native.contains('\\') {
        return Err(PathError::Backslash);
    }
    if native.contains("://") {
        return Err(PathError::AbsoluteUrl);
    }
    for segment in native.split('/') {
        if segment.contains('@') {
            return Err(PathError::At);
        }
        if !segment.contains('%') {
            if segment == "." || segment == ".." {
                return Err(PathError::DotSegment);
            }
            continue;
        }
        check_encoded_segment(segment)?;
    }
    Ok(())
}

/// Checks a segment holding `%` at each level of its encoding (see the module doc).
fn check_encoded_segment(segment: &str) -> Result<(), PathError> {
    if !valid_escapes(segment) {
        return Err(PathError::BadEncoding);
    }
    let mut current = segment.as_bytes().to_vec();
    for _ in 0..MAX_DECODE_LEVELS {
        let decoded: Vec<u8> = percent_encoding::percent_decode(&current).collect();
        if decoded.iter().any(|b| b.is_ascii_control()) {
            return Err(PathError::BadEncoding);
        }
        if decoded.iter().any(|&b| b == b'/' || b == b'\\') {
            return Err(PathError::EncodedSeparator);
        }
        if decoded.contains(&b'@') {
            return Err(PathError::At);
        }
        if decoded == b"." || decoded == b".." {
            return Err(PathError::DotSegment);
        }
        if String::from_utf8_lossy(&decoded).contains("://") {
            return Err(PathError::AbsoluteUrl);
        }
        // Another level only where a valid escape remains (a lone `%` decodes to itself).
        if decoded == current || !has_escape(&decoded) {
            return Ok(());
        }
        current = decoded;
    }
    Err(PathError::BadEncoding)
}

/// Whether `b` holds a `%` followed by two hex digits.
fn has_escape(b: &[u8]) -> bool {
    b.windows(3)
        .any(|w| w[0] == b'%' && w[1].is_ascii_hexdigit() && w[2].is_ascii_hexdigit())
}

/// Every `%` starts a two-hex-digit escape.
fn valid_escapes(s: &str) -> bool {
    let b = s.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let ok = b.get(i + 1).is_some_and(u8::is_ascii_hexdigit)
                && b.get(i + 2).is_some_and(u8::is_ascii_hexdigit);
            if !ok {
                return false;
            }
            i += 3;
        } else {
            i += 1;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;
    use percent_encoding::percent_decode_str;
    use proptest::prelude::*;

    #[test]
    fn splits() {
        assert_eq!(
            split_prefix("/openai/v1/chat/completions"),
            Some(("openai", "/v1/chat/completions"))
        );
        assert_eq!(split_prefix("/openai"), Some(("openai", "/")));
        assert_eq!(split_prefix("/"), None);
        assert_eq!(split_prefix("//x"), None);
    }

    #[test]
    fn accepts_real_provider_paths() {
        for p in [
            "/v1/chat/completions",
            "/v1/messages",
            "/v1beta/models/gemini-2.0-flash:streamGenerateContent",
            "/v1/models/gemini-2.0-flash:generateContent",
            "/openai/v1/chat/completions",
            "/v1/models/ft%3Agpt-4o%3Aorg",
            "/v1/files/file-abc/content",
            "/",
        ] {
            assert_eq!(check_native_path(p), Ok(()), "{p}");
        }
    }

    #[test]
    fn refuses_escapes() {
        let cases = [
            ("/v1/../admin", PathError::DotSegment),
            ("/v1/./x", PathError::DotSegment),
            ("/v1/%2e%2e/admin", PathError::DotSegment),
            ("/v1/%2E./admin", PathError::DotSegment),
            (
                "/v1/models/a%2Fb:generateContent",
                PathError::EncodedSeparator,
            ),
            ("/v1/models/a%2fb", PathError::EncodedSeparator),
            ("/v1/models/a%5cb", PathError::EncodedSeparator),
            ("/v1\\x", PathError::Backslash),
            ("/v1/user@evil.com", PathError::At),
            ("/v1/a%40b", PathError::At),
            ("//evil.com/v1", PathError::AbsoluteUrl),
            ("/http://evil.com/v1", PathError::AbsoluteUrl),
            ("/http%3A%2F%2Fevil.com", PathError::EncodedSeparator),
            ("/v1/a%00b", PathError::BadEncoding),
            ("/v1/a%zz", PathError::BadEncoding),
            ("/v1/a%4", PathError::BadEncoding),
            // Encoded more than once: a second decoder would see the dot segment or separator.
            ("/v1/%252e%252e/admin", PathError::DotSegment),
            ("/v1/%252E%252e", PathError::DotSegment),
            ("/v1/%25252e%25252e/x", PathError::DotSegment),
            ("/v1/%252e/x", PathError::DotSegment),
            ("/v1/models/a%252Fb", PathError::EncodedSeparator),
            ("/v1/a%252540b", PathError::At),
            ("/v1/a%2500b", PathError::BadEncoding),
            ("/v1/%2525252525252e", PathError::BadEncoding),
        ];
        for (p, want) in cases {
            assert_eq!(check_native_path(p), Err(want), "{p}");
        }
    }

    #[test]
    fn a_literal_percent_sign_that_is_no_escape_is_kept() {
        // `%25` alone decodes to a `%` that starts no further escape: one level, accepted.
        assert_eq!(check_native_path("/v1/files/100%25"), Ok(()));
        assert_eq!(check_native_path("/v1/files/100%25zz"), Ok(()));
    }

    /// Every level of decoding of `seg`, up to the point where nothing changes.
    fn levels(seg: &str) -> Vec<String> {
        let mut out = vec![seg.to_owned()];
        for _ in 0..8 {
            let Some(last) = out.last() else { break };
            let next = percent_decode_str(last).decode_utf8_lossy().into_owned();
            if &next == last {
                break;
            }
            out.push(next);
        }
        out
    }

    /// `s` percent-encoded byte for byte `times` times, each time with random hex case.
    fn encode_times(s: &str, times: usize, upper: bool) -> String {
        let mut out = s.to_owned();
        for _ in 0..times {
            out = out
                .bytes()
                .map(|b| {
                    if upper {
                        format!("%{b:02X}")
                    } else {
                        format!("%{b:02x}")
                    }
                })
                .collect();
        }
        out
    }

    proptest! {
        /// Whatever is accepted has no dot segment, separator or '@' at any level of decoding.
        #[test]
        fn accepted_paths_stay_inside(segs in proptest::collection::vec("[a-zA-Z0-9%.:@/\\\\-]{0,8}", 1..6)) {
            let path = format!("/{}", segs.join("/"));
            if check_native_path(&path).is_ok() {
                for seg in path.split('/') {
                    for d in levels(seg) {
                        prop_assert!(d != "." && d != "..");
                        prop_assert!(!d.contains('/') && !d.contains('\\') && !d.contains('@'));
                    }
                }
                prop_assert!(!path.starts_with("//"));
            }
        }

        /// A dot segment or a separator, encoded any number of times up to the limit (and in
        /// either hex case), is refused; so is anything nested deeper.
        #[test]
        fn encoded_escapes_are_refused_at_any_depth(
            which in prop::sample::select(vec![".", "..", "/", "\\", "@"]),
            times in 1usize..=6,
            upper: bool,
            prefix in "[a-z]{0,3}",
        ) {
            let seg = encode_times(which, times, upper);
            // A separator or '@' inside a longer segment is still refused; a dot is only a
            // dot segment alone.
            let seg = if which.starts_with('.') { seg } else { format!("{prefix}{seg}") };
            let path = format!("/v1/{seg}/x");
            prop_assert!(check_native_path(&path).is_err(), "{path}");
        }
    }
}
