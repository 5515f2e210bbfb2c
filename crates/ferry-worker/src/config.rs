//! A worker's configuration ([`WorkerConfig`]) and the KV transports it registers with.

use crate::kv::device::Pipes;
use crate::role::{Role, TransportChoice};
use std::time::Duration;

#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub role: Role,
    /// A name for logs and the router's listing.
    pub name: String,
    /// The served model's name.
    pub model: String,
    /// The routers to register with: one `host:port`, or several separated by commas; a name
    /// resolving to several addresses is one router per address (see [`crate::cluster::routers`]). None: serve
    /// unregistered (e.g. in tests).
    pub router: Option<String>,
    /// The address peers should use (default: the gRPC listener's address).
    pub advertise: Option<String>,
    /// The host peers should use with the bound ports (e.g. a pod's IP); see [`crate::cluster::advertise`].
    pub advertise_host: Option<String>,
    pub transport: TransportChoice,
    /// How long a decode worker waits for an admitted request's KV.
    pub kv_timeout: Duration,
    /// Longest one step of a KV transfer may make no progress, on either side (a chunk not
    /// taken or not arriving, an acknowledgement not coming) before the transfer is failed.
    pub kv_stall_timeout: Duration,
    /// On shutdown, how long to wait for in-flight requests (and, on a prefill worker, for the
    /// acknowledgement of every KV sent) before exiting anyway.
    pub drain_timeout: Duration,
    /// The cluster secret: this worker's services require it of every caller (the router, the
    /// prefill workers), its KV data port of every sender, and it carries it in every call it
    /// makes (registration, KV pushes). Open: no check (in-process tests).
    pub cluster_secret: ferry_proto::ClusterSecret,
    /// TLS: `server` on the gRPC listener (mutual TLS with a client CA), `client` to the router
    /// and to decode workers. With either, the plaintext TCP data path is off: a decode worker
    /// serves no data listener and prefill workers send KV over gRPC, inside TLS.
    pub tls: ferry_proto::tls::Tls,
    /// Device-to-device KV pipes (NCCL on a GPU worker); None: host transports only.
    pub pipes: Option<Pipes>,
    /// Open connections and header timeout of the gRPC server ([`ferry_proto::conn`]).
    pub connections: ferry_proto::conn::ConnLimits,
}

impl WorkerConfig {
    /// A worker of `role` named `name` with the defaults `ferry prefill`/`ferry decode` use:
    /// unregistered (no router), plaintext, TCP data path, 120 s KV timeout, 30 s stall timeout,
    /// 60 s drain, no NCCL.
    pub fn new(role: Role, name: impl Into<String>) -> WorkerConfig {
        WorkerConfig {
            role,
            name: name.into(),
            model: "default".into(),
            router: None,
            advertise: None,
            advertise_host: None,
            transport: TransportChoice::Tcp,
            kv_timeout: Duration::from_secs(120),
            kv_stall_timeout: crate::kv::chunks::DEFAULT_STALL,
            drain_timeout: Duration::from_secs(60),
            cluster_secret: Default::default(),
            tls: Default::default(),
            pipes: None,
            connections: ferry_proto::conn::ConnLimits::worker(),
        }
    }
}

/// The KV transports a worker registers with. Its `transport` is its ceiling: gRPC always; TCP
/// unless the ceiling is gRPC, and only where the plaintext data path exists (a prefill worker
/// without TLS; a decode worker serving a data listener); NCCL with device pipes. Colocated
/// workers move no KV.
pub(crate) fn kv_transports(cfg: &WorkerConfig, data_listener: bool) -> Vec<i32> {
    use ferry_proto::v1::KvTransport as K;
    if cfg.role == Role::Colocated {
        return Vec::new();
    }
    let mut v = vec![K::Grpc];
    let tcp_path = match cfg.role {
        Role::Prefill => !cfg.tls.enabled(),
        _ => data_listener,
    };
    if tcp_path && cfg.transport != TransportChoice::Grpc {
        v.push(K::Tcp);
    }
    // A device pipe is registered under the transport its connector provides, when this
    // worker's ceiling is that transport.
    if let Some(pipes) = &cfg.pipes {
        let kind = pipes.0.transport();
        if cfg.transport.pipe() == Some(kind) {
            v.push(kind);
        }
    }
    v.into_iter().map(|k| k as i32).collect()
}

#[cfg(test)]
mod transport_tests {
    use super::*;
    use ferry_proto::v1::KvTransport as K;

    #[test]
    fn a_worker_registers_the_transports_under_its_ceiling() {
        let pipes = Some(Pipes(crate::kv::in_process::InProcessConnector::new()));
        let cfg = |role, transport, pipes: &Option<Pipes>| WorkerConfig { transport, pipes: pipes.clone(), ..WorkerConfig::new(role, "w") };
        let cases = [
            (cfg(Role::Prefill, TransportChoice::Tcp, &None), true, vec![K::Grpc, K::Tcp]),
            (cfg(Role::Prefill, TransportChoice::Grpc, &None), true, vec![K::Grpc]),
            (cfg(Role::Prefill, TransportChoice::Nccl, &pipes), true, vec![K::Grpc, K::Tcp, K::Nccl]),
            // NCCL asked for but not available (a CPU worker): the host transports.
            (cfg(Role::Prefill, TransportChoice::Nccl, &None), true, vec![K::Grpc, K::Tcp]),
            (cfg(Role::Decode, TransportChoice::Tcp, &None), true, vec![K::Grpc, K::Tcp]),
            (cfg(Role::Decode, TransportChoice::Tcp, &None), false, vec![K::Grpc]),
            (cfg(Role::Decode, TransportChoice::Grpc, &pipes), true, vec![K::Grpc]),
            (cfg(Role::Colocated, TransportChoice::Tcp, &None), true, vec![]),
        ];
        for (c, data, want) in cases {
            let want: Vec<i32> = want.into_iter().map(|k| k as i32).collect();
            assert_eq!(kv_transports(&c, data), want, "{:?} {:?}", c.role, c.transport);
        }
    }
}
