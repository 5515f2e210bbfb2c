//! Bad input gets an error that names the problem, never a panic.

mod common;
use common::*;
use ferry_core::SamplingParams;
use ferry_engine::{Engine, EngineConfig, EngineError};
use std::path::Path;

/// A copy of a golden model folder, with `edit` applied to it (removed when dropped).
fn edited_model(name: &str, edit: impl FnOnce(&Path)) -> ScratchDir {
    let dst = ScratchDir::golden_copy(name, "llama-gqa");
    edit(&dst);
    dst
}

fn load_err(path: &Path) -> String {
    match Engine::load(path, &EngineConfig { threads: 1, ..Default::default() }) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => e.to_string(),
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(p, v.to_string()).unwrap();
}

#[test]
fn missing_files_are_named() {
    let e = load_err(Path::new("/nonexistent/model.gguf"));
    assert!(e.contains("/nonexistent/model.gguf"), "{e}");
    let d = edited_model("no-weights", |d| std::fs::remove_file(d.join("model.safetensors")).unwrap());
    assert!(load_err(&d).contains("model.safetensors"));
    let d = edited_model("no-tokenizer", |d| std::fs::remove_file(d.join("tokenizer.json")).unwrap());
    assert!(load_err(&d).contains("tokenizer.json"));
}

#[test]
fn corrupt_and_truncated_safetensors() {
    let d = edited_model("st-header", |d| {
        let p = d.join("model.safetensors");
        let mut b = std::fs::read(&p).unwrap();
        b[8..16].copy_from_slice(b"{garbage");
        std::fs::write(p, b).unwrap();
    });
    let e = load_err(&d);
    assert!(e.contains("safetensors"), "{e}");
    let d = edited_model("st-trunc", |d| {
        let p = d.join("model.safetensors");
        let b = std::fs::read(&p).unwrap();
        std::fs::write(p, &b[..b.len() / 2]).unwrap();
    });
    assert!(load_err(&d).contains("safetensors"));
}

#[test]
fn truncated_and_corrupt_gguf() {
    let src = std::fs::read(smollm2_path()).unwrap();
    let dir = ScratchDir::new("gguf");
    for (name, bytes) in [
        ("empty.gguf", Vec::new()),
        ("magic.gguf", b"GGUF".to_vec()),
        ("header.gguf", src[..4096].to_vec()),
        ("half.gguf", src[..src.len() / 2].to_vec()),
        ("badmagic.gguf", [b"FUGG".to_vec(), src[4..65536].to_vec()].concat()),
    ] {
        let p = dir.join(name);
        std::fs::write(&p, bytes).unwrap();
        let e = load_err(&p);
        assert!(e.contains(name), "{name}: error does not name the file: {e}");
    }
}

#[test]
fn unknown_architecture_and_bad_shapes() {
    let d = edited_model("arch", |d| edit_config(d, |v| v["architectures"] = serde_json::json!(["GPT2LMHeadModel"])));
    let e = load_err(&d);
    assert!(e.contains("GPT2LMHeadModel") && e.contains("supported"), "{e}");
    let d = edited_model("shape", |d| edit_config(d, |v| v["intermediate_size"] = serde_json::json!(96)));
    let e = load_err(&d);
    assert!(e.contains("mlp") && e.contains("expected shape"), "{e}");
    let d = edited_model("heads", |d| edit_config(d, |v| v["num_key_value_heads"] = serde_json::json!(3)));
    assert!(load_err(&d).contains("KV heads"));
    let d = edited_model("json", |d| std::fs::write(d.join("config.json"), "{not json").unwrap());
    assert!(load_err(&d).contains("config.json"));
}

#[test]
fn bad_prompts_and_params() {
    let mut e = engine(&golden_dir("llama-gqa"));
    let p = SamplingParams::greedy(4);
    assert!(matches!(e.generate(&[], &p, &mut |_| {}), Err(EngineError::EmptyPrompt)));
    let long = vec![5u32; 600]; // context is 512
    let err = e.generate(&long, &p, &mut |_| {}).unwrap_err();
    assert!(matches!(err, EngineError::ContextOverflow { tokens: 600, context: 512, .. }), "{err}");
    assert!(err.to_string().contains("512"));
    let err = e.generate(&[1, 9999], &p, &mut |_| {}).unwrap_err();
    assert!(matches!(err, EngineError::TokenOutOfRange { id: 9999, vocab: 512 }), "{err}");
    let bad = SamplingParams { top_p: 0.0, ..p.clone() };
    assert!(e.generate(&[1, 2, 3], &bad, &mut |_| {}).unwrap_err().to_string().contains("top_p"));
    assert!(e.score(&long).is_err());
    assert_eq!(e.free_blocks(), e.total_blocks(), "a failed request leaked KV blocks");
}

#[test]
fn full_cache_is_a_retryable_error_and_changes_nothing() {
    let cfg = EngineConfig { threads: 1, block_size: 16, kv_tokens: Some(64), ..Default::default() };
    let mut e = Engine::load(&golden_dir("llama-gqa"), &cfg).unwrap();
    let a = e.new_sequence();
    e.prefill(a, &[7u32; 40]).unwrap();
    let b = e.new_sequence();
    let free = e.free_blocks();
    let err = e.prefill(b, &[7u32; 40]).unwrap_err();
    assert_eq!(err.kind(), ferry_engine::ErrorKind::Capacity, "{err}");
    assert!(err.to_string().contains("exhausted"), "{err}");
    assert_eq!(e.seq_len(b).unwrap(), 0);
    assert_eq!(e.free_blocks(), free, "a failed step kept blocks");
    // A batch whose second item does not fit gives back the first item's blocks too.
    let c = e.new_sequence();
    let items = [
        ferry_engine::StepItem { seq: c, tokens: &[7u32; 8], logits: ferry_engine::Logits::None },
        ferry_engine::StepItem { seq: b, tokens: &[7u32; 40], logits: ferry_engine::Logits::None },
    ];
    assert!(e.step(&items, &mut |_, _| {}).is_err());
    assert_eq!(e.free_blocks(), free, "a failed batch kept blocks");
    e.release(c).unwrap();
    e.release(a).unwrap();
    e.release(b).unwrap();
    assert_eq!(e.free_blocks(), e.total_blocks());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]
    /// Random corruption of a safetensors header never panics the loader.
    #[test]
    fn corrupted_safetensors_never_panic(pos in 0usize..600, byte in proptest::num::u8::ANY, cut in proptest::option::of(0usize..2000)) {
        let d = edited_model("fuzz", |d| {
            let p = d.join("model.safetensors");
            let mut b = std::fs::read(&p).unwrap();
            if pos < b.len() { b[pos] = byte; }
            if let Some(c) = cut { b.truncate(c.min(b.len())); }
            std::fs::write(p, b).unwrap();
        });
        let _ = Engine::load(&d, &EngineConfig { threads: 1, ..Default::default() });
    }
}
