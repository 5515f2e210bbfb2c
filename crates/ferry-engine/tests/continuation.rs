//! A generation continued elsewhere equals the uninterrupted one: N tokens generated at once are,
//! token for token, the first k followed by a fresh generation from prompt + those k tokens with
//! `token_offset` k and `max_tokens` N - k (what the router sends when it migrates a request).
//! Seeded sampling and greedy, on the golden fixture models.

mod common;
use common::*;
use ferry_core::SamplingParams;
use ferry_engine::FinishReason;

fn prompt() -> Vec<u32> {
    (0..23u32).map(|i| (i * 11 + 5) % 190 + 1).collect()
}

fn check(model: &str, params: &SamplingParams, n: usize) {
    let mut e = engine(&golden_dir(model));
    let prompt = prompt();
    let whole = e.generate(&prompt, &SamplingParams { max_tokens: n, ..params.clone() }, &mut |_| {}).expect("generate");
    assert_eq!(whole.tokens.len(), n, "{model}: ignore_eos runs to max_tokens");
    assert_eq!(whole.finish, FinishReason::Length);
    for k in [1, 5, n - 1] {
        let mut moved = prompt.clone();
        moved.extend_from_slice(&whole.tokens[..k]);
        let rest = SamplingParams { max_tokens: n - k, token_offset: k as u32, ..params.clone() };
        let cont = e.generate(&moved, &rest, &mut |_| {}).expect("continue");
        // The completion count is this call's: max_tokens was reduced by what came before.
        assert_eq!(cont.tokens.len(), n - k, "{model}, k {k}");
        assert_eq!(cont.finish, FinishReason::Length, "{model}, k {k}");
        assert_eq!(cont.prompt_tokens, prompt.len() + k);
        let mut joined = whole.tokens[..k].to_vec();
        joined.extend(cont.tokens);
        assert_eq!(joined, whole.tokens, "{model}: continued at {k}, {params:?}");
    }
    assert_eq!(e.active_sequences(), 0);
    assert_eq!(e.free_blocks(), e.total_blocks(), "every block came back");
}

#[test]
fn a_seeded_sample_continues_with_the_same_tokens() {
    let sampled = SamplingParams { temperature: 0.8, seed: Some(20261202), ignore_eos: true, ..SamplingParams::default() };
    for model in ["llama-gqa", "qwen2-bias-tied"] {
        check(model, &sampled, 16);
    }
    // The offset matters: without it the continuation draws other tokens (sampling here is far
    // from greedy, so the two differ somewhere).
    let mut e = engine(&golden_dir("llama-gqa"));
    let p = prompt();
    let whole = e.generate(&p, &SamplingParams { max_tokens: 16, ..sampled.clone() }, &mut |_| {}).unwrap().tokens;
    let mut moved = p.clone();
    moved.extend_from_slice(&whole[..4]);
    let wrong = e.generate(&moved, &SamplingParams { max_tokens: 12, ..sampled.clone() }, &mut |_| {}).unwrap().tokens;
    assert_ne!(wrong, whole[4..], "token_offset 0 replays the draws of tokens 0.. (it should not match)");
}

#[test]
fn greedy_continues_with_the_same_tokens() {
    let greedy = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(1) };
    check("llama-gqa", &greedy, 12);
}

#[test]
fn penalties_continue_with_the_same_tokens() {
    // Penalties read the output so far: a continuation must count the generated tail of its
    // prompt (token_offset) as output, not as prompt, or frequency and presence change.
    let penalized = SamplingParams {
        temperature: 0.8,
        seed: Some(41),
        ignore_eos: true,
        repetition_penalty: 1.3,
        frequency_penalty: 0.6,
        presence_penalty: 0.4,
        logit_bias: vec![(7, 1.5)],
        min_p: 0.02,
        ..SamplingParams::default()
    };
    for model in ["llama-gqa", "qwen2-bias-tied"] {
        check(model, &penalized, 16);
    }
    check("llama-gqa", &SamplingParams { temperature: 0.0, ..penalized.clone() }, 12);
    // The penalties change this sample (so the check above is about them).
    let mut e = engine(&golden_dir("llama-gqa"));
    let plain = SamplingParams { repetition_penalty: 1.0, frequency_penalty: 0.0, presence_penalty: 0.0, logit_bias: vec![], ..penalized.clone() };
    let with = e.generate(&prompt(), &SamplingParams { max_tokens: 16, ..penalized }, &mut |_| {}).unwrap().tokens;
    let without = e.generate(&prompt(), &SamplingParams { max_tokens: 16, ..plain }, &mut |_| {}).unwrap().tokens;
    assert_ne!(with, without);
}
