//! Shared support for the end-to-end tests: a `ferry up` cluster of real processes on loopback,
//! a gRPC client, and the single-process reference.
#![allow(dead_code)]

use ferry_proto::v1::admin_client::AdminClient;
use ferry_proto::v1::ferry_client::FerryClient;
use ferry_proto::v1::{generate_request, generate_response, GenerateFinal, GenerateRequest, ListWorkersRequest, StopConditions, TokenInput, WorkerInfo};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

pub fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

pub fn smollm2() -> PathBuf {
    std::env::var_os("FERRY_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or_else(|| ferry_engine::fetch::ensure_default_model().expect("the default model: run `ferry fetch`"))
}

pub struct WorkerProc {
    pub role: String,
    pub name: String,
    pub pid: u32,
    pub grpc: String,
    /// Its `/metrics`, `/livez` and `/readyz` address.
    pub metrics: String,
}

/// `GET path` over HTTP/1.0: the whole response (status line, headers, body), or the connection
/// error.
pub async fn http_get(addr: &str, path: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).await?;
    let mut response = String::new();
    s.read_to_string(&mut response).await?;
    Ok(response)
}

/// `ferry up` as a child process; stopped (SIGTERM, which stops its workers) when dropped.
pub struct Cluster {
    child: Child,
    pub router: String,
    /// The router's Prometheus `/metrics` address.
    pub router_metrics: String,
    /// The router's OpenAI-compatible HTTP address.
    pub http: String,
    pub workers: Vec<WorkerProc>,
    /// `ferry up --tls`: the CA and the client certificate it printed (None: plaintext).
    pub tls: Option<TlsFiles>,
}

/// The PEM files `ferry up --tls` made for clients.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
}

impl TlsFiles {
    /// A client that verifies the router and presents the client certificate.
    pub fn client(&self) -> ferry_proto::tls::ClientTls {
        let cfg = ferry_proto::tls::TlsConfig {
            ca: Some(self.ca.clone()),
            client_cert: Some(self.client_cert.clone()),
            client_key: Some(self.client_key.clone()),
            ..Default::default()
        };
        cfg.client().expect("load the client certificate").expect("TLS")
    }

    /// The same options for the `ferry` CLI.
    pub fn flags(&self) -> Vec<std::ffi::OsString> {
        let mut v = Vec::new();
        for (flag, path) in [("--tls-ca", &self.ca), ("--tls-client-cert", &self.client_cert), ("--tls-client-key", &self.client_key)] {
            v.push(flag.into());
            v.push(path.into());
        }
        v
    }
}

fn bound_loopback(addr: &str) -> bool {
    addr.parse::<std::net::SocketAddr>().is_ok_and(|a| a.ip().is_loopback() && a.port() != 0)
}

fn field(line: &str, key: &str) -> String {
    line.split_whitespace().find_map(|f| f.strip_prefix(key)).unwrap_or_default().to_string()
}

pub fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a process this test started; no memory is involved.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

impl Cluster {
    pub fn up(model: &std::path::Path, prefill: usize, decode: usize, extra: &[&str]) -> Cluster {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .args(["up", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--threads", "1", "--ready-timeout", "240"])
            .args(["--prefill", &prefill.to_string(), "--decode", &decode.to_string(), "--model"])
            .arg(model)
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start ferry up");
        let out = BufReader::new(child.stdout.take().unwrap());
        let mut workers = Vec::new();
        let mut router_metrics = String::new();
        let mut tls = None;
        let mut lines = out.lines();
        let (router, http) = loop {
            let line = match lines.next() {
                Some(Ok(l)) => l,
                _ => panic!("ferry up exited before it was ready: {:?}", child.wait()),
            };
            if line.starts_with("router ") {
                router_metrics = field(&line, "metrics=");
            }
            if line.starts_with("tls ") {
                tls = Some(TlsFiles { ca: field(&line, "ca=").into(), client_cert: field(&line, "client_cert=").into(), client_key: field(&line, "client_key=").into() });
            }
            if line.starts_with("worker ") {
                workers.push(WorkerProc { role: field(&line, "role="), name: field(&line, "name="), pid: field(&line, "pid=").parse().unwrap(), grpc: field(&line, "grpc="), metrics: field(&line, "metrics=") });
            }
            if line.starts_with("ready ") {
                break (field(&line, "router="), field(&line, "http="));
            }
        };
        // Keep draining its stdout so it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        assert!(bound_loopback(&router) && bound_loopback(&http), "router={router} http={http}");
        Cluster { child, router, router_metrics, http, workers, tls }
    }

    /// A channel to the router: over mutual TLS when the cluster has TLS.
    pub async fn channel(&self) -> Channel {
        let tls = self.tls.as_ref().map(TlsFiles::client);
        ferry_proto::tls::endpoint(&self.router, tls.as_ref()).unwrap().connect().await.expect("connect to the router")
    }

    pub async fn client(&self) -> FerryClient<Channel> {
        FerryClient::new(self.channel().await)
    }

    /// The router's `/metrics` text.
    pub async fn router_metrics(&self) -> String {
        http_get(&self.router_metrics, "/metrics").await.expect("connect to the router's /metrics")
    }

    /// The sum of a counter's samples in the router's `/metrics` (0 when absent).
    pub async fn router_counter(&self, name: &str) -> f64 {
        self.router_metrics()
            .await
            .lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    }

    pub async fn workers(&self) -> Vec<WorkerInfo> {
        let mut a = AdminClient::new(self.channel().await);
        a.list_workers(ListWorkersRequest {}).await.unwrap().into_inner().workers
    }

    /// Wait until every live worker reports a whole KV pool (nothing used, nothing promised) in a
    /// heartbeat; panics naming the worker that leaked.
    pub async fn assert_no_leaks(&self) {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let ws = self.workers().await;
            let leaking: Vec<String> = ws
                .iter()
                .filter(|w| w.state == ferry_proto::v1::WorkerState::Ready as i32)
                .filter_map(|w| {
                    let l = w.load.unwrap_or_default();
                    (l.kv_blocks_free != l.kv_blocks_total || l.kv_blocks_reserved != 0 || l.active_sequences != 0 || w.inflight != 0)
                        .then(|| format!("{} ({}): {:?}, inflight {}", w.worker_id, w.name, l, w.inflight))
                })
                .collect();
            if leaking.is_empty() {
                return;
            }
            if Instant::now() > deadline {
                panic!("KV not returned: {leaking:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        signal(self.child.id(), libc::SIGTERM);
        let _ = self.child.wait();
    }
}

/// A token-ids request (greedy, no EOS stop unless `eos`).
pub fn token_request(ids: &[u32], max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        input: Some(generate_request::Input::Tokens(TokenInput { ids: ids.to_vec() })),
        stop: Some(StopConditions { max_tokens, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

pub struct Outcome {
    pub ids: Vec<u32>,
    pub text: String,
    pub fin: GenerateFinal,
}

pub async fn run(client: &mut FerryClient<Channel>, req: GenerateRequest) -> Result<Outcome, tonic::Status> {
    let mut s = client.generate(req).await?.into_inner();
    let (mut ids, mut text) = (Vec::new(), String::new());
    while let Some(m) = s.message().await? {
        match m.event {
            Some(generate_response::Event::Delta(d)) => {
                ids.extend(d.token_ids);
                text.push_str(&d.text);
            }
            Some(generate_response::Event::Final(fin)) => return Ok(Outcome { ids, text, fin }),
            None => {}
        }
    }
    Err(tonic::Status::internal("stream ended without a final message"))
}

/// The single-process engine's greedy ids (no EOS stop).
pub fn reference(engine: &mut ferry_engine::Engine, ids: &[u32], max_tokens: usize) -> Vec<u32> {
    let p = ferry_core::SamplingParams { ignore_eos: true, ..ferry_core::SamplingParams::greedy(max_tokens) };
    engine.generate(ids, &p, &mut |_| {}).expect("reference generate").tokens
}

pub fn engine(path: &std::path::Path) -> ferry_engine::Engine {
    ferry_engine::Engine::load(path, &ferry_engine::EngineConfig { threads: 2, ..Default::default() }).expect("load the model")
}
