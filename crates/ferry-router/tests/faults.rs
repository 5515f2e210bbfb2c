//! Fault tolerance against mock workers: a decode stream that breaks or freezes after some tokens
//! is migrated (the client's stream goes on with every token once), a full decode pool queues
//! requests instead of refusing them, and a full queue refuses with a retry hint.

mod common;

use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

use common::{TestRouter, generate, model_path, prompt, scripted};
use ferry_core::WorkerRole;
use ferry_proto::v1;
use ferry_router::RouterConfig;
use ferry_testkit::MockConfig;
use tonic::Code;

const SCRIPT: &str = " Hello world, this is Ferry speaking. Nice to meet you, and goodbye for now.";

fn cfg() -> RouterConfig {
    RouterConfig::new(model_path())
}

fn max_tokens(mut req: v1::GenerateRequest, n: u32) -> v1::GenerateRequest {
    req.stop = Some(v1::StopConditions { max_tokens: n, ..Default::default() });
    req
}

/// A decode worker ranked first (more free blocks) that misbehaves, and a healthy one.
async fn faulty_pair(r: &TestRouter, faulty: MockConfig) -> (ferry_testkit::MockWorker, ferry_testkit::MockWorker, ferry_testkit::MockWorker) {
    let p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let bad = r.mock(WorkerRole::Decode, MockConfig { kv_blocks_free: 2000, ..faulty }).await;
    let good = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    (p, bad, good)
}

#[tokio::test]
async fn a_broken_decode_stream_migrates_and_the_client_sees_every_token_once() {
    let r = TestRouter::start(cfg()).await;
    let script = scripted(SCRIPT).script();
    let (p, bad, _good) = faulty_pair(&r, MockConfig { break_after_tokens: Some(4), ..scripted(SCRIPT) }).await;
    let mut c = r.client().await;
    let out = generate(&mut c, max_tokens(prompt("Hi"), 12)).await.expect("migrated, not failed");
    assert_eq!(out.ids, script[..12], "the whole script once, in order");
    assert_eq!(out.fin.migrations, 1);
    assert_eq!(out.fin.completion_tokens, 12);
    assert_eq!(out.fin.finish_reason, v1::FinishReason::Length as i32);
    assert_eq!((bad.stats.decode_calls.load(Relaxed), out.fin.decode_worker.as_str()), (1, "decode-2"));
    // Prefilled twice: the prompt, then the prompt with the 5 tokens streamed before the break.
    assert_eq!(p.stats.prefill_calls.load(Relaxed), 2);

    // Without a token limit the migrated request runs to the script's end (a stop token).
    let out = generate(&mut c, prompt("Hi")).await.expect("migrated");
    assert_eq!(out.ids, script);
    assert_eq!(out.text, SCRIPT);
}

/// A migrated request keeps its logprobs: every token streamed, before the break and after it
/// from the new decode worker, has its entry; the prompt's come once (not again for the
/// migrated attempt, whose prompt holds the streamed tokens).
#[tokio::test]
async fn a_migrated_request_keeps_its_logprobs_and_gets_the_prompts_once() {
    let r = TestRouter::start(cfg()).await;
    let script = scripted(SCRIPT).script();
    let (_p, _bad, _good) = faulty_pair(&r, MockConfig { break_after_tokens: Some(4), ..scripted(SCRIPT) }).await;
    let mut req = max_tokens(v1::GenerateRequest { input: Some(v1::generate_request::Input::Tokens(v1::TokenInput { ids: vec![5, 6, 7] })), ..Default::default() }, 12);
    req.sampling = Some(v1::SamplingParams { logprobs: Some(2), prompt_logprobs: Some(1), ..Default::default() });
    let mut s = r.client().await.generate(req).await.unwrap().into_inner();
    let (mut ids, mut lps, mut prompts, mut fin) = (Vec::new(), Vec::new(), Vec::new(), None);
    while let Some(m) = s.message().await.unwrap() {
        match m.event.expect("event") {
            v1::generate_response::Event::Delta(d) if d.token_ids.is_empty() && d.text.is_empty() => prompts.push(d.prompt_logprobs),
            v1::generate_response::Event::Delta(d) => {
                assert_eq!(d.logprobs.len(), d.token_ids.len(), "{d:?}");
                ids.extend(d.token_ids);
                lps.extend(d.logprobs);
            }
            v1::generate_response::Event::Final(f) => fin = Some(f),
            v1::generate_response::Event::ToolCall(t) => panic!("a tool call in a request without tools: {t:?}"),
        }
    }
    assert_eq!(fin.unwrap().migrations, 1);
    assert_eq!(ids, script[..12]);
    let want: Vec<_> = ids.iter().map(|&id| ferry_testkit::mock_logprob(Some(2), id).unwrap()).collect();
    assert_eq!(lps, want, "each token's own entry, across the migration");
    assert_eq!(prompts.len(), 1, "the prompt's logprobs once: {prompts:?}");
    assert_eq!(prompts[0].iter().map(|l| l.token_id).collect::<Vec<_>>(), [6, 7]);
}

#[tokio::test]
async fn a_frozen_decode_worker_is_left_within_its_lease() {
    let r = TestRouter::start(RouterConfig { lease: Duration::from_millis(600), heartbeat: Duration::from_millis(100), ..cfg() }).await;
    let script = scripted(SCRIPT).script();
    let (_p, bad, _good) = faulty_pair(&r, MockConfig { freeze_after_tokens: Some(3), ..scripted(SCRIPT) }).await;
    let mut c = r.client().await;
    let t = Instant::now();
    let out = generate(&mut c, max_tokens(prompt("Hi"), 10)).await.expect("migrated off the frozen worker");
    assert_eq!(out.ids, script[..10]);
    assert_eq!(out.fin.migrations, 1);
    // The lease (600 ms) settles it, not the 30 s token timeout.
    assert!(t.elapsed() < Duration::from_secs(5), "took {:?}", t.elapsed());
    common::wait_until("the frozen worker's stream to be dropped", async || bad.stats.decode_cancelled.load(Relaxed) == 1).await;
}

#[tokio::test]
async fn migrations_are_bounded() {
    let r = TestRouter::start(RouterConfig { max_migrations: 1, ..cfg() }).await;
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let broken = || MockConfig { break_after_tokens: Some(2), ..scripted(SCRIPT) };
    let _d1 = r.mock(WorkerRole::Decode, broken()).await;
    let _d2 = r.mock(WorkerRole::Decode, broken()).await;
    let _d3 = r.mock(WorkerRole::Decode, broken()).await;
    let mut c = r.client().await;
    let err = generate(&mut c, max_tokens(prompt("Hi"), 30)).await.err().expect("gave up");
    assert_eq!(err.code(), Code::Unavailable, "{err}");
    assert!(err.message().contains("1 moves"), "{err}");
}

#[tokio::test]
async fn a_full_decode_pool_queues_then_refuses_with_retry_after() {
    let r = TestRouter::start(RouterConfig { queue_timeout: Duration::from_millis(400), ..cfg() }).await;
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let full = r.mock(WorkerRole::Decode, MockConfig { refuse_decode: true, ..scripted(SCRIPT) }).await;
    let mut c = r.client().await;
    let t = Instant::now();
    let err = generate(&mut c, prompt("Hi")).await.err().expect("refused after waiting");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(t.elapsed() >= Duration::from_millis(400), "it waited: {:?}", t.elapsed());
    assert!(err.metadata().get("retry-after").is_some(), "{err:?}");
    assert!(full.stats.decode_calls.load(Relaxed) >= 2, "asked again while queued");

    // Room appears while a request waits: it is served.
    let r2 = TestRouter::start(RouterConfig { queue_timeout: Duration::from_secs(10), ..cfg() }).await;
    let _p2 = r2.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let _full2 = r2.mock(WorkerRole::Decode, MockConfig { refuse_decode: true, ..scripted(SCRIPT) }).await;
    let mut c2 = r2.client().await;
    let waiting = tokio::spawn(async move { generate(&mut c2, prompt("Hi")).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the request waits in the queue");
    let _ok = r2.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let out = waiting.await.expect("task").expect("served once room appeared");
    assert_eq!(out.fin.decode_worker, "decode-2");
}

#[tokio::test]
async fn a_full_queue_refuses_at_once() {
    let r = TestRouter::start(RouterConfig { queue_max: 1, queue_timeout: Duration::from_secs(5), ..cfg() }).await;
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let _full = r.mock(WorkerRole::Decode, MockConfig { refuse_decode: true, ..scripted(SCRIPT) }).await;
    let mut c = r.client().await;
    let mut c1 = c.clone();
    let first = tokio::spawn(async move { generate(&mut c1, prompt("Hi")).await });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t = Instant::now();
    let err = generate(&mut c, prompt("Hi")).await.err().expect("refused");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
    assert!(err.message().contains("queue is full"), "{err}");
    assert!(t.elapsed() < Duration::from_secs(1), "at once: {:?}", t.elapsed());
    first.abort();
}

#[tokio::test]
async fn the_http_api_answers_429_with_retry_after_when_no_room_appears() {
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http_addr = http.local_addr().unwrap().to_string();
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let cfg = RouterConfig { queue_timeout: Duration::from_millis(300), ..cfg() };
    let r = TestRouter::with(cfg, ferry_router::Listeners { grpc, http: Some(http), metrics: None }).await;
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let _full = r.mock(WorkerRole::Decode, MockConfig { refuse_decode: true, ..scripted(SCRIPT) }).await;
    let model = common::text().name;
    for stream in [false, true] {
        let body = serde_json::json!({"model": model, "prompt": "Hi", "max_tokens": 4, "stream": stream}).to_string();
        let a = common::http::post(&http_addr, "/v1/completions", &body).await;
        let e = a.error(429);
        assert_eq!(e["type"], "rate_limit_error", "{e}");
        let secs: u32 = a.retry_after.as_deref().expect("Retry-After").parse().expect("seconds");
        assert!(secs >= 1, "stream {stream}: {secs}");
    }
}
