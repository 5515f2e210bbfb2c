//! The chaos suite: `ferry up` clusters of real processes on loopback, concurrent greedy clients,
//! and one fault each at a moment chosen by watching progress (a decode worker killed or frozen
//! mid-stream, a prefill worker killed or frozen mid-prompt, a router killed, a KV transfer cut
//! mid-payload, a whole role gone). Each scenario checks that every request ends with the
//! single-process engine's greedy ids (or, where nothing can serve it, a clear error within seconds), that
//! none hangs, and that once settled every live worker's own counters show a whole KV pool.
//!
//! The scenarios run one at a time (a lock): each starts five or six processes on a 2-core
//! machine, and faults are timed against the progress of the others.

mod chaos_support;
mod cluster_support;

use chaos_support::*;
use cluster_support::{engine, reference, smollm2, token_request};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Tokens each request generates.
const MAX_TOKENS: u32 = 24;
/// A client that sees no end within this is hung.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a settled cluster may take to show whole pools.
const SETTLE: Duration = Duration::from_secs(30);

/// Every request is done within this of a worker's freeze (detection within a few seconds, then
/// the rest of the work on the workers left).
const FROZEN_HANDLED: Duration = Duration::from_secs(30);

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// Six prompts of 100-250 tokens (long enough that a prefill is still running when a fault
/// strikes) and the single-process engine's greedy ids for each, computed once.
fn cases() -> &'static [(Vec<u32>, Vec<u32>)] {
    static CASES: OnceLock<Vec<(Vec<u32>, Vec<u32>)>> = OnceLock::new();
    CASES.get_or_init(|| {
        let t = Instant::now();
        let mut single = engine(&smollm2());
        let text = "The harbour master keeps a ledger of every ship: its name, its cargo, the tide it came in on, and the day it left again for the open sea. ";
        let base = single.encode(&text.repeat(16)).expect("encode the prompt text");
        let out = (0..6usize)
            .map(|i| {
                let p = base[i * 7..i * 7 + 100 + i * 30].to_vec();
                let want = reference(&mut single, &p, MAX_TOKENS as usize);
                (p, want)
            })
            .collect::<Vec<_>>();
        eprintln!("references for {} prompts: {:.1} s", out.len(), t.elapsed().as_secs_f64());
        out
    })
}

/// Start one client per case through the given routers (round-robin).
async fn load(chaos: &Chaos, routers: &[String]) -> Vec<Stream> {
    let mut out = Vec::new();
    for (i, (p, _)) in cases().iter().enumerate() {
        out.push(start(chaos, &routers[i % routers.len()], token_request(p, MAX_TOKENS), CLIENT_TIMEOUT).await);
    }
    out
}

/// Every stream must end with its reference ids; returns the finals.
async fn all_correct(streams: Vec<Stream>, label: &str) -> Vec<ferry_proto::v1::GenerateFinal> {
    let mut finals = Vec::new();
    for (i, s) in streams.into_iter().enumerate() {
        match s.task.await.expect("client task") {
            Seen::Done { ids, fin } => {
                assert_eq!(ids, cases()[i].1, "{label}: request {i}: streamed ids differ from the single-process engine's (a token twice or missing)");
                finals.push(fin);
            }
            other => panic!("{label}: request {i} did not complete: {other:?}"),
        }
    }
    finals
}

/// The worker to strike. Decode: one whose own counters show a sequence decoding while some
/// client is mid-stream (>= `min_tokens` seen, not done), so the fault surely hits a stream that
/// has sent tokens. Prefill: the one with the most prompts in flight (as the router counts them).
async fn busy(chaos: &Chaos, streams: &[Stream], role: Role, min_tokens: usize) -> Proc {
    let router = chaos.router();
    let deadline = Instant::now() + Duration::from_secs(90);
    // The last scrape that failed (a gauge missing, say), for the message if none is found.
    let mut unreadable = None;
    loop {
        if role == Role::Decode {
            let mid_stream = streams.iter().any(|s| (min_tokens..MAX_TOKENS as usize - 4).contains(&s.seen()));
            let mut best: Option<(f64, Proc)> = None;
            for w in chaos.live_workers().into_iter().filter(|w| w.role == Role::Decode) {
                let active = match pool(&w.metrics).await {
                    Ok(p) => p.active,
                    Err(e) => {
                        unreadable = Some(format!("{}: {e}", w.name));
                        0.0
                    }
                };
                if active >= 1.0 && best.as_ref().is_none_or(|(a, _)| active > *a) {
                    best = Some((active, w));
                }
            }
            if let (true, Some((_, w))) = (mid_stream, best) {
                return w;
            }
        } else {
            let ws = chaos.listed(&router).await;
            if let Some(w) = ws.iter().filter(|w| w.role == ferry_proto::v1::WorkerRole::Prefill as i32 && w.inflight > 0).max_by_key(|w| w.inflight) {
                return chaos.proc_of(w);
            }
        }
        assert!(Instant::now() < deadline, "no busy {role:?} worker (progress {:?}; last unreadable pool: {unreadable:?})", streams.iter().map(Stream::seen).collect::<Vec<_>>());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The positive control of a decode fault: it moved at least one request mid-stream, counted in
/// the finals and in the routers' metrics; else the fault missed and the test proves nothing.
async fn migrated(chaos: &Chaos, finals: &[ferry_proto::v1::GenerateFinal], label: &str) {
    let in_finals: u32 = finals.iter().map(|f| f.migrations).sum();
    assert!(in_finals >= 1, "{label}: the fault missed: no request says it migrated: {finals:?}");
    let counted = chaos.router_metric("ferry_router_migrations_total").await;
    assert!(counted >= in_finals as f64, "{label}: ferry_router_migrations_total = {counted}, the finals say {in_finals}");
    eprintln!("{label}: the fault struck: {in_finals} migrations in the finals, ferry_router_migrations_total = {counted}");
}

/// The positive control of a prefill fault: it struck a prompt in flight, which started again on
/// another worker before its first token, counted in the finals and in the routers' metrics; else
/// the fault missed (the prompts were done before it) and the test proves nothing.
async fn retried(chaos: &Chaos, finals: &[ferry_proto::v1::GenerateFinal], label: &str) {
    let in_finals: u32 = finals.iter().map(|f| f.retries).sum();
    assert!(in_finals >= 1, "{label}: the fault missed: no request says it was retried: {finals:?}");
    let counted = chaos.router_metric("ferry_router_retries_total").await;
    assert!(counted >= in_finals as f64, "{label}: ferry_router_retries_total = {counted}, the finals say {in_finals}");
    eprintln!("{label}: the fault struck: {in_finals} retries in the finals, ferry_router_retries_total = {counted}");
}

/// A killed worker is declared dead (its calls fail, or its lease expires).
async fn marked_dead(chaos: &Chaos, label: &str) {
    let dead = chaos.router_metric("ferry_router_workers_marked_dead_total").await;
    assert!(dead >= 1.0, "{label}: ferry_router_workers_marked_dead_total = {dead} after a worker was killed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_decode_worker_killed_mid_stream_its_requests_migrate() {
    let _one = serial();
    let t = Instant::now();
    cases();
    let chaos = Chaos::up(&smollm2(), 2, 2, &[]);
    eprintln!("cluster up after {:.1} s", t.elapsed().as_secs_f64());
    let streams = load(&chaos, &[chaos.router()]).await;
    let victim = busy(&chaos, &streams, Role::Decode, 3).await;
    chaos.kill(victim.pid);
    let finals = all_correct(streams, "decode killed").await;
    migrated(&chaos, &finals, "decode killed").await;
    marked_dead(&chaos, "decode killed").await;
    chaos.assert_pools_whole(SETTLE).await;
    eprintln!("a_decode_worker_killed_mid_stream: {:.1} s", t.elapsed().as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn b_a_prefill_worker_killed_mid_prompt_its_prompts_go_elsewhere() {
    let _one = serial();
    let t = Instant::now();
    cases();
    let chaos = Chaos::up(&smollm2(), 2, 2, &[]);
    eprintln!("cluster up after {:.1} s", t.elapsed().as_secs_f64());
    let streams = load(&chaos, &[chaos.router()]).await;
    let victim = busy(&chaos, &streams, Role::Prefill, 0).await;
    chaos.kill(victim.pid);
    let finals = all_correct(streams, "prefill killed").await;
    retried(&chaos, &finals, "prefill killed").await;
    marked_dead(&chaos, "prefill killed").await;
    chaos.assert_pools_whole(SETTLE).await;
    eprintln!("b_a_prefill_worker_killed_mid_prompt: {:.1} s", t.elapsed().as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn c_a_decode_worker_frozen_mid_stream_its_requests_migrate() {
    let _one = serial();
    let t = Instant::now();
    cases();
    let chaos = Chaos::up(&smollm2(), 2, 2, &[]);
    eprintln!("cluster up after {:.1} s", t.elapsed().as_secs_f64());
    let streams = load(&chaos, &[chaos.router()]).await;
    let victim = busy(&chaos, &streams, Role::Decode, 3).await;
    chaos.stop(victim.pid);
    let struck = Instant::now();
    let finals = all_correct(streams, "decode frozen").await;
    eprintln!("decode frozen: every request done {:.1} s after the SIGSTOP", struck.elapsed().as_secs_f64());
    assert!(struck.elapsed() < FROZEN_HANDLED, "a frozen decode worker held its requests for {:?}", struck.elapsed());
    migrated(&chaos, &finals, "decode frozen").await;
    // Thawed, it finds its streams gone and frees them (and registers again, or is cleaned up).
    chaos.resume(victim.pid);
    chaos.assert_pools_whole(SETTLE).await;
    eprintln!("c_a_decode_worker_frozen_mid_stream: {:.1} s", t.elapsed().as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn d_a_prefill_worker_frozen_mid_prompt_its_prompts_go_elsewhere() {
    let _one = serial();
    let t = Instant::now();
    cases();
    let chaos = Chaos::up(&smollm2(), 2, 2, &[]);
    eprintln!("cluster up after {:.1} s", t.elapsed().as_secs_f64());
    let streams = load(&chaos, &[chaos.router()]).await;
    let victim = busy(&chaos, &streams, Role::Prefill, 0).await;
    chaos.stop(victim.pid);
    let struck = Instant::now();
    let finals = all_correct(streams, "prefill frozen").await;
    eprintln!("prefill frozen: every request done {:.1} s after the SIGSTOP", struck.elapsed().as_secs_f64());
    assert!(struck.elapsed() < FROZEN_HANDLED, "a frozen prefill worker held its prompts for {:?}", struck.elapsed());
    retried(&chaos, &finals, "prefill frozen").await;
    chaos.resume(victim.pid);
    chaos.assert_pools_whole(SETTLE).await;
    eprintln!("d_a_prefill_worker_frozen_mid_prompt: {:.1} s", t.elapsed().as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn e_one_of_two_routers_killed_only_its_streams_end_and_the_other_serves_at_once() {
    let _one = serial();
    let t = Instant::now();
    cases();
    let chaos = Chaos::up(&smollm2(), 2, 2, &["--routers", "2"]);
    let routers: Vec<String> = chaos.routers().iter().map(|r| r.grpc.clone()).collect();
    assert_eq!(routers.len(), 2, "ferry up --routers 2 announced {routers:?}");
    for r in &routers {
        chaos.wait_ready(r, Role::Prefill, 2, Duration::from_secs(30)).await;
        chaos.wait_ready(r, Role::Decode, 2, Duration::from_secs(30)).await;
    }
    let (survivor, doomed) = (routers[0].clone(), chaos.routers()[1].clone());
    let streams = load(&chaos, &routers).await;
    // Strike once a stream through the doomed router is streaming.
    wait_for("a stream through the second router", Duration::from_secs(90), || {
        let s = &streams;
        let d = doomed.grpc.clone();
        async move { s.iter().any(|s| s.router == d && s.seen() >= 3) }
    })
    .await;
    chaos.kill(doomed.pid);
    let struck = Instant::now();
    let mut cut = 0;
    for (i, s) in streams.into_iter().enumerate() {
        let through = s.router.clone();
        match s.task.await.expect("client task") {
            Seen::Done { ids, .. } => assert_eq!(ids, cases()[i].1, "request {i} through {through}"),
            Seen::Error { status, .. } if through == doomed.grpc => {
                assert!(struck.elapsed() < Duration::from_secs(10), "the error came {:?} after the kill", struck.elapsed());
                eprintln!("request {i} through the killed router: {:?}: {}", status.code(), status.message());
                cut += 1;
            }
            other => panic!("request {i} through {through}: {other:?}"),
        }
    }
    assert!(cut >= 1, "the stream that was running through the killed router ended with an error");
    // New requests through the survivor succeed at once.
    let again = load(&chaos, &[survivor.clone()]).await;
    let t_again = Instant::now();
    all_correct(again, "after the router kill").await;
    eprintln!("after the router kill: 6 new requests done in {:.1} s", t_again.elapsed().as_secs_f64());
    chaos.assert_pools_whole(SETTLE).await;
    eprintln!("e_one_of_two_routers_killed: {:.1} s", t.elapsed().as_secs_f64());
}

/// Start one more decode worker, registered with `router`, whose KV data path peers reach only
/// through `FaultProxy`s: the worker binds 127.0.0.1, advertises 127.0.0.2 (same ports), and the
/// proxies listen there. The gRPC proxy passes everything; the data proxy cuts the first `cut`
/// transfers after `after` bytes.
async fn proxied_decode_worker(chaos: &Chaos, router: &str, cut: usize, after: u64) -> (FaultProxy, FaultProxy, Proc) {
    for _ in 0..5 {
        let grpc_l = tokio::net::TcpListener::bind("127.0.0.2:0").await.expect("bind 127.0.0.2");
        let data_l = tokio::net::TcpListener::bind("127.0.0.2:0").await.expect("bind 127.0.0.2");
        let (g, d) = (grpc_l.local_addr().expect("addr").port(), data_l.local_addr().expect("addr").port());
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ferry"))
            .env("FERRY_CLUSTER_SECRET", &chaos.cluster.cluster_secret)
            .args(["decode", "--router", router, "--threads", "1", "--name", "decode-proxied", "--advertise-host", "127.0.0.2"])
            // As the cluster's workers: its streams are held against the exact references.
            .args(["--activations", "exact"])
            .args(["--listen", &format!("127.0.0.1:{g}"), "--data-listen", &format!("127.0.0.1:{d}"), "--model"])
            .arg(&chaos.model)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start a decode worker");
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(child.stdout.take().expect("stdout")));
        let ready = lines.by_ref().map_while(Result::ok).find(|l| l.contains(" ready "));
        let Some(line) = ready else {
            // The port was taken on 127.0.0.1: try other ports.
            let _ = child.wait();
            continue;
        };
        std::thread::spawn(move || for _ in lines {});
        let metrics = line.split_whitespace().find_map(|f| f.strip_prefix("metrics=")).unwrap_or_default().to_string();
        let grpc = FaultProxy::start(grpc_l, format!("127.0.0.1:{g}"), 0, 0);
        let data = FaultProxy::start(data_l, format!("127.0.0.1:{d}"), cut, after);
        let p = Proc { role: Role::Decode, name: "decode-proxied".into(), pid: child.id(), grpc: format!("127.0.0.2:{g}"), metrics };
        chaos.adopt(child, p.clone());
        return (grpc, data, p);
    }
    panic!("could not start a decode worker on matching ports");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn f_a_kv_transfer_cut_mid_payload_is_retried_and_nothing_leaks() {
    let _one = serial();
    let t = Instant::now();
    cases();
    let chaos = Chaos::up(&smollm2(), 2, 1, &[]);
    let router = chaos.router();
    // 150 prompt tokens of SmolLM2 KV are a few MB: 256 KiB is mid-payload.
    let (_grpc, data, proxied) = proxied_decode_worker(&chaos, &router, 2, 256 << 10).await;
    chaos.wait_ready(&router, Role::Decode, 2, Duration::from_secs(60)).await;
    let listed = chaos.listed(&router).await;
    let w = listed.iter().find(|w| w.name == proxied.name).expect("the proxied worker is listed");
    assert!(w.data_addr.starts_with("127.0.0.2:"), "its data path is advertised through the proxy: {w:?}");
    // Two rounds, so that the proxied worker surely gets transfers while the cuts are armed.
    for round in 0..2 {
        let streams = load(&chaos, &[router.clone()]).await;
        all_correct(streams, &format!("KV cut, round {round}")).await;
        if data.cuts() >= 2 {
            break;
        }
    }
    assert!(data.cuts() >= 1, "no transfer went through the proxy ({} connections)", data.connections());
    eprintln!("KV cut: {} transfers cut mid-payload, {} connections through the proxy", data.cuts(), data.connections());
    chaos.assert_pools_whole(SETTLE).await;
    eprintln!("f_a_kv_transfer_cut_mid_payload: {:.1} s", t.elapsed().as_secs_f64());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn g_with_no_decode_worker_left_requests_fail_clearly_within_seconds() {
    let _one = serial();
    let t = Instant::now();
    cases();
    // Without --no-restart, `ferry up` would bring the killed workers back and the scenario would
    // test something else: a `--help` that no longer lists it fails here, not silently.
    assert!(Chaos::up_has_flag("--no-restart"), "`ferry up --help` does not list --no-restart");
    let chaos = Chaos::up(&smollm2(), 1, 2, &["--no-restart"]);
    let router = chaos.router();
    let streams = load(&chaos, &[router.clone()]).await;
    wait_for("a streaming request", Duration::from_secs(90), || {
        let s = &streams;
        async move { s.iter().any(|s| s.seen() >= 3) }
    })
    .await;
    for w in chaos.live_workers().into_iter().filter(|w| w.role == Role::Decode) {
        chaos.kill(w.pid);
    }
    let struck = Instant::now();
    let mut failed = 0;
    for (i, s) in streams.into_iter().enumerate() {
        match s.task.await.expect("client task") {
            // Done before the kill.
            Seen::Done { ids, .. } => assert_eq!(ids, cases()[i].1, "request {i}"),
            Seen::Error { status, .. } => {
                assert!(struck.elapsed() < Duration::from_secs(15), "request {i}: the error came {:?} after the kill", struck.elapsed());
                assert_eq!(status.code(), tonic::Code::Unavailable, "request {i}: {status:?}");
                failed += 1;
            }
            other => panic!("request {i}: {other:?}"),
        }
    }
    // The positive control: the kill struck requests in flight (else every one was done first).
    assert!(failed >= 1, "the fault missed: every request was done before the decode workers were killed");
    // A new request: a clear error at once, not a wait.
    let t_new = Instant::now();
    let s = start(&chaos, &router, token_request(&cases()[0].0, MAX_TOKENS), CLIENT_TIMEOUT).await;
    match s.task.await.expect("client task") {
        Seen::Error { status, .. } => {
            assert!(t_new.elapsed() < Duration::from_secs(15), "the error took {:?}", t_new.elapsed());
            assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
            assert!(status.message().to_ascii_lowercase().contains("decode"), "names what is missing: {}", status.message());
        }
        other => panic!("a request with no decode worker left: {other:?}"),
    }
    chaos.assert_pools_whole(SETTLE).await;
    eprintln!("g_with_no_decode_worker_left: {:.1} s", t.elapsed().as_secs_f64());
}
