//! A worker's `/livez` and `/readyz` against a real router on loopback: not ready before it has
//! registered, ready after, not ready once the router is gone for a lease, ready again when a
//! router comes back on the same address. Also the autoscaling gauges on `/metrics`.

use ferry_engine::{Engine, EngineConfig};
use ferry_router::RouterConfig;
use ferry_worker::{Listeners, Role, WorkerConfig};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden/llama-gqa")
}

/// `GET path` over HTTP/1.1 on loopback: (status, body).
async fn get(addr: &str, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect to the HTTP listener");
    let req = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (status, body)
}

/// Poll `GET path` until it answers `want` (bounded: a readiness wait, not a sleep).
async fn wait_status(addr: &str, path: &str, want: u16, what: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = get(addr, path).await;
        if status == want {
            return body;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}: {path} is {status} {body:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

struct Router {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), ferry_router::RouterError>>,
}

fn start_router(listener: std::net::TcpListener) -> Router {
    let cfg = RouterConfig { lease: Duration::from_millis(400), heartbeat: Duration::from_millis(50), ..RouterConfig::new(fixture()) };
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let l = tokio::net::TcpListener::from_std(listener).unwrap();
    let task = tokio::spawn(ferry_router::serve(cfg, ferry_router::Listeners::grpc(l), async move {
        let _ = rx.await;
    }));
    Router { stop, task }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn readyz_follows_registration_and_the_routers_lease() {
    // The router's address is reserved (bound) first; it starts serving later. The same socket
    // serves the second router, so the worker's --router address stays the same.
    let router_socket = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    router_socket.set_nonblocking(true).unwrap();
    let router_addr = router_socket.local_addr().unwrap().to_string();
    let second_socket = router_socket.try_clone().unwrap();

    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = metrics.local_addr().unwrap().to_string();
    let cfg = WorkerConfig {
        model: "test".into(),
        router: Some(router_addr.clone()),
        kv_timeout: Duration::from_secs(5),
        drain_timeout: Duration::from_secs(5),
        ..WorkerConfig::new(Role::Prefill, "probe-test")
    };
    let engine = Engine::load(&fixture(), &EngineConfig { threads: 1, ..Default::default() }).expect("load the fixture model");
    let engine = ferry_worker::EngineHandle::start(Role::Prefill, engine, "test", None);
    let (ready, mut registered) = tokio::sync::watch::channel(false);
    let (stop_worker, stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(ferry_worker::serve(
        cfg,
        engine,
        Listeners { grpc, data: None, metrics: Some(metrics), health: None },
        async move {
            let _ = stopped.await;
        },
        ready,
    ));

    // Before registration: live, not ready, and it says why.
    let (status, _) = get(&http, "/livez").await;
    assert_eq!(status, 200);
    let (status, body) = get(&http, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(&format!("not registered with the router at {router_addr}")), "{body:?}");
    assert!(!*registered.borrow());

    // The router starts: the worker registers and turns ready.
    let r1 = start_router(router_socket);
    let body = wait_status(&http, "/readyz", 200, "registration").await;
    assert_eq!(body.trim(), "ready");
    registered.wait_for(|r| *r).await.unwrap();

    // The autoscaling gauges are exported (refreshed on every scrape).
    let (status, text) = get(&http, "/metrics").await;
    assert_eq!(status, 200);
    for gauge in ["ferry_worker_kv_utilization{role=\"prefill\"}", "ferry_worker_queue_oldest_seconds{role=\"prefill\"}"] {
        assert!(text.contains(gauge), "no {gauge} in /metrics:\n{text}");
    }

    // The router goes away: once no heartbeat has been acknowledged for a lease, not ready.
    let _ = r1.stop.send(());
    r1.task.await.unwrap().unwrap();
    let body = wait_status(&http, "/readyz", 503, "the lease to lapse").await;
    assert!(body.contains("not registered with the router"), "{body:?}");
    assert_eq!(get(&http, "/livez").await.0, 200, "still live without a router");

    // A router comes back on the same address: the worker registers again and is ready again.
    let r2 = start_router(second_socket);
    wait_status(&http, "/readyz", 200, "registration with the second router").await;

    let _ = stop_worker.send(());
    worker.await.unwrap().unwrap();
    let _ = r2.stop.send(());
    r2.task.await.unwrap().unwrap();
}
