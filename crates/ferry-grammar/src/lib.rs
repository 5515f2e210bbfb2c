//! Structured outputs: a request's [`OutputGrammar`] (JSON schema, any JSON object, regex, Lark
//! grammar, or a fixed choice) compiled by llguidance (the grammar engine behind vLLM's, SGLang's
//! and llama.cpp's guidance backends) into a per-token mask over the model's vocabulary.
//!
//! One [`Grammars`] per model (the token trie is built once from the tokenizer). Each request that
//! asks for structure gets a [`Constraint`]: before a token is sampled, [`Constraint::mask`] sets
//! every token the grammar forbids to -inf; after, [`Constraint::commit`] advances the matcher.
//!
//! The matcher's state is the grammar plus the tokens it has consumed, so it crosses the
//! prefill -> decode hop (and a migration) as exactly that: every worker that samples builds the
//! constraint from the request's grammar and replays the completion so far
//! ([`Grammars::constraint`]'s `replay`). Nothing opaque travels between workers.
//!
//! A grammar is hostile input (issue 32): before it compiles it must fit [`Limits`]
//! ([`limits::check`]); it compiles under llguidance's fuel limits, off the async runtime on a
//! [`CompilePool`] of large-stack threads ([`LazyGrammars::check`], [`LazyGrammars::constraint`]),
//! and its first mask is computed at once, so every failure a worker would meet shows at the
//! router's check. Messages are cut to a clean first line ([`message::clean`]).

use std::sync::Arc;

use ferry_core::sampling::OutputGrammar;
use ferry_tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

mod finite;
mod lazy;
pub mod limits;
pub mod message;
pub mod pool;

pub use lazy::LazyGrammars;
pub use limits::Limits;
pub use pool::{CompilePool, PoolConfig};

/// Which kind of grammar a request asked for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GrammarKind {
    JsonSchema,
    JsonObject,
    Regex,
    Lark,
    Choice,
}

impl GrammarKind {
    pub fn of(g: &OutputGrammar) -> Self {
        match g {
            OutputGrammar::JsonSchema(_) => GrammarKind::JsonSchema,
            OutputGrammar::JsonObject => GrammarKind::JsonObject,
            OutputGrammar::Regex(_) => GrammarKind::Regex,
            OutputGrammar::Lark(_) => GrammarKind::Lark,
            OutputGrammar::Choice(_) => GrammarKind::Choice,
        }
    }

    /// Its field in the wire's `StructuredOutput` (gRPC clients' name for it).
    pub fn wire_field(self) -> &'static str {
        match self {
            GrammarKind::JsonSchema => "json_schema",
            GrammarKind::JsonObject => "json_object",
            GrammarKind::Regex => "regex",
            GrammarKind::Lark => "lark",
            GrammarKind::Choice => "choice",
        }
    }
}

impl std::fmt::Display for GrammarKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            GrammarKind::JsonSchema => "JSON schema",
            GrammarKind::JsonObject => "JSON object grammar",
            GrammarKind::Regex => "regular expression",
            GrammarKind::Lark => "Lark grammar",
            GrammarKind::Choice => "choice list",
        })
    }
}

/// Every message here is fit for a client: llguidance's text only through [`message::clean`].
#[derive(Clone, Debug, thiserror::Error)]
pub enum GrammarError {
    /// The model's tokenizer cannot be turned into a token trie (final: no request can use a
    /// grammar with this model).
    #[error("structured outputs are not available for this model's tokenizer: {0}")]
    Tokenizer(String),
    /// The request's grammar is malformed or unsupported (final: the request is invalid).
    #[error("invalid {kind}: {message}")]
    Invalid { kind: GrammarKind, message: String },
    /// The grammar exceeds one of the [`Limits`] (final).
    #[error("invalid {kind}: {what} is {value}, above the limit of {max}")]
    Limit { kind: GrammarKind, what: &'static str, value: u64, max: u64 },
    /// Compiling the grammar (with its first mask) took longer than the pool's budget (final: it
    /// would again).
    #[error("invalid {kind}: it did not compile within the {budget_ms} ms budget")]
    Timeout { kind: GrammarKind, budget_ms: u64 },
    /// The grammar engine panicked on this grammar (final: it would again).
    #[error("invalid {kind}: the grammar engine failed on it")]
    Panicked { kind: GrammarKind },
    /// Every compile thread is taken and the request waited its turn too long (retryable: the
    /// grammar may be fine; come back shortly).
    #[error("the grammar compiler is busy (waited {waited_ms} ms for a thread): retry shortly")]
    Busy { waited_ms: u64 },
    /// The compile threads could not be started (final for this process).
    #[error("structured outputs are unavailable: the compile threads did not start: {0}")]
    Threads(String),
    /// The matcher refused a token or failed (the completion so far does not fit the grammar).
    #[error("the structured-output matcher failed: {0}")]
    Matcher(String),
}

impl GrammarError {
    /// The kind of grammar refused, where the refusal is about one.
    pub fn kind(&self) -> Option<GrammarKind> {
        match self {
            GrammarError::Invalid { kind, .. }
            | GrammarError::Limit { kind, .. }
            | GrammarError::Timeout { kind, .. }
            | GrammarError::Panicked { kind } => Some(*kind),
            GrammarError::Tokenizer(_) | GrammarError::Busy { .. } | GrammarError::Threads(_) | GrammarError::Matcher(_) => None,
        }
    }

    /// llguidance's `raw` message, cleaned, as a refusal of a `kind` grammar.
    fn invalid(kind: GrammarKind, raw: &str) -> Self {
        GrammarError::Invalid { kind, message: message::clean(raw, "the grammar engine refused it") }
    }
}

/// The grammar engine for one model: its token trie and llguidance's parser factory.
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
    limits: Limits,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").field("vocab", &self.vocab).finish()
    }
}

/// The tokenizer as llguidance sees it: each token's bytes (special tokens behind the trie's
/// marker, so no grammar can spell them as text), and the tokenizer itself for forced strings.
struct Env {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Only whole UTF-8 text reaches here from grammars; lossy keeps it total.
        self.tokenizer.encode(&String::from_utf8_lossy(s), false).unwrap_or_default()
    }
}

impl Grammars {
    /// Builds the token trie for `tokenizer`, padded to the model's `vocab` (its logits' width;
    /// ids past the tokenizer's are never allowed). `None`: the tokenizer's own size (enough to
    /// check grammars, as the router does).
    pub fn new(tokenizer: &Tokenizer, vocab: Option<usize>) -> Result<Self, GrammarError> {
        Self::with_limits(tokenizer, vocab, Limits::default())
    }

    /// [`Grammars::new`], compiling under `limits`.
    pub fn with_limits(tokenizer: &Tokenizer, vocab: Option<usize>, limits: Limits) -> Result<Self, GrammarError> {
        let text = tokenizer.to_json().map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        let vocab = vocab.unwrap_or(words.len());
        if words.len() > vocab {
            return Err(GrammarError::Tokenizer(format!("the tokenizer has {} tokens but the model only {vocab} logits", words.len())));
        }
        while words.len() < vocab {
            // Ids the tokenizer does not know: special placeholders, never text.
            let mut name = format!(".<[{}]>", words.len()).into_bytes();
            name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(name);
        }
        let eos = tokenizer.eos_ids();
        let Some(&first_eos) = eos.first() else {
            return Err(GrammarError::Tokenizer("the model has no end-of-sequence token to finish a grammar with".into()));
        };
        let info = TokRxInfo { tok_bos: tokenizer.bos_id(), ..TokRxInfo::new(vocab as u32, first_eos) };
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let env: TokEnv = Arc::new(Env { trie, tokenizer: tokenizer.clone() });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        // Errors come back to the caller; llguidance's own stderr logging stays off.
        factory.quiet();
        *factory.limits_mut() = limits.parser_limits();
        Ok(Self { factory, vocab, limits })
    }

    /// The width of the masks (the model's vocabulary).
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// The limits grammars compile under.
    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Checks that `grammar` fits the limits, compiles, and yields its first mask (the router
    /// does this before any worker sees it). Runs on the calling thread: servers go through
    /// [`LazyGrammars::check`], which runs it on the compile pool.
    pub fn check(&self, grammar: &OutputGrammar) -> Result<(), GrammarError> {
        self.constraint(grammar, &[]).map(drop)
    }

    /// A constraint for one request, advanced over `replay` (the completion's tokens already
    /// sampled elsewhere: the first token on the decode worker, the generated tail of the prompt
    /// after a migration). Its mask is computed once here: some grammars (a `$ref` cycle,
    /// `a{1000}{1000}`) compile and fail only there.
    pub fn constraint(&self, grammar: &OutputGrammar, replay: &[u32]) -> Result<Constraint, GrammarError> {
        let kind = GrammarKind::of(grammar);
        limits::check(grammar, &self.limits)?;
        let top = top_level(grammar).map_err(|message| GrammarError::invalid(kind, &message))?;
        let parser = self.factory.create_parser(top).map_err(|e| GrammarError::invalid(kind, &e.to_string()))?;
        let mut c = Constraint { matcher: Matcher::new(Ok(parser)) };
        for &t in replay {
            c.commit(t)?;
        }
        c.matcher
            .compute_mask_or_eos()
            .map_err(|e| GrammarError::invalid(kind, &format!("its first token mask cannot be computed: {e}")))?;
        Ok(c)
    }
}

/// llguidance's grammar for `g`. JSON comes out compact (no free whitespace, which small models
/// otherwise fill until max_tokens) unless the schema sets `x-guidance` itself.
fn top_level(g: &OutputGrammar) -> Result<TopLevelGrammar, String> {
    let json_schema = |mut schema: Value| -> Result<TopLevelGrammar, String> {
        let Value::Object(obj) = &mut schema else {
            return Err("a JSON schema must be a JSON object".into());
        };
        obj.entry("x-guidance").or_insert_with(|| json!({"whitespace_flexible": false}));
        Ok(TopLevelGrammar::from_json_schema(schema))
    };
    match g {
        OutputGrammar::JsonSchema(text) => json_schema(serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?),
        OutputGrammar::JsonObject => json_schema(json!({"type": "object"})),
        OutputGrammar::Regex(rx) => Ok(TopLevelGrammar::from_regex(rx)),
        OutputGrammar::Lark(src) => {
            if src.trim().is_empty() {
                return Err("the grammar is empty".into());
            }
            Ok(TopLevelGrammar::from_lark(src.clone()))
        }
        OutputGrammar::Choice(choices) => {
            if choices.is_empty() {
                return Err("at least one choice is needed".into());
            }
            // Lark string literals are JSON strings, so any choice text is quoted exactly.
            let alts = choices.iter().map(|c| serde_json::to_string(c).map_err(|e| e.to_string())).collect::<Result<Vec<String>, String>>()?;
            Ok(TopLevelGrammar::from_lark(format!("start: {}", alts.join(" | "))))
        }
    }
}

/// One request's matcher.
pub struct Constraint {
    matcher: Matcher,
}

impl Constraint {
    /// An independent copy in the same state (one more choice of an `n`-choice request, from
    /// where this one stands).
    pub fn fork(&self) -> Constraint {
        Constraint { matcher: self.matcher.deep_clone() }
    }

    /// Sets the logit of every token the grammar forbids now to -inf. Once the grammar is
    /// complete only the end-of-sequence tokens remain.
    pub fn mask(&mut self, logits: &mut [f32]) -> Result<(), GrammarError> {
        let mask = self.matcher.compute_mask_or_eos().map_err(|e| GrammarError::Matcher(message::clean(&e.to_string(), "the mask could not be computed")))?;
        for (i, l) in logits.iter_mut().enumerate() {
            if !mask.is_allowed(i as TokenId) {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances over a sampled token. End-of-sequence tokens are accepted once the grammar can
    /// finish.
    pub fn commit(&mut self, token: u32) -> Result<(), GrammarError> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| GrammarError::Matcher(format!("token {token}: {}", message::clean(&e.to_string(), "refused"))))
    }

    /// The grammar is complete and admits nothing more: the sequence can finish now.
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod hostile_tests;
