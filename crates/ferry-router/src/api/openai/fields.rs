//! Every field of OpenAI's completions, chat-completions and responses request bodies, and the vLLM
//! extras Ferry knows, each with what Ferry does with it: nothing is silently ignored. A field is
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
use super::body::Kind;

/// Which endpoints take a field.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum On {
    Both,
    /// `POST /v1/chat/completions` only.
    Chat,
    /// `POST /v1/completions` only.
    Completions,
    /// `POST /v1/responses` only ([`super::responses`]); `Both` does not include it.
    Responses,
}

/// The endpoint a body came to, as the table tells them apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    Chat,
    Responses,
}

impl From<Kind> for Endpoint {
    fn from(kind: Kind) -> Endpoint {
        match kind {
            Kind::Completion => Endpoint::Completions,
            Kind::Chat => Endpoint::Chat,
        }
    }
}

impl On {
    fn takes(self, at: impl Into<Endpoint>) -> bool {
        use Endpoint as E;
        match (self, at.into()) {
            (On::Both, E::Chat | E::Completions) | (On::Chat, E::Chat) | (On::Completions, E::Completions) | (On::Responses, E::Responses) => true,
            (On::Both, E::Responses)
            | (On::Chat, E::Completions | E::Responses)
            | (On::Completions, E::Chat | E::Responses)
            | (On::Responses, E::Chat | E::Completions) => false,
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

use On::{Both, Chat, Completions, Responses};
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
    // OpenAI, responses (`super::responses` reads the supported ones).
    f("model", Responses, Supported),
    f("input", Responses, Supported),
    f("instructions", Responses, Supported),
    f("max_output_tokens", Responses, Supported),
    f("temperature", Responses, Supported),
    f("top_p", Responses, Supported),
    f("stream", Responses, Supported),
    f("stream_options", Responses, limited(no_obfuscation, "only {} or {\"include_obfuscation\": false}: Ferry's events carry no obfuscation padding")),
    f("text", Responses, Supported),
    f("tools", Responses, Supported),
    f("tool_choice", Responses, Supported),
    f("parallel_tool_calls", Responses, Supported),
    f("store", Responses, limited(off, "Ferry stores no responses; send store: false (an absent `store` is taken as false)")),
    f("previous_response_id", Responses, rejected(null, "Ferry stores no responses, so none can be continued: send the whole conversation in `input`")),
    f("conversation", Responses, rejected(null, "Ferry stores no conversations: send the whole conversation in `input`")),
    f("background", Responses, rejected(off, "background responses are stored to be fetched later; Ferry stores none")),
    f("background_options", Responses, rejected(null, "background responses are not supported")),
    f("prompt", Responses, rejected(null, "stored prompt templates are not supported: send `instructions` and `input`")),
    f("context_management", Responses, rejected(null, "server-side context management is not supported: Ferry keeps no context")),
    f("max_tool_calls", Responses, limited(positive, "a positive integer: it bounds calls to built-in tools, and Ferry runs none")),
    f("reasoning", Responses, limited(no_reasoning_config, "only {} or {\"effort\": \"none\"}: Ferry serves no reasoning model")),
    f("include", Responses, limited(empty, "only []: Ferry adds no extra output (no logprobs, sources or reasoning)")),
    f("top_logprobs", Responses, limited(zero, "only 0: log-probabilities are not offered on /v1/responses")),
    f("truncation", Responses, limited(disabled, "only \"disabled\", the default: Ferry never drops input items")),
    f("metadata", Responses, limited(metadata, "up to 16 string pairs (keys up to 64 characters, values up to 512): logged with the request id")),
    f("user", Responses, limited(string, "a string: logged with the request id, no other effect")),
    f("safety_identifier", Responses, limited(string, "a string: logged with the request id, no other effect")),
    f("prompt_cache_key", Responses, limited(string, "a string: logged with the request id; the router already sends a prompt to where its prefix is cached")),
    f("prompt_cache_retention", Responses, limited(in_memory, "only \"in_memory\": cached blocks live in worker memory, evicted least recently used first")),
    f("prompt_cache_options", Responses, limited(cache_options, "only {} or {\"mode\": \"implicit\"}: Ferry caches every prompt's full blocks and promises no lifetime")),
    f("service_tier", Responses, limited(tier, "only \"auto\" or \"default\"")),
    f("moderation", Responses, rejected(null, "moderation is not supported")),
    f("image", Responses, rejected(null, "image generation is not supported")),
    f("access_programs", Responses, rejected(null, "not supported")),
    // vLLM's extras on responses (passed to the chat request as they are).
    f("seed", Responses, Supported),
    f("stop", Responses, Supported),
    f("top_k", Responses, Supported),
    f("min_p", Responses, Supported),
    f("repetition_penalty", Responses, Supported),
    f("stop_token_ids", Responses, Supported),
    f("ignore_eos", Responses, Supported),
    f("min_tokens", Responses, Supported),
    f("bad_words", Responses, Supported),
    f("cache_salt", Responses, Supported),
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
    kind: impl Into<Endpoint>,
    obj: &serde_json::Map<String, Value>,
    path: &str,
) -> Result<(), ApiError> {
    let at = kind.into();
    for (key, value) in obj {
        let Some(field) = table.iter().find(|f| f.name == key && f.on.takes(at)) else {
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

fn positive(v: &Value) -> bool {
    v.is_null() || v.as_u64().is_some_and(|n| n >= 1)
}

fn zero(v: &Value) -> bool {
    v.is_null() || v.as_u64() == Some(0)
}

fn disabled(v: &Value) -> bool {
    is_str(v, &["disabled"])
}

fn no_obfuscation(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(o) => o.iter().all(|(k, v)| k == "include_obfuscation" && off(v)),
        _ => false,
    }
}

/// A Responses `reasoning`: nothing asked, or effort `"none"` (summaries need a reasoning model).
fn no_reasoning_config(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Object(o) => o.iter().all(|(k, v)| match k.as_str() {
            "effort" => no_reasoning(v),
            "summary" | "generate_summary" => v.is_null(),
            _ => false,
        }),
        _ => false,
    }
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
