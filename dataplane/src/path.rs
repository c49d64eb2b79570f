//! Splits `/<provider>/<native path>` and refuses native paths that could leave the provider's
//! API once joined to its base URL.
//!
//! The gateway never normalises a path (that would change what the provider sees); it refuses
//! anything a normaliser, a proxy or the provider itself might read as a different resource:
//! dot segments (`..`, `.`, also percent-encoded), encoded slashes or backslashes (`%2F` in a
//! model id), backslashes, userinfo markers (`@`), embedded URLs (`http://...`), a leading `//`,
//! and encoded control characters.

use percent_encoding::percent_decode_str;

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

/// `/<prefix>/<rest>` -> (`prefix`, `/<rest>`). `None` when the path has no prefix segment.
pub fn split_prefix(path: &str) -> Option<(&str, &str)> {
    let rest = path.strip_prefix('/')?;
    let (prefix, native) = match rest.find('/') {
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
        let decoded = percent_decode_str(segment).collect::<Vec<u8>>();
        if !valid_escapes(segment) || decoded.iter().any(|b| b.is_ascii_control()) {
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
        let text = String::from_utf8_lossy(&decoded);
        if text.contains("://") {
            return Err(PathError::AbsoluteUrl);
        }
    }
    Ok(())
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
        ];
        for (p, want) in cases {
            assert_eq!(check_native_path(p), Err(want), "{p}");
        }
    }

    proptest! {
        /// Whatever is accepted, once decoded, has no dot segment, separator or '@' smuggled in.
        #[test]
        fn accepted_paths_stay_inside(segs in proptest::collection::vec("[a-zA-Z0-9%.:@/\\\\-]{0,8}", 1..6)) {
            let path = format!("/{}", segs.join("/"));
            if check_native_path(&path).is_ok() {
                for seg in path.split('/') {
                    let d = percent_decode_str(seg).decode_utf8_lossy();
                    prop_assert!(d != "." && d != "..");
                    prop_assert!(!d.contains('/') && !d.contains('\\') && !d.contains('@'));
                }
                prop_assert!(!path.starts_with("//"));
            }
        }
    }
}
