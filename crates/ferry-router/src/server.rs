//! The router's process: the registry, the shared state and every listener wired together
//! ([`serve`]), and the lease sweeper.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ferry_proto::v1;

use crate::RouterError;
use crate::api::grpc::FerryService;
use crate::config::RouterConfig;
use crate::ops::{admin, autoscale, scale};
use crate::pipeline::queue::AdmissionQueue;
use crate::state::Shared;
use crate::workers::dial::{DialOptions, KEEPALIVE_INTERVAL, KEEPALIVE_TIMEOUT, MAX_MESSAGE_BYTES, WINDOW_BYTES};
use crate::workers::registry::Registry;

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
    let shared = Arc::new(Shared {
        queue: AdmissionQueue::new(cfg.queue_max, cfg.queue_timeout, registry.room.clone()),
        registry: registry.clone(),
        text,
        grammars,
        cfg: cfg.clone(),
        window: Default::default(),
    });
    crate::metrics::handle()?;
    crate::metrics::publish_slo(cfg.slo);

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
        tokio::spawn(crate::api::openai::serve(
            l,
            shared.clone(),
            cfg.api_keys.clone(),
            async move {
                let _ = rx.wait_for(|s| *s).await;
            },
        ))
    });

    let (reflection, reflection_alpha) = ferry_proto::reflection::services(ferry_proto::reflection::ROUTER)?;
    let ferry = v1::ferry_server::FerryServer::new(FerryService { shared })
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    // API keys guard the client API only; workers and operators use Registry and Admin.
    let ferry = tonic::service::interceptor::InterceptedService::new(ferry, cfg.api_keys.clone());
    // The cluster secret guards worker registration; the admin token the operators' API.
    let reg = v1::registry_server::RegistryServer::with_interceptor(
        admin::RegistryService {
            registry: registry.clone(),
        },
        cfg.cluster_secret.guard(crate::auth::cluster_refused),
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
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT));
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
        .serve_with_incoming_shutdown(ferry_proto::conn::Acceptor::new(grpc, ferry_proto::conn::Server::RouterGrpc, cfg.connections).http2(), shutdown)
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
