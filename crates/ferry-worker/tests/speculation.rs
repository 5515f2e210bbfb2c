//! Speculative decoding end to end (a real router, real workers, SmolLM2 with the serving
//! default's q8 activations): the same requests answered with speculation off, with prompt
//! lookup (`ngram`) on a colocated worker, with the suffix index on a disaggregated pair's decode
//! worker, and with a proposer that proposes only garbage, give the same ids and the same
//! logprobs — greedy, seeded sampling, `n` = 3, a grammar, stop strings; and a request resumed
//! mid-answer as a migration resends it (`token_offset`) continues the same answer. On text that
//! repeats, proposals are verified and accepted (the finals count them); garbage ones never are.

mod common;

use ferry_core::spec::SpecMode;
use ferry_engine::{Activations, Engine, EngineConfig};
use ferry_proto::v1::{self, generate_request, structured_output::Kind, GenerateFinal, GenerateRequest, StopConditions, StructuredOutput};
use ferry_router::RouterConfig;
use ferry_worker::fault::FaultInjection;
use ferry_worker::{EngineOptions, Listeners, Role, SpecConfig, WorkerConfig};
use std::path::PathBuf;
use std::time::Duration;

fn golden() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden/llama-gqa")
}

fn model() -> PathBuf {
    match std::env::var_os("FERRY_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => ferry_engine::fetch::ensure_default_model().expect("the default model: run `cargo run -p ferry -- fetch`"),
    }
}

fn engine() -> Engine {
    engine_with(Activations::Q8)
}

fn engine_with(activations: Activations) -> Engine {
    load(&model(), activations)
}

fn load(path: &std::path::Path, activations: Activations) -> Engine {
    Engine::load(path, &EngineConfig { threads: 1, activations, ..Default::default() }).expect("load the model")
}

struct Setup {
    what: &'static str,
    roles: &'static [Role],
    mode: SpecMode,
    garbage: bool,
}

type Answer = Vec<(Vec<u32>, Vec<f32>, GenerateFinal)>;

/// Every request's choices under `s` on the model at `path`: ids, logprobs of the chosen tokens,
/// final.
async fn answers(path: &std::path::Path, s: &Setup, reqs: &[GenerateRequest]) -> Vec<Answer> {
    let r = common::Router::start(RouterConfig { heartbeat: Duration::from_millis(100), ..RouterConfig::new(path) }).await;
    let spec = SpecConfig { mode: s.mode, max_tokens: 5 };
    let faults = FaultInjection { spec_garbage: s.garbage, ..Default::default() };
    let mut stops = Vec::new();
    for &role in s.roles {
        let opts = EngineOptions { spec, faults: faults.clone(), ..Default::default() };
        stops.push(common::spawn_worker_with(role, &r.addr, load(path, Activations::Q8), opts).await);
    }
    let mut out = Vec::new();
    for req in reqs {
        out.push(choices(&r.addr, req.clone()).await);
    }
    drop(stops);
    r.stop().await;
    out
}

/// One request's choices, retrying while no worker is ready.
async fn choices(router: &str, req: GenerateRequest) -> Answer {
    let n = req.sampling.as_ref().map_or(1, |s| s.n.max(1)) as usize;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut s = loop {
        let mut c = v1::ferry_client::FerryClient::connect(format!("http://{router}")).await.expect("connect");
        match c.generate(req.clone()).await {
            Err(e) if e.code() == tonic::Code::Unavailable && std::time::Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            r => break r.expect("generate").into_inner(),
        }
    };
    let mut out: Answer = (0..n).map(|_| (Vec::new(), Vec::new(), GenerateFinal::default())).collect();
    while let Some(m) = s.message().await.expect("stream") {
        match m.event {
            Some(v1::generate_response::Event::Delta(d)) => {
                let o = &mut out[d.index as usize];
                o.0.extend(d.token_ids);
                o.1.extend(d.logprobs.iter().map(|l| l.logprob));
            }
            Some(v1::generate_response::Event::Final(f)) => {
                let i = f.index as usize;
                out[i].2 = f;
            }
            _ => {}
        }
    }
    out
}

fn request(prompt: &[u32], max_tokens: u32, sampling: v1::SamplingParams, stop: Vec<String>) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::Tokens(v1::TokenInput { ids: prompt.to_vec() })),
        sampling: Some(sampling),
        stop: Some(StopConditions { max_tokens, stop, ..Default::default() }),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn speculation_changes_no_answer() {
    let e = engine();
    // Text that asks to be copied: a list, then its start again.
    let list = "apples, bread, cheese, dates, eggs, flour, grapes, honey, ice, jam, kale, lemons, milk, nuts, oats";
    let copy = e.encode(&format!("Shopping list: {list}.\nThe same list again: {list}.\nAnd once more: apples,")).unwrap();
    let chat = e.encode("Write one sentence about the sea.").unwrap();
    let greedy = |lp: u32| v1::SamplingParams { temperature: 0.0, logprobs: Some(lp), ..Default::default() };
    let seeded = |seed: u64, n: u32| v1::SamplingParams { temperature: 0.8, seed: Some(seed), n, logprobs: Some(1), ..Default::default() };
    let reqs = vec![
        request(&copy, 48, greedy(2), vec![]),
        request(&copy, 40, seeded(7, 1), vec![]),
        request(&copy, 24, seeded(11, 3), vec![]),
        request(&chat, 24, greedy(0), vec![]),
        // A stop string ends the text in the middle of the copy.
        request(&copy, 48, greedy(0), vec!["lemons".into()]),
        // A grammar: the list's items, comma-separated, as the model copies them.
        request(
            &copy,
            32,
            v1::SamplingParams { temperature: 0.0, structured: Some(StructuredOutput { kind: Some(Kind::Regex(" [a-z]+(, [a-z]+){2,12}\\.".into())) }), ..Default::default() },
            vec![],
        ),
    ];
    let off = Setup { what: "off", roles: &[Role::Colocated], mode: SpecMode::Off, garbage: false };
    let want = answers(&model(), &off, &reqs).await;

    let setups = [
        Setup { what: "ngram, colocated", roles: &[Role::Colocated], mode: SpecMode::Ngram, garbage: false },
        Setup { what: "suffix, disaggregated", roles: &[Role::Prefill, Role::Decode], mode: SpecMode::Suffix, garbage: false },
        Setup { what: "garbage proposals, colocated", roles: &[Role::Colocated], mode: SpecMode::Ngram, garbage: true },
    ];
    for s in &setups {
        let got = answers(&model(), s, &reqs).await;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.len(), w.len(), "{}: request {i}: choices", s.what);
            for (k, (gc, wc)) in g.iter().zip(w).enumerate() {
                assert_eq!(gc.0, wc.0, "{}: request {i} choice {k}: ids differ from speculation off", s.what);
                let same_lp = gc.1.iter().map(|x| x.to_bits()).eq(wc.1.iter().map(|x| x.to_bits()));
                assert!(same_lp, "{}: request {i} choice {k}: logprobs differ from speculation off", s.what);
                assert_eq!(gc.2.finish_reason, wc.2.finish_reason, "{}: request {i} choice {k}: finish", s.what);
                assert_eq!(gc.2.completion_tokens, wc.2.completion_tokens, "{}: request {i} choice {k}: completion_tokens", s.what);
                assert!(gc.2.spec_accepted_tokens <= gc.2.spec_proposed_tokens);
            }
        }
        let proposed: u32 = got.iter().flatten().map(|c| c.2.spec_proposed_tokens).sum();
        let accepted: u32 = got.iter().flatten().map(|c| c.2.spec_accepted_tokens).sum();
        eprintln!("{}: {proposed} tokens proposed, {accepted} accepted", s.what);
        assert!(proposed > 0, "{}: nothing was proposed", s.what);
        if s.garbage {
            assert!(accepted * 20 < proposed, "{}: garbage accepted {accepted} of {proposed}", s.what);
        } else {
            // The greedy copy is mostly accepted proposals.
            let copy = &got[0][0].2;
            assert!(copy.spec_accepted_tokens * 2 > copy.completion_tokens, "{}: the greedy copy accepted {} of {} tokens", s.what, copy.spec_accepted_tokens, copy.completion_tokens);
        }
    }
    for (i, w) in want.iter().enumerate() {
        assert!(w.iter().all(|c| c.2.spec_proposed_tokens == 0), "off: request {i} counted proposals");
    }
}

/// A request resumed after `offset` tokens of its answer, as the router resends one whose decode
/// worker died (the prompt and the tokens streamed so far, `token_offset` = their count), straight
/// to a colocated worker with `mode` and exact activations: its tokens.
async fn resumed(mode: SpecMode, prompt: &[u32], offset: u32, max_tokens: usize) -> Vec<u32> {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = grpc.local_addr().unwrap().to_string();
    let cfg = WorkerConfig { model: "test".into(), ..WorkerConfig::new(Role::Colocated, "resumed") };
    let spec = SpecConfig { mode, max_tokens: 5 };
    let engine = engine_with(Activations::Exact);
    let handle = ferry_worker::EngineHandle::start_with(Role::Colocated, engine, "test", EngineOptions { spec, ..Default::default() });
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let (ready, _) = tokio::sync::watch::channel(false);
    let listeners = Listeners { grpc, data: None, metrics: None, health: None };
    let task = tokio::spawn(ferry_worker::serve(cfg, handle, listeners, async move { let _ = stopped.await; }, ready));
    let params = ferry_core::SamplingParams { temperature: 0.8, seed: Some(7), token_offset: offset, ..ferry_core::SamplingParams::greedy(max_tokens) };
    let (sampling, stop_wire) = ferry_proto::sampling_to_wire(&params);
    let mut c = v1::decode_client::DecodeClient::connect(format!("http://{addr}")).await.expect("connect");
    let req = v1::DecodeRequest { request_id: "resumed".into(), prompt_tokens: prompt.len() as u32, prompt: prompt.to_vec(), sampling: Some(sampling), stop: Some(stop_wire), ..Default::default() };
    let mut s = c.decode(req).await.expect("decode").into_inner();
    let mut ids = Vec::new();
    while let Some(m) = s.message().await.expect("stream") {
        if let Some(v1::decode_response::Event::Tokens(t)) = m.event {
            ids.extend(t.ids);
        }
    }
    let _ = stop.send(());
    task.await.expect("join").expect("serve");
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resumed_request_continues_the_same_answer() {
    // Migration resends the prompt and the tokens streamed; the worker that takes it over
    // continues with the tokens the first one would have sampled, with speculation as without.
    // (Exact activations, as migration's own tests: the resumed prompt is prefilled, where the
    // first worker decoded, and only the exact path computes both within f32 rounding.)
    let e = engine();
    let list = "red, orange, yellow, green, blue, indigo, violet";
    let prompt = e.encode(&format!("Colours: {list}. Again: {list}. Again:")).unwrap();
    let whole = resumed(SpecMode::Off, &prompt, 0, 40).await;
    assert_eq!(whole.len(), 40);
    let resume = [prompt.clone(), whole[..12].to_vec()].concat();
    for mode in [SpecMode::Off, SpecMode::Ngram, SpecMode::Suffix] {
        let again = resumed(mode, &resume, 12, 28).await;
        assert_eq!(again, whole[12..], "{mode}: the resumed answer differs from the whole one");
    }
    // And the whole answer with speculation is the one without.
    for mode in [SpecMode::Ngram, SpecMode::Suffix] {
        assert_eq!(resumed(mode, &prompt, 0, 40).await, whole, "{mode}: the whole answer differs");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn speculation_changes_no_answer_on_a_golden_model() {
    // A random-weight Llama (the golden fixture, f32 weights): greedy, seeded and n = 2 answers on
    // a prompt that repeats, off against ngram (colocated) and suffix (disaggregated).
    let path = golden();
    let prompt: Vec<u32> = (0..60u32).map(|i| (i % 12) * 17 + 5).collect();
    let sampling = |temperature: f32, seed: u64, n: u32| v1::SamplingParams { temperature, seed: Some(seed), n, logprobs: Some(1), ..Default::default() };
    let reqs = vec![request(&prompt, 40, sampling(0.0, 0, 1), vec![]), request(&prompt, 40, sampling(0.9, 3, 1), vec![]), request(&prompt, 24, sampling(0.9, 5, 2), vec![])];
    let off = Setup { what: "off", roles: &[Role::Colocated], mode: SpecMode::Off, garbage: false };
    let want = answers(&path, &off, &reqs).await;
    for s in [
        Setup { what: "ngram, colocated", roles: &[Role::Colocated], mode: SpecMode::Ngram, garbage: false },
        Setup { what: "suffix, disaggregated", roles: &[Role::Prefill, Role::Decode], mode: SpecMode::Suffix, garbage: false },
        // This model's answers repeat little of the prompt: garbage proposals make every step
        // verify (and roll back) on it too.
        Setup { what: "garbage proposals, disaggregated", roles: &[Role::Prefill, Role::Decode], mode: SpecMode::Ngram, garbage: true },
    ] {
        let got = answers(&path, &s, &reqs).await;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            for (k, (gc, wc)) in g.iter().zip(w).enumerate() {
                assert_eq!(gc.0, wc.0, "{}: request {i} choice {k}: ids differ from speculation off", s.what);
                // f32 weights take the exact path, whose rows are not bit for bit those of a
                // step of other rows (tests/batching.rs): logprobs within f32 rounding.
                assert_eq!(gc.1.len(), wc.1.len());
                for (a, b) in gc.1.iter().zip(&wc.1) {
                    assert!((a - b).abs() <= 1e-4, "{}: request {i} choice {k}: logprob {a} vs {b}", s.what);
                }
            }
        }
        let proposed: u32 = got.iter().flatten().map(|c| c.2.spec_proposed_tokens).sum();
        eprintln!("{}: {proposed} tokens proposed, {} accepted", s.what, got.iter().flatten().map(|c| c.2.spec_accepted_tokens).sum::<u32>());
        assert!(proposed > 0, "{}: nothing was proposed", s.what);
    }
}

/// `count` unseeded copies of `req` (4 in flight at a time) on a colocated worker with `mode`:
/// each answer's ids, and the proposed and accepted token counts summed.
async fn unseeded_answers(mode: SpecMode, req: &GenerateRequest, count: usize) -> (Vec<Vec<u32>>, u32, u32) {
    let r = common::Router::start(RouterConfig { heartbeat: Duration::from_millis(100), ..RouterConfig::new(model()) }).await;
    let opts = EngineOptions { spec: SpecConfig { mode, max_tokens: 5 }, ..Default::default() };
    let stop = common::spawn_worker_with(Role::Colocated, &r.addr, engine(), opts).await;
    let (mut out, mut proposed, mut accepted) = (Vec::new(), 0, 0);
    for _ in 0..count / 4 {
        let batch: Vec<_> = (0..4).map(|_| tokio::spawn(choices_owned(r.addr.clone(), req.clone()))).collect();
        for t in batch {
            let mut a = t.await.expect("request task");
            let (ids, _, f) = a.remove(0);
            proposed += f.spec_proposed_tokens;
            accepted += f.spec_accepted_tokens;
            out.push(ids);
        }
    }
    drop(stop);
    r.stop().await;
    (out, proposed, accepted)
}

async fn choices_owned(router: String, req: GenerateRequest) -> Answer {
    choices(&router, req).await
}

/// Unseeded sampling keeps its distribution with speculation on: the answers (5 tokens) of 160
/// unseeded requests at temperature 1 with prompt lookup on, against 160 with it off, on a prompt whose
/// continuation the model mostly copies (so proposals are made and accepted) but not always (so
/// the answers vary). A two-sample chi-square test over the answers seen at least 8 times (the
/// rest pooled) must not reject at p = 1e-6 (Wilson-Hilferty's normal approximation, z > 4.75):
/// a verifier that accepted a proposal more (or less) often than the sampler draws it would shift
/// the copy's share, and at these counts a shift of a few points is found.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unseeded_sampling_keeps_its_distribution_with_speculation() {
    let e = engine();
    let list = "apples, bread, cheese, dates, eggs, flour, grapes, honey, ice, jam, kale, lemons, milk, nuts, oats";
    let copy = e.encode(&format!("Shopping list: {list}.\nThe same list again: {list}.\nAnd once more: apples,")).unwrap();
    let req = request(&copy, 5, v1::SamplingParams { temperature: 1.0, ..Default::default() }, vec![]);
    let (off, p0, _) = unseeded_answers(SpecMode::Off, &req, 160).await;
    let (on, proposed, accepted) = unseeded_answers(SpecMode::Ngram, &req, 160).await;
    assert_eq!(p0, 0, "off proposed");
    assert!(accepted * 4 > proposed && accepted > 60, "speculation must be exercised: {accepted} of {proposed} accepted");

    let mut counts: std::collections::BTreeMap<&[u32], (f64, f64)> = Default::default();
    for a in &off {
        counts.entry(a).or_default().0 += 1.0;
    }
    for a in &on {
        counts.entry(a).or_default().1 += 1.0;
    }
    let (mut cells, mut other) = (Vec::new(), (0.0, 0.0));
    for (_, (x, y)) in counts {
        match x + y >= 8.0 {
            true => cells.push((x, y)),
            false => other = (other.0 + x, other.1 + y),
        }
    }
    if other.0 + other.1 > 0.0 {
        cells.push(other);
    }
    assert!(cells.len() >= 3, "the answers must vary for the test to mean anything: {} cells", cells.len());
    let (n1, n2) = (off.len() as f64, on.len() as f64);
    let chi2: f64 = cells
        .iter()
        .map(|&(x, y)| {
            let (e1, e2) = ((x + y) * n1 / (n1 + n2), (x + y) * n2 / (n1 + n2));
            (x - e1).powi(2) / e1 + (y - e2).powi(2) / e2
        })
        .sum();
    let k = (cells.len() - 1) as f64;
    let z = ((chi2 / k).cbrt() - (1.0 - 2.0 / (9.0 * k))) / (2.0 / (9.0 * k)).sqrt();
    eprintln!("{} cells, chi2 {chi2:.2} on {k} degrees of freedom (z {z:.2}); {accepted} of {proposed} proposed tokens accepted", cells.len());
    assert!(z < 4.75, "speculation changed the unseeded distribution: chi2 {chi2:.2} on {k} df (z {z:.2}), cells {cells:?}");
}
