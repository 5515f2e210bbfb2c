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
