//! A `POST /v1/responses` body to the chat request it runs as: pure, no I/O. The body's keys are
//! checked against [`fields`]' table (endpoint `responses`) first; then the Responses shapes
//! (`input` items, flat function tools, `tool_choice`, `text.format`) are checked here and
//! rewritten into a chat-completions body, which [`request::parse`] reads as any chat request
//! (so sampling checks, messages, tools and structured outputs are the chat path's own). An error
//! that chat parsing still finds names the chat field; [`rename`] gives it the Responses name.

use serde_json::{Map, Value, json};

use crate::error::clip;
use crate::api::openai::error::ApiError;
use crate::api::openai::fields::{self, Endpoint};
use crate::api::openai::body::{Kind, type_name, wrong_type};
use crate::api::openai::request::{self, Parsed};

/// A parsed Responses request: the chat request it runs as, and what the response object
/// repeats of it.
#[derive(Clone, Debug)]
pub struct Asked {
    pub chat: Parsed,
    /// The request fields the response object echoes (`instructions`, `tools`, `text`, …), with
    /// OpenAI's defaults filled in.
    pub echo: Map<String, Value>,
}

/// Fields passed to the chat body as they are (the same name, type and meaning): OpenAI's, then
/// vLLM's extras (which vLLM's Responses endpoint takes too).
const SAME: &[&str] = &[
    "model",
    "temperature",
    "top_p",
    "stream",
    "parallel_tool_calls",
    "user",
    "metadata",
    "safety_identifier",
    "prompt_cache_key",
    "seed",
    "stop",
    "top_k",
    "min_p",
    "repetition_penalty",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "bad_words",
    "cache_salt",
];

/// Chat field names (and message words) to their Responses names, for errors chat parsing finds.
const RENAMES: &[(&str, &str)] = &[
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("messages", "input"),
    ("function.name", "name"),
    ("function.parameters", "parameters"),
    ("function.description", "description"),
    ("function.strict", "strict"),
];

pub fn parse(body: &[u8]) -> Result<Asked, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("malformed JSON body: {e}"), None))?;
    let Value::Object(obj) = value else {
        return Err(ApiError::invalid("the request body must be a JSON object", None));
    };
    fields::check(fields::FIELDS, Endpoint::Responses, &obj, "")?;
    let chat = to_chat(&obj)?;
    let parsed = request::parse(Kind::Chat, chat.to_string().as_bytes()).map_err(rename)?;
    Ok(Asked { chat: parsed, echo: echo(&obj) })
}

/// The chat-completions body a Responses body runs as.
pub fn to_chat(obj: &Map<String, Value>) -> Result<Value, ApiError> {
    let mut chat = Map::new();
    for &name in SAME {
        if let Some(v) = obj.get(name) {
            chat.insert(name.into(), v.clone());
        }
    }
    chat.insert("messages".into(), json!(super::input::messages(obj.get("instructions"), obj.get("input"))?));
    match obj.get("max_output_tokens") {
        None | Some(Value::Null) => {}
        Some(v) if v.as_u64() == Some(0) => {
            return Err(ApiError::invalid("`max_output_tokens` must be at least 1", Some("max_output_tokens")));
        }
        Some(v) => {
            chat.insert("max_completion_tokens".into(), v.clone());
        }
    }
    if let Some(format) = text_format(obj.get("text"))? {
        chat.insert("response_format".into(), format);
    }
    if let Some(tools) = tools(obj.get("tools"))? {
        chat.insert("tools".into(), tools);
    }
    if let Some(choice) = tool_choice(obj.get("tool_choice"))? {
        chat.insert("tool_choice".into(), choice);
    }
    Ok(Value::Object(chat))
}

/// An error of chat parsing, under the Responses names of its fields.
pub fn rename(mut e: ApiError) -> ApiError {
    for (chat, responses) in RENAMES {
        e.message = e.message.replace(chat, responses);
        if let Some(p) = &e.param
            && (p == chat || p.starts_with(&format!("{chat}[")) || p.starts_with(&format!("{chat}.")))
        {
            e.param = Some(format!("{responses}{}", &p[chat.len()..]));
        }
    }
    e
}

/// `text`: `{"format"?, "verbosity"?}`; the format as chat's `response_format` (`None`: text).
fn text_format(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    const F: &str = "text";
    let o = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(other) => return Err(wrong_type(F, "an object", other)),
    };
    for (k, v) in o {
        match k.as_str() {
            "format" => {}
            "verbosity" if v.is_null() || v == "medium" => {}
            "verbosity" => {
                return Err(ApiError::invalid_field(format!("`text.verbosity` = {v} is not supported: only \"medium\", the default"), "text.verbosity".into()));
            }
            other => return Err(ApiError::invalid_field(format!("unknown field \"text.{}\"", clip(other)), format!("text.{}", clip(other)))),
        }
    }
    let bad = |why: String| ApiError::invalid_field(format!("`text.format`: {why}"), "text.format".into());
    let format = match o.get("format") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(f)) => f,
        Some(other) => return Err(bad(format!("must be an object with a `type`, not {}", type_name(other)))),
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") if format.len() == 1 => Ok(None),
        Some("json_object") if format.len() == 1 => Ok(Some(json!({"type": "json_object"}))),
        Some(t @ ("text" | "json_object")) => Err(bad(format!("a {t:?} format takes only `type`"))),
        Some("json_schema") => {
            let mut schema = Map::new();
            for (k, v) in format {
                match k.as_str() {
                    "type" => {}
                    "name" | "description" | "schema" | "strict" => {
                        schema.insert(k.clone(), v.clone());
                    }
                    other => return Err(bad(format!("unknown field {:?} (a json_schema format takes name, description, schema, strict)", clip(other)))),
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        Some(other) => Err(bad(format!("type {:?} is not supported (text, json_object, json_schema)", clip(other)))),
        None => Err(bad("needs a `type` (text, json_object, json_schema)".into())),
    }
}

/// `tools`: flat function tools, `{"type": "function", "name", "description"?, "parameters"?,
/// "strict"?}`, as chat's nested ones. `strict` is OpenAI's Responses default, true, when unsaid.
fn tools(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(other) => return Err(wrong_type("tools", "an array of function tools", other)),
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let at = |why: String| ApiError::invalid(format!("`tools[{i}]`: {why}"), Some("tools"));
        let Value::Object(t) = t else {
            return Err(at(format!("must be an object, not {}", type_name(t))));
        };
        match t.get("type").and_then(Value::as_str) {
            Some("function") => {}
            Some(other) => {
                return Err(at(format!("type {:?} is not supported; only \"function\" tools are (Ferry runs no built-in tools)", clip(other))));
            }
            None => return Err(at("`type` is required (\"function\")".into())),
        }
        let mut function = Map::new();
        for (k, v) in t {
            match k.as_str() {
                "type" => {}
                "name" | "description" | "parameters" | "strict" => {
                    function.insert(k.clone(), v.clone());
                }
                other => return Err(at(format!("unknown field {:?} (a function tool takes name, description, parameters, strict)", clip(other)))),
            }
        }
        if function.get("strict").is_none_or(Value::is_null) {
            function.insert("strict".into(), Value::Bool(true));
        }
        out.push(json!({"type": "function", "function": function}));
    }
    Ok(Some(Value::Array(out)))
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"` or `{"type": "function", "name"}`, in chat's
/// shape.
fn tool_choice(v: Option<&Value>) -> Result<Option<Value>, ApiError> {
    const F: &str = "tool_choice";
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(s @ Value::String(_)) => Ok(Some(s.clone())),
        Some(Value::Object(o)) => {
            match o.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(other) => {
                    return Err(ApiError::invalid(
                        format!("`tool_choice` of type {:?} is not supported; name a function with {{\"type\": \"function\", \"name\": ...}}", clip(other)),
                        Some(F),
                    ));
                }
                None => return Err(ApiError::invalid("`tool_choice` needs a `type` (\"function\")", Some(F))),
            }
            if let Some(k) = o.keys().find(|k| !matches!(k.as_str(), "type" | "name")) {
                return Err(ApiError::invalid(format!("`tool_choice`: unknown field {:?} (type, name)", clip(k)), Some(F)));
            }
            match o.get("name") {
                Some(Value::String(n)) => Ok(Some(json!({"type": "function", "function": {"name": n}}))),
                _ => Err(ApiError::invalid("`tool_choice.name` is required (a string)", Some(F))),
            }
        }
        Some(other) => Err(wrong_type(F, "a string or an object", other)),
    }
}

/// What the response object repeats of the request, as OpenAI returns it: each field as sent,
/// or its default.
pub fn echo(obj: &Map<String, Value>) -> Map<String, Value> {
    let given = |name: &str, default: Value| match obj.get(name) {
        None | Some(Value::Null) => default,
        Some(v) => v.clone(),
    };
    let tools: Vec<Value> = obj
        .get("tools")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|t| {
            let get = |k: &str| t.get(k).cloned().unwrap_or(Value::Null);
            let strict = t.get("strict").and_then(Value::as_bool).unwrap_or(true);
            json!({"type": "function", "name": get("name"), "description": get("description"), "parameters": get("parameters"), "strict": strict})
        })
        .collect();
    let mut text = match obj.get("text") {
        Some(Value::Object(o)) => o.clone(),
        _ => Map::new(),
    };
    if text.get("format").is_none_or(Value::is_null) {
        text.insert("format".into(), json!({"type": "text"}));
    }
    if text.get("verbosity").is_none_or(Value::is_null) {
        text.insert("verbosity".into(), json!("medium"));
    }
    let mut e = Map::new();
    for (name, v) in [
        ("instructions", given("instructions", Value::Null)),
        ("max_output_tokens", given("max_output_tokens", Value::Null)),
        ("max_tool_calls", given("max_tool_calls", Value::Null)),
        ("temperature", given("temperature", json!(1.0))),
        ("top_p", given("top_p", json!(1.0))),
        ("tools", json!(tools)),
        ("tool_choice", given("tool_choice", json!("auto"))),
        ("parallel_tool_calls", given("parallel_tool_calls", json!(true))),
        ("text", Value::Object(text)),
        ("metadata", given("metadata", json!({}))),
        ("user", given("user", Value::Null)),
        ("safety_identifier", given("safety_identifier", Value::Null)),
        ("prompt_cache_key", given("prompt_cache_key", Value::Null)),
        ("service_tier", given("service_tier", json!("default"))),
        ("truncation", given("truncation", json!("disabled"))),
        ("top_logprobs", given("top_logprobs", json!(0))),
        ("reasoning", json!({"effort": null, "summary": null})),
        ("store", json!(false)),
        ("background", json!(false)),
        ("previous_response_id", Value::Null),
    ] {
        e.insert(name.into(), v);
    }
    e
}

#[cfg(test)]
#[path = "parse_tests.rs"]
mod tests;
