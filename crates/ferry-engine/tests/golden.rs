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

/// Mistral is Llama's architecture (sliding window aside): the same weights under
/// `MistralForCausalLM` give the Llama reference logits.
#[test]
fn mistral_label_loads_the_llama_reference() {
    let src = golden_dir("llama-gqa");
    let dst = ScratchDir::golden_copy("mistral", "llama-gqa");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dst.join("config.json")).unwrap()).unwrap();
    cfg["architectures"] = serde_json::json!(["MistralForCausalLM"]);
    cfg["model_type"] = serde_json::json!("mistral");
    cfg["sliding_window"] = serde_json::json!(4096);
    std::fs::write(dst.join("config.json"), cfg.to_string()).unwrap();
    let g = Tensors::open(src.join("golden.safetensors"));
    let ids = g.ids("input_ids");
    let got = engine(&dst).score(&ids).unwrap();
    assert!(max_abs_diff(&got, &g.f32("logits")) <= 1e-3);
}

/// A model split into shards with `model.safetensors.index.json` loads like the single file.
#[test]
fn sharded_safetensors_load() {
    let src = golden_dir("llama-gqa");
    let dst = ScratchDir::new("shards");
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"] {
        std::fs::copy(src.join(f), dst.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(|s| s.to_string()).collect();
    names.sort();
    let (a, b) = names.split_at(names.len() / 2);
    let mut map = serde_json::Map::new();
    for (i, part) in [a, b].iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let views: Vec<(String, safetensors::tensor::TensorView)> = part.iter().map(|n| (n.clone(), st.tensor(n).unwrap())).collect();
        safetensors::serialize_to_file(views, None, &dst.join(&file)).unwrap();
        for n in *part {
            map.insert(n.clone(), serde_json::json!(file));
        }
    }
    std::fs::write(dst.join("model.safetensors.index.json"), serde_json::json!({"metadata": {}, "weight_map": map}).to_string()).unwrap();
    let g = Tensors::open(src.join("golden.safetensors"));
    let got = engine(&dst).score(&g.ids("input_ids")).unwrap();
    assert!(max_abs_diff(&got, &g.f32("logits")) <= 1e-3);
}
