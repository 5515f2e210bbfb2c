//! `ferry bench kv-disk`: what the KV disk tier costs traffic that has nothing to reuse. Two
//! engines of one model in one process, the same in all but the tier (both with the prefix cache,
//! which the tier needs): each round both generate from the same fresh random prompt (no prefix
//! in common with any other), in turn, the order swapped every round, so the machine's drift
//! falls on both alike and each round gives a paired ratio. With the tier on, every full block of
//! prompt and answer is copied out at seal time and written by the tier's thread; the request's
//! time is counted to the end of those writes (`flush`), which over-counts what serving pays (the
//! writes there overlap the next requests), and its time without them is reported beside it.
//! Use every core (`--threads 0`, the default) so the writer has to share them.
//!
//! Two more figures read the ratio: the tier's own work, timed where it is done (the engine
//! thread's copies and the writer's seconds), against the requests' time; and `--control`, the
//! same run with neither engine given the tier, which shows what two identical engines differ by
//! on this machine.

use crate::ModelArgs;
use anyhow::Context;
use ferry_core::SamplingParams;
use ferry_engine::bench::median;
use rand::{Rng, SeedableRng};
use serde_json::json;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct KvDiskBenchArgs {
    /// The model and engine flags (`--kv-disk DIR` names the tier's directory, which must not be in
    /// use; without it a fresh one under the system's temporary directory, removed after).
    #[command(flatten)]
    pub model: ModelArgs,
    /// Tokens in each prompt (random ids: nothing shared).
    #[arg(long, default_value_t = 512)]
    pub prompt_len: usize,
    /// Tokens generated per request (greedy, EOS ignored).
    #[arg(long = "gen", default_value_t = 32)]
    pub gen_tokens: usize,
    /// Rounds: one request with the tier and one without in each.
    #[arg(long, default_value_t = 20)]
    pub rounds: usize,
    #[arg(long, default_value_t = 385)]
    pub seed: u64,
    /// Neither engine gets the tier (an A/A run: the ratio two identical engines give here).
    #[arg(long)]
    pub control: bool,
}

/// What one configuration measured, round by round.
#[derive(Default)]
struct Side {
    /// Seconds from the request's start to its last token.
    generate: Vec<f64>,
    /// Seconds after that until the tier's writer had written its blocks (0 without a tier).
    flush: Vec<f64>,
}

impl Side {
    fn total(&self, i: usize) -> f64 {
        self.generate[i] + self.flush[i]
    }
}

pub fn run(a: KvDiskBenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.rounds >= 3, "--rounds must be at least 3");
    anyhow::ensure!(a.prompt_len >= 1 && a.gen_tokens >= 1, "--prompt-len and --gen must be positive");
    anyhow::ensure!(!a.model.no_prefix_cache, "the disk tier needs the prefix cache: drop --no-prefix-cache");
    let (dir, made) = match &a.model.kv.kv_disk {
        Some(d) => (d.clone(), false),
        None => (std::env::temp_dir().join(format!("ferry-bench-kv-disk-{}", std::process::id())), true),
    };
    let result = measure(&a, &dir);
    if made {
        let _ = std::fs::remove_dir_all(&dir);
    }
    result
}

fn measure(a: &KvDiskBenchArgs, dir: &std::path::Path) -> anyhow::Result<()> {
    let act = crate::ActivationsArg::Q8;
    let mut off_args = a.model.clone();
    off_args.kv.kv_disk = None;
    let mut on_args = a.model.clone();
    on_args.kv.kv_disk = (!a.control).then(|| dir.to_path_buf());
    let mut off = off_args.load(act).context("loading the engine without the tier")?;
    let mut on = on_args.load(act).context("loading the engine with the tier")?;
    let ctx = off.config().max_position;
    anyhow::ensure!(a.prompt_len + a.gen_tokens < ctx, "--prompt-len {} and --gen {} pass the model's context of {ctx}", a.prompt_len, a.gen_tokens);
    let vocab = off.config().vocab_size as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
    let mut prompt = || (0..a.prompt_len).map(|_| rng.random_range(0..vocab)).collect::<Vec<u32>>();
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(a.gen_tokens) };
    // Warm-up: weights paged in, the tier's files and threads started.
    for e in [&mut off, &mut on] {
        e.generate(&prompt(), &params, &mut |_| {})?;
    }
    if let Some(d) = on.kv_disk() {
        d.flush();
    }
    let (mut with, mut without) = (Side::default(), Side::default());
    let bar = crate::bench_serve::progress_styled(a.rounds as u64, "{bar:40} {pos}/{len} rounds  {elapsed}");
    for round in 0..a.rounds {
        let p = prompt();
        let one = |e: &mut ferry_engine::Engine, side: &mut Side| -> anyhow::Result<()> {
            let t0 = Instant::now();
            let g = e.generate(&p, &params, &mut |_| {})?;
            anyhow::ensure!(g.tokens.len() == a.gen_tokens, "a request generated {} tokens, {} asked", g.tokens.len(), a.gen_tokens);
            let t1 = Instant::now();
            if let Some(d) = e.kv_disk() {
                d.flush();
            }
            side.generate.push((t1 - t0).as_secs_f64());
            side.flush.push(t1.elapsed().as_secs_f64());
            Ok(())
        };
        if round % 2 == 0 {
            one(&mut on, &mut with)?;
            one(&mut off, &mut without)?;
        } else {
            one(&mut off, &mut without)?;
            one(&mut on, &mut with)?;
        }
        bar.inc(1);
    }
    bar.finish_and_clear();
    let stats = match (a.control, on.kv_disk()) {
        (true, _) => ferry_engine::kv_disk::DiskStats::default(),
        (false, Some(d)) => d.stats(),
        (false, None) => anyhow::bail!("the tier did not open"),
    };
    anyhow::ensure!(a.control || stats.written_blocks > 0, "the tier wrote no blocks: nothing was measured");
    let n = a.rounds;
    let tokens = (a.prompt_len + a.gen_tokens) as f64;
    let sum = |f: &dyn Fn(usize) -> f64| (0..n).map(f).sum::<f64>();
    // Throughput ratio (on / off) over the whole run, and round by round with a bootstrap 95%
    // interval of its mean.
    let paired: Vec<f64> = (0..n).map(|i| without.total(i) / with.total(i)).collect();
    let paired_no_flush: Vec<f64> = (0..n).map(|i| without.generate[i] / with.generate[i]).collect();
    let figures = |r: &[f64]| {
        let (lo, hi) = bootstrap_mean(r, a.seed);
        json!({ "mean": round4(mean(r)), "median": round4(median(r.to_vec())), "ci95": [round4(lo), round4(hi)] })
    };
    let out = json!({
        "bench": "kv-disk",
        "control": a.control,
        "model": a.model.model,
        "kv_dtype": on.kv_layout().dtype.to_string(),
        "prompt_len": a.prompt_len,
        "gen": a.gen_tokens,
        "rounds": n,
        "off": { "tokens_per_s": round4(tokens * n as f64 / sum(&|i| without.total(i))), "request_s_p50": round4(median(without.generate.clone())) },
        "on": {
            "tokens_per_s": round4(tokens * n as f64 / sum(&|i| with.total(i))),
            "request_s_p50": round4(median(with.generate.clone())),
            "flush_s_p50": round4(median(with.flush.clone())),
            // The tier's own work, timed where it runs, over the time of the requests it served
            // (the warm-up request's blocks counted too): what it can take from them at most.
            "copy_s": round4(stats.copy_seconds),
            "write_s": round4(stats.write_seconds),
            "work_fraction": round4((stats.copy_seconds + stats.write_seconds) / sum(&|i| with.total(i))),
            "written_blocks": stats.written_blocks,
            "written_mib": round4(stats.written_bytes as f64 / (1 << 20) as f64),
            "write_dropped": stats.write_dropped,
            "evicted": stats.evicted,
        },
        // Throughput with the tier over throughput without it, per round (1.0: no cost).
        "throughput_ratio_with_writes": figures(&paired),
        "throughput_ratio_without_waiting_for_writes": figures(&paired_no_flush),
    });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}

fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len().max(1) as f64
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

/// A percentile bootstrap 95% interval of the mean of `v` (4,000 resamples).
fn bootstrap_mean(v: &[f64], seed: u64) -> (f64, f64) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed ^ 0x9e37_79b9);
    let mut means: Vec<f64> = (0..4000).map(|_| (0..v.len()).map(|_| v[rng.random_range(0..v.len())]).sum::<f64>() / v.len() as f64).collect();
    means.sort_by(f64::total_cmp);
    (means[means.len() * 25 / 1000], means[means.len() * 975 / 1000])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bootstrap_interval_holds_the_mean_and_narrows_with_less_spread() {
        let tight: Vec<f64> = (0..20).map(|i| 1.0 + 0.001 * (i % 3) as f64).collect();
        let wide: Vec<f64> = (0..20).map(|i| 1.0 + 0.1 * (i % 3) as f64).collect();
        let (a, b) = bootstrap_mean(&tight, 1);
        let (c, d) = bootstrap_mean(&wide, 1);
        assert!(a <= mean(&tight) && mean(&tight) <= b);
        assert!(c <= mean(&wide) && mean(&wide) <= d);
        assert!(b - a < (d - c) / 10.0, "{a}..{b} against {c}..{d}");
    }
}
