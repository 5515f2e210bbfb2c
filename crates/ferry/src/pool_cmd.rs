//! `ferry pool list|drain|undrain|remove|scale`: the router's admin API from the command line.

use ferry_proto::v1;

use crate::remote::status_error;

#[derive(clap::Args, Debug)]
pub struct PoolArgs {
    #[command(subcommand)]
    pub command: PoolCommand,
}

#[derive(clap::Subcommand, Debug)]
pub enum PoolCommand {
    /// List the registered workers.
    List(PoolOpts),
    /// Stop routing new requests to a worker (in-flight ones finish).
    Drain(PoolWorker),
    /// Route to a drained worker again.
    Undrain(PoolWorker),
    /// Forget a worker (it may register again).
    Remove(PoolWorker),
    /// Set a pool's size: under Kubernetes the router patches the pool's Deployment; under
    /// `ferry up` workers are started, or the newest are drained and stopped (no request lost).
    Scale(PoolScale),
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolRole {
    Prefill,
    Decode,
    Colocated,
}

#[derive(clap::Args, Debug)]
pub struct PoolScale {
    #[command(flatten)]
    pub opts: PoolOpts,
    pub role: PoolRole,
    pub replicas: u32,
    /// Return once the scaler accepted, without waiting for the pool to reach its size.
    #[arg(long)]
    pub no_wait: bool,
    /// Seconds to wait for the router to see the pool at its new size (workers loaded and
    /// registered; drained ones gone).
    #[arg(long, default_value_t = 300)]
    pub wait_timeout: u64,
}

#[derive(clap::Args, Debug)]
pub struct PoolOpts {
    /// The router's gRPC address.
    #[arg(long, default_value = "127.0.0.1:7700")]
    pub router: String,
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The router's admin token (its `--admin-token`; with none set there, its cluster secret).
    #[arg(long, env = "FERRY_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// A file holding the admin token (what `ferry up` prints as `admin token_file=`).
    #[arg(long, env = "FERRY_ADMIN_TOKEN_FILE", value_name = "FILE", conflicts_with = "admin_token")]
    pub admin_token_file: Option<std::path::PathBuf>,
    /// TLS to the router.
    #[command(flatten)]
    pub tls: crate::tls_args::DialTlsArgs,
}

#[derive(clap::Args, Debug)]
pub struct PoolWorker {
    #[command(flatten)]
    pub opts: PoolOpts,
    /// Worker id (`prefill-1`, `decode-2`, …).
    pub worker_id: String,
}

pub fn run(a: PoolArgs) -> anyhow::Result<()> {
    let (opts, workers) = match a.command {
        PoolCommand::Scale(s) => return scale(s),
        cmd => call(cmd)?,
    };
    let mut out = String::new();
    if opts.json {
        out = serde_json::to_string_pretty(&workers.iter().map(to_json).collect::<Vec<_>>())?;
    } else {
        out.push_str(&table(&workers));
    }
    println!("{}", out.trim_end());
    Ok(())
}

fn call(cmd: PoolCommand) -> anyhow::Result<(PoolOpts, Vec<v1::WorkerInfo>)> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async move {
        let opts = match &cmd {
            PoolCommand::List(o) => o,
            PoolCommand::Drain(w) | PoolCommand::Undrain(w) | PoolCommand::Remove(w) => &w.opts,
            PoolCommand::Scale(s) => &s.opts,
        };
        let mut c = admin(&opts.router, opts).await?;
        let one = |w: &PoolWorker| v1::WorkerRef { worker_id: w.worker_id.clone(), ..Default::default() };
        Ok(match cmd {
            PoolCommand::List(o) => (o, c.list_workers(v1::ListWorkersRequest {}).await.map_err(status_error)?.into_inner().workers),
            PoolCommand::Drain(w) => {
                let info = c.drain(one(&w)).await.map_err(status_error)?.into_inner();
                (w.opts, vec![info])
            }
            PoolCommand::Undrain(w) => {
                let info = c.undrain(one(&w)).await.map_err(status_error)?.into_inner();
                (w.opts, vec![info])
            }
            PoolCommand::Remove(w) => {
                let info = c.remove(one(&w)).await.map_err(status_error)?.into_inner();
                (w.opts, vec![info])
            }
            PoolCommand::Scale(_) => unreachable!("handled by `scale`"),
        })
    })
}

pub(crate) type Admin = v1::admin_client::AdminClient<tonic::service::interceptor::InterceptedService<tonic::transport::Channel, ferry_proto::Bearer>>;

async fn admin(router: &str, opts: &PoolOpts) -> anyhow::Result<Admin> {
    let from_file = match &opts.admin_token_file {
        Some(p) => Some(std::fs::read_to_string(p).map_err(|e| anyhow::anyhow!("reading the admin token from {}: {e}", p.display()))?),
        None => None,
    };
    let token = from_file.as_deref().or(opts.admin_token.as_deref());
    let auth = ferry_proto::Bearer::new(token).map_err(|e| anyhow::anyhow!("the admin token: {e}"))?;
    let channel = crate::remote::connect(router, opts.tls.client()?.as_ref()).await?;
    Ok(v1::admin_client::AdminClient::with_interceptor(channel, auth))
}

fn scale(s: PoolScale) -> anyhow::Result<()> {
    let role = match s.role {
        PoolRole::Prefill => v1::WorkerRole::Prefill,
        PoolRole::Decode => v1::WorkerRole::Decode,
        PoolRole::Colocated => v1::WorkerRole::Colocated,
    };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async move {
        let mut c = admin(&s.opts.router, &s.opts).await?;
        let resp = c.scale(v1::ScaleRequest { role: role as i32, replicas: s.replicas }).await.map_err(status_error)?.into_inner();
        if !s.opts.json {
            println!("{role} pool: {} -> {} ({})", resp.previous, resp.replicas, resp.backend);
            for w in &resp.started {
                println!("  started  {w}");
            }
            for w in &resp.stopping {
                println!("  draining {w} (it stops when its in-flight requests are done)");
            }
        }
        let mut workers = Vec::new();
        if !s.no_wait {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(s.wait_timeout);
            loop {
                workers = c.list_workers(v1::ListWorkersRequest {}).await.map_err(status_error)?.into_inner().workers;
                if settled(&workers, role, s.replicas) {
                    break;
                }
                anyhow::ensure!(
                    std::time::Instant::now() < deadline,
                    "the {role} pool did not reach {} ready workers within {} s:\n{}",
                    s.replicas,
                    s.wait_timeout,
                    table(&workers)
                );
                tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            }
        }
        if s.opts.json {
            let v = serde_json::json!({
                "role": role.to_string(), "previous": resp.previous, "replicas": resp.replicas,
                "backend": resp.backend, "started": resp.started, "stopping": resp.stopping,
                "workers": workers.iter().map(to_json).collect::<Vec<_>>(),
            });
            println!("{}", serde_json::to_string_pretty(&v)?);
        } else if !s.no_wait {
            print!("{}", table(&workers));
        }
        Ok(())
    })
}

/// Whether the router sees exactly `replicas` ready workers of `role` and none still draining
/// to exit.
pub fn settled(workers: &[v1::WorkerInfo], role: v1::WorkerRole, replicas: u32) -> bool {
    let of_role = workers.iter().filter(|w| w.role == role as i32);
    let ready = of_role.clone().filter(|w| w.state == v1::WorkerState::Ready as i32).count();
    let leaving = of_role.filter(|w| w.shutting_down && w.state != v1::WorkerState::Dead as i32).count();
    ready == replicas as usize && leaving == 0
}

fn role(w: &v1::WorkerInfo) -> String {
    v1::WorkerRole::try_from(w.role).unwrap_or(v1::WorkerRole::Unspecified).to_string()
}

fn state(w: &v1::WorkerInfo) -> String {
    let s = v1::WorkerState::try_from(w.state).unwrap_or(v1::WorkerState::Unspecified).to_string();
    if w.shutting_down {
        format!("{s} (exiting)")
    } else {
        s
    }
}

pub fn to_json(w: &v1::WorkerInfo) -> serde_json::Value {
    let load = w.load.unwrap_or_default();
    serde_json::json!({
        "worker_id": w.worker_id, "name": w.name, "role": role(w), "state": state(w),
        "grpc_addr": w.grpc_addr, "data_addr": w.data_addr,
        "inflight": w.inflight, "outstanding_prefill_tokens": w.outstanding_prefill_tokens,
        "shutting_down": w.shutting_down,
        "since_heartbeat_ms": w.since_heartbeat_ms,
        "kv_transports": kv_transports(w),
        "kv_dtype": kv_dtype(w),
        "kv_bytes_per_token": w.kv_bytes_per_token,
        "load": {
            "kv_blocks_total": load.kv_blocks_total, "kv_blocks_free": load.kv_blocks_free,
            "kv_blocks_reserved": load.kv_blocks_reserved, "active_sequences": load.active_sequences,
            "queued_prefill_tokens": load.queued_prefill_tokens, "block_size": load.block_size,
            "kv_blocks_cached": load.kv_blocks_cached, "kv_disk_blocks": load.kv_disk_blocks,
            "disk_read_tokens_per_s": load.disk_read_tokens_per_s,
        },
    })
}

/// The KV transports a worker registered (`grpc`, `tcp`, `nccl`).
fn kv_transports(w: &v1::WorkerInfo) -> Vec<String> {
    w.kv_transports.iter().map(|&k| v1::KvTransport::try_from(k).unwrap_or(v1::KvTransport::Unspecified).to_string()).collect()
}

/// What the worker's KV cache stores (f32 for a router that does not say).
fn kv_dtype(w: &v1::WorkerInfo) -> &str {
    if w.kv_dtype.is_empty() { "f32" } else { &w.kv_dtype }
}

/// How long the worker's steps took against its profile since it started (`1.12x`: 12% slower
/// than profiled); `-` when it prices no steps (no `--profile`).
fn step_time(load: &v1::WorkerLoad) -> String {
    if load.step_model_seconds > 0.0 {
        format!("{:.2}x", load.step_seconds / load.step_model_seconds)
    } else {
        "-".into()
    }
}

pub fn table(workers: &[v1::WorkerInfo]) -> String {
    let mut rows = vec![["ID", "NAME", "ROLE", "STATE", "ADDR", "INFLIGHT", "PREFILL_TOK", "KV_FREE/TOTAL", "KV_DTYPE", "CACHED", "ON_DISK", "ACTIVE", "STEP_TIME", "KV_VIA", "HEARTBEAT"].map(String::from).to_vec()];
    for w in workers {
        let load = w.load.unwrap_or_default();
        rows.push(vec![
            w.worker_id.clone(),
            w.name.clone(),
            role(w),
            state(w),
            w.grpc_addr.clone(),
            w.inflight.to_string(),
            w.outstanding_prefill_tokens.max(load.queued_prefill_tokens).to_string(),
            format!("{}/{}", load.kv_blocks_free, load.kv_blocks_total),
            kv_dtype(w).to_string(),
            load.kv_blocks_cached.to_string(),
            load.kv_disk_blocks.to_string(),
            load.active_sequences.to_string(),
            step_time(&load),
            kv_transports(w).join(","),
            format!("{:.0} ms ago", w.since_heartbeat_ms),
        ]);
    }
    let widths: Vec<usize> = (0..rows[0].len()).map(|i| rows.iter().map(|r| r[i].chars().count()).max().unwrap_or(0)).collect();
    let mut s = String::new();
    for r in &rows {
        let line: Vec<String> = r.iter().zip(&widths).map(|(c, w)| format!("{c:<w$}")).collect();
        s.push_str(line.join("  ").trim_end());
        s.push('\n');
    }
    s
}
