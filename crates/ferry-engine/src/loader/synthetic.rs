//! Synthetic models for benchmarks: a real architecture's shapes with random bf16 weights
//! (`--model synthetic:NAME`), so a GPU benchmark of an 8B-parameter model needs no 16 GB download:
//! a GPU backend generates the weights on the device (`fill_random_bf16`), the CPU makes them on
//! the host. The tokenizer is a stand-in (one made-up word per id); benchmarks feed token ids.

use super::{LoadedModel, ModelFormat};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::weights::{HostWeight, RandomBf16, Storage, WeightKey, WeightSet};
use ferry_quant::WeightType;
use std::sync::Arc;

/// The presets: name, what it is, and its HF `config.json` fields.
const PRESETS: &[(&str, &str)] = &[
    (
        "llama3-8b",
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,
            "num_attention_heads":32,"num_key_value_heads":8,"head_dim":128,"rms_norm_eps":1e-5,"vocab_size":128256,
            "max_position_embeddings":8192,"rope_theta":500000.0,
            "rope_scaling":{"factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192,"rope_type":"llama3"},
            "tie_word_embeddings":false,"bos_token_id":0,"eos_token_id":1}"#,
    ),
    (
        "llama3-1b",
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":2048,"intermediate_size":8192,"num_hidden_layers":16,
            "num_attention_heads":32,"num_key_value_heads":8,"head_dim":64,"rms_norm_eps":1e-5,"vocab_size":128256,
            "max_position_embeddings":8192,"rope_theta":500000.0,
            "rope_scaling":{"factor":32.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192,"rope_type":"llama3"},
            "tie_word_embeddings":true,"bos_token_id":0,"eos_token_id":1}"#,
    ),
    (
        "tiny",
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"head_dim":16,"rms_norm_eps":1e-5,"vocab_size":256,
            "max_position_embeddings":512,"rope_theta":10000.0,"tie_word_embeddings":false,"bos_token_id":0,"eos_token_id":1}"#,
    ),
];

/// A stand-in tokenizer for `vocab` ids: a word per id (`<unk>`, `</s>`, then `t2`, `t3`, ...), so
/// any generated id decodes; benchmarks on synthetic models feed token ids.
fn tokenizer(vocab: usize) -> Result<ferry_tokenizer::Tokenizer> {
    let words: Vec<String> = (0..vocab)
        .map(|i| match i {
            0 => r#""<unk>":0"#.to_string(),
            1 => r#""</s>":1"#.to_string(),
            _ => format!(r#""t{i}":{i}"#),
        })
        .collect();
    let json = format!(
        r#"{{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],"normalizer":null,"pre_tokenizer":{{"type":"Whitespace"}},"post_processor":null,"decoder":null,"model":{{"type":"WordLevel","vocab":{{{}}},"unk_token":"<unk>"}}}}"#,
        words.join(",")
    );
    Ok(ferry_tokenizer::Tokenizer::from_json(&json, "synthetic tokenizer")?)
}

/// The names `synthetic:NAME` takes.
pub fn presets() -> Vec<&'static str> {
    PRESETS.iter().map(|p| p.0).collect()
}

/// The synthetic model `name`, its weights drawn from `seed`.
pub fn load(name: &str, seed: u32) -> Result<LoadedModel> {
    let json = PRESETS.iter().find(|p| p.0 == name).map(|p| p.1).ok_or_else(|| {
        EngineError::Config(format!("no synthetic model {name:?} (there are: {})", presets().join(", ")))
    })?;
    let cfg: serde_json::Value = serde_json::from_str(json).map_err(|e| EngineError::Config(format!("synthetic preset {name}: {e}")))?;
    let config = ModelConfig::from_hf(&cfg, None)?;
    let c = &config;
    let (hid, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let mut weights = WeightSet::default();
    let mut n = 0u32;
    // Matrices: random bf16 with the scale of a trained model's init (std ≈ 0.02 → ±0.035);
    // norm weights: ones (f32), so activations keep their scale through the layers.
    let mut matrix = |key: WeightKey, shape: [usize; 2]| {
        n += 1;
        let storage = Storage::Random(Arc::new(RandomBf16::new(seed.wrapping_mul(7919).wrapping_add(n), 0.035, shape[0] * shape[1])));
        weights.tensors.insert(key, HostWeight { name: key.hf_name(), ty: WeightType::BF16, shape: shape.to_vec(), storage, x8: None });
    };
    matrix(WeightKey::Embed, [c.vocab_size, hid]);
    if !c.tie_embeddings {
        matrix(WeightKey::LmHead, [c.vocab_size, hid]);
    }
    for l in 0..c.n_layers {
        matrix(WeightKey::Q(l), [q, hid]);
        matrix(WeightKey::K(l), [kv, hid]);
        matrix(WeightKey::V(l), [kv, hid]);
        matrix(WeightKey::O(l), [hid, q]);
        matrix(WeightKey::Gate(l), [ff, hid]);
        matrix(WeightKey::Up(l), [ff, hid]);
        matrix(WeightKey::Down(l), [hid, ff]);
    }
    let ones = |key: WeightKey| {
        let bytes: Vec<u8> = (0..hid).flat_map(|_| 1f32.to_le_bytes()).collect();
        (key, HostWeight { name: key.hf_name(), ty: WeightType::F32, shape: vec![hid], storage: Storage::Owned(Arc::new(bytes)), x8: None })
    };
    weights.tensors.extend((0..c.n_layers).flat_map(|l| [ones(WeightKey::AttnNorm(l)), ones(WeightKey::FfnNorm(l))]));
    weights.tensors.extend([ones(WeightKey::FinalNorm)]);
    let tokenizer = tokenizer(c.vocab_size)?;
    Ok(LoadedModel {
        path: format!("synthetic:{name}").into(),
        format: ModelFormat::Synthetic,
        config,
        weights,
        tokenizer,
        chat_template: None,
        fingerprint: format!("synthetic:{name}:seed{seed}"),
        add_special_tokens: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_load_with_their_shapes() {
        let m = load("llama3-8b", 1).unwrap();
        assert_eq!((m.config.n_layers, m.config.hidden_size, m.config.vocab_size), (32, 4096, 128256));
        // Llama-3-8B: 8.03 B parameters, bf16 matrices (the norms are a rounding error).
        let params = m.weights.total_bytes() / 2;
        assert!((8_000_000_000..8_100_000_000).contains(&params), "{params}");
        assert!(m.config.rope.llama3.is_some());
        assert!(load("nope", 1).err().expect("unknown preset").to_string().contains("llama3-8b"));
    }

    #[test]
    fn random_weights_are_a_function_of_seed_and_index() {
        let r = RandomBf16::new(5, 0.5, 1000);
        let bytes = Storage::Random(Arc::new(r)).bytes().to_vec();
        assert_eq!(bytes.len(), 2000);
        let vals: Vec<f32> = bytes.chunks_exact(2).map(|b| half::bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()).collect();
        assert!(vals.iter().all(|v| (-0.5..=0.5).contains(v)), "bf16 rounding may reach the bound, never pass it");
        let mean = vals.iter().sum::<f32>() / 1000.0;
        assert!(mean.abs() < 0.05, "mean {mean}");
        assert_eq!(crate::weights::random_bf16(5, 7, 0.5), u16::from_le_bytes([bytes[14], bytes[15]]));
        assert_ne!(crate::weights::random_bf16(6, 7, 0.5), crate::weights::random_bf16(5, 7, 0.5));
    }
}
