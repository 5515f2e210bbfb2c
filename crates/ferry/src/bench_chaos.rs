//! `ferry bench chaos`: a soak under faults. It starts `ferry up` (several routers when asked),
//! sends a set number of greedy requests from concurrent clients and, spaced over the run by
//! progress, strikes seeded random faults: `kill -9` of a worker or a router, or SIGSTOP of a
//! worker and SIGCONT a few seconds later (`ferry up` restarts what died). Every request's ids are
//! checked against the single-process engine's. Then it lets the cluster settle and reads every
//! worker's own KV counters and every router's migration figures. It fails (exit 1) when a request
//! was lost (no final, no error), hung, corrupted (ids differ), failed while its role and its
//! router were up, or when blocks leaked.
//!
//! Failures allowed: a stream held by a router that was killed, and requests that failed while a
//! whole role was down (no ready worker of it, as the routers list them).

use anyhow::Context;
use crate::loadgen::{self, LenDist};
use ferry_proto::v1::{self, generate_response};
use serde_json::json;
use std::collections::HashMap;
use std::io::{BufRead, BufReader, IsTerminal};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct ChaosBenchArgs {
    /// A GGUF file, an HF model folder, or `default`.
    #[arg(long, short = 'm', default_value = "default")]
    pub model: String,
    /// Requests to send in all.
    #[arg(long, default_value_t = 500)]
    pub requests: usize,
    /// Concurrent clients.
    #[arg(long, default_value_t = 6)]
    pub concurrency: usize,
    /// Faults to strike, spaced evenly over the requests.
    #[arg(long, default_value_t = 10)]
    pub kills: usize,
    /// Seed for the prompts and the faults: the same seed strikes the same faults.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Routers (`ferry up --routers`; routers are struck only when there are several).
    #[arg(long, default_value_t = 2)]
    pub routers: usize,
    #[arg(long, default_value_t = 2)]
    pub prefill: usize,
    #[arg(long, default_value_t = 2)]
    pub decode: usize,
    /// CPU threads per worker.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Distinct prompts (each request uses one; the reference is computed once per prompt).
    #[arg(long, default_value_t = 8)]
    pub prompts: usize,
    /// Prompt length in tokens: `N` or `LO..HI`.
    #[arg(long, default_value = "16..128")]
    pub prompt_len: String,
    /// Tokens per request (EOS ignored).
    #[arg(long, default_value_t = 24)]
    pub max_tokens: u32,
    /// Seconds one request may take before it counts as hung.
    #[arg(long, default_value_t = 120)]
    pub request_timeout: u64,
    /// Seconds the whole run may take (requests still running then count as hung).
    #[arg(long, default_value_t = 900)]
    pub timeout: u64,
    /// Print the results as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// A connection to a router killed this long before a request started may still be the broken one.
const STALE: Duration = Duration::from_secs(5);

const TEXT: &str = "The history of the printing press begins with the first movable type, invented in China, and continues through Gutenberg's workshop in Mainz, where metal type, oil-based ink and a wooden screw press came together. ";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Router,
    Prefill,
    Decode,
}

#[derive(Clone, Debug)]
struct Proc {
    role: Role,
    name: String,
    pid: u32,
    grpc: String,
    metrics: String,
}

fn field(line: &str, key: &str) -> Option<String> {
    line.split_whitespace().find_map(|f| f.strip_prefix(key)).map(str::to_string)
}

/// Alive and not a zombie.
fn alive(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    !stat.is_empty() && !stat.rsplit(')').next().is_some_and(|rest| rest.trim_start().starts_with(['Z', 'X']))
}

fn signal(pid: u32, sig: i32) {
    // SAFETY: kill(2) on a process of the cluster this command started; no memory is involved.
    unsafe {
        libc::kill(pid as libc::pid_t, sig);
    }
}

/// A `ferry up … stdout` line that announces a process.
fn announced(line: &str) -> Option<Proc> {
    let (role, pid) = if line.starts_with("router ") {
        (Role::Router, field(line, "pid=")?.parse().ok()?)
    } else if line.starts_with("worker ") {
        let role = match field(line, "role=")?.as_str() {
            "prefill" => Role::Prefill,
            "decode" => Role::Decode,
            _ => return None,
        };
        (role, field(line, "pid=")?.parse().ok()?)
    } else {
        return None;
    };
    let grpc = field(line, "grpc=")?;
    let name = field(line, "name=").unwrap_or_else(|| format!("router@{grpc}"));
    Some(Proc { role, name, pid, grpc, metrics: field(line, "metrics=").unwrap_or_default() })
}

/// `ferry up` and every process it announced (restarts append); stopped on drop, after every
/// frozen process is continued.
struct Up {
    child: std::process::Child,
    procs: Arc<Mutex<Vec<Proc>>>,
    log: std::path::PathBuf,
    /// The admin token this benchmark gave `ferry up` (its routers' Admin API needs it).
    admin: ferry_proto::Bearer,
}

impl Up {
    fn start(a: &ChaosBenchArgs, model: &std::path::Path) -> anyhow::Result<Up> {
        let log = std::env::temp_dir().join(format!("ferry-bench-chaos-{}.log", std::process::id()));
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.args(["up", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--threads", &a.threads.to_string()])
            .args(["--prefill", &a.prefill.to_string(), "--decode", &a.decode.to_string(), "--model"])
            .arg(model);
        // In the environment, not on the command line.
        let token = format!("bench-chaos-{:032x}", rand::random::<u128>());
        cmd.env("FERRY_ADMIN_TOKEN", &token);
        let admin = ferry_proto::Bearer::new(Some(&token)).map_err(|e| anyhow::anyhow!("the admin token: {e}"))?;
        if a.routers > 1 {
            let help = std::process::Command::new(std::env::current_exe()?).args(["up", "--help"]).output().context("ferry up --help")?;
            anyhow::ensure!(String::from_utf8_lossy(&help.stdout).contains("--routers"), "this ferry up has no --routers: run with --routers 1");
            cmd.args(["--routers", &a.routers.to_string()]);
        }
        let mut child = cmd
            .stdout(std::process::Stdio::piped())
            .stderr(std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?)
            .spawn()
            .context("starting ferry up")?;
        let out = BufReader::new(child.stdout.take().context("ferry up's stdout")?);
        let procs = Arc::new(Mutex::new(Vec::new()));
        let seen = procs.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                if let Some(p) = announced(&line) {
                    seen.lock().unwrap_or_else(|e| e.into_inner()).push(p);
                }
                if line.starts_with("ready ") {
                    let _ = ready_tx.send(());
                }
            }
        });
        let up = Up { child, procs, log, admin };
        if ready_rx.recv_timeout(Duration::from_secs(300)).is_err() {
            anyhow::bail!("ferry up did not become ready (its log: {})", up.log.display());
        }
        Ok(up)
    }

    /// Live processes of `role`, each pid once (newest announcement).
    fn live(&self, role: Role) -> Vec<Proc> {
        let all = self.procs.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut out: Vec<Proc> = Vec::new();
        for p in all.into_iter().filter(|p| p.role == role) {
            out.retain(|q| q.pid != p.pid && q.grpc != p.grpc);
            out.push(p);
        }
        out.retain(|p| alive(p.pid));
        out
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        for p in self.procs.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            signal(p.pid, libc::SIGCONT);
        }
        signal(self.child.id(), libc::SIGTERM);
        let _ = self.child.wait();
    }
}

/// How one request ended.
#[derive(Clone, Debug)]
enum End {
    Completed,
    Corrupted { got: Vec<u32> },
    Failed { code: tonic::Code, message: String },
    Lost,
    Hung,
}

#[derive(Clone, Debug)]
struct Record {
    index: usize,
    router: String,
    start: Instant,
    end: Instant,
    how: End,
    /// The longest gap the client saw between two tokens.
    max_gap: Duration,
}

struct Fault {
    at: Instant,
    what: String,
    target: Proc,
}

async fn one(channel: tonic::transport::Channel, ids: Vec<u32>, want: &[u32], max_tokens: u32, timeout: Duration) -> (End, Duration) {
    let req = v1::GenerateRequest {
        input: Some(v1::generate_request::Input::Tokens(v1::TokenInput { ids })),
        stop: Some(v1::StopConditions { max_tokens, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    };
    let mut got = Vec::new();
    let mut max_gap = Duration::ZERO;
    let body = async {
        let mut s = match v1::ferry_client::FerryClient::new(channel).generate(req).await {
            Ok(r) => r.into_inner(),
            Err(s) => return End::Failed { code: s.code(), message: s.message().to_string() },
        };
        let mut last: Option<Instant> = None;
        loop {
            match s.message().await {
                Ok(Some(m)) => match m.event {
                    Some(generate_response::Event::Delta(d)) => {
                        let now = Instant::now();
                        if let Some(l) = last {
                            max_gap = max_gap.max(now - l);
                        }
                        last = Some(now);
                        got.extend(d.token_ids);
                    }
                    Some(generate_response::Event::Final(_)) if got == want => return End::Completed,
                    Some(generate_response::Event::Final(_)) => return End::Corrupted { got: got.clone() },
                    Some(generate_response::Event::ToolCall(_)) | None => {}
                },
                Ok(None) => return End::Lost,
                Err(s) => return End::Failed { code: s.code(), message: s.message().to_string() },
            }
        }
    };
    let how = tokio::time::timeout(timeout, body).await.unwrap_or(End::Hung);
    (how, max_gap)
}

/// Ready workers of each role as one router lists them: (prefill, decode), or None if it does not answer.
async fn ready_counts(router: &str, token: &ferry_proto::Bearer) -> Option<(usize, usize)> {
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{router}")).ok()?.connect_timeout(Duration::from_secs(1)).connect().await.ok()?;
    let mut admin = v1::admin_client::AdminClient::with_interceptor(ch, token.clone());
    let ws = tokio::time::timeout(Duration::from_secs(2), admin.list_workers(v1::ListWorkersRequest {})).await.ok()?.ok()?.into_inner().workers;
    let n = |r: v1::WorkerRole| ws.iter().filter(|w| w.role == r as i32 && w.state == v1::WorkerState::Ready as i32).count();
    Some((n(v1::WorkerRole::Prefill), n(v1::WorkerRole::Decode)))
}

/// What keeps the cluster from being whole (every router up and listing every worker ready; one
/// fault at a time: the last one is healed), or None when it is.
async fn missing(up: &Up, a: &ChaosBenchArgs) -> Option<String> {
    let rs = up.live(Role::Router);
    if rs.len() < a.routers.max(1) {
        return Some(format!("{} of {} routers alive", rs.len(), a.routers.max(1)));
    }
    for r in &rs {
        match ready_counts(&r.grpc, &up.admin).await {
            Some((p, d)) if p >= a.prefill && d >= a.decode => {}
            Some((p, d)) => return Some(format!("{} lists {p} prefill and {d} decode workers ready", r.name)),
            None => return Some(format!("{} does not answer ListWorkers", r.name)),
        }
    }
    None
}

async fn http_get(addr: &str, path: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr)).await.map_err(|_| std::io::Error::other("connect timed out"))??;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes()).await?;
    let mut r = String::new();
    tokio::time::timeout(Duration::from_secs(2), s.read_to_string(&mut r)).await.map_err(|_| std::io::Error::other("read timed out"))??;
    Ok(r)
}

fn samples<'a>(text: &'a str, name: &'a str) -> impl Iterator<Item = (&'a str, f64)> + 'a {
    text.lines()
        .filter(move |l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| Some((l.rsplit_once(' ')?.0, l.rsplit(' ').next()?.parse::<f64>().ok()?)))
}

/// Blocks a worker's own counters say are taken: used + reserved (and its active sequences).
/// Every gauge must be there and the pool must have blocks: a worker that exports none (or a
/// renamed gauge) is an error, never a pool with nothing held.
async fn held(metrics: &str) -> Result<(f64, f64), String> {
    let text = http_get(metrics, "/metrics").await.map_err(|e| format!("/metrics at {metrics}: {e}"))?;
    let gauge = |name: &str, state: Option<&str>| {
        samples(&text, name)
            .filter(|(k, _)| state.is_none_or(|s| k.contains(&format!("state=\"{s}\""))))
            .map(|(_, v)| v)
            .reduce(|a, b| a + b)
            .ok_or_else(|| format!("no {name}{} in its /metrics", state.map_or(String::new(), |s| format!("{{state=\"{s}\"}}"))))
    };
    let (free, used, reserved) = (gauge("ferry_worker_kv_blocks", Some("free"))?, gauge("ferry_worker_kv_blocks", Some("used"))?, gauge("ferry_worker_kv_blocks", Some("reserved"))?);
    if free + used <= 0.0 {
        return Err(format!("a KV pool of {} blocks", free + used));
    }
    Ok((used + reserved, gauge("ferry_worker_active_sequences", None)?))
}

/// Migration figures of one router's `/metrics`: the counter and the stall histogram's buckets.
#[derive(Clone, Default, Debug)]
struct RouterFigures {
    migrations: Option<f64>,
    /// (le, cumulative count)
    stall_buckets: Vec<(f64, f64)>,
}

fn router_figures(text: &str) -> RouterFigures {
    let migrations = samples(text, "ferry_router_migrations_total").map(|(_, v)| v).reduce(|a, b| a + b);
    let stall_buckets = samples(text, "ferry_router_migration_stall_seconds_bucket")
        .filter_map(|(k, v)| {
            let le = k.split("le=\"").nth(1)?.split('"').next()?;
            Some((if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? }, v))
        })
        .collect();
    RouterFigures { migrations, stall_buckets }
}

/// The q-quantile (0..1) of cumulative histogram buckets, interpolated within its bucket.
fn bucket_quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let mut b = buckets.to_vec();
    b.sort_by(|x, y| x.0.total_cmp(&y.0));
    let total = b.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let target = q * total;
    let (mut lo, mut below) = (0.0, 0.0);
    for (le, cum) in b {
        if cum >= target {
            if le.is_infinite() {
                return Some(lo);
            }
            let frac = if cum > below { (target - below) / (cum - below) } else { 1.0 };
            return Some(lo + (le - lo) * frac);
        }
        (lo, below) = (le, cum);
    }
    Some(lo)
}

pub fn run(a: ChaosBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.requests >= 1 && a.concurrency >= 1 && a.prompts >= 1, "--requests, --concurrency and --prompts must be at least 1");
    anyhow::ensure!(a.max_tokens >= 1, "--max-tokens must be at least 1");
    let lens = LenDist::parse(&a.prompt_len).map_err(anyhow::Error::msg)?;
    let model = ferry_engine::fetch::resolve_model(Some(&a.model))?;
    // The reference: the single-process engine's greedy ids, once per distinct prompt.
    let mut engine = ferry_engine::Engine::load(&model, &ferry_engine::EngineConfig { threads: 2, ..Default::default() })?;
    let base = engine.encode(&TEXT.repeat(8))?;
    let mut u = loadgen::uniforms(a.seed);
    let mut prompts = Vec::new();
    for _ in 0..a.prompts {
        let n = lens.sample(&mut u).min(base.len() - 1);
        let at = ((u() * (base.len() - n) as f64) as usize).min(base.len() - n);
        let p = base[at..at + n].to_vec();
        let params = ferry_core::SamplingParams { ignore_eos: true, ..ferry_core::SamplingParams::greedy(a.max_tokens as usize) };
        let want = engine.generate(&p, &params, &mut |_| {})?.tokens;
        prompts.push((p, want));
    }
    drop(engine);
    let up = Up::start(&a, &model)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let report = rt.block_on(soak(&a, &up, Arc::new(prompts), &mut u))?;
    drop(rt);
    drop(up);
    print_report(&a, &report)
}

struct Report {
    records: Vec<Record>,
    faults: Vec<(f64, String)>,
    /// (worker, blocks held, active sequences) after settling, for every live worker.
    pools: Vec<(String, f64, f64)>,
    figures: Vec<RouterFigures>,
    wall_s: f64,
    allowed: Vec<bool>,
    /// Waits of more than 10 s for the cluster to heal before a fault: (at s, waited s, what was missing last).
    heals: Vec<(f64, f64, String)>,
}

async fn soak(a: &ChaosBenchArgs, up: &Up, prompts: Arc<Vec<(Vec<u32>, Vec<u32>)>>, u: &mut impl FnMut() -> f64) -> anyhow::Result<Report> {
    let t0 = Instant::now();
    let bar = indicatif::ProgressBar::new(a.requests as u64);
    if !std::io::stderr().is_terminal() {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_style(indicatif::ProgressStyle::with_template("{bar:40} {pos}/{len} requests  {msg}").map_err(|e| anyhow::anyhow!("{e}"))?);
    let next = Arc::new(AtomicUsize::new(0));
    let finished = Arc::new(AtomicUsize::new(0));
    let records = Arc::new(Mutex::new(Vec::new()));
    let channels: Arc<Mutex<HashMap<String, tonic::transport::Channel>>> = Default::default();
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..a.concurrency {
        let (next, finished, records, channels, prompts, bar) = (next.clone(), finished.clone(), records.clone(), channels.clone(), prompts.clone(), bar.clone());
        let procs = up.procs.clone();
        let (n, max_tokens, timeout) = (a.requests, a.max_tokens, Duration::from_secs(a.request_timeout));
        clients.spawn(async move {
            loop {
                let index = next.fetch_add(1, SeqCst);
                if index >= n {
                    return;
                }
                // Round-robin over the routers alive now.
                let live: Vec<String> = {
                    let all = procs.lock().unwrap_or_else(|e| e.into_inner()).clone();
                    let mut seen: Vec<String> = Vec::new();
                    for r in all.iter().filter(|p| p.role == Role::Router && alive(p.pid)) {
                        if !seen.contains(&r.grpc) {
                            seen.push(r.grpc.clone());
                        }
                    }
                    seen
                };
                let Some(router) = live.get(index % live.len().max(1)).cloned() else {
                    records.lock().unwrap_or_else(|e| e.into_inner()).push(Record { index, router: String::new(), start: Instant::now(), end: Instant::now(), how: End::Failed { code: tonic::Code::Unavailable, message: "no router alive".into() }, max_gap: Duration::ZERO });
                    finished.fetch_add(1, SeqCst);
                    continue;
                };
                let channel = {
                    let mut c = channels.lock().unwrap_or_else(|e| e.into_inner());
                    match c.get(&router) {
                        Some(ch) => ch.clone(),
                        None => match tonic::transport::Endpoint::from_shared(format!("http://{router}")) {
                            Ok(ep) => {
                                let ch = ep.connect_timeout(Duration::from_secs(2)).connect_lazy();
                                c.insert(router.clone(), ch.clone());
                                ch
                            }
                            Err(_) => continue,
                        },
                    }
                };
                let (p, want) = &prompts[index % prompts.len()];
                let start = Instant::now();
                let (how, max_gap) = one(channel, p.clone(), want, max_tokens, timeout).await;
                records.lock().unwrap_or_else(|e| e.into_inner()).push(Record { index, router, start, end: Instant::now(), how, max_gap });
                finished.fetch_add(1, SeqCst);
                bar.inc(1);
            }
        });
    }
    // Who is down, sampled: (time, prefill ready, decode ready) from the first router that answers.
    let timeline: Arc<Mutex<Vec<(Instant, usize, usize)>>> = Default::default();
    let (tl, procs, admin) = (timeline.clone(), up.procs.clone(), up.admin.clone());
    let poller = tokio::spawn(async move {
        loop {
            let rs: Vec<String> = procs.lock().unwrap_or_else(|e| e.into_inner()).iter().filter(|p| p.role == Role::Router && alive(p.pid)).map(|p| p.grpc.clone()).collect();
            for r in rs {
                if let Some((p, d)) = ready_counts(&r, &admin).await {
                    tl.lock().unwrap_or_else(|e| e.into_inner()).push((Instant::now(), p, d));
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    });
    // The faults, spaced by progress.
    let deadline = t0 + Duration::from_secs(a.timeout);
    let mut faults: Vec<Fault> = Vec::new();
    let mut figures: HashMap<String, RouterFigures> = HashMap::new();
    // Waits of more than 10 s for the cluster to heal before a fault: (at, seconds, what was missing last).
    let mut heals: Vec<(f64, f64, String)> = Vec::new();
    for k in 0..a.kills {
        let due = (k + 1) * a.requests / (a.kills + 1);
        while finished.load(SeqCst) < due && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        if finished.load(SeqCst) >= a.requests || Instant::now() >= deadline {
            break;
        }
        // One fault at a time: wait (a while) for the cluster to be whole again.
        let (waited, settle) = (Instant::now(), Instant::now() + Duration::from_secs(60));
        let mut why = None;
        while let Some(w) = missing(up, a).await {
            if Instant::now() >= settle || finished.load(SeqCst) >= a.requests {
                why = Some(w);
                break;
            }
            if why.as_ref() != Some(&w) {
                bar.set_message(format!("waiting to strike fault {}: {w}", k + 1));
            }
            why = Some(w);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if waited.elapsed() > Duration::from_secs(10) {
            heals.push((waited.duration_since(t0).as_secs_f64(), waited.elapsed().as_secs_f64(), why.unwrap_or_default()));
        }
        if finished.load(SeqCst) >= a.requests {
            break;
        }
        let mut targets: Vec<Proc> = up.live(Role::Prefill).into_iter().chain(up.live(Role::Decode)).collect();
        let rs = up.live(Role::Router);
        if rs.len() >= 2 {
            targets.extend(rs);
        }
        let target = targets[((u() * targets.len() as f64) as usize).min(targets.len() - 1)].clone();
        let freeze = target.role != Role::Router && u() < 0.5;
        if target.role == Role::Router
            && let Ok(text) = http_get(&target.metrics, "/metrics").await
        {
            figures.insert(format!("{}#{}", target.metrics, target.pid), router_figures(&text));
        }
        let at = Instant::now();
        if freeze {
            let secs = 2.0 + 4.0 * u();
            signal(target.pid, libc::SIGSTOP);
            faults.push(Fault { at, what: format!("SIGSTOP {:.1} s", secs), target: target.clone() });
            bar.set_message(format!("fault {}/{}: SIGSTOP {}", k + 1, a.kills, target.name));
            tokio::time::sleep(Duration::from_secs_f64(secs)).await;
            signal(target.pid, libc::SIGCONT);
        } else {
            signal(target.pid, libc::SIGKILL);
            faults.push(Fault { at, what: "kill -9".into(), target: target.clone() });
            bar.set_message(format!("fault {}/{}: kill -9 {}", k + 1, a.kills, target.name));
        }
    }
    // The rest of the requests, within the run's deadline.
    let left = deadline.saturating_duration_since(Instant::now());
    let _ = tokio::time::timeout(left, async { while clients.join_next().await.is_some() {} }).await;
    clients.abort_all();
    bar.finish_and_clear();
    let wall_s = t0.elapsed().as_secs_f64();
    let mut records = records.lock().unwrap_or_else(|e| e.into_inner()).clone();
    // Requests never finished within the deadline are hung.
    let done: Vec<usize> = records.iter().map(|r| r.index).collect();
    for index in (0..a.requests).filter(|i| !done.contains(i)) {
        let now = Instant::now();
        records.push(Record { index, router: String::new(), start: now, end: now, how: End::Hung, max_gap: Duration::ZERO });
    }
    records.sort_by_key(|r| r.index);
    poller.abort();
    // Settle: every live worker's own counters, until whole or 60 s.
    let settle = Instant::now() + Duration::from_secs(60);
    let pools = loop {
        let mut pools = Vec::new();
        for w in up.live(Role::Prefill).into_iter().chain(up.live(Role::Decode)) {
            // An unreadable pool is NaN: never whole, reported as such.
            match held(&w.metrics).await {
                Ok((blocks, active)) => pools.push((format!("{} (pid {})", w.name, w.pid), blocks, active)),
                Err(e) => pools.push((format!("{} (pid {}): unreadable: {e}", w.name, w.pid), f64::NAN, f64::NAN)),
            }
        }
        if pools.iter().all(|(_, b, s)| *b == 0.0 && *s == 0.0) || Instant::now() > settle {
            break pools;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    for r in up.live(Role::Router) {
        if let Ok(text) = http_get(&r.metrics, "/metrics").await {
            figures.insert(format!("{}#{}", r.metrics, r.pid), router_figures(&text));
        }
    }
    // Which failures are allowed: through a router that was killed while the request ran (or in
    // the STALE seconds before it started: a client's connection to it is then broken), or
    // while a whole role was down (within a second of the failure).
    let timeline = timeline.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let allowed = records
        .iter()
        .map(|r| {
            if !matches!(r.how, End::Failed { .. }) {
                return true;
            }
            let router_struck = faults.iter().any(|f| f.target.role == Role::Router && f.target.grpc == r.router && f.at + STALE >= r.start && f.at <= r.end + Duration::from_secs(1));
            let role_down = timeline.iter().any(|(t, p, d)| (*p == 0 || *d == 0) && *t + Duration::from_secs(1) >= r.start && *t <= r.end + Duration::from_secs(1));
            router_struck || role_down
        })
        .collect();
    let faults = faults.iter().map(|f| (f.at.duration_since(t0).as_secs_f64(), format!("{} {} (pid {})", f.what, f.target.name, f.target.pid))).collect();
    Ok(Report { records, faults, pools, figures: figures.into_values().collect(), wall_s, allowed, heals })
}

fn print_report(a: &ChaosBenchArgs, r: &Report) -> anyhow::Result<()> {
    let count = |f: &dyn Fn(&End) -> bool| r.records.iter().filter(|x| f(&x.how)).count();
    let completed = count(&|e| matches!(e, End::Completed));
    let corrupted = count(&|e| matches!(e, End::Corrupted { .. }));
    let failed = count(&|e| matches!(e, End::Failed { .. }));
    let lost = count(&|e| matches!(e, End::Lost));
    let hung = count(&|e| matches!(e, End::Hung));
    let unexplained: Vec<&Record> = r.records.iter().zip(&r.allowed).filter(|(_, ok)| !**ok).map(|(x, _)| x).collect();
    let unreadable = r.pools.iter().filter(|(_, b, _)| b.is_nan()).count();
    let leaked: f64 = r.pools.iter().map(|(_, b, _)| b).filter(|b| !b.is_nan()).sum();
    let active: f64 = r.pools.iter().map(|(_, _, s)| s).filter(|s| !s.is_nan()).sum();
    let migrations = r.figures.iter().filter_map(|f| f.migrations).reduce(|x, y| x + y);
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for f in &r.figures {
        for &(le, c) in &f.stall_buckets {
            match buckets.iter_mut().find(|(l, _)| *l == le) {
                Some(b) => b.1 += c,
                None => buckets.push((le, c)),
            }
        }
    }
    let stall = |q: f64| bucket_quantile(&buckets, q).map(|s| s * 1e3);
    let gaps: Vec<f64> = r.records.iter().filter(|x| matches!(x.how, End::Completed)).map(|x| x.max_gap.as_secs_f64() * 1e3).collect();
    let why: HashMap<String, usize> = r.records.iter().fold(HashMap::new(), |mut m, x| {
        if let End::Failed { code, message } = &x.how {
            *m.entry(format!("{code:?}: {}", message.chars().take(120).collect::<String>())).or_default() += 1;
        }
        m
    });
    let fmt = |v: Option<f64>| v.map_or("n/a".to_string(), |v| format!("{v:.0}"));
    if a.json {
        let out = json!({
            "bench": "chaos",
            "requests": a.requests, "concurrency": a.concurrency, "kills": r.faults.len(), "seed": a.seed,
            "cluster": { "routers": a.routers, "prefill": a.prefill, "decode": a.decode, "threads": a.threads },
            "wall_s": r.wall_s,
            "sent": r.records.len(), "completed": completed, "failed": failed, "failed_unexplained": unexplained.len(),
            "lost": lost, "hung": hung, "corrupted": corrupted,
            "failures": why,
            "faults": r.faults.iter().map(|(t, w)| json!({ "at_s": t, "fault": w })).collect::<Vec<_>>(),
            "slow_heals": r.heals.iter().map(|(t, s, w)| json!({ "at_s": t, "waited_s": s, "missing": w })).collect::<Vec<_>>(),
            "leaked_blocks": leaked, "active_sequences_after_settle": active, "pools_unreadable": unreadable,
            "pools": r.pools.iter().map(|(w, b, s)| json!({ "worker": w, "blocks_held": b, "active_sequences": s })).collect::<Vec<_>>(),
            "migrations": migrations,
            "migration_stall_ms": { "p50": stall(0.5), "p99": stall(0.99) },
            "client_max_token_gap_ms": { "p50": loadgen::percentile(&gaps, 50.0), "p99": loadgen::percentile(&gaps, 99.0) },
        });
        println!("{out}");
    } else {
        println!("chaos soak: {} requests, {} clients, {} faults (seed {}), {} router(s) + {} prefill + {} decode, {:.0} s", a.requests, a.concurrency, r.faults.len(), a.seed, a.routers, a.prefill, a.decode, r.wall_s);
        for (t, w) in &r.faults {
            println!("  fault at {t:>6.1} s: {w}");
        }
        for (t, s, w) in &r.heals {
            println!("  slow heal: from {t:.1} s the next fault waited {s:.1} s for the cluster to be whole ({w})");
        }
        println!("sent {}  completed {completed}  failed {failed} ({} unexplained)  lost {lost}  hung {hung}  corrupted {corrupted}", r.records.len(), unexplained.len());
        for (m, n) in &why {
            println!("  failed x{n}: {m}");
        }
        for x in r.records.iter().filter(|x| matches!(x.how, End::Corrupted { .. })) {
            if let End::Corrupted { got } = &x.how {
                println!("  corrupted: request {} via {}: {:?}", x.index, x.router, got);
            }
        }
        for x in &unexplained {
            println!("  unexplained failure: request {} via {}: {:?}", x.index, x.router, x.how);
        }
        for (w, b, s) in &r.pools {
            println!("  pool {w}: {b} blocks held, {s} sequences active");
        }
        println!("leaked blocks {leaked}  unreadable pools {unreadable}");
        println!(
            "migrations {}  migration stall p50 {} ms  p99 {} ms  (client's longest token gap p50 {:.0} ms, p99 {:.0} ms)",
            migrations.map_or("n/a".to_string(), |m| format!("{m:.0}")),
            fmt(stall(0.5)),
            fmt(stall(0.99)),
            loadgen::percentile(&gaps, 50.0),
            loadgen::percentile(&gaps, 99.0)
        );
    }
    let bad = lost + hung + corrupted + unexplained.len();
    anyhow::ensure!(
        bad == 0 && leaked == 0.0 && active == 0.0 && unreadable == 0,
        "chaos soak failed: {lost} lost, {hung} hung, {corrupted} corrupted, {} unexplained failures, {leaked} leaked blocks, {unreadable} pools unreadable",
        unexplained.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_quantiles_interpolate_within_the_bucket() {
        let b = [(0.1, 0.0), (0.5, 50.0), (1.0, 100.0), (f64::INFINITY, 100.0)];
        assert!((bucket_quantile(&b, 0.5).unwrap() - 0.5).abs() < 1e-9);
        assert!((bucket_quantile(&b, 0.25).unwrap() - 0.3).abs() < 1e-9);
        assert!((bucket_quantile(&b, 0.99).unwrap() - 0.99).abs() < 1e-9);
        assert_eq!(bucket_quantile(&[(1.0, 0.0), (f64::INFINITY, 0.0)], 0.5), None);
        assert_eq!(bucket_quantile(&[(1.0, 0.0), (f64::INFINITY, 4.0)], 0.5), Some(1.0));
    }

    #[test]
    fn announced_lines_name_role_pid_and_addresses() {
        let w = announced("worker   role=decode name=decode-2 pid=42 grpc=127.0.0.1:5 data=127.0.0.1:6 metrics=127.0.0.1:7").unwrap();
        assert_eq!((w.role, w.name.as_str(), w.pid, w.grpc.as_str(), w.metrics.as_str()), (Role::Decode, "decode-2", 42, "127.0.0.1:5", "127.0.0.1:7"));
        let r = announced("router   grpc=127.0.0.1:9 http=127.0.0.1:8 metrics=127.0.0.1:3 pid=7").unwrap();
        assert_eq!((r.role, r.pid), (Role::Router, 7));
        assert!(announced("ready router=127.0.0.1:9").is_none());
    }
}
