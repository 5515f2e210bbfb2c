//! Opening a model: an HF folder (config.json + safetensors + tokenizer.json) or a GGUF file,
//! into one [`LoadedModel`] with normalised config, weights, tokenizer and chat template.

mod gguf;
mod hf;
pub mod synthetic;

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::weights::WeightSet;
use ferry_tokenizer::{ChatTemplate, Tokenizer};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelFormat {
    HfSafetensors,
    Gguf,
    /// `synthetic:NAME`: random weights in a preset's shapes ([`synthetic`]).
    Synthetic,
}

pub struct LoadedModel {
    pub path: PathBuf,
    pub format: ModelFormat,
    pub config: ModelConfig,
    pub weights: WeightSet,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// Identifies the exact weights and layout: engines exchange KV only when these match.
    pub fingerprint: String,
    /// Whether encoding a prompt should prepend BOS (from the tokenizer's own post-processor
    /// for HF folders, from `tokenizer.ggml.add_bos_token` for GGUF).
    pub add_special_tokens: bool,
}

/// Open a model from a path: a `.gguf` file, or a folder with `config.json`; or
/// `synthetic:NAME`, random weights in the shapes of a preset ([`synthetic::presets`]).
pub fn load(path: &Path) -> Result<LoadedModel> {
    if let Some(name) = path.to_str().and_then(|p| p.strip_prefix("synthetic:")) {
        return synthetic::load(name, 1);
    }
    let meta = std::fs::metadata(path).map_err(|e| EngineError::io(path, e))?;
    let mut m = if meta.is_dir() {
        hf::load(path)?
    } else if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        gguf::load(path)?
    } else {
        return Err(EngineError::bad_model(path, "expected a .gguf file or a folder with config.json and *.safetensors"));
    };
    if m.tokenizer.vocab_size() > m.config.vocab_size {
        return Err(EngineError::bad_model(
            path,
            format!("tokenizer has {} tokens but the model's vocabulary is {}", m.tokenizer.vocab_size(), m.config.vocab_size),
        ));
    }
    m.fingerprint = fingerprint(&m);
    Ok(m)
}

fn fingerprint(m: &LoadedModel) -> String {
    let mut h = Sha256::new();
    h.update(format!("{:?}", m.config).as_bytes());
    let mut names: Vec<_> = m.weights.tensors.iter().collect();
    names.sort_by(|a, b| a.1.name.cmp(&b.1.name));
    for (_, w) in names {
        h.update(format!("{}:{}:{:?}", w.name, w.ty.name(), w.shape).as_bytes());
        let b = w.bytes();
        h.update(&b[..b.len().min(256)]);
        h.update(&b[b.len().saturating_sub(256)..]);
    }
    let d = h.finalize();
    d.iter().take(16).map(|b| format!("{b:02x}")).collect()
}
