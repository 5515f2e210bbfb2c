//! The `response` object and its server-sent events, built as the answer comes: pure, no I/O.
//! One [`Events`] turns what the tool-call scanner says ([`Said`]: text, a call's opening, its
//! argument pieces, its close) into output items
//! and the events that build them, in OpenAI's order:
//!
//! `response.created`, `response.in_progress`; per message item `response.output_item.added`,
//! `response.content_part.added`, `response.output_text.delta`…, `response.output_text.done`,
//! `response.content_part.done`, `response.output_item.done`; per function call
//! `response.output_item.added` (empty arguments), `response.function_call_arguments.delta`…,
//! `response.function_call_arguments.done`, `response.output_item.done`; then
//! `response.completed` or `response.incomplete` (or `error` and `response.failed`).
//!
//! A whole (not streamed) answer runs the same [`Events`] and keeps only its last object, so the
//! events of a stream add up to exactly the object a request without `stream` gets.

use ferry_proto::v1;
use serde_json::{Map, Value, json};

use crate::api::openai::error::ApiError;
use crate::tools::calls::Said;

/// What every object of one response repeats.
#[derive(Clone, Debug)]
pub struct Head {
    /// `resp_<Ferry's request id>`.
    pub id: String,
    /// Unix seconds.
    pub created_at: u64,
    pub model: String,
    /// The request's fields the object echoes ([`super::parse::echo`]).
    pub echo: Map<String, Value>,
}

/// A response's state: its output items as they stand, and the events so far.
#[derive(Debug)]
pub struct Events {
    head: Head,
    seq: u64,
    output: Vec<Value>,
    /// The output index of the message item being written, if one is open.
    open: Option<usize>,
    status: &'static str,
    incomplete: Value,
    error: Value,
    usage: Value,
}

/// An event of `kind` with `body`'s fields.
fn with_type(kind: &str, seq: u64, body: Value) -> Value {
    let mut e = json!({"type": kind, "sequence_number": seq});
    if let (Value::Object(e), Value::Object(b)) = (&mut e, body) {
        e.extend(b);
    }
    e
}

fn text_part(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": []})
}

/// OpenAI's `usage` of a response from Ferry's final message.
pub fn usage(fin: &v1::GenerateFinal) -> Value {
    json!({
        "input_tokens": fin.prompt_tokens,
        "input_tokens_details": {"cached_tokens": fin.cached_tokens},
        "output_tokens": fin.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
    })
}

/// Whether the answer was cut by a length limit (`max_output_tokens`, or the model's context).
fn cut_short(fin: &v1::GenerateFinal) -> bool {
    matches!(
        v1::FinishReason::try_from(fin.finish_reason),
        Ok(v1::FinishReason::Length | v1::FinishReason::ContextFull)
    )
}

impl Events {
    pub fn new(head: Head) -> Events {
        Events { head, seq: 0, output: Vec::new(), open: None, status: "in_progress", incomplete: Value::Null, error: Value::Null, usage: Value::Null }
    }

    /// The `response` object as it stands.
    pub fn response(&self) -> Value {
        let mut r = json!({
            "id": self.head.id,
            "object": "response",
            "created_at": self.head.created_at,
            "status": self.status,
            "error": self.error,
            "incomplete_details": self.incomplete,
            "model": self.head.model,
            "output": self.output,
            "usage": self.usage,
        });
        if let Value::Object(o) = &mut r {
            o.extend(self.head.echo.clone());
        }
        r
    }

    fn event(&mut self, kind: &str, body: Value) -> Value {
        let e = with_type(kind, self.seq, body);
        self.seq += 1;
        e
    }

    fn about_response(&mut self, kind: &str) -> Value {
        let r = self.response();
        self.event(kind, json!({"response": r}))
    }

    /// `response.created` and `response.in_progress`.
    pub fn start(&mut self) -> Vec<Value> {
        vec![self.about_response("response.created"), self.about_response("response.in_progress")]
    }

    /// The events of what the answer says next. (The one place that maps the scanner's pieces
    /// to items; a call's arguments are the pieces that arrived, so they add up by construction.)
    pub fn said(&mut self, s: Said) -> Vec<Value> {
        match s {
            Said::Text(t) => self.text(&t),
            Said::Open { id, name, .. } => self.call_start(&id, &name),
            Said::Args { text, .. } => self.call_arguments(&text),
            Said::Close { .. } => self.call_end(),
        }
    }

    fn item_id(&self, index: usize) -> String {
        self.output[index]["id"].as_str().unwrap_or_default().to_owned()
    }

    /// Text: a delta of the open message item, opening one first if none is.
    fn text(&mut self, t: &str) -> Vec<Value> {
        if t.is_empty() {
            return Vec::new();
        }
        let mut out = Vec::new();
        let index = match self.open {
            Some(i) => i,
            None => {
                out.extend(self.open_message());
                self.output.len() - 1
            }
        };
        if let Some(Value::String(text)) = self.output[index].pointer_mut("/content/0/text") {
            text.push_str(t);
        }
        let item_id = self.item_id(index);
        out.push(self.event(
            "response.output_text.delta",
            json!({"item_id": item_id, "output_index": index, "content_index": 0, "delta": t, "logprobs": []}),
        ));
        out
    }

    fn open_message(&mut self) -> Vec<Value> {
        let index = self.output.len();
        let id = format!("msg_{}_{index}", self.head.id.trim_start_matches("resp_"));
        let item = json!({"type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": []});
        self.output.push(item.clone());
        self.open = Some(index);
        let added = self.event("response.output_item.added", json!({"output_index": index, "item": item}));
        if let Some(Value::Array(content)) = self.output[index].get_mut("content") {
            content.push(text_part(""));
        }
        let part = self.event(
            "response.content_part.added",
            json!({"item_id": id, "output_index": index, "content_index": 0, "part": text_part("")}),
        );
        vec![added, part]
    }

    /// Ends the open message item (if one is) with `status`.
    fn close_message(&mut self, status: &str) -> Vec<Value> {
        let Some(index) = self.open.take() else {
            return Vec::new();
        };
        let item_id = self.item_id(index);
        self.output[index]["status"] = json!(status);
        let text = self.output[index].pointer("/content/0/text").cloned().unwrap_or(json!(""));
        let item = self.output[index].clone();
        vec![
            self.event(
                "response.output_text.done",
                json!({"item_id": item_id, "output_index": index, "content_index": 0, "text": text, "logprobs": []}),
            ),
            self.event(
                "response.content_part.done",
                json!({"item_id": item_id, "output_index": index, "content_index": 0, "part": item["content"][0]}),
            ),
            self.event("response.output_item.done", json!({"output_index": index, "item": item})),
        ]
    }

    /// A call begins: the message before it ends, and a `function_call` item with empty
    /// arguments is added (its `fc_` id shares the call id's random part).
    fn call_start(&mut self, call_id: &str, name: &str) -> Vec<Value> {
        let mut out = self.close_message("completed");
        let index = self.output.len();
        let id = format!("fc_{}", call_id.trim_start_matches("call_"));
        let item = json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": "", "status": "in_progress"});
        self.output.push(item.clone());
        out.push(self.event("response.output_item.added", json!({"output_index": index, "item": item})));
        out
    }

    /// The next piece of the last call's arguments.
    fn call_arguments(&mut self, piece: &str) -> Vec<Value> {
        let index = self.output.len().saturating_sub(1);
        let Some(Value::String(args)) = self.output.get_mut(index).and_then(|i| i.get_mut("arguments")) else {
            return Vec::new();
        };
        args.push_str(piece);
        let item_id = self.item_id(index);
        vec![self.event("response.function_call_arguments.delta", json!({"item_id": item_id, "output_index": index, "delta": piece}))]
    }

    /// The last call is whole.
    fn call_end(&mut self) -> Vec<Value> {
        let index = self.output.len().saturating_sub(1);
        if self.output.get(index).and_then(|i| i.get("type")) != Some(&json!("function_call")) {
            return Vec::new();
        }
        self.output[index]["status"] = json!("completed");
        let item = self.output[index].clone();
        vec![
            self.event(
                "response.function_call_arguments.done",
                json!({"item_id": item["id"], "output_index": index, "name": item["name"], "arguments": item["arguments"]}),
            ),
            self.event("response.output_item.done", json!({"output_index": index, "item": item})),
        ]
    }

    /// The answer ended with `fin`: the open message ends (an answer that said nothing still has
    /// one, empty), then `response.completed`, or `response.incomplete` when a length limit cut it.
    pub fn finish(&mut self, fin: &v1::GenerateFinal) -> Vec<Value> {
        let cut = cut_short(fin);
        let mut out = Vec::new();
        if self.output.is_empty() {
            out.extend(self.open_message());
        }
        out.extend(self.close_message(if cut { "incomplete" } else { "completed" }));
        self.usage = usage(fin);
        if cut {
            self.status = "incomplete";
            self.incomplete = json!({"reason": "max_output_tokens"});
            out.push(self.about_response("response.incomplete"));
        } else {
            self.status = "completed";
            out.push(self.about_response("response.completed"));
        }
        out
    }

    /// The answer failed: an `error` event, then `response.failed`.
    pub fn fail(&mut self, e: &ApiError) -> Vec<Value> {
        let code = e.code.unwrap_or(e.kind());
        let error = self.event("error", json!({"code": code, "message": e.message, "param": e.param}));
        self.status = "failed";
        self.error = json!({"code": code, "message": e.message});
        vec![error, self.about_response("response.failed")]
    }
}

/// One event on the wire: `event: <type>` and `data: <JSON>`.
pub fn sse(e: &Value) -> String {
    format!("event: {}\ndata: {e}\n\n", e["type"].as_str().unwrap_or("message"))
}

#[cfg(test)]
#[path = "events_tests.rs"]
mod tests;
