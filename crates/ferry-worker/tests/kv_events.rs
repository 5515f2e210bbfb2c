//! The router knows where prefixes live: a prefill and a decode worker, each with a real engine,
//! register with a router registry served in this process; once the prefill worker has served a
//! prompt, the registry's index (fed by the heartbeats' cache events) holds that prompt's block
//! chain there, computed the router's way. A worker the router forgets registers again and
//! refills the index by snapshot.
//!
//! Runs on the tiny fixture model; with `FERRY_SMOLLM2_GGUF` set, on SmolLM2 too.

use ferry_core::prefix_cache::block_hashes;
use ferry_core::BlockHash;
use ferry_engine::{Engine, EngineConfig};
use ferry_proto::v1::decode_client::DecodeClient;
use ferry_proto::v1::prefill_client::PrefillClient;
use ferry_proto::v1::registry_server::RegistryServer;
use ferry_proto::v1::{decode_response, DecodeRequest, KvTarget, PrefillRequest, StopConditions, WorkerRole};
use ferry_router::ops::admin::RegistryService;
use ferry_router::workers::{DialOptions, Registry};
use ferry_worker::{Listeners, Role, WorkerConfig};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::transport::Channel;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden/llama-gqa")
}

fn engine(path: &Path) -> Engine {
    Engine::load(path, &EngineConfig { threads: 2, kv_tokens: Some(4096), ..Default::default() }).expect("load the model")
}

/// The router's registry alone, served on a port-0 listener.
async fn registry() -> (Arc<Registry>, String) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let dial = DialOptions { connect_timeout: Duration::from_secs(1), tls: None, cluster: Default::default() };
    let registry = Arc::new(Registry::new(Duration::from_secs(3), Duration::from_millis(50), dial));
    let svc = RegistryServer::new(RegistryService { registry: registry.clone() });
    tokio::spawn(tonic::transport::Server::builder().add_service(svc).serve_with_incoming(tonic::transport::server::TcpIncoming::from(l)));
    (registry, addr)
}

/// A worker registered with `router`; it stops when the sender drops.
async fn worker(role: Role, path: &Path, router: &str) -> (String, tokio::sync::oneshot::Sender<()>) {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let data = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = grpc.local_addr().unwrap().to_string();
    let cfg = WorkerConfig {
        model: "test".into(),
        router: Some(router.to_string()),
        kv_timeout: Duration::from_secs(10),
        drain_timeout: Duration::from_secs(2),
        ..WorkerConfig::new(role, format!("{role:?}"))
    };
    let handle = ferry_worker::EngineHandle::start(role, engine(path), "test", None);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready, _) = tokio::sync::watch::channel(false);
    let listeners = Listeners { grpc, data: (role == Role::Decode).then_some(data), metrics: None, health: None };
    tokio::spawn(async move {
        ferry_worker::serve(cfg, handle, listeners, async move { let _ = stopped.await; }, ready).await.expect("worker");
    });
    (addr, stop)
}

/// Bounded wait until `f` holds (a readiness wait on the registry's own state).
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn id_of(r: &Registry, role: WorkerRole) -> Option<String> {
    r.list().into_iter().find(|w| w.role == role as i32).map(|w| w.worker_id)
}

async fn channel(addr: &str) -> Channel {
    Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap()
}

/// One request through the pair, the router's way (decode admits, prefill ships the KV).
async fn serve_prompt(prefill: &str, decode: &str, prompt: &[u32]) {
    let stop = StopConditions { max_tokens: 2, ignore_eos: true, ..Default::default() };
    let token = format!("{:032x}", rand::random::<u128>());
    let mut dec = DecodeClient::new(channel(decode).await);
    let req = DecodeRequest { request_id: "t".into(), prompt_tokens: prompt.len() as u32, stop: Some(stop.clone()), transfer_token: token.clone(), ..Default::default() };
    let mut stream = dec.decode(req).await.expect("decode").into_inner();
    let Some(decode_response::Event::Admitted(adm)) = stream.message().await.expect("admitted").and_then(|m| m.event) else { panic!("admitted first") };
    let target = KvTarget { decode_worker: "d".into(), grpc_addr: decode.into(), data_addr: adm.data_addr.clone(), transfer_id: adm.transfer_id, transfer_token: token, ..Default::default() };
    let mut pre = PrefillClient::new(channel(prefill).await);
    pre.prefill(PrefillRequest { request_id: "t".into(), prompt: prompt.to_vec(), stop: Some(stop), target: Some(target), ..Default::default() }).await.expect("prefill");
    while let Some(m) = stream.message().await.expect("decode stream") {
        if let Some(decode_response::Event::Final(_)) = m.event {
            return;
        }
    }
    panic!("the decode stream ended without its final message");
}

async fn the_index_holds_what_a_prefill_worker_served(path: &Path) {
    let reference = engine(path);
    let (bs, fingerprint) = (reference.kv_layout().block_size, reference.fingerprint.clone());
    drop(reference);
    let (registry, router) = registry().await;
    let (p_addr, _p) = worker(Role::Prefill, path, &router).await;
    let (d_addr, _d) = worker(Role::Decode, path, &router).await;
    until("both workers registered", || registry.list().len() == 2).await;
    let p = id_of(&registry, WorkerRole::Prefill).expect("the prefill worker");
    assert!(registry.get(&p).is_some_and(|w| w.prefix_cache), "it registered with its prefix cache on");

    let prompt: Vec<u32> = (0..(3 * bs + 5) as u32).map(|i| (i * 7 + 3) % 200 + 1).collect();
    // The router's chain is the engine's: the model fingerprint and the (empty) salt as root.
    let chains = registry.prefix_chain(b"", &prompt, bs);
    let chain = chains.of(ferry_core::KvDtype::F32).to_vec();
    let engine_chain: Vec<u64> = block_hashes(BlockHash::root(fingerprint.as_bytes(), b""), &prompt, bs).into_iter().map(|h| h.0).collect();
    assert_eq!((chain.len(), &chain), (3, &engine_chain));
    assert!(registry.prefix_overlaps(&chain).is_empty());

    serve_prompt(&p_addr, &d_addr, &prompt).await;
    until("the index to hold the prompt's chain on the prefill worker", || registry.prefix_held(&p, &chains, usize::MAX).total() == chain.len()).await;
    assert_eq!(registry.prefix_overlaps(&chain).get(&p), Some(&3));
    // Released after the decode worker took the KV, the blocks stay cached; the load says so.
    until("the heartbeat to report cached blocks", || registry.get(&p).is_some_and(|w| w.load.kv_blocks_cached as usize >= chain.len())).await;
    // Another prompt sharing the first two blocks overlaps by two.
    let mut other = prompt.clone();
    other[2 * bs] += 1;
    assert_eq!(registry.prefix_held(&p, &registry.prefix_chain(b"", &other, bs), usize::MAX).total(), 2);
    // Another salt's chain is not there.
    assert_eq!(registry.prefix_held(&p, &registry.prefix_chain(b"tenant", &prompt, bs), usize::MAX).total(), 0);

    // The router forgets the worker: it registers again (a new id, a clean entry) and its first
    // heartbeat's snapshot puts the chain back.
    registry.remove(&p).expect("remove");
    until("the prefill worker to register again", || id_of(&registry, WorkerRole::Prefill).is_some_and(|id| id != p)).await;
    let again = id_of(&registry, WorkerRole::Prefill).expect("registered again");
    until("the snapshot to refill the index", || registry.prefix_held(&again, &chains, usize::MAX).total() == chain.len()).await;
    assert_eq!(registry.prefix_held(&p, &chains, usize::MAX).total(), 0, "the old id holds nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_router_index_holds_a_served_prompt_fixture_model() {
    the_index_holds_what_a_prefill_worker_served(&fixture()).await;
}

/// Says that test `test` cannot run and why, as one `SKIPPED: test: why` line straight to stderr
/// (past the test harness's capture): `.ci/run` fails on any such line it does not allow.
fn skipped(test: &str, why: &dyn std::fmt::Display) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("\nSKIPPED: {test}: {why}\n").as_bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_router_index_holds_a_served_prompt_smollm2() {
    let Some(path) = std::env::var_os("FERRY_SMOLLM2_GGUF") else {
        skipped("kv_events::the_router_index_holds_a_served_prompt_smollm2", &"FERRY_SMOLLM2_GGUF is not set");
        return;
    };
    the_index_holds_what_a_prefill_worker_served(Path::new(&path)).await;
}
