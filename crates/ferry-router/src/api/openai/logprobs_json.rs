//! Log-probabilities in the OpenAI API: the request fields that ask for them, and the JSON that
//! answers them, from the per-token logprobs the workers return (`TokenDelta.logprobs` and
//! `prompt_logprobs`; the model's log-softmax before temperature, top-k and top-p).
//!
//! - Chat: `logprobs: true` and `top_logprobs` (0..=20) give `choices[].logprobs.content[]`,
//!   each `{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`.
//! - Completions: `logprobs: N` (0..=20; OpenAI caps it at 5, vLLM at 20) gives
//!   `choices[].logprobs = {tokens, token_logprobs, top_logprobs, text_offset}`, where each
//!   `top_logprobs` entry maps token text to logprob for the N most likely tokens plus the chosen
//!   one (as vLLM). `echo: true` prepends the prompt to the text and, with `logprobs`, the prompt
//!   tokens' entries (the first one's `null`: nothing precedes it), what evaluation harnesses
//!   score.
//!
//! A token's text is its bytes as UTF-8 (U+FFFD for part of a character; `bytes` is exact);
//! `text_offset` counts characters of those texts from the start of the returned text, special
//! tokens counting none (they are not in the text).

use std::sync::Arc;

use ferry_core::MAX_TOP_LOGPROBS;
use ferry_proto::v1::{self, generate_request::Input};
use serde_json::{Map, Value, json};

use super::error::ApiError;
use crate::error::clip;
use super::body::Kind;
use crate::state::Shared;

/// What a request asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Want {
    /// Alternatives per token; None: no logprobs.
    pub top: Option<u32>,
    /// Completions' `echo`: the prompt comes first in the answer.
    pub echo: bool,
}

impl Want {
    /// The worker-side request: logprobs of generated tokens, and of the prompt's with `echo`.
    pub fn apply(&self, s: &mut v1::SamplingParams) {
        s.logprobs = self.top;
        s.prompt_logprobs = if self.echo { self.top } else { None };
    }
}

fn top_in_range(n: i64, field: &'static str) -> Result<u32, ApiError> {
    u32::try_from(n).ok().filter(|&n| n <= MAX_TOP_LOGPROBS).ok_or_else(|| {
        ApiError::invalid(format!("`{field}` must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {n}"), Some(field))
    })
}

/// An integer field, or None when absent or null.
fn int(obj: &Map<String, Value>, field: &'static str) -> Result<Option<i64>, ApiError> {
    match obj.get(field) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_i64().map(Some).ok_or_else(|| ApiError::invalid(format!("`{field}` must be an integer, not {}", clip(&v.to_string())), Some(field))),
    }
}

/// `logprobs`, `top_logprobs` and `echo` of a request to `kind`.
pub fn parse(kind: Kind, obj: &Map<String, Value>) -> Result<Want, ApiError> {
    let echo = match obj.get("echo") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) if kind == Kind::Completion => true,
        Some(Value::Bool(true)) => return Err(ApiError::invalid("`echo` is only for /v1/completions", Some("echo"))),
        Some(v) => return Err(ApiError::invalid(format!("`echo` must be a boolean, not {}", clip(&v.to_string())), Some("echo"))),
    };
    let top = match kind {
        Kind::Chat => {
            let on = match obj.get("logprobs") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => return Err(ApiError::invalid(format!("`logprobs` must be a boolean for chat, not {}", clip(&v.to_string())), Some("logprobs"))),
            };
            match (on, int(obj, "top_logprobs")?) {
                (true, n) => Some(n.map(|n| top_in_range(n, "top_logprobs")).transpose()?.unwrap_or(0)),
                (false, None) => None,
                (false, Some(_)) => return Err(ApiError::invalid("`top_logprobs` needs `logprobs: true`", Some("top_logprobs"))),
            }
        }
        Kind::Completion => match obj.get("logprobs") {
            // `false` is taken as "none", as before this field was supported.
            None | Some(Value::Null) | Some(Value::Bool(false)) => None,
            Some(_) => int(obj, "logprobs")?.map(|n| top_in_range(n, "logprobs")).transpose()?,
        },
    };
    Ok(Want { top, echo })
}

/// The prompt as text, for `echo`: the request's own text, or its token ids decoded.
pub fn prompt_text(shared: &Shared, input: Option<&Input>) -> String {
    match input {
        Some(Input::Prompt(s)) => s.clone(),
        Some(Input::Tokens(t)) => shared.text.tokenizer.decode(&t.ids, true).unwrap_or_default(),
        Some(Input::Chat(_)) | None => String::new(),
    }
}

/// Builds a request's logprobs JSON, whole or chunk by chunk (it keeps the text offset): one
/// per choice.
#[derive(Clone)]
pub struct Render {
    shared: Arc<Shared>,
    kind: Kind,
    want: Want,
    /// The prompt's first token (the one without a logprob), for `echo`.
    first_prompt_token: Option<u32>,
    /// Characters of text before the next token (completions' `text_offset`).
    offset: usize,
}

/// One answer's logprob entries as they arrive: the prompt's (after its first token) and the
/// generated tokens'.
#[derive(Default)]
pub struct Collected {
    pub prompt: Option<Vec<v1::TokenLogprob>>,
    pub generated: Vec<v1::TokenLogprob>,
}

/// Whether `d` is the delta of the prompt's logprobs (the router sends it alone, with no ids
/// and no text; a one-token prompt's is empty).
pub fn is_prompt_delta(d: &v1::TokenDelta) -> bool {
    d.token_ids.is_empty() && d.text.is_empty()
}

impl Collected {
    pub fn push(&mut self, d: &v1::TokenDelta) {
        if is_prompt_delta(d) {
            self.prompt.get_or_insert_with(Vec::new).extend(d.prompt_logprobs.iter().cloned());
        }
        self.generated.extend(d.logprobs.iter().cloned());
    }
}

impl Render {
    pub fn new(shared: Arc<Shared>, kind: Kind, want: Want, first_prompt_token: Option<u32>) -> Render {
        Render { shared, kind, want, first_prompt_token, offset: 0 }
    }

    pub fn wanted(&self) -> bool {
        self.want.top.is_some()
    }

    /// A token's text and bytes (empty for an id the tokenizer does not know).
    fn token(&self, id: u32) -> (String, Vec<u8>) {
        let bytes = self.shared.text.tokenizer.token_bytes(id).unwrap_or_default();
        (String::from_utf8_lossy(&bytes).into_owned(), bytes)
    }

    /// The `logprobs` of an answer or chunk carrying these entries: `prompt` (with `echo`, the
    /// prompt's, after its first token) then `generated`. Null when none were asked for.
    pub fn render(&mut self, prompt: Option<&[v1::TokenLogprob]>, generated: &[v1::TokenLogprob]) -> Value {
        if !self.wanted() {
            return Value::Null;
        }
        match self.kind {
            Kind::Chat => json!({"content": generated.iter().map(|l| self.chat_entry(l)).collect::<Vec<_>>()}),
            Kind::Completion => {
                let mut c = CompletionLogprobs::default();
                if let (true, Some(p)) = (self.want.echo, prompt) {
                    if let Some(first) = self.first_prompt_token {
                        self.completion_entry(&mut c, first, None);
                    }
                    p.iter().for_each(|l| self.completion_entry(&mut c, l.token_id, Some(l)));
                }
                generated.iter().for_each(|l| self.completion_entry(&mut c, l.token_id, Some(l)));
                json!({"tokens": c.tokens, "token_logprobs": c.token_logprobs, "top_logprobs": c.top_logprobs, "text_offset": c.text_offset})
            }
        }
    }

    /// A whole answer's `logprobs`.
    pub fn whole(&mut self, c: &Collected) -> Value {
        self.render(c.prompt.as_deref(), &c.generated)
    }

    fn chat_entry(&self, l: &v1::TokenLogprob) -> Value {
        let one = |id: u32, lp: f32| {
            let (token, bytes) = self.token(id);
            json!({"token": token, "logprob": lp, "bytes": bytes})
        };
        let mut e = one(l.token_id, l.logprob);
        e["top_logprobs"] = l.top.iter().map(|t| one(t.token_id, t.logprob)).collect();
        e
    }

    fn completion_entry(&mut self, c: &mut CompletionLogprobs, id: u32, l: Option<&v1::TokenLogprob>) {
        let (text, _) = self.token(id);
        c.text_offset.push(self.offset);
        if !self.shared.text.tokenizer.is_special(id) {
            self.offset += text.chars().count();
        }
        c.tokens.push(Value::String(text));
        c.token_logprobs.push(l.map_or(Value::Null, |l| json!(l.logprob)));
        c.top_logprobs.push(match l {
            None => Value::Null,
            Some(l) => {
                // Alternatives with the same text collapse onto the most likely one.
                let mut top = Map::new();
                for t in &l.top {
                    top.entry(self.token(t.token_id).0).or_insert(json!(t.logprob));
                }
                // The chosen token is always in (vLLM's shape: up to N + 1 entries).
                top.entry(self.token(l.token_id).0).or_insert(json!(l.logprob));
                Value::Object(top)
            }
        });
    }
}

#[derive(Default)]
struct CompletionLogprobs {
    tokens: Vec<Value>,
    token_logprobs: Vec<Value>,
    top_logprobs: Vec<Value>,
    text_offset: Vec<usize>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(kind: Kind, body: &str) -> Result<Want, ApiError> {
        let Value::Object(o) = serde_json::from_str::<Value>(body).unwrap() else { panic!("{body}") };
        parse(kind, &o)
    }

    #[test]
    fn fields_table() {
        let ok = [
            (Kind::Chat, r#"{}"#, Want { top: None, echo: false }),
            (Kind::Chat, r#"{"logprobs": false}"#, Want { top: None, echo: false }),
            (Kind::Chat, r#"{"logprobs": true}"#, Want { top: Some(0), echo: false }),
            (Kind::Chat, r#"{"logprobs": true, "top_logprobs": 20}"#, Want { top: Some(20), echo: false }),
            (Kind::Chat, r#"{"logprobs": null, "top_logprobs": null}"#, Want { top: None, echo: false }),
            (Kind::Completion, r#"{"logprobs": 0}"#, Want { top: Some(0), echo: false }),
            (Kind::Completion, r#"{"logprobs": 5, "echo": true}"#, Want { top: Some(5), echo: true }),
            (Kind::Completion, r#"{"echo": true}"#, Want { top: None, echo: true }),
            (Kind::Completion, r#"{"logprobs": false, "echo": false}"#, Want { top: None, echo: false }),
        ];
        for (kind, body, w) in ok {
            assert_eq!(want(kind, body).unwrap_or_else(|e| panic!("{body}: {e:?}")), w, "{body}");
        }
        let bad = [
            (Kind::Chat, r#"{"logprobs": true, "top_logprobs": 21}"#, "top_logprobs", "from 0 to 20"),
            (Kind::Chat, r#"{"logprobs": true, "top_logprobs": -1}"#, "top_logprobs", "from 0 to 20"),
            (Kind::Chat, r#"{"logprobs": true, "top_logprobs": 2.5}"#, "top_logprobs", "an integer"),
            (Kind::Chat, r#"{"top_logprobs": 3}"#, "top_logprobs", "needs `logprobs: true`"),
            (Kind::Chat, r#"{"logprobs": 3}"#, "logprobs", "a boolean"),
            (Kind::Chat, r#"{"echo": true}"#, "echo", "only for /v1/completions"),
            (Kind::Completion, r#"{"logprobs": 21}"#, "logprobs", "from 0 to 20"),
            (Kind::Completion, r#"{"logprobs": true}"#, "logprobs", "an integer"),
            (Kind::Completion, r#"{"logprobs": "2"}"#, "logprobs", "an integer"),
            (Kind::Completion, r#"{"echo": 1}"#, "echo", "a boolean"),
        ];
        for (kind, body, param, needle) in bad {
            let e = want(kind, body).expect_err(body);
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{body}");
            assert!(e.message.contains(needle), "{body}: {}", e.message);
        }
    }

    #[test]
    fn sampling_asks_workers_for_what_the_answer_needs() {
        let mut s = v1::SamplingParams::default();
        Want { top: Some(3), echo: true }.apply(&mut s);
        assert_eq!((s.logprobs, s.prompt_logprobs), (Some(3), Some(3)));
        Want { top: Some(2), echo: false }.apply(&mut s);
        assert_eq!((s.logprobs, s.prompt_logprobs), (Some(2), None));
        Want { top: None, echo: true }.apply(&mut s);
        assert_eq!((s.logprobs, s.prompt_logprobs), (None, None));
    }

    #[test]
    fn collected_keeps_the_prompt_apart() {
        let lp = |id| v1::TokenLogprob { token_id: id, logprob: -1.0, top: vec![] };
        let mut c = Collected::default();
        c.push(&v1::TokenDelta { prompt_logprobs: vec![lp(5), lp(6)], ..Default::default() });
        c.push(&v1::TokenDelta { text: "a".into(), token_ids: vec![7], logprobs: vec![lp(7)], ..Default::default() });
        c.push(&v1::TokenDelta { text: "b".into(), ..Default::default() });
        assert_eq!(c.prompt.as_ref().map(|p| p.iter().map(|l| l.token_id).collect::<Vec<_>>()), Some(vec![5, 6]));
        assert_eq!(c.generated.iter().map(|l| l.token_id).collect::<Vec<_>>(), [7]);
        // A one-token prompt has no prompt logprobs: its (empty) delta still says they came.
        let mut c = Collected::default();
        c.push(&v1::TokenDelta::default());
        assert_eq!(c.prompt, Some(vec![]));
    }
}
