//! The cluster secret: the one credential every member of a Ferry cluster holds (its routers, its
//! workers, `ferry up`'s scaler) and every cluster-internal port checks: the router's `Registry`,
//! each worker's `Prefill`, `Decode` and `KvTransfer` services, the decode workers' plaintext KV
//! data port, and the scaler. Client API keys and the operators' admin token are separate
//! credentials (see `ferry_router::auth`); a holder of either cannot call a worker.
//!
//! gRPC calls carry it as `authorization: Bearer SECRET` ([`ClusterSecret::bearer`]); the TCP
//! data path sends it in its first frame. Like any bearer token it travels in clear text unless
//! TLS is on, so on a network you do not trust, run with mutual TLS as well (`--tls-*`), which
//! also turns the plaintext data path off. Unset ([`ClusterSecret::open`]) every check passes: the
//! library default for in-process tests; the `ferry` commands refuse to start open unless told
//! `--insecure-open-cluster`, and `ferry up` makes one for its own cluster.

use std::sync::Arc;

use crate::bearer::{bearer_token, ct_eq};
use crate::Bearer;

/// The environment variable the `ferry` commands read the secret from.
pub const ENV: &str = "FERRY_CLUSTER_SECRET";
/// The shortest secret accepted (characters); `ferry up` makes 64 hex characters.
pub const MIN_LEN: usize = 16;
/// The longest secret accepted (it travels in a header and in the data path's first frame).
pub const MAX_LEN: usize = 256;

/// A secret that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SecretError {
    #[error("the cluster secret has {len} characters; it needs at least {MIN_LEN} (e.g. the output of `openssl rand -hex 32`)")]
    TooShort { len: usize },
    #[error("the cluster secret has {len} characters; at most {MAX_LEN} are accepted")]
    TooLong { len: usize },
    #[error("the cluster secret must be printable ASCII with no spaces")]
    NotPrintable,
}

/// The cluster's shared secret, or none (open).
#[derive(Clone, Default)]
pub struct ClusterSecret(Option<Set>);

#[derive(Clone)]
struct Set {
    secret: Arc<str>,
    bearer: Bearer,
}

impl std::fmt::Debug for ClusterSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.is_set() { "ClusterSecret(set)" } else { "ClusterSecret(open)" })
    }
}

/// Why a caller was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// No credential, or not of the form `Bearer SECRET`.
    Missing,
    /// A credential that is not the cluster's secret.
    Wrong,
}

impl Refusal {
    pub fn message(self) -> &'static str {
        match self {
            Refusal::Missing => {
                "missing cluster secret: this port serves only members of the Ferry cluster (routers and workers send FERRY_CLUSTER_SECRET)"
            }
            Refusal::Wrong => "invalid cluster secret",
        }
    }
}

impl ClusterSecret {
    /// No secret: every check passes.
    pub fn open() -> ClusterSecret {
        ClusterSecret(None)
    }

    /// `secret` (surrounding whitespace trimmed, as a file's trailing newline).
    pub fn new(secret: &str) -> Result<ClusterSecret, SecretError> {
        let secret = secret.trim();
        let len = secret.chars().count();
        if !secret.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(SecretError::NotPrintable);
        }
        if len < MIN_LEN {
            return Err(SecretError::TooShort { len });
        }
        if len > MAX_LEN {
            return Err(SecretError::TooLong { len });
        }
        let bearer = Bearer::new(Some(secret)).map_err(|_| SecretError::NotPrintable)?;
        Ok(ClusterSecret(Some(Set { secret: secret.into(), bearer })))
    }

    pub fn is_set(&self) -> bool {
        self.0.is_some()
    }

    /// The secret itself, to hand to a child process's environment (never to a log).
    pub fn reveal(&self) -> Option<&str> {
        self.0.as_ref().map(|s| &*s.secret)
    }

    /// The client side: adds `authorization: Bearer SECRET` to every call (nothing when open).
    pub fn bearer(&self) -> Bearer {
        self.0.as_ref().map(|s| s.bearer.clone()).unwrap_or_default()
    }

    /// Whether `presented` (the raw secret, as the data path's first frame carries it) is the
    /// cluster's; always when open. Constant time for a given length.
    pub fn admits(&self, presented: &[u8]) -> bool {
        match &self.0 {
            None => true,
            Some(s) => ct_eq(s.secret.as_bytes(), presented),
        }
    }

    /// Checks an `authorization` header value (None when absent).
    pub fn check(&self, header: Option<&[u8]>) -> Result<(), Refusal> {
        if self.0.is_none() {
            return Ok(());
        }
        let token = header.and_then(bearer_token).ok_or(Refusal::Missing)?;
        if self.admits(token) { Ok(()) } else { Err(Refusal::Wrong) }
    }

    /// The server side, as a tonic interceptor for a cluster-internal service; `refused` is
    /// called on every refusal (to count and log it where the server keeps its metrics).
    pub fn guard(&self, refused: fn(Refusal)) -> ClusterGuard {
        ClusterGuard { secret: self.clone(), refused }
    }
}

/// Refuses a call without the cluster secret with UNAUTHENTICATED before it reaches the service.
#[derive(Clone)]
pub struct ClusterGuard {
    secret: ClusterSecret,
    refused: fn(Refusal),
}

impl tonic::service::Interceptor for ClusterGuard {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let header = req.metadata().get("authorization").map(|v| v.as_bytes());
        match self.secret.check(header) {
            Ok(()) => Ok(req),
            Err(r) => {
                (self.refused)(r);
                Err(tonic::Status::unauthenticated(r.message()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tonic::service::Interceptor;

    const S: &str = "0123456789abcdef0123";

    fn call(guard: &mut ClusterGuard, header: Option<&str>) -> Result<(), tonic::Code> {
        let mut req = tonic::Request::new(());
        if let Some(h) = header {
            req.metadata_mut().insert("authorization", h.parse().unwrap());
        }
        guard.call(req).map(drop).map_err(|s| s.code())
    }

    #[test]
    fn a_set_secret_admits_only_itself() {
        let secret = ClusterSecret::new(&format!("  {S}\n")).unwrap();
        let mut g = secret.guard(|_| {});
        assert_eq!(call(&mut g, Some(&format!("Bearer {S}"))), Ok(()));
        assert_eq!(call(&mut g, Some(&format!("Bearer {S}x"))), Err(tonic::Code::Unauthenticated));
        assert_eq!(call(&mut g, Some(S)), Err(tonic::Code::Unauthenticated));
        assert_eq!(call(&mut g, None), Err(tonic::Code::Unauthenticated));
        assert!(secret.admits(S.as_bytes()) && !secret.admits(b"0123456789abcdef012"));
        assert_eq!(secret.check(None), Err(Refusal::Missing));
        assert_eq!(secret.check(Some(b"Bearer nope-nope-nope-nope")), Err(Refusal::Wrong));
        // What the client side sends is what the server side takes.
        let req = secret.bearer().call(tonic::Request::new(())).unwrap();
        assert_eq!(secret.check(req.metadata().get("authorization").map(|v| v.as_bytes())), Ok(()));
        assert_eq!(format!("{secret:?}"), "ClusterSecret(set)");
    }

    #[test]
    fn open_admits_everyone_and_sends_nothing() {
        let open = ClusterSecret::open();
        assert_eq!(call(&mut open.guard(|_| {}), None), Ok(()));
        assert!(open.admits(b""));
        let req = open.bearer().call(tonic::Request::new(())).unwrap();
        assert!(req.metadata().get("authorization").is_none());
    }

    #[test]
    fn weak_or_unsendable_secrets_are_refused() {
        assert_eq!(ClusterSecret::new("short").unwrap_err(), SecretError::TooShort { len: 5 });
        assert_eq!(ClusterSecret::new(&"x".repeat(MAX_LEN + 1)).unwrap_err(), SecretError::TooLong { len: MAX_LEN + 1 });
        assert_eq!(ClusterSecret::new("0123456789 abcdef").unwrap_err(), SecretError::NotPrintable);
        assert_eq!(ClusterSecret::new("0123456789abcdéf0").unwrap_err(), SecretError::NotPrintable);
    }

    #[test]
    fn refusals_are_reported() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let mut g = ClusterSecret::new(S).unwrap().guard(|_| {
            N.fetch_add(1, Ordering::Relaxed);
        });
        let _ = call(&mut g, None);
        let _ = call(&mut g, Some("Bearer wrong-wrong-wrong-wrong"));
        let _ = call(&mut g, Some(&format!("Bearer {S}")));
        assert_eq!(N.load(Ordering::Relaxed), 2);
    }
}
