//! Structured-output fields of an OpenAI request to Ferry's `StructuredOutput`: OpenAI's
//! `response_format`, and vLLM's `structured_outputs` and older `guided_*` fields. At most one of
//! them may ask for structure; each refusal names its field. (`guided_decoding_backend` and
//! `guided_whitespace_pattern` are limited and refused by [`super::fields`]' table, checked
//! before this runs.) The grammar itself is checked later,
//! by compiling it ([`crate::api::grpc::prepare`]), and a bad one is a 400 naming the field it came
//! from.

use ferry_proto::v1::{self, structured_output::Kind};
use serde_json::{Map, Value};

use super::error::ApiError;

/// The grammar a request asks for, and the field that asked (for errors about it).
pub type Asked = Option<(v1::StructuredOutput, &'static str)>;

/// vLLM's structured-output options that Ferry does not take (llguidance has its own settings,
/// passed inside a JSON schema as `x-guidance`).
const REFUSED_OPTIONS: &[&str] = &[
    "structural_tag",
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
];

pub fn parse(obj: &Map<String, Value>) -> Result<Asked, ApiError> {
    let mut asked: Vec<(Kind, &'static str)> = Vec::new();
    if let Some(rf) = obj.get("response_format").filter(|v| !v.is_null()) {
        if let Some(k) = response_format(rf)? {
            asked.push((k, "response_format"));
        }
    }
    if let Some(so) = obj.get("structured_outputs").filter(|v| !v.is_null()) {
        asked.extend(structured_outputs(so)?.map(|k| (k, "structured_outputs")));
    }
    for (name, kind) in [
        ("guided_json", json_kind as fn(&Value, &'static str) -> Result<Kind, ApiError>),
        ("guided_regex", regex_kind),
        ("guided_grammar", lark_kind),
        ("guided_choice", choice_kind),
    ] {
        if let Some(v) = obj.get(name).filter(|v| !v.is_null()) {
            asked.push((kind(v, name)?, name));
        }
    }
    match asked.len() {
        0 => Ok(None),
        1 => {
            let (kind, field) = asked.pop().expect("one");
            Ok(Some((v1::StructuredOutput { kind: Some(kind) }, field)))
        }
        _ => {
            let fields: Vec<&str> = asked.iter().map(|(_, f)| *f).collect();
            Err(ApiError::invalid(
                format!("only one structured-output field may be set; got {}", fields.join(", ")),
                Some(asked[1].1),
            ))
        }
    }
}

/// OpenAI's `response_format`: `text` (no structure), `json_object`, or `json_schema`.
fn response_format(rf: &Value) -> Result<Option<Kind>, ApiError> {
    const F: &str = "response_format";
    let Value::Object(o) = rf else {
        return Err(ApiError::invalid("response_format must be an object with a \"type\"", Some(F)));
    };
    match o.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Kind::JsonObject(true))),
        Some("json_schema") => {
            let Some(Value::Object(js)) = o.get("json_schema") else {
                return Err(ApiError::invalid("response_format.json_schema must be an object with a \"schema\"", Some(F)));
            };
            for key in js.keys() {
                // name, description: labels for the model's provider; strict: no properties
                // beyond those listed ([`super::strict`]; the mask itself is always exact).
                if !matches!(key.as_str(), "name" | "description" | "schema" | "strict") {
                    return Err(ApiError::invalid(format!("response_format.json_schema.{key} is not a known field"), Some(F)));
                }
            }
            let strict = match js.get("strict") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(other) => return Err(ApiError::invalid(format!("response_format.json_schema.strict must be a boolean, not {other}"), Some(F))),
            };
            match js.get("schema") {
                Some(s @ Value::Object(_)) if strict => super::strict::tighten(s)
                    .map(|s| Some(Kind::JsonSchema(s.to_string())))
                    .map_err(|why| ApiError::invalid(format!("response_format.json_schema.schema: {why}"), Some(F))),
                Some(s @ Value::Object(_)) => Ok(Some(Kind::JsonSchema(s.to_string()))),
                None => Err(ApiError::invalid("response_format.json_schema.schema is required (a JSON schema object)", Some(F))),
                Some(_) => Err(ApiError::invalid("response_format.json_schema.schema must be a JSON schema object", Some(F))),
            }
        }
        Some(other) => Err(ApiError::invalid(
            format!("response_format type {other:?} is not supported (text, json_object, json_schema)"),
            Some(F),
        )),
        None => Err(ApiError::invalid("response_format needs a \"type\"", Some(F))),
    }
}

/// vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object.
fn structured_outputs(so: &Value) -> Result<Option<Kind>, ApiError> {
    const F: &str = "structured_outputs";
    let Value::Object(o) = so else {
        return Err(ApiError::invalid("structured_outputs must be an object", Some(F)));
    };
    let mut kinds = Vec::new();
    for (key, v) in o {
        if v.is_null() || *v == Value::Bool(false) {
            continue;
        }
        let k = match key.as_str() {
            "json" => json_kind(v, F)?,
            "regex" => regex_kind(v, F)?,
            "grammar" => lark_kind(v, F)?,
            "choice" => choice_kind(v, F)?,
            "json_object" if *v == Value::Bool(true) => Kind::JsonObject(true),
            k if REFUSED_OPTIONS.contains(&k) => {
                return Err(ApiError::invalid(format!("structured_outputs.{k} is not supported"), Some(F)));
            }
            k => return Err(ApiError::invalid(format!("structured_outputs.{k} is not a known field"), Some(F))),
        };
        kinds.push(k);
    }
    match kinds.len() {
        0 => Ok(None),
        1 => Ok(kinds.pop()),
        _ => Err(ApiError::invalid("structured_outputs must set only one of json, regex, choice, grammar, json_object", Some(F))),
    }
}

/// A JSON schema given as an object, or as its JSON text.
fn json_kind(v: &Value, field: &'static str) -> Result<Kind, ApiError> {
    match v {
        Value::Object(_) => Ok(Kind::JsonSchema(v.to_string())),
        Value::String(s) => Ok(Kind::JsonSchema(s.clone())),
        _ => Err(ApiError::invalid(format!("{field}: a JSON schema must be an object (or its JSON text)"), Some(field))),
    }
}

fn regex_kind(v: &Value, field: &'static str) -> Result<Kind, ApiError> {
    match v {
        Value::String(s) => Ok(Kind::Regex(s.clone())),
        _ => Err(ApiError::invalid(format!("{field}: a regular expression must be a string"), Some(field))),
    }
}

/// A grammar in llguidance's Lark dialect (vLLM's EBNF/GBNF grammars are not accepted).
fn lark_kind(v: &Value, field: &'static str) -> Result<Kind, ApiError> {
    match v {
        Value::String(s) => Ok(Kind::Lark(s.clone())),
        _ => Err(ApiError::invalid(format!("{field}: a grammar must be a string (Lark syntax)"), Some(field))),
    }
}

fn choice_kind(v: &Value, field: &'static str) -> Result<Kind, ApiError> {
    let list = v.as_array().filter(|a| !a.is_empty()).ok_or_else(|| {
        ApiError::invalid(format!("{field}: the choices must be a non-empty list of strings"), Some(field))
    })?;
    let choices = list
        .iter()
        .map(|c| c.as_str().map(str::to_owned))
        .collect::<Option<Vec<String>>>()
        .ok_or_else(|| ApiError::invalid(format!("{field}: every choice must be a string"), Some(field)))?;
    Ok(Kind::Choice(v1::Choices { choices }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn p(v: Value) -> Result<Asked, ApiError> {
        parse(v.as_object().unwrap())
    }

    fn kind(v: Value) -> (Kind, &'static str) {
        let (s, f) = p(v).unwrap().expect("a grammar");
        (s.kind.unwrap(), f)
    }

    #[test]
    fn each_field_maps_to_its_grammar() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        assert_eq!(kind(json!({"response_format": {"type": "json_object"}})), (Kind::JsonObject(true), "response_format"));
        assert_eq!(
            kind(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})),
            (Kind::JsonSchema(schema.to_string()), "response_format")
        );
        // Strict: closed to unlisted properties.
        let closed = json!({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": false});
        assert_eq!(
            kind(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema": schema}}})),
            (Kind::JsonSchema(closed.to_string()), "response_format")
        );
        assert_eq!(kind(json!({"structured_outputs": {"regex": "a+"}})), (Kind::Regex("a+".into()), "structured_outputs"));
        assert_eq!(kind(json!({"structured_outputs": {"json": schema}})), (Kind::JsonSchema(schema.to_string()), "structured_outputs"));
        assert_eq!(kind(json!({"guided_json": schema.to_string()})), (Kind::JsonSchema(schema.to_string()), "guided_json"));
        assert_eq!(kind(json!({"guided_regex": "[0-9]+"})), (Kind::Regex("[0-9]+".into()), "guided_regex"));
        assert_eq!(kind(json!({"guided_grammar": "start: \"x\""})), (Kind::Lark("start: \"x\"".into()), "guided_grammar"));
        assert_eq!(
            kind(json!({"guided_choice": ["a", "b"]})),
            (Kind::Choice(v1::Choices { choices: vec!["a".into(), "b".into()] }), "guided_choice")
        );
        assert!(p(json!({"response_format": {"type": "text"}})).unwrap().is_none());
    }

    #[test]
    fn refusals_name_the_field() {
        for (body, field) in [
            (json!({"response_format": {"type": "xml"}}), "response_format"),
            (json!({"response_format": "json"}), "response_format"),
            (json!({"response_format": {"type": "json_schema"}}), "response_format"),
            (json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}), "response_format"),
            (json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}}), "response_format"),
            (json!({"structured_outputs": {"regex": "a", "choice": ["a"]}}), "structured_outputs"),
            (json!({"structured_outputs": {"structural_tag": "x"}}), "structured_outputs"),
            (json!({"structured_outputs": {"nope": 1}}), "structured_outputs"),
            (json!({"guided_choice": []}), "guided_choice"),
            (json!({"guided_choice": ["a", 1]}), "guided_choice"),
            (json!({"guided_regex": 5}), "guided_regex"),
            (json!({"guided_json": 5}), "guided_json"),
            (json!({"guided_regex": "a", "response_format": {"type": "json_object"}}), "guided_regex"),
        ] {
            let e = p(body.clone()).expect_err(&body.to_string());
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
        }
    }
}
