//! GGUF files (llama.cpp): hyper-parameters, tokenizer and chat template from the metadata,
//! weights left quantized in the memory map. llama.cpp's converter interleaves the two RoPE halves
//! of each Q/K head (`permute` in convert_hf_to_gguf.py) for the `llama` architecture; we move
//! those rows back so one RoPE convention (HF's rotate-half) serves every format.

use super::{LoadedModel, ModelFormat};
use crate::config::{Arch, ModelConfig};
use crate::error::{EngineError, Result};
use crate::weights::{HostWeight, Storage, WeightKey, WeightSet};
use ferry_gguf::{GgmlType, GgufFile};
use ferry_quant::WeightType;
use std::path::Path;
use std::sync::Arc;

fn weight_type(name: &str, t: &GgmlType) -> Result<WeightType> {
    Ok(match t {
        GgmlType::F32 => WeightType::F32,
        GgmlType::F16 => WeightType::F16,
        GgmlType::BF16 => WeightType::BF16,
        GgmlType::Q8_0 => WeightType::Q8_0,
        GgmlType::Q4_0 => WeightType::Q4_0,
        GgmlType::Q4_1 => WeightType::Q4_1,
        GgmlType::Q4_K => WeightType::Q4_K,
        GgmlType::Q6_K => WeightType::Q6_K,
        other => return Err(EngineError::UnsupportedDtype { name: name.into(), dtype: other.name() }),
    })
}

pub(super) fn load(path: &Path) -> Result<LoadedModel> {
    let file = Arc::new(GgufFile::open(path)?);
    let mut config = ModelConfig::from_gguf(&file)?;
    let mut weights = WeightSet::default();
    let keys = WeightKey::all(config.n_layers);
    for (i, t) in file.tensors().iter().enumerate() {
        let Some(key) = keys.iter().find(|k| k.gguf_name() == t.name) else {
            if t.name == "rope_freqs.weight" {
                let w = host_weight(&file, i)?;
                config.rope.freq_factors = Some(w.to_f32());
            }
            continue;
        };
        let mut w = host_weight(&file, i)?;
        if config.arch == Arch::Llama {
            match key {
                WeightKey::Q(_) => w = unpermute_rope_rows(w, config.n_heads, config.head_dim)?,
                WeightKey::K(_) => w = unpermute_rope_rows(w, config.n_kv_heads, config.head_dim)?,
                WeightKey::QBias(_) | WeightKey::KBias(_) => {
                    return Err(EngineError::bad_model(path, "Q/K biases in a llama-architecture GGUF are not supported"));
                }
                _ => {}
            }
        }
        weights.tensors.insert(*key, w);
    }
    // The same text side the router opens, so both tokenize identically.
    let ferry_tokenizer::ModelText { tokenizer, chat_template, add_special_tokens, .. } =
        ferry_tokenizer::ModelText::from_gguf(&file, path)?;
    Ok(LoadedModel {
        path: path.to_path_buf(),
        format: ModelFormat::Gguf,
        config,
        weights,
        tokenizer,
        chat_template,
        fingerprint: String::new(),
        add_special_tokens,
    })
}

fn host_weight(file: &Arc<GgufFile>, index: usize) -> Result<HostWeight> {
    let t = &file.tensors()[index];
    let ty = weight_type(&t.name, &t.ggml_type)?;
    // GGUF lists dims innermost first; row-major shape is the reverse.
    let shape: Vec<usize> = t.dims.iter().rev().map(|&d| d as usize).collect();
    let w = HostWeight { name: t.name.clone(), ty, shape, storage: Storage::Gguf(file.clone(), index), x8: None };
    w.check()?;
    Ok(w)
}

/// Undo llama.cpp's Q/K permutation: GGUF row (h, r, j) holds HF row (h, j, r), where j picks the
/// RoPE half and r the index inside it.
fn unpermute_rope_rows(w: HostWeight, n_heads: usize, head_dim: usize) -> Result<HostWeight> {
    if w.shape.len() != 2 || w.rows() != n_heads * head_dim {
        return Err(EngineError::TensorShape { name: w.name.clone(), expected: vec![n_heads * head_dim, w.cols()], found: w.shape.clone() });
    }
    let half = head_dim / 2;
    Ok(w.permute_rows(|i| {
        let (h, within) = (i / head_dim, i % head_dim);
        let (j, r) = (within / half, within % half);
        h * head_dim + 2 * r + j
    }))
}
