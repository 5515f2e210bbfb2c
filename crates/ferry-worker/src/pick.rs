//! Choosing each token: the request's sampler, behind its structured-output mask when it has a
//! grammar ([`ferry_grammar::Constraint`]).
//!
//! A constraint is built wherever a request samples: on the prefill worker for the first token,
//! on the decode (or colocated) worker for the rest. Its state is the grammar plus the tokens the
//! completion holds so far, so each worker rebuilds it from the request: the generated tail of a
//! migrated request's prompt (its last `token_offset` ids) is replayed here, and a decode worker
//! then commits the first token that came from prefill ([`Picker::commit`]).

use std::time::Instant;

use ferry_core::SamplingParams;
use ferry_engine::sampler::Sampler;
use ferry_grammar::{Constraint, GrammarError, LazyGrammars};

use crate::{Result, WorkerError};

/// The constraint for a request with `params` whose prompt is `prompt`: None without a grammar.
/// The prompt's last `token_offset` ids are the completion so far (a request moved here after
/// they were generated): they are replayed.
pub fn constraint_for(grammars: &LazyGrammars, params: &SamplingParams, prompt: &[u32]) -> Result<Option<Constraint>> {
    let Some(grammar) = &params.grammar else { return Ok(None) };
    let offset = params.token_offset as usize;
    if offset > prompt.len() {
        return Err(WorkerError::InvalidRequest(format!(
            "token_offset {offset} is past the {} prompt ids this worker was sent; a structured output needs the completion so far",
            prompt.len()
        )));
    }
    let replay = &prompt[prompt.len() - offset..];
    let grammars = grammars.get().map_err(|e| WorkerError::InvalidRequest(e.to_string()))?;
    grammars.constraint(grammar, replay).map(Some).map_err(|e| match e {
        GrammarError::Matcher(m) => WorkerError::InvalidRequest(format!("the completion so far does not fit the request's grammar: {m}")),
        e => WorkerError::InvalidRequest(e.to_string()),
    })
}

/// One request's token chooser.
pub struct Picker {
    sampler: Sampler,
    constraint: Option<Constraint>,
}

impl Picker {
    pub fn new(sampler: Sampler, constraint: Option<Constraint>) -> Self {
        Self { sampler, constraint }
    }

    /// The next token from `logits` (masked in place when constrained), committed to the grammar.
    pub fn pick(&mut self, logits: &mut [f32]) -> std::result::Result<u32, GrammarError> {
        let Some(c) = &mut self.constraint else { return Ok(self.sampler.sample(logits)) };
        let t0 = Instant::now();
        c.mask(logits)?;
        metrics::histogram!("ferry_worker_grammar_mask_seconds").record(t0.elapsed().as_secs_f64());
        let tok = self.sampler.sample(logits);
        c.commit(tok)?;
        Ok(tok)
    }

    /// Commits a token sampled elsewhere (the first token, from the prefill worker).
    pub fn commit(&mut self, tok: u32) -> std::result::Result<(), GrammarError> {
        match &mut self.constraint {
            Some(c) => c.commit(tok),
            None => Ok(()),
        }
    }

    /// Whether a grammar masks this request's logits (callers that need the model's own
    /// distribution, for logprobs, keep a copy first).
    pub fn is_constrained(&self) -> bool {
        self.constraint.is_some()
    }

    /// The grammar is complete: nothing but the end of the sequence may follow.
    pub fn finished(&self) -> bool {
        self.constraint.as_ref().is_some_and(Constraint::is_finished)
    }

    /// The sampler's generator state (see [`Sampler::rng_state`]).
    pub fn rng_state(&self) -> u64 {
        self.sampler.rng_state()
    }
}
