//! `ferry pool list|drain|undrain|remove`: the router's admin API from the command line.

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
}

#[derive(clap::Args, Debug)]
pub struct PoolOpts {
    /// The router's gRPC address.
    #[arg(long, default_value = "127.0.0.1:7700")]
    pub router: String,
    /// JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(clap::Args, Debug)]
pub struct PoolWorker {
    #[command(flatten)]
    pub opts: PoolOpts,
    /// Worker id (`prefill-1`, `decode-2`, …).
    pub worker_id: String,
}

pub fn run(a: PoolArgs) -> anyhow::Result<()> {
    let (opts, workers) = call(a.command)?;
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
        let router = match &cmd {
            PoolCommand::List(o) => &o.router,
            PoolCommand::Drain(w) | PoolCommand::Undrain(w) | PoolCommand::Remove(w) => &w.opts.router,
        };
        let uri = if router.contains("://") { router.clone() } else { format!("http://{router}") };
        let channel = tonic::transport::Endpoint::from_shared(uri.clone())?
            .connect()
            .await
            .map_err(|e| anyhow::anyhow!("Unavailable: cannot connect to the router at {uri}: {e}"))?;
        let mut c = v1::admin_client::AdminClient::new(channel);
        let one = |w: &PoolWorker| v1::WorkerRef { worker_id: w.worker_id.clone() };
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
        })
    })
}

fn role(w: &v1::WorkerInfo) -> String {
    v1::WorkerRole::try_from(w.role).unwrap_or(v1::WorkerRole::Unspecified).to_string()
}

fn state(w: &v1::WorkerInfo) -> String {
    v1::WorkerState::try_from(w.state).unwrap_or(v1::WorkerState::Unspecified).to_string()
}

pub fn to_json(w: &v1::WorkerInfo) -> serde_json::Value {
    let load = w.load.unwrap_or_default();
    serde_json::json!({
        "worker_id": w.worker_id, "name": w.name, "role": role(w), "state": state(w),
        "grpc_addr": w.grpc_addr, "data_addr": w.data_addr,
        "inflight": w.inflight, "outstanding_prefill_tokens": w.outstanding_prefill_tokens,
        "since_heartbeat_ms": w.since_heartbeat_ms,
        "load": {
            "kv_blocks_total": load.kv_blocks_total, "kv_blocks_free": load.kv_blocks_free,
            "kv_blocks_reserved": load.kv_blocks_reserved, "active_sequences": load.active_sequences,
            "queued_prefill_tokens": load.queued_prefill_tokens, "block_size": load.block_size,
        },
    })
}

pub fn table(workers: &[v1::WorkerInfo]) -> String {
    let mut rows = vec![["ID", "NAME", "ROLE", "STATE", "ADDR", "INFLIGHT", "PREFILL_TOK", "KV_FREE/TOTAL", "ACTIVE", "HEARTBEAT"].map(String::from).to_vec()];
    for w in workers {
        let load = w.load.unwrap_or_default();
        rows.push(vec![
            w.worker_id.clone(),
            w.name.clone(),
            role(w),
            state(w),
            w.grpc_addr.clone(),
            w.inflight.to_string(),
            (w.outstanding_prefill_tokens + load.queued_prefill_tokens).to_string(),
            format!("{}/{}", load.kv_blocks_free, load.kv_blocks_total),
            load.active_sequences.to_string(),
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
