//! The OpenAI-compatible HTTP API against mock workers on loopback: completions and chat,
//! whole and streamed (SSE), usage, stop strings, models, errors in OpenAI's shape, and a client
//! that hangs up mid-stream.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::http::{self, open, post};
use common::{TestRouter, scripted, wait_until};
use ferry_core::WorkerRole;
use ferry_proto::v1;
use ferry_router::{Listeners, RouterConfig};
use ferry_testkit::MockConfig;
use serde_json::{Value, json};

const SCRIPT: &str = " Hello world, this is Ferry speaking. Nice to meet you.";

/// A router serving gRPC and HTTP on port 0; returns it with the HTTP address.
async fn router() -> (TestRouter, String) {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = http.local_addr().unwrap().to_string();
    let listeners = Listeners {
        grpc,
        http: Some(http),
        metrics: None,
    };
    let r = TestRouter::with(RouterConfig::new(common::model_path()), listeners).await;
    r.channel().await;
    (r, addr)
}

fn model() -> String {
    common::text().name
}

fn body(v: Value) -> String {
    v.to_string()
}

#[tokio::test]
async fn completions_and_chat_whole_answers() {
    let (r, addr) = router().await;
    let m = scripted(SCRIPT);
    let _p = r.mock(WorkerRole::Prefill, m.clone()).await;
    let _d = r.mock(WorkerRole::Decode, m.clone()).await;
    let prompt_tokens = common::text().encode_prompt("Hi").unwrap().len() as u64;
    let n = 1 + m.tokens.len() as u64;

    let a = post(
        &addr,
        "/v1/completions",
        &body(json!({"model": model(), "prompt": "Hi", "max_tokens": 100, "temperature": 0})),
    )
    .await;
    assert_eq!(
        (a.status, a.content_type.as_str()),
        (200, "application/json"),
        "{}",
        a.body
    );
    let v = a.json();
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"), "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], model());
    assert!(v["created"].as_u64().unwrap() > 1_700_000_000);
    assert_eq!(v["choices"][0]["text"], SCRIPT);
    assert_eq!(v["choices"][0]["index"], 0);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n, "prompt_tokens_details": {"cached_tokens": 0}})
    );

    // max_tokens cuts at `length`; a stop string ends early and is not returned.
    let v = post(
        &addr,
        "/v1/completions",
        &body(json!({"model": model(), "prompt": ["Hi"], "max_tokens": 3})),
    )
    .await
    .json();
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let v = post(
        &addr,
        "/v1/completions",
        &body(json!({"model": model(), "prompt": "Hi", "stop": "Ferry"})),
    )
    .await
    .json();
    assert_eq!(v["choices"][0]["text"], " Hello world, this is ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Token ids as the prompt.
    let v = post(
        &addr,
        "/v1/completions",
        &body(json!({"model": model(), "prompt": [5, 6, 7], "max_tokens": 2})),
    )
    .await
    .json();
    assert_eq!(v["usage"]["prompt_tokens"], 3);

    let chat = json!({
        "model": model(),
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "2+2?"}]}],
        "max_completion_tokens": 100,
        "seed": 3,
        "user": "an extra field",
    });
    let v = post(&addr, "/v1/chat/completions", &body(chat))
        .await
        .json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"), "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(
        v["choices"][0]["message"],
        json!({"role": "assistant", "content": SCRIPT})
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["usage"]["completion_tokens"], n);
    assert!(
        v["usage"]["prompt_tokens"].as_u64().unwrap() > 5,
        "the template adds tokens: {v}"
    );

    let v = http::get(&addr, "/v1/models").await.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], model());
    assert_eq!(v["data"][0]["object"], "model");
    // The default model's name: its file's, without the quantisation.
    assert_eq!(model(), "SmolLM2-135M-Instruct");
    let v = http::get(&addr, &format!("/v1/models/{}", model())).await.json();
    assert_eq!(v["id"], model());
    let e = http::get(&addr, "/v1/models/gpt-17").await.error(404);
    assert_eq!(e["code"], "model_not_found");
    r.shutdown().await;
}

/// The `data:` payloads of a stream, `[DONE]` last, the JSON ones parsed.
async fn stream(addr: &str, path: &str, req: Value) -> Vec<Value> {
    let o = open(addr, "POST", path, None, Some(&req.to_string())).await;
    assert_eq!(
        (o.status, o.content_type.as_str()),
        (200, "text/event-stream")
    );
    let events = o.events().await;
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect()
}

#[tokio::test]
async fn completions_and_chat_stream_as_sse() {
    let (r, addr) = router().await;
    let m = scripted(SCRIPT);
    let _p = r.mock(WorkerRole::Prefill, m.clone()).await;
    let _d = r.mock(WorkerRole::Decode, m.clone()).await;
    let n = 1 + m.tokens.len() as u64;

    let chunks = stream(&addr, "/v1/completions", json!({"model": model(), "prompt": "Hi", "stream": true, "stream_options": {"include_usage": true}})).await;
    assert!(chunks.len() > 4, "streamed in pieces: {chunks:?}");
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("cmpl-"));
    for c in &chunks {
        assert_eq!(
            (c["id"].as_str(), c["object"].as_str()),
            (Some(id), Some("text_completion")),
            "{c}"
        );
        assert!(
            c.as_object().unwrap().contains_key("usage"),
            "every chunk has usage (null but the last): {c}"
        );
    }
    let (last, body) = chunks.split_last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], n);
    let text: String = body
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, SCRIPT);
    let (fin, deltas) = body.split_last().unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "stop");
    assert!(
        deltas
            .iter()
            .all(|c| c["choices"][0]["finish_reason"].is_null() && c["usage"].is_null())
    );

    // Without include_usage there is no usage anywhere; a stop string says `stop`.
    let chunks = stream(
        &addr,
        "/v1/completions",
        json!({"model": model(), "prompt": "Hi", "stream": true, "stop": ["Ferry"]}),
    )
    .await;
    assert!(
        chunks
            .iter()
            .all(|c| !c.as_object().unwrap().contains_key("usage"))
    );
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    assert_eq!(text, " Hello world, this is ");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );

    let chunks = stream(
        &addr,
        "/v1/chat/completions",
        json!({"model": model(), "messages": [{"role": "user", "content": "Hi"}], "stream": true, "max_tokens": 4, "stream_options": {"include_usage": true}}),
    )
    .await;
    assert!(chunks[0]["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert!(
        chunks
            .iter()
            .all(|c| c["object"] == "chat.completion.chunk")
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(
        chunks[1..]
            .iter()
            .all(|c| c["choices"][0]["delta"].get("role").is_none())
    );
    let (usage, body) = chunks.split_last().unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 4);
    let (fin, _) = body.split_last().unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "length");
    assert_eq!(fin["choices"][0]["delta"], json!({}));
    let text: String = body
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    let want: String = common::text()
        .tokenizer
        .decode(&m.tokens_with_first()[..4], true)
        .unwrap();
    assert_eq!(text, want);
    r.shutdown().await;
}

trait Tokens {
    fn tokens_with_first(&self) -> Vec<u32>;
}

impl Tokens for MockConfig {
    fn tokens_with_first(&self) -> Vec<u32> {
        std::iter::once(self.first_token)
            .chain(self.tokens.iter().copied())
            .collect()
    }
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let (r, addr) = router().await;
    // No workers yet: 503.
    let e = post(
        &addr,
        "/v1/completions",
        &body(json!({"model": model(), "prompt": "Hi"})),
    )
    .await
    .error(503);
    assert_eq!(e["type"], "server_error");
    let e = post(&addr, "/v1/chat/completions", &body(json!({"model": model(), "messages": [{"role": "user", "content": "Hi"}], "stream": true}))).await.error(503);
    assert!(e["message"].as_str().unwrap().contains("no ready"), "{e}");
    let p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let d = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;

    let m = model();
    let cases: Vec<(&str, String, u16, Option<&str>, &str)> = vec![
        (
            "/v1/completions",
            "{\"model\": ".into(),
            400,
            None,
            "malformed JSON",
        ),
        (
            "/v1/completions",
            "not json".into(),
            400,
            None,
            "malformed JSON",
        ),
        ("/v1/completions", "[1]".into(), 400, None, "JSON object"),
        (
            "/v1/completions",
            body(json!({"model": m, "prompt": "Hi", "max_tokens": "five"})),
            400,
            Some("max_tokens"),
            "invalid type",
        ),
        (
            "/v1/completions",
            body(json!({"model": m, "prompt": "Hi", "temperature": "hot"})),
            400,
            Some("temperature"),
            "invalid type",
        ),
        (
            "/v1/completions",
            body(json!({"model": m, "prompt": "Hi", "n": 0})),
            400,
            Some("n"),
            "`n` must be between 1 and 16, got 0",
        ),
        (
            "/v1/chat/completions",
            body(json!({"model": m, "messages": [{"role": "user", "content": "Hi"}], "n": 17})),
            400,
            Some("n"),
            "`n` must be between 1 and 16, got 17",
        ),
        (
            "/v1/completions",
            body(json!({"model": m, "prompt": ["a", "b"]})),
            400,
            Some("prompt"),
            "batched",
        ),
        (
            "/v1/completions",
            body(json!({"model": m, "prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]})),
            400,
            Some("stop"),
            "at most 4",
        ),
        (
            "/v1/completions",
            body(json!({"model": m, "prompt": ""})),
            400,
            None,
            "empty",
        ),
        (
            "/v1/completions",
            body(json!({"model": m, "prompt": "Hi", "temperature": -1})),
            400,
            Some("temperature"),
            "temperature",
        ),
        (
            "/v1/completions",
            body(json!({"model": m, "prompt": [1, 49152]})),
            400,
            None,
            "49152",
        ),
        (
            "/v1/completions",
            body(json!({"prompt": "Hi"})),
            400,
            Some("model"),
            "required",
        ),
        (
            "/v1/chat/completions",
            body(json!({"model": m, "messages": []})),
            400,
            Some("messages"),
            "empty",
        ),
        (
            "/v1/completions",
            body(json!({"model": "gpt-17", "prompt": "Hi"})),
            404,
            Some("model"),
            "gpt-17",
        ),
        (
            "/v1/chat/completions",
            body(
                json!({"model": "gpt-17", "messages": [{"role": "user", "content": "Hi"}], "stream": true}),
            ),
            404,
            Some("model"),
            "gpt-17",
        ),
    ];
    for (path, req, status, param, needle) in cases {
        let a = post(&addr, path, &req).await;
        let e = a.error(status);
        let want_type = if status == 503 {
            "server_error"
        } else {
            "invalid_request_error"
        };
        assert_eq!(e["type"], want_type, "{req}: {e}");
        assert_eq!(e["param"].as_str(), param, "{req}: {e}");
        assert!(
            e["message"].as_str().unwrap().contains(needle),
            "{req}: {e}"
        );
        if status == 404 {
            assert_eq!(e["code"], "model_not_found");
        }
    }
    // Unknown routes answer in the same shape.
    http::get(&addr, "/v1/embeddings").await.error(404);
    // Nothing reached a worker, and the router still serves.
    assert_eq!(p.stats.prefill_calls.load(Ordering::Relaxed), 0);
    assert_eq!(d.stats.decode_calls.load(Ordering::Relaxed), 0);
    let a = post(
        &addr,
        "/v1/completions",
        &body(json!({"model": m, "prompt": "Hi"})),
    )
    .await;
    assert_eq!(a.status, 200, "{}", a.body);
    r.shutdown().await;
}

#[tokio::test]
async fn client_gone_mid_stream_cancels_the_request() {
    let (r, addr) = router().await;
    let long = MockConfig {
        token_delay: Duration::from_millis(20),
        tokens: scripted(&SCRIPT.repeat(30)).tokens,
        ..scripted(SCRIPT)
    };
    let _p = r.mock(WorkerRole::Prefill, long.clone()).await;
    let d = r.mock(WorkerRole::Decode, long).await;
    let req = json!({"model": model(), "prompt": "Hi", "max_tokens": 500, "stream": true});
    let mut o = open(
        &addr,
        "POST",
        "/v1/completions",
        None,
        Some(&req.to_string()),
    )
    .await;
    assert_eq!(o.status, 200);
    for _ in 0..3 {
        let e = o.event().await.expect("a chunk");
        assert!(e.contains("text_completion"), "{e}");
    }
    drop(o);
    wait_until("the decode stream to be cancelled", async || {
        d.stats.decode_cancelled.load(Ordering::Relaxed) == 1
    })
    .await;
    let mut admin = r.admin().await;
    wait_until("the router to release the request", async || {
        let ws = admin
            .list_workers(v1::ListWorkersRequest {})
            .await
            .unwrap()
            .into_inner()
            .workers;
        ws.iter().all(|w| {
            w.inflight == 0 && w.outstanding_prefill_tokens == 0 && w.promised_kv_blocks == 0
        })
    })
    .await;
    r.shutdown().await;
}

#[tokio::test]
async fn served_model_names_replace_the_model_name_and_add_aliases() {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = http.local_addr().unwrap().to_string();
    let cfg = RouterConfig {
        served_model_names: vec!["smollm2".into(), "tiny".into()],
        ..RouterConfig::new(common::model_path())
    };
    let listeners = Listeners {
        grpc,
        http: Some(http),
        metrics: None,
    };
    let r = TestRouter::with(cfg, listeners).await;
    let m = scripted(SCRIPT);
    let _p = r.mock(WorkerRole::Prefill, m.clone()).await;
    let _d = r.mock(WorkerRole::Decode, m.clone()).await;

    let listed = http::get(&addr, "/v1/models").await.json();
    let ids: Vec<&str> = listed["data"].as_array().unwrap().iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["smollm2", "tiny"], "{listed}");
    assert_eq!(http::get(&addr, "/v1/models/tiny").await.status, 200);
    for name in ["smollm2", "tiny"] {
        let a = post(&addr, "/v1/chat/completions", &body(json!({"model": name, "messages": [{"role": "user", "content": "Hi"}]}))).await;
        assert_eq!(a.status, 200, "{}", a.body);
        assert_eq!(a.json()["model"], name);
        assert_eq!(a.json()["choices"][0]["message"]["content"], SCRIPT);
    }
    // The file's own name is no longer served; the error lists what is.
    let a = post(&addr, "/v1/chat/completions", &body(json!({"model": model(), "messages": [{"role": "user", "content": "Hi"}]}))).await;
    assert_eq!(a.status, 404, "{}", a.body);
    assert_eq!(a.json()["error"]["code"], "model_not_found");
    let mut c = r.client().await;
    let mut req = common::prompt("Hi");
    req.model = model();
    let Err(err) = common::generate(&mut c, req).await else { panic!("the file's own model name was served") };
    assert_eq!(err.code(), tonic::Code::NotFound, "{err:?}");
    assert!(err.message().contains("smollm2, tiny"), "{}", err.message());
    let info = c.model_info(v1::ModelInfoRequest {}).await.unwrap().into_inner();
    assert_eq!(info.model, "smollm2");
}
