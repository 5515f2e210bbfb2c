//! The generate loop on the real model: chat template, stop strings and stop tokens, seeded
//! sampling, streaming text that adds up to the final text.

mod common;
use common::*;
use ferry_core::SamplingParams;
use ferry_engine::FinishReason;
use ferry_tokenizer::{ChatMessage, Role};

#[test]
fn chat_answer_matches_hf_greedy_text() {
    let mut e = engine(&smollm2_path());
    let msgs = [
        ChatMessage::new(Role::System, "You are a helpful AI assistant named SmolLM, trained by Hugging Face"),
        ChatMessage::new(Role::User, "What is the capital of France?"),
    ];
    let text = e.chat_template.as_ref().expect("SmolLM2 has a chat template").render(&msgs, true).unwrap();
    let ids = e.tokenizer.encode(&text, false).unwrap();
    let mut streamed = String::new();
    let g = e.generate(&ids, &SamplingParams::greedy(64), &mut |t| streamed.push_str(t)).unwrap();
    // HF's greedy text for this prompt starts with the answer, then <|im_end|> (EOS).
    assert_eq!(g.text, "The capital of France is Paris.");
    assert_eq!(g.finish, FinishReason::StopToken(2));
    assert_eq!(streamed, g.text, "streamed pieces add up to the text");
}

#[test]
fn stop_strings_and_stop_tokens() {
    let mut e = engine(&smollm2_path());
    let prompt = e.encode("Once upon a time, there was a little robot who").unwrap();
    // HF greedy: " had a special ability to make people happy. He was called \"The Happy One\" ..."
    let p = SamplingParams { stop_strings: vec!["happy".into()], ..SamplingParams::greedy(32) };
    let mut streamed = String::new();
    let g = e.generate(&prompt, &p, &mut |t| streamed.push_str(t)).unwrap();
    assert_eq!(g.text, " had a special ability to make people ");
    assert_eq!(g.finish, FinishReason::StopString);
    assert_eq!(streamed, g.text);
    // Stop at a token id: the id of " special" ends generation before it is emitted.
    let special = e.tokenizer.encode(" special", false).unwrap();
    assert_eq!(special.len(), 1);
    let p = SamplingParams { stop_token_ids: special.clone(), ..SamplingParams::greedy(32) };
    let g = e.generate(&prompt, &p, &mut |_| {}).unwrap();
    assert_eq!(g.text, " had a");
    assert_eq!(g.finish, FinishReason::StopToken(special[0]));
    assert_eq!(e.free_blocks(), e.total_blocks());
}

#[test]
fn seeded_sampling_reproduces() {
    let mut e = engine(&smollm2_path());
    let prompt = e.encode("The weather today is").unwrap();
    let p = |seed| SamplingParams { temperature: 0.9, top_p: 0.95, top_k: 50, seed: Some(seed), ignore_eos: true, ..SamplingParams::greedy(24) };
    let a = e.generate(&prompt, &p(1), &mut |_| {}).unwrap().tokens;
    let b = e.generate(&prompt, &p(1), &mut |_| {}).unwrap().tokens;
    let c = e.generate(&prompt, &p(2), &mut |_| {}).unwrap().tokens;
    assert_eq!(a, b, "same seed, same sample");
    assert_ne!(a, c, "different seeds gave the same 24 tokens");
}
