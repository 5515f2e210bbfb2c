//! OpenAI's `strict: true` on a JSON schema (`response_format.json_schema.strict`,
//! `tools[i].function.strict`): the answer has the properties the schema lists and no others.
//! OpenAI refuses a strict schema whose objects do not say `additionalProperties: false`; Ferry
//! tightens instead where the schema says nothing (each object schema without
//! `additionalProperties` gets `false`, so clients that leave it out, as many do, get what strict
//! promises) and refuses, as OpenAI does, an object that allows more (`true` or a schema). Without
//! `strict`, a JSON schema's own default holds: other properties allowed.

use serde_json::{Map, Value};

/// `schema` with every object schema closed to unlisted properties; Err names the first object
/// that explicitly allows more (a JSON pointer into the schema).
pub fn tighten(schema: &Value) -> Result<Value, String> {
    let mut s = schema.clone();
    close(&mut s, "")?;
    Ok(s)
}

/// Keywords whose value is one subschema, or a map of them, or a list of them.
const ONE: &[&str] = &["items", "additionalItems", "contains", "not", "if", "then", "else", "propertyNames", "unevaluatedItems"];
const MAP: &[&str] = &["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"];
const LIST: &[&str] = &["anyOf", "allOf", "oneOf", "prefixItems", "items"];

fn close(v: &mut Value, at: &str) -> Result<(), String> {
    let Value::Object(o) = v else { return Ok(()) };
    if is_object_schema(o) {
        match o.get("additionalProperties") {
            None => {
                o.insert("additionalProperties".into(), Value::Bool(false));
            }
            Some(Value::Bool(false)) => {}
            Some(_) => {
                let here = if at.is_empty() { "the schema's root" } else { at };
                return Err(format!("`strict: true` allows no properties beyond those listed, but {here} sets `additionalProperties` to something other than false"));
            }
        }
    }
    for (key, sub) in o.iter_mut() {
        let k = key.as_str();
        match sub {
            Value::Object(m) if MAP.contains(&k) => {
                for (name, s) in m.iter_mut() {
                    close(s, &format!("{at}/{k}/{name}"))?;
                }
            }
            Value::Object(_) if ONE.contains(&k) => close(sub, &format!("{at}/{k}"))?,
            Value::Array(list) if LIST.contains(&k) => {
                for (i, s) in list.iter_mut().enumerate() {
                    close(s, &format!("{at}/{k}/{i}"))?;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// An object schema: `type` is (or includes) `object`, or it lists `properties`.
fn is_object_schema(o: &Map<String, Value>) -> bool {
    match o.get("type") {
        Some(Value::String(t)) => t == "object",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "object"),
        _ => o.contains_key("properties"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unsaid_objects_are_closed_everywhere_in_the_schema() {
        let s = json!({"type": "object", "properties": {
            "city": {"type": "object", "properties": {"name": {"type": "string"}}},
            "tags": {"type": "array", "items": {"properties": {"k": {"type": "string"}}}},
            "any": {"anyOf": [{"type": "object"}, {"type": "null"}]},
            "ref": {"$ref": "#/$defs/x"}},
            "$defs": {"x": {"type": ["object", "null"], "properties": {"y": {"type": "integer"}}}}});
        let t = tighten(&s).unwrap();
        for p in ["", "/properties/city", "/properties/tags/items", "/properties/any/anyOf/0", "/$defs/x"] {
            assert_eq!(t.pointer(&format!("{p}/additionalProperties")), Some(&json!(false)), "{p}");
        }
        // Not objects: untouched; already closed: unchanged.
        assert_eq!(t.pointer("/properties/any/anyOf/1"), Some(&json!({"type": "null"})));
        assert_eq!(tighten(&t).unwrap(), t);
        // A property *named* like a keyword is a property, not a keyword.
        let named = json!({"type": "object", "properties": {"properties": {"type": "string"}}});
        assert_eq!(tighten(&named).unwrap()["properties"]["properties"], json!({"type": "string"}));
    }

    #[test]
    fn objects_that_allow_more_are_refused_by_path() {
        let e = tighten(&json!({"type": "object", "additionalProperties": true})).unwrap_err();
        assert!(e.contains("root"), "{e}");
        let e = tighten(&json!({"type": "object", "properties": {"m": {"type": "object", "additionalProperties": {"type": "string"}}}})).unwrap_err();
        assert!(e.contains("/properties/m"), "{e}");
    }
}
