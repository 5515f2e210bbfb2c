//! End to end: `ferry up` (a router, prefill and decode workers as separate processes on
//! loopback) against the single-process engine and the HF references in tests/fixtures.

mod cluster_support;

use cluster_support::*;
use ferry_proto::v1::{generate_request, structured_output, ChatInput, ChatMessage, FinishReason, GenerateRequest, SamplingParams, StopConditions, StructuredOutput};
use std::time::{Duration, Instant};

fn json(path: std::path::PathBuf) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn golden_models_disaggregated_equal_single_process_and_hf() {
    for name in ["llama-gqa", "llama3-ropescaled", "qwen2-bias-tied", "llama-bf16"] {
        let dir = fixtures().join("golden").join(name);
        let g = json(dir.join("golden.json"));
        let (prompt, want) = (ids(&g["input_ids"]), ids(&g["greedy_ids"]));
        let cluster = Cluster::up(&dir, 1, 1, &[]);
        let mut client = cluster.client().await;
        let out = run(&mut client, token_request(&prompt, want.len() as u32)).await.unwrap();
        let single = reference(&mut engine(&dir), &prompt, want.len());
        assert_eq!(out.ids, single, "{name}: cluster vs single process");
        assert_eq!(out.ids, want, "{name}: cluster vs HF transformers");
        assert_eq!(out.fin.finish_reason, FinishReason::Length as i32);
        assert_eq!(out.fin.completion_tokens as usize, want.len());
        cluster.assert_no_leaks().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_disaggregated_equals_single_process_and_hf_text() {
    let model = smollm2();
    let g = json(fixtures().join("smollm2/golden.json"));
    let cluster = Cluster::up(&model, 1, 1, &[]);
    let mut client = cluster.client().await;
    let mut single = engine(&model);
    for case in ["capital", "story"] {
        let c = &g["cases"][case];
        let prompt = ids(&c["input_ids"]);
        let n = 24;
        let out = run(&mut client, token_request(&prompt, n as u32)).await.unwrap();
        assert_eq!(out.ids, reference(&mut single, &prompt, n), "{case}: cluster vs single process");
        let kv = out.fin.kv.unwrap();
        assert!(kv.bytes > 0 && kv.chunks > 0, "{case}: a cold prompt's KV moved: {kv:?}");
        assert_eq!(out.ids[..7], ids(&c["hf_greedy_ids"])[..7], "{case}: cluster vs HF transformers");
    }
    // Chat through the router's template: the reference answer, stopped at EOS.
    let chat = GenerateRequest {
        request_id: "chat-1".into(),
        input: Some(generate_request::Input::Chat(ChatInput {
            messages: vec![
                ChatMessage { role: "system".into(), content: "You are a helpful AI assistant named SmolLM, trained by Hugging Face".into(), ..Default::default() },
                ChatMessage { role: "user".into(), content: "What is the capital of France?".into(), ..Default::default() },
            ],
        })),
        ..Default::default()
    };
    let out = run(&mut client, chat).await.unwrap();
    assert_eq!(out.text, "The capital of France is Paris.");
    assert_eq!(out.ids, ids(&g["cases"]["capital"]["hf_greedy_ids"])[..7], "the chat template renders as HF's");
    assert_eq!(out.fin.finish_reason, FinishReason::StopToken as i32);
    assert!(out.fin.ttft_ms > 0.0 && !out.fin.prefill_worker.is_empty() && !out.fin.decode_worker.is_empty());
    // The chat renders to the "capital" case's prompt, which the decode worker holds (it decoded
    // it above): it computes the last tokens itself, and no KV moves.
    let kv = out.fin.kv.unwrap_or_default();
    assert!(out.fin.cached_tokens > 0 && kv.bytes == 0, "served from the decode worker's cache: {:?}", out.fin);
    assert_eq!(out.fin.prefill_worker, out.fin.decode_worker);

    // A client that goes away mid-stream: the work stops on both workers and the KV comes back.
    let mut stream = client.generate(token_request(&ids(&g["cases"]["story"]["input_ids"]), 5000)).await.unwrap().into_inner();
    for _ in 0..3 {
        stream.message().await.unwrap().unwrap();
    }
    drop(stream);
    cluster.assert_no_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn thirty_two_concurrent_requests_through_two_by_two() {
    let model = smollm2();
    let cluster = Cluster::up(&model, 2, 2, &[]);
    let mut single = engine(&model);
    let text = "The history of the printing press begins with movable type, invented in China, and continues through Gutenberg's workshop in Mainz. ";
    let base: Vec<u32> = single.encode(&text.repeat(20)).unwrap();
    let cases: Vec<(Vec<u32>, u32)> = (0..32usize).map(|i| (base[i..i + 4 + (i * 37) % 160].to_vec(), 4 + (i as u32 * 5) % 20)).collect();
    let wants: Vec<Vec<u32>> = cases.iter().map(|(p, n)| reference(&mut single, p, *n as usize)).collect();
    drop(single);
    let mut tasks = Vec::new();
    for (p, n) in cases.clone() {
        let mut client = cluster.client().await;
        tasks.push(tokio::spawn(async move { run(&mut client, token_request(&p, n)).await }));
    }
    let mut prefill_used = std::collections::BTreeSet::new();
    let mut decode_used = std::collections::BTreeSet::new();
    for (i, t) in tasks.into_iter().enumerate() {
        let out = t.await.unwrap().unwrap_or_else(|e| panic!("request {i}: {e:?}"));
        assert_eq!(out.ids, wants[i], "request {i} (prompt of {})", cases[i].0.len());
        prefill_used.insert(out.fin.prefill_worker.clone());
        decode_used.insert(out.fin.decode_worker.clone());
    }
    assert_eq!(prefill_used.len(), 2, "both prefill workers serve: {prefill_used:?}");
    assert_eq!(decode_used.len(), 2, "both decode workers serve: {decode_used:?}");
    cluster.assert_no_leaks().await;
    // The router's /metrics explains its routing per worker: each prefill worker's measured rate
    // (which turns queued tokens into the queue-time estimate) and each decode worker's KV.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = cluster.router_metrics().await;
        let rated = m.lines().filter(|l| l.starts_with("ferry_router_worker_prefill_tokens_per_second{")).filter(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).is_some_and(|v| v > 0.0)).count();
        let kv = m.lines().filter(|l| l.starts_with("ferry_router_worker_kv_blocks_capacity{")).count();
        if rated == 2 && kv == 2 && m.contains("ferry_router_worker_estimated_queue_seconds{") {
            break;
        }
        assert!(Instant::now() < deadline, "per-worker routing gauges missing from the router's /metrics:\n{m}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_status_and_nothing_runs() {
    let model = smollm2();
    let cluster = Cluster::up(&model, 1, 1, &[]);
    let mut client = cluster.client().await;
    let code = |r: Result<Outcome, tonic::Status>| r.err().map(|s| (s.code(), s.message().to_string())).expect("an error");
    let prompt = |p: &str| GenerateRequest { input: Some(generate_request::Input::Prompt(p.into())), ..Default::default() };

    let (c, m) = code(run(&mut client, prompt("")).await);
    assert_eq!(c, tonic::Code::InvalidArgument, "{m}");
    let (c, m) = code(run(&mut client, GenerateRequest::default()).await);
    assert_eq!(c, tonic::Code::InvalidArgument, "{m}");
    let (c, m) = code(run(&mut client, token_request(&vec![42; 9000], 4)).await);
    assert_eq!(c, tonic::Code::InvalidArgument, "{m}");
    assert!(m.contains("9000") && m.contains("8192"), "{m}");
    let (c, m) = code(run(&mut client, token_request(&[1, 2, 999_999], 4)).await);
    assert_eq!(c, tonic::Code::InvalidArgument, "{m}");
    for s in [SamplingParams { temperature: -1.0, ..Default::default() }, SamplingParams { top_p: Some(1.5), ..Default::default() }] {
        let (c, m) = code(run(&mut client, GenerateRequest { sampling: Some(s), ..prompt("hi") }).await);
        assert_eq!(c, tonic::Code::InvalidArgument, "{m}");
    }
    let stop = StopConditions { stop: vec![String::new()], ..Default::default() };
    let (c, m) = code(run(&mut client, GenerateRequest { stop: Some(stop), ..prompt("hi") }).await);
    assert_eq!(c, tonic::Code::InvalidArgument, "{m}");
    let (c, m) = code(run(&mut client, GenerateRequest { model: "gpt-17".into(), ..prompt("hi") }).await);
    assert_eq!(c, tonic::Code::NotFound, "{m}");
    assert!(m.contains("gpt-17"), "{m}");
    // The cluster still serves, and nothing was left allocated.
    run(&mut client, token_request(&[1, 2, 3], 3)).await.unwrap();
    cluster.assert_no_leaks().await;
}

/// Streams `req`, kills the decode worker serving it after three messages, and reads the stream
/// to its end: (every id streamed, the final, the killed worker's id).
async fn kill_its_decode_worker_mid_stream(
    cluster: &Cluster,
    client: &mut ferry_proto::v1::ferry_client::FerryClient<tonic::transport::Channel>,
    req: GenerateRequest,
) -> (Vec<u32>, ferry_proto::v1::GenerateFinal, String) {
    use ferry_proto::v1::generate_response::Event;
    let mut stream = client.generate(req).await.unwrap().into_inner();
    let mut ids = Vec::new();
    for _ in 0..3 {
        if let Some(Event::Delta(d)) = stream.message().await.unwrap().unwrap().event {
            ids.extend(d.token_ids);
        }
    }
    let ws = cluster.workers().await;
    let busy = ws.iter().find(|w| w.role == ferry_proto::v1::WorkerRole::Decode as i32 && w.state == ferry_proto::v1::WorkerState::Ready as i32 && w.inflight == 1).expect("a busy decode worker");
    let victim = cluster.live_workers().into_iter().find(|w| w.grpc == busy.grpc_addr).expect("its process");
    signal(victim.pid, libc::SIGKILL);
    let fin = loop {
        match stream.message().await.expect("no error: the request migrates").expect("a final").event {
            Some(Event::Delta(d)) => ids.extend(d.token_ids),
            Some(Event::Final(f)) => break f,
            Some(Event::ToolCall(_)) | None => panic!("an empty message or a tool call"),
        }
    };
    (ids, fin, busy.worker_id.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_decode_worker_s_stream_migrates_and_the_rest_keep_serving() {
    let model = smollm2();
    let cluster = Cluster::up(&model, 2, 2, &[]);
    let mut client = cluster.client().await;

    // Greedy: the migrated stream equals a run without the fault.
    let req = token_request(&[1, 504, 3575], 64);
    let reference = run(&mut client, req.clone()).await.expect("the reference run");
    let (ids, fin, killed) = kill_its_decode_worker_mid_stream(&cluster, &mut client, req).await;
    assert_eq!(ids, reference.ids, "every token once, as without the fault");
    assert_eq!(fin.migrations, 1, "{fin:?}");
    assert_ne!(fin.decode_worker, killed);

    // Seeded sampling continues the same sample across the migration (the draw for token i
    // depends only on the seed and i).
    let mut sampled = token_request(&[1, 504, 3575], 48);
    sampled.sampling = Some(SamplingParams { temperature: 0.9, seed: Some(1234), ..Default::default() });
    let reference = run(&mut client, sampled.clone()).await.expect("the sampled reference");
    let greedy = run(&mut client, token_request(&[1, 504, 3575], 48)).await.expect("greedy");
    assert_ne!(reference.ids, greedy.ids, "the sample is not the greedy path");
    cluster.wait_registered(ferry_proto::v1::WorkerRole::Decode, 2, Duration::from_secs(60)).await;
    let (ids, fin, _) = kill_its_decode_worker_mid_stream(&cluster, &mut client, sampled).await;
    assert_eq!(ids, reference.ids, "the same sample as without the fault");
    assert_eq!(fin.migrations, 1, "{fin:?}");

    // Penalties too: the new workers count the generated tail of the prompt they are sent as
    // output (repetition, frequency and presence penalty, min_tokens), so the sample goes on as
    // it would have. On SmolLM2 the penalties change this sample.
    let mut penalized = token_request(&[1, 504, 3575], 48);
    penalized.sampling = Some(SamplingParams { temperature: 0.9, seed: Some(1234), repetition_penalty: Some(1.3), frequency_penalty: 0.5, presence_penalty: 0.3, ..Default::default() });
    penalized.stop = Some(StopConditions { max_tokens: 48, min_tokens: 40, ..Default::default() });
    let reference_penalized = run(&mut client, penalized.clone()).await.expect("the penalized reference");
    assert_ne!(reference_penalized.ids, reference.ids, "the penalties change the sample");
    cluster.wait_registered(ferry_proto::v1::WorkerRole::Decode, 2, Duration::from_secs(60)).await;
    let (ids, fin, _) = kill_its_decode_worker_mid_stream(&cluster, &mut client, penalized).await;
    assert_eq!(ids, reference_penalized.ids, "the same penalized sample as without the fault");
    assert_eq!(fin.migrations, 1, "{fin:?}");

    // A structured output survives the migration: the new workers replay the generated tail into
    // their grammar matchers, so the answer is the one a run without the fault gives, and valid.
    let schema = r#"{"type":"object","properties":{"city":{"type":"string","maxLength":24},"country":{"type":"string","maxLength":24},"population":{"type":"integer","minimum":0}},"required":["city","country","population"],"additionalProperties":false}"#;
    let messages = vec![ChatMessage { role: "user".into(), content: "Describe Paris as JSON.".into(), ..Default::default() }];
    let structured = GenerateRequest {
        input: Some(generate_request::Input::Chat(ChatInput { messages })),
        sampling: Some(SamplingParams {
            temperature: 0.7,
            seed: Some(99),
            structured: Some(StructuredOutput { kind: Some(structured_output::Kind::JsonSchema(schema.into())) }),
            ..Default::default()
        }),
        stop: Some(StopConditions { max_tokens: 96, ..Default::default() }),
        ..Default::default()
    };
    let reference = run(&mut client, structured.clone()).await.expect("the structured reference");
    let v: serde_json::Value = serde_json::from_str(&reference.text).unwrap_or_else(|e| panic!("not JSON ({e}): {}", reference.text));
    assert!(v["city"].is_string() && v["country"].is_string() && v["population"].is_u64(), "{v}");
    cluster.wait_registered(ferry_proto::v1::WorkerRole::Decode, 2, Duration::from_secs(60)).await;
    let (ids, fin, _) = kill_its_decode_worker_mid_stream(&cluster, &mut client, structured).await;
    assert_eq!(ids, reference.ids, "the same structured answer as without the fault");
    assert_eq!(fin.migrations, 1, "{fin:?}");

    // Kill a prefill worker too: new requests go to the one left.
    let p = cluster.live_workers().into_iter().find(|w| w.role == "prefill").unwrap();
    signal(p.pid, libc::SIGKILL);
    for i in 0..4u32 {
        let out = run(&mut client, token_request(&[1, 504 + i, 3575], 6)).await.unwrap_or_else(|e| panic!("request {i} after the kills: {e:?}"));
        assert_eq!(out.ids.len(), 6);
    }
    cluster.assert_no_leaks().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn colocated_and_chunked_prefill_equal_the_single_process_engine() {
    let model = smollm2();
    let mut single = engine(&model);
    let base: Vec<u32> = single.encode(&"A river runs through the old town, under seven bridges of grey stone. ".repeat(12)).unwrap();
    let cases: Vec<(Vec<u32>, u32)> = (0..6usize).map(|i| (base[i..i + 3 + (i * 41) % 90].to_vec(), 5 + i as u32 * 3)).collect();
    let wants: Vec<Vec<u32>> = cases.iter().map(|(p, n)| reference(&mut single, p, *n as usize)).collect();
    drop(single);
    // Colocated, prefill first; colocated with chunked prefill (small chunks, so prompts span
    // several steps shared with decodes); disaggregated with prefill chunked the same way.
    for (label, args) in [
        ("colocated", (0, 0), vec!["--colocated", "1"]),
        ("colocated+chunked", (0, 0), vec!["--colocated", "1", "--chunked-prefill", "16"]),
        ("disaggregated+chunked", (1, 1), vec!["--chunked-prefill", "16"]),
    ]
    .map(|(l, (p, d), a)| (l, (p, d, a)))
    {
        let (p, d, args) = args;
        let cluster = Cluster::up(&model, p, d, &args);
        let mut tasks = Vec::new();
        for (p, n) in cases.clone() {
            let mut client = cluster.client().await;
            tasks.push(tokio::spawn(async move { run(&mut client, token_request(&p, n)).await }));
        }
        for (i, t) in tasks.into_iter().enumerate() {
            let out = t.await.unwrap().unwrap_or_else(|e| panic!("{label}, request {i}: {e:?}"));
            assert_eq!(out.ids, wants[i], "{label}, request {i}");
            if label.starts_with("colocated") {
                assert_eq!(out.fin.prefill_worker, out.fin.decode_worker, "{label}: one worker serves");
                assert_eq!(out.fin.kv.unwrap_or_default().bytes, 0, "{label}: no KV moves");
            }
        }
        cluster.assert_no_leaks().await;
    }
}

/// Whether a process still exists (`ferry up` reaps its children, so an exited worker vanishes).
fn alive(pid: u32) -> bool {
    // SAFETY: kill(2) with signal 0 only checks that the process exists.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sigterm_drains_a_prefill_and_a_decode_worker_under_load_without_losing_a_request() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::{Arc, Mutex};
    let model = smollm2();
    let cluster = Cluster::up(&model, 2, 2, &[]);
    let mut single = engine(&model);
    let text = "A lighthouse keeper writes in the log every night: the weather, the ships, the lamp. ";
    let base: Vec<u32> = single.encode(&text.repeat(20)).unwrap();
    let prompts: Vec<Vec<u32>> = (0..6usize).map(|i| base[i..i + 40 + i * 30].to_vec()).collect();
    let wants: Vec<Vec<u32>> = prompts.iter().map(|p| reference(&mut single, p, 24)).collect();
    drop(single);

    // 36 requests from 8 concurrent clients.
    let queue = Arc::new(Mutex::new((0..36usize).collect::<Vec<_>>()));
    let done = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (queue, done, results, prompts) = (queue.clone(), done.clone(), results.clone(), prompts.clone());
        let mut client = cluster.client().await;
        tasks.push(tokio::spawn(async move {
            loop {
                let Some(i) = queue.lock().unwrap().pop() else { return };
                let r = run(&mut client, token_request(&prompts[i % prompts.len()], 24)).await;
                results.lock().unwrap().push((i, r.map(|o| (o.ids, o.fin, Instant::now()))));
                done.fetch_add(1, SeqCst);
            }
        }));
    }

    // Once the load is running, SIGTERM one decode worker with requests in flight, and a prefill.
    let deadline = Instant::now() + Duration::from_secs(120);
    let (decode_victim, prefill_victim) = loop {
        assert!(Instant::now() < deadline, "no decode worker ever had requests in flight");
        let ws = cluster.workers().await;
        let busy = ws.iter().find(|w| w.role == ferry_proto::v1::WorkerRole::Decode as i32 && w.inflight >= 2);
        if let (Some(d), true) = (busy, done.load(SeqCst) >= 2) {
            let p = ws.iter().filter(|w| w.role == ferry_proto::v1::WorkerRole::Prefill as i32).max_by_key(|w| w.inflight).unwrap();
            break (d.clone(), p.clone());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let proc_of = |w: &ferry_proto::v1::WorkerInfo| cluster.workers.iter().find(|p| p.grpc == w.grpc_addr).expect("its process");
    let (dpid, ppid) = (proc_of(&decode_victim).pid, proc_of(&prefill_victim).pid);
    let probe = proc_of(&decode_victim).metrics.clone();
    let ready = http_get(&probe, "/readyz").await.expect("the decode worker's /readyz");
    assert!(ready.starts_with("HTTP/1.0 200") || ready.starts_with("HTTP/1.1 200"), "{ready}");
    let signalled = Instant::now();
    signal(dpid, libc::SIGTERM);
    signal(ppid, libc::SIGTERM);
    // While it finishes its requests, the draining worker is live but not ready (a Service stops
    // sending it work).
    let draining = loop {
        let r = http_get(&probe, "/readyz").await.expect("the draining decode worker still answers its probes");
        if r.contains(" 503 ") {
            break r;
        }
        assert!(signalled.elapsed() < Duration::from_secs(10), "/readyz never turned 503 while draining: {r}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    assert!(draining.contains("draining"), "{draining}");

    for t in tasks {
        t.await.unwrap();
    }
    let results = std::mem::take(&mut *results.lock().unwrap());
    assert_eq!(results.len(), 36);
    let mut finished_on_victim_after_signal = 0;
    for (i, r) in &results {
        let (ids, fin, at) = r.as_ref().unwrap_or_else(|e| panic!("request {i} failed during the drain: {e:?}"));
        assert_eq!(ids, &wants[i % prompts.len()], "request {i}");
        if fin.decode_worker == decode_victim.worker_id && *at > signalled {
            finished_on_victim_after_signal += 1;
        }
    }
    assert!(finished_on_victim_after_signal >= 1, "the draining decode worker finished its in-flight requests");
    // Nothing was routed to a leaving worker: no retries, no worker marked dead.
    assert_eq!(cluster.router_counter("ferry_router_retries_total").await, 0.0, "{}", cluster.router_metrics().await);
    assert_eq!(cluster.router_counter("ferry_router_workers_marked_dead_total").await, 0.0, "{}", cluster.router_metrics().await);

    // Both victims exit on their own (drained, not killed) and leave the router's pool.
    let deadline = Instant::now() + Duration::from_secs(30);
    while alive(dpid) || alive(ppid) {
        assert!(Instant::now() < deadline, "a drained worker did not exit (decode alive: {}, prefill alive: {})", alive(dpid), alive(ppid));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ids: Vec<String> = cluster.workers().await.into_iter().map(|w| w.worker_id).collect();
    assert!(!ids.contains(&decode_victim.worker_id) && !ids.contains(&prefill_victim.worker_id), "deregistered: {ids:?}");
    // The rest keep serving, with nothing leaked.
    let mut client = cluster.client().await;
    let out = run(&mut client, token_request(&prompts[0], 24)).await.unwrap();
    assert_eq!(out.ids, wants[0]);
    cluster.assert_no_leaks().await;
}

/// `ferry pool scale` under `ferry up`: grows a pool with a new worker process, and shrinks it by
/// draining the newest worker while it serves, losing no request.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pool_scale_under_ferry_up_starts_and_drains_workers() {
    let model = smollm2();
    let cluster = Cluster::up(&model, 1, 1, &[]);
    let pool = |args: Vec<String>| {
        let router = cluster.router.clone();
        let mut pool_command = cluster.pool_command();
        tokio::task::spawn_blocking(move || {
            let out = pool_command.args(&args).args(["--router", &router]).output().unwrap();
            (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
        })
    };
    let (ok, out) = pool(vec!["scale".into(), "decode".into(), "2".into()]).await.unwrap();
    assert!(ok, "{out}");
    assert!(out.contains("decode pool: 1 -> 2") && out.contains("started  decode-2"), "{out}");
    let decode_ready = |ws: &[ferry_proto::v1::WorkerInfo]| ws.iter().filter(|w| w.role == ferry_proto::v1::WorkerRole::Decode as i32 && w.state == ferry_proto::v1::WorkerState::Ready as i32).count();
    assert_eq!(decode_ready(&cluster.workers().await), 2);

    // Load on both decode workers, then shrink the pool while it runs.
    let mut tasks = Vec::new();
    for i in 0..6u32 {
        let mut client = cluster.client().await;
        tasks.push(tokio::spawn(async move { run(&mut client, token_request(&[1, 504 + i % 2, 3575, 28], 40)).await }));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while !cluster.workers().await.iter().any(|w| w.name == "decode-2" && w.inflight > 0) {
        assert!(Instant::now() < deadline, "the new decode worker never got work");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (ok, out) = pool(vec!["scale".into(), "decode".into(), "1".into()]).await.unwrap();
    assert!(ok, "{out}");
    assert!(out.contains("decode pool: 2 -> 1") && out.contains("draining decode worker 2"), "{out}");
    let mut by_prompt: std::collections::HashMap<u32, Vec<u32>> = Default::default();
    for (i, t) in tasks.into_iter().enumerate() {
        let o = t.await.unwrap().unwrap_or_else(|e| panic!("request {i} failed while the pool shrank: {e:?}"));
        assert_eq!(o.ids.len(), 40);
        let first = by_prompt.entry(i as u32 % 2).or_insert(o.ids.clone());
        assert_eq!(&o.ids, first, "same prompt, same greedy output on either worker");
    }
    let ws = cluster.workers().await;
    assert_eq!(decode_ready(&ws), 1, "{ws:?}");
    assert!(ws.iter().all(|w| w.name != "decode-2"), "the drained worker left: {ws:?}");
    assert_eq!(cluster.router_counter("ferry_router_retries_total").await, 0.0);
    // A bad pool size is refused with a clear message.
    let (ok, out) = pool(vec!["scale".into(), "decode".into(), "100000".into(), "--no-wait".into()]).await.unwrap();
    assert!(!ok && out.contains("100000"), "{out}");
    cluster.assert_no_leaks().await;
}

/// `--autoscale` under `ferry up`: a load step of long prompts makes the router add a prefill
/// worker (the role the plan says limits TTFT), the end of the load makes it drain that worker
/// again, and no request fails through either move.
///
/// The profile here is written by the test, not measured: it says prefill costs 5 ms a token
/// (decode 2 ms a step), so that the plan at ~4 req/s of 40-token prompts needs 2 prefill workers;
/// the workers emulate that device (`--emulate-profile`: the tiny fixture model's steps are held
/// to the profile's times), so the speed they report against the profile, which the autoscaler
/// plans with, is the profile's. What is tested is the loop —
/// measuring the workload, planning over a profile, scaling through `ferry up`'s supervisor with
/// hysteresis, draining — not the profile's accuracy (`ferry plan --measured` checks that).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn autoscale_under_ferry_up_follows_a_load_step() {
    use ferry_core::profile::{DecodePoint, PrefillPoint, Profile, PROFILE_FORMAT};
    let dir = std::env::temp_dir().join(format!("ferry-autoscale-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let profile_path = dir.join("profile.json");
    let prefill = [(1, 16), (1, 64), (1, 256), (2, 64), (4, 64)]
        .map(|(prompts, prompt_tokens)| PrefillPoint { prompts, prompt_tokens, seconds: 0.002 + 0.005 * (prompts * prompt_tokens) as f64 });
    let decode = [(1, 64), (4, 64), (16, 64), (4, 256)].map(|(batch, context)| DecodePoint { batch, context, seconds: 0.002 + 0.0001 * batch as f64 + 1e-7 * (batch * context) as f64 });
    let profile = Profile {
        format: PROFILE_FORMAT,
        model: "llama-gqa".into(),
        fingerprint: String::new(),
        machine: "written by the test".into(),
        threads: 1,
        measured_at: "2026-12-03T00:00:00Z".into(),
        block_size: 16,
        kv_blocks: 4096,
        max_batch_tokens: 2048,
        max_context: 512,
        kv_bytes_per_token: 4096,
        kv_dtype: Default::default(),
        prefill: prefill.to_vec(),
        decode: decode.to_vec(),
    };
    std::fs::write(&profile_path, serde_json::to_string(&profile).unwrap()).unwrap();
    let model = fixtures().join("golden/llama-gqa");
    let profile_arg = profile_path.to_string_lossy().into_owned();
    let cluster = Cluster::up(
        &model,
        1,
        1,
        &[
            "--emulate-profile", &profile_arg, "--autoscale", "--autoscale-profile", &profile_arg, "--autoscale-interval-ms", "1000", "--autoscale-rate-window-ms", "2000", "--autoscale-max-workers", "3",
            "--autoscale-up-cooldown-ms", "1000", "--autoscale-down-cooldown-ms", "2000", "--autoscale-down-after", "2",
            "--slo-ttft-ms", "700", "--slo-tpot-ms", "100", "--autoscale-headroom", "0",
        ],
    );
    let ready = |ws: &[ferry_proto::v1::WorkerInfo], role: ferry_proto::v1::WorkerRole| {
        ws.iter().filter(|w| w.role == role as i32 && w.state == ferry_proto::v1::WorkerState::Ready as i32).count()
    };
    use ferry_proto::v1::WorkerRole::{Decode, Prefill};
    // The load step: 4 requests a second of 40-token prompts until a second prefill worker is
    // ready (at most 40 s), and a little after so that it serves some.
    let mut tasks = Vec::new();
    let start = Instant::now();
    let mut grown: Option<Instant> = None;
    let mut i = 0u32;
    while grown.is_none_or(|t| t.elapsed() < Duration::from_secs(2)) {
        assert!(start.elapsed() < Duration::from_secs(40), "no prefill worker was added under load: {:?}", cluster.workers().await);
        let mut client = cluster.client().await;
        let ids: Vec<u32> = (0..40).map(|k| 1 + (i * 7 + k) % 500).collect();
        tasks.push(tokio::spawn(async move { run(&mut client, token_request(&ids, 8)).await }));
        i += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
        if grown.is_none() && ready(&cluster.workers().await, Prefill) == 2 {
            grown = Some(Instant::now());
        }
    }
    let ws = cluster.workers().await;
    assert_eq!((ready(&ws, Prefill), ready(&ws, Decode)), (2, 1), "the limiting role grew, the other did not: {ws:?}");
    // The load stops: the added worker drains and leaves.
    let deadline = Instant::now() + Duration::from_secs(40);
    while ready(&cluster.workers().await, Prefill) != 1 {
        assert!(Instant::now() < deadline, "the prefill pool did not shrink after the load: {:?}", cluster.workers().await);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for (k, t) in tasks.into_iter().enumerate() {
        let o = t.await.unwrap().unwrap_or_else(|e| panic!("request {k} failed while the pools moved: {e:?}"));
        assert_eq!(o.ids.len(), 8);
    }
    let metrics = cluster.router_metrics().await;
    assert!(metrics.contains("ferry_router_autoscale_moves_total{role=\"prefill\",direction=\"up\"}"), "{metrics}");
    assert!(metrics.contains("ferry_router_autoscale_moves_total{role=\"prefill\",direction=\"down\"}"), "{metrics}");
    // The workers priced their steps against the profile they emulate, and the router measured
    // their speed from the heartbeats: the profile's (a paced step never runs short of it; exactly
    // 1 would be the default of a router that measured nothing).
    let ratio = metrics
        .lines()
        .find_map(|l| l.strip_prefix("ferry_router_autoscale_step_time_ratio{role=\"prefill\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no prefill step-time ratio: {metrics}"));
    assert!(ratio > 1.0 && ratio < 1.5, "prefill steps ran {ratio}x the emulated profile's time");
    assert_eq!(ready(&cluster.workers().await, Decode), 1);
    cluster.assert_no_leaks().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// The `openai` Python package version the client test installs.
const OPENAI_PIN: &str = "3.57.0";
/// And grpcio with its reflection client, for `tests/grpc_client.py`.
const GRPC_PINS: [&str; 2] = ["grpcio==1.78.0", "grpcio-reflection==1.78.0"];

/// A Python that has the `openai` package (and grpcio with its reflection client): `$FERRY_OPENAI_PYTHON`, else a venv under `target/`
/// made once with `python3 -m venv` and `pip install openai==OPENAI_PIN` (reused after that).
///
/// Once per test process: the tests that need it run in parallel, and two of them creating the
/// same venv at once break each other (`python3 -m venv --clear` removes what the other installs).
fn openai_python() -> Result<std::path::PathBuf, String> {
    static PYTHON: std::sync::OnceLock<Result<std::path::PathBuf, String>> = std::sync::OnceLock::new();
    PYTHON.get_or_init(find_or_make_openai_python).clone()
}

fn find_or_make_openai_python() -> Result<std::path::PathBuf, String> {
    let imports = |python: &std::path::Path, check: &str| {
        std::process::Command::new(python).args(["-c", &format!("import openai, grpc, grpc_reflection, sys; {check}")]).output().is_ok_and(|o| o.status.success())
    };
    if let Some(p) = std::env::var_os("FERRY_OPENAI_PYTHON") {
        let p = std::path::PathBuf::from(p);
        return if imports(&p, "") { Ok(p) } else { Err(format!("FERRY_OPENAI_PYTHON={} cannot import openai", p.display())) };
    }
    let venv = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("../py-openai");
    let python = venv.join("bin/python");
    let has_openai = |python: &std::path::Path| imports(python, &format!("sys.exit(openai.__version__ != {OPENAI_PIN:?})"));
    if has_openai(&python) {
        return Ok(python);
    }
    let step = |what: &str, cmd: &mut std::process::Command| -> Result<(), String> {
        let o = cmd.output().map_err(|e| format!("{what}: {e}"))?;
        if o.status.success() {
            Ok(())
        } else {
            Err(format!("{what} failed: {}", String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or("")))
        }
    };
    step("python3 -m venv", std::process::Command::new("python3").args(["-m", "venv", "--clear"]).arg(&venv))?;
    let pip = step(
        "pip install openai",
        std::process::Command::new(&python).args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check", &format!("openai=={OPENAI_PIN}")]).args(GRPC_PINS),
    );
    if let Err(e) = pip {
        let _ = std::fs::remove_dir_all(&venv);
        return Err(e);
    }
    if has_openai(&python) { Ok(python) } else { Err(format!("{} cannot import openai {OPENAI_PIN}", python.display())) }
}

/// [`openai_python`] for test `test`, or `None` after saying on stderr why it is skipped;
/// with `FERRY_REQUIRE_OPENAI=1` a missing Python fails the test instead.
fn openai_python_or_skip(test: &str) -> Option<std::path::PathBuf> {
    match openai_python() {
        Ok(p) => Some(p),
        Err(why) if std::env::var("FERRY_REQUIRE_OPENAI").as_deref() == Ok("1") => {
            panic!("FERRY_REQUIRE_OPENAI=1 but no Python with the openai package: {why}")
        }
        Err(why) => {
            use std::io::Write;
            // Straight to stderr, past the test harness's capture, so the skip is seen.
            let line = format!("\nSKIPPED: cluster::{test}: {why} (set FERRY_OPENAI_PYTHON to a Python with openai=={OPENAI_PIN}; FERRY_REQUIRE_OPENAI=1 makes this a failure)\n");
            let _ = std::io::stderr().write_all(line.as_bytes());
            None
        }
    }
}

/// Text, ids and final message of one gRPC generation.
async fn collect(mut s: tonic::Streaming<ferry_proto::v1::GenerateResponse>) -> (String, ferry_proto::v1::GenerateFinal) {
    let mut text = String::new();
    while let Some(m) = s.message().await.expect("the gRPC stream") {
        match m.event {
            Some(ferry_proto::v1::generate_response::Event::Delta(d)) => text.push_str(&d.text),
            Some(ferry_proto::v1::generate_response::Event::Final(f)) => return (text, f),
            Some(ferry_proto::v1::generate_response::Event::ToolCall(_)) | None => {}
        }
    }
    panic!("no final message");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_client_against_ferry_up() {
    let Some(python) = openai_python_or_skip("openai_python_client_against_ferry_up") else {
        return;
    };
    let model = smollm2();
    let key = "ferry-test-key";
    let cluster = Cluster::up(&model, 1, 1, &["--api-key", key]);

    // `ferry up` passed the key on: the gRPC client API refuses calls without it.
    let err = cluster.client().await.health(ferry_proto::v1::HealthRequest {}).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::Unauthenticated, "{err:?}");
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.router)).unwrap().connect().await.unwrap();
    let bearer: tonic::metadata::AsciiMetadataValue = format!("Bearer {key}").parse().unwrap();
    let mut client = ferry_proto::v1::ferry_client::FerryClient::with_interceptor(channel, move |mut r: tonic::Request<()>| {
        r.metadata_mut().insert("authorization", bearer.clone());
        Ok(r)
    });
    let name = client.model_info(ferry_proto::v1::ModelInfoRequest {}).await.unwrap().into_inner().model;
    assert_eq!(name, "SmolLM2-135M-Instruct", "the served id: the file's name without its quantisation");

    // What Ferry's own API answers greedily, for the Python client to match.
    let (prompt, max_tokens, chat) = ("The capital of France is", 12u32, "What is the capital of France?");
    let stop = Some(StopConditions { max_tokens, ..Default::default() });
    let req = GenerateRequest { input: Some(generate_request::Input::Prompt(prompt.into())), stop: stop.clone(), ..Default::default() };
    let (text, fin) = collect(client.generate(req).await.unwrap().into_inner()).await;
    let messages = vec![ChatMessage { role: "user".into(), content: chat.into(), ..Default::default() }];
    let req = GenerateRequest { input: Some(generate_request::Input::Chat(ChatInput { messages })), stop, ..Default::default() };
    let (chat_text, _) = collect(client.generate(req).await.unwrap().into_inner()).await;
    let words: Vec<&str> = text.split_whitespace().collect();
    assert!(words.len() >= 3, "a greedy answer of a few words: {text:?}");
    let finish = match FinishReason::try_from(fin.finish_reason).unwrap() {
        FinishReason::Length | FinishReason::ContextFull => "length",
        FinishReason::StopToken | FinishReason::StopString => "stop",
        FinishReason::Unspecified => panic!("no finish reason"),
    };
    let args = serde_json::json!({
        "base_url": format!("http://{}/v1", cluster.http),
        "api_key": key,
        "model": name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "expect_text": text,
        "expect_prompt_tokens": fin.prompt_tokens,
        "expect_completion_tokens": fin.completion_tokens,
        "expect_finish": finish,
        "stop": words[words.len() / 2],
        "chat": chat,
        "expect_chat": chat_text,
    });
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/openai_client.py");
    let py = python.clone();
    let out = tokio::task::spawn_blocking(move || std::process::Command::new(&py).arg(&script).arg(args.to_string()).output())
        .await
        .unwrap()
        .expect("run the openai client script");
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && log.contains("all checks passed"), "tests/openai_client.py failed:\n{log}");
    eprintln!("{log}");

    // Structured outputs: chat.completions.parse with pydantic models.
    let args = serde_json::json!({ "base_url": format!("http://{}/v1", cluster.http), "api_key": key, "model": name });
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/openai_structured.py");
    let py = python.clone();
    let out = tokio::task::spawn_blocking(move || std::process::Command::new(&py).arg(&script).arg(args.to_string()).output())
        .await
        .unwrap()
        .expect("run the structured-outputs script");
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && log.contains("all checks passed"), "tests/openai_structured.py failed:\n{log}");
    eprintln!("{log}");

    // Every field of the `openai` package's request types against docs/api.md's field table.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let args = serde_json::json!({
        "base_url": format!("http://{}/v1", cluster.http),
        "api_key": key,
        "model": name,
        "api_md": root.join("docs/api.md"),
    });
    let script = root.join("tests/openai_fields.py");
    let py = python.clone();
    let out = tokio::task::spawn_blocking(move || std::process::Command::new(&py).arg(&script).arg(args.to_string()).output())
        .await
        .unwrap()
        .expect("run the openai fields script");
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && log.contains("all checks passed"), "tests/openai_fields.py failed:\n{log}");
    eprintln!("{log}");

    // gRPC from descriptors alone: grpcio's v1alpha reflection client lists the router's own
    // services and calls Generate.
    let args = serde_json::json!({ "addr": cluster.router, "api_key": key });
    run_python_script(python.clone(), "tests/grpc_client.py", args).await;

    // SmolLM2's ChatML template takes no tools: Ferry's generic format.
    let args = serde_json::json!({ "base_url": format!("http://{}/v1", cluster.http), "api_key": key, "model": name, "takes_tools": false });
    run_python_script(python.clone(), "tests/openai_tools.py", args.clone()).await;
    // The Responses API through the client's `responses.create` / `stream` / `parse`, and every
    // field of its request type against the table.
    run_python_script(python, "tests/openai_responses.py", args).await;
    cluster.assert_no_leaks().await;
}

/// The client libraries `tests/openai_libraries.py` runs, pinned (instructor goes in by itself,
/// without its dependencies: it pins a `jiter` older than any `openai` 3.x allows; these give it
/// the rest).
const LIBRARY_PINS: [&str; 16] = [
    "openai==3.57.0", "pydantic-ai-slim[openai]==2.62.0", "langchain-openai==1.7.4",
    "aiohttp>=3.14.3,<4", "click>=8.3.3", "docstring-parser>=0.16,<1", "jinja2>=3.1.4,<4", "regex>=2023",
    "requests>=2.33,<3", "rich>=13.7,<15", "tenacity>=8.2.3,<10", "typer>=0.9,<1", "urllib3>=2.7,<3", "idna>=3.15",
    "grpcio==1.78.0", "grpcio-reflection==1.78.0",
];
const INSTRUCTOR_PIN: &str = "instructor==1.17.0";
const AIPERF_PIN: &str = "aiperf==0.13.0";

/// A venv under `target/` named `name`, made once per test process with `pip install` of each of
/// `installs` in turn (reused while `check` imports), or why there is none.
fn venv_python(name: &str, check: &str, installs: &[&[&str]]) -> Result<std::path::PathBuf, String> {
    let venv = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("..").join(name);
    let python = venv.join("bin/python");
    let ok = |p: &std::path::Path| std::process::Command::new(p).args(["-c", check]).output().is_ok_and(|o| o.status.success());
    if ok(&python) {
        return Ok(python);
    }
    let run = |what: String, cmd: &mut std::process::Command| -> Result<(), String> {
        let o = cmd.output().map_err(|e| format!("{what}: {e}"))?;
        if o.status.success() { Ok(()) } else { Err(format!("{what} failed: {}", String::from_utf8_lossy(&o.stderr).lines().last().unwrap_or(""))) }
    };
    run("python3 -m venv".into(), std::process::Command::new("python3").args(["-m", "venv", "--clear"]).arg(&venv))?;
    for args in installs {
        let r = run(format!("pip install {}", args.join(" ")), std::process::Command::new(&python).args(["-m", "pip", "install", "--quiet", "--disable-pip-version-check"]).args(*args));
        if let Err(e) = r {
            let _ = std::fs::remove_dir_all(&venv);
            return Err(e);
        }
    }
    if ok(&python) { Ok(python) } else { Err(format!("{} cannot run {check:?}", python.display())) }
}

/// `venv_python`'s answer for test `test`, or `None` after saying on stderr why it is skipped
/// (with `FERRY_REQUIRE_OPENAI=1`, a failure).
fn python_or_skip(test: &str, made: Result<std::path::PathBuf, String>) -> Option<std::path::PathBuf> {
    match made {
        Ok(p) => Some(p),
        Err(why) if std::env::var("FERRY_REQUIRE_OPENAI").as_deref() == Ok("1") => panic!("FERRY_REQUIRE_OPENAI=1 but {why}"),
        Err(why) => {
            use std::io::Write;
            let line = format!("\nSKIPPED: cluster::{test}: {why} (FERRY_REQUIRE_OPENAI=1 makes this a failure)\n");
            let _ = std::io::stderr().write_all(line.as_bytes());
            None
        }
    }
}

/// The libraries people build on the OpenAI API, installed from PyPI, against `ferry up` on the
/// default model (tests/openai_libraries.py: pydantic-ai, instructor, langchain-openai and the
/// `openai` client's Responses API; every answer a valid object or tool call), and aiperf with
/// vLLM's `min_tokens` and per-chunk server usage (tests/aiperf_check.py: 0 errors).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_libraries_against_ferry_up() {
    let test = "client_libraries_against_ferry_up";
    let check = "import pydantic_ai, instructor, langchain_openai, openai, sys; sys.exit(openai.__version__ != '3.57.0')";
    let Some(libs) = python_or_skip(test, venv_python("py-libs", check, &[&LIBRARY_PINS, &["--no-deps", INSTRUCTOR_PIN]])) else { return };
    let Some(aiperf) = python_or_skip(test, venv_python("py-aiperf", "import aiperf", &[&[AIPERF_PIN]])) else { return };
    let model = smollm2();
    let key = "ferry-test-key";
    let cluster = Cluster::up(&model, 1, 1, &["--api-key", key]);
    let base = serde_json::json!({ "base_url": format!("http://{}/v1", cluster.http), "api_key": key, "model": "SmolLM2-135M-Instruct" });
    let mut libs_args = base.clone();
    libs_args["responses"] = serde_json::json!(true);
    run_python_script(libs, "tests/openai_libraries.py", libs_args).await;
    run_python_script(aiperf, "tests/aiperf_check.py", base).await;
    cluster.assert_no_leaks().await;
}

/// Runs one of the `openai` client scripts with `python` and its JSON argument; fails with its
/// output unless it ends with "all checks passed".
async fn run_python_script(python: std::path::PathBuf, script: &str, args: serde_json::Value) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").join(script);
    let out = tokio::task::spawn_blocking(move || std::process::Command::new(&python).arg(&path).arg(args.to_string()).output())
        .await
        .unwrap()
        .expect("run an openai client script");
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && log.contains("all checks passed"), "{script} failed:\n{log}");
    eprintln!("{log}");
}

/// A tiny model whose chat template takes tools: the `qwen2-bias-tied` golden fixture (random
/// weights, the 512-token tokenizer) with vLLM's Hermes tool-calling template
/// (tests/fixtures/tools/README.md) and a 4096-token context (room for the template's long tool
/// prompt; the weights do not depend on it). Made under the target directory, once per run.
fn tool_model() -> std::path::PathBuf {
    let from = fixtures().join("golden/qwen2-bias-tied");
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("qwen2-hermes-tools-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["model.safetensors", "tokenizer.json", "generation_config.json"] {
        std::fs::copy(from.join(f), dir.join(f)).unwrap_or_else(|e| panic!("{f}: {e}"));
    }
    let mut config = json(from.join("config.json"));
    config["max_position_embeddings"] = serde_json::json!(4096);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut tc = json(from.join("tokenizer_config.json"));
    tc["model_max_length"] = serde_json::json!(4096);
    tc["chat_template"] = serde_json::Value::String(std::fs::read_to_string(fixtures().join("tools/hermes_tool_chat_template.jinja")).unwrap());
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
    dir
}

/// Tool calling through the official `openai` client (tests/openai_tools.py) on `ferry up`
/// serving a tiny model with a real tool-calling template: forced calls (required, named) valid
/// against their schemas, streaming equal to whole answers, a multi-turn tool conversation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_tool_calls_against_ferry_up() {
    let Some(python) = openai_python_or_skip("openai_tool_calls_against_ferry_up") else {
        return;
    };
    let model = tool_model();
    let cluster = Cluster::up(&model, 1, 1, &[]);
    let name = model.file_name().unwrap().to_string_lossy().into_owned();
    let args = serde_json::json!({ "base_url": format!("http://{}/v1", cluster.http), "api_key": "none", "model": name, "takes_tools": true });
    run_python_script(python.clone(), "tests/openai_tools.py", args.clone()).await;
    run_python_script(python, "tests/openai_responses.py", args).await;
    cluster.assert_no_leaks().await;
    drop(cluster);
    let _ = std::fs::remove_dir_all(&model);
}

/// `ferry up --admin-token`: the admin API refuses `ferry pool` without it (or with the file
/// `ferry up` printed for it, which holds it), and the workers, which register with the cluster
/// secret instead, come up and serve.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_token_is_required_by_the_pool_cli() {
    let model = smollm2();
    let cluster = Cluster::up(&model, 1, 1, &["--admin-token", "op-t0ken"]);
    let mut client = cluster.client().await;
    let out = run(&mut client, token_request(&[1, 504, 3575], 4)).await.expect("served: the workers registered with the token");
    assert_eq!(out.ids.len(), 4);
    let pool = |args: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["pool", "list", "--json", "--router", &cluster.router])
            .args(args)
            .env_remove("FERRY_ADMIN_TOKEN")
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr))
    };
    let (ok, out) = pool(&[]);
    assert!(!ok && out.contains("Unauthenticated") && out.contains("admin token"), "{out}");
    let (ok, out) = pool(&["--admin-token", "wrong"]);
    assert!(!ok && out.contains("invalid admin token"), "{out}");
    assert_eq!(cluster.admin_token, "op-t0ken");
    let (ok, out) = pool(&["--admin-token", "op-t0ken"]);
    assert!(ok, "{out}");
    let listed: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(listed.as_array().map(Vec::len), Some(2), "{out}");
    // What each worker registered for KV: CPU workers, no TLS: gRPC and the TCP data path.
    for w in listed.as_array().unwrap() {
        assert_eq!(w["kv_transports"], serde_json::json!(["grpc", "tcp"]), "{w}");
    }
}

/// `ferry up --tls`: router, workers and clients on mutual TLS (throwaway certificates). The same
/// greedy requests give the same ids and text as on a plaintext cluster, through gRPC and through
/// `ferry generate --router`; KV travels over gRPC (the plaintext TCP data path is off); clients
/// without TLS or without a client certificate are refused; the certificates go with the cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutual_tls_cluster_generates_what_the_plaintext_one_does() {
    let model = smollm2();
    let g = json(fixtures().join("smollm2/golden.json"));
    let prompt = ids(&g["cases"]["story"]["input_ids"]);
    let text = "The capital of France is";
    let cli = |router: &str, tls: &[std::ffi::OsString]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["generate", "--router", router, "--max-tokens", "12"])
            .args(tls)
            .arg(text)
            .output()
            .unwrap();
        (out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
    };

    let (plain_ids, plain_text) = {
        let cluster = Cluster::up(&model, 1, 1, &[]);
        assert!(cluster.tls.is_none());
        let out = run(&mut cluster.client().await, token_request(&prompt, 16)).await.unwrap();
        let (ok, stdout, stderr) = cli(&cluster.router, &[]);
        assert!(ok, "{stderr}");
        (out.ids, stdout)
    };

    let cluster = Cluster::up(&model, 1, 1, &["--tls"]);
    let tls = cluster.tls.clone().expect("ferry up --tls prints its certificates");
    let out = run(&mut cluster.client().await, token_request(&prompt, 16)).await.unwrap();
    assert_eq!(out.ids, plain_ids, "mutual TLS cluster vs plaintext cluster");
    let kv = out.fin.kv.unwrap();
    assert_eq!(kv.transport, ferry_proto::v1::KvTransport::Grpc as i32, "with TLS, KV never takes the plaintext TCP path: {kv:?}");
    assert!(kv.bytes > 0, "{kv:?}");
    let (ok, stdout, stderr) = cli(&cluster.router, &tls.flags());
    assert!(ok, "{stderr}");
    assert_eq!(stdout, plain_text, "ferry generate over mutual TLS vs plaintext");
    // The decode worker offers no plaintext data path; `ferry pool` works over TLS.
    let workers = cluster.workers().await;
    assert_eq!(workers.len(), 2);
    assert!(workers.iter().all(|w| w.data_addr.is_empty()), "{workers:?}");
    assert!(workers.iter().all(|w| w.kv_transports == [ferry_proto::v1::KvTransport::Grpc as i32]), "with TLS only gRPC is registered: {workers:?}");
    let pool = cluster.pool_command().args(["list", "--json", "--router", &cluster.router]).args(tls.flags()).output().unwrap();
    assert!(pool.status.success(), "{}", String::from_utf8_lossy(&pool.stderr));

    // Refused: a plaintext client, and a TLS client without a certificate.
    let (ok, _, stderr) = cli(&cluster.router, &[]);
    assert!(!ok && stderr.contains("TLS"), "{stderr}");
    let ca_only = tls.flags()[..2].to_vec();
    let (ok, _, stderr) = cli(&cluster.router, &ca_only);
    assert!(!ok && stderr.contains("TLS") && stderr.to_ascii_lowercase().contains("certificate"), "{stderr}");
    let plain = tonic::transport::Endpoint::from_shared(format!("http://{}", cluster.router)).unwrap().connect_lazy();
    let err = run(&mut ferry_proto::v1::ferry_client::FerryClient::new(plain), token_request(&prompt, 4)).await.err().expect("plaintext refused");
    assert_ne!(err.code(), tonic::Code::Ok);

    let dir = tls.ca.parent().unwrap().to_path_buf();
    assert!(dir.is_dir());
    drop(cluster);
    assert!(!dir.exists(), "ferry up removes its throwaway certificates on exit: {}", dir.display());
}

/// `ferry bench serve --trace` replays the bundled Mooncake-format trace (tests/fixtures/traces,
/// made by scripts/gen_mooncake_trace.py) on `ferry up`, one request at a time (so each finds the
/// cache its predecessors filled, as the oracle assumes): the prefix cache's hit rate, summed from
/// the router's per-request `cached_tokens`, is the one the trace's hash ids imply within 5%.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mooncake_trace_hits_the_cache_its_hash_ids_imply() {
    let cluster = Cluster::up(&smollm2(), 1, 1, &[]);
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("mooncake-replay-{}.json", std::process::id()));
    let trace = fixtures().join("traces/mooncake_small.jsonl");
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_ferry"));
    cmd.args(["bench", "serve", "--router", &cluster.router, "--trace"])
        .arg(&trace)
        .args(["--trace-block-tokens", "16", "--trace-time-scale", "0.01", "--trace-max-output", "2", "--max-concurrency", "1", "--block-size", "16", "--out"])
        .arg(&out);
    let o = tokio::task::spawn_blocking(move || cmd.output()).await.unwrap().expect("run ferry bench serve");
    let log = format!("{}{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "bench serve --trace failed:\n{log}");
    eprintln!("{log}");
    let v = json(out.clone());
    let run = &v["runs"][0];
    assert_eq!((run["requests"].as_u64(), run["completed"].as_u64()), (Some(32), Some(32)), "{log}");
    let o = &run["oracle"];
    let (measured, oracle) = (o["measured_hit_rate"].as_f64().unwrap(), o["servable_hit_rate"].as_f64().unwrap());
    assert!(oracle > 0.3, "the bundled trace shares prefixes: oracle {oracle}");
    assert_eq!(o["hit_rate"].as_f64(), Some(oracle), "16-token blocks and unique last blocks: the engine can serve every hit");
    assert!((measured / oracle - 1.0).abs() <= 0.05, "measured hit rate {measured} vs the oracle's {oracle}:\n{log}");
    let _ = std::fs::remove_file(&out);
    cluster.assert_no_leaks().await;
}
