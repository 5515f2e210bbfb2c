//! Chat `messages` to the conversation the chat template renders: pure parsing, no I/O. Each
//! message is checked against [`fields::MESSAGE_FIELDS`] first (refusals name
//! `messages[i].field`), then its role, content (a string, `null`, or text parts), `name`, an
//! assistant's `tool_calls` and a tool result's `tool_call_id` are read.

use ferry_tokenizer::{ChatMessage, FunctionCall, Role, ToolCall};
use serde_json::{Map, Value};

use super::error::ApiError;
use crate::error::clip;
use super::fields;
use super::body::{Kind, required, type_name, wrong_type};

/// `messages`: objects with a `role` and a `content` that is a string, an array of text parts, or
/// null (an empty message); an assistant's `tool_calls`, a tool result's `tool_call_id`, a `name`;
/// their other fields per [`fields::MESSAGE_FIELDS`]. A tool result without a `name` gets the name
/// of the call it answers (templates such as Hermes' want it; OpenAI's clients do not send it).
pub fn parse(v: Option<&Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let list = match v {
        None | Some(Value::Null) => return Err(required("messages")),
        Some(Value::Array(a)) => a,
        Some(other) => return Err(wrong_type("messages", "an array", other)),
    };
    if list.is_empty() {
        return Err(ApiError::invalid("`messages` is empty", Some("messages")));
    }
    let bad = |i: usize, why: String| {
        ApiError::invalid(format!("`messages[{i}]`: {why}"), Some("messages"))
    };
    let mut out: Vec<ChatMessage> = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let Value::Object(m) = m else {
            return Err(bad(i, format!("must be an object, not {}", type_name(m))));
        };
        fields::check(fields::MESSAGE_FIELDS, Kind::Chat, m, &format!("messages[{i}]."))?;
        // One of the API's roles (`developer` is read as `system`); any other string would be
        // pasted into the template as it is.
        let role = match m.get("role") {
            Some(Value::String(r)) => Role::parse(r).ok_or_else(|| {
                ApiError::invalid_field(
                    format!("`messages[{i}].role` is {:?}; it must be one of {}", clip(r), Role::NAMES),
                    format!("messages[{i}].role"),
                )
            })?,
            None | Some(Value::Null) => return Err(bad(i, "`role` is required".into())),
            Some(other) => {
                return Err(bad(
                    i,
                    format!("`role` must be a string, not {}", type_name(other)),
                ));
            }
        };
        let content = match m.get("content") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for (j, p) in parts.iter().enumerate() {
                    match (p.get("type").and_then(Value::as_str), p.get("text")) {
                        (Some("text"), Some(Value::String(t))) => text.push_str(t),
                        (Some("text"), _) => {
                            return Err(bad(i, format!("content part {j} has no `text` string")));
                        }
                        (Some(t), _) => {
                            return Err(bad(
                                i,
                                format!(
                                    "content part {j} is of type {:?}; only \"text\" parts are supported",
                                    clip(t)
                                ),
                            ));
                        }
                        (None, _) => {
                            return Err(bad(i, format!("content part {j} has no `type`")));
                        }
                    }
                }
                text
            }
            Some(other) => {
                return Err(bad(
                    i,
                    format!(
                        "`content` must be a string or an array of text parts, not {}",
                        type_name(other)
                    ),
                ));
            }
        };
        let string = |key: &str| -> Result<Option<String>, ApiError> {
            match m.get(key) {
                None | Some(Value::Null) => Ok(None),
                Some(Value::String(s)) => Ok(Some(s.clone())),
                Some(other) => Err(bad(i, format!("`{key}` must be a string, not {}", type_name(other)))),
            }
        };
        let tool_call_id = string("tool_call_id")?;
        let mut name = string("name")?;
        let tool_calls = match m.get("tool_calls") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(calls)) => calls
                .iter()
                .enumerate()
                .map(|(j, c)| tool_call(c).map_err(|why| bad(i, format!("`tool_calls[{j}]`: {why}"))))
                .collect::<Result<_, _>>()?,
            Some(other) => return Err(bad(i, format!("`tool_calls` must be an array, not {}", type_name(other)))),
        };
        if role == Role::Tool && name.is_none() {
            name = tool_call_id.as_ref().and_then(|id| {
                out.iter()
                    .flat_map(|m| &m.tool_calls)
                    .find(|c| c.id.as_ref() == Some(id))
                    .map(|c| c.function.name.clone())
            });
        }
        out.push(ChatMessage { role, content, tool_calls, tool_call_id, name });
    }
    Ok(out)
}

/// One of an assistant message's `tool_calls`: `{"id", "type": "function", "function": {"name",
/// "arguments"}}`, the arguments a JSON string (parsed: templates want the object, as vLLM gives
/// them) or already an object.
fn tool_call(c: &Value) -> Result<ToolCall, String> {
    let Value::Object(c) = c else {
        return Err(format!("must be an object, not {}", type_name(c)));
    };
    for key in c.keys() {
        if !matches!(key.as_str(), "id" | "type" | "function") {
            return Err(format!("unknown field {:?} (id, type, function)", clip(key)));
        }
    }
    match c.get("type") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if t == "function" => {}
        Some(other) => return Err(format!("type {} is not supported; only \"function\"", clip(&other.to_string()))),
    }
    let id = match c.get("id") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(other) => return Err(format!("`id` must be a string, not {}", type_name(other))),
    };
    let Some(Value::Object(f)) = c.get("function") else {
        return Err("`function` is required: an object with `name` and `arguments`".into());
    };
    let Some(Value::String(name)) = f.get("name") else {
        return Err("`function.name` is required (a string)".into());
    };
    let arguments = match f.get("arguments") {
        None | Some(Value::Null) => Value::Object(Map::new()),
        Some(Value::String(s)) => serde_json::from_str(s)
            .map_err(|e| format!("`function.arguments` is not JSON ({e}): {:?}", clip(s)))?,
        Some(v @ Value::Object(_)) => v.clone(),
        Some(other) => return Err(format!("`function.arguments` must be a JSON string, not {}", type_name(other))),
    };
    Ok(ToolCall { id, kind: "function".into(), function: FunctionCall { name: name.clone(), arguments } })
}
