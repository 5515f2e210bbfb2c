//! Prometheus `/metrics` for a worker process, on its own HTTP listener, with the `/livez` and
//! `/readyz` probes beside it. Every family is in [`names`], the catalogue, described when the
//! recorder is installed.

pub mod names;

use super::health::Health;
use axum::http::{StatusCode, header};
use axum::routing::get;
use ferry_proto::conn::{Component, Server};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use std::sync::OnceLock;

/// The process's recorder, installed on first use. If another recorder is already installed
/// (several components in one test process), that one records (and is told the worker's help
/// texts); this returns a handle that renders its own, empty registry.
pub fn handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| match ferry_proto::metrics::install(&[names::ALL, Component::Worker.families()]) {
            Ok(h) => {
                publish_fault_counters();
                h
            }
            Err(e) => {
                // Only invalid buckets fail, and the catalogue's are checked by the tests.
                tracing::error!("the metrics recorder: {e}; /metrics stays empty");
                PrometheusBuilder::new().build_recorder().handle()
            }
        })
        .clone()
}

/// What can go wrong on a worker, at 0 from the start, so a dashboard or an alert reads a zero
/// rather than no data (and an absent family means "not exported").
fn publish_fault_counters() {
    for port in AUTH_PORTS {
        metrics::counter!(names::AUTH_FAILURES, "port" => port).increment(0);
    }
    metrics::counter!(names::STEP_ISOLATIONS).increment(0);
    metrics::counter!(names::SEQUENCE_FAILURES).increment(0);
    metrics::gauge!(names::ENGINE_FAILED).set(0.0);
}

/// The `port` labels of `ferry_worker_auth_failures_total`.
const AUTH_PORTS: [&str; 2] = ["grpc", "kv_data"];

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
                std::future::ready(([(header::CONTENT_TYPE, ferry_proto::metrics::CONTENT_TYPE)], h.render()))
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
    let acceptor = ferry_proto::conn::Acceptor::new(listener, Server::WorkerMetrics, limits);
    ferry_proto::conn::serve_http(acceptor, app, std::future::pending()).await;
}

/// `ferry_worker_auth_failures_total{port}`: callers refused for a missing or wrong cluster
/// secret, on the gRPC services (`grpc`) or the KV data port (`kv_data`).
pub fn auth_failure(port: &'static str) {
    metrics::counter!(names::AUTH_FAILURES, "port" => port).increment(1);
}

/// A gRPC caller refused by the cluster guard (see [`ferry_proto::ClusterSecret::guard`]).
pub fn cluster_refused(_: ferry_proto::cluster::Refusal) {
    auth_failure("grpc");
}
