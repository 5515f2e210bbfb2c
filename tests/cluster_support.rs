//! Shared support for the end-to-end tests: a `ferry up` cluster of real processes on loopback,
//! a gRPC client, and the single-process reference.
//!
//! `ferry up` announces every router and worker it (re)starts in a `router …` / `worker …` line on
//! stdout; [`Cluster`] keeps reading them, so a test can find the processes by name, kill one
//! ([`signal`]) and wait until `ferry up` has restarted it and every router lists it again
//! ([`Cluster::wait_restarted`], [`Cluster::wait_router_restarted`]).
#![allow(dead_code)]

use ferry_proto::v1::admin_client::AdminClient;
use ferry_proto::v1::ferry_client::FerryClient;
use ferry_proto::v1::{generate_request, generate_response, GenerateFinal, GenerateRequest, ListWorkersRequest, StopConditions, TokenInput, WorkerInfo};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
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

/// One worker process, as `ferry up` announced it. A restarted worker keeps its name and gets a
/// new pid and new addresses (and a new id at each router).
#[derive(Clone, Debug)]
pub struct WorkerProc {
    pub role: String,
    pub name: String,
    pub pid: u32,
    pub grpc: String,
    /// Decode workers: the TCP KV data address (`-` when none).
    pub data: String,
    /// Its `/metrics`, `/livez` and `/readyz` address.
    pub metrics: String,
    /// How many times `ferry up` had restarted it when this process started.
    pub restarts: u32,
}

/// One router process. A restarted router keeps its name (`router-1`) and its addresses.
#[derive(Clone, Debug)]
pub struct RouterProc {
    pub name: String,
    pub pid: u32,
    pub grpc: String,
    /// The OpenAI-compatible HTTP address.
    pub http: String,
    /// Its Prometheus `/metrics` address.
    pub metrics: String,
    pub restarts: u32,
}

/// Every `router …` and `worker …` line `ferry up` printed, in order.
#[derive(Default)]
struct Announced {
    routers: Vec<RouterProc>,
    workers: Vec<WorkerProc>,
}

impl Announced {
    fn read(&mut self, line: &str) {
        if line.starts_with("router ") {
            self.routers.push(RouterProc {
                name: field(line, "name="),
                pid: field(line, "pid=").parse().unwrap_or(0),
                grpc: field(line, "grpc="),
                http: field(line, "http="),
                metrics: field(line, "metrics="),
                restarts: field(line, "restarts=").parse().unwrap_or(0),
            });
        }
        if line.starts_with("worker ") {
            self.workers.push(WorkerProc {
                role: field(line, "role="),
                name: field(line, "name="),
                pid: field(line, "pid=").parse().unwrap(),
                grpc: field(line, "grpc="),
                data: field(line, "data="),
                metrics: field(line, "metrics="),
                restarts: field(line, "restarts=").parse().unwrap_or(0),
            });
        }
    }
}

/// The newest announcement of each name, in the order names first appeared.
fn latest<T: Clone>(all: &[T], name: impl Fn(&T) -> &str) -> Vec<T> {
    let mut out: Vec<T> = Vec::new();
    for a in all {
        match out.iter_mut().find(|o| name(o) == name(a)) {
            Some(o) => *o = a.clone(),
            None => out.push(a.clone()),
        }
    }
    out
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
    /// The first router's gRPC address.
    pub router: String,
    /// The first router's Prometheus `/metrics` address.
    pub router_metrics: String,
    /// The first router's OpenAI-compatible HTTP address.
    pub http: String,
    /// Every router, as started (`ferry up --routers N`; addresses stay across restarts, pids
    /// do not: [`Cluster::live_routers`]).
    pub routers: Vec<RouterProc>,
    /// The workers as first started (before any restart: [`Cluster::live_workers`]).
    pub workers: Vec<WorkerProc>,
    /// `ferry up --tls`: the CA and the client certificate it printed (None: plaintext).
    pub tls: Option<TlsFiles>,
    /// The pool sizes it was started with (prefill, decode).
    pools: (usize, usize),
    announced: Arc<Mutex<Announced>>,
    /// The routers' admin token, from the file `ferry up` printed (`admin token_file=`).
    pub admin_token: String,
    /// The cluster secret this test gave `ferry up` (FERRY_CLUSTER_SECRET), for the processes a
    /// test starts beside it.
    pub cluster_secret: String,
}

/// A client of a router's Admin API.
pub type Admin = AdminClient<tonic::service::interceptor::InterceptedService<Channel, ferry_proto::Bearer>>;

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
    /// `ferry up --prefill P --decode D EXTRA…` on free loopback ports (`--routers N` in `extra`
    /// starts several routers), once it printed `ready`. The workers compute with exact
    /// activations (`--activations exact`, not the serving default q8): the tests hold their
    /// output against [`engine`] and the HF references.
    pub fn up(model: &std::path::Path, prefill: usize, decode: usize, extra: &[&str]) -> Cluster {
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let cluster_secret = format!("test-cluster-secret-{}-{nanos:x}", std::process::id());
        let mut child = Command::new(env!("CARGO_BIN_EXE_ferry"))
            .env("FERRY_CLUSTER_SECRET", &cluster_secret)
            .env_remove("FERRY_CLUSTER_SECRET_FILE")
            .args(["up", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--threads", "1", "--ready-timeout", "240"])
            .args(["--activations", "exact"])
            .args(["--prefill", &prefill.to_string(), "--decode", &decode.to_string(), "--model"])
            .arg(model)
            .args(extra)
            .stdout(Stdio::piped())
            .spawn()
            .expect("start ferry up");
        let out = BufReader::new(child.stdout.take().unwrap());
        let announced = Arc::new(Mutex::new(Announced::default()));
        let mut tls = None;
        let mut admin_token = String::new();
        let mut lines = out.lines();
        let (router, http) = loop {
            let line = match lines.next() {
                Some(Ok(l)) => l,
                _ => panic!("ferry up exited before it was ready: {:?}", child.wait()),
            };
            announced.lock().unwrap().read(&line);
            if line.starts_with("tls ") {
                tls = Some(TlsFiles { ca: field(&line, "ca=").into(), client_cert: field(&line, "client_cert=").into(), client_key: field(&line, "client_key=").into() });
            }
            if line.starts_with("admin ") {
                let file = field(&line, "token_file=");
                admin_token = std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("the admin token file {file}: {e}"));
            }
            if line.starts_with("ready ") {
                break (field(&line, "router="), field(&line, "http="));
            }
        };
        // Keep reading its stdout (so it never blocks on a full pipe), and learn of restarts.
        let a = announced.clone();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                a.lock().unwrap().read(&line);
            }
        });
        assert!(bound_loopback(&router) && bound_loopback(&http), "router={router} http={http}");
        let (routers, workers) = {
            let a = announced.lock().unwrap();
            (a.routers.clone(), a.workers.clone())
        };
        assert!(!routers.is_empty() && routers[0].grpc == router, "router lines {routers:?}, ready router={router}");
        let router_metrics = routers[0].metrics.clone();
        assert!(!admin_token.is_empty(), "ferry up printed no admin token file");
        Cluster { child, router, router_metrics, http, routers, workers, tls, pools: (prefill, decode), announced, admin_token, cluster_secret }
    }

    /// Each worker's current process (the newest start of each name; one that exited and was
    /// not restarted is still listed).
    pub fn live_workers(&self) -> Vec<WorkerProc> {
        latest(&self.announced.lock().unwrap().workers, |w| &w.name)
    }

    /// Each router's current process.
    pub fn live_routers(&self) -> Vec<RouterProc> {
        latest(&self.announced.lock().unwrap().routers, |r| &r.name)
    }

    /// A channel to the router at `addr` (over mutual TLS when the cluster has TLS).
    pub async fn channel_to(&self, addr: &str) -> Result<Channel, tonic::transport::Error> {
        let tls = self.tls.as_ref().map(TlsFiles::client);
        ferry_proto::tls::endpoint(addr, tls.as_ref()).unwrap().connect().await
    }

    /// An Admin client over `ch`, carrying the admin token.
    pub fn admin(&self, ch: Channel) -> Admin {
        AdminClient::with_interceptor(ch, ferry_proto::Bearer::new(Some(&self.admin_token)).expect("a header-safe token"))
    }

    /// `ferry pool` with this cluster's admin token in its environment.
    pub fn pool_command(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_ferry"));
        c.arg("pool").env("FERRY_ADMIN_TOKEN", &self.admin_token);
        c
    }

    /// A client of router `i` (0: the first).
    pub async fn client_at(&self, i: usize) -> FerryClient<Channel> {
        let addr = &self.routers[i].grpc;
        FerryClient::new(self.channel_to(addr).await.unwrap_or_else(|e| panic!("connect to router {i} at {addr}: {e}")))
    }

    /// The workers router `i` lists (`Admin.ListWorkers`), or why it could not.
    pub async fn workers_at(&self, i: usize) -> Result<Vec<WorkerInfo>, String> {
        let ch = self.channel_to(&self.routers[i].grpc).await.map_err(|e| e.to_string())?;
        let mut a = self.admin(ch);
        a.list_workers(ListWorkersRequest {}).await.map(|r| r.into_inner().workers).map_err(|e| e.to_string())
    }

    /// Wait until every router lists a ready worker at each of `grpc` addresses.
    async fn wait_listed(&self, grpc: &[String], deadline: Instant, what: &str) {
        for i in 0..self.routers.len() {
            loop {
                let listed = self.workers_at(i).await;
                let ready = |addr: &String| listed.as_ref().is_ok_and(|ws| ws.iter().any(|w| &w.grpc_addr == addr && w.state == ferry_proto::v1::WorkerState::Ready as i32));
                if grpc.iter().all(ready) {
                    break;
                }
                assert!(Instant::now() < deadline, "{what}: router {i} does not list {grpc:?} as ready: {listed:?}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// Wait until `ferry up` has restarted `old` (same name, a new process) and every router
    /// lists the new process ready; returns it.
    pub async fn wait_restarted(&self, old: &WorkerProc, timeout: Duration) -> WorkerProc {
        let deadline = Instant::now() + timeout;
        let new = loop {
            if let Some(w) = self.live_workers().into_iter().find(|w| w.name == old.name && w.pid != old.pid) {
                break w;
            }
            assert!(Instant::now() < deadline, "worker {} (pid {}) was not restarted within {timeout:?}", old.name, old.pid);
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        self.wait_listed(std::slice::from_ref(&new.grpc), deadline, &format!("restarted worker {}", new.name)).await;
        new
    }

    /// Wait until `ferry up` has restarted router `old` and it lists the cluster's initial pools
    /// (as many ready prefill and decode workers as it started with) again; returns it.
    pub async fn wait_router_restarted(&self, old: &RouterProc, timeout: Duration) -> RouterProc {
        let deadline = Instant::now() + timeout;
        let new = loop {
            if let Some(r) = self.live_routers().into_iter().find(|r| r.name == old.name && r.pid != old.pid) {
                break r;
            }
            assert!(Instant::now() < deadline, "router {} (pid {}) was not restarted within {timeout:?}", old.name, old.pid);
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let i = self.routers.iter().position(|r| r.name == new.name).expect("a known router");
        use ferry_proto::v1::WorkerRole::{Decode, Prefill};
        for (role, n) in [(Prefill, self.pools.0), (Decode, self.pools.1)] {
            self.wait_ready_at(i, role, n, deadline).await;
        }
        new
    }

    /// Wait until every router lists at least `n` ready workers of `role`.
    pub async fn wait_registered(&self, role: ferry_proto::v1::WorkerRole, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        for i in 0..self.routers.len() {
            self.wait_ready_at(i, role, n, deadline).await;
        }
    }

    async fn wait_ready_at(&self, i: usize, role: ferry_proto::v1::WorkerRole, n: usize, deadline: Instant) {
        loop {
            let listed = self.workers_at(i).await;
            let ready = listed.as_ref().map_or(0, |ws| ws.iter().filter(|w| w.role == role as i32 && w.state == ferry_proto::v1::WorkerState::Ready as i32).count());
            if ready >= n {
                return;
            }
            assert!(Instant::now() < deadline, "router {i} lists {ready} ready {role:?} workers, not {n}: {listed:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
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

    /// The sum of a counter's samples in the router's `/metrics`; panics when the router exports
    /// no sample of it (a renamed or unexported counter must not read as 0).
    pub async fn router_counter(&self, name: &str) -> f64 {
        let text = self.router_metrics().await;
        metric_sum(&text, name).unwrap_or_else(|| panic!("the router's /metrics has no {name}:\n{text}"))
    }

    pub async fn workers(&self) -> Vec<WorkerInfo> {
        let mut a = self.admin(self.channel().await);
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
        // `ferry up` stops its routers, then its workers, with 10 s of grace each; past that,
        // SIGKILL it.
        signal(self.child.id(), libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(40);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The sum of a metric's samples (`name 3` or `name{…} 3`) in Prometheus text; None when it has
/// none (absent is not 0).
pub fn metric_sum(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()).unwrap_or_else(|| panic!("not a Prometheus sample: {l}")))
        .reduce(|a, b| a + b)
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
            Some(generate_response::Event::ToolCall(_)) | None => {}
        }
    }
    Err(tonic::Status::internal("stream ended without a final message"))
}

/// The single-process engine's greedy ids (no EOS stop).
pub fn reference(engine: &mut ferry_engine::Engine, ids: &[u32], max_tokens: usize) -> Vec<u32> {
    let p = ferry_core::SamplingParams { ignore_eos: true, ..ferry_core::SamplingParams::greedy(max_tokens) };
    engine.generate(ids, &p, &mut |_| {}).expect("reference generate").tokens
}

/// The single-process engine, with exact activations as [`Cluster::up`]'s workers.
pub fn engine(path: &std::path::Path) -> ferry_engine::Engine {
    let cfg = ferry_engine::EngineConfig { threads: 2, activations: ferry_engine::Activations::Exact, ..Default::default() };
    ferry_engine::Engine::load(path, &cfg).expect("load the model")
}
