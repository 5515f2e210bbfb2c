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

use super::format::Format;
use super::{Asked, Choice};

/// The Lark grammar for `asked` in `format`; `None` where the answer is free.
pub fn lark(format: Format, asked: &Asked) -> Option<String> {
    let reply = match (&asked.choice, format) {
        (Choice::None, _) => return None,
        (Choice::Auto, Format::Generic) => true,
        (Choice::Auto, _) => return None,
        (Choice::Required | Choice::Named(_), _) => false,
    };
    let quote = |s: &str| serde_json::Value::from(s).to_string();
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
