//! Every component's `/metrics` is clean Prometheus (issue 37): the router's, and a prefill, a
//! decode and a colocated worker's, each after serving requests, pass `promtool check metrics`'s
//! rules as `ferry_testkit::promlint` checks them, and `promtool` itself where it is installed
//! (`FERRY_REQUIRE_PROMTOOL=1`, set by CI, makes a missing promtool a failure). The catalogues
//! follow the same naming rules, and docs/operations.md lists every family.
//!
//! `FERRY_METRICS_DUMP=DIR` writes each component's text to DIR (`router.prom`, …), for
//! checking by hand with `promtool check metrics < DIR/router.prom`.

mod cluster_support;

use cluster_support::*;
use ferry_proto::conn::Component;
use ferry_proto::metrics::CONTENT_TYPE;
use ferry_testkit::promlint::{self, Promtool};
use std::time::{Duration, Instant};

fn promtool_required() -> bool {
    std::env::var("FERRY_REQUIRE_PROMTOOL").is_ok_and(|v| v == "1")
}

/// Lints one component's `/metrics` text with the Rust rules, and with promtool when installed.
fn check(what: &str, text: &str, prefix: &str) {
    let problems = promlint::lint_text(text, prefix);
    assert!(problems.is_empty(), "{what}'s /metrics: {} problems:\n{}\n\n{text}", problems.len(), problems.iter().map(|p| format!("  {p}\n")).collect::<String>());
    match promlint::promtool(text) {
        Promtool::Clean(said) => assert!(said.trim().is_empty(), "{what}: promtool passed but said: {said}"),
        Promtool::Problems(said) => panic!("{what}'s /metrics: promtool check metrics: {said}\n\n{text}"),
        Promtool::Missing => {
            assert!(!promtool_required(), "FERRY_REQUIRE_PROMTOOL=1 but promtool is not on PATH (Debian: apt-get install prometheus)");
            eprintln!("{what}: promtool is not on PATH; checked with the Rust rules only");
        }
    }
    if let Some(dir) = std::env::var_os("FERRY_METRICS_DUMP") {
        let path = std::path::Path::new(&dir).join(format!("{what}.prom"));
        std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&path, text)).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    }
}

/// `GET /metrics` at `addr`: (content type, body).
async fn scrape(addr: &str) -> (String, String) {
    let response = http_get(addr, "/metrics").await.unwrap_or_else(|e| panic!("GET {addr}/metrics: {e}"));
    let (head, body) = response.split_once("\r\n\r\n").unwrap_or_else(|| panic!("not an HTTP response: {response}"));
    assert!(head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"), "GET {addr}/metrics: {head}");
    let content_type = head.lines().find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("content-type")).map(|(_, v)| v.trim().to_string()));
    (content_type.unwrap_or_default(), body.to_string())
}

/// The `_count` of a histogram (summed over label sets), 0 when absent.
fn observations(text: &str, histogram: &str) -> f64 {
    metric_sum(text, &format!("{histogram}_count")).unwrap_or(0.0)
}

/// A worker's `/metrics` once `ready(text)` holds (what a worker records after answering may
/// land a moment after the client has its answer), within a few seconds.
async fn worker_metrics(w: &WorkerProc, ready: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (content_type, text) = scrape(&w.metrics).await;
        assert_eq!(content_type, CONTENT_TYPE, "{} worker {}'s /metrics", w.role, w.name);
        if ready(&text) || Instant::now() > deadline {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Two requests sharing a prompt (the second one's prefix is cached), of several tokens each.
async fn serve(cluster: &Cluster) {
    let prompt: Vec<u32> = (0..40).map(|i| 100 + i * 7).collect();
    for _ in 0..2 {
        let out = run(&mut cluster.client().await, token_request(&prompt, 6)).await.expect("a request");
        assert_eq!(out.ids.len(), 6);
    }
}

/// The router's `/metrics` on both its ports, with the one content type; the text of its metrics
/// port.
async fn router_metrics(cluster: &Cluster) -> String {
    let (metrics_type, text) = scrape(&cluster.router_metrics).await;
    let (http_type, _) = scrape(&cluster.http).await;
    assert_eq!((metrics_type.as_str(), http_type.as_str()), (CONTENT_TYPE, CONTENT_TYPE), "the router's /metrics content types (metrics port, HTTP port)");
    text
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_component_s_metrics_pass_promtool_after_serving() {
    let model = smollm2();

    // Disaggregated: the router sees the whole request, KV moves from prefill to decode.
    let cluster = Cluster::up(&model, 1, 1, &[]);
    serve(&cluster).await;
    let router = router_metrics(&cluster).await;
    check("router", &router, "ferry_router_");
    for h in [
        "ferry_router_request_queue_time_seconds",
        "ferry_router_time_to_first_token_seconds",
        "ferry_router_inter_token_latency_seconds",
        "ferry_router_request_time_per_output_token_seconds",
        "ferry_router_e2e_request_latency_seconds",
        "ferry_router_request_prompt_tokens",
        "ferry_router_request_generation_tokens",
        "ferry_router_request_cached_prompt_tokens",
        "ferry_router_kv_transfer_seconds",
        "ferry_router_kv_transfer_bytes",
    ] {
        assert!(observations(&router, h) >= 1.0, "{h} observed nothing after two requests:\n{router}");
    }
    assert_eq!(metric_sum(&router, "ferry_router_generation_tokens_total"), Some(12.0), "two requests of 6 tokens");
    assert_eq!(metric_sum(&router, "ferry_router_prompt_tokens_total"), Some(80.0), "two prompts of 40 tokens");
    assert_eq!(metric_sum(&router, "ferry_router_migrations_total"), Some(0.0), "published at 0");
    // 6 tokens: at most 5 gaps per request (fewer when tokens arrive together).
    let gaps = observations(&router, "ferry_router_inter_token_latency_seconds");
    assert!((2.0..=10.0).contains(&gaps), "{gaps} inter-token latencies for two requests of 6 tokens");
    for w in cluster.live_workers() {
        // The second request may be prefilled by the decode worker from its prefix cache.
        let served = if w.role == "prefill" { 1.0 } else { 2.0 };
        let text = worker_metrics(&w, |t| metric_sum(t, "ferry_worker_requests_total").unwrap_or(0.0) >= served).await;
        check(&w.role, &text, "ferry_worker_");
        match w.role.as_str() {
            "prefill" => {
                assert!(metric_sum(&text, "ferry_worker_prompt_tokens_total").unwrap_or(0.0) > 0.0, "prefill computed no prompt token:\n{text}");
                assert!(observations(&text, "ferry_worker_kv_transfer_seconds") >= 1.0, "{text}");
            }
            _ => assert!(metric_sum(&text, "ferry_worker_generation_tokens_total").unwrap_or(0.0) >= 10.0, "decode generated no token:\n{text}"),
        }
    }
    drop(cluster);

    // Colocated: one worker prefills and decodes; no KV moves.
    let cluster = Cluster::up(&model, 0, 0, &["--colocated", "1"]);
    serve(&cluster).await;
    let router = router_metrics(&cluster).await;
    check("router-colocated", &router, "ferry_router_");
    assert_eq!(observations(&router, "ferry_router_kv_transfer_bytes"), 0.0, "no KV moved");
    for w in cluster.live_workers() {
        let text = worker_metrics(&w, |t| metric_sum(t, "ferry_worker_requests_total").unwrap_or(0.0) >= 2.0).await;
        check(&w.role, &text, "ferry_worker_");
        assert!(metric_sum(&text, "ferry_worker_prompt_tokens_total").unwrap_or(0.0) > 0.0, "{text}");
        assert!(metric_sum(&text, "ferry_worker_generation_tokens_total").unwrap_or(0.0) >= 12.0, "{text}");
    }
}

#[test]
fn the_catalogues_follow_prometheus_naming_and_the_docs_list_every_family() {
    let docs = std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/operations.md")).expect("docs/operations.md");
    for (prefix, catalogue) in [
        ("ferry_router_", [ferry_router::metrics::names::ALL, Component::Router.families()].concat()),
        ("ferry_worker_", [ferry_worker::cluster::metrics::names::ALL, Component::Worker.families()].concat()),
    ] {
        let problems = promlint::lint_catalogue(&catalogue, prefix);
        assert!(problems.is_empty(), "{prefix}: {problems:#?}");
        let undocumented: Vec<&str> = catalogue.iter().map(|f| f.name).filter(|n| !docs.contains(&format!("`{n}`"))).collect();
        assert!(undocumented.is_empty(), "families missing from docs/operations.md's metrics tables: {undocumented:?}");
    }
}
