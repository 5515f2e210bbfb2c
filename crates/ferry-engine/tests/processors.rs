//! vLLM's sampling parameters against implementations Ferry did not write, on a golden model:
//! HF transformers' logits processors and warpers and SGLang's frequency/presence penalizers
//! (`tests/fixtures/processors/*.json`, made by `scripts/ref_logits_processors.py`).
//! - each processor (and all of them at once, in vLLM's order) on HF's last-position logits, with
//!   the prompt's last 8 ids standing as output generated earlier (`token_offset` 8);
//! - the distribution a draw chooses from after temperature, `min_p`, top-k and top-p;
//! - the whole engine: greedy generation under a repetition penalty equals HF `generate`'s.

mod common;
use common::*;
use ferry_core::{Processors, SamplingParams};
use ferry_engine::sampler::Sampler;
use serde_json::Value;

fn fixture() -> Value {
    let path = fixtures().join("processors/llama-gqa.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array().unwrap().iter().map(|x| x.as_f64().map_or(f32::NEG_INFINITY, |f| f as f32)).collect()
}

/// The fixture's parameters (absent ones at their defaults).
fn params(p: &Value) -> SamplingParams {
    let f = |k: &str, d: f32| p.get(k).and_then(Value::as_f64).map_or(d, |x| x as f32);
    SamplingParams {
        temperature: f("temperature", 0.0),
        top_k: p.get("top_k").and_then(Value::as_u64).unwrap_or(0) as usize,
        top_p: f("top_p", 1.0),
        min_p: f("min_p", 0.0),
        repetition_penalty: f("repetition_penalty", 1.0),
        frequency_penalty: f("frequency_penalty", 0.0),
        presence_penalty: f("presence_penalty", 0.0),
        min_tokens: p.get("min_tokens").and_then(Value::as_u64).unwrap_or(0) as usize,
        logit_bias: p.get("logit_bias").and_then(Value::as_array).map_or(vec![], |a| a.iter().map(|e| (e[0].as_u64().unwrap() as u32, e[1].as_f64().unwrap() as f32)).collect()),
        max_tokens: 64,
        ..SamplingParams::default()
    }
}

#[test]
fn each_processor_equals_the_reference() {
    let fx = fixture();
    let prompt = ids(&fx["input_ids"]);
    let offset = fx["token_offset"].as_u64().unwrap() as u32;
    let logits = floats(&fx["logits"]);
    let cases = fx["processors"].as_array().unwrap();
    assert!(cases.len() >= 9);
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let bad: Vec<Vec<u32>> = c["bad_words_ids"].as_array().unwrap().iter().map(ids).collect();
        let p = SamplingParams { token_offset: offset, bad_words: vec!["(given as ids)".into(); bad.len()], ..params(&c["params"]) };
        let procs = Processors::new(&p, &ids(&c["stop_ids"]), bad, &prompt).unwrap_or_else(|| panic!("{name}: no processors"));
        let mut got = logits.clone();
        procs.apply(&mut got);
        let want = floats(&c["processed"]);
        let mut changed = 0;
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            if w.is_infinite() || g.is_infinite() {
                assert_eq!(g, w, "{name}: token {i} banned in one and not the other");
            } else {
                assert!((g - w).abs() <= 1e-5, "{name}: token {i}: {g} vs reference {w}");
            }
            changed += usize::from(*w != logits[i]);
        }
        // `min_tokens_met` is the control: with min_tokens reached, nothing is banned.
        assert_eq!(changed > 0, name != "min_tokens_met", "{name}: {changed} logits changed");
    }
}

#[test]
fn the_sampling_distribution_equals_the_reference() {
    let fx = fixture();
    let logits = floats(&fx["logits"]);
    for c in fx["distributions"].as_array().unwrap() {
        let name = c["name"].as_str().unwrap();
        let p = SamplingParams { seed: Some(1), ..params(&c["params"]) };
        let (idx, w) = Sampler::new(&p).candidates(&logits);
        let total: f64 = w.iter().sum();
        let mut got: Vec<(u32, f64)> = idx.into_iter().zip(w.iter().map(|x| x / total)).collect();
        got.sort_by_key(|&(t, _)| t);
        let want: Vec<(u32, f64)> = c["probs"].as_array().unwrap().iter().map(|e| (e[0].as_u64().unwrap() as u32, e[1].as_f64().unwrap())).collect();
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), want.iter().map(|w| w.0).collect::<Vec<_>>(), "{name}: the kept tokens");
        for ((t, g), (_, w)) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5, "{name}: token {t}: p {g} vs reference {w}");
        }
        assert!(want.len() > 1 && want.len() < logits.len(), "{name}: the reference cut something and kept a choice");
    }
}

#[test]
fn greedy_under_a_repetition_penalty_equals_hf_generate() {
    let fx = fixture();
    let prompt = ids(&fx["input_ids"]);
    let mut e = engine(&golden_dir(fx["model"].as_str().unwrap()));
    let plain = e.generate(&prompt, &SamplingParams { ignore_eos: true, ..SamplingParams::greedy(24) }, &mut |_| {}).unwrap().tokens;
    for g in fx["generate"].as_array().unwrap() {
        let penalty = g["repetition_penalty"].as_f64().unwrap() as f32;
        let want = ids(&g["greedy_ids"]);
        let p = SamplingParams { ignore_eos: true, repetition_penalty: penalty, ..SamplingParams::greedy(want.len()) };
        let got = e.generate(&prompt, &p, &mut |_| {}).unwrap().tokens;
        assert_eq!(got, want, "repetition_penalty {penalty}");
        assert_ne!(got, plain[..want.len()], "the penalty changes the greedy ids (else this checks nothing)");
    }
}
