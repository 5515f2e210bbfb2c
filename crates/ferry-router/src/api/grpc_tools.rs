//! Tools on gRPC `Generate`: the request's `tools`, `tool_choice` and `parallel_tool_calls` read
//! into [`Asked`] by the same checks the HTTP API runs ([`crate::api::openai::tools::parse`], so the
//! same refusals), the chat's messages with their calls and results, and the relay that reads
//! each choice's answer for calls as it streams: the deltas keep their ids and logprobs but carry
//! only the content, and each call comes as `ToolCallDelta` events (its id and name, then its
//! arguments piece by piece, then `done`); a final counts its choice's calls.

use ferry_proto::v1::{self, generate_response::Event, tool_choice};
use ferry_tokenizer::{ChatMessage, FunctionCall, Role, ToolCall};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tonic::Status;

use crate::RouterError;
use crate::tools::Asked;
use crate::tools::calls::{Calls, Said};

/// The request's tools, or `None` when it offers none and asks for none.
pub fn asked(req: &v1::GenerateRequest) -> Result<Option<Asked>, RouterError> {
    if req.tools.is_empty() && req.tool_choice.is_none() && req.parallel_tool_calls.is_none() {
        return Ok(None);
    }
    let bad = |m: String| RouterError::InvalidRequest(m);
    let mut tools = Vec::with_capacity(req.tools.len());
    for (i, t) in req.tools.iter().enumerate() {
        let mut f = json!({"name": t.name, "strict": t.strict});
        if !t.description.is_empty() {
            f["description"] = Value::from(t.description.as_str());
        }
        if !t.parameters.is_empty() {
            let p: Value = serde_json::from_str(&t.parameters).map_err(|e| bad(format!("tools[{i}].parameters is not JSON: {e}")))?;
            f["parameters"] = p;
        }
        tools.push(json!({"type": "function", "function": f}));
    }
    let mut obj = serde_json::Map::new();
    obj.insert("tools".into(), Value::Array(tools));
    if let Some(c) = &req.tool_choice {
        let choice = match &c.choice {
            None => Value::Null,
            Some(tool_choice::Choice::Function(name)) => json!({"type": "function", "function": {"name": name}}),
            Some(tool_choice::Choice::Mode(m)) => match tool_choice::Mode::try_from(*m) {
                Ok(tool_choice::Mode::Auto) => json!("auto"),
                Ok(tool_choice::Mode::None) => json!("none"),
                Ok(tool_choice::Mode::Required) => json!("required"),
                Err(_) => return Err(bad(format!("tool_choice.mode {m} is not a mode (AUTO, NONE, REQUIRED)"))),
            },
        };
        obj.insert("tool_choice".into(), choice);
    }
    if let Some(p) = req.parallel_tool_calls {
        obj.insert("parallel_tool_calls".into(), Value::Bool(p));
    }
    crate::api::openai::tools::parse(&obj).map_err(|e| bad(e.message))
}

/// The chat's messages: roles, content, an assistant's earlier calls (arguments JSON text), a tool
/// result's call id and name (filled from the call it answers when empty).
pub fn messages(c: &v1::ChatInput) -> Result<Vec<ChatMessage>, RouterError> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(c.messages.len());
    for (i, m) in c.messages.iter().enumerate() {
        let role = Role::parse(&m.role).ok_or_else(|| {
            RouterError::InvalidRequest(format!("chat.messages[{i}].role: {:?} is not a role ({})", crate::error::clip(&m.role), Role::NAMES))
        })?;
        let mut tool_calls = Vec::with_capacity(m.tool_calls.len());
        for (j, call) in m.tool_calls.iter().enumerate() {
            let arguments: Value = match call.arguments.as_str() {
                "" => json!({}),
                a => serde_json::from_str(a).map_err(|e| RouterError::InvalidRequest(format!("chat.messages[{i}].tool_calls[{j}].arguments is not JSON: {e}")))?,
            };
            let id = (!call.id.is_empty()).then(|| call.id.clone());
            tool_calls.push(ToolCall { id, kind: "function".into(), function: FunctionCall { name: call.name.clone(), arguments } });
        }
        let tool_call_id = (!m.tool_call_id.is_empty()).then(|| m.tool_call_id.clone());
        let mut name = (!m.name.is_empty()).then(|| m.name.clone());
        if role == Role::Tool && name.is_none() {
            name = tool_call_id.as_ref().and_then(|id| out.iter().flat_map(|m| &m.tool_calls).find(|c| c.id.as_ref() == Some(id)).map(|c| c.function.name.clone()));
        }
        out.push(ChatMessage { role, content: m.content.clone(), tool_calls, tool_call_id, name });
    }
    Ok(out)
}

/// Relays `events` into the stream it returns, each choice's text read for calls by its own copy
/// of `calls` (see the module doc). Dropping the returned receiver drops `events`, which cancels
/// the request.
pub fn relay(
    mut events: mpsc::Receiver<Result<v1::GenerateResponse, Status>>,
    calls: Calls,
) -> mpsc::Receiver<Result<v1::GenerateResponse, Status>> {
    let (tx, rx) = mpsc::channel(64);
    tokio::spawn(async move {
        let mut per_choice: Vec<Calls> = Vec::new();
        while let Some(ev) = events.recv().await {
            let out = match ev {
                Ok(m) => read(m, &calls, &mut per_choice),
                Err(s) => vec![Err(s)],
            };
            for o in out {
                if tx.send(o).await.is_err() {
                    return;
                }
            }
        }
    });
    rx
}

/// One event of the request, with its choice's calls read out of its text.
fn read(m: v1::GenerateResponse, calls: &Calls, per_choice: &mut Vec<Calls>) -> Vec<Result<v1::GenerateResponse, Status>> {
    let index = match &m.event {
        Some(Event::Delta(d)) => d.index,
        Some(Event::Final(f)) => f.index,
        Some(Event::ToolCall(_)) | None => return vec![Ok(m)],
    };
    let i = index as usize;
    if per_choice.len() <= i {
        per_choice.resize(i + 1, calls.clone());
    }
    let scanner = &mut per_choice[i];
    let request_id = m.request_id;
    let mut out = Vec::new();
    let wrap = |event: Event| Ok(v1::GenerateResponse { request_id: request_id.clone(), event: Some(event) });
    let emit = |said: Vec<Said>, delta: Option<v1::TokenDelta>, out: &mut Vec<_>| {
        let mut text = String::new();
        let mut tool = Vec::new();
        for s in said {
            let d = match s {
                Said::Text(t) => {
                    text.push_str(&t);
                    continue;
                }
                Said::Open { index: call, id, name } => v1::ToolCallDelta { index, call_index: call as u32, id, name, ..Default::default() },
                Said::Args { index: call, text } => v1::ToolCallDelta { index, call_index: call as u32, arguments: text, ..Default::default() },
                Said::Close { index: call, .. } => v1::ToolCallDelta { index, call_index: call as u32, done: true, ..Default::default() },
            };
            tool.push(d);
        }
        // The delta first (its ids and logprobs, with the content it completes), then the calls.
        match delta {
            Some(d) => out.push(wrap(Event::Delta(v1::TokenDelta { text, ..d }))),
            None if !text.is_empty() => out.push(wrap(Event::Delta(v1::TokenDelta { text, index, ..Default::default() }))),
            None => {}
        }
        out.extend(tool.into_iter().map(|d| wrap(Event::ToolCall(d))));
    };
    match m.event {
        Some(Event::Delta(d)) => {
            let said = scanner.push(&d.text);
            emit(said, Some(d), &mut out);
        }
        Some(Event::Final(f)) => {
            let said = scanner.finish();
            emit(said, None, &mut out);
            let made = scanner.count() as u32;
            out.push(wrap(Event::Final(v1::GenerateFinal { tool_calls: made, ..f })));
        }
        Some(Event::ToolCall(_)) | None => {}
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::format::Format;

    fn delta(index: u32, text: &str) -> v1::GenerateResponse {
        v1::GenerateResponse { request_id: "r".into(), event: Some(Event::Delta(v1::TokenDelta { text: text.into(), token_ids: vec![7], index, ..Default::default() })) }
    }

    #[test]
    fn deltas_keep_their_ids_and_lose_the_calls() {
        let calls = Calls::new(Format::Generic, None);
        let mut per = Vec::new();
        let mut got = Vec::new();
        for m in [delta(1, "{\"tool_calls\": [{\"name\": \"f\", \"argu"), delta(1, "ments\": {\"a\": 1}}]}"), delta(0, "{\"response\": \"Hi\"}")] {
            got.extend(read(m, &calls, &mut per).into_iter().map(Result::unwrap));
        }
        let fin = v1::GenerateResponse { request_id: "r".into(), event: Some(Event::Final(v1::GenerateFinal { index: 1, ..Default::default() })) };
        got.extend(read(fin, &calls, &mut per).into_iter().map(Result::unwrap));
        let events: Vec<Event> = got.into_iter().filter_map(|m| m.event).collect();
        let texts: Vec<(u32, String, usize)> = events.iter().filter_map(|e| if let Event::Delta(d) = e { Some((d.index, d.text.clone(), d.token_ids.len())) } else { None }).collect();
        assert_eq!(texts, vec![(1, String::new(), 1), (1, String::new(), 1), (0, "Hi".into(), 1)]);
        let tool: Vec<&v1::ToolCallDelta> = events.iter().filter_map(|e| if let Event::ToolCall(t) = e { Some(t) } else { None }).collect();
        assert_eq!((tool[0].index, tool[0].name.as_str()), (1, "f"));
        assert!(tool[0].id.starts_with("call_"));
        let args: String = tool.iter().map(|t| t.arguments.as_str()).collect();
        assert_eq!(args, "{\"a\": 1}");
        assert!(tool.last().unwrap().done && tool.iter().all(|t| t.call_index == 0));
        let Some(Event::Final(f)) = events.last() else { panic!("{events:?}") };
        assert_eq!(f.tool_calls, 1);
    }

    #[test]
    fn tools_are_checked_as_the_http_api_checks_them() {
        let tool = |name: &str, parameters: &str| v1::Tool { name: name.into(), description: "d".into(), parameters: parameters.into(), strict: false };
        let req = v1::GenerateRequest { tools: vec![tool("f", r#"{"type": "object"}"#)], ..Default::default() };
        let a = asked(&req).unwrap().unwrap();
        assert_eq!((a.tools[0].name.as_str(), a.tools[0].description.as_deref(), a.choice.clone()), ("f", Some("d"), crate::tools::Choice::Auto));
        let forced = v1::GenerateRequest { tool_choice: Some(v1::ToolChoice { choice: Some(tool_choice::Choice::Function("f".into())) }), ..req.clone() };
        assert_eq!(asked(&forced).unwrap().unwrap().choice, crate::tools::Choice::Named("f".into()));
        for (req, needle) in [
            (v1::GenerateRequest { tools: vec![tool("a b", "")], ..Default::default() }, "must be 1 to 64"),
            (v1::GenerateRequest { tools: vec![tool("f", "{")], ..Default::default() }, "tools[0].parameters is not JSON"),
            (v1::GenerateRequest { tool_choice: Some(v1::ToolChoice { choice: Some(tool_choice::Choice::Function("g".into())) }), ..req.clone() }, "not in `tools`"),
            (v1::GenerateRequest { tool_choice: Some(v1::ToolChoice { choice: Some(tool_choice::Choice::Mode(9)) }), ..req.clone() }, "not a mode"),
        ] {
            let e = asked(&req).unwrap_err().to_string();
            assert!(e.contains(needle), "{e}");
        }
        assert_eq!(asked(&v1::GenerateRequest::default()).unwrap(), None);
    }
}
