//! A worker given two routers registers and heartbeats with both (each gives it its own id);
//! one router going away leaves it ready with the other; its drain deregisters from every router
//! still there. Real routers in this process, on loopback.

use ferry_engine::{Engine, EngineConfig};
use ferry_proto::v1::admin_client::AdminClient;
use ferry_proto::v1::{ListWorkersRequest, WorkerInfo};
use ferry_router::RouterConfig;
use ferry_worker::{Listeners, Role, WorkerConfig};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden/llama-gqa")
}

struct Router {
    addr: String,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), ferry_router::RouterError>>,
}

async fn router() -> Router {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let cfg = RouterConfig { lease: Duration::from_millis(600), heartbeat: Duration::from_millis(50), ..RouterConfig::new(fixture()) };
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(ferry_router::serve(cfg, ferry_router::Listeners::grpc(l), async move {
        let _ = rx.await;
    }));
    Router { addr, stop, task }
}

async fn workers(addr: &str) -> Vec<WorkerInfo> {
    let mut c = AdminClient::connect(format!("http://{addr}")).await.expect("admin");
    c.list_workers(ListWorkersRequest {}).await.expect("list workers").into_inner().workers
}

/// Bounded wait until `f` holds (polling the routers' own listing: a readiness wait).
async fn until<F: std::future::Future<Output = bool>>(what: &str, mut f: impl FnMut() -> F) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_registers_with_every_router_and_survives_one_going() {
    let (a, b) = (router().await, router().await);
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cfg = WorkerConfig {
        model: "test".into(),
        router: Some(format!("{}, {}", a.addr, b.addr)),
        drain_timeout: Duration::from_secs(5),
        ..WorkerConfig::new(Role::Prefill, "two-routers")
    };
    let engine = Engine::load(&fixture(), &EngineConfig { threads: 1, ..Default::default() }).expect("load the fixture model");
    let engine = ferry_worker::EngineHandle::start(Role::Prefill, engine, "test", None);
    let (ready, mut registered) = tokio::sync::watch::channel(false);
    let (stop_worker, stopped) = tokio::sync::oneshot::channel::<()>();
    let worker = tokio::spawn(ferry_worker::serve(cfg, engine, Listeners { grpc, data: None, metrics: None, health: None }, async move {
        let _ = stopped.await;
    }, ready));

    // Registered with both, each router listing it under its own id.
    until("both registrations", || async { workers(&a.addr).await.len() == 1 && workers(&b.addr).await.len() == 1 }).await;
    registered.wait_for(|r| *r).await.unwrap();
    let (wa, wb) = (workers(&a.addr).await.remove(0), workers(&b.addr).await.remove(0));
    assert_eq!((wa.name.as_str(), wb.name.as_str()), ("two-routers", "two-routers"));

    // Router a goes: heartbeats to b go on, the worker stays ready through a's lease and beyond.
    let _ = a.stop.send(());
    a.task.await.unwrap().unwrap();
    let hb = |w: &WorkerInfo| w.since_heartbeat_ms;
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_millis(1500) {
        assert!(*registered.borrow(), "ready while b holds a lease");
        let w = workers(&b.addr).await;
        assert_eq!(w.len(), 1);
        assert!(hb(&w[0]) < 600.0, "b's lease is renewed: {} ms since the last heartbeat", hb(&w[0]));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The drain deregisters from b (a is gone).
    let _ = stop_worker.send(());
    worker.await.unwrap().unwrap();
    assert!(workers(&b.addr).await.is_empty(), "deregistered from b");
    let _ = b.stop.send(());
    b.task.await.unwrap().unwrap();
}
