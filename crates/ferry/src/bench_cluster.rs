//! `ferry bench router` and `ferry bench disagg`: what the cluster adds on top of the engine.
//!
//! - `router`: the router's added latency per request, with zero-delay mock workers in process.
//! - `disagg`: TTFT through a real `ferry up` cluster (router, prefill and decode processes on
//!   loopback) against single-process prefill with the same threads, measured in the same run;
//!   with how long the KV transfer ran and how much of it outlasted the prefill computation
//!   (what layer-wise streaming did not hide). Every prompt is sent once, to the single process
//!   and to the cluster: a repeated prompt would be served from the prefix cache (the single
//!   process's, or the decode worker's, which then computes nothing and receives no KV), and the
//!   figure would measure the cache. The output says how many prompt tokens a cache served.

use crate::ModelArgs;
use anyhow::Context;
use ferry_core::SamplingParams;
use ferry_engine::bench::median;
use ferry_proto::v1::ferry_client::FerryClient;
use ferry_proto::v1::{generate_request, generate_response, GenerateRequest, StopConditions, TokenInput};
use std::io::{BufRead, BufReader};
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct RouterBenchArgs {
    /// A model (for the router's tokenizer): GGUF, HF folder or `default`.
    #[arg(long, short = 'm', default_value = "default")]
    pub model: String,
    #[arg(long, default_value_t = 500)]
    pub requests: usize,
}

#[derive(clap::Args, Debug)]
pub struct DisaggBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// How the prefill worker sends KV.
    #[arg(long, value_enum, default_value_t = crate::worker_cmd::KvTransportArg::Tcp)]
    pub kv_transport: crate::worker_cmd::KvTransportArg,
}

pub fn router(a: RouterBenchArgs) -> anyhow::Result<()> {
    let path = ferry_engine::fetch::resolve_model(Some(&a.model))?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let s = rt.block_on(ferry_testkit::router_overhead(&path, a.requests))?;
    let out = serde_json::json!({
        "bench": "router",
        "requests": s.requests,
        "tokens_per_request": s.tokens_per_request,
        "added_latency_ms": { "p50": s.p50_ms, "p99": s.p99_ms, "mean": s.mean_ms, "max": s.max_ms },
    });
    println!("{out}");
    Ok(())
}

const TEXT: &str = "The history of the printing press begins with the first movable type, invented in China, and continues through Gutenberg's workshop in Mainz, where metal type, oil-based ink and a wooden screw press came together. ";

pub fn disagg(a: DisaggBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.prompt_len >= 1 && a.repeats >= 1, "--prompt-len and --repeats must be at least 1");
    let threads = if a.model.threads == 0 { 1 } else { a.model.threads };
    let path = ferry_engine::fetch::resolve_model(Some(&a.model.model))?;
    // Single process, same threads as one worker.
    // Both sides decode as the workers do by default (or as asked).
    let activations = a.model.activations_or(crate::ActivationsArg::Q8);
    let mut engine = ModelArgs { threads, model: path.to_string_lossy().into_owned(), ..a.model.clone() }.load(activations)?;
    let base = engine.encode(TEXT)?;
    // Prompt i starts i tokens into the text: from its first KV block on, no two share a prefix.
    // Prompt 0 is the warm-up.
    let prompts: Vec<Vec<u32>> = (0..=a.repeats).map(|i| base.iter().cycle().skip(i).take(a.prompt_len).copied().collect()).collect();
    let warm_up = &prompts[0][..16.min(a.prompt_len)];
    let one = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(1) };
    engine.generate(warm_up, &one, &mut |_| {})?;
    let mut single = Vec::new();
    for prompt in &prompts[1..] {
        single.push(engine.generate(prompt, &one, &mut |_| {})?.ttft.as_secs_f64() * 1e3);
    }
    drop(engine);

    // The cluster: one prefill and one decode worker, `threads` each.
    let transport = a.kv_transport.flag_value();
    let mut child = std::process::Command::new(std::env::current_exe()?)
        .args(["up", "--listen", "127.0.0.1:0", "--http", "127.0.0.1:0", "--threads", &threads.to_string(), "--kv-transport", &transport])
        .args(["--activations", activations.flag_value(), "--model"])
        .arg(&path)
        .args(a.model.kv.to_args())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("starting ferry up")?;
    let mut lines = BufReader::new(child.stdout.take().context("ferry up stdout")?).lines();
    let router = loop {
        let line = lines.next().context("ferry up exited before it was ready")??;
        if let Some(r) = line.split_whitespace().find_map(|f| f.strip_prefix("router=")) {
            break r.to_string();
        }
    };
    std::thread::spawn(move || for _ in lines {});
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let result = rt.block_on(async {
        let mut client = FerryClient::connect(format!("http://{router}")).await?;
        let req = |ids: &[u32]| GenerateRequest {
            input: Some(generate_request::Input::Tokens(TokenInput { ids: ids.to_vec() })),
            stop: Some(StopConditions { max_tokens: 1, ignore_eos: true, ..Default::default() }),
            ..Default::default()
        };
        let mut samples = Vec::new();
        for (i, prompt) in prompts.iter().enumerate() {
            let ids = if i == 0 { warm_up } else { &prompt[..] };
            let t = Instant::now();
            let mut s = client.generate(req(ids)).await?.into_inner();
            let mut ttft = None;
            while let Some(m) = s.message().await? {
                match m.event {
                    Some(generate_response::Event::Delta(_)) if ttft.is_none() => ttft = Some(t.elapsed().as_secs_f64() * 1e3),
                    Some(generate_response::Event::Final(f)) => {
                        if i > 0 {
                            let kv = f.kv.unwrap_or_default();
                            samples.push((ttft.unwrap_or(f.ttft_ms), kv.bytes, kv.duration_ms, kv.exposed_ms, f.cached_tokens));
                        }
                    }
                    _ => {}
                }
            }
        }
        anyhow::Ok(samples)
    });
    // SAFETY: kill(2) with the pid of the child started above; SIGTERM stops its workers too.
    unsafe {
        libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
    }
    let _ = child.wait();
    let samples = result?;
    let cluster = median(samples.iter().map(|s| s.0).collect());
    let single = median(single);
    let out = serde_json::json!({
        "bench": "disagg",
        "prompt_tokens": a.prompt_len,
        "threads_per_worker": threads,
        "kv_transport": transport,
        "kv_dtype": a.model.kv.kv_dtype_for(activations).name(),
        "ttft_single_process_ms": single,
        "ttft_cluster_ms": cluster,
        "ttft_ratio": cluster / single,
        "kv_bytes": samples.first().map(|s| s.1).unwrap_or(0),
        "kv_transfer_ms": median(samples.iter().map(|s| s.2).collect()),
        "kv_exposed_ms": median(samples.iter().map(|s| s.3).collect()),
        "cluster_cached_tokens": samples.iter().map(|s| u64::from(s.4)).sum::<u64>(),
    });
    println!("{out}");
    Ok(())
}
