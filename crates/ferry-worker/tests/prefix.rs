//! Prefix caching across the cluster, end to end: a real router and real prefill and decode
//! workers in this process, on the golden fixture model. A conversation's later turns reuse KV:
//! the prefill worker computes only what its cache lacks, the decode worker that holds the
//! conversation receives only the blocks it lacks (a v2 span), and a short new turn is computed on
//! the decode worker itself with no KV moved. Every answer equals a cache-off engine's, tenants
//! (cache salts) share nothing, and the pools are whole at the end (cached blocks count as free).

mod common;

use common::{request, Router};
use ferry_core::SamplingParams;
use ferry_engine::{Engine, EngineConfig};
use ferry_proto::v1::admin_client::AdminClient;
use ferry_proto::v1::{GenerateFinal, ListWorkersRequest};
use ferry_router::RouterConfig;
use ferry_worker::Role;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const BLOCK: usize = 16;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden/llama-gqa")
}

fn engine(prefix_cache: bool) -> Engine {
    Engine::load(&fixture(), &EngineConfig { threads: 1, prefix_cache, ..Default::default() }).expect("load the fixture model")
}

async fn worker(role: Role, router: &str) -> tokio::sync::oneshot::Sender<()> {
    common::spawn_worker(role, router, engine(true)).await
}

fn tokens(n: usize, seed: u32) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + seed * 13 + 3) % 200 + 1).collect()
}

/// Bytes of a payload of `tokens` tokens of KV on the fixture model from token `start` (its
/// header, v1 or a v2 span's, and its body).
fn kv_bytes(tokens: usize, start: usize) -> u64 {
    let l = engine(false).kv_layout();
    let header = ferry_core::KvSpan { header: ferry_core::KvPayloadHeader { layout: l, tokens }, start }.header_bytes();
    (header + l.layer_bytes(tokens) * l.n_layers) as u64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn later_turns_reuse_kv_on_both_pools_and_answers_do_not_change() {
    let r = Router::start(RouterConfig { heartbeat: Duration::from_millis(100), local_prefill_max: 24, ..RouterConfig::new(fixture()) }).await;
    let router = r.addr.clone();
    let _p = worker(Role::Prefill, &router).await;
    let _d = worker(Role::Decode, &router).await;
    let mut reference = engine(false);
    let mut want = |prompt: &[u32], n: usize| reference.generate(prompt, &SamplingParams { ignore_eos: true, ..SamplingParams::greedy(n) }, &mut |_| {}).unwrap().tokens;

    // Turn 1: a cold 70-token prompt: nothing cached, the whole KV ships.
    let p1 = tokens(70, 1);
    let deadline = Instant::now() + Duration::from_secs(20);
    let (ids1, f1) = loop {
        match generate(&router, &p1, 10, "").await {
            Ok(r) => break r,
            Err(e) if Instant::now() < deadline && e.code() == tonic::Code::Unavailable => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => panic!("turn 1: {e:?}"),
        }
    };
    assert_eq!(ids1, want(&p1, 10), "turn 1");
    assert_eq!(f1.cached_tokens, 0);
    assert_eq!(f1.kv.as_ref().unwrap().bytes, kv_bytes(70, 0), "the whole prompt's KV");

    // Turn 2: turn 1, its answer and 40 new tokens. The prefill worker holds turn 1's prompt
    // blocks (64 tokens) and computes the rest; the decode worker holds turn 1's prompt and all
    // but the last answer token (79 tokens: 4 whole blocks) and receives tokens 64.. only.
    let p2 = [p1.clone(), ids1.clone(), tokens(40, 2)].concat();
    let (ids2, f2) = generate(&router, &p2, 10, "").await.expect("turn 2");
    assert_eq!(ids2, want(&p2, 10), "turn 2: the same answer as without a cache");
    assert_eq!(f2.cached_tokens, 64, "prefill computed only tokens 64..120");
    let held = (70 + 9) / BLOCK * BLOCK;
    assert_eq!(f2.kv.as_ref().unwrap().bytes, kv_bytes(p2.len() - held, held), "only the blocks the decode worker lacks moved");

    // Turn 3: a short new turn (3 tokens): the decode worker holds all but 120 + 9 + 3 - 128 = 4
    // tokens (at most 24 by the router's setting) and computes them itself: no KV moves.
    let p3 = [p2.clone(), ids2.clone(), tokens(3, 3)].concat();
    let (ids3, f3) = generate(&router, &p3, 10, "").await.expect("turn 3");
    assert_eq!(ids3, want(&p3, 10), "turn 3, computed on the decode worker");
    assert_eq!(f3.kv.as_ref().map_or(0, |k| k.bytes), 0, "nothing shipped");
    assert_eq!(f3.cached_tokens as usize, (p2.len() + 9) / BLOCK * BLOCK);
    assert_eq!(f3.prefill_worker, f3.decode_worker, "the decode worker prefilled it");

    // Another tenant's salt: the same prompt shares nothing.
    let (ids4, f4) = generate(&router, &p2, 10, "tenant-b").await.expect("salted");
    assert_eq!(ids4, ids2);
    assert_eq!(f4.cached_tokens, 0, "nothing cached under this salt");
    assert_eq!(f4.kv.as_ref().unwrap().bytes, kv_bytes(p2.len(), 0), "the whole KV again");

    // The pools are whole: every block free again (cached ones included).
    let mut admin = AdminClient::connect(format!("http://{router}")).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let ws = admin.list_workers(ListWorkersRequest {}).await.unwrap().into_inner().workers;
        let whole = ws.iter().all(|w| w.load.as_ref().is_some_and(|l| l.kv_blocks_free == l.kv_blocks_total && l.kv_blocks_total > 0));
        if whole && ws.len() == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "pools not whole: {ws:#?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    r.stop().await;
}

/// With two decode workers, each conversation's next turn goes to the worker that holds it (the
/// router knows from the workers' cache events), and ships only what that worker lacks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_router_sends_a_turn_to_the_decode_worker_holding_its_conversation() {
    let r = Router::start(RouterConfig { heartbeat: Duration::from_millis(100), local_prefill_max: 0, ..RouterConfig::new(fixture()) }).await;
    let router = r.addr.clone();
    let _p = worker(Role::Prefill, &router).await;
    let _d1 = worker(Role::Decode, &router).await;
    let _d2 = worker(Role::Decode, &router).await;
    let mut admin = AdminClient::connect(format!("http://{router}")).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while admin.list_workers(ListWorkersRequest {}).await.unwrap().into_inner().workers.len() < 3 {
        assert!(Instant::now() < deadline, "workers never registered");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Four conversations' first turns at once: load spreads them over both decode workers.
    let firsts: Vec<Vec<u32>> = (0..4).map(|c| tokens(50, 10 + c)).collect();
    let tasks: Vec<_> = firsts.iter().map(|p| {
        let (router, p) = (router.clone(), p.clone());
        tokio::spawn(async move { generate(&router, &p, 40, "").await })
    }).collect();
    let mut turn1: Vec<(Vec<u32>, GenerateFinal)> = Vec::new();
    for t in tasks {
        turn1.push(t.await.unwrap().expect("turn 1"));
    }
    let holders: std::collections::HashSet<&str> = turn1.iter().map(|(_, f)| f.decode_worker.as_str()).collect();
    assert_eq!(holders.len(), 2, "the first turns used both decode workers");
    // Then (once heartbeats carried the cache events) their second turns one at a time, on an
    // idle cluster, where load alone would send every one to the same worker.
    tokio::time::sleep(Duration::from_millis(400)).await;
    for c in [2, 0, 3, 1] {
        let (ids, f1) = &turn1[c];
        let p2 = [firsts[c].clone(), ids.clone(), tokens(30, 20 + c as u32)].concat();
        let (_, f2) = generate(&router, &p2, 6, "").await.expect("turn 2");
        assert_eq!(f2.decode_worker, f1.decode_worker, "conversation {c} went back to the worker that holds it");
        let held = (50 + 39) / BLOCK * BLOCK;
        assert_eq!(f2.kv.as_ref().unwrap().bytes, kv_bytes(p2.len() - held, held), "conversation {c}: only what it lacks");
    }
    r.stop().await;
}


/// With API keys, each key is a tenant of its own: a prompt one key's requests cached is a miss
/// for another key's, and for the same key under another `cache_salt`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn api_keys_are_tenants_that_share_no_cached_kv() {
    let keys = ferry_router::ApiKeys::new(["key-a", "key-b"]);
    let r = Router::start(RouterConfig { heartbeat: Duration::from_millis(100), api_keys: keys, ..RouterConfig::new(fixture()) }).await;
    let router = r.addr.clone();
    let _p = worker(Role::Prefill, &router).await;
    let _d = worker(Role::Decode, &router).await;
    let prompt = tokens(70, 5);
    let as_ = |key: &'static str, salt: &'static str| {
        let (router, prompt) = (router.clone(), prompt.clone());
        async move { common::generate_as(&router, Some(key), request(&prompt, 4, salt)).await }
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let (ids, first) = loop {
        match as_("key-a", "").await {
            Ok(r) => break r,
            Err(e) if Instant::now() < deadline && e.code() == tonic::Code::Unavailable => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => panic!("key a: {e:?}"),
        }
    };
    assert_eq!(first.cached_tokens, 0);
    let (_, again) = as_("key-a", "").await.expect("key a again");
    assert_eq!(again.cached_tokens, 64, "the same tenant hits its own cache");
    let (ids_b, b) = as_("key-b", "").await.expect("key b");
    assert_eq!((b.cached_tokens, ids_b), (0, ids.clone()), "another tenant: a miss, the same answer");
    let (_, salted) = as_("key-a", "x").await.expect("key a, salted");
    assert_eq!(salted.cached_tokens, 0, "the same tenant under another salt: a miss");
    let refused = common::generate_as(&router, Some("key-c"), request(&prompt, 4, "")).await.expect_err("an unknown key");
    assert_eq!(refused.code(), tonic::Code::Unauthenticated);
    r.stop().await;
}

async fn generate(router: &str, prompt: &[u32], max_tokens: u32, salt: &str) -> Result<(Vec<u32>, GenerateFinal), tonic::Status> {
    common::generate(router, request(prompt, max_tokens, salt)).await
}
