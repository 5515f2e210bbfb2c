//! OpenTelemetry tracing across the hop (issue 37, part 3): a `ferry up` cluster (one prefill and
//! one decode worker) exports its spans over OTLP/HTTP to a receiver this test runs itself. One
//! request over HTTP and one over gRPC, each with the client's `traceparent`: each request's spans
//! share the client's trace id, come from three processes (router, prefill, decode), and form one
//! tree whose root is the router's `request` span, a child of the client's span.

mod cluster_support;

use cluster_support::*;
use ferry_proto::v1::ferry_client::FerryClient;
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One span as received, with the resource it came from.
#[derive(Clone, Debug)]
struct Got {
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
    service: String,
    instance: String,
    start_ns: u64,
    end_ns: u64,
}

type Spans = Arc<Mutex<Vec<Got>>>;

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn string_attr(attrs: &[opentelemetry_proto::tonic::common::v1::KeyValue], key: &str) -> String {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref()?.value.as_ref())
        .map(|v| match v {
            Value::StringValue(s) => s.clone(),
            other => format!("{other:?}"),
        })
        .unwrap_or_default()
}

/// An OTLP/HTTP (protobuf) receiver on a free loopback port: every span it is sent lands in `spans`.
async fn receiver() -> (String, Spans) {
    let spans: Spans = Arc::default();
    let into = spans.clone();
    let app = axum::Router::new().route(
        "/v1/traces",
        axum::routing::post(move |body: axum::body::Bytes| {
            let into = into.clone();
            async move {
                let req = ExportTraceServiceRequest::decode(body).expect("an ExportTraceServiceRequest");
                let mut got = into.lock().unwrap();
                for rs in req.resource_spans {
                    let attrs = rs.resource.map(|r| r.attributes).unwrap_or_default();
                    let (service, instance) = (string_attr(&attrs, "service.name"), string_attr(&attrs, "service.instance.id"));
                    for s in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                        got.push(Got {
                            name: s.name,
                            trace_id: hex(&s.trace_id),
                            span_id: hex(&s.span_id),
                            parent: hex(&s.parent_span_id),
                            service: service.clone(),
                            instance: instance.clone(),
                            start_ns: s.start_time_unix_nano,
                            end_ns: s.end_time_unix_nano,
                        });
                    }
                }
                ([("content-type", "application/x-protobuf")], ExportTraceServiceResponse::default().encode_to_vec())
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind the receiver");
    let addr = listener.local_addr().expect("its address").to_string();
    tokio::spawn(async move { axum::serve(listener, app).await.expect("the receiver serves") });
    (format!("http://{addr}"), spans)
}

/// `POST path` over HTTP/1.0 with a `traceparent` header: (status, body).
async fn http_post(addr: &str, path: &str, body: &str, traceparent: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect to the router");
    let head = format!(
        "POST {path} HTTP/1.0\r\nHost: {addr}\r\ntraceparent: {traceparent}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
    let mut response = String::new();
    s.read_to_string(&mut response).await.unwrap();
    let status = response.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, response.split("\r\n\r\n").nth(1).unwrap_or_default().to_string())
}

/// The spans names every request's trace must hold, and the service each comes from.
const EXPECTED: &[(&str, &str)] = &[
    ("ferry-router", "request"),
    ("ferry-router", "admission"),
    ("ferry-router", "prefill"),
    ("ferry-router", "decode"),
    ("ferry-prefill", "prefill"),
    ("ferry-prefill", "prefill_chunk"),
    ("ferry-prefill", "kv_send"),
    ("ferry-decode", "decode"),
    ("ferry-decode", "decode_admission"),
    ("ferry-decode", "kv_receive"),
    ("ferry-decode", "kv_import"),
];

/// Waits (bounded) until every expected span of trace `trace_id` arrived; its spans.
async fn trace_of(spans: &Spans, trace_id: &str) -> Vec<Got> {
    let t = Instant::now();
    loop {
        let got: Vec<Got> = spans.lock().unwrap().iter().filter(|s| s.trace_id == trace_id).cloned().collect();
        let have: HashSet<(&str, &str)> = got.iter().map(|s| (s.service.as_str(), s.name.as_str())).collect();
        if EXPECTED.iter().all(|e| have.contains(e)) {
            // The last batch of another process may still be on its way: one more batch delay.
            tokio::time::sleep(Duration::from_millis(700)).await;
            return spans.lock().unwrap().iter().filter(|s| s.trace_id == trace_id).cloned().collect();
        }
        let missing: Vec<_> = EXPECTED.iter().filter(|e| !have.contains(*e)).collect();
        assert!(t.elapsed() < Duration::from_secs(30), "trace {trace_id}: spans missing after 30 s: {missing:?}; got {got:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One tree across three processes, rooted at the client's span; prints the phases against the
/// client's latency.
fn check_tree(what: &str, got: &[Got], client_span: &str, client_latency: Duration) {
    let instances: HashSet<&str> = got.iter().map(|s| s.instance.as_str()).collect();
    let services: HashSet<&str> = got.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(instances.len(), 3, "{what}: spans from {instances:?}");
    assert_eq!(services, HashSet::from(["ferry-router", "ferry-prefill", "ferry-decode"]), "{what}");
    let ids: HashMap<&str, &Got> = got.iter().map(|s| (s.span_id.as_str(), s)).collect();
    assert_eq!(ids.len(), got.len(), "{what}: span ids are unique");
    let roots: Vec<&Got> = got.iter().filter(|s| s.parent == client_span).collect();
    assert_eq!(roots.len(), 1, "{what}: one child of the client's span: {roots:#?}");
    let root = roots[0];
    assert_eq!((root.service.as_str(), root.name.as_str()), ("ferry-router", "request"), "{what}");
    for s in got {
        // Every span reaches the root through its parents (no orphan, no cycle).
        let (mut at, mut hops) = (s, 0);
        while at.span_id != root.span_id {
            at = ids.get(at.parent.as_str()).unwrap_or_else(|| panic!("{what}: {} ({}) has parent {} outside the trace", s.name, s.service, s.parent));
            hops += 1;
            assert!(hops < 32, "{what}: a cycle through {}", s.name);
        }
    }
    // The KV's hop: the decode worker's import is a child of the prefill worker's send.
    let import = got.iter().find(|s| s.name == "kv_import").expect("kv_import");
    let send = ids.get(import.parent.as_str()).expect("kv_import's parent");
    assert_eq!((send.service.as_str(), send.name.as_str()), ("ferry-prefill", "kv_send"), "{what}");
    let ms = |ns: u64| ns as f64 / 1e6;
    let root_ms = ms(root.end_ns - root.start_ns);
    let phases: f64 = got.iter().filter(|s| s.parent == root.span_id).map(|s| ms(s.end_ns - s.start_ns)).sum();
    let client_ms = client_latency.as_secs_f64() * 1e3;
    println!(
        "{what}: {} spans; client {client_ms:.1} ms, root span {root_ms:.1} ms ({:.1}%), its phases {phases:.1} ms ({:.1}%)",
        got.len(),
        100.0 * root_ms / client_ms,
        100.0 * phases / client_ms
    );
    assert!(root_ms <= client_ms * 1.05, "{what}: the root span ({root_ms:.1} ms) outlasts the client's wait ({client_ms:.1} ms)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_three_processes() {
    let (endpoint, spans) = receiver().await;
    let cluster = Cluster::up(&smollm2(), 1, 1, &["--otlp-endpoint", &endpoint]);

    // Over HTTP: the client's span is the parent of the router's.
    let models = http_get(&cluster.http, "/v1/models").await.expect("GET /v1/models");
    let json: serde_json::Value = serde_json::from_str(models.split("\r\n\r\n").nth(1).unwrap_or_default()).expect("models JSON");
    let model = json["data"][0]["id"].as_str().expect("a served model").to_string();
    // A few lengths: the phases against the client's latency are printed for each.
    let span = "00f067aa0ba902b7";
    for (i, max_tokens) in [4, 8, 16].into_iter().enumerate() {
        let trace = format!("4bf92f3577b34da6a3ce929d0e0e473{i}");
        let body = serde_json::json!({"model": model, "prompt": "The capital of France is", "max_tokens": max_tokens, "temperature": 0}).to_string();
        let t = Instant::now();
        let (status, text) = http_post(&cluster.http, "/v1/completions", &body, &format!("00-{trace}-{span}-01")).await;
        let latency = t.elapsed();
        assert_eq!(status, 200, "{text}");
        check_tree(&format!("HTTP, {max_tokens} tokens"), &trace_of(&spans, &trace).await, span, latency);
    }

    // Over gRPC: the same, from metadata.
    let (trace, span) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let mut client = FerryClient::new(cluster.channel_to(&cluster.router).await.expect("dial the router"));
    let mut req = tonic::Request::new(token_request(&[1, 504, 3458, 282, 4649, 314], 8));
    req.metadata_mut().insert("traceparent", format!("00-{trace}-{span}-01").parse().unwrap());
    let t = Instant::now();
    let mut stream = client.generate(req).await.expect("generate").into_inner();
    while stream.message().await.expect("a message").is_some() {}
    let latency = t.elapsed();
    check_tree("gRPC, 8 tokens", &trace_of(&spans, trace).await, span, latency);

    // A malformed traceparent starts a new trace (and the request is served as usual).
    let body = serde_json::json!({"model": model, "prompt": "Hi", "max_tokens": 2}).to_string();
    let (status, text) = http_post(&cluster.http, "/v1/completions", &body, "00-not-a-trace-01").await;
    assert_eq!(status, 200, "{text}");
}
