//! Tool-calling chat templates: a real one (vLLM's Hermes template, tests/fixtures/tools) renders
//! the tools offered, an assistant's calls and a tool's result; templates say whether they take
//! tools at all.

use std::path::PathBuf;

use ferry_tokenizer::{ChatMessage, ChatTemplate, FunctionCall, Role, ToolCall};
use serde_json::json;

fn hermes() -> ChatTemplate {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tools/hermes_tool_chat_template.jinja");
    let source = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    ChatTemplate::new(&source, "", "<|im_end|>").expect("the Hermes template compiles")
}

fn weather_tool() -> serde_json::Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city."},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Degrees."}
        }, "required": ["city", "unit"]}
    }})
}

#[test]
fn which_templates_take_tools() {
    assert!(hermes().takes_tools());
    let chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}";
    assert!(!ChatTemplate::new(chatml, "", "").unwrap().takes_tools());
    // A template that sets `tools` itself does not take them from the caller.
    assert!(!ChatTemplate::new("{% set tools = [] %}{{ tools|length }}", "", "").unwrap().takes_tools());
}

#[test]
fn tools_are_offered_in_the_system_turn() {
    let t = hermes();
    let user = [ChatMessage::new(Role::User, "Weather in Paris?")];
    let without = t.render(&user, true).unwrap();
    assert_eq!(without, "<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n");
    let tools = [weather_tool()];
    let with = t.render_with_tools(&user, Some(&tools), true).unwrap();
    assert!(with.starts_with("You are a function calling AI model."), "{with}");
    assert!(with.contains("{\"name\": \"get_weather\", \"description\": \"get_weather(city: str, unit: str) - Current weather in a city.\n\n    Args:\n        city(str): The city.        unit(str): Degrees.\""), "{with}");
    assert!(with.contains("\"required\":[\"city\",\"unit\"]"), "the parameters' JSON schema: {with}");
    assert!(with.ends_with("</tool_call><|im_end|><|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"), "{with}");
    // An empty list offers nothing, as with no tools.
    assert_eq!(t.render_with_tools(&user, Some(&[]), true).unwrap(), without);
}

#[test]
fn calls_and_results_render_in_the_conversation() {
    let t = hermes();
    let call = ToolCall {
        id: Some("call_1".into()),
        kind: "function".into(),
        function: FunctionCall { name: "get_weather".into(), arguments: json!({"city": "Paris", "unit": "celsius"}) },
    };
    let assistant = ChatMessage { tool_calls: vec![call], ..ChatMessage::new(Role::Assistant, "") };
    let result = ChatMessage {
        tool_call_id: Some("call_1".into()),
        name: Some("get_weather".into()),
        ..ChatMessage::new(Role::Tool, "18 degrees")
    };
    let messages = [ChatMessage::new(Role::User, "Weather in Paris?"), assistant, result];
    let text = t.render_with_tools(&messages, Some(&[weather_tool()]), true).unwrap();
    let tail = "<|im_start|>user\nWeather in Paris?<|im_end|>\n\
        <|im_start|>assistant\n<tool_call>\n{ \"arguments\": {\"city\":\"Paris\",\"unit\":\"celsius\"}, \"name\": \"get_weather\"}\n</tool_call> <|im_end|>\n\
        <|im_start|>tool\n<tool_response>\n{\"name\": \"get_weather\", \"content\": \"18 degrees\"}\n</tool_response> <|im_end|>\n\
        <|im_start|>assistant\n";
    assert!(text.ends_with(tail), "{text}");
    // The template refuses a tool result without the function's name, as it does under Python.
    let nameless = [ChatMessage::new(Role::User, "x"), ChatMessage { tool_call_id: Some("c".into()), ..ChatMessage::new(Role::Tool, "y") }];
    let err = t.render(&nameless, true).unwrap_err();
    assert!(err.to_string().contains("require a 'name' key"), "{err}");
}
