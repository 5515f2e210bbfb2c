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
    /// vLLM's logits processors, applied in [`crate::processors`] before temperature (in this
    /// order: bad words, `min_tokens`, logit bias, repetition, frequency and presence penalty).
    /// Subtracted once per time the token occurs in the output so far (-2 to 2).
    #[serde(default)]
    pub frequency_penalty: f32,
    /// Subtracted once if the token occurs in the output so far (-2 to 2).
    #[serde(default)]
    pub presence_penalty: f32,
    /// Divides a positive logit and multiplies a negative one of every token in the prompt or
    /// the output so far (> 0; 1 is none), as HF's `RepetitionPenaltyLogitsProcessor`.
    #[serde(default = "one_f32")]
    pub repetition_penalty: f32,
    /// Added to these tokens' logits (each -100 to 100, OpenAI's `logit_bias`).
    #[serde(default)]
    pub logit_bias: Vec<(u32, f32)>,
    /// Keep only tokens whose probability (after temperature) is at least this fraction of the
    /// most likely one's (0 to 1; 0 is no cut). Applied before top-k and top-p, as vLLM does.
    #[serde(default)]
    pub min_p: f32,
    /// The stop ids (EOS and `stop_token_ids`) cannot be sampled, and stop strings do not end
    /// the text, before this many tokens were generated (at most `max_tokens`).
    #[serde(default)]
    pub min_tokens: usize,
    /// Words the output never contains: each is tokenized as written and with a leading space
    /// (vLLM's rule), and a token that would complete one of those id sequences is banned.
    #[serde(default)]
    pub bad_words: Vec<String>,
}

fn one() -> u32 {
    1
}

fn one_f32() -> f32 {
    1.0
}

/// The most `logit_bias` entries one request may carry.
pub const MAX_LOGIT_BIAS: usize = 1024;
/// The most `bad_words` one request may carry, and the longest one (bytes).
pub const MAX_BAD_WORDS: usize = 64;
pub const MAX_BAD_WORD_BYTES: usize = 256;

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
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            min_p: 0.0,
            min_tokens: 0,
            bad_words: Vec::new(),
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
    #[error("`{field}` must be a number from -2 to 2, got {got}")]
    Penalty { field: &'static str, got: f32 },
    #[error("`repetition_penalty` must be a finite number > 0 (1 is none), got {0}")]
    RepetitionPenalty(f32),
    #[error("`logit_bias` for token {token} must be a number from -100 to 100, got {got}")]
    LogitBias { token: u32, got: f32 },
    #[error("`logit_bias` has {0} entries; at most {MAX_LOGIT_BIAS}")]
    LogitBiasCount(usize),
    #[error("`min_p` must be a number from 0 to 1, got {0}")]
    MinP(f32),
    #[error("`min_tokens` ({min}) must not exceed max_tokens ({max})")]
    MinTokens { min: usize, max: usize },
    #[error("`logit_bias` names token {token}, outside this model's vocabulary of {vocab}")]
    LogitBiasToken { token: u32, vocab: usize },
    #[error("`bad_words`: at most {MAX_BAD_WORDS} words of 1 to {MAX_BAD_WORD_BYTES} bytes each (word {index} breaks this)")]
    BadWords { index: usize },
}

impl SamplingError {
    /// The request field the error is about (OpenAI's and vLLM's names).
    pub fn field(&self) -> &'static str {
        match self {
            SamplingError::Temperature(_) => "temperature",
            SamplingError::TopP(_) => "top_p",
            SamplingError::MaxTokens(_) => "max_tokens",
            SamplingError::EmptyStop => "stop",
            SamplingError::TopLogprobs { field, .. } | SamplingError::Penalty { field, .. } => field,
            SamplingError::Choices(_) => "n",
            SamplingError::RepetitionPenalty(_) => "repetition_penalty",
            SamplingError::LogitBias { .. } | SamplingError::LogitBiasCount(_) | SamplingError::LogitBiasToken { .. } => "logit_bias",
            SamplingError::MinP(_) => "min_p",
            SamplingError::MinTokens { .. } => "min_tokens",
            SamplingError::BadWords { .. } => "bad_words",
        }
    }
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
        self.validate_processors()
    }

    fn validate_processors(&self) -> Result<(), SamplingError> {
        for (field, got) in [("frequency_penalty", self.frequency_penalty), ("presence_penalty", self.presence_penalty)] {
            if !(-2.0..=2.0).contains(&got) {
                return Err(SamplingError::Penalty { field, got });
            }
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(SamplingError::RepetitionPenalty(self.repetition_penalty));
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS {
            return Err(SamplingError::LogitBiasCount(self.logit_bias.len()));
        }
        if let Some(&(token, got)) = self.logit_bias.iter().find(|(_, b)| !(-100.0..=100.0).contains(b)) {
            return Err(SamplingError::LogitBias { token, got });
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(SamplingError::MinP(self.min_p));
        }
        if self.min_tokens > self.max_tokens {
            return Err(SamplingError::MinTokens { min: self.min_tokens, max: self.max_tokens });
        }
        let bad = |w: &String| w.trim().is_empty() || w.len() > MAX_BAD_WORD_BYTES;
        if let Some(index) = self.bad_words.iter().position(bad).or((self.bad_words.len() > MAX_BAD_WORDS).then_some(MAX_BAD_WORDS)) {
            return Err(SamplingError::BadWords { index });
        }
        Ok(())
    }

    /// The ids that end this request's text: its `stop_token_ids`, and the model's `eos` ids
    /// unless `ignore_eos`.
    pub fn stop_ids(&self, eos: &[u32]) -> Vec<u32> {
        let mut ids = self.stop_token_ids.clone();
        if !self.ignore_eos {
            ids.extend_from_slice(eos);
        }
        ids
    }

    /// Whether any of vLLM's logits processors (penalties, bias, `min_tokens`, bad words) can
    /// change this request's logits: the sampler then works on a processed copy.
    pub fn processes_logits(&self) -> bool {
        self.frequency_penalty != 0.0
            || self.presence_penalty != 0.0
            || self.repetition_penalty != 1.0
            || !self.logit_bias.is_empty()
            || self.min_tokens > 0
            || !self.bad_words.is_empty()
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
        let more = [
            (SamplingParams { frequency_penalty: 2.5, ..ok.clone() }, SamplingError::Penalty { field: "frequency_penalty", got: 2.5 }),
            (SamplingParams { presence_penalty: -3.0, ..ok.clone() }, SamplingError::Penalty { field: "presence_penalty", got: -3.0 }),
            (SamplingParams { repetition_penalty: 0.0, ..ok.clone() }, SamplingError::RepetitionPenalty(0.0)),
            (SamplingParams { logit_bias: vec![(3, 101.0)], ..ok.clone() }, SamplingError::LogitBias { token: 3, got: 101.0 }),
            (SamplingParams { logit_bias: vec![(0, 1.0); MAX_LOGIT_BIAS + 1], ..ok.clone() }, SamplingError::LogitBiasCount(MAX_LOGIT_BIAS + 1)),
            (SamplingParams { min_p: 1.5, ..ok.clone() }, SamplingError::MinP(1.5)),
            (SamplingParams { min_tokens: 9, max_tokens: 8, ..ok.clone() }, SamplingError::MinTokens { min: 9, max: 8 }),
            (SamplingParams { bad_words: vec!["a".into(), " ".into()], ..ok.clone() }, SamplingError::BadWords { index: 1 }),
            (SamplingParams { bad_words: vec!["a".into(); MAX_BAD_WORDS + 1], ..ok.clone() }, SamplingError::BadWords { index: MAX_BAD_WORDS }),
        ];
        for (p, e) in more {
            assert!(p.processes_logits() || matches!(e, SamplingError::MinP(_)));
            assert_eq!(p.validate(), Err(e));
        }
        assert!(!ok.processes_logits());
        assert!(SamplingParams { temperature: f32::NAN, ..ok.clone() }.validate().is_err());
        assert!(SamplingParams { repetition_penalty: f32::NAN, ..ok.clone() }.validate().is_err());
        assert!(SamplingParams { frequency_penalty: f32::NAN, ..ok.clone() }.validate().is_err());
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
