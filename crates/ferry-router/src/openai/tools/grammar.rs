//! The grammar that enforces `tool_choice` `"required"` or a named function: llguidance Lark in
//! which each call is the format's literal text around a `%json` sub-grammar of the function's
//! `parameters` schema, so the model can write nothing but calls the parser reads back, to the
//! allowed functions, with valid arguments. One call, or (`parallel_tool_calls` not false, choice
//! `"required"`) one or more separated as the format separates them. The arguments come out as
//! compact JSON (as structured outputs do: small models fill free whitespace until `max_tokens`)
//! unless a schema sets llguidance's `x-guidance` itself.

use super::parse::Format;
use super::{Asked, Choice, Tool};

/// The Lark grammar for a forcing choice; `None` for `"auto"` and `"none"`.
pub fn lark(format: Format, asked: &Asked) -> Option<String> {
    let allowed: Vec<&Tool> = match &asked.choice {
        Choice::None | Choice::Auto => return None,
        Choice::Required => asked.tools.iter().collect(),
        Choice::Named(name) => asked.tools.iter().filter(|t| &t.name == name).collect(),
    };
    let sep = serde_json::Value::from(format.separator()).to_string();
    let mut g = match asked.max_calls() {
        Some(1) => "start: call\n".to_owned(),
        _ => format!("start: call ({sep} call)*\n"),
    };
    let alts: Vec<String> = (0..allowed.len()).map(|i| format!("call_{i}")).collect();
    g.push_str(&format!("call: {}\n", alts.join(" | ")));
    for (i, tool) in allowed.iter().enumerate() {
        let (head, tail) = format.call_text(&tool.name);
        let quote = |s: &str| serde_json::Value::from(s).to_string();
        g.push_str(&format!("call_{i}: {} args_{i} {}\n", quote(&head), quote(tail)));
        let mut schema = tool.parameters.clone();
        if let Some(o) = schema.as_object_mut() {
            o.entry("x-guidance").or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
        }
        g.push_str(&format!("args_{i}: %json {schema}\n"));
    }
    Some(g)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn asked(choice: Choice, parallel: bool) -> Asked {
        let tools = vec![
            Tool { name: "get_weather".into(), parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}) },
            Tool { name: "now".into(), parameters: json!({"type": "object", "properties": {}, "additionalProperties": false}) },
        ];
        Asked { offered: Vec::new(), tools, choice, parallel }
    }

    #[test]
    fn only_forcing_choices_have_a_grammar() {
        assert_eq!(lark(Format::Hermes, &asked(Choice::Auto, true)), None);
        assert_eq!(lark(Format::Hermes, &asked(Choice::None, true)), None);
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
}
