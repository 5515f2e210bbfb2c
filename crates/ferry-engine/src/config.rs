//! Model hyper-parameters, read from an HF `config.json` (+ `generation_config.json`) or from GGUF
//! metadata, normalised into one [`ModelConfig`] that the model code uses.

use crate::error::{EngineError, Result};
use serde_json::Value;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    Qwen3,
}

pub const SUPPORTED_ARCHS: &str =
    "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM; GGUF: llama, qwen2, qwen3";

impl Arch {
    fn from_hf(name: &str) -> Option<Self> {
        Some(match name {
            "LlamaForCausalLM" => Arch::Llama,
            "MistralForCausalLM" => Arch::Mistral,
            "Qwen2ForCausalLM" => Arch::Qwen2,
            "Qwen3ForCausalLM" => Arch::Qwen3,
            _ => return None,
        })
    }
    fn from_gguf(name: &str) -> Option<Self> {
        Some(match name {
            "llama" => Arch::Llama,
            "qwen2" => Arch::Qwen2,
            "qwen3" => Arch::Qwen3,
            _ => return None,
        })
    }
}

/// Llama-3 frequency-dependent RoPE scaling (`rope_type: llama3`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position: f32,
}

/// The precision HF ends up holding RoPE inverse frequencies in (the checkpoint's dtype).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FreqDtype {
    F32,
    BF16,
    F16,
}

#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    pub llama3: Option<Llama3Scaling>,
    /// Per-frequency divisors (GGUF `rope_freqs.weight`, llama.cpp's form of Llama-3 scaling).
    pub freq_factors: Option<Vec<f32>>,
    pub freq_dtype: FreqDtype,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_layers: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope: RopeConfig,
    pub max_position: usize,
    pub tie_embeddings: bool,
    pub qkv_bias: bool,
    pub o_bias: bool,
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

fn get_usize(v: &Value, key: &str) -> Option<usize> {
    v.get(key).and_then(Value::as_u64).map(|x| x as usize)
}
fn get_f32(v: &Value, key: &str) -> Option<f32> {
    v.get(key).and_then(Value::as_f64).map(|x| x as f32)
}
fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

pub(crate) fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, e))?;
    serde_json::from_str(&text).map_err(|source| EngineError::Json { path: path.into(), source })
}

impl ModelConfig {
    /// Parse an HF `config.json`; `generation_config` (if present) contributes EOS ids.
    pub fn from_hf(cfg: &Value, generation_config: Option<&Value>) -> Result<Self> {
        let arch_name = cfg
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .ok_or_else(|| EngineError::Config("config.json has no `architectures` entry".into()))?;
        let arch = Arch::from_hf(arch_name)
            .ok_or_else(|| EngineError::UnsupportedArch { arch: arch_name.into(), supported: SUPPORTED_ARCHS })?;
        let need = |key: &str| get_usize(cfg, key).ok_or_else(|| EngineError::Config(format!("config.json: missing or invalid `{key}`")));
        let hidden_size = need("hidden_size")?;
        let n_heads = need("num_attention_heads")?;
        let n_kv_heads = get_usize(cfg, "num_key_value_heads").unwrap_or(n_heads);
        let head_dim = get_usize(cfg, "head_dim").unwrap_or(hidden_size / n_heads.max(1));
        if cfg.get("hidden_act").and_then(Value::as_str).is_some_and(|a| a != "silu") {
            return Err(EngineError::Config(format!("unsupported hidden_act {:?} (only silu)", cfg["hidden_act"])));
        }
        if cfg.get("mlp_bias").and_then(Value::as_bool) == Some(true) {
            return Err(EngineError::Config("mlp_bias = true is not supported".into()));
        }
        // transformers >= 5 puts rope settings under `rope_parameters`; older ones use
        // top-level `rope_theta` and `rope_scaling`.
        let rope_params = cfg.get("rope_parameters").filter(|v| v.is_object());
        let scaling = rope_params.or_else(|| cfg.get("rope_scaling").filter(|v| v.is_object()));
        let theta = rope_params
            .and_then(|p| get_f32(p, "rope_theta"))
            .or_else(|| get_f32(cfg, "rope_theta"))
            .unwrap_or(10000.0);
        let rope_type = scaling
            .and_then(|s| s.get("rope_type").or_else(|| s.get("type")))
            .and_then(Value::as_str)
            .unwrap_or("default");
        let llama3 = match rope_type {
            "default" => None,
            "llama3" => {
                let s = scaling.expect("rope_type came from scaling");
                let f = |k: &str| get_f32(s, k).ok_or_else(|| EngineError::Config(format!("llama3 rope scaling: missing `{k}`")));
                Some(Llama3Scaling {
                    factor: f("factor")?,
                    low_freq_factor: f("low_freq_factor")?,
                    high_freq_factor: f("high_freq_factor")?,
                    original_max_position: f("original_max_position_embeddings")?,
                })
            }
            other => return Err(EngineError::Config(format!("unsupported rope_type {other:?} (supported: default, llama3)"))),
        };
        let mut max_position = need("max_position_embeddings")?;
        if arch == Arch::Mistral {
            // Sliding-window attention is not implemented: cap the context so the window never slides.
            if let Some(w) = get_usize(cfg, "sliding_window") {
                max_position = max_position.min(w);
            }
        }
        let freq_dtype = match cfg.get("dtype").or_else(|| cfg.get("torch_dtype")).and_then(Value::as_str) {
            Some("bfloat16") => FreqDtype::BF16,
            Some("float16") => FreqDtype::F16,
            _ => FreqDtype::F32,
        };
        let attention_bias = cfg.get("attention_bias").and_then(Value::as_bool).unwrap_or(false);
        let mut eos = ids(cfg.get("eos_token_id"));
        for id in ids(generation_config.and_then(|g| g.get("eos_token_id"))) {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
        let c = Self {
            arch,
            vocab_size: need("vocab_size")?,
            hidden_size,
            intermediate_size: need("intermediate_size")?,
            n_layers: need("num_hidden_layers")?,
            n_heads,
            n_kv_heads,
            head_dim,
            rms_eps: get_f32(cfg, "rms_norm_eps").unwrap_or(1e-6),
            rope: RopeConfig { theta, llama3, freq_factors: None, freq_dtype },
            max_position,
            tie_embeddings: cfg.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
            qkv_bias: arch == Arch::Qwen2 || attention_bias,
            o_bias: matches!(arch, Arch::Llama | Arch::Mistral) && attention_bias,
            qk_norm: arch == Arch::Qwen3,
            bos_token_id: ids(cfg.get("bos_token_id")).first().copied(),
            eos_token_ids: eos,
        };
        c.validate()?;
        Ok(c)
    }

    /// Read the hyper-parameters from GGUF metadata (`<arch>.*` keys).
    pub fn from_gguf(g: &ferry_gguf::GgufFile) -> Result<Self> {
        let arch_name = g.get_str("general.architecture")?;
        let arch = Arch::from_gguf(arch_name)
            .ok_or_else(|| EngineError::UnsupportedArch { arch: arch_name.into(), supported: SUPPORTED_ARCHS })?;
        let k = |s: &str| format!("{arch_name}.{s}");
        let u = |s: &str| g.get_u32(&k(s)).map(|v| v as usize);
        let hidden_size = u("embedding_length")?;
        let n_heads = u("attention.head_count")?;
        let n_kv_heads = u("attention.head_count_kv").unwrap_or(n_heads);
        let head_dim = u("attention.key_length").or_else(|_| u("rope.dimension_count")).unwrap_or(hidden_size / n_heads.max(1));
        let vocab_size = match g.tensor("token_embd.weight") {
            Some(t) if t.dims.len() == 2 => t.dims[1] as usize,
            _ => g.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let mut eos = Vec::new();
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
            if let Ok(id) = g.get_u32(key) {
                if !eos.contains(&id) {
                    eos.push(id);
                }
            }
        }
        let has_bias = g.tensor("blk.0.attn_q.bias").is_some();
        let c = Self {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size: u("feed_forward_length")?,
            n_layers: u("block_count")?,
            n_heads,
            n_kv_heads,
            head_dim,
            rms_eps: g.get_f32(&k("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
            rope: RopeConfig { theta: g.get_f32(&k("rope.freq_base")).unwrap_or(10000.0), llama3: None, freq_factors: None, freq_dtype: FreqDtype::F32 },
            max_position: u("context_length")?,
            tie_embeddings: g.tensor("output.weight").is_none(),
            qkv_bias: has_bias,
            o_bias: g.tensor("blk.0.attn_output.bias").is_some(),
            qk_norm: g.tensor("blk.0.attn_q_norm.weight").is_some(),
            bos_token_id: g.get_u32("tokenizer.ggml.bos_token_id").ok(),
            eos_token_ids: eos,
        };
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::Config(m));
        if self.n_heads == 0 || self.n_kv_heads == 0 || self.head_dim == 0 || self.n_layers == 0 {
            return bad(format!("zero-sized model: heads {}, kv heads {}, head dim {}, layers {}", self.n_heads, self.n_kv_heads, self.head_dim, self.n_layers));
        }
        if self.n_heads % self.n_kv_heads != 0 {
            return bad(format!("{} heads is not a multiple of {} KV heads", self.n_heads, self.n_kv_heads));
        }
        if self.head_dim % 2 != 0 {
            return bad(format!("head_dim {} must be even for RoPE", self.head_dim));
        }
        if self.vocab_size == 0 || self.hidden_size == 0 || self.intermediate_size == 0 || self.max_position == 0 {
            return bad("vocab, hidden, intermediate sizes and context length must be positive".into());
        }
        Ok(())
    }

    pub fn q_dim(&self) -> usize {
        self.n_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_kv_heads * self.head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 160, "num_hidden_layers": 2,
               "max_position_embeddings": 512, "vocab_size": 512, "rms_norm_eps": 1e-5,
               "eos_token_id": 2, "bos_token_id": 1})
    }

    #[test]
    fn hf_old_and_new_rope_keys() {
        let mut old = base();
        old["rope_theta"] = json!(500000.0);
        old["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
        let mut new = base();
        new["rope_parameters"] = json!({"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
        let a = ModelConfig::from_hf(&old, None).unwrap();
        let b = ModelConfig::from_hf(&new, Some(&json!({"eos_token_id": [2, 7]}))).unwrap();
        assert_eq!(a.rope, b.rope);
        assert_eq!(a.rope.theta, 500000.0);
        assert_eq!(b.eos_token_ids, vec![2, 7]);
        assert_eq!(a.head_dim, 16);
    }

    #[test]
    fn hf_rejects_bad_configs() {
        let mut c = base();
        c["architectures"] = json!(["GPTNeoXForCausalLM"]);
        assert!(matches!(ModelConfig::from_hf(&c, None), Err(EngineError::UnsupportedArch { .. })));
        let mut c = base();
        c["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_hf(&c, None).is_err());
        let mut c = base();
        c["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0});
        let e = ModelConfig::from_hf(&c, None).unwrap_err().to_string();
        assert!(e.contains("yarn"), "{e}");
        let mut c = base();
        c.as_object_mut().unwrap().remove("hidden_size");
        assert!(ModelConfig::from_hf(&c, None).unwrap_err().to_string().contains("hidden_size"));
    }
}
