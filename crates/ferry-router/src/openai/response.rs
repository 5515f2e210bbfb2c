//! OpenAI response bodies and server-sent-event chunks, built from Ferry's deltas and final
//! message: pure functions over plain data.

use bytes::Bytes;
use ferry_proto::v1;
use serde_json::{Value, json};

use super::request::Kind;

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
        if stream && self.include_usage {
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

/// OpenAI's `usage`; `prompt_tokens_details.cached_tokens` counts the prompt tokens a prefix
/// cache served (not computed for this request).
pub fn usage(fin: &v1::GenerateFinal) -> Value {
    json!({
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
    })
}

/// The whole answer of a request without `stream`.
pub fn complete(meta: &Meta, text: &str, fin: &v1::GenerateFinal) -> Value {
    let choice = match meta.kind {
        Kind::Completion => json!({
            "index": 0, "text": text, "logprobs": null, "finish_reason": finish_of(fin),
        }),
        Kind::Chat => json!({
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": null,
            "finish_reason": finish_of(fin),
        }),
    };
    let mut v = meta.envelope(false, json!([choice]));
    v["usage"] = usage(fin);
    v
}

fn chunk(meta: &Meta, text: Option<&str>, role: bool, finish: Option<&'static str>) -> Value {
    let choice = match meta.kind {
        Kind::Completion => json!({
            "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish,
        }),
        Kind::Chat => {
            let mut delta = json!({});
            if role {
                delta["role"] = json!("assistant");
            }
            if let Some(t) = text {
                delta["content"] = json!(t);
            }
            json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
        }
    };
    meta.envelope(true, json!([choice]))
}

/// The first chunk of a chat stream: `delta.role = "assistant"` (none for completions).
pub fn role_chunk(meta: &Meta) -> Option<Value> {
    match meta.kind {
        Kind::Completion => None,
        Kind::Chat => Some(chunk(meta, Some(""), true, None)),
    }
}

/// A chunk of generated text.
pub fn text_chunk(meta: &Meta, text: &str) -> Value {
    chunk(meta, Some(text), false, None)
}

/// The chunks that end a stream: the finish reason, then (with `include_usage`) the usage with
/// no choices.
pub fn final_chunks(meta: &Meta, fin: &v1::GenerateFinal) -> Vec<Value> {
    let mut out = vec![match meta.kind {
        Kind::Completion => chunk(meta, Some(""), false, finish_of(fin)),
        Kind::Chat => chunk(meta, None, false, finish_of(fin)),
    }];
    if meta.include_usage {
        let mut u = meta.envelope(true, json!([]));
        u["usage"] = usage(fin);
        out.push(u);
    }
    out
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

    fn fin(reason: v1::FinishReason) -> v1::GenerateFinal {
        v1::GenerateFinal {
            finish_reason: reason as i32,
            prompt_tokens: 7,
            completion_tokens: 3,
            ..Default::default()
        }
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
        let v = complete(&m, "Hi", &fin(v1::FinishReason::Length));
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
        let v = complete(&m, "Hi", &fin(v1::FinishReason::StopToken));
        assert_eq!(v["id"], "chatcmpl-ab12");
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(
            v["choices"][0]["message"],
            json!({"role": "assistant", "content": "Hi"})
        );
        assert_eq!(v["choices"][0]["finish_reason"], "stop");
    }

    #[test]
    fn chat_chunks() {
        let m = Meta::new(Kind::Chat, "1", 5, "m".into(), true);
        let r = role_chunk(&m).unwrap();
        assert_eq!(r["object"], "chat.completion.chunk");
        assert_eq!(
            r["choices"][0]["delta"],
            json!({"role": "assistant", "content": ""})
        );
        assert_eq!(r["usage"], Value::Null);
        assert!(r.as_object().unwrap().contains_key("usage"));
        let t = text_chunk(&m, "Hel");
        assert_eq!(t["choices"][0]["delta"], json!({"content": "Hel"}));
        assert_eq!(t["choices"][0]["finish_reason"], Value::Null);
        let f = final_chunks(&m, &fin(v1::FinishReason::StopString));
        assert_eq!(f.len(), 2);
        assert_eq!(f[0]["choices"][0]["delta"], json!({}));
        assert_eq!(f[0]["choices"][0]["finish_reason"], "stop");
        assert_eq!(f[1]["choices"], json!([]));
        assert_eq!(f[1]["usage"]["total_tokens"], 10);
    }

    #[test]
    fn completion_chunks() {
        let m = Meta::new(Kind::Completion, "1", 5, "m".into(), false);
        assert!(role_chunk(&m).is_none());
        let t = text_chunk(&m, "Hel");
        assert_eq!(t["object"], "text_completion");
        assert_eq!(t["choices"][0]["text"], "Hel");
        assert!(!t.as_object().unwrap().contains_key("usage"));
        let f = final_chunks(&m, &fin(v1::FinishReason::Length));
        assert_eq!(f.len(), 1);
        assert_eq!(f[0]["choices"][0]["finish_reason"], "length");
        assert_eq!(
            sse(&json!({"a": 1})),
            Bytes::from_static(b"data: {\"a\":1}\n\n")
        );
    }
}
