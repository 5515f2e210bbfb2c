//! `ferry bench …`: benchmarks that print figures as JSON lines.

use crate::{ActivationsArg, ModelArgs};
use ferry_core::SamplingParams;
use ferry_engine::bench::{median, memory_read_bandwidth};
use std::time::Instant;

#[derive(clap::Subcommand, Debug)]
pub enum BenchCommand {
    /// Prefill and decode speed of the engine, with the memory roofline measured in the same run;
    /// on the CPU both activations paths (q8 and exact) in turn, unless `--activations` names one.
    Engine(EngineBenchArgs),
    /// KV transfer throughput between two processes (TCP data path and gRPC) vs raw loopback TCP.
    Kv(crate::bench_kv::KvBenchArgs),
    /// The router's added latency per request (mock workers in process).
    Router(crate::bench_cluster::RouterBenchArgs),
    /// TTFT through a `ferry up` cluster vs single-process prefill, with the KV transfer's cost.
    Disagg(crate::bench_cluster::DisaggBenchArgs),
    /// Open-loop load against a router: latency percentiles, throughput and goodput over a sweep of rates.
    Serve(crate::bench_serve::ServeBenchArgs),
    /// A soak under random kills and freezes of workers and routers: lost, hung, corrupted, leaked.
    Chaos(crate::bench_chaos::ChaosBenchArgs),
    /// What structured outputs cost a decode batch: TPOT free vs under a JSON schema's mask.
    Grammar(crate::bench_grammar::GrammarBenchArgs),
    /// Every KV dtype against f32 on one model: perplexity, greedy continuations, log-probabilities.
    KvFidelity(crate::bench_kv_dtype::FidelityArgs),
    /// Decode step time of a batch at long contexts per KV dtype (interleaved), and capacity at a fixed --kv-memory.
    KvDecode(crate::bench_kv_dtype::DecodeArgs),
    /// What verifying proposed tokens costs a decode step: step time at 1..r rows of one sequence (interleaved).
    SpecRows(crate::bench_spec::SpecRowsArgs),
    /// What the KV disk tier costs traffic with nothing to reuse: one engine with it and one without, interleaved.
    KvDisk(crate::bench_kv_disk::KvDiskBenchArgs),
    /// Draw `bench serve` results (JSON from --out) in one SVG: p99 TTFT and TPOT against the rate.
    Plot(PlotArgs),
    /// The receiving process of `bench kv` (started by it).
    #[command(hide = true)]
    KvSink(crate::bench_kv::KvSinkArgs),
}

#[derive(clap::Args, Debug)]
pub struct EngineBenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    /// Tokens to generate per decode run.
    #[arg(long = "gen", default_value_t = 128)]
    pub gen_tokens: usize,
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Also measure batched decode: this many sequences advancing one token each per step (the
    /// decode pool's steady state under load), reported as aggregate tokens/s.
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
}

#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// `bench serve` result files.
    #[arg(required = true)]
    pub results: Vec<std::path::PathBuf>,
    /// The SVG to write.
    #[arg(long)]
    pub out: std::path::PathBuf,
}

fn plot(a: PlotArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    let mut all = Vec::new();
    for p in &a.results {
        let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", p.display()))?;
        anyhow::ensure!(v["bench"] == "serve", "{}: not a `ferry bench serve` result", p.display());
        all.push(v);
    }
    // Multi-turn results are drawn by turn, the others against the rate.
    let multiturn = all.iter().filter(|v| v["workload"]["kind"] == "multiturn").count();
    anyhow::ensure!(multiturn == 0 || multiturn == all.len(), "multi-turn and other results cannot share a plot");
    let svg = if multiturn > 0 { crate::plot::ttft_by_turn(&all) } else { crate::plot::latency_vs_rate(&all) };
    std::fs::write(&a.out, svg).with_context(|| format!("writing {}", a.out.display()))?;
    Ok(())
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Engine(a) => engine(a),
        BenchCommand::Kv(a) => crate::bench_kv::run(a),
        BenchCommand::Serve(a) => crate::bench_serve::run(a),
        BenchCommand::Plot(a) => plot(a),
        BenchCommand::Grammar(a) => crate::bench_grammar::run(a),
        BenchCommand::Chaos(a) => crate::bench_chaos::run(a),
        BenchCommand::Router(a) => crate::bench_cluster::router(a),
        BenchCommand::Disagg(a) => crate::bench_cluster::disagg(a),
        BenchCommand::KvSink(a) => crate::bench_kv::sink(a),
        BenchCommand::KvFidelity(a) => crate::bench_kv_dtype::fidelity(a),
        BenchCommand::KvDecode(a) => crate::bench_kv_dtype::decode(a),
        BenchCommand::SpecRows(a) => crate::bench_spec::rows(a),
        BenchCommand::KvDisk(a) => crate::bench_kv_disk::run(a),
    }
}

const TEXT: &str = "The history of the printing press begins with the first movable type, invented in China, and continues through Gutenberg's workshop in Mainz, where metal type, oil-based ink and a wooden screw press came together. ";

/// One activations path of `bench engine`: its engine and what it measured.
struct Path {
    activations: ActivationsArg,
    engine: ferry_engine::Engine,
    prefill: Vec<f64>,
    decode: Vec<f64>,
    batch_decode: Vec<f64>,
}

/// The paths `bench engine` measures: the one asked for; else, on the CPU, both, the workers'
/// default (q8) first, as its figures keep the JSON's top-level fields; on a GPU, which has only
/// the exact one, that one.
fn paths(model: &ModelArgs) -> Vec<ActivationsArg> {
    match (model.activations_asked(), model.device) {
        (Some(a), _) => vec![a],
        (None, ferry_engine::Device::Cpu) => vec![ActivationsArg::Q8, ActivationsArg::Exact],
        (None, _) => vec![ActivationsArg::Exact],
    }
}

fn engine(a: EngineBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.prompt_len >= 1, "--prompt-len must be at least 1");
    anyhow::ensure!(a.gen_tokens >= 2, "--gen must be at least 2 (decode speed is measured after the first token)");
    anyhow::ensure!(a.repeats >= 1, "--repeats must be at least 1");
    let mut paths: Vec<Path> = paths(&a.model)
        .into_iter()
        .map(|act| {
            let engine = ModelArgs { activations: Some(act), q8_activations: false, ..a.model.clone() }.load(act)?;
            anyhow::Ok(Path { activations: act, engine, prefill: Vec::new(), decode: Vec::new(), batch_decode: Vec::new() })
        })
        .collect::<anyhow::Result<_>>()?;
    let threads = match a.model.threads {
        0 => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        n => n,
    };
    let base = paths[0].engine.encode(TEXT)?;
    anyhow::ensure!(!base.is_empty(), "benchmark text encodes to no tokens");
    let prompt: Vec<u32> = base.iter().cycle().take(a.prompt_len).copied().collect();
    let short = &prompt[..prompt.len().min(16)];
    // Warm-up: page in the weights.
    for p in &mut paths {
        p.engine.score(short)?;
    }
    // The paths take turns within each repeat, so a slow or fast spell of a shared machine
    // falls on both.
    let params = SamplingParams { max_tokens: a.gen_tokens, ignore_eos: true, ..SamplingParams::greedy(a.gen_tokens) };
    for _ in 0..a.repeats {
        for p in &mut paths {
            let seq = p.engine.new_sequence();
            let t = Instant::now();
            p.engine.prefill(seq, &prompt)?;
            p.prefill.push(prompt.len() as f64 / t.elapsed().as_secs_f64());
            p.engine.release(seq)?;
        }
        for p in &mut paths {
            let g = p.engine.generate(short, &params, &mut |_| {})?;
            p.decode.push((g.tokens.len() - 1) as f64 / g.decode_time.as_secs_f64());
        }
        if a.batch > 1 {
            for p in &mut paths {
                p.batch_decode.push(batched_decode(&mut p.engine, short, a.batch, a.gen_tokens)?);
            }
        }
    }
    // The limits, measured now: on a GPU its memory bandwidth (a device copy) and bf16 GEMM
    // throughput; on the CPU the memory read bandwidth of this many threads.
    let limits = device_limits(&paths[0].engine)?;
    let bw = match limits {
        Some((bw, _)) => bw,
        None => memory_read_bandwidth(threads, 512 << 20, 5),
    };
    let bytes = paths[0].engine.decode_weight_bytes();
    let roofline = bw / bytes as f64;
    let matmuls = prefill_matmuls(&paths[0].engine, a.prompt_len)?;
    let mut json = serde_json::json!({
        "bench": "engine",
        "model": a.model.model,
        "threads": threads,
        "prompt_len": a.prompt_len,
        "gen": a.gen_tokens,
        "repeats": a.repeats,
        "weight_bytes_per_decode_step": bytes,
        "memory_read_gb_s": (bw / 1e8).round() / 10.0,
        "decode_roofline_tok_s": (roofline * 10.0).round() / 10.0,
    });
    if let (Some(m), serde_json::Value::Object(top)) = (matmuls, &mut json) {
        top.insert("prefill_matmuls".into(), m);
    }
    // The first path's figures at the top level (the fields this benchmark always had), each
    // other path's under its name (`"exact": {…}`).
    for (i, p) in paths.into_iter().enumerate() {
        let name = p.activations.flag_value();
        let figures = figures(p, &a, roofline, limits.map(|(_, peak)| peak));
        match (i, &mut json) {
            (0, serde_json::Value::Object(top)) => top.extend(figures),
            (_, json) => json[name] = serde_json::Value::Object(figures),
        }
    }
    println!("{json}");
    Ok(())
}

/// One path's figures: its backend, prefill and decode tokens/s (medians), the decode roofline
/// fractions, and on a GPU the prefill's FLOP/s against the bf16 GEMM peak.
fn figures(p: Path, a: &EngineBenchArgs, roofline: f64, gemm_peak: Option<f64>) -> serde_json::Map<String, serde_json::Value> {
    let round = |x: f64, places: i32| (x * 10f64.powi(places)).round() / 10f64.powi(places);
    let decode = median(p.decode);
    let prefill = median(p.prefill);
    let mut out = serde_json::Map::new();
    out.insert("activations".into(), p.activations.flag_value().into());
    out.insert("backend".into(), ferry_engine::backend::Backend::describe(p.engine.backend()).into());
    out.insert("prefill_tok_s".into(), round(prefill, 1).into());
    out.insert("decode_tok_s".into(), round(decode, 1).into());
    out.insert("roofline_fraction".into(), round(decode / roofline, 3).into());
    if a.batch > 1 {
        let b = median(p.batch_decode);
        out.insert("batch".into(), a.batch.into());
        out.insert("batch_decode_tok_s".into(), round(b, 1).into());
        // Each step still streams every weight once: the roofline of `batch` tokens per step
        // (the KV reads, small at these contexts, left out).
        out.insert("batch_roofline_fraction".into(), round(b / (roofline * a.batch as f64), 3).into());
    }
    if let Some(peak) = gemm_peak {
        let achieved = prefill_flops(p.engine.config(), a.prompt_len) * prefill / a.prompt_len as f64;
        out.insert("prefill_tflop_s".into(), round(achieved / 1e12, 1).into());
        out.insert("bf16_gemm_peak_tflop_s".into(), round(peak / 1e12, 1).into());
        out.insert("prefill_peak_fraction".into(), round(achieved / peak, 3).into());
    }
    out
}

/// On a GPU: (memory bandwidth in bytes/s from a 4 GiB device copy, bf16 GEMM FLOP/s at
/// 8192³); None on the CPU.
fn device_limits(engine: &ferry_engine::Engine) -> anyhow::Result<Option<(f64, f64)>> {
    match engine.backend() {
        ferry_engine::DeviceBackend::Cpu(_) => Ok(None),
        #[cfg(feature = "cuda")]
        ferry_engine::DeviceBackend::Cuda(b) => Ok(Some((b.copy_bandwidth(4 << 30, 5)?, b.bf16_gemm_flops(8192, 10)?))),
    }
}

/// On a GPU: what cuBLAS reaches on the prefill's own matmul shapes (`tokens` rows against each
/// distinct weight shape of a layer), with the f32 output the backend writes and with a bf16
/// one, in TFLOP/s: whether the prefill's distance from the square GEMM peak is in the shapes, in
/// the output type, or elsewhere. `None` on the CPU.
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn prefill_matmuls(engine: &ferry_engine::Engine, tokens: usize) -> anyhow::Result<Option<serde_json::Value>> {
    match engine.backend() {
        ferry_engine::DeviceBackend::Cpu(_) => Ok(None),
        #[cfg(feature = "cuda")]
        ferry_engine::DeviceBackend::Cuda(b) => {
            let c = engine.config();
            let (hid, q, kv, ff) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
            let mut shapes = vec![("q", q, hid), ("k, v", kv, hid), ("o", hid, q), ("gate, up", ff, hid), ("down", hid, ff)];
            shapes.dedup_by_key(|s| (s.1, s.2));
            let mut out = Vec::new();
            for (name, n, k) in shapes {
                let f32_out = b.matmul_flops(tokens, n, k, false, 5)? / 1e12;
                let bf16_out = b.matmul_flops(tokens, n, k, true, 5)? / 1e12;
                out.push(serde_json::json!({ "weights": name, "m": tokens, "n": n, "k": k, "f32_out_tflop_s": (f32_out * 10.0).round() / 10.0, "bf16_out_tflop_s": (bf16_out * 10.0).round() / 10.0 }));
            }
            Ok(Some(out.into()))
        }
    }
}

/// Floating-point operations of one prefill of `tokens` tokens: every layer's matrices for each
/// token, causal attention (QKᵀ and PV over the tokens before each), and the output head for the
/// last token only (what `prefill` computes).
fn prefill_flops(c: &ferry_engine::ModelConfig, tokens: usize) -> f64 {
    let (hid, q, kv, ff) = (c.hidden_size as f64, c.q_dim() as f64, c.kv_dim() as f64, c.intermediate_size as f64);
    let per_token_layer = 2.0 * (hid * q + 2.0 * hid * kv + q * hid + 3.0 * hid * ff);
    let t = tokens as f64;
    let attention = 2.0 * 2.0 * q * t * (t + 1.0) / 2.0;
    c.n_layers as f64 * (per_token_layer * t + attention) + 2.0 * hid * c.vocab_size as f64
}

/// Aggregate decode tokens/s of `batch` sequences (each prefilled with `prompt`, a different
/// first token apiece so they diverge) stepping together, greedy, for `steps` steps.
fn batched_decode(engine: &mut ferry_engine::Engine<ferry_engine::DeviceBackend>, prompt: &[u32], batch: usize, steps: usize) -> anyhow::Result<f64> {
    use ferry_engine::sampler::argmax;
    use ferry_engine::{Logits, StepItem};
    let mut seqs = Vec::with_capacity(batch);
    let mut last = Vec::with_capacity(batch);
    for i in 0..batch {
        let seq = engine.new_sequence();
        let mut p = prompt.to_vec();
        p[0] = p[0].wrapping_add(i as u32) % engine.config().vocab_size as u32;
        last.push(argmax(&engine.prefill(seq, &p)?));
        seqs.push(seq);
    }
    let t = Instant::now();
    for _ in 0..steps {
        let toks: Vec<[u32; 1]> = last.iter().map(|&t| [t]).collect();
        let items: Vec<StepItem> = seqs.iter().zip(&toks).map(|(&seq, t)| StepItem { seq, tokens: t, logits: Logits::Last }).collect();
        let logits = engine.step(&items, &mut |_, _| {})?;
        for (l, out) in last.iter_mut().zip(&logits) {
            *l = argmax(out);
        }
    }
    let secs = t.elapsed().as_secs_f64();
    for seq in seqs {
        engine.release(seq)?;
    }
    Ok((batch * steps) as f64 / secs)
}
