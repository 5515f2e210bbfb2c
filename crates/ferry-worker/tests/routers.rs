//! A worker given two routers registers and heartbeats with both (each gives it its own id);
//! one router going away leaves it ready with the other; its drain deregisters from every router
//! still there. Real routers in this process, on loopback. A draining worker takes work until
//! its router has answered the heartbeat that says it drains (a registry made here, that holds
//! that answer).

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

/// A prefill worker on the fixture model, registering with `routers`; it drains when `stop` fires.
struct Worker {
    addr: String,
    registered: tokio::sync::watch::Receiver<bool>,
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Result<(), ferry_worker::WorkerError>>,
}

async fn prefill_worker(routers: String, name: &str) -> Worker {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = grpc.local_addr().unwrap().to_string();
    let cfg = WorkerConfig { model: "test".into(), router: Some(routers), drain_timeout: Duration::from_secs(5), ..WorkerConfig::new(Role::Prefill, name) };
    let engine = Engine::load(&fixture(), &EngineConfig { threads: 1, ..Default::default() }).expect("load the fixture model");
    let engine = ferry_worker::EngineHandle::start(Role::Prefill, engine, "test", None);
    let (ready, registered) = tokio::sync::watch::channel(false);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(ferry_worker::serve(cfg, engine, Listeners { grpc, data: None, metrics: None, health: None }, async move {
        let _ = stopped.await;
    }, ready));
    Worker { addr, registered, stop, task }
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
    let Worker { mut registered, stop: stop_worker, task: worker, .. } = prefill_worker(format!("{}, {}", a.addr, b.addr), "two-routers").await;

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

/// A router's registry that answers everything at once except the first heartbeat saying the
/// worker drains, which it holds for `hold` (a router slow to hear of the drain).
struct SlowToHear {
    hold: Duration,
    heard: tokio::sync::watch::Sender<Option<Instant>>,
}

#[tonic::async_trait]
impl ferry_proto::v1::registry_server::Registry for SlowToHear {
    async fn register(&self, _: tonic::Request<ferry_proto::v1::RegisterRequest>) -> Result<tonic::Response<ferry_proto::v1::RegisterResponse>, tonic::Status> {
        Ok(tonic::Response::new(ferry_proto::v1::RegisterResponse { worker_id: "w-1".into(), lease_ms: 10_000, heartbeat_ms: 50 }))
    }

    async fn heartbeat(&self, req: tonic::Request<ferry_proto::v1::HeartbeatRequest>) -> Result<tonic::Response<ferry_proto::v1::HeartbeatResponse>, tonic::Status> {
        if req.get_ref().draining && self.heard.borrow().is_none() {
            tokio::time::sleep(self.hold).await;
            self.heard.send_replace(Some(Instant::now()));
        }
        Ok(tonic::Response::new(ferry_proto::v1::HeartbeatResponse::default()))
    }

    async fn deregister(&self, _: tonic::Request<ferry_proto::v1::WorkerRef>) -> Result<tonic::Response<ferry_proto::v1::DeregisterResponse>, tonic::Status> {
        Ok(tonic::Response::new(ferry_proto::v1::DeregisterResponse {}))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_draining_worker_takes_work_until_its_router_has_heard() {
    use ferry_proto::v1::prefill_client::PrefillClient;
    let hold = Duration::from_millis(800);
    let (heard, mut heard_rx) = tokio::sync::watch::channel(None);
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let router = l.local_addr().unwrap().to_string();
    let svc = ferry_proto::v1::registry_server::RegistryServer::new(SlowToHear { hold, heard });
    tokio::spawn(tonic::transport::Server::builder().add_service(svc).serve_with_incoming(tonic::transport::server::TcpIncoming::from(l)));

    let Worker { addr, mut registered, stop: stop_worker, task: worker } = prefill_worker(router, "slow-router").await;
    tokio::time::timeout(Duration::from_secs(20), registered.wait_for(|r| *r)).await.expect("registered in time").unwrap();

    // An empty prefill request is refused, and by what: `draining` if the worker no longer takes
    // work, the empty prompt if it does.
    let mut client = PrefillClient::connect(format!("http://{addr}")).await.expect("connect to the worker");
    let ask = |mut c: PrefillClient<tonic::transport::Channel>| async move { c.prefill(ferry_proto::v1::PrefillRequest::default()).await.expect_err("an empty prompt") };
    let before = ask(client.clone()).await;
    assert_eq!(before.code(), tonic::Code::InvalidArgument, "{before:?}");

    let signalled = Instant::now();
    let _ = stop_worker.send(());
    // While the router holds its answer, the worker still takes work (each call passes the drain
    // guard and fails on its empty prompt, not on `draining`).
    let mut taken = 0;
    while heard_rx.borrow().is_none() && signalled.elapsed() < hold / 2 {
        let s = ask(client.clone()).await;
        assert_eq!(s.code(), tonic::Code::InvalidArgument, "taken while the router has not heard: {s:?}");
        taken += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(taken >= 3, "{taken} calls made while the router held its answer");
    tokio::time::timeout(Duration::from_secs(10), heard_rx.wait_for(|h| h.is_some())).await.expect("the drain's heartbeat reached the router").unwrap();
    let heard_at = heard_rx.borrow().unwrap();
    assert!(heard_at.duration_since(signalled) >= hold, "the router answered after holding it");

    // Then it refuses (or has already exited, idle).
    let after = loop {
        match client.prefill(ferry_proto::v1::PrefillRequest::default()).await {
            Err(s) if s.code() == tonic::Code::InvalidArgument => {
                assert!(signalled.elapsed() < Duration::from_secs(5), "still taking work 5 s into the drain");
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            other => break other,
        }
    };
    if let Err(s) = &after {
        assert!(s.code() == tonic::Code::Unavailable, "refused as draining or gone: {s:?}");
    }
    tokio::time::timeout(Duration::from_secs(10), worker).await.expect("the worker exits after its drain").unwrap().unwrap();
}
