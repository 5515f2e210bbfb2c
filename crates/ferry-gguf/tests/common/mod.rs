//! Shared test helpers: locating the real SmolLM2 GGUF, and a test-only GGUF writer.
#![allow(dead_code)]

pub mod writer;

use std::path::PathBuf;

/// The SmolLM2-135M-Instruct Q4_1 GGUF: `$FERRY_SMOLLM2_GGUF`, else
/// `$HOME/.cache/ferry/models/SmolLM2-135M-Instruct.Q4_1.gguf`. Fails the test when missing.
pub fn smollm2_gguf() -> PathBuf {
    let path = match std::env::var_os("FERRY_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => {
            let home = std::env::var_os("HOME").unwrap_or_default();
            PathBuf::from(home).join(".cache/ferry/models/SmolLM2-135M-Instruct.Q4_1.gguf")
        }
    };
    assert!(
        path.is_file(),
        "SmolLM2 GGUF not found at {}: run `cargo run -p ferry -- fetch` (or set FERRY_SMOLLM2_GGUF)",
        path.display()
    );
    path
}
