//! Prometheus `/metrics` for a worker process, on its own HTTP listener, with the `/livez` and
//! `/readyz` probes beside it.

use super::health::Health;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

/// Latency buckets (seconds) shared by every histogram measured in time.
pub const SECONDS_BUCKETS: &[f64] =
    &[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0];

/// The process's recorder, installed on first use. If another recorder is already installed
/// (several components in one test process), this returns a handle that renders its own, empty
/// registry rather than failing.
pub fn handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let builder = || {
                PrometheusBuilder::new()
                    .set_buckets(SECONDS_BUCKETS)
                    .and_then(|b| b.set_buckets_for_metric(Matcher::Suffix("_batch".into()), &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0]))
                    .and_then(|b| b.set_buckets_for_metric(Matcher::Suffix("_bytes".into()), &[1e4, 1e5, 1e6, 1e7, 1e8, 1e9]))
                    .expect("valid buckets")
            };
            builder().install_recorder().unwrap_or_else(|_| builder().build_recorder().handle())
        })
        .clone()
}

/// Serve `GET /metrics`, `GET /livez` and `GET /readyz`, within the default `/metrics`
/// connection limits ([`ferry_proto::conn::ConnLimits::metrics`]).
///
/// `/livez` is 200 whenever this answers. `/readyz` is 200 `ready` when [`Health::readiness`]
/// holds, else 503 with the reason on one line. The load gauges are refreshed from the engine's
/// atomics on every scrape, so an idle engine thread (blocked waiting for work or for KV to come
/// back) does not leave stale values, and the oldest queued prompt's age keeps growing.
pub async fn serve(listener: tokio::net::TcpListener, health: Health) {
    let h = handle();
    let scrape = health.clone();
    let ready = health;
    let app = axum::Router::new()
        .route(
            "/metrics",
            get(move || {
                if let Some(e) = scrape.engine() {
                    e.load.export(e.role.as_str());
                }
                std::future::ready(h.render())
            }),
        )
        .route("/livez", get(|| std::future::ready("live\n")))
        .route(
            "/readyz",
            get(move || {
                std::future::ready(match ready.readiness() {
                    Ok(()) => (StatusCode::OK, "ready\n".to_string()),
                    Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
                })
            }),
        );
    let limits = ferry_proto::conn::ConnLimits::metrics(ferry_proto::conn::ConnLimits::worker());
    let acceptor = ferry_proto::conn::Acceptor::new(listener, "worker_metrics", limits);
    ferry_proto::conn::serve_http(acceptor, app, std::future::pending()).await;
}

/// `ferry_worker_auth_failures_total{port}`: callers refused for a missing or wrong cluster
/// secret, on the gRPC services (`grpc`) or the KV data port (`kv_data`).
pub fn auth_failure(port: &'static str) {
    metrics::counter!("ferry_worker_auth_failures_total", "port" => port).increment(1);
}

/// A gRPC caller refused by the cluster guard (see [`ferry_proto::ClusterSecret::guard`]).
pub fn cluster_refused(_: ferry_proto::cluster::Refusal) {
    auth_failure("grpc");
}
