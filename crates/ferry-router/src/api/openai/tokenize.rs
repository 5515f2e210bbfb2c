//! `POST /tokenize` and `POST /detokenize`, in vLLM's shapes, with the router's own tokenizer and
//! chat template (the ones generation uses, so counts match `usage.prompt_tokens`):
//!
//! - tokenize `{model?, prompt, add_special_tokens?, return_token_strs?}` or
//!   `{model?, messages, add_generation_prompt?, add_special_tokens?, return_token_strs?}` answers
//!   `{count, max_model_len, tokens, token_strs?}`;
//! - detokenize `{model?, tokens}` answers `{prompt}`.
//!
//! Parsing is pure; unknown fields and wrong types are a 400 naming the field, as on `/v1/*`.

use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::fields::{self, Field, On, Support};
use super::body::{Kind, field, required, token_ids, wrong_type};
use crate::api::prompt::encode_chat;
use crate::state::Shared;

/// The fields of a tokenize request.
const TOKENIZE_FIELDS: &[Field] = &[
    Field { name: "model", on: On::Both, support: Support::Supported },
    Field { name: "prompt", on: On::Completions, support: Support::Supported },
    Field { name: "messages", on: On::Chat, support: Support::Supported },
    Field { name: "add_generation_prompt", on: On::Chat, support: Support::Supported },
    Field { name: "add_special_tokens", on: On::Both, support: Support::Supported },
    Field { name: "return_token_strs", on: On::Both, support: Support::Supported },
];

/// What to tokenize.
#[derive(Clone, Debug, PartialEq)]
pub enum Source {
    Prompt(String),
    Chat { messages: Vec<ferry_tokenizer::ChatMessage>, add_generation_prompt: bool },
}

#[derive(Clone, Debug, PartialEq)]
pub struct Tokenize {
    pub model: Option<String>,
    pub source: Source,
    /// Whether to add the model's special tokens (BOS): vLLM's default is true for a prompt and
    /// false for messages (the chat template writes them).
    pub add_special_tokens: bool,
    pub return_token_strs: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Detokenize {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
}

fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(ApiError::invalid("the request body must be a JSON object", None)),
        Err(e) => Err(ApiError::invalid(format!("malformed JSON body: {e}"), None)),
    }
}

/// Parses a `/tokenize` body: `prompt` or `messages`, not both.
pub fn parse_tokenize(body: &[u8]) -> Result<Tokenize, ApiError> {
    let obj = object(body)?;
    let kind = match (obj.contains_key("prompt"), obj.contains_key("messages")) {
        (true, true) => {
            return Err(ApiError::invalid("send `prompt` or `messages`, not both", Some("messages")));
        }
        (true, false) => Kind::Completion,
        (false, true) => Kind::Chat,
        (false, false) => return Err(required("prompt")),
    };
    fields::check(TOKENIZE_FIELDS, kind, &obj, "")?;
    let source = match kind {
        Kind::Completion => match obj.get("prompt") {
            Some(Value::String(s)) => Source::Prompt(s.clone()),
            Some(other) => return Err(wrong_type("prompt", "a string", other)),
            None => return Err(required("prompt")),
        },
        Kind::Chat => Source::Chat {
            messages: super::messages::parse(obj.get("messages"))?,
            add_generation_prompt: field(&obj, "add_generation_prompt")?.unwrap_or(true),
        },
    };
    Ok(Tokenize {
        model: field(&obj, "model")?,
        add_special_tokens: field(&obj, "add_special_tokens")?.unwrap_or(kind == Kind::Completion),
        return_token_strs: field(&obj, "return_token_strs")?.unwrap_or(false),
        source,
    })
}

/// Parses a `/detokenize` body.
pub fn parse_detokenize(body: &[u8]) -> Result<Detokenize, ApiError> {
    const FIELDS: &[Field] = &[
        Field { name: "model", on: On::Both, support: Support::Supported },
        Field { name: "tokens", on: On::Both, support: Support::Supported },
    ];
    let obj = object(body)?;
    fields::check(FIELDS, Kind::Completion, &obj, "")?;
    let tokens = match obj.get("tokens") {
        None | Some(Value::Null) => return Err(required("tokens")),
        Some(Value::Array(a)) => token_ids(a).ok_or_else(|| {
            ApiError::invalid("`tokens` must be an array of token ids (integers from 0 to 2^32-1)", Some("tokens"))
        })?,
        Some(other) => return Err(wrong_type("tokens", "an array of token ids", other)),
    };
    Ok(Detokenize { model: field(&obj, "model")?, tokens })
}

/// A model named in a tokenizer request must be one this router serves (400, as vLLM's tokenizer
/// endpoints answer).
fn check_model(shared: &Shared, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if !shared.serves(m) => Err(ApiError {
            code: Some("model_not_found"),
            ..ApiError::invalid(
                format!("the model `{}` does not exist (served: {})", crate::error::clip(m), shared.model_names().join(", ")),
                Some("model"),
            )
        }),
        _ => Ok(()),
    }
}

/// Answers a `/tokenize` body.
pub fn tokenize(shared: &Shared, body: &[u8]) -> Result<Value, ApiError> {
    let t = parse_tokenize(body)?;
    check_model(shared, t.model.as_deref())?;
    let text = &shared.text;
    let special = t.add_special_tokens && text.add_special_tokens;
    let tokens = match &t.source {
        Source::Prompt(p) => text.tokenizer.encode(p, special).map_err(|e| ApiError::from(crate::RouterError::Tokenize(e)))?,
        // As generation tokenizes a chat: message text is plain text, never special tokens.
        Source::Chat { messages, add_generation_prompt } => {
            encode_chat(text, messages, None, *add_generation_prompt, special).map_err(ApiError::from)?
        }
    };
    let mut answer = json!({
        "count": tokens.len(),
        "max_model_len": shared.registry.max_context(),
        "tokens": tokens,
    });
    if t.return_token_strs {
        let strs: Vec<Option<String>> = tokens.iter().map(|&id| text.tokenizer.id_to_token(id)).collect();
        answer["token_strs"] = json!(strs);
    }
    Ok(answer)
}

/// Answers a `/detokenize` body.
pub fn detokenize(shared: &Shared, body: &[u8]) -> Result<Value, ApiError> {
    let d = parse_detokenize(body)?;
    check_model(shared, d.model.as_deref())?;
    let tok = &shared.text.tokenizer;
    let vocab = tok.vocab_size();
    if let Some((i, bad)) = d.tokens.iter().enumerate().find(|&(_, &id)| id as usize >= vocab) {
        return Err(ApiError::invalid(
            format!("`tokens[{i}]` = {bad} is outside the vocabulary (ids 0 to {})", vocab.saturating_sub(1)),
            Some("tokens"),
        ));
    }
    let prompt = tok
        .decode(&d.tokens, false)
        .map_err(|e| ApiError::from(crate::RouterError::Tokenize(e)))?;
    Ok(json!({"prompt": prompt}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenize_bodies() {
        let t = parse_tokenize(br#"{"prompt": "Hi"}"#).unwrap();
        assert_eq!((t.source, t.add_special_tokens, t.model), (Source::Prompt("Hi".into()), true, None));
        let t = parse_tokenize(br#"{"model": "m", "prompt": "Hi", "add_special_tokens": false, "return_token_strs": true}"#).unwrap();
        assert_eq!((t.add_special_tokens, t.return_token_strs, t.model.as_deref()), (false, true, Some("m")));
        let t = parse_tokenize(br#"{"messages": [{"role": "user", "content": "Hi"}]}"#).unwrap();
        let msg = ferry_tokenizer::ChatMessage::new(ferry_tokenizer::Role::User, "Hi");
        assert_eq!(t.source, Source::Chat { messages: vec![msg.clone()], add_generation_prompt: true });
        assert!(!t.add_special_tokens, "the template writes the special tokens");
        let t = parse_tokenize(br#"{"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": false}"#).unwrap();
        assert_eq!(t.source, Source::Chat { messages: vec![msg], add_generation_prompt: false });
    }

    #[test]
    fn bad_bodies_name_the_field() {
        for (body, param, needle) in [
            (r#"{"model": "m"}"#, Some("prompt"), "required"),
            (r#"{"prompt": 5}"#, Some("prompt"), "must be a string"),
            (r#"{"prompt": "a", "messages": []}"#, Some("messages"), "not both"),
            (r#"{"prompt": "a", "add_generation_prompt": true}"#, Some("add_generation_prompt"), "unknown field"),
            (r#"{"prompt": "a", "add_special_tokens": "yes"}"#, Some("add_special_tokens"), "invalid type"),
            (r#"{"prompt": "a", "model": 1}"#, Some("model"), "invalid type"),
            (r#"{"prompt": "a", "extra": 1}"#, Some("extra"), "unknown field \"extra\""),
            (r#"{"messages": "hi"}"#, Some("messages"), "must be an array"),
            (r#"{"messages": [{"role": "user", "content": "x", "refusal": "n"}]}"#, Some("messages[0].refusal"), "not supported"),
            ("[]", None, "JSON object"),
            ("{", None, "malformed JSON"),
        ] {
            let e = parse_tokenize(body.as_bytes()).expect_err(body);
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, param), "{body}: {e:?}");
            assert!(e.message.contains(needle), "{body}: {}", e.message);
        }
    }

    #[test]
    fn detokenize_bodies() {
        assert_eq!(parse_detokenize(br#"{"tokens": [1, 2]}"#).unwrap(), Detokenize { model: None, tokens: vec![1, 2] });
        assert_eq!(parse_detokenize(br#"{"tokens": []}"#).unwrap().tokens, Vec::<u32>::new());
        for (body, param, needle) in [
            (r#"{}"#, "tokens", "required"),
            (r#"{"tokens": "1 2"}"#, "tokens", "must be an array"),
            (r#"{"tokens": [1, -2]}"#, "tokens", "token ids"),
            (r#"{"tokens": [1.5]}"#, "tokens", "token ids"),
            (r#"{"tokens": [4294967296]}"#, "tokens", "token ids"),
            (r#"{"tokens": [1], "prompt": "x"}"#, "prompt", "unknown field"),
            (r#"{"tokens": [1], "model": false}"#, "model", "invalid type"),
        ] {
            let e = parse_detokenize(body.as_bytes()).expect_err(body);
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{body}: {e:?}");
            assert!(e.message.contains(needle), "{body}: {}", e.message);
        }
    }
}
