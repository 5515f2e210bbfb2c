//! Router metrics: recorded with the `metrics` facade into one process-wide Prometheus recorder
//! (installed once; a second router in the same process shares it), served as text on
//! `GET /metrics` by a small axum server on its own listener, with the `/livez` and `/readyz`
//! probes beside it.

use std::sync::OnceLock;
use std::time::Duration;

use axum::http::StatusCode;
use axum::routing::get;
use ferry_proto::v1;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio::sync::watch;
use tonic::Code;

use crate::RouterError;
use crate::workers::registry::Registry;

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

const LATENCY_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

/// The process's Prometheus handle, installing the recorder on first use. If another recorder is
/// already installed globally, ours still renders (but records nothing).
pub fn handle() -> Result<PrometheusHandle, RouterError> {
    if let Some(h) = HANDLE.get() {
        return Ok(h.clone());
    }
    let recorder = PrometheusBuilder::new()
        .set_buckets(LATENCY_BUCKETS)
        .map_err(|e| RouterError::Metrics(e.to_string()))?
        .build_recorder();
    let h = recorder.handle();
    let h = HANDLE.get_or_init(|| {
        if metrics::set_global_recorder(recorder).is_err() {
            tracing::warn!(
                "a metrics recorder was already installed; /metrics shows only what it renders"
            );
        }
        publish_fault_counters();
        h
    });
    Ok(h.clone())
}

/// The counters of faults the router handled, published at 0 from the start: a scrape tells "none
/// happened" (0) from "not exported" (absent), so a reader can refuse an absent counter.
fn publish_fault_counters() {
    metrics::counter!("ferry_router_retries_total").increment(0);
    metrics::counter!("ferry_router_migrations_total").increment(0);
    for cause in ["lease_expired", "call_failed"] {
        metrics::counter!("ferry_router_workers_marked_dead_total", "cause" => cause).increment(0);
    }
}

/// What the router's `/readyz` says: 200 while its gRPC server serves, whatever the number of
/// workers (workers reach the router through whatever routes to a ready router, so gating it on
/// workers would keep both sides waiting on each other).
pub fn readiness(grpc_serving: bool) -> (StatusCode, &'static str) {
    if grpc_serving {
        (StatusCode::OK, "ready\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "the gRPC server is not serving\n")
    }
}

/// Serves `GET /metrics`, `GET /livez` (200 whenever this answers) and `GET /readyz` (see
/// [`readiness`]; `grpc_serving` says whether the gRPC server runs) on `listener`, within
/// `limits`, until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    limits: ferry_proto::conn::ConnLimits,
    grpc_serving: watch::Receiver<bool>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), RouterError> {
    let h = handle()?;
    let app = axum::Router::new()
        .route("/metrics", get(move || std::future::ready(h.render())))
        .route("/livez", get(|| std::future::ready("live\n")))
        .route(
            "/readyz",
            get(move || std::future::ready(readiness(*grpc_serving.borrow()))),
        );
    let acceptor = ferry_proto::conn::Acceptor::new(listener, "router_metrics", limits);
    ferry_proto::conn::serve_http(acceptor, app, shutdown).await;
    Ok(())
}

/// `ferry_router_requests_total{outcome}`.
pub fn request_outcome(outcome: &'static str) {
    metrics::counter!("ferry_router_requests_total", "outcome" => outcome).increment(1);
}

/// The outcome label for a failed request's status.
pub fn outcome_of(code: Code) -> &'static str {
    match code {
        Code::InvalidArgument | Code::NotFound | Code::OutOfRange => "invalid",
        Code::ResourceExhausted => "exhausted",
        Code::Unavailable => "unavailable",
        Code::Cancelled | Code::DeadlineExceeded => "cancelled",
        Code::Ok
        | Code::Unknown
        | Code::AlreadyExists
        | Code::PermissionDenied
        | Code::FailedPrecondition
        | Code::Aborted
        | Code::Unimplemented
        | Code::Internal
        | Code::DataLoss
        | Code::Unauthenticated => "error",
    }
}

/// Latencies and KV transfer figures of one finished request.
pub fn observe_request(
    ttft: Duration,
    tpot_s: f64,
    e2e: Duration,
    kv: &v1::KvTransferStats,
    overhead: Duration,
) {
    metrics::histogram!("ferry_router_ttft_seconds").record(ttft.as_secs_f64());
    if tpot_s > 0.0 {
        metrics::histogram!("ferry_router_tpot_seconds").record(tpot_s);
    }
    metrics::histogram!("ferry_router_e2e_seconds").record(e2e.as_secs_f64());
    metrics::histogram!("ferry_router_kv_transfer_bytes").record(kv.bytes as f64);
    metrics::histogram!("ferry_router_kv_transfer_seconds").record(kv.duration_ms / 1e3);
    metrics::histogram!("ferry_router_overhead_seconds").record(overhead.as_secs_f64());
}

/// Per transfer: the transport the router chose for the pair and the one the prefill worker
/// used (they differ when it fell back), and the bytes moved by each.
pub fn observe_kv_transport(chosen: v1::KvTransport, kv: Option<&v1::KvTransferStats>) {
    let Some(kv) = kv else { return };
    let used = v1::KvTransport::try_from(kv.transport).unwrap_or(v1::KvTransport::Unspecified).to_string();
    metrics::counter!("ferry_router_kv_transfers_total", "chosen" => chosen.to_string(), "used" => used.clone()).increment(1);
    metrics::counter!("ferry_router_kv_bytes_total", "transport" => used).increment(kv.bytes);
}

/// The SLO finished requests are held to (the first router of the process sets it).
static SLO: OnceLock<ferry_core::slo::Slo> = OnceLock::new();

/// Publishes the SLO the routers hold requests to (`ferry_router_slo_*_seconds`, for dashboards to
/// draw beside the percentiles) and the goodput counter at 0. Routers sharing one process share
/// the first one's SLO.
pub fn publish_slo(slo: ferry_core::slo::Slo) {
    let slo = *SLO.get_or_init(|| slo);
    metrics::gauge!("ferry_router_slo_time_to_first_token_seconds").set(slo.ttft_ms / 1e3);
    metrics::gauge!("ferry_router_slo_time_per_output_token_seconds").set(slo.tpot_ms / 1e3);
    metrics::counter!("ferry_router_goodput_requests_total").increment(0);
}

/// `ferry_router_goodput_requests_total`: one request that finished with every choice within both
/// latency targets. `choices`: each choice's (TTFT, TPOT in seconds; 0 for a one-token answer).
pub fn observe_goodput(choices: impl IntoIterator<Item = (Duration, f64)>) {
    let slo = SLO.get().copied().unwrap_or(ferry_core::slo::Slo::DEFAULT);
    if choices.into_iter().all(|(ttft, tpot_s)| ttft.as_secs_f64() * 1e3 <= slo.ttft_ms && tpot_s * 1e3 <= slo.tpot_ms) {
        metrics::counter!("ferry_router_goodput_requests_total").increment(1);
    }
}

/// `ferry_router_inflight`, up while the guard lives.
pub struct InflightGauge(());

impl InflightGauge {
    pub fn new() -> InflightGauge {
        metrics::gauge!("ferry_router_inflight").increment(1.0);
        InflightGauge(())
    }
}

impl Default for InflightGauge {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for InflightGauge {
    fn drop(&mut self) {
        metrics::gauge!("ferry_router_inflight").decrement(1.0);
    }
}

/// `ferry_router_workers{role,state}` from the registry.
pub fn set_worker_gauges(registry: &Registry) {
    for (role, state, n) in registry.counts() {
        metrics::gauge!("ferry_router_workers", "role" => role.as_str(), "state" => state.as_str())
            .set(n as f64);
    }
    // Per worker, what routing decided on: a run can be explained afterwards. (A removed
    // worker's series keep their last value; filter on `ferry_router_workers` states.)
    for w in registry.list() {
        let role = crate::wire::role_from_wire(w.role).map_or("unspecified", |r| r.as_str());
        let load = w.load.unwrap_or_default();
        let labels = [("worker", w.worker_id.clone()), ("role", role.to_string())];
        metrics::gauge!("ferry_router_worker_inflight", &labels).set(w.inflight as f64);
        match crate::wire::role_from_wire(w.role) {
            Some(ferry_core::WorkerRole::Prefill) => {
                let queued = w.outstanding_prefill_tokens + load.queued_prefill_tokens;
                metrics::gauge!("ferry_router_worker_outstanding_prefill_tokens", &labels)
                    .set(w.outstanding_prefill_tokens as f64);
                metrics::gauge!("ferry_router_worker_queued_prefill_tokens", &labels)
                    .set(queued as f64);
                metrics::gauge!("ferry_router_worker_prefill_tokens_per_second", &labels)
                    .set(load.prefill_tokens_per_s);
                if load.prefill_tokens_per_s > 0.0 {
                    metrics::gauge!("ferry_router_worker_estimated_queue_seconds", &labels)
                        .set(queued as f64 / load.prefill_tokens_per_s);
                }
            }
            Some(ferry_core::WorkerRole::Decode | ferry_core::WorkerRole::Colocated) | None => {
                metrics::gauge!("ferry_router_worker_kv_blocks_free", &labels)
                    .set(load.kv_blocks_free as f64);
                metrics::gauge!("ferry_router_worker_kv_blocks_total", &labels)
                    .set(load.kv_blocks_total as f64);
                metrics::gauge!("ferry_router_worker_promised_kv_blocks", &labels)
                    .set(w.promised_kv_blocks as f64);
            }
        }
    }
}

/// `ferry_router_auth_failures_total{api}`: requests refused for a missing or wrong API key.
pub fn auth_failure(api: &'static str) {
    metrics::counter!("ferry_router_auth_failures_total", "api" => api).increment(1);
}
