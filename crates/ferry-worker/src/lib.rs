//! Ferry's workers. A prefill worker runs prompts and streams their KV, layer by layer, to a
//! decode worker, which generates with continuous batching; each is one engine thread behind
//! gRPC services, registered with the router by heartbeat.
//!
//! The tree follows a request:
//! - [`prefill`]: the prefill engine thread, its gRPC service, and the choice of KV transport;
//! - [`kv`]: the transfer between them: [`kv::send`] (the prefill side's transports),
//!   [`kv::receive`] (the decode side's state machine and links), and the frame format both use;
//! - [`decode`]: the continuous-batching engine thread (KV import, forking for n > 1, the step,
//!   finishing) and the `Decode` gRPC service;
//! - [`cluster`]: registration and heartbeats with every router, the addresses advertised,
//!   graceful drain, `/metrics`, `/livez` and `/readyz`;
//! - shared by both sides: [`role`], [`config`], [`engine_handle`], [`facts`] (what requests are
//!   checked against), [`pick`] and [`logprobs`] (choosing tokens), [`load`] and [`cache_log`]
//!   (what the heartbeats report), [`fault`] (a broken engine takes the worker out), [`isolate`]
//!   (a step that fails for one sequence fails that sequence only), [`error`].
//!
//! This file is the front: declarations, re-exports, and [`serve`].

pub mod cache_log;
pub mod cluster;
pub mod config;
pub mod decode;
pub mod engine_handle;
pub mod error;
pub mod facts;
pub mod fault;
pub mod isolate;
pub mod kv;
pub mod load;
pub mod logprobs;
pub mod pick;
pub mod prefill;
pub mod role;

pub use config::WorkerConfig;
pub use decode::SpecConfig;
pub use engine_handle::{EngineHandle, EngineOptions};
pub use error::{Result, WorkerError};
pub use role::{Role, TransportChoice};

use cluster::{advertise, drain, health, metrics, registration, routers};
use config::kv_transports;
use ferry_proto::v1::{decode_server::DecodeServer, kv_transfer_server::KvTransferServer, prefill_server::PrefillServer};
use ferry_proto::v1::RegisterRequest;
use kv::receive::{KvReceiver, KvTransferService};
use kv::send::{Channels, GrpcTransport, TcpTransport, H2_WINDOW, MAX_MESSAGE_BYTES};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::service::interceptor::InterceptedService;

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
                    Arc::new(kv::send::PipeTransport::new(
                        p.0.clone(),
                        Channels::new(client_tls.clone(), cfg.cluster_secret.clone()),
                        cfg.name.clone(),
                        facts.fingerprint.clone(),
                    ))
                        as Arc<dyn kv::send::KvTransport>
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
                tokio::spawn(kv::receive::serve_tcp(receiver.clone(), l, cfg.kv_stall_timeout, cfg.cluster_secret.clone()));
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
            kv_dtype: facts.layout.dtype.layout_name().to_string(),
            kv_bytes_per_token: facts.layout.bytes_per_token() as u64,
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
        ::metrics::gauge!(cluster::metrics::names::DRAINING).set(1.0);
        match failed {
            None => {
                // Tell the routers and take what they dispatched before they heard; refuse after.
                drain.announce();
                if let Some(r) = &router_set {
                    if !r.drain_heard(DRAIN_HEARD_WITHIN).await {
                        tracing::warn!("draining: not every router acknowledged the drain within {} s", DRAIN_HEARD_WITHIN.as_secs_f64());
                    }
                    tokio::time::sleep(DISPATCH_GRACE).await;
                }
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
                ::metrics::gauge!(cluster::metrics::names::ENGINE_FAILED).set(1.0);
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
    let incoming = ferry_proto::conn::Acceptor::new(listeners.grpc, ferry_proto::conn::Server::WorkerGrpc, cfg.connections).http2();
    let result = router
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .map_err(|e| WorkerError::Internal(format!("gRPC server: {e}")));
    if let Some(what) = fault.get() {
        return Err(WorkerError::EngineFailed(what));
    }
    result
}

/// How long a draining worker waits for its routers to acknowledge the drain before it refuses
/// new requests (a router it cannot reach is not waited for longer).
const DRAIN_HEARD_WITHIN: Duration = Duration::from_secs(3);

/// After the routers have acknowledged the drain, how long the worker still takes requests: those
/// a router dispatched just before it heard may still be on their way.
const DISPATCH_GRACE: Duration = Duration::from_millis(250);

/// How long a worker whose engine failed waits for the failures of the requests it held to reach
/// their callers before it exits.
const FAILED_FLUSH: Duration = Duration::from_secs(5);
