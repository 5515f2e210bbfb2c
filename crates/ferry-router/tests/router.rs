//! The router against mock workers on loopback: streaming, fall-through on RESOURCE_EXHAUSTED,
//! retry after a dead prefill worker, bad input, leases, re-registration, drain, metrics.

mod common;

use std::time::Duration;

use common::{TestRouter, generate, model_path, prompt, scripted, wait_until};
use ferry_core::WorkerRole;
use ferry_proto::v1;
use ferry_router::RouterConfig;
use ferry_testkit::MockConfig;
use tonic::Code;

const SCRIPT: &str = " Hello world, this is Ferry speaking. Nice to meet you.";

fn cfg() -> RouterConfig {
    RouterConfig::new(model_path())
}

#[tokio::test]
async fn streams_deltas_then_final_and_metrics() {
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics_addr = metrics.local_addr().unwrap();
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = TestRouter::on(cfg(), grpc, Some(metrics)).await;
    let m = scripted(SCRIPT);
    let _p = r.mock(WorkerRole::Prefill, m.clone()).await;
    let _d = r.mock(WorkerRole::Decode, m.clone()).await;
    let mut c = r.client().await;

    let out = generate(&mut c, prompt("Hi")).await.unwrap();
    assert_eq!(out.text, SCRIPT);
    assert!(out.deltas > 3, "streamed in pieces: {}", out.deltas);
    let f = &out.fin;
    assert_eq!(f.finish_reason, v1::FinishReason::StopToken as i32);
    assert_eq!(f.completion_tokens as usize, 1 + m.tokens.len());
    assert_eq!(out.ids.len(), 1 + m.tokens.len());
    assert_eq!(
        (f.prefill_worker.as_str(), f.decode_worker.as_str()),
        ("prefill-1", "decode-1")
    );
    assert_eq!(f.kv.as_ref().unwrap().bytes, 4096);
    assert!(f.ttft_ms > 0.0 && f.e2e_ms >= f.ttft_ms);

    // max_tokens cuts at LENGTH; a stop string ends early and is not returned.
    let mut req = prompt("Hi");
    req.stop = Some(v1::StopConditions {
        max_tokens: 3,
        ..Default::default()
    });
    let out = generate(&mut c, req).await.unwrap();
    assert_eq!(
        (out.fin.finish_reason, out.fin.completion_tokens),
        (v1::FinishReason::Length as i32, 3)
    );
    let mut req = prompt("Hi");
    req.stop = Some(v1::StopConditions {
        stop: vec!["Ferry".into()],
        ..Default::default()
    });
    let out = generate(&mut c, req).await.unwrap();
    assert_eq!(out.text, " Hello world, this is ");
    assert_eq!(out.fin.finish_reason, v1::FinishReason::StopString as i32);

    // Chat input renders the template; the request id comes back on every message.
    let mut req = v1::GenerateRequest {
        request_id: "req-42".into(),
        input: Some(v1::generate_request::Input::Chat(v1::ChatInput {
            messages: vec![v1::ChatMessage {
                role: "user".into(),
                content: "2+2?".into(),
                ..Default::default()
            }],
        })),
        ..Default::default()
    };
    req.model = common::text().name;
    let mut s = c.generate(req).await.unwrap().into_inner();
    while let Some(m) = s.message().await.unwrap() {
        assert_eq!(m.request_id, "req-42");
    }

    let info = c
        .model_info(v1::ModelInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            info.vocab_size,
            info.max_context,
            info.eos_token_ids.clone()
        ),
        (49152, 2048, vec![2])
    );
    assert!(info.has_chat_template && info.fingerprint == "mock-fingerprint");

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut http = tokio::net::TcpStream::connect(metrics_addr).await.unwrap();
    http.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    http.read_to_string(&mut body).await.unwrap();
    for name in [
        "ferry_router_requests_total",
        "ferry_router_time_to_first_token_seconds",
        "ferry_router_workers",
        "ferry_router_overhead_seconds",
    ] {
        assert!(body.contains(name), "{name} in /metrics:\n{body}");
    }
    r.shutdown().await;
}

#[tokio::test]
async fn resource_exhausted_decode_falls_through_to_the_next() {
    let r = TestRouter::start(RouterConfig { queue_timeout: Duration::from_millis(300), ..cfg() }).await;
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let full = r
        .mock(
            WorkerRole::Decode,
            MockConfig {
                refuse_decode: true,
                ..scripted(SCRIPT)
            },
        )
        .await;
    let _ok = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let mut c = r.client().await;
    let out = generate(&mut c, prompt("Hi")).await.unwrap();
    assert_eq!(out.fin.decode_worker, "decode-2");
    assert_eq!(
        full.stats
            .decode_calls
            .load(std::sync::atomic::Ordering::Relaxed),
        1,
        "decode-1 was asked first"
    );

    // With only refusing decode workers the client gets RESOURCE_EXHAUSTED (after waiting its
    // queue timeout for room).
    let mut admin = r.admin().await;
    admin
        .drain(v1::WorkerRef {
            worker_id: "decode-2".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let err = generate(&mut c, prompt("Hi")).await.err().expect("refused");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err}");
}

#[tokio::test]
async fn dead_prefill_worker_is_marked_and_the_request_retried() {
    let r = TestRouter::start(cfg()).await;
    // A prefill worker whose address refuses connections registers first (prefill-1).
    let gone = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let gone_addr = gone.local_addr().unwrap().to_string();
    drop(gone);
    let mut reg = v1::registry_client::RegistryClient::new(r.channel().await);
    let req = v1::RegisterRequest {
        role: v1::WorkerRole::Prefill as i32,
        grpc_addr: gone_addr,
        fingerprint: "mock-fingerprint".into(),
        max_context: 2048,
        ..Default::default()
    };
    assert_eq!(
        reg.register(req).await.unwrap().into_inner().worker_id,
        "prefill-1"
    );
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let d = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let mut c = r.client().await;
    let out = generate(&mut c, prompt("Hi")).await.unwrap();
    assert_eq!(out.text, SCRIPT);
    assert_eq!(out.fin.prefill_worker, "prefill-2");
    assert_eq!(
        d.stats
            .decode_calls
            .load(std::sync::atomic::Ordering::Relaxed),
        2,
        "admitted twice (first attempt dropped)"
    );
    let workers = r
        .admin()
        .await
        .list_workers(v1::ListWorkersRequest {})
        .await
        .unwrap()
        .into_inner()
        .workers;
    let dead = workers.iter().find(|w| w.worker_id == "prefill-1").unwrap();
    assert_eq!(dead.state, v1::WorkerState::Dead as i32);
    assert!(
        workers
            .iter()
            .all(|w| w.inflight == 0 && w.outstanding_prefill_tokens == 0),
        "{workers:?}"
    );
}

#[tokio::test]
async fn bad_requests_are_refused() {
    let r = TestRouter::start(cfg()).await;
    let mut c = r.client().await;
    // No workers yet: UNAVAILABLE.
    assert_eq!(
        generate(&mut c, prompt("Hi")).await.err().unwrap().code(),
        Code::Unavailable
    );
    let _p = r
        .mock(
            WorkerRole::Prefill,
            MockConfig {
                max_context: 64,
                ..scripted(SCRIPT)
            },
        )
        .await;
    let _d = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;

    let long = "word ".repeat(200);
    let mut wrong_model = prompt("Hi");
    wrong_model.model = "gpt-17".into();
    let mut bad_temp = prompt("Hi");
    bad_temp.sampling = Some(v1::SamplingParams {
        temperature: -1.0,
        ..Default::default()
    });
    let cases: Vec<(&str, v1::GenerateRequest, Code, &str)> = vec![
        (
            "no input",
            v1::GenerateRequest::default(),
            Code::InvalidArgument,
            "no input",
        ),
        ("empty prompt", prompt(""), Code::InvalidArgument, "empty"),
        ("unknown model", wrong_model, Code::NotFound, "gpt-17"),
        (
            "id out of vocab",
            v1::GenerateRequest {
                input: Some(v1::generate_request::Input::Tokens(v1::TokenInput {
                    ids: vec![5, 49152],
                })),
                ..Default::default()
            },
            Code::InvalidArgument,
            "49152",
        ),
        (
            "empty ids",
            v1::GenerateRequest {
                input: Some(v1::generate_request::Input::Tokens(v1::TokenInput {
                    ids: vec![],
                })),
                ..Default::default()
            },
            Code::InvalidArgument,
            "no tokens",
        ),
        (
            "too long",
            prompt(&long),
            Code::InvalidArgument,
            "context is 64",
        ),
        ("bad sampling", bad_temp, Code::InvalidArgument, ""),
    ];
    for (name, req, code, needle) in cases {
        let err = generate(&mut c, req)
            .await
            .err()
            .unwrap_or_else(|| panic!("{name}: accepted"));
        assert_eq!(err.code(), code, "{name}: {err}");
        assert!(err.message().contains(needle), "{name}: {err}");
    }
    // Token ids are used as given.
    let ok = v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Tokens(v1::TokenInput {
            ids: vec![5, 6],
        })),
        ..Default::default()
    };
    assert_eq!(generate(&mut c, ok).await.unwrap().fin.prompt_tokens, 2);

    // A worker with another model fingerprint is refused.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let err = ferry_testkit::MockWorker::start(
        WorkerRole::Decode,
        l,
        &r.addr,
        MockConfig {
            fingerprint: "other".into(),
            ..Default::default()
        },
    )
    .await
    .err()
    .unwrap();
    assert!(
        err.to_string().contains("FailedPrecondition") || err.to_string().contains("other"),
        "{err}"
    );
}

#[tokio::test]
async fn lease_expiry_drops_a_silent_worker() {
    let r = TestRouter::start(RouterConfig {
        lease: Duration::from_millis(300),
        heartbeat: Duration::from_millis(50),
        ..cfg()
    })
    .await;
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let d = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let mut c = r.client().await;
    assert!(
        c.health(v1::HealthRequest {})
            .await
            .unwrap()
            .into_inner()
            .serving
    );
    d.stop_heartbeats();
    wait_until("the decode lease to expire", async || {
        let h = c.health(v1::HealthRequest {}).await.unwrap().into_inner();
        !h.serving && h.decode_workers == 0 && h.prefill_workers == 1
    })
    .await;
    assert_eq!(
        generate(&mut c, prompt("Hi")).await.err().unwrap().code(),
        Code::Unavailable
    );
}

#[tokio::test]
async fn workers_register_again_after_a_router_restart() {
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    std_listener.set_nonblocking(true).unwrap();
    // The same socket serves both routers (a duplicate handle), so the address stays reachable.
    let second = std_listener.try_clone().unwrap();
    let lease = RouterConfig {
        lease: Duration::from_millis(500),
        heartbeat: Duration::from_millis(50),
        ..cfg()
    };
    let r1 = TestRouter::on(
        lease.clone(),
        tokio::net::TcpListener::from_std(std_listener).unwrap(),
        None,
    )
    .await;
    let _p = r1.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let _d = r1.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    r1.shutdown().await;

    let r2 = TestRouter::on(
        lease,
        tokio::net::TcpListener::from_std(second).unwrap(),
        None,
    )
    .await;
    let mut c = r2.client().await;
    wait_until("both workers to register with the new router", async || {
        c.health(v1::HealthRequest {})
            .await
            .unwrap()
            .into_inner()
            .serving
    })
    .await;
    let out = generate(&mut c, prompt("Hi")).await.unwrap();
    assert_eq!(out.text, SCRIPT);
}

#[tokio::test]
async fn drained_workers_get_no_new_requests() {
    let r = TestRouter::start(cfg()).await;
    let _p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let _d1 = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let _d2 = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let mut admin = r.admin().await;
    let info = admin
        .drain(v1::WorkerRef {
            worker_id: "decode-1".into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.state, v1::WorkerState::Draining as i32);
    let mut c = r.client().await;
    for _ in 0..3 {
        assert_eq!(
            generate(&mut c, prompt("Hi"))
                .await
                .unwrap()
                .fin
                .decode_worker,
            "decode-2"
        );
    }
    admin
        .undrain(v1::WorkerRef {
            worker_id: "decode-1".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    admin
        .drain(v1::WorkerRef {
            worker_id: "decode-2".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(
        generate(&mut c, prompt("Hi"))
            .await
            .unwrap()
            .fin
            .decode_worker,
        "decode-1"
    );
    admin
        .remove(v1::WorkerRef {
            worker_id: "decode-2".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    let err = admin
        .drain(v1::WorkerRef {
            worker_id: "decode-2".into(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound);
}

#[tokio::test]
async fn router_overhead_reports_percentiles() {
    let s = ferry_testkit::router_overhead(&model_path(), 50)
        .await
        .unwrap();
    eprintln!("{s:?}");
    assert_eq!(s.requests, 50);
    assert!(s.p50_ms > 0.0 && s.p50_ms <= s.p99_ms && s.p99_ms <= s.max_ms);
}

/// `GET path` on `addr` over HTTP/1.1: (status, body).
async fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).await.unwrap();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

#[tokio::test]
async fn probes_say_ready_with_no_workers() {
    let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let metrics_addr = metrics.local_addr().unwrap();
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = TestRouter::on(cfg(), grpc, Some(metrics)).await;
    // Serving gRPC (the health call answers) with no worker registered.
    let h = r
        .client()
        .await
        .health(v1::HealthRequest {})
        .await
        .unwrap()
        .into_inner();
    assert!(!h.serving && h.prefill_workers == 0 && h.decode_workers == 0);
    assert_eq!(http_get(metrics_addr, "/livez").await.0, 200);
    let (status, body) = http_get(metrics_addr, "/readyz").await;
    assert_eq!((status, body.trim()), (200, "ready"));
    assert_eq!(http_get(metrics_addr, "/nope").await.0, 404);
    r.shutdown().await;
}

#[tokio::test]
async fn the_router_mints_a_transfer_token_per_request_and_gives_it_only_to_the_pair() {
    let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let r = TestRouter::on(cfg(), grpc, None).await;
    let p = r.mock(WorkerRole::Prefill, scripted(SCRIPT)).await;
    let d = r.mock(WorkerRole::Decode, scripted(SCRIPT)).await;
    let mut c = r.client().await;
    for _ in 0..3 {
        generate(&mut c, prompt("Hi")).await.unwrap();
    }
    let decode = d.stats.decode_tokens.lock().unwrap().clone();
    let prefill = p.stats.prefill_tokens.lock().unwrap().clone();
    // The decode worker is told the token at admission, the prefill worker gets the same one in
    // its KV target: the decode worker never has to hand a secret out.
    assert_eq!(decode, prefill);
    assert_eq!(decode.len(), 3);
    for t in &decode {
        assert_eq!(t.len(), 32, "128 bits in hex: {t:?}");
        assert!(t.chars().all(|c| c.is_ascii_hexdigit()), "{t:?}");
    }
    let mut distinct = decode.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), 3, "a fresh token per request: {decode:?}");
}

/// Each pair is asked for the fastest KV transport both workers registered, under the router's
/// ceiling; the choice and what was used show in the metrics.
#[tokio::test]
async fn each_pair_gets_the_fastest_kv_transport_both_registered() {
    use ferry_proto::v1::KvTransport as K;
    use ferry_router::workers::transport::KvPolicy;
    let with = |ks: &[K]| MockConfig { kv_transports: ks.to_vec(), ..scripted(SCRIPT) };
    for (policy, prefill, decode, want) in [
        (KvPolicy::Auto, vec![K::Grpc, K::Tcp, K::Nccl], vec![K::Grpc, K::Tcp, K::Nccl], K::Nccl),
        (KvPolicy::Auto, vec![K::Grpc, K::Tcp, K::Nccl], vec![K::Grpc, K::Tcp], K::Tcp),
        (KvPolicy::Tcp, vec![K::Grpc, K::Tcp, K::Nccl], vec![K::Grpc, K::Tcp, K::Nccl], K::Tcp),
        (KvPolicy::Grpc, vec![K::Grpc, K::Tcp], vec![K::Grpc, K::Tcp], K::Grpc),
        // Workers that list nothing: prefill gRPC+TCP, a decode worker without a data address gRPC.
        (KvPolicy::Auto, vec![], vec![], K::Grpc),
    ] {
        let metrics = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let metrics_addr = metrics.local_addr().unwrap();
        let grpc = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let r = TestRouter::on(RouterConfig { kv_transport: policy, ..cfg() }, grpc, Some(metrics)).await;
        let p = r.mock(WorkerRole::Prefill, with(&prefill)).await;
        let _d = r.mock(WorkerRole::Decode, with(&decode)).await;
        let mut c = r.client().await;
        generate(&mut c, prompt("Hi")).await.unwrap();
        assert_eq!(*p.stats.prefill_transports.lock().unwrap(), vec![want], "{policy:?} {prefill:?} {decode:?}");
        let (_, text) = http_get(metrics_addr, "/metrics").await;
        let line = format!("ferry_router_kv_transfers_total{{chosen=\"{want}\",used=\"{want}\"}} ");
        assert!(text.contains(&line), "{line} not in:\n{text}");
    }
}
