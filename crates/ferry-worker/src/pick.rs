//! Choosing each token: the request's sampler (with its logits processors: penalties, bias,
//! `min_tokens`, bad words), behind its structured-output mask when it has a grammar
//! ([`ferry_grammar::Constraint`]).
//!
//! A constraint is built wherever a request samples: on the prefill worker for the first token,
//! on the decode (or colocated) worker for the rest. Its state is the grammar plus the tokens the
//! completion holds so far, so each worker rebuilds it from the request: the generated tail of a
//! migrated request's prompt (its last `token_offset` ids) is replayed here, and a decode worker
//! then commits the first token that came from prefill ([`Picker::commit`]).
//!
//! A request with `n` choices samples each choice's first token from the same prompt logits
//! ([`first_tokens`]), each with its own sampler (seed + i) and its own copy of the matcher.

use std::time::Instant;

use ferry_core::{Processors, SamplingParams, TokenLogprob};
use ferry_engine::sampler::{processors_for, Sampler};
use ferry_grammar::{Constraint, GrammarError, LazyGrammars};

use crate::facts::ModelFacts;
use crate::error::{Result, WorkerError};

/// What a request's choices choose their tokens by, besides their samplers: the grammar's
/// matcher and the logits processors, each built once for the request (from its sequence so
/// far) where it arrives, and copied for each choice.
#[derive(Default)]
pub struct Rules {
    pub constraint: Option<Constraint>,
    pub processors: Option<Processors>,
}

/// The [`Rules`] of a request with `params` whose prompt is `prompt` (its last `token_offset`
/// ids generated earlier): see [`constraint_for`] and [`processors_for`].
pub async fn rules_for(facts: &ModelFacts, params: &SamplingParams, prompt: &[u32]) -> Result<Rules> {
    let processors = processors_for(&facts.tokenizer, facts.vocab_size, &facts.eos_ids, params, prompt)?;
    let constraint = constraint_for(&facts.grammars, params, prompt).await?;
    Ok(Rules { constraint, processors })
}

impl Rules {
    /// Choice `i`'s chooser: its own sampler for `params.choice(i)` (`state`: continuing a
    /// sampler elsewhere), and its own copies of the rules.
    fn picker(&self, params: &SamplingParams, i: u32, state: Option<u64>) -> Picker {
        let p = params.choice(i);
        let sampler = match state {
            Some(state) => Sampler::resume(&p, state),
            None => Sampler::new(&p),
        };
        Picker::new(sampler.processing(self.processors.clone()), self.constraint.as_ref().map(Constraint::fork))
    }
}

/// The constraint for a request with `params` whose prompt is `prompt`: None without a grammar.
/// The prompt's last `token_offset` ids are the completion so far (a request moved here after
/// they were generated): they are replayed. Compiled on the grammar pool's large-stack threads,
/// under the same limits as the router's check (so what the router let through compiles here);
/// a full pool is [`WorkerError::Exhausted`] (the router may try another worker).
pub async fn constraint_for(grammars: &LazyGrammars, params: &SamplingParams, prompt: &[u32]) -> Result<Option<Constraint>> {
    let Some(grammar) = &params.grammar else { return Ok(None) };
    let offset = params.token_offset as usize;
    if offset > prompt.len() {
        return Err(WorkerError::InvalidRequest(format!(
            "token_offset {offset} is past the {} prompt ids this worker was sent; a structured output needs the completion so far",
            prompt.len()
        )));
    }
    let replay = &prompt[prompt.len() - offset..];
    grammars.constraint(grammar, replay).await.map(Some).map_err(|e| match e {
        GrammarError::Matcher(m) => WorkerError::InvalidRequest(format!("the completion so far does not fit the request's grammar: {m}")),
        e @ GrammarError::Busy { .. } => WorkerError::Exhausted(e.to_string()),
        e @ (GrammarError::Tokenizer(_)
        | GrammarError::Invalid { .. }
        | GrammarError::Limit { .. }
        | GrammarError::Timeout { .. }
        | GrammarError::Panicked { .. }
        | GrammarError::Threads(_)) => WorkerError::InvalidRequest(e.to_string()),
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
        metrics::histogram!(crate::cluster::metrics::names::GRAMMAR_MASK_SECONDS).record(t0.elapsed().as_secs_f64());
        let tok = self.sampler.sample(logits);
        c.commit(tok)?;
        Ok(tok)
    }

    /// Commits a token sampled elsewhere (the first token, from the prefill worker).
    pub fn commit(&mut self, tok: u32) -> std::result::Result<(), GrammarError> {
        self.sampler.record(tok);
        match &mut self.constraint {
            Some(c) => c.commit(tok),
            None => Ok(()),
        }
    }

    /// Whether a grammar or a logits processor changes the logits [`Picker::pick`] is given
    /// (callers that need the model's own distribution, for logprobs, keep a copy first).
    pub fn alters_logits(&self) -> bool {
        self.constraint.is_some() || self.sampler.alters_logits()
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

/// One choice's first token, sampled from the prompt's last logits.
pub struct First {
    pub token: u32,
    /// The token is a stop token: the choice is finished.
    pub is_stop: bool,
    /// Its logprob, when asked for (the model's, before the grammar's mask).
    pub logprob: Option<TokenLogprob>,
    /// The choice's chooser, the token taken (its sampler state and matcher move on from it).
    pub picker: Picker,
}

/// The first token of each of the request's `params.n` choices from the prompt's last `logits`:
/// choice `i` with the sampler of [`SamplingParams::choice`]`(i)` and its own copy of `rules`.
/// Err names the choice whose grammar could not be sampled under.
pub fn first_tokens(params: &SamplingParams, rules: &Rules, logits: &[f32], stop_ids: &[u32]) -> std::result::Result<Vec<First>, (u32, GrammarError)> {
    let n = params.n.max(1);
    let mut firsts = Vec::with_capacity(n as usize);
    for i in 0..n {
        let mut picker = rules.picker(params, i, None);
        let mut masked = logits.to_vec();
        let token = picker.pick(&mut masked).map_err(|e| (i, e))?;
        let logprob = crate::logprobs::of_token(params, logits, token);
        firsts.push(First { token, is_stop: stop_ids.contains(&token), logprob, picker });
    }
    Ok(firsts)
}

/// The chooser of each of a request's `params.n` choices on a worker that did not sample the
/// first tokens (a decode worker: they came from prefill, with each choice's sampler state):
/// each resumes its sampler and takes its first token into its copy of `rules`. Err names the
/// choice whose first token does not fit the grammar.
pub fn resume_pickers(params: &SamplingParams, rules: &Rules, firsts: &[(u32, bool, u64)]) -> std::result::Result<Vec<Picker>, (u32, u32, GrammarError)> {
    let mut pickers = Vec::with_capacity(firsts.len());
    for (i, &(token, is_stop, state)) in firsts.iter().enumerate() {
        let i = i as u32;
        let mut picker = rules.picker(params, i, Some(state));
        if !is_stop {
            picker.commit(token).map_err(|e| (i, token, e))?;
        }
        pickers.push(picker);
    }
    Ok(pickers)
}
