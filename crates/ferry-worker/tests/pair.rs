//! A prefill and a decode worker in this process, on loopback, driven the way the router drives
//! them: the output must equal the single-process engine's, token for token, over both KV
//! transports; bad KV is refused with the right status while the worker keeps serving; and no
//! path leaks KV blocks.

use ferry_core::SamplingParams;
use ferry_engine::{Engine, EngineConfig};
use ferry_proto::v1::decode_client::DecodeClient;
use ferry_proto::v1::kv_transfer_client::KvTransferClient;
use ferry_proto::v1::prefill_client::PrefillClient;
use ferry_proto::v1::{decode_response, kv_chunk, DecodeRequest, KvBegin, KvChunk, KvData, KvEnd, KvTarget, KvTransferStats, KvTransport as Kind, PrefillRequest};
use ferry_worker::kv::device::Pipes;
use ferry_worker::kv::in_process::InProcessConnector;
use ferry_worker::load::LoadGauge;
use ferry_worker::{Listeners, Role, TransportChoice, WorkerConfig};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::Channel;

fn golden(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden").join(name)
}

fn engine(path: &Path, kv_tokens: Option<usize>) -> Engine {
    Engine::load(path, &EngineConfig { threads: 1, kv_tokens, ..Default::default() }).expect("load model")
}

struct Worker {
    addr: String,
    /// The TCP data listener's address (decode workers).
    data_addr: String,
    load: Arc<LoadGauge>,
    _shutdown: tokio::sync::oneshot::Sender<()>,
}

async fn start(role: Role, path: &Path, kv_tokens: Option<usize>, transport: TransportChoice) -> Worker {
    start_with(role, path, kv_tokens, transport, None).await
}

/// A worker with device-to-device pipes (the in-process stand-in for NCCL).
async fn start_with(role: Role, path: &Path, kv_tokens: Option<usize>, transport: TransportChoice, pipes: Option<Arc<InProcessConnector>>) -> Worker {
    start_custom(role, path, kv_tokens, |c| {
        c.transport = transport;
        c.pipes = pipes.map(|c| Pipes(c));
    })
    .await
}

/// A worker with its config edited by `edit`.
async fn start_custom(role: Role, path: &Path, kv_tokens: Option<usize>, edit: impl FnOnce(&mut WorkerConfig)) -> Worker {
    start_engine(role, engine(path, kv_tokens), edit).await
}

/// A worker serving `engine`.
async fn start_engine(role: Role, engine: Engine, edit: impl FnOnce(&mut WorkerConfig)) -> Worker {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let data = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = grpc.local_addr().unwrap().to_string();
    let data_addr = data.local_addr().unwrap().to_string();
    let mut cfg = WorkerConfig {
        model: "test".into(),
        kv_timeout: Duration::from_secs(5),
        drain_timeout: Duration::from_secs(5),
        ..WorkerConfig::new(role, format!("{role:?}"))
    };
    edit(&mut cfg);
    let engine = ferry_worker::EngineHandle::start(role, engine, "test", None);
    let load = engine.load();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let (ready, _) = tokio::sync::watch::channel(false);
    let listeners = Listeners { grpc, data: (role == Role::Decode).then_some(data), metrics: None, health: None };
    tokio::spawn(async move {
        ferry_worker::serve(cfg, engine, listeners, async move { let _ = rx.await; }, ready).await.expect("worker");
    });
    Worker { addr, data_addr, load, _shutdown: tx }
}

async fn channel(addr: &str) -> Channel {
    Channel::from_shared(format!("http://{addr}")).unwrap().connect().await.unwrap()
}

/// Run one request through the pair; returns all generated ids (first included).
async fn generate(p: &Worker, d: &Worker, prompt: &[u32], params: &SamplingParams) -> Result<Vec<u32>, tonic::Status> {
    generate_via(p, d, prompt, params, Kind::Unspecified).await.map(|(ids, _)| ids)
}

/// The same, with the router's choice of KV transport for the pair; also returns what the
/// prefill worker reported about the transfer.
async fn generate_via(p: &Worker, d: &Worker, prompt: &[u32], params: &SamplingParams, transport: Kind) -> Result<(Vec<u32>, KvTransferStats), tonic::Status> {
    let (sampling, stop) = ferry_proto::sampling_to_wire(params);
    let mut dec = DecodeClient::new(channel(&d.addr).await);
    let token = mint();
    let req = DecodeRequest { request_id: "t".into(), prompt_tokens: prompt.len() as u32, sampling: Some(sampling.clone()), stop: Some(stop.clone()), kv_timeout_ms: 0, prompt: vec![], transfer_token: token.clone(), prompt_ids: prompt.to_vec(), ..Default::default() };
    let mut stream = dec.decode(req).await?.into_inner();
    let Some(decode_response::Event::Admitted(adm)) = stream.message().await?.and_then(|m| m.event) else { panic!("admitted first") };
    let target = KvTarget {
        decode_worker: "d".into(),
        grpc_addr: d.addr.clone(),
        data_addr: adm.data_addr.clone(),
        transfer_id: adm.transfer_id,
        transfer_token: token,
        transport: transport as i32,
        // The decode worker holds the prompt's cached full blocks (it was sent the prompt's ids):
        // ship the rest, as the router does.
        start_block: adm.cached_tokens / ferry_engine::EngineConfig::default().block_size as u32,
        ..Default::default()
    };
    let mut pre = PrefillClient::new(channel(&p.addr).await);
    let r = pre
        .prefill(PrefillRequest { request_id: "t".into(), prompt: prompt.to_vec(), sampling: Some(sampling), stop: Some(stop), target: Some(target), ..Default::default() })
        .await?
        .into_inner();
    let mut ids = if r.first_is_stop { vec![] } else { vec![r.first_token] };
    while let Some(m) = stream.message().await? {
        match m.event {
            Some(decode_response::Event::Tokens(t)) => ids.extend(t.ids),
            Some(decode_response::Event::Final(f)) => {
                assert_eq!(f.completion_tokens as usize, ids.len());
                return Ok((ids, r.kv.unwrap_or_default()));
            }
            _ => panic!("unexpected event"),
        }
    }
    panic!("stream ended without final")
}

fn prompt_ids(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 7 + 3) % 200 + 1).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn disaggregated_output_equals_single_process_over_both_transports() {
    let path = golden("llama-gqa");
    let mut single = engine(&path, None);
    let greedy = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(12) };
    let seeded = SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(42), ignore_eos: true, ..SamplingParams::greedy(12) };
    // vLLM's processors read the sequence so far: the decode worker must count the first token,
    // sampled on the prefill worker, as output.
    let penalized = SamplingParams {
        repetition_penalty: 1.4,
        frequency_penalty: 0.8,
        presence_penalty: 0.4,
        logit_bias: vec![(9, 2.0)],
        bad_words: vec!["the".into()],
        min_tokens: 10,
        ..SamplingParams::greedy(12)
    };
    let penalized_sample = SamplingParams { temperature: 0.9, min_p: 0.05, seed: Some(5), ..penalized.clone() };
    for transport in [TransportChoice::Tcp, TransportChoice::Grpc] {
        let p = start(Role::Prefill, &path, None, transport).await;
        let d = start(Role::Decode, &path, None, transport).await;
        for (len, params) in [(5, &greedy), (37, &greedy), (19, &seeded), (23, &penalized), (23, &penalized_sample)] {
            let prompt = prompt_ids(len);
            let want = single.generate(&prompt, params, &mut |_| {}).unwrap().tokens;
            let got = generate(&p, &d, &prompt, params).await.unwrap();
            assert_eq!(got, want, "{transport:?}, prompt of {len}");
        }
        // Every block came back on both workers.
        p.assert_pool_whole().await;
        d.assert_pool_whole().await;
    }
}

/// Workers whose KV caches store other types pair: the payload ships as the prefill worker
/// stores it and the decode worker converts on import. The output is, token for token, what one
/// process computes the same way (prefill on a cache of the first type, KV exported, imported
/// into a cache of the second, greedy decoding there); with one type on both sides, what a
/// single engine of that type generates.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_with_different_kv_dtypes_pair_and_convert_on_import() {
    use ferry_core::KvDtype;
    use ferry_engine::sampler::argmax;
    let path = golden("llama-gqa");
    let with = |dtype| Engine::load(&path, &EngineConfig { threads: 1, kv_dtype: dtype, ..Default::default() }).expect("load model");
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(10) };
    let prompt = prompt_ids(37);
    for (pd, dd) in [(KvDtype::Int8, KvDtype::Int8), (KvDtype::Int8, KvDtype::F32), (KvDtype::F32, KvDtype::BF16)] {
        let want = if pd == dd {
            with(pd).generate(&prompt, &params, &mut |_| {}).unwrap().tokens
        } else {
            let (mut pe, mut de) = (with(pd), with(dd));
            let seq = pe.new_sequence();
            let mut ids = vec![argmax(&pe.prefill(seq, &prompt).unwrap())];
            let s = de.import_kv(&pe.export_kv(seq).unwrap()).unwrap();
            while ids.len() < 10 {
                ids.push(argmax(&de.prefill(s, &ids[ids.len() - 1..]).unwrap()));
            }
            ids
        };
        let p = start_engine(Role::Prefill, with(pd), |c| c.transport = TransportChoice::Tcp).await;
        let d = start_engine(Role::Decode, with(dd), |c| c.transport = TransportChoice::Tcp).await;
        let got = generate(&p, &d, &prompt, &params).await.unwrap();
        assert_eq!(got, want, "prefill {pd} -> decode {dd}");
        p.assert_pool_whole().await;
        d.assert_pool_whole().await;
    }
}

impl Worker {
    /// Wait (bounded) until the engine thread has published a pool with every block free: a
    /// release happens on the engine thread shortly after the stream that caused it ends.
    async fn assert_pool_whole(&self) {
        for _ in 0..400 {
            let (free, total) = (self.load.blocks_free.load(Relaxed), self.load.blocks_total.load(Relaxed));
            if free == total && self.load.blocks_committed.load(Relaxed) == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!(
            "KV leaked: {} of {} blocks free, {} committed",
            self.load.blocks_free.load(Relaxed),
            self.load.blocks_total.load(Relaxed),
            self.load.blocks_committed.load(Relaxed)
        );
    }
}

/// A transfer token as the router mints them (tests play the router).
fn mint() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// Admit a request on the decode worker and return its stream and transfer (id, token).
async fn admit(d: &Worker, prompt_tokens: u32, max_tokens: u32) -> Result<(tonic::Streaming<ferry_proto::v1::DecodeResponse>, u64, String), tonic::Status> {
    admit_with(d, prompt_tokens, max_tokens, mint()).await
}

async fn admit_with(d: &Worker, prompt_tokens: u32, max_tokens: u32, token: String) -> Result<(tonic::Streaming<ferry_proto::v1::DecodeResponse>, u64, String), tonic::Status> {
    let mut dec = DecodeClient::new(channel(&d.addr).await);
    let stop = ferry_proto::v1::StopConditions { max_tokens, ignore_eos: true, ..Default::default() };
    let req = DecodeRequest { request_id: "bad".into(), prompt_tokens, sampling: None, stop: Some(stop), kv_timeout_ms: 0, prompt: vec![], transfer_token: token.clone(), ..Default::default() };
    let mut stream = dec.decode(req).await?.into_inner();
    let Some(decode_response::Event::Admitted(a)) = stream.message().await?.and_then(|m| m.event) else { panic!("admitted first") };
    Ok((stream, a.transfer_id, token))
}

async fn push(d: &Worker, chunks: Vec<KvChunk>) -> Result<ferry_proto::v1::KvAck, tonic::Status> {
    let mut kv = KvTransferClient::new(channel(&d.addr).await);
    kv.push_kv(tokio_stream::iter(chunks)).await.map(|r| r.into_inner())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_kv_is_refused_and_the_worker_keeps_serving() {
    let path = golden("llama-gqa");
    let reference = engine(&path, None);
    let (layout, fingerprint) = (reference.kv_layout(), reference.fingerprint.clone());
    let p = start(Role::Prefill, &path, None, TransportChoice::Grpc).await;
    let d = start(Role::Decode, &path, None, TransportChoice::Grpc).await;
    let tokens = 6usize;
    let header = ferry_core::KvPayloadHeader { layout, tokens }.encode().to_vec();
    let body = vec![0u8; ferry_core::KvPayloadHeader { layout, tokens }.body_bytes()];
    let begin = |id: u64, token: &str, fp: &str, header: &[u8]| KvChunk {
        transfer_id: id,
        part: Some(kv_chunk::Part::Begin(KvBegin { transfer_token: token.into(), fingerprint: fp.into(), header: header.to_vec().into(), request_id: "bad".into(), ..Default::default() })),
    };
    let data = |id: u64, bytes: &[u8], crc: u32| KvChunk {
        transfer_id: id,
        part: Some(kv_chunk::Part::Data(KvData { offset: 0, data: bytes.to_vec().into(), crc32: crc })),
    };
    let end = |id: u64| KvChunk { transfer_id: id, part: Some(kv_chunk::Part::End(KvEnd { first_token: 1, chunks: 1, ..Default::default() })) };

    // Bad checksum: DATA_LOSS, and the admitted request fails with it too.
    let (mut stream, id, token) = admit(&d, tokens as u32, 4).await.unwrap();
    let err = push(&d, vec![begin(id, &token, &fingerprint, &header), data(id, &body, 0xdead_beef), end(id)]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::DataLoss, "{err:?}");
    assert!(err.message().contains("CRC"), "{}", err.message());
    assert_eq!(stream.message().await.unwrap_err().code(), tonic::Code::DataLoss);

    // Wrong model fingerprint: FAILED_PRECONDITION.
    let (_s, id, token) = admit(&d, tokens as u32, 4).await.unwrap();
    let err = push(&d, vec![begin(id, &token, "0123", &header)]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    assert!(err.message().contains("fingerprint"), "{}", err.message());

    // Wrong size (header for more tokens than admitted): DATA_LOSS naming both.
    let (_s, id, token) = admit(&d, tokens as u32, 4).await.unwrap();
    let big = ferry_core::KvPayloadHeader { layout, tokens: tokens + 1 }.encode().to_vec();
    let err = push(&d, vec![begin(id, &token, &fingerprint, &big)]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::DataLoss, "{err:?}");

    // A short body (the right checksum, too few bytes) is refused at `end`.
    let (_s, id, token) = admit(&d, tokens as u32, 4).await.unwrap();
    let half = &body[..body.len() / 2];
    let err = push(&d, vec![begin(id, &token, &fingerprint, &header), data(id, half, crc32fast::hash(half)), end(id)]).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::DataLoss, "{err:?}");

    // Without the router's token (or with a short one) nothing is admitted or reserved.
    for weak in ["", "0123456789abcde"] {
        let err = admit_with(&d, tokens as u32, 4, weak.into()).await.unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
        assert!(err.message().contains("transfer_token"), "{}", err.message());
    }
    d.assert_pool_whole().await;

    // Wrong transfer token (another request's, of the same length, or junk), and an unknown transfer.
    let (_s, id, _) = admit(&d, tokens as u32, 4).await.unwrap();
    assert_eq!(push(&d, vec![begin(id, &mint(), &fingerprint, &header)]).await.unwrap_err().code(), tonic::Code::PermissionDenied);
    assert_eq!(push(&d, vec![begin(id, "nope", &fingerprint, &header)]).await.unwrap_err().code(), tonic::Code::PermissionDenied);
    assert_eq!(push(&d, vec![begin(9_999, "x", &fingerprint, &header)]).await.unwrap_err().code(), tonic::Code::NotFound);
    drop(_s);

    // A valid payload pushed by hand is accepted and generation runs.
    let (mut stream, id, token) = admit(&d, tokens as u32, 3).await.unwrap();
    let ack = push(&d, vec![begin(id, &token, &fingerprint, &header), data(id, &body, crc32fast::hash(&body)), end(id)]).await.unwrap();
    assert_eq!(ack.bytes as usize, header.len() + body.len());
    let mut n = 0;
    while let Some(m) = stream.message().await.unwrap() {
        if let Some(decode_response::Event::Final(f)) = m.event {
            assert_eq!(f.completion_tokens, 3);
            n += 1;
        }
    }
    assert_eq!(n, 1);

    // And the pair still serves real requests.
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(5) };
    let prompt = prompt_ids(9);
    let want = reference_generate(&path, &prompt, &params);
    assert_eq!(generate(&p, &d, &prompt, &params).await.unwrap(), want);
    p.assert_pool_whole().await;
    d.assert_pool_whole().await;
}

fn reference_generate(path: &Path, prompt: &[u32], params: &SamplingParams) -> Vec<u32> {
    engine(path, None).generate(prompt, params, &mut |_| {}).unwrap().tokens
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn admission_is_refused_when_the_cache_cannot_hold_the_request() {
    let path = golden("llama-gqa");
    // 64 tokens of KV = 4 blocks of 16.
    let d = start(Role::Decode, &path, Some(64), TransportChoice::Tcp).await;
    let (_held, _, _) = admit(&d, 20, 20).await.unwrap(); // 40 tokens: 3 blocks promised
    let err = admit(&d, 20, 20).await.unwrap_err();
    assert_eq!(err.code(), tonic::Code::ResourceExhausted, "{err:?}");
    assert!(err.message().contains("KV blocks"), "{}", err.message());
    drop(_held);
    // The reservation comes back when the stream is dropped.
    d.assert_pool_whole().await;
    admit(&d, 20, 20).await.unwrap();
    // Bad requests are refused before anything is reserved.
    assert_eq!(admit(&d, 0, 4).await.unwrap_err().code(), tonic::Code::InvalidArgument);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancelling_mid_stream_frees_the_kv_on_both_workers() {
    let path = golden("llama-gqa");
    let p = start(Role::Prefill, &path, None, TransportChoice::Tcp).await;
    let d = start(Role::Decode, &path, None, TransportChoice::Tcp).await;
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(10_000) };
    let (sampling, stop) = ferry_proto::sampling_to_wire(&params);
    let mut dec = DecodeClient::new(channel(&d.addr).await);
    let token = mint();
    let req = DecodeRequest { request_id: "c".into(), prompt_tokens: 30, sampling: Some(sampling.clone()), stop: Some(stop.clone()), kv_timeout_ms: 0, prompt: vec![], transfer_token: token.clone(), ..Default::default() };
    let mut stream = dec.decode(req).await.unwrap().into_inner();
    let Some(decode_response::Event::Admitted(adm)) = stream.message().await.unwrap().and_then(|m| m.event) else { panic!() };
    let target = KvTarget { decode_worker: "d".into(), grpc_addr: d.addr.clone(), data_addr: adm.data_addr, transfer_id: adm.transfer_id, transfer_token: token, transport: 0, ..Default::default() };
    let mut pre = PrefillClient::new(channel(&p.addr).await);
    pre.prefill(PrefillRequest { request_id: "c".into(), prompt: prompt_ids(30), sampling: Some(sampling), stop: Some(stop), target: Some(target), ..Default::default() })
        .await
        .unwrap();
    // A few tokens, then the client goes away.
    for _ in 0..3 {
        stream.message().await.unwrap().unwrap();
    }
    assert!(d.load.active_sequences.load(Relaxed) <= 1);
    drop(stream);
    p.assert_pool_whole().await;
    d.assert_pool_whole().await;

    // A request whose KV never comes is dropped at the timeout, and its reservation returns.
    let mut dec = DecodeClient::new(channel(&d.addr).await);
    let req = DecodeRequest { request_id: "late".into(), prompt_tokens: 8, sampling: None, stop: None, kv_timeout_ms: 100, prompt: vec![], transfer_token: mint(), ..Default::default() };
    let mut stream = dec.decode(req).await.unwrap().into_inner();
    stream.message().await.unwrap();
    assert_eq!(stream.message().await.unwrap_err().code(), tonic::Code::DeadlineExceeded);
    d.assert_pool_whole().await;
}

/// KV over device-to-device pipes (NCCL's contract, in process): the output equals the single
/// engine's, concurrent transfers to one decode worker each get a pipe, pipes are reused, and
/// no block leaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kv_over_pipes_equals_single_process() {
    let path = golden("llama-gqa");
    let mut single = engine(&path, None);
    let pipes = InProcessConnector::new();
    let p = start_with(Role::Prefill, &path, None, TransportChoice::Nccl, Some(pipes.clone())).await;
    let d = start_with(Role::Decode, &path, None, TransportChoice::Nccl, Some(pipes.clone())).await;
    let greedy = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(12) };
    let seeded = SamplingParams { temperature: 0.9, top_p: 0.95, seed: Some(7), ignore_eos: true, ..SamplingParams::greedy(12) };
    for (len, params) in [(5, &greedy), (37, &greedy), (19, &seeded), (80, &greedy)] {
        let prompt = prompt_ids(len);
        let want = single.generate(&prompt, params, &mut |_| {}).unwrap().tokens;
        // The router's choice, and the worker's own preference (unspecified): both NCCL.
        for via in [Kind::Nccl, Kind::Unspecified] {
            let sent_before = pipes.buffer_sends();
            let (got, kv) = generate_via(&p, &d, &prompt, params, via).await.unwrap();
            assert_eq!(got, want, "prompt of {len}");
            assert_eq!(kv.transport, Kind::Nccl as i32, "{kv:?}");
            assert!(kv.bytes > 0 && kv.chunks > 0, "{kv:?}");
            // Every chunk left as a layer buffer (on a GPU: device to device), none as host data.
            assert_eq!(pipes.buffer_sends() - sent_before, kv.chunks as usize, "{kv:?}");
        }
    }
    // Concurrent requests to the same decode worker.
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt_ids(10 + 9 * i)).collect();
    let wants: Vec<Vec<u32>> = prompts.iter().map(|pr| single.generate(pr, &greedy, &mut |_| {}).unwrap().tokens).collect();
    let (a, b, c, e) = tokio::join!(
        generate_via(&p, &d, &prompts[0], &greedy, Kind::Nccl),
        generate_via(&p, &d, &prompts[1], &greedy, Kind::Nccl),
        generate_via(&p, &d, &prompts[2], &greedy, Kind::Nccl),
        generate_via(&p, &d, &prompts[3], &greedy, Kind::Nccl),
    );
    for (r, want) in [a, b, c, e].into_iter().zip(wants) {
        let (got, kv) = r.unwrap();
        assert_eq!(got, want);
        assert_eq!(kv.transport, Kind::Nccl as i32);
    }
    // A link that corrupts the layers: the decode worker's checksum refuses the transfer, the
    // request fails saying so, nothing leaks, and the pipe (still in step) serves the next one.
    pipes.corrupt_buffers.store(true, Relaxed);
    let err = generate_via(&p, &d, &prompts[0], &greedy, Kind::Nccl).await.unwrap_err();
    assert!(err.message().contains("checksum"), "{err:?}");
    pipes.corrupt_buffers.store(false, Relaxed);
    let (got, kv) = generate_via(&p, &d, &prompts[0], &greedy, Kind::Nccl).await.unwrap();
    assert_eq!((got, kv.transport), (single.generate(&prompts[0], &greedy, &mut |_| {}).unwrap().tokens, Kind::Nccl as i32));
    p.assert_pool_whole().await;
    d.assert_pool_whole().await;
}

/// When the pair cannot set NCCL up, the prefill worker falls back to the host path and says so;
/// a pipe that fails mid-transfer fails that request without leaking, and the pair backs off.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nccl_falls_back_and_failures_leak_nothing() {
    let path = golden("llama-gqa");
    let single = |prompt: &[u32], params: &SamplingParams| reference_generate(&path, prompt, params);
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(6) };
    let prompt = prompt_ids(21);
    let want = single(&prompt, &params);

    // The decode worker has no NCCL: its rendezvous answers UNAVAILABLE; TCP is used.
    let pipes = InProcessConnector::new();
    pipes.set_connect_timeout(Duration::from_millis(300));
    let p = start_with(Role::Prefill, &path, None, TransportChoice::Nccl, Some(pipes.clone())).await;
    let d_host = start(Role::Decode, &path, None, TransportChoice::Tcp).await;
    let (got, kv) = generate_via(&p, &d_host, &prompt, &params, Kind::Nccl).await.unwrap();
    assert_eq!(got, want);
    assert_eq!(kv.transport, Kind::Tcp as i32, "fell back to the TCP data path: {kv:?}");

    // The peer never joins the communicator: the rendezvous times out, the transfer falls back,
    // and while the pair backs off the next one does not wait for another timeout.
    let d = start_with(Role::Decode, &path, None, TransportChoice::Nccl, Some(pipes.clone())).await;
    pipes.refuse_join.store(true, Relaxed);
    let t = std::time::Instant::now();
    let (got, kv) = generate_via(&p, &d, &prompt, &params, Kind::Nccl).await.unwrap();
    assert_eq!((got, kv.transport), (want.clone(), Kind::Tcp as i32));
    assert!(t.elapsed() >= Duration::from_millis(300), "waited for the rendezvous");
    let t = std::time::Instant::now();
    let (got, kv) = generate_via(&p, &d, &prompt, &params, Kind::Nccl).await.unwrap();
    assert_eq!((got, kv.transport), (want.clone(), Kind::Tcp as i32));
    assert!(t.elapsed() < Duration::from_millis(300), "backing off, not waiting again: {:?}", t.elapsed());
    p.assert_pool_whole().await;
    d.assert_pool_whole().await;

    // A pipe that breaks mid-transfer: that request fails (the router would retry it), with
    // nothing leaked on either side.
    pipes.refuse_join.store(false, Relaxed);
    let p2 = start_with(Role::Prefill, &path, None, TransportChoice::Nccl, Some(pipes.clone())).await;
    *pipes.fail_after_sends.lock().unwrap() = Some(4);
    let long = prompt_ids(70);
    let err = generate_via(&p2, &d, &long, &params, Kind::Nccl).await.unwrap_err();
    assert!(matches!(err.code(), tonic::Code::Aborted | tonic::Code::Unavailable), "{err:?}");
    assert!(err.message().contains("nccl pipe"), "{}", err.message());
    p2.assert_pool_whole().await;
    d.assert_pool_whole().await;
}

/// A peer that stops making progress mid-transfer (frozen, not disconnected) fails the transfer
/// after the stall timeout, on either side, and nothing it held stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stalled_peer_fails_the_transfer_and_frees_everything() {
    use tokio::io::AsyncWriteExt;
    let path = golden("llama-gqa");
    let stall = Duration::from_millis(300);

    // Prefill side: the decode worker's data address accepts the connection and then reads
    // nothing and never replies. The prefill fails (ABORTED, naming the stall), and its blocks
    // come back, long before the decode side's 5 s KV timeout would have mattered.
    let p = start_custom(Role::Prefill, &path, None, |c| c.kv_stall_timeout = stall).await;
    let frozen = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let frozen_addr = frozen.local_addr().unwrap().to_string();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = frozen.accept().await {
            held.push(sock);
        }
    });
    let target = KvTarget { decode_worker: "frozen".into(), grpc_addr: frozen_addr.clone(), data_addr: frozen_addr, transfer_id: 1, transfer_token: mint(), transport: Kind::Tcp as i32, ..Default::default() };
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(4) };
    let (sampling, stop) = ferry_proto::sampling_to_wire(&params);
    let mut pre = PrefillClient::new(channel(&p.addr).await);
    let t = std::time::Instant::now();
    let err = pre
        .prefill(PrefillRequest { request_id: "s".into(), prompt: prompt_ids(20), sampling: Some(sampling), stop: Some(stop), target: Some(target), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::Aborted, "{err:?}");
    assert!(err.message().contains("stalled"), "{}", err.message());
    assert!(t.elapsed() < Duration::from_secs(4), "{:?}", t.elapsed());
    p.assert_pool_whole().await;
    hold.abort();

    // Decode side: a sender that opens the transfer and then sends nothing more. The admitted
    // request fails after the stall timeout (not the 5 s KV timeout) and its reservation returns.
    let d = start_custom(Role::Decode, &path, None, |c| c.kv_stall_timeout = stall).await;
    let reference = engine(&path, None);
    let tokens = 6usize;
    let (mut stream, id, token) = admit(&d, tokens as u32, 4).await.unwrap();
    let mut sock = tokio::net::TcpStream::connect(&d.data_addr).await.unwrap();
    let header = ferry_core::KvPayloadHeader { layout: reference.kv_layout(), tokens }.encode().to_vec();
    let begin = KvChunk {
        transfer_id: id,
        part: Some(kv_chunk::Part::Begin(KvBegin { transfer_token: token, fingerprint: reference.fingerprint.clone(), header: header.into(), request_id: "s".into(), ..Default::default() })),
    };
    // The connection's first frame is the hello (the cluster is open here: an empty secret).
    let hello = ferry_worker::kv::frame::FrameHeader::control(ferry_worker::kv::frame::Kind::Hello, 0).encode();
    sock.write_all(&hello).await.unwrap();
    sock.write_all(&ferry_worker::kv::frame::message(ferry_worker::kv::frame::Kind::Begin, &begin)).await.unwrap();
    sock.flush().await.unwrap();
    let t = std::time::Instant::now();
    let err = loop {
        match stream.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended without an error"),
            Err(e) => break e,
        }
    };
    assert!(t.elapsed() < Duration::from_secs(4), "failed at the stall timeout, not the KV timeout: {:?}", t.elapsed());
    assert!(err.message().contains("stalled"), "{err:?}");
    drop(sock);
    d.assert_pool_whole().await;
}
