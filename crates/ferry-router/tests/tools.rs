//! Tool calling on the HTTP API, against mock workers that replay a scripted answer: the router
//! serves the text side of a tiny model given vLLM's Hermes template (tests/fixtures/tools), so
//! the prompt carries the tools; the scripted answer's `<tool_call>` block comes back as
//! `message.tool_calls`, and streamed (token by token) as `delta.tool_calls` that add up to the
//! same call, its arguments in several pieces. A template without tools (SmolLM2's) gets Ferry's
//! generic format: a scripted `{"tool_calls": [...]}` or `{"response": ...}` answer comes back as
//! calls or as content.

mod common;

use std::path::{Path, PathBuf};

use common::TestRouter;
use common::http::{self, post};
use ferry_core::WorkerRole;
use ferry_router::{Listeners, RouterConfig};
use ferry_testkit::MockConfig;
use serde_json::{Value, json};

const ANSWER: &str = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>";

fn tool_model() -> PathBuf {
    common::hermes_tool_model("tools")
}

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}})
}

async fn router(model: &Path) -> (TestRouter, String) {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = http.local_addr().unwrap().to_string();
    let r = TestRouter::with(RouterConfig::new(model), Listeners { grpc, http: Some(http), metrics: None }).await;
    r.channel().await;
    (r, addr)
}

#[tokio::test]
async fn scripted_calls_come_back_whole_and_streamed() {
    let dir = tool_model();
    let text = ferry_tokenizer::ModelText::open(&dir).unwrap();
    let ids = text.tokenizer.encode(ANSWER, false).unwrap();
    let script = MockConfig { first_token: ids[0], tokens: ids[1..].to_vec(), ..Default::default() };
    let (r, addr) = router(&dir).await;
    let _p = r.mock(WorkerRole::Prefill, script.clone()).await;
    let _d = r.mock(WorkerRole::Decode, script).await;
    let body = |extra: Value| {
        let mut b = json!({"model": text.name, "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [weather()], "max_tokens": 200});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b.to_string()
    };

    let v = post(&addr, "/v1/chat/completions", &body(json!({}))).await.json();
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    let msg = &choice["message"];
    assert_eq!(msg["content"], "Let me check.", "{v}");
    let calls = msg["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 1, "{v}");
    assert_eq!((calls[0]["type"].as_str(), calls[0]["function"]["name"].as_str()), (Some("function"), Some("get_weather")));
    assert_eq!(calls[0]["function"]["arguments"], "{\"city\": \"Paris\", \"unit\": \"celsius\"}");
    let id = calls[0]["id"].as_str().unwrap();
    assert!(id.starts_with("call_") && id.len() == 29, "{id}");

    // Streamed, one token per delta: content, then the call in two chunks, then the finish.
    let events = http::open(&addr, "POST", "/v1/chat/completions", None, Some(&body(json!({"stream": true})))).await.events().await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let (mut content, mut name, mut args, mut finish, mut ids) = (String::new(), String::new(), String::new(), None, Vec::new());
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        let d = &c["choices"][0]["delta"];
        content += d["content"].as_str().unwrap_or("");
        for tc in d["tool_calls"].as_array().into_iter().flatten() {
            assert_eq!(tc["index"], 0, "{e}");
            ids.extend(tc["id"].as_str().map(str::to_owned));
            name += tc["function"]["name"].as_str().unwrap_or("");
            args += tc["function"]["arguments"].as_str().unwrap_or("");
        }
        if let Some(f) = c["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_owned());
        }
    }
    assert_eq!((content.as_str(), name.as_str(), args.as_str()), ("Let me check.", "get_weather", "{\"city\": \"Paris\", \"unit\": \"celsius\"}"));
    assert_eq!((ids.len(), finish.as_deref()), (1, Some("tool_calls")));
    let pieces = events.iter().filter(|e| e.contains("\"arguments\":\"{") || e.contains("\"arguments\":\"")).count();
    assert!(pieces > 3, "the arguments stream piece by piece, not in one chunk: {pieces} chunks");

    // tool_choice none: no tools offered, the text comes back as it is.
    let v = post(&addr, "/v1/chat/completions", &body(json!({"tool_choice": "none"}))).await.json();
    assert_eq!(v["choices"][0]["message"]["content"], ANSWER, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    // A forcing choice compiles its grammar in the router first (the mock replays regardless).
    let v = post(&addr, "/v1/chat/completions", &body(json!({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))).await;
    assert_eq!(v.status, 200, "{}", v.body);
    // A conversation with the call and its result renders (the result named after its call).
    let turn = json!({"messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18"}]});
    let a = post(&addr, "/v1/chat/completions", &body(turn)).await;
    assert_eq!(a.status, 200, "{}", a.body);
    r.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// One answer (streamed, one token per delta, and whole) of a router serving SmolLM2's text
/// side to mock workers that replay `answer`: the message's content and calls, and how many
/// chunks carried arguments.
async fn generic_answer(addr: &str, text: &ferry_tokenizer::ModelText, extra: Value) -> (Value, String, Vec<(String, String)>, usize) {
    let body = |stream: bool| {
        let mut b = json!({"model": text.name, "messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [weather()], "max_tokens": 200, "stream": stream});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b.to_string()
    };
    let whole = post(addr, "/v1/chat/completions", &body(false)).await.json();
    let events = http::open(addr, "POST", "/v1/chat/completions", None, Some(&body(true))).await.events().await;
    let (mut content, mut calls, mut arg_chunks) = (String::new(), Vec::<(String, String)>::new(), 0);
    for e in &events[..events.len() - 1] {
        let c: Value = serde_json::from_str(e).unwrap();
        let d = &c["choices"][0]["delta"];
        content += d["content"].as_str().unwrap_or("");
        for tc in d["tool_calls"].as_array().into_iter().flatten() {
            let i = tc["index"].as_u64().unwrap() as usize;
            if i == calls.len() {
                calls.push((tc["function"]["name"].as_str().unwrap().to_owned(), String::new()));
            }
            let a = tc["function"]["arguments"].as_str().unwrap_or("");
            arg_chunks += usize::from(!a.is_empty());
            calls[i].1 += a;
        }
    }
    (whole, content, calls, arg_chunks)
}

#[tokio::test]
async fn a_template_without_tools_gets_the_generic_format() {
    let model = common::model_path();
    let text = common::text();
    for (answer, content, calls) in [
        (
            r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]}"#,
            "",
            vec![("get_weather", r#"{"city": "Paris", "unit": "celsius"}"#)],
        ),
        (r#"{"response": "It is sunny in \"Paris\"."}"#, r#"It is sunny in "Paris"."#, vec![]),
    ] {
        let ids = text.tokenizer.encode(answer, false).unwrap();
        let script = MockConfig { first_token: ids[0], tokens: ids[1..].to_vec(), ..Default::default() };
        let (r, addr) = router(&model).await;
        let _p = r.mock(WorkerRole::Prefill, script.clone()).await;
        let _d = r.mock(WorkerRole::Decode, script).await;
        for choice in [json!("auto"), json!("required")] {
            let (whole, streamed, got, arg_chunks) = generic_answer(&addr, &text, json!({"tool_choice": choice})).await;
            let msg = &whole["choices"][0]["message"];
            assert_eq!(msg["content"].as_str().unwrap_or(""), content, "{whole}");
            assert_eq!(streamed, content, "the stream's content is the whole answer's");
            let whole_calls: Vec<(String, String)> = msg["tool_calls"].as_array().into_iter().flatten()
                .map(|c| (c["function"]["name"].as_str().unwrap().to_owned(), c["function"]["arguments"].as_str().unwrap().to_owned()))
                .collect();
            let want: Vec<(String, String)> = calls.iter().map(|(n, a)| (n.to_string(), a.to_string())).collect();
            assert_eq!((&whole_calls, &got), (&want, &want), "{whole}");
            let finish = if calls.is_empty() { "stop" } else { "tool_calls" };
            assert_eq!(whole["choices"][0]["finish_reason"], finish, "{whole}");
            if !calls.is_empty() {
                assert!(arg_chunks > 3, "arguments streamed piece by piece: {arg_chunks} chunks");
            }
        }
        r.shutdown().await;
    }
}

#[tokio::test]
async fn a_tool_the_template_cannot_render_is_a_400_naming_tools() {
    let dir = tool_model();
    let model = ferry_tokenizer::ModelText::open(&dir).unwrap().name;
    let (r, addr) = router(&dir).await;
    // The Hermes template concatenates each function's description: one without it fails there.
    let bare = json!({"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}});
    let e = post(&addr, "/v1/chat/completions", &json!({"model": model, "messages": [{"role": "user", "content": "Time?"}], "tools": [bare]}).to_string())
        .await
        .error(400);
    assert_eq!(e["param"], "tools", "{e}");
    let m = e["message"].as_str().unwrap();
    assert!(m.contains("cannot render these `tools`") && m.contains("description"), "{m}");
    r.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// gRPC `Generate` with tools on SmolLM2 (the generic format): the deltas keep their token ids
/// but carry no call text, the call comes as `ToolCallDelta` events (id and name, then its
/// arguments in pieces, then `done`), and the final counts it. A bad tool is INVALID_ARGUMENT
/// with the HTTP API's words.
#[tokio::test]
async fn grpc_generate_takes_tools_and_streams_calls() {
    use ferry_proto::v1::{self, generate_response::Event};
    let text = common::text();
    let answer = r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]}"#;
    let ids = text.tokenizer.encode(answer, false).unwrap();
    let script = MockConfig { first_token: ids[0], tokens: ids[1..].to_vec(), ..Default::default() };
    let (r, _addr) = router(&common::model_path()).await;
    let _p = r.mock(WorkerRole::Prefill, script.clone()).await;
    let _d = r.mock(WorkerRole::Decode, script).await;
    let mut c = v1::ferry_client::FerryClient::new(r.channel().await);
    let tool = v1::Tool {
        name: "get_weather".into(),
        description: "Weather.".into(),
        parameters: weather()["function"]["parameters"].to_string(),
        strict: false,
    };
    let req = |tools: Vec<v1::Tool>, choice: Option<v1::tool_choice::Choice>| v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Chat(v1::ChatInput {
            messages: vec![v1::ChatMessage { role: "user".into(), content: "Weather in Paris?".into(), ..Default::default() }],
        })),
        tools,
        tool_choice: choice.map(|c| v1::ToolChoice { choice: Some(c) }),
        stop: Some(v1::StopConditions { max_tokens: 200, ..Default::default() }),
        ..Default::default()
    };
    let mut s = c.generate(req(vec![tool.clone()], Some(v1::tool_choice::Choice::Mode(v1::tool_choice::Mode::Required as i32)))).await.unwrap().into_inner();
    let (mut text_seen, mut token_ids, mut calls, mut fin) = (String::new(), 0, Vec::<v1::ToolCallDelta>::new(), None);
    while let Some(m) = s.message().await.unwrap() {
        match m.event {
            Some(Event::Delta(d)) => {
                text_seen += &d.text;
                token_ids += d.token_ids.len();
            }
            Some(Event::ToolCall(t)) => calls.push(t),
            Some(Event::Final(f)) => fin = Some(f),
            None => {}
        }
    }
    assert_eq!((text_seen.as_str(), token_ids), ("", ids.len()), "every token comes, no call text");
    assert_eq!((calls[0].name.as_str(), calls[0].call_index, calls[0].index), ("get_weather", 0, 0));
    assert!(calls[0].id.starts_with("call_"), "{:?}", calls[0]);
    let args: String = calls.iter().map(|t| t.arguments.as_str()).collect();
    assert_eq!(args, r#"{"city": "Paris", "unit": "celsius"}"#);
    assert!(calls.iter().filter(|t| !t.arguments.is_empty()).count() > 3, "arguments in pieces: {calls:?}");
    assert!(calls.last().unwrap().done);
    assert_eq!(fin.expect("a final").tool_calls, 1);

    let bad = v1::Tool { name: "a b".into(), ..tool.clone() };
    let e = c.generate(req(vec![bad], None)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    assert!(e.message().contains("must be 1 to 64"), "{e:?}");
    let e = c.generate(req(vec![tool], Some(v1::tool_choice::Choice::Function("nope".into())))).await.unwrap_err();
    assert!(e.message().contains("not in `tools`"), "{e:?}");
    r.shutdown().await;
}
