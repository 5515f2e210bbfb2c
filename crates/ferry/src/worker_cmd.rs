//! `ferry prefill` and `ferry decode`: run a worker of either pool, registered with a router.

use crate::ModelArgs;
use anyhow::Context;
use ferry_worker::{Listeners, Role, TransportChoice, WorkerConfig};
use std::time::Duration;

#[derive(clap::Args, Clone, Debug)]
pub struct WorkerArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub otlp: crate::otel::OtlpArgs,
    /// The routers to register with: `host:port`, or several separated by commas. A name that
    /// resolves to several addresses (a headless Service) is one router per address, re-resolved
    /// every second. The worker registers and heartbeats with each; it is ready while registered
    /// with at least one.
    #[arg(long)]
    pub router: Option<String>,
    /// gRPC address to serve on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: String,
    /// Address to advertise to the router and peers (default: the bound gRPC address).
    #[arg(long)]
    pub advertise: Option<String>,
    /// Host to advertise with the bound ports, for the gRPC address and the KV data path (e.g. a
    /// pod's IP; default: the host of --advertise, else the bound IP).
    #[arg(long, env = "FERRY_ADVERTISE_HOST")]
    pub advertise_host: Option<String>,
    /// Decode workers: the TCP data path for KV (`none` turns it off: KV then travels over gRPC).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub data_listen: String,
    /// HTTP address for Prometheus `/metrics` and the `/livez` and `/readyz` probes (`none`
    /// turns it off). It answers while the model loads (`/readyz`: 503).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub metrics_listen: String,
    /// A name for logs and `ferry pool list`.
    #[arg(long)]
    pub name: Option<String>,
    /// Prefill workers: how KV travels when the decode worker offers a data path.
    #[arg(long, value_enum, default_value_t = KvTransportArg::Tcp)]
    pub kv_transport: KvTransportArg,
    /// KV cache capacity in tokens (default: 4 contexts, at most 2 GiB).
    #[arg(long)]
    pub kv_tokens: Option<usize>,
    /// Most tokens per forward step (prefill batches and chunks long prompts to this).
    #[arg(long, default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// Decode workers: how long an admitted request may wait for its KV. The wait includes the
    /// prompt's time in the prefill queue, so this is a last resort against lost transfers (a
    /// failed prefill worker is noticed by the router at once), sized for an overloaded pool.
    #[arg(long, default_value_t = 120_000)]
    pub kv_timeout_ms: u64,
    /// Longest one step of a KV transfer may make no progress, on either side (a chunk the peer
    /// does not take or that does not arrive, an acknowledgement that does not come), before the
    /// transfer fails and frees what it holds; the router then retries the request elsewhere.
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub kv_stall_timeout_ms: u64,
    /// Prefill workers: most prompts waiting to start; beyond it a request is refused at once
    /// (RESOURCE_EXHAUSTED, `ferry-error: overloaded`) and the router tries another worker.
    #[arg(long, default_value_t = ferry_worker::prefill::DEFAULT_QUEUE_MAX as u64, value_parser = clap::value_parser!(u64).range(1..))]
    pub queue_max: u64,
    /// Colocated workers: chunked prefill (Sarathi-Serve) with this many tokens per step, decodes
    /// included; without it, prompts are prefilled whole before the running decodes continue.
    #[arg(long)]
    pub chunked_prefill: Option<usize>,
    /// Pin this process (and its compute threads) to these CPUs, e.g. `0` or `0,2-3`.
    #[arg(long)]
    pub cpus: Option<String>,
    /// Emulate the device of a `ferry profile` file: every engine step lasts at least what the
    /// profile's cost model says for its shape, and the KV cache holds what the profiled one did
    /// (unless `--kv-tokens` says otherwise). With a small model, many workers then behave like
    /// that device on a few cores: for trying routing, `ferry plan` and `--autoscale` at scale.
    #[arg(long)]
    pub emulate_profile: Option<std::path::PathBuf>,
    /// Price every engine step against this `ferry profile` file and report, with the heartbeats
    /// and as `ferry_worker_priced_step_seconds`, how long steps took against how long the profile says
    /// they take: the device's speed now against its profile, which the router's `--autoscale`
    /// plans with (a shared machine's speed drifts). Default: the emulated profile, if any.
    #[arg(long)]
    pub profile: Option<std::path::PathBuf>,
    /// On SIGTERM/Ctrl-C: seconds to wait for in-flight requests (and, on a prefill worker, for
    /// the decode worker's acknowledgement of every KV sent) before exiting anyway, counted from
    /// when the routers have acknowledged the drain (at most 3.25 s after the signal). Keep it,
    /// plus that, below Kubernetes' terminationGracePeriodSeconds.
    #[arg(long, default_value_t = 60)]
    pub drain_timeout: u64,
    /// The cluster secret: this worker's gRPC services and KV data port serve only callers that
    /// present it, and it presents it to the router and to decode workers.
    #[command(flatten)]
    pub cluster: crate::cluster_args::ClusterArgs,
    /// TLS on the gRPC listener (the router and prefill workers dial it). With any TLS option
    /// the plaintext TCP data path is off: KV travels over gRPC, inside TLS.
    #[command(flatten)]
    pub serve_tls: crate::tls_args::ServeTlsArgs,
    /// TLS to the router and to decode workers.
    #[command(flatten)]
    pub dial_tls: crate::tls_args::DialTlsArgs,
    #[command(flatten)]
    pub connections: crate::conn_args::ConnArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
}

/// Speculative decoding (decode and colocated workers, and `ferry up` for its workers).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SpecArgs {
    /// Speculative decoding, with no second model: `ngram` proposes the continuation of the
    /// latest earlier match of the sequence's last tokens in its own prompt and output (prompt
    /// lookup); `suffix` also draws on an index of this worker's earlier prompts and outputs
    /// (SuffixDecoding); `off`. A step verifies the proposals beside the rest of the batch and
    /// keeps those the sampler chooses anyway: the output is the output without it. Decode and
    /// colocated workers only. [default: off]
    #[arg(long, value_parser = parse_spec_mode)]
    pub speculate: Option<ferry_core::spec::SpecMode>,
    /// Most tokens proposed per sequence per step (1-7); each sequence proposes fewer, or none,
    /// as its measured acceptance says pays. [default: 5]
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..=ferry_worker::decode::speculate::MAX_SPEC_TOKENS as u64))]
    pub spec_tokens: Option<u64>,
}

fn parse_spec_mode(s: &str) -> Result<ferry_core::spec::SpecMode, String> {
    s.parse().map_err(|e| format!("{e}"))
}

impl SpecArgs {
    /// The settings for a worker of `role`: refused where they cannot apply (a prefill worker
    /// never decodes; K without a proposer).
    pub fn config(&self, role: Role) -> anyhow::Result<ferry_worker::SpecConfig> {
        let mode = self.speculate.unwrap_or_default();
        let on = mode != ferry_core::spec::SpecMode::Off;
        anyhow::ensure!(!(on && role == Role::Prefill), "--speculate {mode}: a prefill worker does not decode (give it to decode or colocated workers)");
        anyhow::ensure!(on || self.spec_tokens.is_none(), "--spec-tokens needs --speculate ngram or suffix");
        let max_tokens = self.spec_tokens.map_or(ferry_worker::decode::speculate::DEFAULT_SPEC_TOKENS, |k| k as usize);
        Ok(ferry_worker::SpecConfig { mode, max_tokens })
    }

    /// The flags given, again, for a child process.
    pub fn to_args(&self) -> Vec<String> {
        let mut out = Vec::new();
        if let Some(m) = self.speculate {
            out.extend(["--speculate".to_string(), m.to_string()]);
        }
        if let Some(k) = self.spec_tokens {
            out.extend(["--spec-tokens".into(), k.to_string()]);
        }
        out
    }
}

/// The profile at `path` (given as `flag`) and its cost model.
fn cost_model(flag: &str, path: &std::path::Path) -> anyhow::Result<(ferry_core::profile::Profile, ferry_core::profile::CostModel)> {
    let p = crate::plan::read_profile(path).with_context(|| format!("{flag} {}", path.display()))?;
    let model = ferry_core::profile::CostModel::fit(&p).map_err(|e| anyhow::anyhow!("{flag} {}: {e}", path.display()))?;
    Ok((p, model))
}

/// Parse a CPU list (`0,2-3`).
fn parse_cpus(list: &str) -> anyhow::Result<Vec<usize>> {
    let mut out = Vec::new();
    for part in list.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (a, b) = match part.split_once('-') {
            Some((a, b)) => (a.parse::<usize>()?, b.parse::<usize>()?),
            None => (part.parse::<usize>()?, part.parse::<usize>()?),
        };
        anyhow::ensure!(a <= b && b < 1024, "bad CPU range {part:?}");
        out.extend(a..=b);
    }
    anyhow::ensure!(!out.is_empty(), "empty CPU list {list:?}");
    Ok(out)
}

/// Restrict this process to `cpus` (threads started later inherit it).
pub fn pin(list: &str) -> anyhow::Result<()> {
    let cpus = parse_cpus(list)?;
    #[cfg(target_os = "linux")]
    {
        // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes within it for indices
        // below CPU_SETSIZE (checked above: < 1024); sched_setaffinity reads it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &c in &cpus {
                libc::CPU_SET(c, &mut set);
            }
            anyhow::ensure!(
                libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0,
                "cannot pin to CPUs {list}: {}",
                std::io::Error::last_os_error()
            );
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cpus;
    Ok(())
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvTransportArg {
    Tcp,
    Grpc,
    /// Device to device (GPU workers with NCCL); falls back to tcp, else grpc.
    Nccl,
    /// Device to device through CUDA IPC (GPU workers on one node); falls back to tcp, else grpc.
    CudaIpc,
}

impl KvTransportArg {
    /// The flag's value (`cuda-ipc`), to pass on to a child process.
    pub fn flag_value(self) -> String {
        use clap::ValueEnum;
        self.to_possible_value().map(|v| v.get_name().to_string()).unwrap_or_default()
    }
}

async fn bind(addr: &str) -> anyhow::Result<Option<tokio::net::TcpListener>> {
    if addr == "none" {
        return Ok(None);
    }
    Ok(Some(tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?))
}

pub fn run(role: Role, args: WorkerArgs) -> anyhow::Result<()> {
    let spec = args.spec.config(role)?;
    if let Some(cpus) = &args.cpus {
        pin(cpus)?;
    }
    // Bad PEM files fail now, before the model loads.
    let tls = crate::tls_args::tls_config(&args.serve_tls, &args.dial_tls).load()?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    // The probes answer from the start: live at once, ready once loaded and registered.
    let (ready, registered) = tokio::sync::watch::channel(false);
    let health = ferry_worker::cluster::health::Health::new(args.router.clone(), registered);
    let metrics = rt.block_on(bind(&args.metrics_listen))?;
    let metrics_addr = metrics.as_ref().and_then(|l| l.local_addr().ok()).map(|a| a.to_string()).unwrap_or("-".into());
    if let Some(l) = metrics {
        rt.spawn(ferry_worker::cluster::metrics::serve(l, health.clone()));
    }
    let emulated = args.emulate_profile.as_deref().map(|p| cost_model("--emulate-profile", p)).transpose()?;
    let priced = args.profile.as_deref().map(|p| cost_model("--profile", p)).transpose()?;
    // Serving defaults to the fast decode path, as llama.cpp does; `--activations exact` for the
    // reference math.
    let mut engine = args.model.load_with(crate::ActivationsArg::Q8, |c| {
        c.kv_tokens = args.kv_tokens.or(emulated.as_ref().map(|(p, _)| p.kv_blocks * p.block_size));
        c.max_batch_tokens = args.max_batch_tokens;
    })?;
    if let Some((p, model)) = emulated {
        eprintln!("ferry {}: steps paced to the profile of {} on {} ({} threads, measured {})", role.as_str(), p.model, p.machine, p.threads, p.measured_at);
        engine.pace(Some(model));
    }
    if let Some((p, model)) = priced {
        eprintln!("ferry {}: steps priced against the profile of {} on {} (measured {})", role.as_str(), p.model, p.machine, p.measured_at);
        if args.emulate_profile.is_none() && !p.fingerprint.is_empty() && p.fingerprint != engine.fingerprint {
            eprintln!(
                "ferry {}: warning: --profile was measured for another model ({}, fingerprint {}; this worker serves {}): its step-time ratio compares two models",
                role.as_str(),
                p.model,
                p.fingerprint,
                engine.fingerprint
            );
        }
        engine.price(Some(model));
    }
    let model = std::path::Path::new(&args.model.model).file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let outcome: anyhow::Result<Option<String>> = rt.block_on(async move {
        let grpc = bind(&args.listen).await?.context("--listen cannot be none")?;
        // With TLS, no plaintext data path: KV goes over gRPC (TLS).
        let data = if role == Role::Decode && !tls.enabled() { bind(&args.data_listen).await? } else { None };
        let role_name = role.as_str();
        let addr = grpc.local_addr()?;
        let name = args.name.clone().unwrap_or_else(|| format!("{role_name}@{addr}"));
        // NCCL pipes, or a warning saying why not, before the ready line.
        let pipes = match args.kv_transport {
            KvTransportArg::Nccl => crate::pipes::pipes(ferry_proto::v1::KvTransport::Nccl, args.model.device),
            KvTransportArg::CudaIpc => crate::pipes::pipes(ferry_proto::v1::KvTransport::CudaIpc, args.model.device),
            KvTransportArg::Tcp | KvTransportArg::Grpc => None,
        };
        // One machine-readable line on stdout: `ferry up` and the tests wait for it.
        let show = |l: &Option<tokio::net::TcpListener>| l.as_ref().and_then(|l| l.local_addr().ok()).map(|a| a.to_string()).unwrap_or("-".into());
        println!("ferry {role_name} ready grpc={addr} data={} metrics={metrics_addr} name={name}", show(&data));
        let cfg = WorkerConfig {
            role,
            name,
            model: if model.is_empty() { "default".into() } else { model },
            router: args.router.clone(),
            advertise: args.advertise.clone(),
            advertise_host: args.advertise_host.clone(),
            transport: match args.kv_transport {
                KvTransportArg::Tcp => TransportChoice::Tcp,
                KvTransportArg::Grpc => TransportChoice::Grpc,
                KvTransportArg::Nccl => TransportChoice::Nccl,
                KvTransportArg::CudaIpc => TransportChoice::CudaIpc,
            },
            kv_timeout: Duration::from_millis(args.kv_timeout_ms),
            kv_stall_timeout: Duration::from_millis(args.kv_stall_timeout_ms),
            drain_timeout: Duration::from_secs(args.drain_timeout),
            cluster_secret: args.cluster.resolve()?,
            tls,
            pipes,
            connections: args.connections.limits(ferry_proto::conn::ConnLimits::worker())?,
        };
        let opts = ferry_worker::EngineOptions {
            chunk_tokens: args.chunked_prefill,
            queue_max: usize::try_from(args.queue_max).unwrap_or(usize::MAX),
            faults: ferry_worker::fault::FaultInjection::from_env(),
            spec,
        };
        let engine = ferry_worker::EngineHandle::start_with(role, engine, &cfg.model, opts);
        health.engine_started(ferry_worker::cluster::health::EngineView { load: engine.load(), role });
        match ferry_worker::serve(cfg, engine, Listeners { grpc, data, metrics: None, health: Some(health.clone()) }, shutdown_signal(), ready).await {
            Ok(()) => Ok(None),
            Err(ferry_worker::WorkerError::EngineFailed(what)) => Ok(Some(what)),
            Err(e) => Err(e.into()),
        }
    });
    match outcome? {
        None => Ok(()),
        // A broken engine: exit non-zero so that a supervisor (`ferry up`, Kubernetes) restarts it.
        Some(what) => {
            let code = ferry_worker::fault::EXIT_ENGINE_FAILED;
            tracing::error!("the engine failed ({what}); deregistered; exiting with code {code}");
            eprintln!("ferry {}: the engine failed ({what}); exiting with code {code}", role.as_str());
            std::process::exit(code);
        }
    }
}

/// Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(s) => s,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::spec::SpecMode;

    #[test]
    fn speculation_flags_apply_where_they_can_and_are_refused_elsewhere() {
        let on = SpecArgs { speculate: Some(SpecMode::Ngram), spec_tokens: Some(3) };
        let c = on.config(Role::Decode).unwrap();
        assert_eq!((c.mode, c.max_tokens), (SpecMode::Ngram, 3));
        assert_eq!(on.config(Role::Colocated).unwrap().mode, SpecMode::Ngram);
        let e = on.config(Role::Prefill).unwrap_err().to_string();
        assert!(e.contains("prefill worker does not decode"), "{e}");
        let k_alone = SpecArgs { speculate: None, spec_tokens: Some(3) };
        assert!(k_alone.config(Role::Decode).unwrap_err().to_string().contains("--spec-tokens needs --speculate"));
        let off = SpecArgs::default().config(Role::Prefill).unwrap();
        assert_eq!((off.mode, off.max_tokens), (SpecMode::Off, ferry_worker::decode::speculate::DEFAULT_SPEC_TOKENS));
        assert_eq!(on.to_args(), ["--speculate", "ngram", "--spec-tokens", "3"]);
    }
}
