use serde_json::{Value, json};

use super::*;

fn p(v: Value) -> Result<Option<Asked>, ApiError> {
    parse(v.as_object().expect("an object"))
}

fn weather() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather", "description": "Weather.", "strict": true,
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}
        }, "required": ["city", "unit"], "additionalProperties": false}
    }})
}

fn clock() -> Value {
    json!({"type": "function", "function": {"name": "now"}})
}

#[test]
fn choices_and_defaults() {
    assert_eq!(p(json!({})).unwrap(), None);
    assert_eq!(p(json!({"tools": [], "tool_choice": "none"})).unwrap(), None);
    assert_eq!(p(json!({"tool_choice": "auto"})).unwrap().map(|a| a.active()), Some(false));
    let a = p(json!({"tools": [weather(), clock()]})).unwrap().unwrap();
    assert_eq!((a.choice.clone(), a.parallel, a.active(), a.forces(), a.max_calls()), (Choice::Auto, true, true, false, None));
    assert_eq!(a.tools[1].parameters, json!({"type": "object", "properties": {}, "additionalProperties": false}));
    assert_eq!(a.offered, vec![weather(), clock()], "the template gets the tools as sent");
    // Strict arguments: an object that says nothing is closed; one that allows more is refused.
    let open = |strict: bool| json!({"type": "function", "function": {"name": format!("f_{strict}"), "strict": strict, "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}});
    let a = p(json!({"tools": [open(true), open(false)]})).unwrap().unwrap();
    assert_eq!(a.tools[0].parameters["additionalProperties"], json!(false));
    assert_eq!(a.tools[1].parameters.get("additionalProperties"), None, "not strict: the schema's own default");
    let loose = json!({"type": "function", "function": {"name": "f", "strict": true, "parameters": {"type": "object", "additionalProperties": true}}});
    let e = p(json!({"tools": [loose]})).unwrap_err();
    assert!(e.message.contains("`strict: true` allows no properties beyond those listed"), "{}", e.message);
    let a = p(json!({"tools": [weather()], "tool_choice": "none"})).unwrap().unwrap();
    assert!(!a.active());
    let a = p(json!({"tools": [weather()], "tool_choice": "required", "parallel_tool_calls": false})).unwrap().unwrap();
    assert_eq!((a.choice.clone(), a.forces(), a.max_calls()), (Choice::Required, true, Some(1)));
    let a = p(json!({"tools": [weather(), clock()], "tool_choice": {"type": "function", "function": {"name": "now"}}})).unwrap().unwrap();
    assert_eq!((a.choice.clone(), a.max_calls()), (Choice::Named("now".into()), Some(1)));
}

#[test]
fn refusals_name_the_field() {
    for (body, field, needle) in [
        (json!({"tools": {}}), "tools", "must be an array"),
        (json!({"tools": [1]}), "tools", "`tools[0]`: must be an object"),
        (json!({"tools": [{"type": "code_interpreter"}]}), "tools", "only \"function\""),
        (json!({"tools": [{"function": {"name": "f"}}]}), "tools", "`type` is required"),
        (json!({"tools": [{"type": "function"}]}), "tools", "`function` is required"),
        (json!({"tools": [{"type": "function", "function": {}}]}), "tools", "`function.name` is required"),
        (json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}), "tools", "must be 1 to 64"),
        (json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}), "tools", "JSON schema object"),
        (json!({"tools": [{"type": "function", "function": {"name": "f", "description": 1}}]}), "tools", "description"),
        (json!({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}), "tools", "unknown field `function.extra`"),
        (json!({"tools": [clock(), clock()]}), "tools", "offered twice"),
        (json!({"tools": [clock()], "tool_choice": "any"}), "tool_choice", "not one of"),
        (json!({"tools": [clock()], "tool_choice": 3}), "tool_choice", "a string or an object"),
        (json!({"tool_choice": "required"}), "tool_choice", "needs `tools`"),
        (json!({"tools": [clock()], "tool_choice": {"type": "function", "function": {"name": "later"}}}), "tool_choice", "\"later\", which is not in `tools` (now)"),
        (json!({"tools": [clock()], "tool_choice": {"type": "allowed_tools"}}), "tool_choice", "not supported"),
        (json!({"tools": [clock()], "tool_choice": {"type": "function"}}), "tool_choice", "`tool_choice.function.name` is required"),
        (json!({"tools": [clock()], "parallel_tool_calls": "no"}), "parallel_tool_calls", "a boolean"),
    ] {
        let e = p(body.clone()).expect_err(&body.to_string());
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(field)), "{body}: {}", e.message);
        assert!(e.message.contains(needle), "{body}: {}", e.message);
    }
}
