//! `n` > 1 end to end: a real router and real workers in this process on the golden fixture
//! model. One request for three sampled choices is one prefill whose KV the decode worker runs as
//! three sequences (forks sharing the prompt's full blocks, each with its own copy of the last
//! partial block). Each choice answers exactly what a one-choice request with seed + i answers,
//! a disaggregated pair answers exactly what a colocated worker answers, greedy choices are all
//! alike, structured outputs hold in every choice, and each choice's final counts its tokens.

mod common;

use common::generate_choices;
use ferry_engine::{Engine, EngineConfig};
use ferry_proto::v1::{self, generate_request, structured_output::Kind, GenerateFinal, GenerateRequest, StopConditions, StructuredOutput};
use ferry_router::RouterConfig;
use ferry_worker::Role;
use std::path::PathBuf;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/golden/llama-gqa")
}

fn engine() -> Engine {
    Engine::load(&fixture(), &EngineConfig { threads: 1, ..Default::default() }).expect("load the fixture model")
}

fn request(prompt: &[u32], n: u32, temperature: f32, seed: u64, grammar: Option<Kind>) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::Tokens(v1::TokenInput { ids: prompt.to_vec() })),
        sampling: Some(v1::SamplingParams {
            temperature,
            seed: Some(seed),
            n,
            logprobs: Some(1),
            structured: grammar.map(|k| StructuredOutput { kind: Some(k) }),
            ..Default::default()
        }),
        stop: Some(StopConditions { max_tokens: 24, ..Default::default() }),
        ..Default::default()
    }
}

type Choices = Vec<(Vec<u32>, GenerateFinal)>;

async fn answers(roles: &[Role], reqs: &[GenerateRequest]) -> Vec<Choices> {
    common::run_each(RouterConfig::new(fixture()), roles, engine, reqs, |addr, req| async move {
        generate_choices(&addr, req).await.expect("generate")
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_choice_is_its_own_seeded_request_on_shared_prompt_blocks() {
    // 30 tokens: one full block of 16 shared, the partial one copied per choice.
    let prompt: Vec<u32> = (0..30u32).map(|i| (i * 13 + 7) % 300 + 3).collect();
    let json = || Some(Kind::Regex("[a-z]{2,5}-[0-9]{1,3}".into()));
    let reqs = vec![
        request(&prompt, 3, 1.0, 11, None),
        request(&prompt, 1, 1.0, 11, None),
        request(&prompt, 1, 1.0, 12, None),
        request(&prompt, 1, 1.0, 13, None),
        request(&prompt, 2, 0.0, 1, None),
        request(&prompt, 3, 1.0, 5, json()),
        request(&prompt, 1, 1.0, 7, json()),
    ];
    let disagg = answers(&[Role::Prefill, Role::Decode], &reqs).await;
    let colocated = answers(&[Role::Colocated], &reqs).await;
    for (i, (d, c)) in disagg.iter().zip(&colocated).enumerate() {
        let n = reqs[i].sampling.as_ref().unwrap().n as usize;
        assert_eq!(d.len(), n, "request {i}: one answer per choice");
        for (k, ((ids, fin), (ids_c, _))) in d.iter().zip(c).enumerate() {
            assert_eq!(ids, ids_c, "request {i} choice {k}: the disaggregated answer differs from the colocated one");
            assert_eq!(fin.index as usize, k);
            assert_eq!(fin.completion_tokens as usize, ids.len(), "request {i} choice {k}: completion_tokens");
            assert_eq!(fin.prompt_tokens as usize, prompt.len());
        }
    }
    // Choice i of a three-choice request is the one-choice request with seed 11 + i.
    for k in 0..3 {
        assert_eq!(disagg[0][k].0, disagg[1 + k][0].0, "choice {k} is not the request with seed {}", 11 + k);
    }
    assert!(disagg[0][0].0 != disagg[0][1].0 || disagg[0][1].0 != disagg[0][2].0, "three sampled choices all alike");
    // Greedy choices are alike.
    assert_eq!(disagg[4][0].0, disagg[4][1].0);
    // Structured outputs hold in each choice (each with its own matcher), and choice 2 is seed 7's.
    let text = Engine::load(&fixture(), &EngineConfig::default()).unwrap().tokenizer.clone();
    for (ids, fin) in &disagg[5] {
        let s = text.decode(ids, false).unwrap();
        let (word, num) = s.split_once('-').unwrap_or_else(|| panic!("{s:?}"));
        assert!((2..=5).contains(&word.len()) && word.bytes().all(|b| b.is_ascii_lowercase()), "{s:?}");
        assert!((1..=3).contains(&num.len()) && num.bytes().all(|b| b.is_ascii_digit()), "{s:?}");
        assert_eq!(fin.finish_reason, v1::FinishReason::StopToken as i32, "{s:?}");
    }
    assert_eq!(disagg[5][2].0, disagg[6][0].0);
}
