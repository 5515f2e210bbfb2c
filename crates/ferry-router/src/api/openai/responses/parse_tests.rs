use serde_json::json;

use super::*;
use crate::api::openai::fields::{FIELDS, On, Support};
use crate::api::openai::tools::Choice;

fn body(extra: Value) -> String {
    let mut b = json!({"model": "m", "input": "Hi"});
    if let (Value::Object(b), Value::Object(e)) = (&mut b, extra) {
        b.extend(e);
    }
    b.to_string()
}

fn ok(extra: Value) -> Asked {
    let b = body(extra);
    parse(b.as_bytes()).unwrap_or_else(|e| panic!("{b}: {e:?}"))
}

fn err(extra: Value) -> ApiError {
    let b = body(extra);
    parse(b.as_bytes()).expect_err(&b)
}

#[test]
fn a_full_request_runs_as_its_chat_request() {
    let a = ok(json!({
        "instructions": "Be brief.", "input": [{"role": "user", "content": "Weather?"}],
        "max_output_tokens": 16, "temperature": 0, "top_p": 0.5, "stream": true, "store": false,
        "text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}, "strict": true}},
        "tools": [{"type": "function", "name": "get_weather", "description": "W.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "tool_choice": "auto", "parallel_tool_calls": false, "user": "u1", "metadata": {"k": "v"},
    }));
    let p = &a.chat;
    assert_eq!((p.model.as_str(), p.stream, p.kind), ("m", true, Kind::Chat));
    let roles: Vec<&str> = p.messages.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(roles, ["system", "user"]);
    assert_eq!(p.messages[0].content, "Be brief.");
    let s = &p.params;
    assert_eq!((s.max_tokens, s.temperature, s.top_p), (16, 0.0, 0.5));
    assert!(s.grammar.is_some(), "text.format sets the grammar");
    assert_eq!(p.structured_field, Some("response_format"));
    let t = p.tools.clone().expect("tools");
    assert_eq!((t.choice, t.parallel, t.tools[0].name.as_str()), (Choice::Auto, false, "get_weather"));
    // Strict by default (OpenAI's Responses default): closed to unlisted arguments.
    assert_eq!(t.tools[0].parameters["additionalProperties"], json!(false));
    assert_eq!(p.tags.iter().map(|t| t.0).collect::<Vec<_>>(), ["user", "metadata"]);
    // The echo: as sent, or OpenAI's defaults.
    let e = &a.echo;
    assert_eq!((e["instructions"].as_str(), e["max_output_tokens"].as_u64(), e["parallel_tool_calls"].as_bool()), (Some("Be brief."), Some(16), Some(false)));
    assert_eq!(e["tools"][0], json!({"type": "function", "name": "get_weather", "description": "W.", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": true}));
    assert_eq!(e["text"]["format"]["type"], "json_schema");
    assert_eq!((e["store"].as_bool(), e["tool_choice"].as_str()), (Some(false), Some("auto")));
    let d = ok(json!({})).echo;
    assert_eq!((d["temperature"].as_f64(), d["top_p"].as_f64(), d["tool_choice"].as_str()), (Some(1.0), Some(1.0), Some("auto")));
    assert_eq!(d["text"], json!({"format": {"type": "text"}, "verbosity": "medium"}));
    assert_eq!((d["tools"].clone(), d["metadata"].clone(), d["instructions"].clone()), (json!([]), json!({}), Value::Null));
}

#[test]
fn vllms_extras_pass_to_the_chat_request() {
    let p = ok(json!({"seed": 7, "stop": ["x"], "top_k": 4, "min_p": 0.1, "repetition_penalty": 1.1, "stop_token_ids": [2],
        "ignore_eos": true, "min_tokens": 1, "bad_words": ["no"], "cache_salt": "s"})).chat;
    let s = &p.params;
    assert_eq!((s.seed, s.top_k, s.min_p, s.repetition_penalty, s.bad_words.clone()), (Some(7), 4, 0.1, 1.1, vec!["no".to_string()]));
    assert_eq!((s.stop_strings.clone(), s.stop_token_ids.clone(), s.ignore_eos, s.min_tokens), (vec!["x".to_string()], vec![2], true, 1));
    assert_eq!(p.cache_salt, "s");
    let e = err(json!({"repetition_penalty": 0}));
    assert_eq!(e.param.as_deref(), Some("repetition_penalty"));
    // OpenAI's chat-only sampling fields are not the Responses API's.
    let e = err(json!({"frequency_penalty": 0.5}));
    assert_eq!(e.param.as_deref(), Some("frequency_penalty"));
}

#[test]
fn formats_and_tool_choices() {
    assert!(ok(json!({"text": {"format": {"type": "text"}, "verbosity": "medium"}})).chat.params.grammar.is_none());
    assert!(ok(json!({"text": {"format": {"type": "json_object"}}})).chat.structured_field.is_some());
    let tool = json!([{"type": "function", "name": "f"}]);
    let named = ok(json!({"tools": tool, "tool_choice": {"type": "function", "name": "f"}}));
    assert_eq!(named.chat.tools.map(|t| t.choice), Some(Choice::Named("f".into())));
    let required = ok(json!({"tools": tool, "tool_choice": "required"}));
    assert_eq!(required.chat.tools.map(|t| t.choice), Some(Choice::Required));
    assert!(ok(json!({"tools": tool, "tool_choice": "none"})).chat.tools.is_some_and(|t| !t.active()));
}

#[test]
fn refusals_name_the_responses_field() {
    let tool = json!([{"type": "function", "name": "f"}]);
    for (extra, param, needle) in [
        (json!({"store": true}), "store", "Ferry stores no responses; send store: false"),
        (json!({"previous_response_id": "resp_1"}), "previous_response_id", "stores no responses"),
        (json!({"conversation": "conv_1"}), "conversation", "stores no conversations"),
        (json!({"background": true}), "background", "refused"),
        (json!({"frobnicate": 1}), "frobnicate", "unknown field \"frobnicate\""),
        (json!({"messages": []}), "messages", "unknown field"),
        (json!({"max_tokens": 5}), "max_tokens", "unknown field"),
        (json!({"max_output_tokens": 0}), "max_output_tokens", "at least 1"),
        (json!({"max_output_tokens": "5"}), "max_output_tokens", "invalid type"),
        (json!({"temperature": -1}), "temperature", "temperature"),
        (json!({"input": [{"role": "user", "content": 5}]}), "input[0].content", "a string or an array"),
        (json!({"text": {"format": {"type": "xml"}}}), "text.format", "not supported"),
        (json!({"text": {"format": {"type": "json_schema"}}}), "text.format", "schema is required"),
        (json!({"text": {"format": {"type": "json_schema", "schema": {}, "extra": 1}}}), "text.format", "unknown field"),
        (json!({"text": {"format": {"type": "json_schema", "strict": true, "schema": {"type": "object", "additionalProperties": true}}}}), "text.format", "strict"),
        (json!({"text": {"verbosity": "low"}}), "text.verbosity", "medium"),
        (json!({"text": {"style": 1}}), "text.style", "unknown field"),
        (json!({"text": "json"}), "text", "an object"),
        (json!({"tools": [{"type": "web_search"}]}), "tools", "only \"function\" tools"),
        (json!({"tools": [{"type": "function", "function": {"name": "f"}}]}), "tools", "unknown field \"function\""),
        (json!({"tools": [{"type": "function", "name": "a b"}]}), "tools", "`name` \"a b\" must be"),
        (json!({"tools": [{"type": "function"}]}), "tools", "`name` is required"),
        (json!({"tools": {}}), "tools", "an array"),
        (json!({"tools": tool, "tool_choice": {"type": "function", "name": "g"}}), "tool_choice", "not in `tools`"),
        (json!({"tools": tool, "tool_choice": {"type": "web_search_preview"}}), "tool_choice", "not supported"),
        (json!({"tools": tool, "tool_choice": {"type": "function"}}), "tool_choice", "name` is required"),
        (json!({"tools": tool, "tool_choice": "maybe"}), "tool_choice", "not one of"),
        (json!({"tools": tool, "tool_choice": "required", "text": {"format": {"type": "json_object"}}}), "text.format", "cannot be combined"),
        (json!({"tool_choice": "required"}), "tool_choice", "needs `tools`"),
    ] {
        let e = err(extra.clone());
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(param)), "{extra}: {e:?}");
        assert!(e.message.contains(needle), "{extra}: {}", e.message);
    }
    for b in ["", "[]", "{\"model\": \"m\"}", "{\"input\": \"x\"}"] {
        let e = parse(b.as_bytes()).expect_err(b);
        assert_eq!(e.status.as_u16(), 400, "{b}");
    }
}

#[test]
fn each_limited_or_rejected_field_takes_its_defaults_and_refuses_the_rest() {
    // (field, accepted values, refused values)
    let cases: &[(&str, &[Value], &[Value])] = &[
        ("stream_options", &[json!(null), json!({}), json!({"include_obfuscation": false})], &[json!({"include_obfuscation": true}), json!({"include_usage": true})]),
        ("store", &[json!(false), json!(null)], &[json!(true)]),
        ("previous_response_id", &[json!(null)], &[json!("resp_1")]),
        ("conversation", &[json!(null)], &[json!({"id": "conv_1"})]),
        ("background", &[json!(false)], &[json!(true)]),
        ("background_options", &[json!(null)], &[json!({})]),
        ("prompt", &[json!(null)], &[json!({"id": "pmpt_1"})]),
        ("context_management", &[json!(null)], &[json!([{"type": "compaction"}])]),
        ("max_tool_calls", &[json!(1), json!(null)], &[json!(0), json!("2")]),
        ("reasoning", &[json!({}), json!({"effort": "none"}), json!({"effort": null, "summary": null})], &[json!({"effort": "high"}), json!({"summary": "auto"})]),
        ("include", &[json!([]), json!(null)], &[json!(["message.output_text.logprobs"])]),
        ("top_logprobs", &[json!(0)], &[json!(5)]),
        ("truncation", &[json!("disabled")], &[json!("auto")]),
        ("metadata", &[json!({"team": "a"}), json!({})], &[json!({"n": 1})]),
        ("user", &[json!("u-17")], &[json!(5)]),
        ("safety_identifier", &[json!("h-1")], &[json!(["x"])]),
        ("prompt_cache_key", &[json!("conv-9")], &[json!(9)]),
        ("prompt_cache_retention", &[json!("in_memory")], &[json!("24h")]),
        ("prompt_cache_options", &[json!({}), json!({"mode": "implicit"})], &[json!({"mode": "explicit"})]),
        ("service_tier", &[json!("auto"), json!("default")], &[json!("flex")]),
        ("moderation", &[json!(null)], &[json!({"model": "omni-moderation-latest"})]),
        ("image", &[json!(null)], &[json!({})]),
        ("access_programs", &[json!(null)], &[json!({})]),
    ];
    for (name, good, bad) in cases {
        for v in *good {
            let b = body(json!({*name: v}));
            parse(b.as_bytes()).unwrap_or_else(|e| panic!("{name} = {v} was refused: {e:?}"));
        }
        for v in *bad {
            let e = err(json!({*name: v}));
            assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some(*name)), "{name} = {v}: {e:?}");
            assert!(e.message.contains(&format!("`{name}`")), "{}", e.message);
        }
    }
    for f in FIELDS.iter().filter(|f| f.on == On::Responses) {
        if !matches!(f.support, Support::Supported) {
            assert!(cases.iter().any(|c| c.0 == f.name), "no case for {}", f.name);
        }
    }
}

#[test]
fn renamed_errors_keep_their_place() {
    let e = rename(ApiError::invalid_field("`messages[2]`: x", "messages[2].role".into()));
    assert_eq!((e.message.as_str(), e.param.as_deref()), ("`input[2]`: x", Some("input[2].role")));
    let e = rename(ApiError::invalid("response_format.json_schema.schema: bad", Some("response_format")));
    assert_eq!((e.message.as_str(), e.param.as_deref()), ("text.format.schema: bad", Some("text.format")));
    let e = rename(ApiError::invalid("x", Some("temperature")));
    assert_eq!(e.param.as_deref(), Some("temperature"));
}
