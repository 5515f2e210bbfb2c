//! Reading an OpenAI request body: which endpoint it came to ([`Kind`]), and its fields one by
//! one, so that a missing or mistyped one is a 400 naming it.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use super::error::ApiError;

/// Which endpoint a request came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `POST /v1/completions`
    Completion,
    /// `POST /v1/chat/completions`
    Chat,
}

/// `name` as a `T`; absent and `null` are `None`.
pub fn field<T: DeserializeOwned>(
    obj: &Map<String, Value>,
    name: &'static str,
) -> Result<Option<T>, ApiError> {
    match obj.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => T::deserialize(v)
            .map(Some)
            // serde's message quotes the value it was given: cut it short.
            .map_err(|e| ApiError::invalid(format!("`{name}`: {}", crate::error::clip(&e.to_string())), Some(name))),
    }
}

pub fn required(name: &'static str) -> ApiError {
    ApiError::invalid(format!("`{name}` is required"), Some(name))
}

pub fn wrong_type(name: &'static str, want: &str, got: &Value) -> ApiError {
    ApiError::invalid(
        format!("`{name}` must be {want}, not {}", type_name(got)),
        Some(name),
    )
}

pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Token ids from an array of numbers, or `None` if it is not one.
pub fn token_ids(a: &[Value]) -> Option<Vec<u32>> {
    a.iter()
        .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect()
}

