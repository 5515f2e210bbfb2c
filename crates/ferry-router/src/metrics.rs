//! Router metrics: recorded with the `metrics` facade into one process-wide Prometheus recorder
//! (installed once; a second router in the same process shares it), served as text on
//! `GET /metrics` by a small axum server on its own listener, with the `/livez` and `/readyz`
//! probes beside it. Every family is in [`names`], the catalogue, described when the recorder is
//! installed.

pub mod names;

use std::sync::OnceLock;
use std::time::Duration;

use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use ferry_proto::conn::Component;
use ferry_proto::v1;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::sync::watch;
use tonic::Code;

use crate::RouterError;
use crate::workers::registry::Registry;

/// The process's Prometheus handle, installing the recorder on first use. If another recorder is
/// already installed globally, that one records (and is told the router's help texts); ours
/// still renders, with nothing in it. Routers started at once (tests run them on parallel
/// threads) wait on one install: installing outside the `OnceLock` let a loser of the race keep
/// the empty handle while the winner's recorder held the metrics.
pub fn handle() -> Result<PrometheusHandle, RouterError> {
    static HANDLE: OnceLock<Result<PrometheusHandle, String>> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let h = ferry_proto::metrics::install(&[names::ALL, Component::Router.families()]).map_err(|e| e.to_string())?;
            publish_fault_counters();
            Ok(h)
        })
        .clone()
        .map_err(RouterError::Metrics)
}

/// `GET /metrics`'s answer: the text, with the one content type every component's `/metrics`
/// uses.
pub fn render(h: &PrometheusHandle) -> impl IntoResponse + use<> {
    ([(header::CONTENT_TYPE, ferry_proto::metrics::CONTENT_TYPE)], h.render())
}

/// The counters of what can go wrong, each label at 0 from the start, and the admission queue's
/// depth: a scrape tells "none happened" (0) from "not exported" (absent), so a reader (a
/// dashboard's panel, an alert's rate) sees a zero rather than no data.
fn publish_fault_counters() {
    metrics::counter!(names::RETRIES).increment(0);
    metrics::counter!(names::MIGRATIONS).increment(0);
    for cause in ["lease_expired", "call_failed"] {
        metrics::counter!(names::WORKERS_MARKED_DEAD, "cause" => cause).increment(0);
    }
    for outcome in ["ok", "cancelled", "invalid", "exhausted", "unavailable", "error"] {
        metrics::counter!(names::REQUESTS, "outcome" => outcome).increment(0);
    }
    for reason in ["full", "timeout"] {
        metrics::counter!(names::QUEUE_REJECTED, "reason" => reason).increment(0);
    }
    for api in AUTH_APIS {
        metrics::counter!(names::AUTH_FAILURES, "api" => api).increment(0);
    }
    for tier in PREFIX_TIERS {
        metrics::counter!(names::PREFIX_ROUTED, "tier" => tier).increment(0);
    }
    metrics::gauge!(names::QUEUE_DEPTH).set(0.0);
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
        .route("/metrics", get(move || std::future::ready(render(&h))))
        .route("/livez", get(|| std::future::ready("live\n")))
        .route(
            "/readyz",
            get(move || std::future::ready(readiness(*grpc_serving.borrow()))),
        );
    let acceptor = ferry_proto::conn::Acceptor::new(listener, ferry_proto::conn::Server::RouterMetrics, limits);
    ferry_proto::conn::serve_http(acceptor, app, shutdown).await;
    Ok(())
}

/// `ferry_router_requests_total{outcome}`.
pub fn request_outcome(outcome: &'static str) {
    metrics::counter!(names::REQUESTS, "outcome" => outcome).increment(1);
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

/// What one finished choice tells: its latencies, tokens, and the KV transfer of its last
/// attempt (when KV moved).
pub struct Finished<'a> {
    pub ttft: Duration,
    /// Seconds per output token after the first (0 for fewer than two tokens).
    pub tpot_s: f64,
    pub e2e: Duration,
    /// Its end-to-end time not spent waiting on workers.
    pub overhead: Duration,
    pub generated: usize,
    pub kv: &'a v1::KvTransferStats,
}

/// Records one finished choice.
pub fn observe_finished(f: &Finished<'_>) {
    metrics::histogram!(names::TIME_TO_FIRST_TOKEN).record(f.ttft.as_secs_f64());
    if f.generated >= 2 {
        metrics::histogram!(names::TIME_PER_OUTPUT_TOKEN).record(f.tpot_s);
    }
    metrics::histogram!(names::E2E_REQUEST_LATENCY).record(f.e2e.as_secs_f64());
    metrics::histogram!(names::REQUEST_GENERATION_TOKENS).record(f.generated as f64);
    if f.kv.bytes > 0 {
        metrics::histogram!(names::KV_TRANSFER_BYTES).record(f.kv.bytes as f64);
        metrics::histogram!(names::KV_TRANSFER_SECONDS).record(f.kv.duration_ms / 1e3);
    }
    metrics::histogram!(names::OVERHEAD).record(f.overhead.as_secs_f64());
}

/// Records a finished request's prompt (once per request, however many choices share it):
/// `prompt` tokens, `cached` of them served from a prefix cache.
pub fn observe_prompt(prompt: usize, cached: u64) {
    let (prompt, cached) = (prompt as u64, cached.min(prompt as u64));
    metrics::counter!(names::PROMPT_TOKENS, "served" => "cache").increment(cached);
    metrics::counter!(names::PROMPT_TOKENS, "served" => "computed").increment(prompt - cached);
    metrics::histogram!(names::REQUEST_PROMPT_TOKENS).record(prompt as f64);
    metrics::histogram!(names::REQUEST_CACHED_PROMPT_TOKENS).record(cached as f64);
}

/// `n` tokens sent to a client at once, `gap` after its previous ones (None for its first): the
/// gap counts as `n` inter-token latencies of `gap / n`.
pub fn tokens_sent(n: usize, gap: Option<Duration>) {
    metrics::counter!(names::GENERATION_TOKENS).increment(n as u64);
    if let Some(gap) = gap
        && n > 0
    {
        metrics::histogram!(names::INTER_TOKEN_LATENCY).record_many(gap.as_secs_f64() / n as f64, n);
    }
}

/// A request's time in the admission queue before a decode worker first admitted it.
pub fn observe_queue_time(waited: Duration) {
    metrics::histogram!(names::REQUEST_QUEUE_TIME).record(waited.as_secs_f64());
}

/// Per transfer: the transport the router chose for the pair and the one the prefill worker
/// used (they differ when it fell back), and the bytes moved by each.
pub fn observe_kv_transport(chosen: v1::KvTransport, kv: Option<&v1::KvTransferStats>) {
    let Some(kv) = kv else { return };
    let used = v1::KvTransport::try_from(kv.transport).unwrap_or(v1::KvTransport::Unspecified).to_string();
    metrics::counter!(names::KV_TRANSFERS, "chosen" => chosen.to_string(), "used" => used.clone()).increment(1);
    metrics::counter!(names::KV_BYTES, "transport" => used).increment(kv.bytes);
}

/// `ferry_router_prefix_routed_total`'s `tier` labels, each published at 0.
const PREFIX_TIERS: [&str; 3] = ["pool", "disk", "none"];

/// A prefill worker was picked; `tier`: the tier holding most of the prompt's cached prefix
/// there (None: nothing held).
pub fn prefix_routed(tier: Option<ferry_core::KvTier>) {
    let label = match tier {
        Some(t) => t.as_str(),
        None => "none",
    };
    metrics::counter!(names::PREFIX_ROUTED, "tier" => label).increment(1);
}

/// The SLO finished requests are held to (the first router of the process sets it).
static SLO: OnceLock<ferry_core::slo::Slo> = OnceLock::new();

/// Publishes the SLO the routers hold requests to (`ferry_router_slo_*_seconds`, for dashboards to
/// draw beside the percentiles) and the goodput counter at 0. Routers sharing one process share
/// the first one's SLO.
pub fn publish_slo(slo: ferry_core::slo::Slo) {
    let slo = *SLO.get_or_init(|| slo);
    metrics::gauge!(names::SLO_TIME_TO_FIRST_TOKEN).set(slo.ttft_ms / 1e3);
    metrics::gauge!(names::SLO_TIME_PER_OUTPUT_TOKEN).set(slo.tpot_ms / 1e3);
    metrics::counter!(names::GOODPUT_REQUESTS).increment(0);
}

/// `ferry_router_goodput_requests_total`: one request that finished with every choice within both
/// latency targets. `choices`: each choice's (TTFT, TPOT in seconds; 0 for a one-token answer).
pub fn observe_goodput(choices: impl IntoIterator<Item = (Duration, f64)>) {
    let slo = SLO.get().copied().unwrap_or(ferry_core::slo::Slo::DEFAULT);
    if choices.into_iter().all(|(ttft, tpot_s)| ttft.as_secs_f64() * 1e3 <= slo.ttft_ms && tpot_s * 1e3 <= slo.tpot_ms) {
        metrics::counter!(names::GOODPUT_REQUESTS).increment(1);
    }
}

/// `ferry_router_inflight_requests`, up while the guard lives.
pub struct InflightGauge(());

impl InflightGauge {
    pub fn new() -> InflightGauge {
        metrics::gauge!(names::INFLIGHT_REQUESTS).increment(1.0);
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
        metrics::gauge!(names::INFLIGHT_REQUESTS).decrement(1.0);
    }
}

/// `ferry_router_workers{role,state}` from the registry.
pub fn set_worker_gauges(registry: &Registry) {
    for (role, state, n) in registry.counts() {
        metrics::gauge!(names::WORKERS, "role" => role.as_str(), "state" => state.as_str())
            .set(n as f64);
    }
    // Per worker, what routing decided on: a run can be explained afterwards. (A removed
    // worker's series keep their last value; filter on `ferry_router_workers` states.)
    for w in registry.list() {
        let role = crate::wire::role_from_wire(w.role).map_or("unspecified", |r| r.as_str());
        let load = w.load.unwrap_or_default();
        let labels = [("worker", w.worker_id.clone()), ("role", role.to_string())];
        metrics::gauge!(names::WORKER_INFLIGHT_REQUESTS, &labels).set(w.inflight as f64);
        match crate::wire::role_from_wire(w.role) {
            Some(ferry_core::WorkerRole::Prefill) => {
                // As routing counts it (`PrefillCandidate::queued_tokens`).
                let queued = w.outstanding_prefill_tokens.max(load.queued_prefill_tokens);
                metrics::gauge!(names::WORKER_OUTSTANDING_PREFILL_TOKENS, &labels)
                    .set(w.outstanding_prefill_tokens as f64);
                metrics::gauge!(names::WORKER_QUEUED_PREFILL_TOKENS, &labels)
                    .set(queued as f64);
                metrics::gauge!(names::WORKER_PREFILL_TOKENS_PER_SECOND, &labels)
                    .set(load.prefill_tokens_per_s);
                if load.prefill_tokens_per_s > 0.0 {
                    metrics::gauge!(names::WORKER_ESTIMATED_QUEUE, &labels)
                        .set(queued as f64 / load.prefill_tokens_per_s);
                }
            }
            Some(ferry_core::WorkerRole::Decode | ferry_core::WorkerRole::Colocated) | None => {
                metrics::gauge!(names::WORKER_KV_BLOCKS_FREE, &labels)
                    .set(load.kv_blocks_free as f64);
                metrics::gauge!(names::WORKER_KV_BLOCKS_CAPACITY, &labels)
                    .set(load.kv_blocks_total as f64);
                metrics::gauge!(names::WORKER_PROMISED_KV_BLOCKS, &labels)
                    .set(w.promised_kv_blocks as f64);
            }
        }
    }
}

/// The `api` labels of `ferry_router_auth_failures_total`: the client gRPC API, the HTTP API,
/// the Admin API, and the cluster-secret guard of the Registry.
const AUTH_APIS: [&str; 4] = ["grpc", "http", "admin", "cluster"];

/// `ferry_router_auth_failures_total{api}`: requests refused for a missing or wrong API key
/// (`api`: one of [`AUTH_APIS`]).
pub fn auth_failure(api: &'static str) {
    debug_assert!(AUTH_APIS.contains(&api), "an auth failure label not in AUTH_APIS: {api}");
    metrics::counter!(names::AUTH_FAILURES, "api" => api).increment(1);
}
