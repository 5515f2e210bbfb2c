//! A Responses request's `instructions` and `input` to chat `messages` (in the chat API's JSON
//! shape, which [`crate::api::openai::messages`] then reads): pure, no I/O. Each refusal names the
//! item's field (`input[2].role`).
//!
//! - `instructions` becomes a first `system` message;
//! - a string `input` is one `user` message;
//! - a `message` item (with or without `"type": "message"`) keeps its role (`developer` and
//!   `system` are both the system's) and its text: a string, or `input_text` / `output_text` parts;
//! - `function_call` items become an assistant message's `tool_calls` (following calls, and a
//!   call following the assistant's text, join that message, as one turn of the model);
//! - a `function_call_output` item becomes a `tool` message answering its `call_id`.
//!
//! Anything else (images, files, references to stored items, reasoning items) is refused.

use serde_json::{Map, Value, json};

use crate::error::clip;
use crate::api::openai::error::ApiError;
use crate::api::openai::body::type_name;

/// The roles a message item may have.
const ROLES: &[&str] = &["user", "assistant", "system", "developer"];

/// `instructions` and `input` as chat messages.
pub fn messages(instructions: Option<&Value>, input: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    match instructions {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) => out.push(json!({"role": "system", "content": s})),
        Some(other) => {
            return Err(ApiError::invalid(format!("`instructions` must be a string, not {}", type_name(other)), Some("instructions")));
        }
    }
    match input {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid("`input` is required: Ferry stores no earlier responses to continue", Some("input")));
        }
        Some(Value::String(s)) => out.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) if items.is_empty() => return Err(ApiError::invalid("`input` is empty", Some("input"))),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                add(&mut out, i, item)?;
            }
        }
        Some(other) => {
            return Err(ApiError::invalid(format!("`input` must be a string or an array of items, not {}", type_name(other)), Some("input")));
        }
    }
    Ok(out)
}

/// A refusal of `input[i]` (or of its field `key`).
fn bad(i: usize, key: Option<&str>, why: impl std::fmt::Display) -> ApiError {
    let at = match key {
        Some(k) => format!("input[{i}].{k}"),
        None => format!("input[{i}]"),
    };
    ApiError::invalid_field(format!("`{at}`: {why}"), at)
}

fn add(out: &mut Vec<Value>, i: usize, item: &Value) -> Result<(), ApiError> {
    let Value::Object(o) = item else {
        return Err(bad(i, None, format!("must be an object, not {}", type_name(item))));
    };
    let kind = match o.get("type") {
        None | Some(Value::Null) => "message",
        Some(Value::String(t)) => t.as_str(),
        Some(other) => return Err(bad(i, Some("type"), format!("must be a string, not {}", type_name(other)))),
    };
    match kind {
        "message" => out.push(message(i, o)?),
        "function_call" => {
            let call = function_call(i, o)?;
            match out.last_mut() {
                Some(Value::Object(m)) if m.get("role").and_then(Value::as_str) == Some("assistant") => {
                    let calls = m.entry("tool_calls").or_insert_with(|| json!([]));
                    if let Value::Array(list) = calls {
                        list.push(call);
                    }
                }
                _ => out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        "function_call_output" => out.push(function_call_output(i, o)?),
        "item_reference" => return Err(bad(i, Some("type"), "\"item_reference\" is not supported: Ferry stores no items; send the item itself")),
        other => {
            return Err(bad(
                i,
                Some("type"),
                format!("{:?} is not supported; items are \"message\", \"function_call\" and \"function_call_output\"", clip(other)),
            ));
        }
    }
    Ok(())
}

/// Checks that `o` has no keys beyond `known`.
fn known_keys(i: usize, o: &Map<String, Value>, known: &[&str]) -> Result<(), ApiError> {
    match o.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(bad(i, Some(&clip(k)), format!("unknown field (this item takes {})", known.join(", ")))),
        None => Ok(()),
    }
}

/// A string field of item `i`; `None` when absent or null.
fn string<'a>(i: usize, o: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, ApiError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(bad(i, Some(key), format!("must be a string, not {}", type_name(other)))),
    }
}

fn required<'a>(i: usize, o: &'a Map<String, Value>, key: &str) -> Result<&'a str, ApiError> {
    string(i, o, key)?.ok_or_else(|| bad(i, Some(key), "is required (a string)"))
}

/// `{"type"?: "message", "role", "content", "id"?, "status"?}` (an earlier answer's message item
/// comes back with its `id` and `status`).
fn message(i: usize, o: &Map<String, Value>) -> Result<Value, ApiError> {
    known_keys(i, o, &["type", "role", "content", "id", "status"])?;
    let role = required(i, o, "role")?;
    if !ROLES.contains(&role) {
        return Err(bad(i, Some("role"), format!("is {:?}; it must be one of {}", clip(role), ROLES.join(", "))));
    }
    let content = match o.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => text_parts(i, "content", parts, &["input_text", "output_text"])?,
        None | Some(Value::Null) => return Err(bad(i, Some("content"), "is required: a string or an array of text parts")),
        Some(other) => return Err(bad(i, Some("content"), format!("must be a string or an array of text parts, not {}", type_name(other)))),
    };
    Ok(json!({"role": role, "content": content}))
}

/// The text of `parts` (`key` of item `i`): each `{"type": one of kinds, "text"}`; an
/// `output_text`'s `annotations` and `logprobs` (an earlier answer's) are accepted and dropped
/// only when empty.
fn text_parts(i: usize, key: &str, parts: &[Value], kinds: &[&str]) -> Result<String, ApiError> {
    let mut text = String::new();
    for (j, p) in parts.iter().enumerate() {
        let at = format!("{key}[{j}]");
        let Value::Object(p) = p else {
            return Err(bad(i, Some(&at), format!("must be an object, not {}", type_name(p))));
        };
        let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
        if !kinds.contains(&kind) {
            return Err(bad(i, Some(&format!("{at}.type")), format!("{:?} is not supported; only {} parts are", clip(kind), kinds.join(" and "))));
        }
        for (k, v) in p {
            let empty = v.is_null() || v.as_array().is_some_and(Vec::is_empty);
            match k.as_str() {
                "type" | "text" => {}
                "annotations" | "logprobs" if kind == "output_text" && empty => {}
                other => return Err(bad(i, Some(&format!("{at}.{}", clip(other))), "is not supported (a text part has `type` and `text`)")),
            }
        }
        match p.get("text") {
            Some(Value::String(t)) => text.push_str(t),
            _ => return Err(bad(i, Some(&format!("{at}.text")), "is required (a string)")),
        }
    }
    Ok(text)
}

/// `{"type": "function_call", "call_id", "name", "arguments", "id"?, "status"?}` as a chat
/// `tool_calls` entry; `arguments` must be JSON text.
fn function_call(i: usize, o: &Map<String, Value>) -> Result<Value, ApiError> {
    known_keys(i, o, &["type", "call_id", "name", "arguments", "id", "status"])?;
    let call_id = required(i, o, "call_id")?;
    let name = required(i, o, "name")?;
    let arguments = required(i, o, "arguments")?;
    if let Err(e) = serde_json::from_str::<Value>(arguments) {
        return Err(bad(i, Some("arguments"), format!("is not JSON ({e}): {:?}", clip(arguments))));
    }
    Ok(json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}))
}

/// `{"type": "function_call_output", "call_id", "output", "id"?, "status"?}`: `output` a string
/// or `input_text` parts.
fn function_call_output(i: usize, o: &Map<String, Value>) -> Result<Value, ApiError> {
    known_keys(i, o, &["type", "call_id", "output", "id", "status"])?;
    let call_id = required(i, o, "call_id")?;
    let output = match o.get("output") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => text_parts(i, "output", parts, &["input_text"])?,
        None | Some(Value::Null) => return Err(bad(i, Some("output"), "is required: a string or an array of input_text parts")),
        Some(other) => return Err(bad(i, Some("output"), format!("must be a string or an array of input_text parts, not {}", type_name(other)))),
    };
    Ok(json!({"role": "tool", "tool_call_id": call_id, "content": output}))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(instructions: Value, input: Value) -> Vec<Value> {
        messages(Some(&instructions), Some(&input)).unwrap_or_else(|e| panic!("{input}: {e:?}"))
    }

    #[test]
    fn strings_and_message_items() {
        assert_eq!(ok(json!(null), json!("Hi")), vec![json!({"role": "user", "content": "Hi"})]);
        assert_eq!(
            ok(json!("Be brief."), json!([
                {"role": "developer", "content": "Say yes."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "there"}]},
                {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                 "content": [{"type": "output_text", "text": "Yes.", "annotations": []}]}])),
            vec![
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "developer", "content": "Say yes."}),
                json!({"role": "user", "content": "Hi there"}),
                json!({"role": "assistant", "content": "Yes."}),
            ]
        );
    }

    #[test]
    fn calls_join_the_assistant_turn_and_outputs_answer_them() {
        let got = ok(json!(null), json!([
            {"role": "user", "content": "Weather?"},
            {"type": "message", "role": "assistant", "content": "Checking."},
            {"type": "function_call", "call_id": "call_1", "name": "w", "arguments": "{\"city\": \"Paris\"}", "id": "fc_1", "status": "completed"},
            {"type": "function_call", "call_id": "call_2", "name": "w", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "20C"}]},
            {"type": "function_call", "call_id": "call_3", "name": "w", "arguments": "{}"}]));
        assert_eq!(got[1]["content"], "Checking.");
        assert_eq!(got[1]["tool_calls"][0], json!({"id": "call_1", "type": "function", "function": {"name": "w", "arguments": "{\"city\": \"Paris\"}"}}));
        assert_eq!(got[1]["tool_calls"][1]["id"], "call_2");
        assert_eq!(got[2], json!({"role": "tool", "tool_call_id": "call_1", "content": "18C"}));
        assert_eq!(got[3]["content"], "20C");
        assert_eq!(got[4], json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_3", "type": "function", "function": {"name": "w", "arguments": "{}"}}]}));
        assert_eq!(got.len(), 5);
    }

    #[test]
    fn refusals_name_the_item_and_field() {
        for (instructions, input, param, needle) in [
            (json!(null), json!(null), "input", "required"),
            (json!(null), json!([]), "input", "empty"),
            (json!(null), json!(7), "input", "a string or an array"),
            (json!(["x"]), json!("Hi"), "instructions", "must be a string"),
            (json!(null), json!(["Hi"]), "input[0]", "must be an object"),
            (json!(null), json!([{"content": "x"}]), "input[0].role", "required"),
            (json!(null), json!([{"role": "tool", "content": "x"}]), "input[0].role", "one of user"),
            (json!(null), json!([{"role": "user"}]), "input[0].content", "required"),
            (json!(null), json!([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]), "input[0].content[0].type", "only input_text"),
            (json!(null), json!([{"role": "user", "content": [{"type": "input_text"}]}]), "input[0].content[0].text", "required"),
            (json!(null), json!([{"role": "assistant", "content": [{"type": "output_text", "text": "a", "annotations": [{"type": "url_citation"}]}]}]), "input[0].content[0].annotations", "not supported"),
            (json!(null), json!([{"role": "user", "content": "x", "mood": 1}]), "input[0].mood", "unknown field"),
            (json!(null), json!([{"type": "function_call", "name": "f", "arguments": "{}"}]), "input[0].call_id", "required"),
            (json!(null), json!([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"}]), "input[0].arguments", "not JSON"),
            (json!(null), json!([{"type": "function_call_output", "call_id": "c"}]), "input[0].output", "required"),
            (json!(null), json!([{"type": "item_reference", "id": "msg_1"}]), "input[0].type", "stores no items"),
            (json!(null), json!([{"type": "reasoning", "summary": []}]), "input[0].type", "not supported"),
            (json!(null), json!([{"type": 3}]), "input[0].type", "must be a string"),
        ] {
            let e = messages(Some(&instructions), Some(&input)).expect_err(&input.to_string());
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{input}: {e:?}");
            assert!(e.message.contains(needle), "{input}: {}", e.message);
        }
    }
}
