//! Sampling parameters: what a request asks of the token chooser, validated before any work starts.

use crate::logprobs::MAX_TOP_LOGPROBS;
use thiserror::Error;

#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    /// 1.0 means no nucleus cut.
    pub top_p: f32,
    /// Seed for reproducible sampling; None draws one.
    pub seed: Option<u64>,
    pub max_tokens: usize,
    /// Generation stops after emitting one of these (the model's EOS ids are added by the engine
    /// unless `ignore_eos`).
    pub stop_token_ids: Vec<u32>,
    /// Generation stops when the text contains one of these; the stop string is not returned.
    pub stop_strings: Vec<String>,
    pub ignore_eos: bool,
    /// The index, within the completion, of the first token this call samples (0 for a fresh
    /// request). A request continued elsewhere (prompt + the tokens already generated as the new
    /// prompt, `max_tokens` reduced by their count) passes their count here with the same seed,
    /// and samples what the first run would have: the sampler's draw for token `i` depends only
    /// on (seed, `i`).
    #[serde(default)]
    pub token_offset: u32,
    /// Structured output: every sampled token must keep the completion inside this grammar.
    #[serde(default)]
    pub grammar: Option<OutputGrammar>,
    /// Return each generated token's log-probability with this many most likely alternatives
    /// (0..=[`MAX_TOP_LOGPROBS`]); None: no logprobs. See [`crate::logprobs`].
    #[serde(default)]
    pub logprobs: Option<u32>,
    /// Return the prompt tokens' log-probabilities (every one but the first), each with this
    /// many alternatives (0..=[`MAX_TOP_LOGPROBS`]); None: none. The prompt is then computed
    /// whole, at every position: its cached prefix is not used.
    #[serde(default)]
    pub prompt_logprobs: Option<u32>,
    /// Completions to generate for the prompt (OpenAI's `n`): one prefill, then `n` sequences
    /// that share the prompt's KV blocks. Choice `i` samples as a one-choice request whose seed
    /// is `seed + i` would ([`SamplingParams::choice`]).
    #[serde(default = "one")]
    pub n: u32,
}

fn one() -> u32 {
    1
}

/// The most completions one request may ask for (`n`).
pub const MAX_CHOICES: u32 = 16;

/// What a constrained completion must be (structured outputs). Compiled by `ferry-grammar`
/// (llguidance) into a per-token mask on whichever worker samples.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum OutputGrammar {
    /// JSON matching this JSON schema (its text).
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// Text matching this regular expression (Rust `regex` syntax, anchored at both ends).
    Regex(String),
    /// Text in this context-free grammar (llguidance's Lark dialect).
    Lark(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            max_tokens: 128,
            stop_token_ids: Vec::new(),
            stop_strings: Vec::new(),
            ignore_eos: false,
            token_offset: 0,
            grammar: None,
            logprobs: None,
            prompt_logprobs: None,
            n: 1,
        }
    }
}

#[derive(Debug, Error, PartialEq)]
pub enum SamplingError {
    #[error("temperature must be a finite number >= 0, got {0}")]
    Temperature(f32),
    #[error("top_p must be in (0, 1], got {0}")]
    TopP(f32),
    #[error("max_tokens must be >= 1, got {0}")]
    MaxTokens(usize),
    #[error("stop strings must be non-empty")]
    EmptyStop,
    #[error("{field} must be between 0 and {MAX_TOP_LOGPROBS}, got {got}")]
    TopLogprobs { field: &'static str, got: u32 },
    #[error("n (completions per request) must be between 1 and {MAX_CHOICES}, got {0}")]
    Choices(u32),
}

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        Self { max_tokens, ..Self::default() }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }

    /// The parameters of choice `i` of an `n`-choice request, as a one-choice request: the seed
    /// is `seed + i` (vLLM's rule), so every choice is reproducible on its own, and choice 0 is
    /// what the same request with `n = 1` answers. Greedy choices are all alike.
    pub fn choice(&self, i: u32) -> SamplingParams {
        SamplingParams { n: 1, seed: self.seed.map(|s| s.wrapping_add(u64::from(i))), ..self.clone() }
    }

    pub fn validate(&self) -> Result<(), SamplingError> {
        if !(1..=MAX_CHOICES).contains(&self.n) {
            return Err(SamplingError::Choices(self.n));
        }
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::Temperature(self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(SamplingError::TopP(self.top_p));
        }
        if self.max_tokens == 0 {
            return Err(SamplingError::MaxTokens(0));
        }
        if self.stop_strings.iter().any(|s| s.is_empty()) {
            return Err(SamplingError::EmptyStop);
        }
        for (field, n) in [("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)] {
            if let Some(got) = n.filter(|&n| n > MAX_TOP_LOGPROBS) {
                return Err(SamplingError::TopLogprobs { field, got });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_table() {
        let ok = SamplingParams::default();
        assert_eq!(ok.validate(), Ok(()));
        let cases = [
            (SamplingParams { temperature: -1.0, ..ok.clone() }, SamplingError::Temperature(-1.0)),
            (SamplingParams { top_p: 0.0, ..ok.clone() }, SamplingError::TopP(0.0)),
            (SamplingParams { top_p: 1.5, ..ok.clone() }, SamplingError::TopP(1.5)),
            (SamplingParams { max_tokens: 0, ..ok.clone() }, SamplingError::MaxTokens(0)),
            (SamplingParams { stop_strings: vec![String::new()], ..ok.clone() }, SamplingError::EmptyStop),
            (SamplingParams { logprobs: Some(21), ..ok.clone() }, SamplingError::TopLogprobs { field: "logprobs", got: 21 }),
            (SamplingParams { prompt_logprobs: Some(99), ..ok.clone() }, SamplingError::TopLogprobs { field: "prompt_logprobs", got: 99 }),
            (SamplingParams { n: 0, ..ok.clone() }, SamplingError::Choices(0)),
            (SamplingParams { n: MAX_CHOICES + 1, ..ok.clone() }, SamplingError::Choices(MAX_CHOICES + 1)),
        ];
        for (p, e) in cases {
            assert_eq!(p.validate(), Err(e));
        }
        assert!(SamplingParams { temperature: f32::NAN, ..ok.clone() }.validate().is_err());
        assert_eq!(SamplingParams { logprobs: Some(20), prompt_logprobs: Some(0), n: MAX_CHOICES, ..ok }.validate(), Ok(()));
    }

    #[test]
    fn each_choice_is_a_one_choice_request_with_its_own_seed() {
        let p = SamplingParams { n: 3, seed: Some(u64::MAX), temperature: 0.8, ..SamplingParams::default() };
        // (choice, seed)
        for (i, seed) in [(0, Some(u64::MAX)), (1, Some(0)), (2, Some(1))] {
            assert_eq!(p.choice(i), SamplingParams { n: 1, seed, ..p.clone() }, "choice {i}");
        }
        assert_eq!(SamplingParams { n: 2, ..SamplingParams::default() }.choice(1).seed, None);
    }
}
