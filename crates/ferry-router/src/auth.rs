//! API keys for the client APIs (`ferry.v1.Ferry` over gRPC and the OpenAI-compatible HTTP
//! routes). With no key configured both are open; with any, a request must carry
//! `authorization: Bearer KEY` naming one of them. The worker-facing `Registry` takes the cluster
//! secret ([`ferry_proto::cluster`]) and the operators' `Admin` the admin token ([`AdminToken`]),
//! or the cluster secret when no admin token is set: a client key cannot register a worker, drain
//! one or scale a pool.
//!
//! Keys are compared in constant time (for a given key length) and are never logged: `Debug`
//! prints only how many there are.

use std::sync::Arc;

use ferry_proto::{ClusterSecret, bearer_token as bearer, ct_eq};

pub use ferry_core::Tenant;

/// The configured keys; empty means no authentication.
#[derive(Clone, Default)]
pub struct ApiKeys(Arc<[Vec<u8>]>);

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} configured)", self.0.len())
    }
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AuthFailure {
    /// No `authorization` header, or not of the form `Bearer KEY`.
    Missing,
    /// A key that is not one of the configured ones.
    Wrong,
}

impl AuthFailure {
    pub fn message(self) -> &'static str {
        match self {
            AuthFailure::Missing => "missing API key: send the header `Authorization: Bearer KEY`",
            AuthFailure::Wrong => "invalid API key",
        }
    }
}

impl ApiKeys {
    /// Keys as given; blank ones (after trimming) are dropped.
    pub fn new<I, S>(keys: I) -> ApiKeys
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let keys: Vec<Vec<u8>> = keys
            .into_iter()
            .map(|k| k.as_ref().trim().as_bytes().to_vec())
            .filter(|k| !k.is_empty())
            .collect();
        ApiKeys(keys.into())
    }

    /// Keys from a file's text: one per line; blank lines and `#` comments are skipped.
    pub fn parse_file(text: &str) -> Vec<String> {
        text.lines()
            .map(|l| l.split('#').next().unwrap_or("").trim())
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// Keys from a comma-separated list (the `FERRY_API_KEYS` variable).
    pub fn parse_list(list: &str) -> Vec<String> {
        list.split(',')
            .map(str::trim)
            .filter(|k| !k.is_empty())
            .map(str::to_owned)
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Checks an `authorization` header value (`None` when absent). Ok: the request's tenant
    /// (the key it presented, digested; none when no keys are configured), whose prompts share
    /// cached KV only with each other.
    pub fn check(&self, header: Option<&[u8]>) -> Result<Option<Tenant>, AuthFailure> {
        if self.is_empty() {
            return Ok(None);
        }
        let key = header.and_then(bearer).ok_or(AuthFailure::Missing)?;
        // Every configured key is compared, so the time does not say which one matched.
        let mut ok = false;
        for k in self.0.iter() {
            ok |= ct_eq(k, key);
        }
        if ok { Ok(Some(Tenant::of_key(key))) } else { Err(AuthFailure::Wrong) }
    }
}

/// The gRPC side: applied to the `Ferry` service only; refuses with UNAUTHENTICATED before the
/// call reaches the service.
impl tonic::service::Interceptor for ApiKeys {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let header = req.metadata().get("authorization").map(|v| v.as_bytes());
        match self.check(header) {
            Ok(tenant) => {
                if let Some(t) = tenant {
                    req.extensions_mut().insert(t);
                }
                Ok(req)
            }
            Err(f) => {
                crate::metrics::auth_failure("grpc");
                Err(tonic::Status::unauthenticated(f.message()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_against_every_key() {
        let open = ApiKeys::default();
        assert_eq!(open.check(None).map(|_| ()), Ok(()));
        let keys = ApiKeys::new(["k1", " k2 ", ""]);
        assert_eq!(keys.len(), 2);
        assert_eq!(keys.check(Some(b"Bearer k1")).map(|_| ()), Ok(()));
        assert_eq!(keys.check(Some(b"Bearer k2")).map(|_| ()), Ok(()));
        assert_eq!(keys.check(Some(b"Bearer k3")), Err(AuthFailure::Wrong));
        // Each key is its own tenant of the prefix cache; no keys, no tenant.
        assert_eq!(keys.check(Some(b"Bearer k1")), Ok(Some(Tenant::of_key(b"k1"))));
        assert_ne!(keys.check(Some(b"Bearer k1")), keys.check(Some(b"Bearer k2")));
        assert_eq!(open.check(Some(b"Bearer k1")), Ok(None));
        assert_eq!(keys.check(Some(b"k1")), Err(AuthFailure::Missing));
        assert_eq!(keys.check(None), Err(AuthFailure::Missing));
        assert_eq!(format!("{keys:?}"), "ApiKeys(2 configured)");
    }

    #[test]
    fn parses_files_and_lists() {
        let f = "# keys\nk1\n\n  k2  # the second\n#k3\n";
        assert_eq!(ApiKeys::parse_file(f), ["k1", "k2"]);
        assert_eq!(ApiKeys::parse_list(" a, b,,c "), ["a", "b", "c"]);
        assert!(ApiKeys::parse_list("").is_empty());
    }
}

/// The operators' token for the `Admin` service (list, drain, scale); `ferry pool` sends it as
/// `authorization: Bearer TOKEN`. Workers do not hold it: they register with the cluster secret.
#[derive(Clone, Default, Debug)]
pub struct AdminToken(ApiKeys);

impl AdminToken {
    pub fn new(token: Option<&str>) -> AdminToken {
        AdminToken(ApiKeys::new(token))
    }

    pub fn is_set(&self) -> bool {
        !self.0.is_empty()
    }

    /// Who may call `Admin`: holders of this token when it is set; otherwise the cluster's
    /// members (the cluster secret), so the operators' API is never more open than the cluster.
    pub fn guard(&self, cluster: &ClusterSecret) -> AdminGuard {
        AdminGuard { token: self.clone(), cluster: cluster.clone() }
    }
}

/// The `Admin` service's interceptor (see [`AdminToken::guard`]).
#[derive(Clone, Debug)]
pub struct AdminGuard {
    token: AdminToken,
    cluster: ClusterSecret,
}

impl tonic::service::Interceptor for AdminGuard {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let header = req.metadata().get("authorization").map(|v| v.as_bytes());
        let refused = if self.token.is_set() {
            self.token.0.check(header).err().map(|f| match f {
                AuthFailure::Missing => {
                    "missing admin token: send `authorization: Bearer TOKEN` (ferry pool: --admin-token, --admin-token-file or FERRY_ADMIN_TOKEN)"
                }
                AuthFailure::Wrong => "invalid admin token",
            })
        } else {
            self.cluster.check(header).err().map(|r| match r {
                ferry_proto::cluster::Refusal::Missing => {
                    "missing credential: with no admin token set, the Admin API takes the cluster secret (ferry pool: --admin-token-file with the cluster secret's file)"
                }
                ferry_proto::cluster::Refusal::Wrong => "invalid credential for the Admin API",
            })
        };
        match refused {
            None => Ok(req),
            Some(message) => {
                crate::metrics::auth_failure("admin");
                Err(tonic::Status::unauthenticated(message))
            }
        }
    }
}

/// Counts a caller refused at a cluster-internal service (`Registry`) for want of the secret.
pub fn cluster_refused(_: ferry_proto::cluster::Refusal) {
    crate::metrics::auth_failure("cluster");
}
