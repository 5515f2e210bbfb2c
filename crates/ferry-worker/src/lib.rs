//! Ferry's workers. A prefill worker runs prompts and streams their KV, layer by layer, to a
//! decode worker, which generates with continuous batching; each is one engine thread behind
//! gRPC services, registered with the router by heartbeat.
//!
//! - [`prefill`], [`decode`]: the engine loops and their services;
//! - [`kv`]: the transfer between them (assembler, receiver, transports: gRPC and TCP);
//! - [`registration`]: register and heartbeat, with every router of [`routers`]; [`drain`]:
//!   graceful shutdown; [`metrics`]: `/metrics`; [`health`]: `/livez` and `/readyz`;
//!   [`advertise`]: the addresses told to the router and peers; [`cache_log`]: the prefix
//!   cache's events, carried by the heartbeats to every router's index;
//! - [`fault`]: a broken engine takes the worker out; [`isolate`]: a step that fails for one
//!   sequence fails that sequence only.

pub mod advertise;
pub mod batcher;
pub mod cache_log;
pub mod decode;
pub mod drain;
pub mod error;
pub mod fault;
pub mod health;
pub mod isolate;
pub mod kv;
pub mod load;
pub mod logprobs;
pub mod metrics;
pub mod pick;
pub mod prefill;
pub mod registration;
pub mod routers;

pub use error::{Result, WorkerError};

use ferry_engine::Engine;
use ferry_proto::v1::{decode_server::DecodeServer, kv_transfer_server::KvTransferServer, prefill_server::PrefillServer};
use ferry_proto::v1::{RegisterRequest, WorkerRole};
use kv::receiver::{KvReceiver, KvTransferService};
use tonic::service::interceptor::InterceptedService;
use kv::transport::{Channels, GrpcTransport, TcpTransport, H2_WINDOW, MAX_MESSAGE_BYTES};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Prefill,
    Decode,
    /// Prefill and decode in one loop (the colocated baseline).
    Colocated,
}

impl Role {
    pub fn wire(self) -> WorkerRole {
        match self {
            Role::Prefill => WorkerRole::Prefill,
            Role::Decode => WorkerRole::Decode,
            Role::Colocated => WorkerRole::Colocated,
        }
    }

    /// The role's name in logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Colocated => "colocated",
        }
    }
}

/// Which transport a prefill worker uses for KV when the router leaves the choice to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportChoice {
    /// The framed TCP data path (the default: several times gRPC's throughput).
    Tcp,
    /// KV chunks as gRPC messages.
    Grpc,
    /// Device to device over NCCL (GPU workers; falls back to TCP or gRPC when a pair cannot
    /// set it up).
    Nccl,
    /// Device to device through CUDA IPC (GPU workers on one node; falls back likewise).
    CudaIpc,
}

impl TransportChoice {
    /// The wire transport of this choice.
    pub fn kind(self) -> ferry_proto::v1::KvTransport {
        use ferry_proto::v1::KvTransport as K;
        match self {
            TransportChoice::Tcp => K::Tcp,
            TransportChoice::Grpc => K::Grpc,
            TransportChoice::Nccl => K::Nccl,
            TransportChoice::CudaIpc => K::CudaIpc,
        }
    }

    /// The device pipe this choice asks for, if any.
    pub fn pipe(self) -> Option<ferry_proto::v1::KvTransport> {
        match self {
            TransportChoice::Nccl | TransportChoice::CudaIpc => Some(self.kind()),
            TransportChoice::Tcp | TransportChoice::Grpc => None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct WorkerConfig {
    pub role: Role,
    /// A name for logs and the router's listing.
    pub name: String,
    /// The served model's name.
    pub model: String,
    /// The routers to register with: one `host:port`, or several separated by commas; a name
    /// resolving to several addresses is one router per address (see [`routers`]). None: serve
    /// unregistered (e.g. in tests).
    pub router: Option<String>,
    /// The address peers should use (default: the gRPC listener's address).
    pub advertise: Option<String>,
    /// The host peers should use with the bound ports (e.g. a pod's IP); see [`advertise`].
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
    pub pipes: Option<kv::pipe::Pipes>,
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
            kv_stall_timeout: kv::DEFAULT_STALL,
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
fn kv_transports(cfg: &WorkerConfig, data_listener: bool) -> Vec<i32> {
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
        let pipes = Some(kv::pipe::Pipes(kv::pipe::InProcessConnector::new()));
        let cfg = |role, transport, pipes: &Option<kv::pipe::Pipes>| WorkerConfig { transport, pipes: pipes.clone(), ..WorkerConfig::new(role, "w") };
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

/// The sockets a worker serves on, bound by the caller (tests bind port 0).
pub struct Listeners {
    pub grpc: TcpListener,
    /// Decode workers: the TCP data path for KV (None: gRPC only).
    pub data: Option<TcpListener>,
    /// `/metrics`, `/livez`, `/readyz` (None: not served here, e.g. the caller already serves
    /// them with its own [`health::Health`] so that probes answer while the model loads).
    pub metrics: Option<TcpListener>,
    /// The caller's probes, when it serves them itself: they follow this worker's drain.
    pub health: Option<health::Health>,
}

/// A worker's engine thread, started before its services.
pub enum EngineHandle {
    Prefill(prefill::PrefillHandle),
    Decode(decode::DecodeHandle),
}

/// How a worker's engine thread runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineOptions {
    /// Chunked prefill's per-step budget for a colocated worker (None: prefill first). Prefill
    /// workers chunk long prompts at the engine's `max_batch_tokens`.
    pub chunk_tokens: Option<usize>,
    /// Prefill workers: most prompts waiting to start (`--queue-max`).
    pub queue_max: usize,
    /// Failures injected on purpose (tests; see [`fault::FaultInjection`]).
    pub faults: fault::FaultInjection,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { chunk_tokens: None, queue_max: prefill::DEFAULT_QUEUE_MAX, faults: fault::FaultInjection::default() }
    }
}

impl EngineHandle {
    /// `chunk_tokens`: chunked prefill's per-step budget for a colocated worker (None: prefill
    /// first). Fault injection follows this process's environment ([`fault::FaultInjection::from_env`]).
    pub fn start(role: Role, engine: Engine, model: &str, chunk_tokens: Option<usize>) -> Self {
        Self::start_with(role, engine, model, EngineOptions { chunk_tokens, faults: fault::FaultInjection::from_env(), ..Default::default() })
    }

    pub fn start_with(role: Role, engine: Engine, model: &str, opts: EngineOptions) -> Self {
        let model = model.to_string();
        let EngineOptions { chunk_tokens, queue_max, faults } = opts;
        let prefix_cache = engine.prefix_cache_enabled();
        let handle = match role {
            Role::Prefill => EngineHandle::Prefill(prefill::spawn_with(engine, model, prefill::PrefillOptions { queue_max, faults })),
            Role::Decode => EngineHandle::Decode(decode::spawn_with(engine, model, batcher::Scheduling::default(), faults)),
            Role::Colocated => {
                EngineHandle::Decode(decode::spawn_with(engine, model, batcher::Scheduling { accept_prompts: true, chunk_tokens }, faults))
            }
        };
        // Known before the first registration (the engine thread also sets it at every publish).
        handle.load().prefix_cache.store(prefix_cache, std::sync::atomic::Ordering::Relaxed);
        handle
    }

    /// Set once the engine thread has failed.
    pub fn fault(&self) -> Arc<fault::EngineFault> {
        match self {
            EngineHandle::Prefill(h) => h.fault.clone(),
            EngineHandle::Decode(h) => h.fault.clone(),
        }
    }

    /// The live load gauge (KV blocks, sequences, queue), as the heartbeat reports it.
    pub fn load(&self) -> Arc<load::LoadGauge> {
        match self {
            EngineHandle::Prefill(h) => h.load.clone(),
            EngineHandle::Decode(h) => h.load.clone(),
        }
    }
}

/// Run a worker until `shutdown` resolves, then drain: refuse new requests, tell the routers,
/// wait for the in-flight ones (at most `drain_timeout`), deregister, exit. `ready` turns true
/// once registered with a router (immediately when there is no router), false while no lease is
/// current (heartbeats unanswered for a lease, or the routers forgot us), and true again once
/// re-registered.
///
/// If the engine fails meanwhile ([`fault`]), the worker takes itself out: not ready, its held
/// requests already failed (tagged `engine`), it deregisters from every router, lets those
/// failures reach their callers (a few seconds at most) and returns
/// [`WorkerError::EngineFailed`].
pub async fn serve(
    cfg: WorkerConfig,
    engine: EngineHandle,
    listeners: Listeners,
    shutdown: impl Future<Output = ()> + Send,
    ready: watch::Sender<bool>,
) -> Result<()> {
    let _ = metrics::handle();
    let drain = drain::Drain::new(cfg.name.clone());
    let fault = engine.fault();
    let grpc_addr = listeners.grpc.local_addr().map_err(|e| WorkerError::Internal(e.to_string()))?;
    // Never KV in cleartext when TLS is configured: the data listener is dropped unused.
    let data_listener = if cfg.tls.enabled() {
        if listeners.data.is_some() {
            tracing::info!("TLS is on: the plaintext TCP data path is off, KV travels over gRPC (TLS)");
        }
        None
    } else {
        listeners.data
    };
    let data_bound = match &data_listener {
        Some(l) => Some(l.local_addr().map_err(|e| WorkerError::Internal(e.to_string()))?),
        None => None,
    };
    let opts = advertise::AdvertiseOptions { addr: cfg.advertise.clone(), host: cfg.advertise_host.clone() };
    let advertise::Advertised { grpc: advertise, data: data_addr } = advertise::advertised(grpc_addr, data_bound, &opts);
    if let Some(h) = &listeners.health {
        h.follow_drain(drain.subscribe());
        h.follow_fault(fault.clone());
    }
    if let Some(m) = listeners.metrics {
        let health = health::Health::new(cfg.router.clone(), ready.subscribe());
        health.engine_started(health::EngineView { load: engine.load(), role: cfg.role });
        health.follow_drain(drain.subscribe());
        health.follow_fault(fault.clone());
        tokio::spawn(metrics::serve(m, health));
    }
    let mut server = tonic::transport::Server::builder()
        .initial_stream_window_size(H2_WINDOW)
        .initial_connection_window_size(H2_WINDOW)
        .tcp_nodelay(true)
        // Pings find dead peers (the connection limit holds their slots until then).
        .http2_keepalive_interval(Some(ferry_proto::conn::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(ferry_proto::conn::KEEPALIVE_TIMEOUT));
    if let Some(tls) = &cfg.tls.server {
        server = server.tls_config(tls.config()).map_err(|e| WorkerError::Internal(format!("TLS: {}", ferry_proto::tls::error_chain(&e))))?;
    }
    let reflection = |services| ferry_proto::reflection::services(services).map_err(|e| WorkerError::Internal(format!("gRPC reflection: {e}")));
    let client_tls = cfg.tls.client.clone();
    // Every service here serves only the cluster's members (the router, prefill workers).
    let guard = cfg.cluster_secret.guard(metrics::cluster_refused);
    let (load, facts, router) = match engine {
        EngineHandle::Prefill(handle) => {
            let (load, facts) = (handle.load.clone(), handle.facts.clone());
            let svc = prefill::PrefillService {
                engine: handle,
                tcp: Arc::new(TcpTransport::new(cfg.cluster_secret.clone())),
                grpc: Arc::new(GrpcTransport::new(Channels::new(client_tls.clone(), cfg.cluster_secret.clone()))),
                pipe: cfg.pipes.as_ref().map(|p| {
                    Arc::new(kv::pipe::PipeTransport::new(
                        p.0.clone(),
                        Channels::new(client_tls.clone(), cfg.cluster_secret.clone()),
                        cfg.name.clone(),
                        facts.fingerprint.clone(),
                    ))
                        as Arc<dyn kv::transport::KvTransport>
                }),
                prefer: cfg.transport,
                allow_tcp: !cfg.tls.enabled(),
                stall: cfg.kv_stall_timeout,
                name: cfg.name.clone(),
                drain: drain.clone(),
            };
            let svc = PrefillServer::new(svc).max_decoding_message_size(MAX_MESSAGE_BYTES).max_encoding_message_size(MAX_MESSAGE_BYTES);
            let (reflection, reflection_alpha) = reflection(ferry_proto::reflection::PREFILL)?;
            let router = server.add_service(reflection).add_service(reflection_alpha).add_service(InterceptedService::new(svc, guard.clone()));
            (load, facts, router)
        }
        EngineHandle::Decode(handle) => {
            let (load, facts) = (handle.load.clone(), handle.facts.clone());
            let receiver = KvReceiver::new(facts.fingerprint.clone(), facts.layout);
            if let Some(l) = data_listener {
                tokio::spawn(kv::receiver::serve_tcp(receiver.clone(), l, cfg.kv_stall_timeout, cfg.cluster_secret.clone()));
            }
            let svc = decode::DecodeService {
                engine: handle,
                receiver: receiver.clone(),
                data_addr: data_addr.clone(),
                kv_timeout: cfg.kv_timeout,
                name: cfg.name.clone(),
                drain: drain.clone(),
            };
            let decode = DecodeServer::new(svc).max_decoding_message_size(MAX_MESSAGE_BYTES).max_encoding_message_size(MAX_MESSAGE_BYTES);
            let kv = KvTransferServer::new(KvTransferService::new(receiver, cfg.pipes.as_ref().map(|p| p.0.clone()), cfg.kv_stall_timeout))
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES);
            let (reflection, reflection_alpha) = reflection(ferry_proto::reflection::DECODE)?;
            let router = server
                .add_service(reflection)
                .add_service(reflection_alpha)
                .add_service(InterceptedService::new(decode, guard.clone()))
                .add_service(InterceptedService::new(kv, guard.clone()));
            (load, facts, router)
        }
    };
    let entries = cfg.router.as_deref().map(routers::entries).unwrap_or_default();
    let router_set = if entries.is_empty() {
        ready.send_replace(true);
        None
    } else {
        let kv_transports = kv_transports(&cfg, !data_addr.is_empty());
        let req = RegisterRequest {
            role: cfg.role.wire() as i32,
            name: cfg.name.clone(),
            grpc_addr: advertise.clone(),
            data_addr,
            model: facts.model.clone(),
            fingerprint: facts.fingerprint.clone(),
            max_context: facts.max_context as u32,
            load: None,
            draining: false,
            kv_transports,
            prefix_cache: load.prefix_cache.load(std::sync::atomic::Ordering::Relaxed),
        };
        let link = registration::RouterLink { router: String::new(), tls: client_tls.clone(), cluster: cfg.cluster_secret.clone() };
        Some(routers::RouterSet::spawn(entries, link, req, load, ready, drain.subscribe(), routers::RouterSetConfig::default()))
    };
    tracing::info!(role = ?cfg.role, name = %cfg.name, addr = %advertise, "worker serving");
    let timeout = cfg.drain_timeout;
    let watch_fault = fault.clone();
    let shutdown = async move {
        let failed = tokio::select! {
            _ = shutdown => None,
            what = watch_fault.wait() => Some(what),
        };
        ::metrics::gauge!("ferry_worker_draining").set(1.0);
        match failed {
            None => {
                tracing::info!(inflight = drain.inflight(), timeout_s = timeout.as_secs_f64(), "draining: refusing new requests, waiting for in-flight ones");
                match drain.drain(timeout).await {
                    drain::DrainOutcome::Idle => tracing::info!("drained: every request finished"),
                    drain::DrainOutcome::TimedOut { left } => {
                        tracing::warn!(left, "drain timed out after {} s: exiting with requests in flight", timeout.as_secs_f64())
                    }
                }
                if let Some(r) = router_set {
                    r.deregister_all().await;
                }
            }
            Some(what) => {
                ::metrics::gauge!("ferry_worker_engine_failed").set(1.0);
                tracing::error!("the engine failed ({what}): deregistering from every router and exiting");
                if let Some(r) = router_set {
                    r.deregister_all().await;
                }
                // The held requests have their failure: let those statuses reach the callers.
                let _ = drain.drain(timeout.min(FAILED_FLUSH)).await;
            }
        }
    };
    // The acceptor caps open connections, closes those that send no HTTP/2 preface in time, and
    // turns Nagle off (small stream messages must not wait for delayed ACKs).
    let incoming = ferry_proto::conn::Acceptor::new(listeners.grpc, "worker_grpc", cfg.connections).http2();
    let result = router
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(|e| WorkerError::Internal(format!("gRPC server: {e}")));
    if let Some(what) = fault.get() {
        return Err(WorkerError::EngineFailed(what));
    }
    result
}

/// How long a worker whose engine failed waits for the failures of the requests it held to reach
/// their callers before it exits.
const FAILED_FLUSH: Duration = Duration::from_secs(5);
