//! OpenAI's `tools`, `tool_choice` and `parallel_tool_calls` on `POST /v1/chat/completions`, read
//! and checked here (pure, no I/O) into [`crate::tools::Asked`]; what is done with them is
//! [`crate::tools`]'. `"none"` offers no tools and scans nothing, as vLLM does.

use serde_json::{Map, Value};

use super::error::ApiError;
pub use crate::tools::{Asked, Choice, Tool};

/// The longest function name OpenAI accepts.
const MAX_NAME: usize = 64;

fn bad(message: String, field: &'static str) -> ApiError {
    ApiError::invalid(message, Some(field))
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls`; `None` when no tools are offered and
/// nothing asks for them.
pub fn parse(obj: &Map<String, Value>) -> Result<Option<Asked>, ApiError> {
    let (offered, tools) = match obj.get("tools") {
        None | Some(Value::Null) => (Vec::new(), Vec::new()),
        Some(Value::Array(list)) => {
            let mut tools: Vec<Tool> = Vec::with_capacity(list.len());
            for (i, t) in list.iter().enumerate() {
                let tool = tool(i, t)?;
                if tools.iter().any(|o| o.name == tool.name) {
                    return Err(bad(format!("`tools[{i}]`: the function name {:?} is offered twice", tool.name), "tools"));
                }
                tools.push(tool);
            }
            (list.clone(), tools)
        }
        Some(other) => return Err(bad(format!("`tools` must be an array of tools, not {other}"), "tools")),
    };
    let parallel = match obj.get("parallel_tool_calls") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(bad(format!("`parallel_tool_calls` must be a boolean, not {other}"), "parallel_tool_calls")),
    };
    let choice = match obj.get("tool_choice") {
        None | Some(Value::Null) if tools.is_empty() => Choice::None,
        None | Some(Value::Null) => Choice::Auto,
        Some(v) => choice(v, &tools)?,
    };
    if tools.is_empty() && choice == Choice::None {
        return Ok(None);
    }
    Ok(Some(Asked { offered, tools, choice, parallel }))
}

/// `tools[i]`: `{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}`.
fn tool(i: usize, t: &Value) -> Result<Tool, ApiError> {
    let at = |why: String| bad(format!("`tools[{i}]`: {why}"), "tools");
    let Value::Object(t) = t else {
        return Err(at(format!("must be an object, not {t}")));
    };
    for key in t.keys() {
        if !matches!(key.as_str(), "type" | "function") {
            return Err(at(format!("unknown field {key:?} (a tool has `type` and `function`)")));
        }
    }
    match t.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => return Err(at(format!("type {other:?} is not supported; only \"function\" tools are"))),
        None => return Err(at("`type` is required (\"function\")".into())),
    }
    let Some(Value::Object(f)) = t.get("function") else {
        return Err(at("`function` is required: an object with a `name`".into()));
    };
    for key in f.keys() {
        if !matches!(key.as_str(), "name" | "description" | "parameters" | "strict") {
            return Err(at(format!("unknown field `function.{key}` (name, description, parameters, strict)")));
        }
    }
    let name = match f.get("name") {
        Some(Value::String(n)) => n.clone(),
        None | Some(Value::Null) => return Err(at("`function.name` is required".into())),
        Some(other) => return Err(at(format!("`function.name` must be a string, not {other}"))),
    };
    if name.is_empty() || name.len() > MAX_NAME || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-') {
        return Err(at(format!(
            "`function.name` {name:?} must be 1 to {MAX_NAME} characters of a-z, A-Z, 0-9, _ and -"
        )));
    }
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d.clone()),
        Some(d) => return Err(at(format!("`function.description` must be a string, not {d}"))),
    };
    let strict = match f.get("strict") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(s) => return Err(at(format!("`function.strict` must be a boolean, not {s}"))),
    };
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => serde_json::json!({"type": "object", "properties": {}, "additionalProperties": false}),
        // Strict: no argument beyond those listed (see `openai::strict`).
        Some(p @ Value::Object(_)) if strict => super::strict::tighten(p).map_err(|why| at(format!("`function.parameters`: {why}")))?,
        Some(p @ Value::Object(_)) => p.clone(),
        Some(other) => return Err(at(format!("`function.parameters` must be a JSON schema object, not {other}"))),
    };
    Ok(Tool { name, description, parameters })
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"`, or `{"type": "function", "function": {"name"}}`.
fn choice(v: &Value, tools: &[Tool]) -> Result<Choice, ApiError> {
    const F: &str = "tool_choice";
    let need_tools = |what: &str| bad(format!("`tool_choice` {what} needs `tools`: none are offered"), F);
    match v {
        Value::String(s) => match s.as_str() {
            "none" => Ok(Choice::None),
            "auto" => Ok(Choice::Auto),
            "required" if tools.is_empty() => Err(need_tools("\"required\"")),
            "required" => Ok(Choice::Required),
            other => Err(bad(format!("`tool_choice` {other:?} is not one of \"none\", \"auto\", \"required\" or a named function"), F)),
        },
        Value::Object(o) => {
            match o.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(other) => return Err(bad(format!("`tool_choice` of type {other:?} is not supported; name a function with {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"), F)),
                None => return Err(bad("`tool_choice` needs a `type` (\"function\")".into(), F)),
            }
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| bad("`tool_choice.function.name` is required".into(), F))?;
            if tools.is_empty() {
                return Err(need_tools(&format!("naming {name:?}")));
            }
            if !tools.iter().any(|t| t.name == name) {
                let offered: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
                return Err(bad(format!("`tool_choice` names the function {name:?}, which is not in `tools` ({})", offered.join(", ")), F));
            }
            Ok(Choice::Named(name.to_owned()))
        }
        other => Err(bad(format!("`tool_choice` must be a string or an object, not {other}"), F)),
    }
}

#[cfg(test)]
#[path = "tools_tests.rs"]
mod tests;
