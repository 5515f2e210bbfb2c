//! A worker's own failures, injected on purpose ([`ferry_worker::fault::FaultInjection`]):
//! - an engine-thread panic takes the worker out: readiness fails naming it, the request it
//!   held fails tagged `engine`, it deregisters from the router, and `serve` returns an error;
//! - a step that fails for one sequence of a batch ends that sequence only (tagged `sequence`,
//!   naming the request), the others finish with their normal greedy ids, no block leaks;
//! - a prefill worker's queue of waiting prompts is bounded: beyond it, RESOURCE_EXHAUSTED tagged
//!   `overloaded`, at once.

use ferry_core::failure::{WorkerFault, FAULT_KEY};
use ferry_core::SamplingParams;
use ferry_engine::{Engine, EngineConfig};
use ferry_proto::v1::admin_client::AdminClient;
use ferry_proto::v1::decode_client::DecodeClient;
use ferry_proto::v1::{decode_response, DecodeRequest, ListWorkersRequest};
use ferry_router::RouterConfig;
use ferry_worker::fault::FaultInjection;
use ferry_worker::kv::Outbound;
use ferry_worker::load::LoadGauge;
use ferry_worker::prefill::{PrefillJob, PrefillOptions};
use ferry_worker::{EngineOptions, Listeners, Role, WorkerConfig, WorkerError};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden/llama-gqa")
}

fn engine(kv_tokens: Option<usize>) -> Engine {
    Engine::load(&fixture(), &EngineConfig { threads: 1, kv_tokens, ..Default::default() }).expect("load the fixture model")
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + 3 + salt * 13) % 200 + 1).collect()
}

fn fault_tag(s: &tonic::Status) -> Option<WorkerFault> {
    s.metadata().get(FAULT_KEY).and_then(|v| v.to_str().ok()).and_then(WorkerFault::parse)
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
    (status, text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default())
}

/// A colocated worker (prompts in, tokens out) with `faults`, optionally registered with `router`
/// and serving probes; returns its address, load gauge, the serve task and its stop sender.
struct Colocated {
    addr: String,
    http: String,
    load: Arc<LoadGauge>,
    task: tokio::task::JoinHandle<ferry_worker::Result<()>>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn colocated(faults: FaultInjection, router: Option<String>) -> Colocated {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (addr, http) = (grpc.local_addr().unwrap().to_string(), metrics.local_addr().unwrap().to_string());
    let cfg = WorkerConfig { model: "test".into(), router, drain_timeout: Duration::from_secs(5), ..WorkerConfig::new(Role::Colocated, "colocated-faults") };
    let handle = ferry_worker::EngineHandle::start_with(Role::Colocated, engine(None), "test", EngineOptions { faults, ..Default::default() });
    let load = handle.load();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready, _) = tokio::sync::watch::channel(false);
    let listeners = Listeners { grpc, data: None, metrics: Some(metrics), health: None };
    let task = tokio::spawn(ferry_worker::serve(cfg, handle, listeners, async move { let _ = stopped.await; }, ready));
    Colocated { addr, http, load, task, _stop: stop }
}

/// One request on a colocated worker: its ids, or the status it failed with.
async fn run(addr: &str, id: &str, prompt: Vec<u32>, max_tokens: usize) -> Result<Vec<u32>, tonic::Status> {
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) };
    let (sampling, stop) = ferry_proto::sampling_to_wire(&params);
    let mut c = DecodeClient::connect(format!("http://{addr}")).await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let req = DecodeRequest { request_id: id.into(), prompt_tokens: prompt.len() as u32, prompt, sampling: Some(sampling), stop: Some(stop), ..Default::default() };
    let mut s = c.decode(req).await?.into_inner();
    let mut ids = Vec::new();
    while let Some(m) = s.message().await? {
        match m.event {
            Some(decode_response::Event::Tokens(t)) => ids.extend(t.ids),
            Some(decode_response::Event::Final(f)) => {
                assert_eq!(f.completion_tokens as usize, ids.len());
                return Ok(ids);
            }
            _ => {}
        }
    }
    Err(tonic::Status::internal("the stream ended without a final message"))
}

async fn pool_whole(load: &LoadGauge) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while load.blocks_free.load(Relaxed) != load.blocks_total.load(Relaxed) || load.blocks_committed.load(Relaxed) != 0 {
        assert!(Instant::now() < deadline, "KV leaked: {} of {} blocks free", load.blocks_free.load(Relaxed), load.blocks_total.load(Relaxed));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_failing_sequence_ends_alone_and_the_batch_goes_on() {
    let faults = FaultInjection { fail_request: Some("poison".into()), ..Default::default() };
    let w = colocated(faults, None).await;
    let mut single = engine(None);
    let ids: [&'static str; 4] = ["a", "b", "poison", "c"];
    let mut calls = Vec::new();
    for (k, &id) in ids.iter().enumerate() {
        let (addr, p) = (w.addr.clone(), prompt(9 + k, k as u32));
        calls.push(tokio::spawn(async move { run(&addr, id, p, 12).await }));
    }
    for (k, (id, call)) in ids.iter().zip(calls).enumerate() {
        let got = call.await.unwrap();
        if *id == "poison" {
            let status = got.expect_err("the poisoned request fails");
            assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
            assert_eq!(fault_tag(&status), Some(WorkerFault::Sequence), "{status:?}");
            assert!(status.message().contains("request poison") && status.message().contains("decode step"), "{}", status.message());
        } else {
            let p = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(12) };
            let want = single.generate(&prompt(9 + k, k as u32), &p, &mut |_| {}).unwrap().tokens;
            assert_eq!(got.expect("the others finish"), want, "request {id}");
        }
    }
    pool_whole(&w.load).await;
    // The hook fails the poisoned request only in a step it shares with others: the others'
    // normal ids above show that step was re-run item by item (the metrics recorder is the
    // router's in this process, so the isolation counter is not read here).
    // The worker still serves.
    assert_eq!(run(&w.addr, "after", prompt(5, 9), 3).await.unwrap().len(), 3);
    pool_whole(&w.load).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_engine_panic_takes_the_worker_out() {
    // A real router, for registration and deregistration.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let router = l.local_addr().unwrap().to_string();
    let rcfg = RouterConfig { lease: Duration::from_millis(2000), heartbeat: Duration::from_millis(50), ..RouterConfig::new(fixture()) };
    let (stop_router, stopped) = tokio::sync::oneshot::channel::<()>();
    let rtask = tokio::spawn(ferry_router::serve(rcfg, ferry_router::Listeners::grpc(l), async move {
        let _ = stopped.await;
    }));
    let faults = FaultInjection { panic_after_steps: Some(4), ..Default::default() };
    let w = colocated(faults, Some(router.clone())).await;
    let deadline = Instant::now() + Duration::from_secs(20);
    while get(&w.http, "/readyz").await.0 != 200 {
        assert!(Instant::now() < deadline, "never registered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut admin = AdminClient::connect(format!("http://{router}")).await.unwrap();
    assert_eq!(admin.list_workers(ListWorkersRequest {}).await.unwrap().into_inner().workers.len(), 1);

    // The request it holds when the engine thread panics fails, tagged `engine`.
    let status = run(&w.addr, "held", prompt(7, 1), 50).await.expect_err("the engine panicked under it");
    assert_eq!(fault_tag(&status), Some(WorkerFault::Engine), "{status:?}");
    assert_eq!(status.code(), tonic::Code::Unavailable);
    assert!(status.message().contains("panicked"), "{}", status.message());

    // serve returns the failure (the binary exits non-zero on it), after deregistering.
    let served = tokio::time::timeout(Duration::from_secs(20), w.task).await.expect("serve returns").unwrap();
    match served {
        Err(WorkerError::EngineFailed(what)) => assert!(what.contains("injected fault"), "{what}"),
        other => panic!("serve returned {other:?}"),
    }
    let (code, body) = get(&w.http, "/readyz").await;
    assert_eq!(code, 503);
    assert!(body.contains("the engine failed") && body.contains("panicked"), "{body:?}");
    assert!(admin.list_workers(ListWorkersRequest {}).await.unwrap().into_inner().workers.is_empty(), "deregistered");
    let _ = stop_router.send(());
    rtask.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prefill_queue_is_bounded() {
    // Room for one 20-token prompt (2 blocks of 16) at a time.
    let h = ferry_worker::prefill::spawn_with(engine(Some(32)), "test".into(), PrefillOptions { queue_max: 1, ..Default::default() });
    let job = |id: &str| {
        let (out, rx) = tokio::sync::mpsc::unbounded_channel();
        let job = PrefillJob {
            request_id: id.into(),
            prompt: prompt(20, 0),
            params: SamplingParams::greedy(4),
            out,
            cancelled: Arc::new(AtomicBool::new(false)),
            enqueued: Instant::now(),
            buffers: false,
            salt: Vec::new(),
            ship_from: 0,
            cached: Default::default(),
            rules: Default::default(),
            span: tracing::Span::none(),
        };
        (job, rx)
    };
    // The first prompt runs; its KV stays leased while its `End` is not taken.
    let (j1, mut rx1) = job("first");
    h.submit(j1).unwrap();
    let end = loop {
        match rx1.recv().await.expect("the first prompt runs") {
            e @ Outbound::End { .. } => break e,
            Outbound::Failed(e) => panic!("{e}"),
            _ => {}
        }
    };
    // The second waits (no blocks free): the queue is full.
    let (j2, mut rx2) = job("second");
    h.submit(j2).unwrap();
    assert_eq!(h.load.snapshot().queued_requests, 1);
    let (j3, _rx3) = job("third");
    let refused = h.submit(j3).expect_err("beyond --queue-max");
    assert!(matches!(refused, WorkerError::Exhausted(_)), "{refused}");
    assert!(refused.to_string().contains("queue is full"), "{refused}");
    let status = tonic::Status::from(refused);
    assert_eq!(status.code(), tonic::Code::ResourceExhausted);
    assert_eq!(fault_tag(&status), Some(WorkerFault::Overloaded));
    // The lease goes back: the second runs, the queue empties and takes work again.
    drop(end);
    loop {
        match rx2.recv().await.expect("the second prompt runs") {
            Outbound::End { .. } => break,
            Outbound::Failed(e) => panic!("{e}"),
            _ => {}
        }
    }
    assert_eq!(h.load.snapshot().queued_requests, 0);
    let (j4, _rx4) = job("fourth");
    h.submit(j4).expect("room again");
}
