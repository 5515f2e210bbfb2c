//! Logprobs end to end, held against logits Ferry did not compute: a real router (OpenAI HTTP
//! API) with real prefill + decode workers, and with a colocated worker, in this process. The
//! HF golden fixture holds `logits` at every prompt position (transformers, f32): `echo` with
//! `logprobs` must give, for every prompt token after the first, the log-softmax of the previous
//! position's fixture logits at that token, and for the first generated token (greedy: the
//! fixture's argmax) the log-softmax at the last position, within 1e-4; the top alternatives too.
//! Streamed answers carry the same entries as whole ones; chat's `top_logprobs` lead with the
//! chosen token under greedy. With `FERRY_SMOLLM2_GGUF` set, the same on the real default model.

mod common;

use ferry_engine::{Engine, EngineConfig};
use ferry_router::RouterConfig;
use ferry_worker::Role;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const TOL: f64 = 1e-4;

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden").join(name)
}

/// `name` from a safetensors file as f64 (f32 or i64 tensors).
fn tensor(file: &Path, name: &str) -> Vec<f64> {
    let bytes = std::fs::read(file).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    match t.dtype() {
        safetensors::Dtype::F32 => t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        safetensors::Dtype::I64 => t.data().chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f64).collect(),
        d => panic!("{name}: dtype {d:?}"),
    }
}

/// log_softmax of each row, computed here in f64 from the fixture's logits.
fn log_softmax(logits: &[f64], vocab: usize) -> Vec<Vec<f64>> {
    logits
        .chunks_exact(vocab)
        .map(|row| {
            let m = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + row.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            row.iter().map(|x| x - lse).collect()
        })
        .collect()
}

/// A row's (id, logprob), best first (equal values in id order).
fn ranked(row: &[f64]) -> Vec<(usize, f64)> {
    let mut r: Vec<(usize, f64)> = row.iter().copied().enumerate().collect();
    r.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    r
}

/// A cluster in this process: the router's gRPC and HTTP addresses; it stops when dropped.
struct Cluster {
    grpc: String,
    http: String,
    _stops: Vec<tokio::sync::oneshot::Sender<()>>,
}

async fn worker(role: Role, router: &str, model: &Path) -> tokio::sync::oneshot::Sender<()> {
    let engine = Engine::load(model, &EngineConfig { threads: 1, max_batch_tokens: 16, ..Default::default() }).expect("load the model");
    // Steps of 16 tokens: a prompt with logprobs runs in several chunks of all-position logits.
    common::spawn_worker_chunked(role, router, engine, Some(16)).await
}

impl Cluster {
    async fn up(model: &Path, roles: &[Role]) -> Cluster {
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let (router, http_addr) = (grpc.local_addr().unwrap().to_string(), http.local_addr().unwrap().to_string());
        let cfg = RouterConfig { heartbeat: Duration::from_millis(100), ..RouterConfig::new(model) };
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let listeners = ferry_router::Listeners { grpc, http: Some(http), metrics: None };
        tokio::spawn(ferry_router::serve(cfg, listeners, async move { let _ = stopped.await; }));
        let mut stops = vec![stop];
        for &r in roles {
            stops.push(worker(r, &router, model).await);
        }
        Cluster { grpc: router, http: http_addr, _stops: stops }
    }

    /// The served model's name (`GET /v1/models`).
    async fn model(&self) -> String {
        let (status, text) = http(&self.http, "/v1/models", "").await;
        assert_eq!(status, 200, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        v["data"][0]["id"].as_str().unwrap().to_string()
    }

    /// POST `body` to `path`; retried while the router has no workers yet (503), bounded.
    async fn post(&self, path: &str, body: &Value) -> Value {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let (status, text) = http(&self.http, path, &body.to_string()).await;
            match status {
                200 if body["stream"] == json!(true) => return sse(&text),
                200 => return serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
                503 if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
                s => panic!("{path} answered {s}: {text}"),
            }
        }
    }
}

/// One HTTP/1.1 request over loopback (GET when `body` is empty): status and body (chunked
/// encoding undone).
async fn http(addr: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let method = if body.is_empty() { "GET" } else { "POST" };
    let req = format!("{method} {path} HTTP/1.1\r\nHost: ferry\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    s.write_all(req.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, mut rest) = raw.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    if !head.to_ascii_lowercase().contains("transfer-encoding: chunked") {
        return (status, rest.to_string());
    }
    let mut out = String::new();
    while let Some((len, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap();
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    (status, out)
}

/// A stream's `data:` events (up to `[DONE]`) as one JSON array.
fn sse(text: &str) -> Value {
    let events: Vec<Value> = text.lines().filter_map(|l| l.strip_prefix("data: ")).take_while(|d| *d != "[DONE]").map(|d| serde_json::from_str(d).unwrap()).collect();
    assert!(text.contains("data: [DONE]"), "{text}");
    Value::Array(events)
}

/// A streamed completion's text and its chunks' logprobs, joined as one answer's.
fn join_completion(chunks: &Value) -> (String, Value) {
    let mut text = String::new();
    let mut lp = json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
    for c in chunks.as_array().unwrap().iter().filter_map(|c| c["choices"].get(0)) {
        text.push_str(c["text"].as_str().unwrap());
        for k in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
            if let Some(a) = c["logprobs"][k].as_array() {
                lp[k].as_array_mut().unwrap().extend(a.iter().cloned());
            }
        }
    }
    (text, lp)
}

fn close(a: &Value, b: f64) -> bool {
    a.as_f64().is_some_and(|a| (a - b).abs() <= TOL)
}

/// `echo` + `logprobs` on `ids` against the reference log-softmax rows `want` (one per prompt
/// position), whole and streamed; returns the whole answer.
async fn check_echo(c: &Cluster, model: &str, ids: &[u32], want: &[Vec<f64>], what: &str) -> Value {
    let body = json!({"model": model, "prompt": ids, "max_tokens": 3, "temperature": 0, "logprobs": 5, "echo": true, "ignore_eos": true});
    let r = c.post("/v1/completions", &body).await;
    let lp = &r["choices"][0]["logprobs"];
    let (tl, top) = (lp["token_logprobs"].as_array().unwrap(), lp["top_logprobs"].as_array().unwrap());
    assert_eq!(tl.len(), ids.len() + 3, "{what}: prompt and generated entries: {lp}");
    assert!(tl[0].is_null() && top[0].is_null(), "{what}: the first prompt token has no logprob");
    let mut worst = 0.0f64;
    // Prompt token p (p >= 1) under the logits at position p - 1; then the first generated token.
    let greedy = want[ids.len() - 1].iter().enumerate().fold((0, f64::NEG_INFINITY), |b, (i, &v)| if v > b.1 { (i, v) } else { b }).0;
    for p in 1..=ids.len() {
        let row = &want[p - 1];
        let tok = if p < ids.len() { ids[p] as usize } else { greedy };
        let got = tl[p].as_f64().unwrap_or_else(|| panic!("{what}: position {p}: {}", tl[p]));
        worst = worst.max((got - row[tok]).abs());
        assert!(close(&tl[p], row[tok]), "{what}: position {p}: token {tok} logprob {got} vs reference {}", row[tok]);
        // The alternatives (keyed by text: tokens with the same text collapse): each is one of
        // the reference's 5 best or the chosen token, and the best is the reference's best. The
        // gRPC check below holds them by id.
        let best = ranked(row);
        let got_top: Vec<f64> = top[p].as_object().unwrap().values().map(|v| v.as_f64().unwrap()).collect();
        for g in &got_top {
            let known = best.iter().take(5).map(|&(_, v)| v).chain([row[tok]]).any(|w| (g - w).abs() <= TOL);
            assert!(known, "{what}: position {p}: alternative {g} is not among the reference's {:?}", &best[..5]);
        }
        assert!(got_top.iter().any(|g| (g - best[0].1).abs() <= TOL), "{what}: position {p}: the best alternative");
    }
    println!("{what}: max |Δlogprob| {worst:.2e} over {} positions", ids.len());
    // The first generated token is the reference's argmax, and its logprob the top one.
    let max_top = top[ids.len()].as_object().unwrap().values().map(|v| v.as_f64().unwrap()).fold(f64::NEG_INFINITY, f64::max);
    assert!(close(&tl[ids.len()], max_top), "{what}: greedy token is top-1");
    // Streamed: the same text and entries.
    let mut body = body;
    body["stream"] = json!(true);
    let (text, slp) = join_completion(&c.post("/v1/completions", &body).await);
    assert_eq!(text, r["choices"][0]["text"].as_str().unwrap(), "{what}: streamed text");
    assert_eq!(slp["tokens"], lp["tokens"], "{what}: streamed tokens");
    assert_eq!(slp["text_offset"], lp["text_offset"], "{what}: streamed offsets");
    for (a, b) in slp["token_logprobs"].as_array().unwrap().iter().zip(tl).skip(1) {
        assert!(close(a, b.as_f64().unwrap()), "{what}: streamed logprob {a} vs {b}");
    }
    r
}

/// Chat with `top_logprobs`, whole and streamed: every token's first alternative is itself
/// (greedy), the entries carry their bytes, and the stream carries the same entries.
async fn check_chat(c: &Cluster, model: &str, what: &str) {
    let body = json!({"model": model, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 5, "temperature": 0, "logprobs": true, "top_logprobs": 3, "ignore_eos": true});
    let r = c.post("/v1/chat/completions", &body).await;
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap_or_else(|| panic!("{what}: {r}")).clone();
    assert_eq!(content.len(), 5, "{what}: one entry per token: {r}");
    for e in &content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{what}: {e}");
        assert_eq!((&top[0]["token"], &top[0]["logprob"]), (&e["token"], &e["logprob"]), "{what}: greedy token is top-1: {e}");
        assert!(top.windows(2).all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()), "{what}: sorted: {e}");
        assert!(e["logprob"].as_f64().unwrap() <= 0.0);
        let bytes: Vec<u8> = e["bytes"].as_array().unwrap().iter().map(|b| b.as_u64().unwrap() as u8).collect();
        assert_eq!(String::from_utf8_lossy(&bytes), e["token"].as_str().unwrap(), "{what}: bytes spell the token");
    }
    let mut body = body;
    body["stream"] = json!(true);
    let chunks = c.post("/v1/chat/completions", &body).await;
    let streamed: Vec<Value> = chunks.as_array().unwrap().iter().filter_map(|c| c["choices"][0]["logprobs"]["content"].as_array()).flatten().cloned().collect();
    // The same entries (a prefix cache may serve the second run's prompt: equal to rounding).
    assert_eq!(streamed.len(), content.len(), "{what}: streamed entries");
    for (s, w) in streamed.iter().zip(&content) {
        assert_eq!((&s["token"], &s["bytes"]), (&w["token"], &w["bytes"]), "{what}");
        assert!(close(&s["logprob"], w["logprob"].as_f64().unwrap()), "{what}: {s} vs {w}");
    }
}

/// The gRPC client API carries the same logprobs: one per token id on every delta, and the
/// prompt's on a delta of their own before the first token. Every prompt entry's 5 alternatives
/// are the reference's 5 best by id, and the first generated token's too.
async fn check_grpc(c: &Cluster, ids: &[u32], want: &[Vec<f64>], what: &str) {
    use ferry_proto::v1::{ferry_client::FerryClient, generate_request, generate_response, GenerateRequest, SamplingParams, StopConditions, TokenInput};
    let mut client = FerryClient::connect(format!("http://{}", c.grpc)).await.unwrap();
    let req = GenerateRequest {
        input: Some(generate_request::Input::Tokens(TokenInput { ids: ids.to_vec() })),
        sampling: Some(SamplingParams { logprobs: Some(5), prompt_logprobs: Some(5), ..Default::default() }),
        stop: Some(StopConditions { max_tokens: 4, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    };
    let mut s = client.generate(req).await.unwrap().into_inner();
    let (mut prompt, mut tokens, mut lps) = (None, Vec::new(), Vec::new());
    while let Some(m) = s.message().await.unwrap() {
        if let Some(generate_response::Event::Delta(d)) = m.event {
            if d.token_ids.is_empty() && d.text.is_empty() {
                assert!(prompt.is_none() && tokens.is_empty(), "{what}: one prompt delta, before the tokens");
                prompt = Some(d.prompt_logprobs);
                continue;
            }
            assert_eq!(d.logprobs.len(), d.token_ids.len(), "{what}: {d:?}");
            tokens.extend(d.token_ids);
            lps.extend(d.logprobs);
        }
    }
    let prompt = prompt.unwrap_or_else(|| panic!("{what}: no prompt logprobs"));
    assert_eq!(prompt.iter().map(|l| l.token_id).collect::<Vec<_>>(), ids[1..], "{what}: the prompt after its first token");
    assert_eq!(tokens.len(), 4);
    assert!(lps.iter().zip(&tokens).all(|(l, &t)| l.token_id == t && l.top.len() == 5 && l.top[0] == ferry_proto::v1::TopLogprob { token_id: t, logprob: l.logprob }));
    // Entry p - 1 is prompt token p, under row p - 1; then the first generated token.
    for (k, l) in prompt.iter().chain(&lps[..1]).enumerate() {
        let best = ranked(&want[k]);
        let got: Vec<(usize, f64)> = l.top.iter().map(|t| (t.token_id as usize, t.logprob as f64)).collect();
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), best[..5].iter().map(|b| b.0).collect::<Vec<_>>(), "{what}: row {k}: the reference's 5 best ids");
        assert!(got.iter().zip(&best).all(|(g, b)| (g.1 - b.1).abs() <= TOL), "{what}: row {k}: {got:?} vs {:?}", &best[..5]);
        assert!((l.logprob as f64 - want[k][l.token_id as usize]).abs() <= TOL, "{what}: row {k}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn echo_logprobs_match_the_hf_fixture_disaggregated_and_colocated() {
    let dir = golden("llama-gqa");
    let file = dir.join("golden.safetensors");
    let ids: Vec<u32> = tensor(&file, "input_ids").iter().map(|&v| v as u32).collect();
    let logits = tensor(&file, "logits");
    let want = log_softmax(&logits, logits.len() / ids.len());
    let greedy: Vec<u32> = tensor(&file, "greedy_ids").iter().map(|&v| v as u32).collect();
    let tokenizer = ferry_tokenizer::Tokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    for (what, roles) in [("disaggregated", &[Role::Prefill, Role::Decode][..]), ("colocated", &[Role::Colocated][..])] {
        let c = Cluster::up(&dir, roles).await;
        let model = c.model().await;
        let r = check_echo(&c, &model, &ids, &want, what).await;
        // The generated tokens are HF's greedy ones.
        let toks = r["choices"][0]["logprobs"]["tokens"].as_array().unwrap();
        let want_toks: Vec<Value> = greedy[..3].iter().map(|&t| json!(tokenizer.token_text(t).unwrap())).collect();
        assert_eq!(toks[ids.len()..], want_toks[..], "{what}");
        check_grpc(&c, &ids, &want, what).await;
    }
}

/// Says that test `test` cannot run and why, as one `SKIPPED: test: why` line straight to stderr
/// (past the test harness's capture): `.ci/run` fails on any such line it does not allow.
fn skipped(test: &str, why: &dyn std::fmt::Display) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("\nSKIPPED: {test}: {why}\n").as_bytes());
}

/// The real default model against its HF reference (`capital.logits`, every position), and chat.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn echo_and_chat_logprobs_on_smollm2() {
    let Some(path) = std::env::var_os("FERRY_SMOLLM2_GGUF") else {
        skipped("logprobs::echo_and_chat_logprobs_on_smollm2", &"FERRY_SMOLLM2_GGUF is not set");
        return;
    };
    let file = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2/golden.safetensors");
    let ids: Vec<u32> = tensor(&file, "capital.input_ids").iter().map(|&v| v as u32).collect();
    let logits = tensor(&file, "capital.logits");
    let want = log_softmax(&logits, logits.len() / ids.len());
    for (what, roles) in [("smollm2 disaggregated", &[Role::Prefill, Role::Decode][..]), ("smollm2 colocated", &[Role::Colocated][..])] {
        let c = Cluster::up(Path::new(&path), roles).await;
        let model = c.model().await;
        check_echo(&c, &model, &ids, &want, what).await;
        check_chat(&c, &model, what).await;
    }
}
