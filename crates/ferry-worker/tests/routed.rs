//! The KV transport chosen end to end: a real router and real prefill and decode workers in this
//! process, the workers with device-to-device pipes (the in-process stand-in for NCCL). The
//! workers register their transports, the router asks the pair for NCCL, the prefill worker
//! uses it, and the output equals the single engine's. With the router's ceiling at TCP, the same
//! pair moves KV over TCP.

mod common;

use common::{generate, request, Router};
use ferry_core::SamplingParams;
use ferry_engine::{Engine, EngineConfig};
use ferry_proto::v1::KvTransport as Kind;
use ferry_router::workers::transport::KvPolicy;
use ferry_router::RouterConfig;
use ferry_worker::kv::device::Pipes;
use ferry_worker::kv::in_process::InProcessConnector;
use ferry_worker::{Listeners, Role, TransportChoice, WorkerConfig};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden/llama-gqa")
}

fn engine() -> Engine {
    Engine::load(&fixture(), &EngineConfig { threads: 1, ..Default::default() }).expect("load the fixture model")
}

/// A worker registered with `router`, with pipes from `pipes`; stops when the sender drops.
async fn worker(role: Role, router: &str, pipes: &Arc<InProcessConnector>) -> tokio::sync::oneshot::Sender<()> {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let data = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cfg = WorkerConfig {
        model: "test".into(),
        router: Some(router.to_string()),
        transport: TransportChoice::Nccl,
        pipes: Some(Pipes(pipes.clone())),
        ..WorkerConfig::new(role, format!("{role:?}"))
    };
    let handle = ferry_worker::EngineHandle::start(role, engine(), "test", None);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready, _) = tokio::sync::watch::channel(false);
    let listeners = Listeners { grpc, data: (role == Role::Decode).then_some(data), metrics: None, health: None };
    tokio::spawn(async move {
        ferry_worker::serve(cfg, handle, listeners, async move { let _ = stopped.await; }, ready).await.expect("worker");
    });
    stop
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_router_asks_a_pair_with_pipes_for_nccl() {
    let prompt: Vec<u32> = (0..33u32).map(|i| (i * 7 + 3) % 200 + 1).collect();
    let want = engine().generate(&prompt, &SamplingParams { ignore_eos: true, ..SamplingParams::greedy(10) }, &mut |_| {}).unwrap().tokens;
    for (policy, expect) in [(KvPolicy::Auto, Kind::Nccl), (KvPolicy::Tcp, Kind::Tcp)] {
        let r = Router::start(RouterConfig { heartbeat: Duration::from_millis(100), kv_transport: policy, ..RouterConfig::new(fixture()) }).await;
        let router = r.addr.clone();
        let pipes = InProcessConnector::new();
        let _p = worker(Role::Prefill, &router, &pipes).await;
        let _d = worker(Role::Decode, &router, &pipes).await;
        // Bounded wait for both workers to register.
        let deadline = Instant::now() + Duration::from_secs(20);
        let (ids, fin) = loop {
            match generate(&router, request(&prompt, 10, "")).await {
                Ok(r) => break r,
                Err(e) if Instant::now() < deadline && matches!(e.code(), tonic::Code::Unavailable) => tokio::time::sleep(Duration::from_millis(20)).await,
                Err(e) => panic!("{policy:?}: {e:?}"),
            }
        };
        assert_eq!(ids, want, "{policy:?}");
        let kv = fin.kv.unwrap();
        assert_eq!(kv.transport, expect as i32, "{policy:?}: {kv:?}");
        assert!(kv.bytes > 0);
        r.stop().await;
    }
}
