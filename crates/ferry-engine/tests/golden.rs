//! Correctness against HF transformers (f32 math) on the four tiny golden models: logits at every
//! prompt position within 1e-3, and the 32 greedy ids identical.

mod common;
use common::*;

#[test]
fn golden_logits_and_greedy_ids() {
    for name in GOLDEN_MODELS {
        let dir = golden_dir(name);
        let g = Tensors::open(dir.join("golden.safetensors"));
        let ids = g.ids("input_ids");
        let want = g.f32("logits");
        let mut e = engine(&dir);
        let got = e.score(&ids).unwrap();
        let d = max_abs_diff(&got, &want);
        println!("{name}: max |Δlogit| = {d:.2e} over {} positions", ids.len());
        assert!(d <= 1e-3, "{name}: max |Δlogit| {d} > 1e-3");
        let greedy_want = g.ids("greedy_ids");
        let greedy_got = greedy(&mut e, &ids, greedy_want.len());
        assert_eq!(greedy_got, greedy_want, "{name}: greedy ids differ");
        assert_eq!(e.free_blocks(), e.total_blocks(), "{name}: KV blocks leaked");
    }
}

#[test]
fn golden_tokenizer_matches_prompt_ids() {
    for name in GOLDEN_MODELS {
        let dir = golden_dir(name);
        let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
        let e = engine(&dir);
        let want: Vec<u32> = json["input_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let got = e.tokenizer.encode(json["prompt"].as_str().unwrap(), false).unwrap();
        assert_eq!(got, want, "{name}");
    }
}
