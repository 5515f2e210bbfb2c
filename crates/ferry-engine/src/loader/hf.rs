//! HF model folders: `config.json`, `model.safetensors` or shards listed in
//! `model.safetensors.index.json`, `tokenizer.json`, `tokenizer_config.json`, `generation_config.json`.

use super::{LoadedModel, ModelFormat};
use crate::config::{read_json, ModelConfig};
use crate::error::{EngineError, Result};
use crate::weights::{HostWeight, Storage, WeightKey, WeightSet};
use ferry_quant::WeightType;
use memmap2::Mmap;
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;

pub(super) fn load(dir: &Path) -> Result<LoadedModel> {
    let cfg_json = read_json(&dir.join("config.json"))?;
    let gen_path = dir.join("generation_config.json");
    let gen_json = if gen_path.exists() { Some(read_json(&gen_path)?) } else { None };
    let config = ModelConfig::from_hf(&cfg_json, gen_json.as_ref())?;

    let files = shard_files(dir)?;
    let mut by_name: HashMap<String, HostWeight> = HashMap::new();
    for f in files {
        read_safetensors(&dir.join(&f), &mut by_name)?;
    }
    let mut weights = WeightSet::default();
    for key in WeightKey::all(config.n_layers) {
        if let Some(w) = by_name.remove(&key.hf_name()) {
            weights.tensors.insert(key, w);
        }
    }

    // The same text side the router opens (BOS/EOS read from config.json and
    // generation_config.json exactly as `ModelConfig::from_hf` reads them).
    let ferry_tokenizer::ModelText { tokenizer, chat_template, .. } = ferry_tokenizer::ModelText::from_hf_dir(dir)?;
    Ok(LoadedModel {
        path: dir.to_path_buf(),
        format: ModelFormat::HfSafetensors,
        config,
        weights,
        tokenizer,
        chat_template,
        fingerprint: String::new(),
        add_special_tokens: true,
    })
}

fn shard_files(dir: &Path) -> Result<Vec<String>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let j = read_json(&index)?;
        let map = j
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| EngineError::bad_model(&index, "no `weight_map` object"))?;
        let files: BTreeSet<String> = map.values().filter_map(|v| v.as_str().map(str::to_owned)).collect();
        if files.iter().any(|f| f.contains('/') || f.contains("..")) {
            return Err(EngineError::bad_model(&index, "shard names must be plain file names"));
        }
        return Ok(files.into_iter().collect());
    }
    if dir.join("model.safetensors").exists() {
        return Ok(vec!["model.safetensors".into()]);
    }
    Err(EngineError::bad_model(dir, "no model.safetensors or model.safetensors.index.json"))
}

fn read_safetensors(path: &Path, out: &mut HashMap<String, HostWeight>) -> Result<()> {
    let file = std::fs::File::open(path).map_err(|e| EngineError::io(path, e))?;
    // SAFETY: the file is opened read-only and mapped privately; Ferry never writes model files
    // while serving, and a concurrent external truncation is outside what any mmap reader can guard.
    let map = Arc::new(unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(path, e))?);
    let st = safetensors::SafeTensors::deserialize(&map)
        .map_err(|e| EngineError::BadSafetensors { path: path.into(), reason: e.to_string() })?;
    let base = map.as_ptr() as usize;
    for (name, view) in st.tensors() {
        let ty = match view.dtype() {
            safetensors::Dtype::F32 => WeightType::F32,
            safetensors::Dtype::F16 => WeightType::F16,
            safetensors::Dtype::BF16 => WeightType::BF16,
            other => {
                // Only fail for tensors the model uses; others (e.g. I64 buffers) are ignored.
                if name.starts_with("model.") || name == "lm_head.weight" {
                    return Err(EngineError::UnsupportedDtype { name, dtype: format!("{other:?}") });
                }
                continue;
            }
        };
        let data = view.data();
        let w = HostWeight {
            name: name.clone(),
            ty,
            shape: view.shape().to_vec(),
            storage: Storage::Mapped { map: map.clone(), offset: data.as_ptr() as usize - base, len: data.len() },
            x8: None,
        };
        w.check()?;
        out.insert(name, w);
    }
    Ok(())
}
