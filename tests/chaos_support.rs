//! Support for the chaos suite (tests/chaos.rs): a `ferry up` cluster whose processes are tracked
//! as `ferry up` prints them (restarted workers and several routers included), faults on them
//! (SIGKILL, SIGSTOP/SIGCONT, undone on drop), clients that count the tokens they have seen, the
//! workers' own KV counters, and a loopback TCP proxy that cuts connections mid-payload.
#![allow(dead_code)]

use crate::cluster_support::{http_get, signal, Cluster, RouterProc, WorkerProc};
use ferry_proto::v1::ferry_client::FerryClient;
use ferry_proto::v1::{generate_response, GenerateFinal, GenerateRequest, ListWorkersRequest, WorkerInfo};
use std::net::SocketAddr;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tonic::transport::Channel;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Router,
    Prefill,
    Decode,
}

/// One process `ferry up` started (or one the test started itself), as it was announced.
#[derive(Clone, Debug)]
pub struct Proc {
    pub role: Role,
    pub name: String,
    pub pid: u32,
    pub grpc: String,
    /// Its Prometheus `/metrics` address.
    pub metrics: String,
}

/// Whether a process exists (and is not a zombie: `ferry up` reaps its children).
pub fn alive(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The state follows the parenthesised command name.
    !stat.is_empty() && !stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with(['Z', 'X']))
}

impl From<WorkerProc> for Proc {
    fn from(w: WorkerProc) -> Proc {
        let role = if w.role == "prefill" { Role::Prefill } else { Role::Decode };
        Proc { role, name: w.name, pid: w.pid, grpc: w.grpc, metrics: w.metrics }
    }
}

impl From<RouterProc> for Proc {
    fn from(r: RouterProc) -> Proc {
        Proc { role: Role::Router, name: r.name, pid: r.pid, grpc: r.grpc, metrics: r.metrics }
    }
}

/// A [`Cluster`] with faults: stopped processes are continued on drop, and processes the test
/// started itself ([`Chaos::adopt`]) are tracked with `ferry up`'s and stopped on drop.
pub struct Chaos {
    pub cluster: Cluster,
    stopped: Mutex<Vec<u32>>,
    extra: Mutex<Vec<(Child, Proc)>>,
    pub model: std::path::PathBuf,
}

impl Chaos {
    /// `ferry up --prefill P --decode D EXTRA…` with one thread per worker, on free loopback ports.
    pub fn up(model: &std::path::Path, prefill: usize, decode: usize, extra: &[&str]) -> Chaos {
        Chaos { cluster: Cluster::up(model, prefill, decode, extra), stopped: Mutex::new(Vec::new()), extra: Mutex::new(Vec::new()), model: model.to_path_buf() }
    }

    /// Whether `ferry up` knows this flag (features landing at different times).
    pub fn up_has_flag(flag: &str) -> bool {
        let out = Command::new(env!("CARGO_BIN_EXE_ferry")).args(["up", "--help"]).output().expect("ferry up --help");
        String::from_utf8_lossy(&out.stdout).split(|c: char| c.is_whitespace() || c == ',').any(|w| w == flag)
    }

    /// Every router's current process.
    pub fn routers(&self) -> Vec<Proc> {
        self.cluster.live_routers().into_iter().map(Proc::from).collect()
    }

    /// The first router (the one every test talks to unless it says otherwise).
    pub fn router(&self) -> String {
        self.cluster.router.clone()
    }

    /// Workers that are alive now (a restarted worker appears with its new pid and addresses),
    /// the adopted ones included.
    pub fn live_workers(&self) -> Vec<Proc> {
        let adopted = self.extra.lock().unwrap_or_else(|e| e.into_inner()).iter().map(|(_, p)| p.clone()).collect::<Vec<_>>();
        self.cluster.live_workers().into_iter().map(Proc::from).chain(adopted).filter(|p| alive(p.pid)).collect()
    }

    /// The process behind a worker the router lists.
    pub fn proc_of(&self, w: &WorkerInfo) -> Proc {
        self.live_workers().into_iter().find(|p| p.grpc == w.grpc_addr).unwrap_or_else(|| panic!("no live process announced for {} at {}", w.name, w.grpc_addr))
    }

    /// Add a process the test started (stopped on drop), tracked like `ferry up`'s.
    pub fn adopt(&self, child: Child, p: Proc) {
        self.extra.lock().unwrap_or_else(|e| e.into_inner()).push((child, p));
    }

    pub fn kill(&self, pid: u32) {
        signal(pid, libc::SIGKILL);
    }

    pub fn stop(&self, pid: u32) {
        signal(pid, libc::SIGSTOP);
        self.stopped.lock().unwrap_or_else(|e| e.into_inner()).push(pid);
    }

    pub fn resume(&self, pid: u32) {
        signal(pid, libc::SIGCONT);
        self.stopped.lock().unwrap_or_else(|e| e.into_inner()).retain(|&p| p != pid);
    }

    pub async fn channel_to(&self, router: &str) -> Channel {
        self.cluster.channel_to(router).await.unwrap_or_else(|e| panic!("connect to the router at {router}: {e}"))
    }

    pub async fn client_to(&self, router: &str) -> FerryClient<Channel> {
        FerryClient::new(self.channel_to(router).await)
    }

    /// The workers a router lists.
    pub async fn listed(&self, router: &str) -> Vec<WorkerInfo> {
        let mut a = self.cluster.admin(self.channel_to(router).await);
        a.list_workers(ListWorkersRequest {}).await.expect("ListWorkers").into_inner().workers
    }

    /// Waits until `router` lists `n` ready workers of `role`.
    pub async fn wait_ready(&self, router: &str, role: Role, n: usize, within: Duration) {
        let wire = match role {
            Role::Prefill => ferry_proto::v1::WorkerRole::Prefill,
            Role::Decode => ferry_proto::v1::WorkerRole::Decode,
            Role::Router => panic!("routers are not listed"),
        } as i32;
        let deadline = Instant::now() + within;
        loop {
            let ws = self.listed(router).await;
            if ws.iter().filter(|w| w.role == wire && w.state == ferry_proto::v1::WorkerState::Ready as i32).count() >= n {
                return;
            }
            assert!(Instant::now() < deadline, "{router} never listed {n} ready {role:?} workers: {ws:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every live, running worker's own counters say its KV pool is whole (no block
    /// used or reserved, no sequence active); panics naming the ones that are not.
    pub async fn assert_pools_whole(&self, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            let stopped = self.stopped.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let mut bad = Vec::new();
            let running: Vec<Proc> = self.live_workers().into_iter().filter(|w| !stopped.contains(&w.pid)).collect();
            for w in &running {
                match pool(&w.metrics).await {
                    Ok(p) if p.is_whole() => {}
                    Ok(p) => bad.push(format!("{} (pid {}): {p:?}", w.name, w.pid)),
                    Err(e) => bad.push(format!("{} (pid {}): /metrics at {}: {e}", w.name, w.pid, w.metrics)),
                }
            }
            // No worker to check proves nothing.
            assert!(!running.is_empty(), "no live, running worker to check the KV pool of");
            if bad.is_empty() {
                eprintln!("KV pools whole: {}", running.iter().map(|w| w.name.as_str()).collect::<Vec<_>>().join(", "));
                return;
            }
            assert!(Instant::now() < deadline, "KV pools not whole after {within:?}: {bad:?}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The sum of a metric's samples over every live router's `/metrics`; panics when no router
    /// answers or none exports it (an absent counter is not 0).
    pub async fn router_metric(&self, name: &str) -> f64 {
        let mut total = None;
        let mut scraped = 0;
        for r in self.routers().into_iter().filter(|r| alive(r.pid)) {
            let text = match http_get(&r.metrics, "/metrics").await {
                Ok(t) => t,
                Err(e) => panic!("router {} (pid {}): /metrics at {}: {e}", r.name, r.pid, r.metrics),
            };
            scraped += 1;
            if let Some(v) = crate::cluster_support::metric_sum(&text, name) {
                *total.get_or_insert(0.0) += v;
            }
        }
        total.unwrap_or_else(|| panic!("{name}: no sample of it in the /metrics of the {scraped} live routers"))
    }
}

impl Drop for Chaos {
    /// Continue every stopped process and stop the adopted ones; then the cluster drops (SIGTERM
    /// to `ferry up`, which stops its routers and workers).
    fn drop(&mut self) {
        for pid in self.stopped.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            signal(pid, libc::SIGCONT);
        }
        for (mut c, _) in self.extra.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            signal(c.id(), libc::SIGCONT);
            signal(c.id(), libc::SIGTERM);
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The values of a metric's samples (`name 3` or `name{…} 3`) in Prometheus text.
pub fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = f64> + 'a {
    text.lines()
        .filter(move |l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
}

/// A worker's KV pool as its own `/metrics` reports it.
#[derive(Debug, Default, Clone, Copy)]
pub struct Pool {
    /// Every block of the pool (free + used): above 0 for a worker that serves.
    pub total: f64,
    pub used: f64,
    pub reserved: f64,
    pub active: f64,
}

impl Pool {
    pub fn is_whole(&self) -> bool {
        self.total > 0.0 && self.used == 0.0 && self.reserved == 0.0 && self.active == 0.0
    }
}

/// Scrape one worker's pool gauges. Every gauge must be there and the pool must have blocks: a
/// worker that exports none (still loading, or the gauge renamed) is an error, not a whole pool.
pub async fn pool(metrics: &str) -> std::io::Result<Pool> {
    let text = http_get(metrics, "/metrics").await?;
    let missing = |what: &str| std::io::Error::other(format!("no {what} in its /metrics"));
    let blocks = |state: &str| {
        let key = format!("state=\"{state}\"");
        text.lines()
            .filter(|l| l.starts_with("ferry_worker_kv_blocks{") && l.contains(&key))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .reduce(|a, b| a + b)
            .ok_or_else(|| missing(&format!("ferry_worker_kv_blocks{{{key}}}")))
    };
    let active = samples(&text, "ferry_worker_active_sequences").reduce(|a, b| a + b).ok_or_else(|| missing("ferry_worker_active_sequences"))?;
    let (free, used, reserved) = (blocks("free")?, blocks("used")?, blocks("reserved")?);
    if free + used <= 0.0 {
        return Err(std::io::Error::other(format!("a KV pool of {} blocks (free {free}, used {used})", free + used)));
    }
    Ok(Pool { total: free + used, used, reserved, active })
}

/// What one client saw.
#[derive(Debug)]
pub enum Seen {
    Done { ids: Vec<u32>, fin: GenerateFinal },
    Error { status: tonic::Status, ids: Vec<u32>, after: Duration },
    /// The stream ended with neither a final message nor an error.
    Lost { ids: Vec<u32> },
    Hung { ids: Vec<u32> },
}

/// A streaming request in flight, with the count of tokens it has received so far.
pub struct Stream {
    pub tokens: Arc<AtomicUsize>,
    pub router: String,
    pub task: tokio::task::JoinHandle<Seen>,
}

impl Stream {
    pub fn seen(&self) -> usize {
        self.tokens.load(SeqCst)
    }
}

/// Start one request through `router`; it gives up (Hung) after `timeout`.
pub async fn start(chaos: &Chaos, router: &str, req: GenerateRequest, timeout: Duration) -> Stream {
    let mut client = chaos.client_to(router).await;
    let tokens = Arc::new(AtomicUsize::new(0));
    let count = tokens.clone();
    let ids = Arc::new(Mutex::new(Vec::new()));
    let task = tokio::spawn(async move {
        let t0 = Instant::now();
        let got = ids.clone();
        let body = async move {
            let mut s = match client.generate(req).await {
                Ok(r) => r.into_inner(),
                Err(status) => return Seen::Error { status, ids: Vec::new(), after: t0.elapsed() },
            };
            loop {
                match s.message().await {
                    Ok(Some(m)) => match m.event {
                        Some(generate_response::Event::Delta(d)) => {
                            count.fetch_add(d.token_ids.len(), SeqCst);
                            got.lock().unwrap_or_else(|e| e.into_inner()).extend(d.token_ids);
                        }
                        Some(generate_response::Event::Final(fin)) => {
                            return Seen::Done { ids: got.lock().unwrap_or_else(|e| e.into_inner()).clone(), fin };
                        }
                        Some(generate_response::Event::ToolCall(_)) | None => {}
                    },
                    Ok(None) => return Seen::Lost { ids: got.lock().unwrap_or_else(|e| e.into_inner()).clone() },
                    Err(status) => return Seen::Error { status, ids: got.lock().unwrap_or_else(|e| e.into_inner()).clone(), after: t0.elapsed() },
                }
            }
        };
        match tokio::time::timeout(timeout, body).await {
            Ok(seen) => seen,
            Err(_) => Seen::Hung { ids: ids.lock().unwrap_or_else(|e| e.into_inner()).clone() },
        }
    });
    Stream { tokens, router: router.to_string(), task }
}

/// Polls `cond` every 20 ms until it holds; panics with `what` after `within`.
pub async fn wait_for<F, Fut>(what: &str, within: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out after {within:?} waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A loopback TCP proxy in front of `target`: it forwards every connection both ways, except that
/// the first `cut` connections are closed (both sides at once) after `after` bytes have gone
/// from the client to the target: a KV transfer cut mid-payload.
pub struct FaultProxy {
    pub addr: SocketAddr,
    state: Arc<ProxyState>,
    task: tokio::task::JoinHandle<()>,
}

struct ProxyState {
    target: String,
    after: u64,
    cut_left: AtomicUsize,
    cuts: AtomicUsize,
    connections: AtomicUsize,
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

impl FaultProxy {
    /// Listen on `listener`; `cut` = 0 forwards everything untouched.
    pub fn start(listener: tokio::net::TcpListener, target: String, cut: usize, after: u64) -> FaultProxy {
        let addr = listener.local_addr().expect("the proxy's address");
        let state = Arc::new(ProxyState { target, after, cut_left: AtomicUsize::new(cut), cuts: AtomicUsize::new(0), connections: AtomicUsize::new(0), tasks: Mutex::new(Vec::new()) });
        let s = state.clone();
        let task = tokio::spawn(async move {
            while let Ok((inbound, _)) = listener.accept().await {
                s.connections.fetch_add(1, SeqCst);
                let cut = s.cut_left.fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1)).is_ok();
                let s2 = s.clone();
                let h = tokio::spawn(async move {
                    let _ = forward(inbound, &s2, cut).await;
                });
                s.tasks.lock().unwrap_or_else(|e| e.into_inner()).push(h.abort_handle());
            }
        });
        FaultProxy { addr, state, task }
    }

    /// Connections cut so far (each after its byte budget).
    pub fn cuts(&self) -> usize {
        self.state.cuts.load(SeqCst)
    }

    pub fn connections(&self) -> usize {
        self.state.connections.load(SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        for h in self.state.tasks.lock().unwrap_or_else(|e| e.into_inner()).drain(..) {
            h.abort();
        }
    }
}

async fn forward(inbound: tokio::net::TcpStream, s: &ProxyState, cut: bool) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let outbound = tokio::net::TcpStream::connect(&s.target).await?;
    inbound.set_nodelay(true)?;
    outbound.set_nodelay(true)?;
    let (mut ri, mut wi) = inbound.into_split();
    let (mut ro, mut wo) = outbound.into_split();
    let up = async {
        let mut buf = vec![0u8; 64 << 10];
        let mut sent = 0u64;
        loop {
            let n = ri.read(&mut buf).await?;
            if n == 0 {
                return wo.shutdown().await;
            }
            let n = if cut { n.min((s.after - sent) as usize) } else { n };
            wo.write_all(&buf[..n]).await?;
            sent += n as u64;
            if cut && sent >= s.after {
                // Cut: both connections dropped at once, mid-payload.
                s.cuts.fetch_add(1, SeqCst);
                return Err(std::io::Error::other("cut"));
            }
        }
    };
    let down = async {
        tokio::io::copy(&mut ro, &mut wi).await?;
        wi.shutdown().await
    };
    // The first error (the cut) ends both directions; a clean close of one waits for the other.
    tokio::try_join!(up, down).map(|_| ())
}
