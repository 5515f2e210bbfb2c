//! The prompt side of the generic tool format ([`Format::Generic`]): for a model whose chat
//! template takes no tools, Ferry tells the model itself what it may call and how to answer, in
//! a system message, and rewrites the conversation's earlier calls and results into the same
//! JSON shapes, so any template renders them (as plain messages of roles every template knows).
//! The grammar ([`super::grammar`]) then holds the answer to that shape.

use ferry_tokenizer::{ChatMessage, Role};
use serde_json::{Value, json};

use super::asked::{Asked, Choice};
#[cfg(doc)]
use super::format::Format;

/// The instructions for `asked`: the functions (name, description, parameters schema), one per
/// line, and the answer's shape.
pub fn instructions(asked: &Asked) -> String {
    let mut s = String::from("You can call these functions (each a JSON schema of its arguments):\n");
    for t in asked.allowed() {
        let mut f = json!({"name": t.name, "parameters": t.parameters});
        if let Some(d) = &t.description {
            f["description"] = Value::from(d.as_str());
        }
        s.push_str(&f.to_string());
        s.push('\n');
    }
    let calls = r#"{"tool_calls": [{"name": "<function name>", "arguments": {<its arguments>}}]}"#;
    let reply = r#"{"response": "<your reply>"}"#;
    match &asked.choice {
        Choice::Named(name) => s.push_str(&format!("Answer by calling `{name}`, as the JSON object {calls}.")),
        Choice::Required => s.push_str(&format!("Answer by calling one or more of them, as the JSON object {calls}.")),
        Choice::Auto | Choice::None => s.push_str(&format!(
            "Answer with one JSON object: {calls} to call functions, or {reply} to reply to the user directly. \
             After a call, its result comes back as {{\"tool_response\": ...}}."
        )),
    }
    s
}

/// The conversation as the model sees it in the generic format: the instructions joined to the
/// first system message (or a system message of their own first), an assistant's earlier replies
/// and calls written as the JSON it answers with, and each tool result as a user message
/// `{"tool_response": {"name", "content"}}`.
pub fn messages(messages: &[ChatMessage], asked: &Asked) -> Vec<ChatMessage> {
    let mut out = Vec::with_capacity(messages.len() + 1);
    let text = instructions(asked);
    match messages.first() {
        Some(m) if m.role == Role::System => out.push(ChatMessage { content: format!("{}\n\n{text}", m.content), ..m.clone() }),
        _ => out.push(ChatMessage { role: Role::System, content: text, ..Default::default() }),
    }
    let skip = usize::from(messages.first().is_some_and(|m| m.role == Role::System));
    for m in &messages[skip..] {
        out.push(match m.role {
            Role::Assistant if !m.tool_calls.is_empty() => {
                let calls: Vec<Value> = m.tool_calls.iter().map(|c| json!({"name": c.function.name, "arguments": c.function.arguments})).collect();
                ChatMessage { role: Role::Assistant, content: json!({"tool_calls": calls}).to_string(), ..Default::default() }
            }
            Role::Assistant => ChatMessage { role: Role::Assistant, content: json!({"response": m.content}).to_string(), ..Default::default() },
            Role::Tool | Role::Function => {
                let mut r = json!({"content": m.content});
                if let Some(name) = &m.name {
                    r["name"] = Value::from(name.as_str());
                }
                ChatMessage { role: Role::User, content: json!({"tool_response": r}).to_string(), ..Default::default() }
            }
            Role::System | Role::User => m.clone(),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::Tool;
    use ferry_tokenizer::{FunctionCall, ToolCall};

    fn asked(choice: Choice) -> Asked {
        let tools = vec![Tool { name: "get_weather".into(), description: Some("Weather in a city.".into()), parameters: json!({"type": "object"}) }];
        Asked { offered: Vec::new(), tools, choice, parallel: true }
    }

    fn msg(role: Role, content: &str) -> ChatMessage {
        ChatMessage { role, content: content.into(), ..Default::default() }
    }

    #[test]
    fn the_tools_and_the_shape_go_into_a_system_message() {
        let m = messages(&[msg(Role::User, "Weather in Paris?")], &asked(Choice::Auto));
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].role, Role::System);
        assert!(m[0].content.contains(r#"{"name":"get_weather","parameters":{"type":"object"},"description":"Weather in a city."}"#), "{}", m[0].content);
        assert!(m[0].content.contains(r#"{"response": "<your reply>"}"#), "{}", m[0].content);
        let m = messages(&[msg(Role::System, "Be brief."), msg(Role::User, "Hi")], &asked(Choice::Named("get_weather".into())));
        assert_eq!(m.len(), 2);
        assert!(m[0].content.starts_with("Be brief.\n\nYou can call") && m[0].content.contains("Answer by calling `get_weather`"), "{}", m[0].content);
        assert!(!m[0].content.contains("response"), "a forced call offers no reply");
    }

    #[test]
    fn earlier_calls_and_results_are_written_as_the_answers_are() {
        let call = ToolCall { id: Some("call_1".into()), kind: "function".into(), function: FunctionCall { name: "get_weather".into(), arguments: json!({"city": "Paris"}) } };
        let conv = [
            msg(Role::User, "Weather in Paris?"),
            ChatMessage { role: Role::Assistant, tool_calls: vec![call], ..Default::default() },
            ChatMessage { role: Role::Tool, content: "18C".into(), name: Some("get_weather".into()), tool_call_id: Some("call_1".into()), ..Default::default() },
            msg(Role::Assistant, "It is 18C."),
        ];
        let m = messages(&conv, &asked(Choice::Auto));
        assert_eq!(m[2].content, r#"{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}"#);
        assert_eq!((m[3].role, m[3].content.as_str()), (Role::User, r#"{"tool_response":{"content":"18C","name":"get_weather"}}"#));
        assert_eq!(m[4].content, r#"{"response":"It is 18C."}"#);
        assert!(m.iter().all(|m| m.tool_calls.is_empty() && m.tool_call_id.is_none()));
    }
}
