//! Issue 32's hostile grammars against a router with mock workers on loopback, over HTTP and
//! gRPC: each is refused as a 400 / INVALID_ARGUMENT that names its field and shows no panic,
//! backtrace or source path, and the router then still serves a normal request. A valid
//! grammar is accepted (the positive control).

mod common;

use std::time::{Duration, Instant};

use common::http::post;
use common::scripted;
use ferry_core::WorkerRole;
use ferry_proto::v1::{self, structured_output::Kind};
use serde_json::{Value, json};

const SCRIPT: &str = " Hello world.";

/// `start: r1`, `r1: "x1" | r2`, ..., `rN: "xN"`.
fn chain(n: usize) -> String {
    let mut s = String::from("start: r1\n");
    for i in 1..n {
        s += &format!("r{i}: \"x{i}\" | r{}\n", i + 1);
    }
    s + &format!("r{n}: \"x{n}\"\n")
}

fn choices(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("choice {i}")).collect()
}

/// The HTTP attacks: the body's extra fields, and the field the refusal must name.
fn http_attacks() -> Vec<(Value, &'static str)> {
    vec![
        (json!({"guided_grammar": chain(1000)}), "guided_grammar"),
        (json!({"guided_grammar": chain(5000)}), "guided_grammar"),
        (json!({"guided_choice": choices(100_000)}), "guided_choice"),
        (json!({"guided_regex": "a{1000}{1000}"}), "guided_regex"),
        (json!({"guided_regex": format!("{}a{}", "(".repeat(3000), ")".repeat(3000))}), "guided_regex"),
        (json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}), "response_format"),
        (json!({"guided_json": {"$ref": "#/$defs/A", "$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}}}), "guided_json"),
        (json!({"guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}}}}), "guided_json"),
    ]
}

fn body(path: &str, model: &str, extra: &Value) -> String {
    let mut b = if path.ends_with("chat/completions") {
        json!({"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    } else {
        json!({"model": model, "prompt": "Hi", "max_tokens": 2})
    };
    b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
    b.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_grammars_over_http_are_clean_400s_and_the_router_survives() {
    let (r, addr) = common::router_with_http().await;
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let _d = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let model = common::text().name;
    // Positive control: a valid grammar passes the router's check and the request is served.
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let a = post(&addr, path, &body(path, &model, &json!({"guided_grammar": chain(50)}))).await;
        assert_eq!(a.status, 200, "{path}: {}", a.body);
    }
    for path in ["/v1/chat/completions", "/v1/completions"] {
        for (extra, field) in http_attacks() {
            let t0 = Instant::now();
            let a = post(&addr, path, &body(path, &model, &extra)).await;
            let e = a.error(400);
            assert!(t0.elapsed() < Duration::from_secs(10), "{path} {field}: {:?}", t0.elapsed());
            assert_eq!(e["param"].as_str(), Some(field), "{path}: {e}");
            let msg = e["message"].as_str().unwrap();
            assert!(msg.contains(field), "{path}: {msg}");
            common::assert_clean(path, &a.body);
        }
        // Still serving.
        let a = post(&addr, path, &body(path, &model, &json!({}))).await;
        assert_eq!(a.status, 200, "{path} after the attacks: {}", a.body);
    }
    r.shutdown().await;
}

fn grpc_request(kind: Kind) -> v1::GenerateRequest {
    let mut req = common::prompt("Hi");
    req.sampling = Some(v1::SamplingParams { structured: Some(v1::StructuredOutput { kind: Some(kind) }), ..Default::default() });
    req.stop = Some(v1::StopConditions { max_tokens: 2, ..Default::default() });
    req
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_grammars_over_grpc_are_clean_invalid_arguments_and_the_router_survives() {
    let (r, _addr) = common::router_with_http().await;
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let _d = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let mut c = r.client().await;
    common::generate(&mut c, grpc_request(Kind::Lark(chain(50)))).await.expect("a valid grammar is served");
    for (kind, field) in [
        (Kind::Lark(chain(1000)), "structured.lark"),
        (Kind::Lark(chain(5000)), "structured.lark"),
        (Kind::Choice(v1::Choices { choices: choices(100_000) }), "structured.choice"),
        (Kind::Regex("a{1000}{1000}".into()), "structured.regex"),
        (Kind::JsonSchema(r##"{"$ref":"#"}"##.into()), "structured.json_schema"),
    ] {
        let t0 = Instant::now();
        let s = common::generate(&mut c, grpc_request(kind)).await.err().unwrap_or_else(|| panic!("{field} accepted"));
        assert!(t0.elapsed() < Duration::from_secs(10), "{field}: {:?}", t0.elapsed());
        assert_eq!(s.code(), tonic::Code::InvalidArgument, "{field}: {}", s.message());
        assert!(s.message().contains(field), "{field}: {}", s.message());
        common::assert_clean("gRPC", s.message());
    }
    let done = common::generate(&mut c, common::prompt("Hi")).await.expect("still serving");
    assert!(!done.text.is_empty());
    r.shutdown().await;
}
