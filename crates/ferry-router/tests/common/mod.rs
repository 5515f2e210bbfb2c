//! Shared test helpers: the default model's path, a router on 127.0.0.1:0, mock workers, and a
//! client that collects one generation.
#![allow(dead_code)]

pub mod http;

use std::path::PathBuf;
use std::time::Duration;

use ferry_core::WorkerRole;
use ferry_proto::v1;
use ferry_router::RouterConfig;
use ferry_testkit::{MockConfig, MockWorker};
use tokio::net::TcpListener;
use tonic::transport::Channel;

/// The SmolLM2 GGUF: `$FERRY_SMOLLM2_GGUF`, else the default model in Ferry's cache (the router
/// must not link the engine, so it is not fetched here: run `ferry fetch` once).
pub fn model_path() -> PathBuf {
    if let Some(p) = std::env::var_os("FERRY_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    let cache = if let Some(d) = std::env::var_os("FERRY_CACHE") {
        PathBuf::from(d)
    } else if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        PathBuf::from(d).join("ferry")
    } else {
        PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/ferry")
    };
    let p = cache.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "the default model is needed at {} (run `ferry fetch`, or set FERRY_SMOLLM2_GGUF)",
        p.display()
    );
    p
}

pub fn text() -> ferry_tokenizer::ModelText {
    ferry_tokenizer::ModelText::open(&model_path()).expect("open model text")
}

pub struct TestRouter {
    pub addr: String,
    /// How the helpers below dial it (None: plaintext).
    pub client_tls: Option<ferry_proto::tls::ClientTls>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<Result<(), ferry_router::RouterError>>>,
}

impl TestRouter {
    pub async fn start(cfg: RouterConfig) -> TestRouter {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::on(cfg, l, None).await
    }

    pub async fn on(cfg: RouterConfig, l: TcpListener, metrics: Option<TcpListener>) -> TestRouter {
        let listeners = ferry_router::Listeners {
            grpc: l,
            http: None,
            metrics,
        };
        Self::with(cfg, listeners).await
    }

    /// A router on the given listeners.
    pub async fn with(cfg: RouterConfig, listeners: ferry_router::Listeners) -> TestRouter {
        let addr = listeners.grpc.local_addr().unwrap().to_string();
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(ferry_router::serve(cfg, listeners, async move {
            let _ = rx.await;
        }));
        TestRouter {
            addr,
            client_tls: None,
            stop: Some(stop),
            task: Some(task),
        }
    }

    pub async fn shutdown(mut self) {
        let _ = self.stop.take().unwrap().send(());
        self.task.take().unwrap().await.unwrap().unwrap();
    }

    pub async fn channel(&self) -> Channel {
        // Retries until the server has opened the model and accepts calls (readiness, not time).
        let ep = ferry_proto::tls::endpoint(&self.addr, self.client_tls.as_ref()).unwrap();
        let ch = ep.connect_lazy();
        let mut c = v1::ferry_client::FerryClient::new(ch.clone());
        for _ in 0..500 {
            match c.health(v1::HealthRequest {}).await {
                // A router that requires API keys answers too.
                Ok(_) => return ch,
                Err(s) if s.code() == tonic::Code::Unauthenticated => return ch,
                Err(_) => {}
            }
            tokio::task::yield_now().await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("router at {} never answered", self.addr);
    }

    pub async fn client(&self) -> v1::ferry_client::FerryClient<Channel> {
        v1::ferry_client::FerryClient::new(self.channel().await)
    }

    pub async fn admin(&self) -> v1::admin_client::AdminClient<Channel> {
        v1::admin_client::AdminClient::new(self.channel().await)
    }

    pub async fn mock(&self, role: WorkerRole, cfg: MockConfig) -> MockWorker {
        self.channel().await;
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        MockWorker::start(role, l, &self.addr, cfg)
            .await
            .expect("mock worker registers")
    }
}

/// Mock tokens that spell `text` after the first one.
pub fn scripted(text: &str) -> MockConfig {
    let ids = self::text().encode_prompt(text).unwrap();
    MockConfig {
        first_token: ids[0],
        tokens: ids[1..].to_vec(),
        ..Default::default()
    }
}

pub fn prompt(p: &str) -> v1::GenerateRequest {
    v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Prompt(p.into())),
        ..Default::default()
    }
}

pub struct Collected {
    pub text: String,
    pub deltas: usize,
    pub ids: Vec<u32>,
    pub fin: v1::GenerateFinal,
}

pub async fn generate(
    c: &mut v1::ferry_client::FerryClient<Channel>,
    req: v1::GenerateRequest,
) -> Result<Collected, tonic::Status> {
    let mut s = c.generate(req).await?.into_inner();
    let (mut text, mut deltas, mut ids) = (String::new(), 0, Vec::new());
    while let Some(m) = s.message().await? {
        match m.event.expect("event") {
            v1::generate_response::Event::Delta(d) => {
                text.push_str(&d.text);
                ids.extend(d.token_ids);
                deltas += 1;
            }
            v1::generate_response::Event::ToolCall(t) => panic!("a tool call in a request without tools: {t:?}"),
            v1::generate_response::Event::Final(fin) => {
                assert!(s.message().await?.is_none(), "nothing after final");
                return Ok(Collected {
                    text,
                    deltas,
                    ids,
                    fin,
                });
            }
        }
    }
    panic!("stream ended without final");
}

/// Polls `cond` (every 10 ms, up to 10 s) until it holds.
pub async fn wait_until<F: AsyncFnMut() -> bool>(what: &str, mut cond: F) {
    for _ in 0..1000 {
        if cond().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("timed out waiting for {what}");
}

/// A router with the default config serving gRPC and the HTTP API on loopback, ready; the HTTP
/// address beside it.
pub async fn router_with_http() -> (TestRouter, String) {
    let grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let http = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = http.local_addr().unwrap().to_string();
    let listeners = ferry_router::Listeners { grpc, http: Some(http), metrics: None };
    let r = TestRouter::with(RouterConfig::new(model_path()), listeners).await;
    r.channel().await;
    (r, addr)
}

/// What no answer to a client may show: a panic, a backtrace, a source path, a parser's state;
/// and an error stays short. `what` names the case in the failure.
pub fn assert_clean(what: &str, text: &str) {
    for bad in ["panicked", "src/", "RUST_BACKTRACE", "stack backtrace", ".rs:", "<state>"] {
        assert!(!text.contains(bad), "{what}: {bad:?} in the answer: {}", &text[..text.len().min(2000)]);
    }
    assert!(text.len() < 2048, "{what}: a {}-byte answer", text.len());
}

/// The text side of a tiny model whose chat template takes tools: the golden `qwen2-bias-tied`
/// tokenizer and configs with vLLM's Hermes template (tests/fixtures/tools) as `chat_template`
/// (the router reads no weights), in a folder of its own named after `name`.
#[allow(dead_code)]
pub fn hermes_tool_model(name: &str) -> std::path::PathBuf {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let from = root.join("golden/qwen2-bias-tied");
    let dir = std::env::temp_dir().join(format!("ferry-router-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in ["tokenizer.json", "config.json", "generation_config.json"] {
        std::fs::copy(from.join(f), dir.join(f)).unwrap();
    }
    let mut tc: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(from.join("tokenizer_config.json")).unwrap()).unwrap();
    tc["chat_template"] = serde_json::Value::String(std::fs::read_to_string(root.join("tools/hermes_tool_chat_template.jinja")).unwrap());
    std::fs::write(dir.join("tokenizer_config.json"), tc.to_string()).unwrap();
    dir
}
