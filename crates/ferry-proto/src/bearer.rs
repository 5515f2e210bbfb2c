//! The client side of Ferry's bearer tokens (client API keys, the admin token): a tonic
//! interceptor that adds `authorization: Bearer TOKEN` to every call, or nothing without a token.

use tonic::metadata::AsciiMetadataValue;

/// Adds `authorization: Bearer TOKEN` to every call when a token is given.
#[derive(Clone, Debug, Default)]
pub struct Bearer(Option<AsciiMetadataValue>);

/// A token that cannot travel in a header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidToken;

impl std::fmt::Display for InvalidToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the token is not a valid header value (printable ASCII only)")
    }
}

impl std::error::Error for InvalidToken {}

impl Bearer {
    /// Blank or absent: no header.
    pub fn new(token: Option<&str>) -> Result<Bearer, InvalidToken> {
        match token.map(str::trim).filter(|t| !t.is_empty()) {
            None => Ok(Bearer(None)),
            Some(t) => format!("Bearer {t}").parse().map(|v| Bearer(Some(v))).map_err(|_| InvalidToken),
        }
    }
}

impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor;

    #[test]
    fn adds_the_header_only_with_a_token() {
        let mut b = Bearer::new(Some(" k3y ")).unwrap();
        let req = b.call(tonic::Request::new(())).unwrap();
        assert_eq!(req.metadata().get("authorization").unwrap(), "Bearer k3y");
        for none in [None, Some(""), Some("  ")] {
            let req = Bearer::new(none).unwrap().call(tonic::Request::new(())).unwrap();
            assert!(req.metadata().get("authorization").is_none());
        }
        assert_eq!(Bearer::new(Some("bad\nkey")).unwrap_err(), InvalidToken);
    }
}

/// The token in an `authorization` value of the form `Bearer TOKEN` (the scheme is
/// case-insensitive); None for anything else.
pub fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let value = value.trim_ascii();
    let (scheme, rest) = value.split_at_checked(6)?;
    if !scheme.eq_ignore_ascii_case(b"bearer") || !rest.first()?.is_ascii_whitespace() {
        return None;
    }
    let key = rest.trim_ascii();
    (!key.is_empty()).then_some(key)
}

/// Equality whose time depends only on the lengths, not on where the bytes differ.
pub fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() != b.len()) as u8;
    // Walk `a` whatever `b` is, so a length mismatch costs the same as a content mismatch.
    for (i, &x) in a.iter().enumerate() {
        let y = b.get(i).copied().unwrap_or(!x);
        diff |= x ^ y;
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod parse_tests {
    use super::*;

    #[test]
    fn constant_time_equality() {
        for (a, b, eq) in [
            (&b"secret"[..], &b"secret"[..], true),
            (b"secret", b"secreT", false),
            (b"secret", b"secre", false),
            (b"secret", b"secrets", false),
            (b"", b"", true),
            (b"a", b"", false),
        ] {
            assert_eq!(ct_eq(a, b), eq, "{a:?} vs {b:?}");
        }
    }

    #[test]
    fn bearer_values() {
        assert_eq!(bearer_token(b"Bearer k1"), Some(&b"k1"[..]));
        assert_eq!(bearer_token(b"bearer   k1  "), Some(&b"k1"[..]));
        assert_eq!(bearer_token(b"BEARER\tk1"), Some(&b"k1"[..]));
        assert_eq!(bearer_token(b"Bearerk1"), None);
        assert_eq!(bearer_token(b"Basic k1"), None);
        assert_eq!(bearer_token(b"Bearer "), None);
        assert_eq!(bearer_token(b"k1"), None);
        assert_eq!(bearer_token(b""), None);
    }
}
