//! What a worker's services check requests against: the served model's facts ([`ModelFacts`]).

use crate::error::{Result, WorkerError};
use ferry_engine::Engine;
use ferry_grammar::LazyGrammars;
use std::sync::Arc;

/// Model facts the services check requests against.
#[derive(Clone, Debug)]
pub struct ModelFacts {
    pub fingerprint: String,
    pub layout: ferry_core::KvLayout,
    pub max_context: usize,
    pub vocab_size: usize,
    pub model: String,
    /// The engine keeps a prefix cache (`EngineConfig::prefix_cache`).
    pub prefix_cache: bool,
    /// Structured outputs: the grammar engine for this model's vocabulary.
    pub grammars: Arc<LazyGrammars>,
    /// For the logits processors: bad words are tokenized with it.
    pub tokenizer: Arc<ferry_tokenizer::Tokenizer>,
    /// The model's end-of-sequence ids (`min_tokens` holds them back).
    pub eos_ids: Vec<u32>,
}

impl ModelFacts {
    pub fn of(engine: &Engine, model: String) -> Self {
        Self {
            fingerprint: engine.fingerprint.clone(),
            layout: engine.kv_layout(),
            max_context: engine.config().max_position,
            vocab_size: engine.config().vocab_size,
            model,
            prefix_cache: engine.prefix_cache_enabled(),
            grammars: Arc::new(LazyGrammars::new(engine.tokenizer.clone(), Some(engine.config().vocab_size))),
            tokenizer: engine.tokenizer.clone(),
            eos_ids: engine.eos_ids(),
        }
    }

    pub fn check_prompt(&self, prompt: &[u32]) -> Result<()> {
        if prompt.is_empty() {
            return Err(WorkerError::InvalidRequest("empty prompt".into()));
        }
        if prompt.len() >= self.max_context {
            return Err(WorkerError::InvalidRequest(format!(
                "prompt of {} tokens does not fit the model's context of {}",
                prompt.len(),
                self.max_context
            )));
        }
        if let Some(&id) = prompt.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(WorkerError::InvalidRequest(format!("token id {id} is outside the vocabulary of {}", self.vocab_size)));
        }
        Ok(())
    }
}
