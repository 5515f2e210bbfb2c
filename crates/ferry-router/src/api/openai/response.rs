//! OpenAI response bodies and server-sent-event chunks, built from Ferry's deltas and final
//! message: pure functions over plain data.

use std::time::{SystemTime, UNIX_EPOCH};

use axum::http::header;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use ferry_proto::v1;
use serde_json::{Value, json};

use super::body::Kind;
use crate::tools::calls::IdCall;

/// What every response and chunk of one request repeats.
#[derive(Clone, Debug)]
pub struct Meta {
    pub kind: Kind,
    /// `cmpl-<hex>` or `chatcmpl-<hex>`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
    /// Chunks carry `"usage": null`, and a last chunk the usage (`stream_options.include_usage`).
    pub include_usage: bool,
    /// `stream_options.continuous_usage_stats` (vLLM's): every chunk carries the usage so far.
    running: Option<std::sync::Arc<RunningUsage>>,
}

/// The usage of a stream so far: its prompt, and the tokens of every choice generated yet.
#[derive(Debug)]
struct RunningUsage {
    prompt: u32,
    completion: std::sync::atomic::AtomicU32,
}

impl Meta {
    /// `request_id` is Ferry's (it is in the router's logs); the answer's id is built on it.
    pub fn new(
        kind: Kind,
        request_id: &str,
        created: u64,
        model: String,
        include_usage: bool,
    ) -> Meta {
        let prefix = match kind {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        };
        Meta {
            kind,
            id: format!("{prefix}-{request_id}"),
            created,
            model,
            include_usage,
            running: None,
        }
    }

    /// Every chunk of the stream carries `usage` as it stands (the prompt's `prompt_tokens`
    /// tokens, the completion tokens counted by [`Meta::generated`]).
    pub fn with_running_usage(self, prompt_tokens: u32) -> Meta {
        let completion = std::sync::atomic::AtomicU32::new(0);
        Meta { running: Some(std::sync::Arc::new(RunningUsage { prompt: prompt_tokens, completion })), ..self }
    }

    /// Counts `tokens` more generated tokens into the running usage (if the stream has one).
    pub fn generated(&self, tokens: usize) {
        if let Some(r) = &self.running {
            r.completion.fetch_add(tokens as u32, std::sync::atomic::Ordering::Relaxed);
        }
    }

    fn object(&self, stream: bool) -> &'static str {
        match (self.kind, stream) {
            (Kind::Completion, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        }
    }

    fn envelope(&self, stream: bool, choices: Value) -> Value {
        let mut v = json!({
            "id": self.id,
            "object": self.object(stream),
            "created": self.created,
            "model": self.model,
            "choices": choices,
        });
        if let (true, Some(r)) = (stream, &self.running) {
            let completion = r.completion.load(std::sync::atomic::Ordering::Relaxed);
            v["usage"] = json!({"prompt_tokens": r.prompt, "completion_tokens": completion, "total_tokens": r.prompt + completion});
        } else if stream && self.include_usage {
            v["usage"] = Value::Null;
        }
        v
    }
}

/// OpenAI's `finish_reason` for Ferry's.
pub fn finish_reason(f: v1::FinishReason) -> Option<&'static str> {
    match f {
        v1::FinishReason::StopToken | v1::FinishReason::StopString => Some("stop"),
        v1::FinishReason::Length | v1::FinishReason::ContextFull => Some("length"),
        v1::FinishReason::Unspecified => None,
    }
}

fn finish_of(fin: &v1::GenerateFinal) -> Option<&'static str> {
    finish_reason(
        v1::FinishReason::try_from(fin.finish_reason).unwrap_or(v1::FinishReason::Unspecified),
    )
}

/// OpenAI's `usage` over every choice's final: the prompt counted once, the completions of all
/// choices summed; `prompt_tokens_details.cached_tokens` counts the prompt tokens a prefix cache
/// served (not computed for this request).
pub fn usage(fins: &[v1::GenerateFinal]) -> Value {
    let (prompt, cached) = fins.first().map_or((0, 0), |f| (f.prompt_tokens, f.cached_tokens));
    let completion: u32 = fins.iter().map(|f| f.completion_tokens).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// One choice's whole answer: its text (a chat's content, without the calls scanned out of
/// it), its tool calls (none when the request has no active tools) and its final message.
#[derive(Clone, Debug, Default)]
pub struct Whole {
    pub text: String,
    pub calls: Vec<IdCall>,
    pub fin: v1::GenerateFinal,
}

/// `finish_reason` of an answer that made `calls` calls: `"tool_calls"` when the model stopped
/// after calling (not when it ran out of tokens).
fn finish_with_calls(fin: &v1::GenerateFinal, calls: usize) -> Option<&'static str> {
    match finish_of(fin) {
        Some("stop") if calls > 0 => Some("tool_calls"),
        other => other,
    }
}

/// The whole answer of a request without `stream`: one choice per answer, in order. A chat
/// message that made tool calls has them in `tool_calls`, and `content` null when the model
/// said nothing besides them.
pub fn complete(meta: &Meta, answers: &[Whole]) -> Value {
    let choices: Vec<Value> = answers
        .iter()
        .enumerate()
        .map(|(index, a)| {
            let finish = finish_with_calls(&a.fin, a.calls.len());
            match meta.kind {
                Kind::Completion => json!({
                    "index": index, "text": a.text, "logprobs": null, "finish_reason": finish,
                }),
                Kind::Chat => {
                    let content = (!a.text.is_empty() || a.calls.is_empty()).then_some(&a.text);
                    let mut message = json!({"role": "assistant", "content": content});
                    if !a.calls.is_empty() {
                        let list: Vec<Value> = a
                            .calls
                            .iter()
                            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.call.name, "arguments": c.call.arguments}}))
                            .collect();
                        message["tool_calls"] = json!(list);
                    }
                    json!({"index": index, "message": message, "logprobs": null, "finish_reason": finish})
                }
            }
        })
        .collect();
    let fins: Vec<v1::GenerateFinal> = answers.iter().map(|a| a.fin.clone()).collect();
    let mut v = meta.envelope(false, json!(choices));
    v["usage"] = usage(&fins);
    v
}

fn delta_chunk(meta: &Meta, index: u32, delta: Value) -> Value {
    meta.envelope(true, json!([{"index": index, "delta": delta, "logprobs": null, "finish_reason": null}]))
}

/// The chunk that opens tool call `index` of choice `choice`, as OpenAI streams it: the id, type
/// and name with empty arguments.
pub fn call_open_chunk(meta: &Meta, choice: u32, index: usize, id: &str, name: &str) -> Value {
    delta_chunk(meta, choice, json!({"tool_calls": [{"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}}]}))
}

/// A chunk of tool call `index`'s arguments.
pub fn call_args_chunk(meta: &Meta, choice: u32, index: usize, text: &str) -> Value {
    delta_chunk(meta, choice, json!({"tool_calls": [{"index": index, "function": {"arguments": text}}]}))
}

fn chunk(meta: &Meta, index: u32, text: Option<&str>, role: bool, finish: Option<&'static str>) -> Value {
    let choice = match meta.kind {
        Kind::Completion => json!({
            "index": index, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish,
        }),
        Kind::Chat => {
            let mut delta = json!({});
            if role {
                delta["role"] = json!("assistant");
            }
            if let Some(t) = text {
                delta["content"] = json!(t);
            }
            json!({"index": index, "delta": delta, "logprobs": null, "finish_reason": finish})
        }
    };
    meta.envelope(true, json!([choice]))
}

/// The first chunk of a chat stream's choice `index`: `delta.role = "assistant"` (none for
/// completions).
pub fn role_chunk(meta: &Meta, index: u32) -> Option<Value> {
    match meta.kind {
        Kind::Completion => None,
        Kind::Chat => Some(chunk(meta, index, Some(""), true, None)),
    }
}

/// A chunk of choice `index`'s generated text.
pub fn text_chunk(meta: &Meta, index: u32, text: &str) -> Value {
    chunk(meta, index, Some(text), false, None)
}

/// The chunk that ends choice `fin.index`, which streamed `calls` tool calls: its finish reason.
pub fn finish_chunk(meta: &Meta, fin: &v1::GenerateFinal, calls: usize) -> Value {
    let finish = finish_with_calls(fin, calls);
    match meta.kind {
        Kind::Completion => chunk(meta, fin.index, Some(""), false, finish),
        Kind::Chat => chunk(meta, fin.index, None, false, finish),
    }
}

/// After the last choice's finish chunk, with `include_usage`: the usage of them all, with no
/// choices.
pub fn usage_chunk(meta: &Meta, fins: &[v1::GenerateFinal]) -> Option<Value> {
    meta.include_usage.then(|| {
        let mut u = meta.envelope(true, json!([]));
        u["usage"] = usage(fins);
        u
    })
}

/// One server-sent event: `data: JSON` and a blank line.
pub fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The event that ends every stream.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continuous_usage_puts_the_usage_so_far_on_every_chunk() {
        let m = Meta::new(Kind::Chat, "1", 5, "m".into(), false).with_running_usage(7);
        assert_eq!(text_chunk(&m, 0, "a")["usage"], json!({"prompt_tokens": 7, "completion_tokens": 0, "total_tokens": 7}));
        m.generated(3);
        m.clone().generated(2);
        assert_eq!(text_chunk(&m, 0, "b")["usage"], json!({"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}));
        // Without include_usage, no closing usage chunk.
        assert!(usage_chunk(&m, &[fin(v1::FinishReason::Length)]).is_none());
    }

    fn fin(reason: v1::FinishReason) -> v1::GenerateFinal {
        v1::GenerateFinal {
            finish_reason: reason as i32,
            prompt_tokens: 7,
            completion_tokens: 3,
            ..Default::default()
        }
    }

    fn whole(text: &str, fin: v1::GenerateFinal) -> Whole {
        Whole { text: text.into(), calls: Vec::new(), fin }
    }

    #[test]
    fn finish_reasons() {
        for (f, want) in [
            (v1::FinishReason::StopToken, Some("stop")),
            (v1::FinishReason::StopString, Some("stop")),
            (v1::FinishReason::Length, Some("length")),
            (v1::FinishReason::ContextFull, Some("length")),
            (v1::FinishReason::Unspecified, None),
        ] {
            assert_eq!(finish_reason(f), want, "{f:?}");
        }
    }

    #[test]
    fn whole_answers() {
        let m = Meta::new(Kind::Completion, "ab12", 99, "m".into(), false);
        let v = complete(&m, &[whole("Hi", fin(v1::FinishReason::Length))]);
        assert_eq!(v["id"], "cmpl-ab12");
        assert_eq!(v["object"], "text_completion");
        assert_eq!(
            (v["created"].as_u64(), v["model"].as_str()),
            (Some(99), Some("m"))
        );
        assert_eq!(v["choices"][0]["text"], "Hi");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(
            v["usage"],
            json!({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10, "prompt_tokens_details": {"cached_tokens": 0}})
        );
        let m = Meta::new(Kind::Chat, "ab12", 99, "m".into(), false);
        let v = complete(&m, &[whole("Hi", fin(v1::FinishReason::StopToken))]);
        assert_eq!(v["id"], "chatcmpl-ab12");
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(
            v["choices"][0]["message"],
            json!({"role": "assistant", "content": "Hi"})
        );
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
        // Two choices: each its own index, text and finish; usage counts both completions.
        let second = v1::GenerateFinal { index: 1, completion_tokens: 5, ..fin(v1::FinishReason::Length) };
        let v = complete(&m, &[whole("Hi", fin(v1::FinishReason::StopToken)), whole("Yo", second)]);
        assert_eq!(v["choices"][1]["index"], 1);
        assert_eq!(v["choices"][1]["message"]["content"], "Yo");
        assert_eq!(v["choices"][1]["finish_reason"], "length");
        assert_eq!(v["usage"]["completion_tokens"], 8);
        assert_eq!(v["usage"]["total_tokens"], 15);
    }

    #[test]
    fn chat_chunks() {
        let m = Meta::new(Kind::Chat, "1", 5, "m".into(), true);
        let r = role_chunk(&m, 0).unwrap();
        assert_eq!(r["object"], "chat.completion.chunk");
        assert_eq!(
            r["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        assert_eq!(r["usage"], Value::Null);
        assert!(r.as_object().unwrap().contains_key("usage"));
        let t = text_chunk(&m, 2, "Hel");
        assert_eq!(t["choices"][0]["delta"], json!({"content": "Hel"}));
        assert_eq!(t["choices"][0]["index"], 2);
        assert_eq!(t["choices"][0]["finish_reason"], Value::Null);
        let f = finish_chunk(&m, &fin(v1::FinishReason::StopString), 0);
        assert_eq!(f["choices"][0]["delta"], json!({}));
        assert_eq!(f["choices"][0]["finish_reason"], "stop");
        let u = usage_chunk(&m, &[fin(v1::FinishReason::StopString), fin(v1::FinishReason::Length)]).unwrap();
        assert_eq!(u["choices"], json!([]));
        assert_eq!(u["usage"]["total_tokens"], 13);
    }

    #[test]
    fn completion_chunks() {
        let m = Meta::new(Kind::Completion, "1", 5, "m".into(), false);
        assert!(role_chunk(&m, 0).is_none());
        let t = text_chunk(&m, 0, "Hel");
        assert_eq!(t["object"], "text_completion");
        assert_eq!(t["choices"][0]["text"], "Hel");
        assert!(!t.as_object().unwrap().contains_key("usage"));
        assert_eq!(finish_chunk(&m, &fin(v1::FinishReason::Length), 0)["choices"][0]["finish_reason"], "length");
        assert!(usage_chunk(&m, &[fin(v1::FinishReason::Length)]).is_none());
        assert_eq!(
            sse(&json!({"a": 1})),
            Bytes::from_static(b"data: {\"a\":1}\n\n")
        );
    }

    #[test]
    fn tool_call_answers() {
        use crate::tools::scan::Call;
        let m = Meta::new(Kind::Chat, "1", 5, "m".into(), false);
        let c = IdCall { id: "call_x".into(), call: Call { name: "f".into(), arguments: "{\"a\":1}".into() } };
        let v = complete(&m, &[Whole { text: String::new(), calls: vec![c.clone()], fin: fin(v1::FinishReason::StopToken) }]);
        assert_eq!(
            v["choices"][0]["message"],
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": "call_x", "type": "function", "function": {"name": "f", "arguments": "{\"a\":1}"}}]})
        );
        assert_eq!(v["choices"][0]["finish_reason"], "tool_calls");
        // Cut short: the calls made stay, the finish says why it ended.
        let v = complete(&m, &[Whole { text: "Hm".into(), calls: vec![c.clone()], fin: fin(v1::FinishReason::Length) }]);
        assert_eq!((v["choices"][0]["message"]["content"].as_str(), v["choices"][0]["finish_reason"].as_str()), (Some("Hm"), Some("length")));
        // No calls: a plain answer.
        let v = complete(&m, &[whole("Hi", fin(v1::FinishReason::StopToken))]);
        assert_eq!(v["choices"][0]["message"], json!({"role": "assistant", "content": "Hi"}));
        assert_eq!(v["choices"][0]["finish_reason"], "stop");

        let (head, args) = (call_open_chunk(&m, 0, 1, &c.id, &c.call.name), call_args_chunk(&m, 0, 1, &c.call.arguments));
        assert_eq!(
            head["choices"][0]["delta"],
            json!({"tool_calls": [{"index": 1, "id": "call_x", "type": "function", "function": {"name": "f", "arguments": ""}}]})
        );
        assert_eq!(args["choices"][0]["delta"], json!({"tool_calls": [{"index": 1, "function": {"arguments": "{\"a\":1}"}}]}));
        let f = finish_chunk(&m, &fin(v1::FinishReason::StopToken), 2);
        assert_eq!(f["choices"][0]["finish_reason"], "tool_calls");
    }
}

/// A JSON answer with status 200.
pub fn json_ok(v: &Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// Now, in unix seconds (OpenAI's `created`).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

