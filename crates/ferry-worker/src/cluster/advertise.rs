//! The addresses a worker advertises to the router and its peers, computed from what it bound and
//! what the operator said. In a container the worker binds `0.0.0.0` and must advertise its pod's
//! address instead (`--advertise-host $(POD_IP)`); the decode worker's KV data path must follow,
//! or peers would be told to connect to `0.0.0.0`.

use std::net::SocketAddr;

/// What the operator asked for.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdvertiseOptions {
    /// The full gRPC address to advertise (`host:port`).
    pub addr: Option<String>,
    /// The host (name or IP) to advertise, with the bound ports.
    pub host: Option<String>,
}

/// The advertised gRPC address and (decode workers) KV data address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Advertised {
    pub grpc: String,
    /// Empty when the worker has no data path.
    pub data: String,
}

/// `host:port`, with brackets around an IPv6 host.
pub fn join_host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') { format!("[{host}]:{port}") } else { format!("{host}:{port}") }
}

/// The host part of `host:port` (brackets removed); None when there is no port.
fn host_of(addr: &str) -> Option<&str> {
    let (host, port) = addr.rsplit_once(':')?;
    if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    (!host.is_empty()).then_some(host)
}

/// Decide the advertised addresses. The host is `opts.host`, else the host of `opts.addr`, else
/// the bound gRPC IP. The gRPC address is `opts.addr` when given, else host and bound port. The
/// data address keeps its bound IP unless that IP is unspecified (`0.0.0.0`, `::`) or a host was
/// given explicitly; then it is the advertised host with the bound data port.
pub fn advertised(grpc_bound: SocketAddr, data_bound: Option<SocketAddr>, opts: &AdvertiseOptions) -> Advertised {
    let host = match (&opts.host, opts.addr.as_deref().and_then(host_of)) {
        (Some(h), _) => h.clone(),
        (None, Some(h)) => h.to_string(),
        (None, None) => grpc_bound.ip().to_string(),
    };
    let grpc = match &opts.addr {
        Some(a) => a.clone(),
        None => join_host_port(&host, grpc_bound.port()),
    };
    let data = match data_bound {
        None => String::new(),
        Some(d) if d.ip().is_unspecified() || opts.host.is_some() => join_host_port(&host, d.port()),
        Some(d) => d.to_string(),
    };
    Advertised { grpc, data }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn advertised_addresses_follow_the_options() {
        let opts = |addr: Option<&str>, host: Option<&str>| AdvertiseOptions { addr: addr.map(Into::into), host: host.map(Into::into) };
        // (grpc bound, data bound, options, want grpc, want data)
        let cases: &[(&str, Option<&str>, AdvertiseOptions, &str, &str)] = &[
            ("127.0.0.1:7710", None, opts(None, None), "127.0.0.1:7710", ""),
            ("127.0.0.1:7720", Some("127.0.0.1:7721"), opts(None, None), "127.0.0.1:7720", "127.0.0.1:7721"),
            // A pod: bound on every interface, advertising its own IP.
            ("0.0.0.0:7720", Some("0.0.0.0:7721"), opts(None, Some("10.1.2.3")), "10.1.2.3:7720", "10.1.2.3:7721"),
            // --advertise alone: the data path takes its host when bound unspecified.
            ("0.0.0.0:7720", Some("0.0.0.0:7721"), opts(Some("node-a:9000"), None), "node-a:9000", "node-a:7721"),
            ("0.0.0.0:7720", Some("127.0.0.1:7721"), opts(Some("node-a:9000"), None), "node-a:9000", "127.0.0.1:7721"),
            // Both: the full address wins for gRPC, the host for data.
            ("0.0.0.0:7720", Some("0.0.0.0:7721"), opts(Some("a:1"), Some("b")), "a:1", "b:7721"),
            ("[::]:7720", Some("[::]:7721"), opts(None, Some("fd00::5")), "[fd00::5]:7720", "[fd00::5]:7721"),
            ("0.0.0.0:7720", Some("0.0.0.0:7721"), opts(Some("[fd00::6]:7720"), None), "[fd00::6]:7720", "[fd00::6]:7721"),
            // No advertising at all: today's behaviour, the bound addresses.
            ("0.0.0.0:7720", Some("0.0.0.0:7721"), opts(None, None), "0.0.0.0:7720", "0.0.0.0:7721"),
        ];
        for (grpc, data, o, want_grpc, want_data) in cases {
            let got = advertised(sa(grpc), data.map(sa), o);
            assert_eq!((got.grpc.as_str(), got.data.as_str()), (*want_grpc, *want_data), "{grpc} {data:?} {o:?}");
        }
    }

    #[test]
    fn host_of_rejects_what_is_not_host_port() {
        assert_eq!(host_of("a:1"), Some("a"));
        assert_eq!(host_of("[::1]:7"), Some("::1"));
        assert_eq!(host_of("a"), None);
        assert_eq!(host_of(":80"), None);
        assert_eq!(host_of("a:b"), None);
    }
}
