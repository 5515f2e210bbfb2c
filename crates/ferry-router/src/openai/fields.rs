//! Every field of OpenAI's completions and chat-completions request bodies, and the vLLM extras
//! Ferry knows, each with what Ferry does with it: nothing is silently ignored. A field is
//! - **supported**: [`super::request`] reads it and it has its effect;
//! - **limited**: honoured for some values (often only the no-op ones), refused for the others;
//! - **rejected**: refused whenever set to anything but its default (the default is accepted).
//!
//! A field that is not in the table is refused as `unknown field "x"`. docs/api.md keeps the same
//! table (a test holds the two together), and tests/openai_fields.py walks the official `openai`
//! package's request schema against it.
//!
//! To support a field: make its entry [`Support::Supported`] and read it in `request.rs`.

use serde_json::Value;

use super::error::ApiError;
use super::request::Kind;

/// Which endpoints take a field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum On {
    Both,
    /// `POST /v1/chat/completions` only.
    Chat,
    /// `POST /v1/completions` only.
    Completions,
}

impl On {
    fn takes(self, kind: Kind) -> bool {
        match (self, kind) {
            (On::Both, _) | (On::Chat, Kind::Chat) | (On::Completions, Kind::Completion) => true,
            (On::Chat, Kind::Completion) | (On::Completions, Kind::Chat) => false,
        }
    }
}

/// What Ferry does with a field.
#[derive(Clone, Copy, Debug)]
pub enum Support {
    /// Read by the parser; it has its effect.
    Supported,
    /// Values `ok` accepts are honoured; others are refused with `rule`, which says which are.
    Limited { ok: fn(&Value) -> bool, rule: &'static str },
    /// Refused unless `ok` (its default); `rule` says why and what is accepted.
    Rejected { ok: fn(&Value) -> bool, rule: &'static str },
}

impl Support {
    /// The class docs/api.md's table names.
    pub fn class(&self) -> &'static str {
        match self {
            Support::Supported => "supported",
            Support::Limited { .. } => "limited",
            Support::Rejected { .. } => "rejected",
        }
    }
}

#[derive(Clone, Copy, Debug)]
pub struct Field {
    pub name: &'static str,
    pub on: On,
    pub support: Support,
}

const fn f(name: &'static str, on: On, support: Support) -> Field {
    Field { name, on, support }
}

const fn limited(ok: fn(&Value) -> bool, rule: &'static str) -> Support {
    Support::Limited { ok, rule }
}

const fn rejected(ok: fn(&Value) -> bool, rule: &'static str) -> Support {
    Support::Rejected { ok, rule }
}

use On::{Both, Chat, Completions};
use Support::Supported;

/// The top-level fields of a request body.
pub const FIELDS: &[Field] = &[
    // OpenAI, both endpoints.
    f("model", Both, Supported),
    f("max_tokens", Both, Supported),
    f("temperature", Both, Supported),
    f("top_p", Both, Supported),
    f("seed", Both, Supported),
    f("stop", Both, Supported),
    f("stream", Both, Supported),
    f("stream_options", Both, Supported),
    f("user", Both, limited(string, "a string: logged with the request id, no other effect")),
    f("frequency_penalty", Both, Supported),
    f("presence_penalty", Both, Supported),
    f("logit_bias", Both, Supported),
    f("n", Both, Supported),
    f("logprobs", Both, Supported),
    f("response_format", Both, Supported),
    // OpenAI, completions.
    f("prompt", Completions, Supported),
    f("suffix", Completions, limited(empty, "only empty: Ferry does not insert text")),
    f("echo", Completions, Supported),
    f("best_of", Completions, rejected(one, "not supported yet; only 1")),
    // OpenAI, chat.
    f("messages", Chat, Supported),
    f("max_completion_tokens", Chat, Supported),
    f("metadata", Chat, limited(metadata, "up to 16 string pairs (keys up to 64 characters, values up to 512): logged with the request id")),
    f("safety_identifier", Chat, limited(string, "a string: logged with the request id, no other effect")),
    f("prompt_cache_key", Chat, limited(string, "a string: logged with the request id; the router already sends a prompt to where its prefix is cached (isolation is `cache_salt`'s)")),
    f("prompt_cache_retention", Chat, limited(in_memory, "only \"in_memory\": cached blocks live in worker memory, evicted least recently used first")),
    f("prompt_cache_options", Chat, limited(cache_options, "only {} or {\"mode\": \"implicit\"}: Ferry caches every prompt's full blocks and promises no lifetime")),
    f("service_tier", Chat, limited(tier, "only \"auto\" or \"default\"")),
    f("store", Chat, limited(off, "only false: Ferry stores no completions")),
    f("modalities", Chat, limited(text_only, "only [\"text\"]")),
    f("verbosity", Chat, limited(medium, "only \"medium\", the default")),
    f("reasoning_effort", Chat, limited(no_reasoning, "only \"none\": Ferry serves no reasoning model")),
    f("audio", Chat, rejected(null, "audio output is not supported")),
    f("moderation", Chat, rejected(null, "moderation is not supported")),
    f("prediction", Chat, rejected(null, "predicted outputs are not supported")),
    f("web_search_options", Chat, rejected(null, "web search is not supported")),
    f("top_logprobs", Chat, Supported),
    f("tools", Chat, Supported),
    f("tool_choice", Chat, Supported),
    f("parallel_tool_calls", Chat, Supported),
    f("functions", Chat, rejected(empty, "deprecated by OpenAI and not supported: send `tools` (type \"function\") instead")),
    f("function_call", Chat, rejected(no_tool, "deprecated by OpenAI and not supported: send `tool_choice` instead")),
    // vLLM's extras.
    f("top_k", Both, Supported),
    f("ignore_eos", Both, Supported),
    f("cache_salt", Both, Supported),
    f("stop_token_ids", Both, Supported),
    f("min_p", Both, Supported),
    f("repetition_penalty", Both, Supported),
    f("min_tokens", Both, Supported),
    f("bad_words", Both, Supported),
    f("structured_outputs", Both, Supported),
    f("guided_json", Both, Supported),
    f("guided_regex", Both, Supported),
    f("guided_grammar", Both, Supported),
    f("guided_choice", Both, Supported),
    f("guided_decoding_backend", Both, limited(guidance, "only \"llguidance\", \"guidance\" or \"auto\": Ferry's grammar engine is llguidance")),
    f("guided_whitespace_pattern", Both, rejected(null, "not supported: JSON is compact unless the schema sets llguidance's x-guidance options")),
];

/// The fields of a chat message (`messages[i]`).
pub const MESSAGE_FIELDS: &[Field] = &[
    f("role", Chat, Supported),
    f("content", Chat, Supported),
    f("name", Chat, Supported),
    f("refusal", Chat, rejected(empty, "not supported")),
    f("audio", Chat, rejected(null, "audio is not supported")),
    f("tool_calls", Chat, Supported),
    f("tool_call_id", Chat, Supported),
    f("function_call", Chat, rejected(null, "deprecated by OpenAI and not supported: send `tool_calls` instead")),
];

/// The fields of `stream_options`.
pub const STREAM_OPTIONS: &[Field] = &[
    f("include_usage", Both, Supported),
    f("continuous_usage_stats", Both, Supported),
    f("include_obfuscation", Both, limited(off, "only false: Ferry's chunks carry no obfuscation padding")),
];

/// Checks every key of `obj` against `table` for `kind`: unknown keys and refused values are a
/// 400 naming the field (`path` prefixes the name in messages, e.g. "messages[2].").
pub fn check(
    table: &[Field],
    kind: Kind,
    obj: &serde_json::Map<String, Value>,
    path: &str,
) -> Result<(), ApiError> {
    for (key, value) in obj {
        let Some(field) = table.iter().find(|f| f.name == key && f.on.takes(kind)) else {
            let key = crate::error::clip(key);
            return Err(ApiError::invalid_field(
                format!("unknown field \"{path}{key}\""),
                format!("{path}{key}"),
            ));
        };
        match field.support {
            Support::Supported => {}
            Support::Limited { ok, rule } | Support::Rejected { ok, rule } if !ok(value) => {
                let verdict = match field.support {
                    Support::Limited { .. } => "is not supported",
                    _ => "is refused",
                };
                return Err(ApiError::invalid_field(
                    format!("`{path}{key}` = {} {verdict}: {rule}", shown(value)),
                    format!("{path}{key}"),
                ));
            }
            Support::Limited { .. } | Support::Rejected { .. } => {}
        }
    }
    Ok(())
}

/// A value for an error message, cut short.
fn shown(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(60) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s,
    }
}

fn null(v: &Value) -> bool {
    v.is_null()
}

fn guidance(v: &Value) -> bool {
    v.is_null() || matches!(v.as_str(), Some("auto" | "guidance" | "llguidance"))
}

fn off(v: &Value) -> bool {
    matches!(v, Value::Null | Value::Bool(false))
}

fn one(v: &Value) -> bool {
    v.is_null() || v.as_u64() == Some(1)
}

/// Null, or an empty string, array or object.
fn empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Bool(_) | Value::Number(_) => false,
    }
}

fn string(v: &Value) -> bool {
    v.is_null() || v.is_string()
}

fn is_str(v: &Value, allowed: &[&str]) -> bool {
    v.is_null() || v.as_str().is_some_and(|s| allowed.contains(&s))
}

fn tier(v: &Value) -> bool {
    is_str(v, &["auto", "default"])
}

fn in_memory(v: &Value) -> bool {
    is_str(v, &["in_memory"])
}

fn medium(v: &Value) -> bool {
    is_str(v, &["medium"])
}

fn no_reasoning(v: &Value) -> bool {
    is_str(v, &["none"])
}

fn no_tool(v: &Value) -> bool {
    is_str(v, &["none"])
}

fn text_only(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.len() == 1 && a[0] == "text",
        _ => false,
    }
}

fn cache_options(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(o) => o.iter().all(|(k, v)| k == "mode" && v == "implicit"),
        _ => false,
    }
}

/// OpenAI's metadata: at most 16 pairs, keys up to 64 characters, values strings up to 512.
fn metadata(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(o) => {
            o.len() <= 16
                && o.iter().all(|(k, v)| {
                    k.chars().count() <= 64 && v.as_str().is_some_and(|s| s.chars().count() <= 512)
                })
        }
        _ => false,
    }
}

#[cfg(test)]
#[path = "fields_tests.rs"]
mod tests;
