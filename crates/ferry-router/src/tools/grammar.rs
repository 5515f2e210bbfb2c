//! The grammars that keep an answer to what `tool_choice` allows: llguidance Lark in which each
//! call is the format's literal text around a `%json` sub-grammar of the function's `parameters`
//! schema, so the model can write nothing but calls the scanner reads back, to the allowed
//! functions, with valid arguments.
//! - `"required"` or a named function, any format: one call, or (`parallel_tool_calls` not false,
//!   choice `"required"`) one or more in the format's list.
//! - `"auto"` in the generic format: a reply (`{"response": "…"}`) or calls; in a template's own
//!   format, `"auto"` is free text (the model was trained to write calls in it).
//!
//! The arguments come out as compact JSON (as structured outputs do: small models fill free
//! whitespace until `max_tokens`) unless a schema sets llguidance's `x-guidance` itself.
//!
//! The pythonic format's arguments are Python keyword arguments, not JSON: their grammar is
//! written from the schema ([`python_kwargs`]), a subset of JSON schema: the required
//! properties, in the schema's order, then the optional ones, each optional (a function with no
//! required property is called with none); strings (`minLength`/`maxLength`) as double-quoted
//! Python strings, integers and numbers, booleans as `True`/`False`, `null` as `None`, `enum` and
//! `const` as Python literals, `anyOf`/`oneOf`, a list of types, arrays of `items`, objects as
//! dicts (the same property rule); anything else is any Python literal. Patterns, bounds on
//! numbers and item counts are not kept; property names that are not Python identifiers cannot
//! be keyword arguments.

use serde_json::Value;

use super::format::Format;
use super::asked::{Asked, Choice};

/// The Lark grammar for `asked` in `format`; `None` where the answer is free.
pub fn lark(format: Format, asked: &Asked) -> Option<String> {
    let reply = match (&asked.choice, format) {
        (Choice::None, _) => return None,
        (Choice::Auto, Format::Generic) => true,
        (Choice::Auto, _) => return None,
        (Choice::Required | Choice::Named(_), _) => false,
    };
    let (open, sep, close) = format.list_text();
    let list = match asked.max_calls() {
        Some(1) => "call".to_owned(),
        _ => format!("call ({} call)*", quote(sep)),
    };
    let list = [quote(open), list, quote(close)].into_iter().filter(|s| s != "\"\"").collect::<Vec<_>>().join(" ");
    let mut g = match reply {
        true => format!("start: reply | calls\nreply: \"{{\\\"response\\\": \" %json {{\"type\": \"string\"}} \"}}\"\ncalls: {list}\n"),
        false => format!("start: {list}\n"),
    };
    let allowed = asked.allowed();
    let alts: Vec<String> = (0..allowed.len()).map(|i| format!("call_{i}")).collect();
    g.push_str(&format!("call: {}\n", alts.join(" | ")));
    for (i, tool) in allowed.iter().enumerate() {
        let (head, tail) = format.call_text(&tool.name);
        if format == Format::Pythonic {
            match python_kwargs(&tool.parameters) {
                Some(args) => g.push_str(&format!("call_{i}: {} args_{i} {}\nargs_{i}: {args}\n", quote(&head), quote(tail))),
                None => g.push_str(&format!("call_{i}: {}\n", quote(&format!("{head}{tail}")))),
            }
            continue;
        }
        g.push_str(&format!("call_{i}: {} args_{i} {}\n", quote(&head), quote(tail)));
        let mut schema = tool.parameters.clone();
        if let Some(o) = schema.as_object_mut() {
            o.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
        }
        g.push_str(&format!("args_{i}: %json {schema}\n"));
    }
    if g.contains("py_") {
        g.push_str(PY_ANY);
    }
    Some(g)
}

/// Any Python literal (where a schema says nothing narrower).
const PY_ANY: &str = r#"py_value: py_str | py_num | "True" | "False" | "None" | py_list | py_dict
py_list: "[" (py_value (", " py_value)*)? "]"
py_dict: "{" (py_str ": " py_value (", " py_str ": " py_value)*)? "}"
py_str: /"([^"\\\r\n]|\\["\\nrt])*"/
py_num: /-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,16})?([eE][+-]?[0-9]{1,3})?/
"#;

fn quote(s: &str) -> String {
    Value::from(s).to_string()
}

/// A function's keyword arguments, `key=value, ...`, as a Lark expression from its parameters
/// schema (see the module doc); `None` when it has no required property.
pub fn python_kwargs(schema: &Value) -> Option<String> {
    properties(schema.as_object()?, |k| quote(&format!("{k}=")))
}

/// The required properties and then the optional ones (when some are required) of an object
/// schema, each written `key` value, separated by `, `.
fn properties(o: &serde_json::Map<String, Value>, key: impl Fn(&str) -> String) -> Option<String> {
    let empty = serde_json::Map::new();
    let props = o.get("properties").and_then(Value::as_object).unwrap_or(&empty);
    let required: Vec<&str> = o.get("required").and_then(Value::as_array).map(|r| r.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    if required.is_empty() {
        return None;
    }
    let any = Value::Bool(true);
    let mut names: Vec<&str> = props.keys().map(String::as_str).filter(|k| required.contains(k)).collect();
    names.extend(required.iter().filter(|k| !props.contains_key(**k)));
    let item = |k: &str| format!("{} {}", key(k), python_value(props.get(k).unwrap_or(&any)));
    let mut e = names.iter().map(|k| item(k)).collect::<Vec<_>>().join(" \", \" ");
    for k in props.keys().filter(|k| !required.contains(&k.as_str())) {
        e.push_str(&format!(" (\", \" {})?", item(k)));
    }
    Some(e)
}

/// A Lark expression for a value of `schema`, written as Python.
fn python_value(schema: &Value) -> String {
    let Some(o) = schema.as_object() else { return "py_value".into() };
    let alts = |v: Vec<String>| match v.len() {
        0 => "py_value".to_owned(),
        _ => format!("({})", v.join(" | ")),
    };
    if let Some(c) = o.get("const") {
        return quote(&python_literal(c));
    }
    if let Some(e) = o.get("enum").and_then(Value::as_array) {
        return alts(e.iter().map(|v| quote(&python_literal(v))).collect());
    }
    if let Some(a) = o.get("anyOf").or_else(|| o.get("oneOf")).and_then(Value::as_array) {
        return alts(a.iter().map(python_value).collect());
    }
    match o.get("type") {
        Some(Value::String(t)) => python_typed(t, o),
        Some(Value::Array(ts)) => alts(ts.iter().filter_map(Value::as_str).map(|t| python_typed(t, o)).collect()),
        _ if o.contains_key("properties") => python_typed("object", o),
        _ => "py_value".into(),
    }
}

fn python_typed(t: &str, o: &serde_json::Map<String, Value>) -> String {
    match t {
        "string" => {
            let min = o.get("minLength").and_then(Value::as_u64).unwrap_or(0);
            let reps = match o.get("maxLength").and_then(Value::as_u64) {
                Some(max) => format!("{{{min},{max}}}"),
                None => format!("{{{min},}}"),
            };
            format!(r#"/"([^"\\\r\n]|\\["\\nrt]){reps}"/"#)
        }
        "integer" => "/-?(0|[1-9][0-9]{0,15})/".into(),
        "number" => "py_num".into(),
        "boolean" => r#"("True" | "False")"#.into(),
        "null" => r#""None""#.into(),
        "array" => {
            let item = o.get("items").map(python_value).unwrap_or_else(|| "py_value".into());
            format!(r#"("[" ({item} (", " {item})*)? "]")"#)
        }
        "object" => match properties(o, |k| quote(&format!("{}: ", quote(k)))) {
            Some(e) => format!(r#"("{{" {e} "}}")"#),
            None if o.contains_key("properties") || o.get("additionalProperties") == Some(&Value::Bool(false)) => r#""{}""#.into(),
            None => "py_dict".into(),
        },
        _ => "py_value".into(),
    }
}

/// `v` as a Python literal (JSON strings are Python strings of the same text).
fn python_literal(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Number(_) | Value::String(_) => v.to_string(),
        Value::Array(a) => format!("[{}]", a.iter().map(python_literal).collect::<Vec<_>>().join(", ")),
        Value::Object(o) => format!("{{{}}}", o.iter().map(|(k, v)| format!("{}: {}", quote(k), python_literal(v))).collect::<Vec<_>>().join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::Tool;
    use serde_json::json;

    fn asked(choice: Choice, parallel: bool) -> Asked {
        let tools = vec![
            Tool { name: "get_weather".into(), description: None, parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}) },
            Tool { name: "now".into(), description: None, parameters: json!({"type": "object", "properties": {}, "additionalProperties": false}) },
        ];
        Asked { offered: Vec::new(), tools, choice, parallel }
    }

    #[test]
    fn free_answers_have_no_grammar() {
        assert_eq!(lark(Format::Hermes, &asked(Choice::Auto, true)), None);
        assert_eq!(lark(Format::Hermes, &asked(Choice::None, true)), None);
        assert_eq!(lark(Format::Generic, &asked(Choice::None, true)), None);
    }

    #[test]
    fn required_allows_every_tool_and_repeats() {
        let g = lark(Format::Hermes, &asked(Choice::Required, true)).unwrap();
        assert_eq!(
            g,
            "start: call (\"\\n\" call)*\n\
             call: call_0 | call_1\n\
             call_0: \"<tool_call>\\n{\\\"name\\\": \\\"get_weather\\\", \\\"arguments\\\": \" args_0 \"}\\n</tool_call>\"\n\
             args_0: %json {\"type\":\"object\",\"properties\":{\"city\":{\"type\":\"string\"}},\"required\":[\"city\"],\"x-guidance\":{\"whitespace_flexible\":false}}\n\
             call_1: \"<tool_call>\\n{\\\"name\\\": \\\"now\\\", \\\"arguments\\\": \" args_1 \"}\\n</tool_call>\"\n\
             args_1: %json {\"type\":\"object\",\"properties\":{},\"additionalProperties\":false,\"x-guidance\":{\"whitespace_flexible\":false}}\n"
        );
        let one = lark(Format::Hermes, &asked(Choice::Required, false)).unwrap();
        assert!(one.starts_with("start: call\ncall: call_0 | call_1\n"), "{one}");
    }

    #[test]
    fn a_named_function_is_the_only_one() {
        let g = lark(Format::Hermes, &asked(Choice::Named("now".into()), true)).unwrap();
        assert!(g.starts_with("start: call\ncall: call_0\n"), "{g}");
        assert!(g.contains("\\\"now\\\"") && !g.contains("get_weather"), "{g}");
    }

    #[test]
    fn pythonic_arguments_are_python() {
        let g = lark(Format::Pythonic, &asked(Choice::Required, true)).unwrap();
        assert_eq!(
            g,
            "start: \"[\" call (\", \" call)* \"]\"\n\
             call: call_0 | call_1\n\
             call_0: \"get_weather(\" args_0 \")\"\n\
             args_0: \"city=\" /\"([^\"\\\\\\r\\n]|\\\\[\"\\\\nrt]){0,}\"/\n\
             call_1: \"now()\"\n"
        );
        let schema = json!({"type": "object", "properties": {
            "unit": {"enum": ["c", 1, true, null]},
            "days": {"type": "integer"},
            "at": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
            "tags": {"type": "array", "items": {"type": "boolean"}},
            "any": {}
        }, "required": ["days", "at"]});
        assert_eq!(
            python_kwargs(&schema).unwrap(),
            "\"days=\" /-?(0|[1-9][0-9]{0,15})/ \", \" \"at=\" (\"{\" \"\\\"x\\\": \" py_num \"}\") \
             (\", \" \"unit=\" (\"\\\"c\\\"\" | \"1\" | \"True\" | \"None\"))? \
             (\", \" \"tags=\" (\"[\" ((\"True\" | \"False\") (\", \" (\"True\" | \"False\"))*)? \"]\"))? \
             (\", \" \"any=\" py_value)?"
        );
        assert_eq!(python_kwargs(&json!({"type": "object", "properties": {"a": {}}})), None, "no required property: no arguments");
    }

    #[test]
    fn generic_answers_are_a_reply_or_calls() {
        let g = lark(Format::Generic, &asked(Choice::Auto, true)).unwrap();
        assert!(
            g.starts_with(
                "start: reply | calls\nreply: \"{\\\"response\\\": \" %json {\"type\": \"string\"} \"}\"\n\
                 calls: \"{\\\"tool_calls\\\": [\" call (\", \" call)* \"]}\"\ncall: call_0 | call_1\n\
                 call_0: \"{\\\"name\\\": \\\"get_weather\\\", \\\"arguments\\\": \" args_0 \"}\"\n"
            ),
            "{g}"
        );
        let g = lark(Format::Generic, &asked(Choice::Required, false)).unwrap();
        assert!(g.starts_with("start: \"{\\\"tool_calls\\\": [\" call \"]}\"\ncall: call_0 | call_1\n"), "{g}");
    }
}

#[cfg(test)]
#[path = "grammar_walk_tests.rs"]
mod walk;
