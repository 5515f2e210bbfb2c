//! Ferry's router: the client APIs (`Ferry` over gRPC, OpenAI-compatible HTTP), the worker
//! registry with leases and health, the pairing of a prefill and a decode worker per request and
//! the request's orchestration, the operators' admin API, and Prometheus metrics. It tokenizes
//! with the model's tokenizer ([`ferry_tokenizer::ModelText`]) but never loads weights or links
//! the engine.
//!
//! - [`registry`]: workers, leases, in-flight accounting.
//! - [`service`] / [`orchestrate`]: validation, then one request's lifecycle (`worker.proto`).
//! - [`openai`]: the OpenAI-compatible HTTP API over the same path.
//! - [`auth`]: API keys for the client APIs.
//! - [`admin`]: the `Registry` and `Admin` services.
//! - [`metrics`]: the Prometheus recorder and `/metrics` server.
//!
//! Mock workers for its tests and `ferry bench router` are in `ferry-testkit`, not here.

pub mod admin;
pub mod auth;
pub mod autoscale;
mod error;
pub mod grpc_tools;
pub mod metrics;
pub mod openai;
pub mod orchestrate;
pub mod prompt;
pub mod queue;
pub mod registry;
pub mod scale;
pub mod service;
pub mod tools;
pub mod transport;
pub mod wire;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_proto::tls::Tls;
use ferry_proto::v1;

pub use auth::{AdminToken, ApiKeys};
pub use error::{RouterError, http_status_of};
pub use scale::{KubeScale, Scaler};

use crate::registry::{DialOptions, MAX_MESSAGE_BYTES, Registry, WINDOW_BYTES};

/// How the router runs.
#[derive(Clone, Debug)]
pub struct RouterConfig {
    /// The model (GGUF file or HF folder) whose tokenizer and chat template the router uses.
    pub model_path: PathBuf,
    /// A worker whose last heartbeat is older than this is dead.
    pub lease: Duration,
    /// How often workers are told to heartbeat.
    pub heartbeat: Duration,
    /// Times a request starts again on other workers after a failure before any output.
    pub max_retries: u32,
    /// Times a request that has streamed tokens moves to other workers (its prompt and the
    /// tokens so far prefilled again) when its decode worker dies or freezes.
    pub max_migrations: u32,
    /// Requests that may wait in the admission queue for room on a decode worker; beyond it
    /// they are refused (RESOURCE_EXHAUSTED / HTTP 429 with `Retry-After`).
    pub queue_max: usize,
    /// How long a request waits in the admission queue before it is refused the same way.
    pub queue_timeout: Duration,
    /// Deadline of a decode admission (the worker answers `admitted` at once or not at all).
    pub admit_timeout: Duration,
    /// Deadline of one prefill call (the prompt's computation and its KV transfer).
    pub prefill_timeout: Duration,
    /// Longest silence of a decode stream between two messages before the worker is taken as
    /// frozen and the request moves.
    pub token_timeout: Duration,
    /// Connect timeout for worker channels.
    pub connect_timeout: Duration,
    /// How long a decode worker waits for the KV after admission (zero: the worker's default).
    pub kv_timeout: Duration,
    /// Where `Admin.Scale` goes (None: scaling is refused with a clear error).
    pub scaler: Option<Scaler>,
    /// Keys the client APIs (gRPC `Ferry`, HTTP `/v1/*`) require; empty: open.
    pub api_keys: ApiKeys,
    /// The token `Admin` requires (unset: the cluster secret).
    pub admin_token: AdminToken,
    /// The cluster secret: `Registry` requires it, and every call to a worker or to the scaler
    /// carries it (open: none; the `ferry` commands never run open unless told to).
    pub cluster_secret: ferry_proto::ClusterSecret,
    /// The names clients may ask for the model by (`model` in requests); the first is the one
    /// reported. Empty: the model path's own name ([`ferry_tokenizer::served_name`]: the file
    /// stem without its quantisation, or the HF folder's name).
    pub served_model_names: Vec<String>,
    /// TLS: `server` on the gRPC listener (mutual TLS when it has a client CA), `client` when
    /// dialing workers and `ferry up`'s scaler. Default: plaintext both ways.
    pub tls: Tls,
    /// The fastest KV transport the router asks a pair to use (see [`transport`]).
    pub kv_transport: transport::KvPolicy,
    /// Whether routing weighs the prompt prefixes workers hold (from their cache events), or
    /// load alone.
    pub prefix_routing: PrefixRouting,
    /// A decode worker that holds a prompt's prefix computes the rest itself (no prefill worker,
    /// no KV moved) when at most this many tokens are left; 0: never.
    pub local_prefill_max: usize,
    /// The format tool calls are parsed in (and forced calls written in) on the HTTP API; `None`:
    /// the one the model's chat template teaches ([`tools::format::Format::detect`]).
    pub tool_call_parser: Option<tools::format::Format>,
    /// Scale the pools from the SLOs (`--autoscale`; needs `scaler`). None: only by hand.
    pub autoscale: Option<autoscale::AutoscaleConfig>,
    /// Open connections and header timeout of the gRPC and the HTTP API, each; `/metrics` gets
    /// [`ferry_proto::conn::DEFAULT_METRICS_MAX_CONNECTIONS`] with the same timeout.
    pub connections: ferry_proto::conn::ConnLimits,
}

/// How the router uses what it knows of the workers' prefix caches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PrefixRouting {
    /// Prefill: the expected finish time with each worker's cached prefix taken off the work;
    /// decode: a worker holding the prefix first while it has room (`ferry_core::cache_policy`).
    #[default]
    KvAware,
    /// Load alone (the workers still use their caches for what happens to land on them).
    LoadOnly,
}

/// The default `local_prefill_max`, measured (docs/benchmarks.md, "Prefix caching"): on a
/// multi-turn chat workload, computing a turn's short suffix on the decode worker that holds the
/// conversation halved TTFT against a round trip through a prefill worker (which must recompute
/// the previous answer), for a longer decode step there; 128 covers a chat turn's new message.
pub const DEFAULT_LOCAL_PREFILL_MAX: usize = 128;

impl RouterConfig {
    pub fn new(model_path: impl Into<PathBuf>) -> RouterConfig {
        RouterConfig {
            model_path: model_path.into(),
            lease: Duration::from_secs(3),
            heartbeat: Duration::from_secs(1),
            max_retries: 3,
            max_migrations: 3,
            queue_max: 256,
            queue_timeout: Duration::from_secs(30),
            admit_timeout: Duration::from_secs(10),
            prefill_timeout: Duration::from_secs(120),
            token_timeout: Duration::from_secs(30),
            connect_timeout: Duration::from_secs(1),
            kv_timeout: Duration::ZERO,
            scaler: None,
            api_keys: ApiKeys::default(),
            admin_token: AdminToken::default(),
            cluster_secret: Default::default(),
            served_model_names: Vec::new(),
            tls: Tls::default(),
            kv_transport: transport::KvPolicy::Auto,
            prefix_routing: PrefixRouting::KvAware,
            local_prefill_max: DEFAULT_LOCAL_PREFILL_MAX,
            tool_call_parser: None,
            autoscale: None,
            connections: ferry_proto::conn::ConnLimits::api(),
        }
    }
}

/// The router's listeners, bound by the caller (tests bind port 0 and pass them in).
#[derive(Debug)]
pub struct Listeners {
    /// gRPC: the client API (`Ferry`), `Registry`, `Admin` and reflection.
    pub grpc: tokio::net::TcpListener,
    /// The OpenAI-compatible HTTP API.
    pub http: Option<tokio::net::TcpListener>,
    /// Prometheus `GET /metrics`.
    pub metrics: Option<tokio::net::TcpListener>,
}

impl Listeners {
    /// gRPC only.
    pub fn grpc(grpc: tokio::net::TcpListener) -> Listeners {
        Listeners {
            grpc,
            http: None,
            metrics: None,
        }
    }
}

/// Serves the router's gRPC API (Ferry, Registry, Admin, reflection), and the HTTP API and
/// `/metrics`, `/livez`, `/readyz` on their listeners when given, until `shutdown` completes.
pub async fn serve(
    cfg: RouterConfig,
    listeners: Listeners,
    shutdown: impl Future<Output = ()>,
) -> Result<(), RouterError> {
    let Listeners {
        grpc,
        http,
        metrics,
    } = listeners;
    scale::check(cfg.scaler.as_ref())?;
    let path = cfg.model_path.clone();
    let mut text = tokio::task::spawn_blocking(move || ferry_tokenizer::ModelText::open(&path))
        .await
        .map_err(|e| RouterError::Io {
            what: "opening the model's tokenizer",
            source: std::io::Error::other(e),
        })?
        .map_err(|source| RouterError::LoadModel {
            path: cfg.model_path.clone(),
            source,
        })?;
    if let Some(name) = cfg.served_model_names.first() {
        text.name = name.clone();
    }
    let dial = DialOptions {
        connect_timeout: cfg.connect_timeout,
        tls: cfg.tls.client.clone(),
        cluster: cfg.cluster_secret.clone(),
    };
    let registry = Arc::new(Registry::new(cfg.lease, cfg.heartbeat, dial.clone()));
    let grammars = ferry_grammar::LazyGrammars::new(Arc::new(text.tokenizer.clone()), None);
    let shared = Arc::new(service::Shared {
        queue: queue::AdmissionQueue::new(cfg.queue_max, cfg.queue_timeout, registry.room.clone()),
        registry: registry.clone(),
        text,
        grammars,
        cfg: cfg.clone(),
        window: Default::default(),
    });
    crate::metrics::handle()?;

    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (serving_tx, serving_rx) = tokio::sync::watch::channel(false);
    let sweeper = tokio::spawn(sweep(
        registry.clone(),
        (cfg.lease / 4).max(Duration::from_millis(10)),
    ));
    let autoscaler = match &cfg.autoscale {
        Some(_) if cfg.scaler.is_none() => return Err(RouterError::NoScaler),
        Some(a) => Some(tokio::spawn(autoscale::run(shared.clone(), a.clone(), dial.clone()))),
        None => None,
    };
    let metrics_task = metrics.map(|l| {
        let mut rx = stop_rx.clone();
        let limits = ferry_proto::conn::ConnLimits::metrics(cfg.connections);
        tokio::spawn(crate::metrics::serve(l, limits, serving_rx.clone(), async move {
            let _ = rx.wait_for(|s| *s).await;
        }))
    });

    let http_task = http.map(|l| {
        let mut rx = stop_rx.clone();
        tokio::spawn(crate::openai::serve(
            l,
            shared.clone(),
            cfg.api_keys.clone(),
            async move {
                let _ = rx.wait_for(|s| *s).await;
            },
        ))
    });

    let (reflection, reflection_alpha) = ferry_proto::reflection::services(ferry_proto::reflection::ROUTER)?;
    let ferry = v1::ferry_server::FerryServer::new(service::FerryService { shared })
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    // API keys guard the client API only; workers and operators use Registry and Admin.
    let ferry = tonic::service::interceptor::InterceptedService::new(ferry, cfg.api_keys.clone());
    // The cluster secret guards worker registration; the admin token the operators' API.
    let reg = v1::registry_server::RegistryServer::with_interceptor(
        admin::RegistryService {
            registry: registry.clone(),
        },
        cfg.cluster_secret.guard(auth::cluster_refused),
    );
    let adm = v1::admin_server::AdminServer::with_interceptor(
        admin::AdminService {
            registry,
            scaler: cfg.scaler.clone(),
            dial,
        },
        cfg.admin_token.guard(&cfg.cluster_secret),
    );
    // Ready from here: the listener is bound (connections wait in its backlog) and the server
    // below accepts as soon as it is polled.
    let mut server = tonic::transport::Server::builder()
        .initial_stream_window_size(Some(WINDOW_BYTES))
        .initial_connection_window_size(Some(WINDOW_BYTES))
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(registry::KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(registry::KEEPALIVE_TIMEOUT));
    if let Some(tls) = &cfg.tls.server {
        server = server.tls_config(tls.config())?;
    }
    serving_tx.send_replace(true);
    let result = server
        .add_service(reflection)
        .add_service(reflection_alpha)
        .add_service(ferry)
        .add_service(reg)
        .add_service(adm)
        .serve_with_incoming_shutdown(ferry_proto::conn::Acceptor::new(grpc, "router_grpc", cfg.connections).http2(), shutdown)
        .await;
    serving_tx.send_replace(false);
    sweeper.abort();
    if let Some(t) = autoscaler {
        t.abort();
    }
    let _ = stop_tx.send(true);
    if let Some(t) = metrics_task {
        let _ = t.await;
    }
    if let Some(t) = http_task {
        // An HTTP listener that failed is reported after the gRPC server's own result.
        result?;
        return t.await.map_err(|e| RouterError::Io {
            what: "the HTTP API task",
            source: std::io::Error::other(e),
        })?;
    }
    Ok(result?)
}

/// Marks expired leases dead every `every`, and refreshes the worker gauges.
async fn sweep(registry: Arc<Registry>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        registry.sweep(Instant::now());
        crate::metrics::set_worker_gauges(&registry);
    }
}
