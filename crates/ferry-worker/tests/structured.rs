//! Structured outputs end to end: a real router and real workers in this process on the golden
//! fixture model (random weights, so unconstrained text is gibberish). A JSON schema, a regex and
//! a choice constrain the answer on both sides of the prefill -> decode hop: the prefill worker
//! masks the first token, the decode worker rebuilds the matcher from the grammar and that token
//! and masks the rest. The answers parse and validate (checked by serde_json and by hand), and a
//! disaggregated pair answers exactly what one colocated worker answers, greedy and seeded, which
//! fails if the decode worker's matcher did not take the first token. A bad grammar is refused
//! by the router before any worker sees it.

mod common;

use common::{generate_when_ready, spawn_worker, Router};
use ferry_engine::{Engine, EngineConfig};
use ferry_proto::v1::{self, generate_request, structured_output::Kind, GenerateRequest, StopConditions, StructuredOutput};
use ferry_router::RouterConfig;
use ferry_worker::Role;
use serde_json::Value;
use std::path::PathBuf;
use std::time::Duration;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden/llama-gqa")
}

fn engine() -> Engine {
    Engine::load(&fixture(), &EngineConfig { threads: 1, ..Default::default() }).expect("load the fixture model")
}

const SCHEMA: &str = r#"{"type":"object","properties":{
    "kind":{"enum":["cat","dog","bird"]},
    "age":{"type":"integer","minimum":0,"maximum":99},
    "indoor":{"type":"boolean"},
    "name":{"type":"string","maxLength":6},
    "tags":{"type":"array","items":{"enum":["a","b"]},"maxItems":3}},
    "required":["kind","age","indoor","name","tags"],"additionalProperties":false}"#;

fn request(prompt: &[u32], kind: Kind, temperature: f32, seed: u64) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::Tokens(v1::TokenInput { ids: prompt.to_vec() })),
        sampling: Some(v1::SamplingParams {
            temperature,
            seed: Some(seed),
            structured: Some(StructuredOutput { kind: Some(kind) }),
            ..Default::default()
        }),
        stop: Some(StopConditions { max_tokens: 120, ..Default::default() }),
        ..Default::default()
    }
}

fn check_json(text: &str) {
    let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let o = v.as_object().unwrap_or_else(|| panic!("not an object: {text}"));
    assert_eq!(o.len(), 5, "{text}");
    assert!(matches!(o["kind"].as_str(), Some("cat" | "dog" | "bird")), "{text}");
    assert!((0..=99).contains(&o["age"].as_i64().unwrap_or(-1)), "{text}");
    assert!(o["indoor"].is_boolean(), "{text}");
    assert!(o["name"].as_str().is_some_and(|s| s.chars().count() <= 6), "{text}");
    let tags = o["tags"].as_array().unwrap_or_else(|| panic!("{text}"));
    assert!(tags.len() <= 3 && tags.iter().all(|t| matches!(t.as_str(), Some("a" | "b"))), "{text}");
}

/// Runs every request on a router with `roles`; returns each answer's ids and finish reason.
async fn answers(roles: &[Role], reqs: &[GenerateRequest]) -> Vec<(Vec<u32>, i32)> {
    common::run_each(RouterConfig::new(fixture()), roles, engine, reqs, |addr, req| async move {
        let (ids, f) = generate_when_ready(&addr, req).await.expect("generate");
        (ids, f.finish_reason)
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn grammars_hold_across_the_prefill_decode_hop() {
    let text = Engine::load(&fixture(), &EngineConfig::default()).unwrap().tokenizer.clone();
    let prompt: Vec<u32> = (0..30u32).map(|i| (i * 11 + 5) % 300 + 3).collect();
    let mut reqs = Vec::new();
    for (t, seed) in [(0.0, 1), (1.0, 1), (1.0, 2), (0.8, 3)] {
        reqs.push(request(&prompt, Kind::JsonSchema(SCHEMA.into()), t, seed));
    }
    reqs.push(request(&prompt, Kind::JsonObject(true), 0.0, 1));
    reqs.push(request(&prompt, Kind::Regex("[0-9]{2}-(yes|no)".into()), 1.0, 4));
    reqs.push(request(&prompt, Kind::Choice(v1::Choices { choices: vec!["left".into(), "right".into()] }), 1.0, 5));

    let disagg = answers(&[Role::Prefill, Role::Decode], &reqs).await;
    let colocated = answers(&[Role::Colocated], &reqs).await;
    for (i, ((ids, finish), (ids_c, _))) in disagg.iter().zip(&colocated).enumerate() {
        let s = text.decode(ids, false).unwrap();
        assert_eq!(ids, ids_c, "request {i}: the disaggregated answer {s:?} differs from the colocated one");
        let stopped = *finish == v1::FinishReason::StopToken as i32;
        // Any JSON object lets a random model wander in a string until max_tokens; the bounded
        // grammars always finish.
        assert!(stopped || i == 4, "request {i} did not finish its grammar: {s:?}");
        match i {
            0..=3 => check_json(&s),
            4 if stopped => assert!(serde_json::from_str::<Value>(&s).is_ok_and(|v| v.is_object()), "{s:?}"),
            4 => assert!(s.starts_with('{'), "{s:?}"),
            5 => {
                let b = s.as_bytes();
                assert!(b.len() >= 5 && b[..2].iter().all(u8::is_ascii_digit) && matches!(&s[2..], "-yes" | "-no"), "{s:?}");
            }
            _ => assert!(s == "left" || s == "right", "{s:?}"),
        }
    }
    // Sampling with different seeds explored different objects (the mask does not pin them).
    assert_ne!(disagg[1].0, disagg[2].0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_bad_grammar_is_refused_by_the_router_naming_it() {
    let r = Router::start(RouterConfig { heartbeat: Duration::from_millis(100), ..RouterConfig::new(fixture()) }).await;
    let _w = spawn_worker(Role::Colocated, &r.addr, engine()).await;
    for (kind, what) in [
        (Kind::JsonSchema("{\"type\":\"frobnicate\"}".into()), "JSON schema"),
        (Kind::JsonSchema("not json".into()), "JSON schema"),
        (Kind::Regex("(a".into()), "regular expression"),
        (Kind::Lark("start: nowhere".into()), "Lark grammar"),
    ] {
        let e = generate_when_ready(&r.addr, request(&[5, 6, 7], kind, 0.0, 1)).await.expect_err("a bad grammar");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(e.message().contains("sampling.structured") && e.message().contains(what), "{e:?}");
    }
    r.stop().await;
}

/// A worker compiles under the same limits as the router, on its own large-stack pool: a hostile
/// grammar that reaches it directly (not through a router) is INVALID_ARGUMENT with a clean
/// one-line message, never a crash or a 500 carrying llguidance's state (issue 32).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refuses_hostile_grammars_cleanly() {
    use ferry_core::sampling::OutputGrammar;
    let e = engine();
    let grammars = ferry_grammar::LazyGrammars::new(e.tokenizer.clone(), Some(e.config().vocab_size));
    let mut chain = String::from("start: r1\n");
    for i in 1..1000 {
        chain += &format!("r{i}: \"x{i}\" | r{}\n", i + 1);
    }
    chain += "r1000: \"x1000\"\n";
    let valid = ferry_core::SamplingParams { grammar: Some(OutputGrammar::Regex("[0-9]+".into())), ..ferry_core::SamplingParams::greedy(4) };
    assert!(ferry_worker::pick::constraint_for(&grammars, &valid, &[5, 6, 7]).await.expect("a valid grammar compiles").is_some());
    for g in [
        OutputGrammar::Lark(chain),
        OutputGrammar::Choice((0..100_000).map(|i| format!("choice {i}")).collect()),
        OutputGrammar::Regex("a{1000}{1000}".into()),
        OutputGrammar::JsonSchema(r##"{"$ref":"#"}"##.into()),
    ] {
        let params = ferry_core::SamplingParams { grammar: Some(g.clone()), ..ferry_core::SamplingParams::greedy(4) };
        let err = ferry_worker::pick::constraint_for(&grammars, &params, &[5, 6, 7]).await.err().unwrap_or_else(|| panic!("{g:?} accepted"));
        let s = tonic::Status::from(err);
        assert_eq!(s.code(), tonic::Code::InvalidArgument, "{}", s.message());
        assert!(!s.message().contains('\n') && s.message().len() < 500, "{}", s.message());
        for bad in ["panicked", "src/", "RUST_BACKTRACE", "stack backtrace", "<state>"] {
            assert!(!s.message().contains(bad), "{bad:?} in {}", s.message());
        }
    }
}
