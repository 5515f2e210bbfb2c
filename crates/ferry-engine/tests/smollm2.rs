//! The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF) against HF transformers run in f32
//! on the exactly dequantized weights.

mod common;
use common::*;

fn golden() -> (Tensors, serde_json::Value) {
    let dir = fixtures().join("smollm2");
    let json = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    (Tensors::open(dir.join("golden.safetensors")), json)
}

#[test]
fn greedy_ids_match_hf_for_both_cases() {
    let (g, json) = golden();
    let mut e = engine(&smollm2_path());
    for case in ["capital", "story"] {
        let ids = g.ids(&format!("{case}.input_ids"));
        let want = g.ids(&format!("{case}.greedy_ids"));
        let logits = e.score(&ids).unwrap();
        let vocab = e.config().vocab_size;
        let last = &logits[(ids.len() - 1) * vocab..];
        let d = max_abs_diff(last, &g.f32(&format!("{case}.logits_last")));
        println!("{case}: max |Δlogit| at the last position = {d:.2e}");
        assert!(d < 1e-3, "{case}: last-position logits differ by {d}");
        let got = greedy(&mut e, &ids, want.len());
        assert_eq!(got, want, "{case}: greedy ids differ from HF");
        assert_eq!(e.tokenizer.decode(&got, false).unwrap(), json["cases"][case]["hf_greedy_text"].as_str().unwrap());
    }
    assert_eq!(e.free_blocks(), e.total_blocks());
}

#[test]
fn all_position_logits_for_capital() {
    let (g, _) = golden();
    let mut e = engine(&smollm2_path());
    let ids = g.ids("capital.input_ids");
    let got = e.score(&ids).unwrap();
    let d = max_abs_diff(&got, &g.f32("capital.logits"));
    println!("capital: max |Δlogit| over all {} positions = {d:.2e}", ids.len());
    assert!(d < 1e-3, "{d}");
}

#[test]
fn prompt_text_encodes_to_fixture_ids() {
    let (g, json) = golden();
    let e = engine(&smollm2_path());
    for case in ["capital", "story"] {
        let text = json["cases"][case]["text"].as_str().unwrap();
        assert_eq!(e.encode(text).unwrap(), g.ids(&format!("{case}.input_ids")), "{case}");
    }
    for t in json["tokenization"].as_array().unwrap() {
        let want: Vec<u32> = t["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(e.tokenizer.encode(t["text"].as_str().unwrap(), false).unwrap(), want);
    }
}
