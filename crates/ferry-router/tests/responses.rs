//! `POST /v1/responses` on the HTTP API, against mock workers that replay a scripted answer: the
//! `response` object, its events (in OpenAI's order, numbered, adding up to the same object),
//! the stateless refusals, an error mid-stream, and function calls (the text side of a tiny model
//! given vLLM's Hermes template, as tests/tools.rs builds it) with a follow-up turn that sends the
//! call and its output back as items.

mod common;

use std::path::PathBuf;

use common::TestRouter;
use common::http::{self, post};
use ferry_core::WorkerRole;
use ferry_router::{Listeners, RouterConfig};
use ferry_testkit::MockConfig;
use serde_json::{Value, json};

/// A streamed response's events: `(event name, data)` per event.
async fn stream(addr: &str, body: &Value) -> Vec<(String, Value)> {
    let o = http::open(addr, "POST", "/v1/responses", None, Some(&body.to_string())).await;
    assert_eq!((o.status, o.content_type.as_str()), (200, "text/event-stream"));
    let text = o.text().await;
    text.split_terminator("\n\n")
        .map(|e| {
            let (name, data) = e.split_once('\n').unwrap_or_else(|| panic!("an event without data: {e:?}"));
            let name = name.strip_prefix("event: ").unwrap_or_else(|| panic!("no event line: {e:?}"));
            let data = data.strip_prefix("data: ").unwrap_or_else(|| panic!("no data line: {e:?}"));
            (name.to_owned(), serde_json::from_str(data).unwrap_or_else(|err| panic!("{err}: {data}")))
        })
        .collect()
}

/// Checks the events' names and numbers, and gives back the text and arguments their deltas add
/// up to, per output index.
fn added_up(events: &[(String, Value)]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for (n, (name, data)) in events.iter().enumerate() {
        assert_eq!((data["type"].as_str(), data["sequence_number"].as_u64()), (Some(name.as_str()), Some(n as u64)), "{data}");
        let i = data["output_index"].as_u64().unwrap_or(0) as usize;
        match name.as_str() {
            "response.output_item.added" => out.push(String::new()),
            "response.output_text.delta" | "response.function_call_arguments.delta" => out[i] += data["delta"].as_str().unwrap(),
            _ => {}
        }
    }
    out
}

/// The object without what differs from one request to the next.
fn steady(mut r: Value) -> Value {
    for k in ["id", "created_at"] {
        r[k] = Value::Null;
    }
    // Item ids are built on the response id, or are a call's random one.
    for item in r["output"].as_array_mut().into_iter().flatten() {
        for k in ["id", "call_id"] {
            if item.get(k).is_some() {
                item[k] = Value::Null;
            }
        }
    }
    r
}

#[tokio::test]
async fn a_text_response_whole_and_streamed() {
    let (r, addr) = common::router_with_http().await;
    let _p = r.mock(WorkerRole::Prefill, common::scripted("Hello there, friend")).await;
    let _d = r.mock(WorkerRole::Decode, common::scripted("Hello there, friend")).await;
    let model = common::text().name;
    let body = json!({"model": model, "instructions": "Be brief.", "input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}],
        "max_output_tokens": 50, "temperature": 0, "metadata": {"k": "v"}});
    let v = post(&addr, "/v1/responses", &body.to_string()).await.json();
    assert_eq!((v["object"].as_str(), v["status"].as_str(), v["model"].as_str()), (Some("response"), Some("completed"), Some(model.as_str())), "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("resp_"), "{v}");
    let item = &v["output"][0];
    assert_eq!((item["type"].as_str(), item["role"].as_str(), item["status"].as_str()), (Some("message"), Some("assistant"), Some("completed")), "{v}");
    assert!(item["id"].as_str().unwrap().starts_with("msg_"), "{v}");
    assert_eq!(item["content"][0]["text"], "Hello there, friend", "{v}");
    let u = &v["usage"];
    assert_eq!(u["total_tokens"].as_u64(), Some(u["input_tokens"].as_u64().unwrap() + u["output_tokens"].as_u64().unwrap()), "{v}");
    assert_eq!((v["instructions"].as_str(), v["max_output_tokens"].as_u64(), v["store"].as_bool()), (Some("Be brief."), Some(50), Some(false)));
    assert_eq!(v["metadata"], json!({"k": "v"}));

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = stream(&addr, &streamed).await;
    let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(names[..4], ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]);
    assert_eq!(names[names.len() - 4..], ["response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]);
    assert_eq!(added_up(&events), ["Hello there, friend"]);
    let last = &events.last().unwrap().1["response"];
    assert_eq!(steady(last.clone()), steady(v.clone()), "the stream adds up to the whole object");

    // Cut short by max_output_tokens: incomplete.
    let v = post(&addr, "/v1/responses", &json!({"model": model, "input": "Hi", "max_output_tokens": 2}).to_string()).await.json();
    assert_eq!((v["status"].as_str(), v["incomplete_details"]["reason"].as_str()), (Some("incomplete"), Some("max_output_tokens")), "{v}");
    r.shutdown().await;
}

#[tokio::test]
async fn stateless_refusals_name_the_field() {
    let (r, addr) = common::router_with_http().await;
    let model = common::text().name;
    for (extra, param) in [
        (json!({"store": true}), "store"),
        (json!({"previous_response_id": "resp_1"}), "previous_response_id"),
        (json!({"tools": [{"type": "web_search"}]}), "tools"),
        (json!({"input": [{"type": "item_reference", "id": "msg_1"}]}), "input[0].type"),
    ] {
        let mut b = json!({"model": model, "input": "Hi"});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        let a = post(&addr, "/v1/responses", &b.to_string()).await;
        let e = a.error(400);
        assert_eq!(e["param"], param, "{extra}: {e}");
        common::assert_clean(&extra.to_string(), &a.body);
    }
    let e = post(&addr, "/v1/responses", &json!({"model": "nope", "input": "Hi"}).to_string()).await.error(404);
    assert_eq!(e["param"], "model");
    r.shutdown().await;
}

#[tokio::test]
async fn an_error_mid_stream_fails_the_response() {
    let (r, addr) = common::router_with_http().await;
    let script = MockConfig { break_after_tokens: Some(2), ..common::scripted("one two three four five six") };
    let _p = r.mock(WorkerRole::Prefill, script.clone()).await;
    let _d = r.mock(WorkerRole::Decode, script).await;
    let events = stream(&addr, &json!({"model": common::text().name, "input": "Hi", "stream": true})).await;
    let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    assert_eq!(names[names.len() - 2..], ["error", "response.failed"], "{names:?}");
    let failed = &events.last().unwrap().1["response"];
    assert_eq!(failed["status"], "failed");
    assert!(failed["error"]["message"].is_string(), "{failed}");
    added_up(&events);
    r.shutdown().await;
}

const ANSWER: &str = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>";

fn tool_model() -> PathBuf {
    common::hermes_tool_model("responses")
}

#[tokio::test]
async fn function_calls_come_back_as_items_and_go_back_as_input() {
    let dir = tool_model();
    let text = ferry_tokenizer::ModelText::open(&dir).unwrap();
    let ids = text.tokenizer.encode(ANSWER, false).unwrap();
    let script = MockConfig { first_token: ids[0], tokens: ids[1..].to_vec(), ..Default::default() };
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = http.local_addr().unwrap().to_string();
    let r = TestRouter::with(RouterConfig::new(&dir), Listeners { grpc, http: Some(http), metrics: None }).await;
    r.channel().await;
    let _p = r.mock(WorkerRole::Prefill, script.clone()).await;
    let _d = r.mock(WorkerRole::Decode, script).await;
    let tool = json!({"type": "function", "name": "get_weather", "description": "Weather.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}});
    let body = json!({"model": text.name, "input": "Weather in Paris?", "tools": [tool], "max_output_tokens": 200});

    let v = post(&addr, "/v1/responses", &body.to_string()).await.json();
    assert_eq!(v["status"], "completed", "{v}");
    let out = v["output"].as_array().unwrap();
    assert_eq!(out.len(), 2, "{v}");
    assert_eq!(out[0]["content"][0]["text"], "Let me check.");
    let call = &out[1];
    assert_eq!((call["type"].as_str(), call["name"].as_str(), call["status"].as_str()), (Some("function_call"), Some("get_weather"), Some("completed")));
    assert_eq!(call["arguments"], "{\"city\": \"Paris\", \"unit\": \"celsius\"}");
    assert!(call["call_id"].as_str().unwrap().starts_with("call_") && call["id"].as_str().unwrap().starts_with("fc_"), "{call}");
    assert_eq!(v["tools"][0]["strict"], true, "{v}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let events = stream(&addr, &streamed).await;
    assert_eq!(added_up(&events), ["Let me check.", "{\"city\": \"Paris\", \"unit\": \"celsius\"}"]);
    let names: Vec<&str> = events.iter().map(|e| e.0.as_str()).collect();
    assert!(names.contains(&"response.function_call_arguments.done"), "{names:?}");
    let last = &events.last().unwrap().1["response"];
    assert_eq!(last["output"][1]["name"], "get_weather");
    assert_eq!(last["status"], "completed");

    // A forced call compiles its grammar (the mock replays regardless).
    let mut forced = body.clone();
    forced["tool_choice"] = json!({"type": "function", "name": "get_weather"});
    let a = post(&addr, "/v1/responses", &forced.to_string()).await;
    assert_eq!(a.status, 200, "{}", a.body);

    // The next turn: the call and its output go back as items.
    let mut turn = body.clone();
    turn["input"] = json!([
        {"role": "user", "content": "Weather in Paris?"},
        call.clone(),
        {"type": "function_call_output", "call_id": call["call_id"], "output": "18"}]);
    let a = post(&addr, "/v1/responses", &turn.to_string()).await;
    assert_eq!(a.status, 200, "{}", a.body);
    r.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// SmolLM2's template takes no tools: the generic format (tools described in the prompt, the
/// answer `{"tool_calls": [...]}` or `{"response": "..."}`) gives the same items, the call's
/// arguments streamed in pieces.
#[tokio::test]
async fn a_template_without_tools_answers_in_the_generic_format() {
    let text = common::text();
    let tool = json!({"type": "function", "name": "get_weather", "description": "Weather.", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}});
    for (answer, want) in [
        (r#"{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}"#, vec![("function_call", r#"{"city": "Paris"}"#)]),
        (r#"{"response": "It is sunny in \"Paris\"."}"#, vec![("message", r#"It is sunny in "Paris"."#)]),
    ] {
        let ids = text.tokenizer.encode(answer, false).unwrap();
        let script = MockConfig { first_token: ids[0], tokens: ids[1..].to_vec(), ..Default::default() };
        let (r, addr) = common::router_with_http().await;
        let _p = r.mock(WorkerRole::Prefill, script.clone()).await;
        let _d = r.mock(WorkerRole::Decode, script).await;
        let body = json!({"model": text.name, "input": "Weather in Paris?", "tools": [tool], "max_output_tokens": 200});
        let v = post(&addr, "/v1/responses", &body.to_string()).await.json();
        let got: Vec<(&str, &str)> = v["output"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| (o["type"].as_str().unwrap(), o["arguments"].as_str().or(o["content"][0]["text"].as_str()).unwrap()))
            .collect();
        assert_eq!(got, want, "{v}");
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let events = stream(&addr, &streamed).await;
        let added = added_up(&events);
        assert_eq!(added, want.iter().map(|w| w.1).collect::<Vec<_>>());
        if want[0].0 == "function_call" {
            let pieces = events.iter().filter(|e| e.0 == "response.function_call_arguments.delta").count();
            assert!(pieces > 2, "arguments streamed piece by piece: {pieces} deltas");
        }
        assert_eq!(steady(events.last().unwrap().1["response"].clone()), steady(v.clone()));
        r.shutdown().await;
    }
}
