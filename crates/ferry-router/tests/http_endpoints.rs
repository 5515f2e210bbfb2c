//! The HTTP port's endpoints beside the OpenAI API, against mock workers on loopback: `/health`
//! (the gRPC `Health` test), `/metrics`, both open when API keys are on; `/tokenize` and
//! `/detokenize` (vLLM's shapes, behind the key); and request fields that are refused rather than
//! ignored.

mod common;

use common::http::{self, post, request};
use common::{TestRouter, scripted};
use ferry_core::WorkerRole;
use ferry_router::{ApiKeys, Listeners, RouterConfig};
use serde_json::{Value, json};

const SCRIPT: &str = " Hello world.";

async fn router(keys: ApiKeys) -> (TestRouter, String) {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = http.local_addr().unwrap().to_string();
    let mut cfg = RouterConfig::new(common::model_path());
    cfg.api_keys = keys;
    let r = TestRouter::with(cfg, Listeners { grpc, http: Some(http), metrics: None }).await;
    r.channel().await;
    (r, addr)
}

#[tokio::test]
async fn health_follows_the_workers_and_metrics_render_without_a_key() {
    let (r, addr) = router(ApiKeys::new(["k"])).await;
    let counts = |v: &Value| (v["prefill_workers"].clone(), v["decode_workers"].clone(), v["colocated_workers"].clone());
    let a = http::get(&addr, "/health").await;
    assert_eq!((a.status, a.content_type.as_str()), (503, "application/json"), "{}", a.body);
    let v = a.json();
    assert_eq!((v["status"].as_str(), counts(&v)), (Some("unavailable"), (json!(0), json!(0), json!(0))));
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let a = http::get(&addr, "/health").await;
    assert_eq!(a.status, 503, "a prefill worker alone cannot serve: {}", a.body);
    let _d = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let a = http::get(&addr, "/health").await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(counts(&a.json()), (json!(1), json!(1), json!(0)));
    // The gRPC Health RPC agrees.
    let mut c = r.client().await;
    let mut req = tonic::Request::new(ferry_proto::v1::HealthRequest {});
    req.metadata_mut().insert("authorization", "Bearer k".parse().unwrap());
    assert!(c.health(req).await.unwrap().into_inner().serving);

    // Prometheus text, the recorder's; refusals of the key below are counted in it.
    assert_eq!(request(&addr, "GET", "/v1/models", None, None).await.status, 401);
    let a = http::get(&addr, "/metrics").await;
    assert_eq!(a.status, 200, "{}", a.body);
    assert_eq!(a.content_type, ferry_proto::metrics::CONTENT_TYPE, "the content type of every /metrics");
    assert!(a.body.contains("ferry_router_auth_failures_total"), "{}", a.body);
    // The rest of the port still needs the key, unknown routes included.
    for (method, path) in [("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/nothing")] {
        request(&addr, method, path, None, Some("{}")).await.error(401);
    }
    r.shutdown().await;
}

#[tokio::test]
async fn tokenize_and_detokenize_match_generation() {
    let (r, addr) = router(ApiKeys::default()).await;
    let text = common::text();
    let model = text.name.clone();
    let prompt = "The capital of France is";
    let ids = text.encode_prompt(prompt).unwrap();

    // Before any worker, max_model_len is unknown.
    let v = post(&addr, "/tokenize", &json!({"prompt": prompt}).to_string()).await.json();
    assert_eq!(v, json!({"count": ids.len(), "max_model_len": null, "tokens": ids}));
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let d = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let v = post(&addr, "/tokenize", &json!({"model": model, "prompt": prompt, "return_token_strs": true}).to_string()).await.json();
    assert_eq!((v["count"].as_u64(), v["max_model_len"].as_u64()), (Some(ids.len() as u64), Some(2048)));
    assert_eq!(v["token_strs"].as_array().map(Vec::len), Some(ids.len()), "{v}");
    // add_special_tokens: false gives the text's own ids.
    let bare = text.tokenizer.encode(prompt, false).unwrap();
    let v = post(&addr, "/tokenize", &json!({"prompt": prompt, "add_special_tokens": false}).to_string()).await.json();
    assert_eq!(v["tokens"], json!(bare));

    // Chat: the same ids a chat completion runs on (its usage counts them).
    let messages = json!([{"role": "user", "content": "Hi"}]);
    let chat = post(&addr, "/tokenize", &json!({"messages": messages}).to_string()).await.json();
    let done = post(&addr, "/v1/chat/completions", &json!({"model": model, "messages": messages, "max_tokens": 2}).to_string()).await.json();
    assert_eq!(chat["count"], done["usage"]["prompt_tokens"], "{chat} / {done}");
    let no_prompt = post(&addr, "/tokenize", &json!({"messages": messages, "add_generation_prompt": false}).to_string()).await.json();
    assert!(no_prompt["count"].as_u64() < chat["count"].as_u64(), "{no_prompt} / {chat}");

    // Round trip.
    let v = post(&addr, "/detokenize", &json!({"model": model, "tokens": bare}).to_string()).await.json();
    assert_eq!(v, json!({"prompt": prompt}));
    let decoded = post(&addr, "/detokenize", &json!({"tokens": chat["tokens"]}).to_string()).await.json();
    assert!(decoded["prompt"].as_str().unwrap().contains("<|im_start|>user\nHi"), "{decoded}");

    // Bad input: a 400 naming the field.
    let vocab = text.tokenizer.vocab_size();
    for (path, body, param, needle) in [
        ("/tokenize", json!({"model": "gpt-17", "prompt": "x"}), "model", "gpt-17"),
        ("/tokenize", json!({"prompt": ["x"]}), "prompt", "must be a string"),
        ("/tokenize", json!({"prompt": "x", "add_special_tokens": 1}), "add_special_tokens", "invalid type"),
        ("/tokenize", json!({"prompt": "x", "stream": true}), "stream", "unknown field \"stream\""),
        ("/tokenize", json!({"messages": [{"content": "x"}]}), "messages", "`role` is required"),
        ("/detokenize", json!({"tokens": [1, vocab]}), "tokens", &format!("`tokens[1]` = {vocab} is outside the vocabulary")),
        ("/detokenize", json!({"tokens": [1, -1]}), "tokens", "token ids"),
        ("/detokenize", json!({"tokens": "1"}), "tokens", "must be an array"),
        ("/detokenize", json!({"model": "gpt-17", "tokens": [1]}), "model", "does not exist"),
    ] {
        let e = post(&addr, path, &body.to_string()).await.error(400);
        assert_eq!(e["param"].as_str(), Some(param), "{body}: {e}");
        assert!(e["message"].as_str().unwrap().contains(needle), "{body}: {e}");
    }
    // Nothing generated but the one chat completion.
    assert_eq!(d.stats.decode_calls.load(std::sync::atomic::Ordering::Relaxed), 1);
    r.shutdown().await;
}

#[tokio::test]
async fn fields_are_honoured_or_refused_never_ignored() {
    let (r, addr) = router(ApiKeys::default()).await;
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let _d = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let model = common::text().name;
    let chat = |extra: Value| {
        let mut b = json!({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b.to_string()
    };
    // Defaults and no-ops are accepted; the tags are logged.
    let ok = chat(json!({"user": "u1", "metadata": {"team": "a"}, "store": false, "service_tier": "auto",
        "presence_penalty": 0.3, "logit_bias": {"5": -1.5}, "repetition_penalty": 1.1, "min_tokens": 1, "tools": [], "response_format": {"type": "text"}, "n": 1,
        "logprobs": false, "parallel_tool_calls": true, "modalities": ["text"]}));
    let a = post(&addr, "/v1/chat/completions", &ok).await;
    assert_eq!(a.status, 200, "{}", a.body);
    for (extra, param) in [
        (json!({"presence_penalty": 2.3}), "presence_penalty"),
        (json!({"logit_bias": {"1": 300}}), "logit_bias"),
        (json!({"service_tier": "flex"}), "service_tier"),
        (json!({"top_logprobs": 3}), "top_logprobs"),
        (json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}), "tools"),
        (json!({"response_format": {"type": "xml"}}), "response_format"),
        (json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}}), "response_format"),
        (json!({"guided_regex": "(a"}), "guided_regex"),
        (json!({"guided_decoding_backend": "xgrammar"}), "guided_decoding_backend"),
        (json!({"temprature": 0.2}), "temprature"),
        (json!({"stream_options": {"include_usage": true}}), "stream_options"),
    ] {
        let e = post(&addr, "/v1/chat/completions", &chat(extra.clone())).await.error(400);
        assert_eq!(e["param"].as_str(), Some(param), "{extra}: {e}");
        assert!(e["message"].as_str().unwrap().contains(param), "{extra}: {e}");
    }
    r.shutdown().await;
}
