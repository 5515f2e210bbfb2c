//! [`ModelText`]: everything about a model's text side, without its weights: the tokenizer, the
//! chat template, whether prompts get special tokens, the end-of-sequence ids and a display name.
//! The engine's loaders build their tokenizer through it, and the router (which never loads
//! weights) opens the same model path with it, so both tokenize a prompt identically.

use std::path::Path;

use ferry_gguf::GgufFile;
use serde_json::Value;

use crate::{ChatTemplate, Tokenizer, TokenizerError};

pub struct ModelText {
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// Encode prompts with special tokens (BOS per `tokenizer.ggml.add_bos_token` for GGUF; the
    /// tokenizer's own post-processor for HF folders).
    pub add_special_tokens: bool,
    /// Ids that end generation: EOS, EOT/EOM where defined, and `generation_config.json`'s.
    pub eos_ids: Vec<u32>,
    /// The name it is served under by default: [`crate::served_name`] of its path (the file
    /// stem without the quantisation, the folder name, or `org/name` in the HF hub cache).
    pub name: String,
}

impl ModelText {
    /// Opens a `.gguf` file or an HF model folder (`tokenizer.json`, `config.json`,
    /// `tokenizer_config.json`, `generation_config.json`).
    pub fn open(path: &Path) -> Result<ModelText, TokenizerError> {
        let meta = std::fs::metadata(path).map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })?;
        if meta.is_dir() {
            Self::from_hf_dir(path)
        } else {
            let file = GgufFile::open(path)?;
            Self::from_gguf(&file, path)
        }
    }

    /// The text side of an opened GGUF file (`path` names it).
    pub fn from_gguf(file: &GgufFile, path: &Path) -> Result<ModelText, TokenizerError> {
        let tokenizer = Tokenizer::from_gguf(file)?;
        let chat_template = ChatTemplate::from_gguf(file, &tokenizer)?;
        let add_special_tokens = file
            .get("tokenizer.ggml.add_bos_token")
            .map(|v| matches!(v, ferry_gguf::MetaValue::Bool(true)))
            .unwrap_or(false);
        let mut eos_ids = Vec::new();
        for key in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
            if let Ok(id) = file.get_u32(key) {
                push_unique(&mut eos_ids, id);
            }
        }
        for &id in tokenizer.eos_ids() {
            push_unique(&mut eos_ids, id);
        }
        Ok(ModelText { tokenizer, chat_template, add_special_tokens, eos_ids, name: crate::served_name(path) })
    }

    /// The text side of an HF model folder. BOS is `config.json`'s first `bos_token_id`; the EOS
    /// ids are `config.json`'s `eos_token_id` (a number or a list) then `generation_config.json`'s.
    pub fn from_hf_dir(dir: &Path) -> Result<ModelText, TokenizerError> {
        let cfg = read_json(&dir.join("config.json"))?;
        let gen_path = dir.join("generation_config.json");
        let generation = if gen_path.exists() { Some(read_json(&gen_path)?) } else { None };
        let mut eos_ids = ids(cfg.get("eos_token_id"));
        for id in ids(generation.as_ref().and_then(|g| g.get("eos_token_id"))) {
            push_unique(&mut eos_ids, id);
        }
        let bos = ids(cfg.get("bos_token_id")).first().copied();
        let mut tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"))?;
        tokenizer.set_special(bos, eos_ids.clone());
        let tc = dir.join("tokenizer_config.json");
        let chat_template = if tc.exists() { ChatTemplate::from_tokenizer_config(&tc)? } else { None };
        Ok(ModelText { tokenizer, chat_template, add_special_tokens: true, eos_ids, name: crate::served_name(dir) })
    }

    /// A prompt's ids, with special tokens per the model's settings.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
        self.tokenizer.encode(text, self.add_special_tokens)
    }
}

impl std::fmt::Debug for ModelText {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelText")
            .field("name", &self.name)
            .field("tokenizer", &self.tokenizer)
            .field("has_chat_template", &self.chat_template.is_some())
            .field("add_special_tokens", &self.add_special_tokens)
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

fn push_unique(v: &mut Vec<u32>, id: u32) {
    if !v.contains(&id) {
        v.push(id);
    }
}

/// A token id field: a number or a list of numbers (anything else: none).
fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

fn read_json(path: &Path) -> Result<Value, TokenizerError> {
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Io { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text).map_err(|e| TokenizerError::Config { path: path.to_path_buf(), message: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_fields() {
        assert_eq!(ids(Some(&serde_json::json!(2))), vec![2]);
        assert_eq!(ids(Some(&serde_json::json!([2, 7]))), vec![2, 7]);
        assert_eq!(ids(Some(&serde_json::json!(null))), Vec::<u32>::new());
        assert_eq!(ids(None), Vec::<u32>::new());
    }
}
