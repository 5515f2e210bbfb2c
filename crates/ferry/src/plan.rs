//! `ferry plan`: how to spend a budget of workers, from a measured profile, a workload and SLOs.
//!
//! For each split of the budget (every `P:D` and all colocated) it simulates the workload through
//! Ferry's own routing and batching decisions ([`ferry_core::sim`]) with step times from the
//! profile's cost model, and prints the predicted TTFT/TPOT percentiles and SLO attainment at each
//! offered rate, the goodput (the highest rate meeting the SLOs for `--slo-target` of requests),
//! and the best split.

use anyhow::{bail, ensure, Context};
use crate::loadgen::{self, LenDist, Sample, Slo};
use ferry_core::profile::{CostModel, DiskTierCost, Profile, PROFILE_FORMAT};
use ferry_core::sim::{self, Calibration, Fleet, KvLink, SimRequest, Split, Summary};
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
pub struct PlanArgs {
    /// The profile `ferry profile` wrote on the machine the workers run on (with `--measured`,
    /// needed only for entries that name no profile of their own).
    #[arg(long)]
    pub profile: Option<PathBuf>,
    /// Workers to spend: every split of this many is tried.
    #[arg(long, default_value_t = 2)]
    pub workers: usize,
    /// Only these splits (`P:D` or `Nc` for N colocated, comma-separated) instead of every one.
    #[arg(long, value_delimiter = ',')]
    pub splits: Vec<String>,
    /// Offered request rates (requests/s) to predict at, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub rates: Vec<f64>,
    /// Requests per rate, as `ferry bench serve --requests` (the same seed gives the same requests).
    #[arg(long, default_value_t = 200)]
    pub requests: usize,
    /// Prompt length in tokens: `N` or `LO..HI` (uniform), as `bench serve`.
    #[arg(long, default_value = "64..1024")]
    pub prompt_len: String,
    /// Output length in tokens, as `bench serve`.
    #[arg(long, default_value = "64..256")]
    pub output_len: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// A trace instead of the synthetic workload: JSON lines of `{"at": seconds, "prompt":
    /// tokens, "output": tokens}`, or a Mooncake-format trace (`{"timestamp": ms, "input_length",
    /// "output_length", "hash_ids"}`, as `bench serve --trace` replays it; its prefix sharing is
    /// simulated too, and the cache hit rate printed beside the oracle). Its own rate is scaled to
    /// each `--rates` value (times stretched or compressed).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Mooncake --trace: prompt tokens per hash id, as `bench serve --trace-block-tokens`.
    #[arg(long, default_value_t = crate::trace_workload::MOONCAKE_BLOCK_TOKENS)]
    pub trace_block_tokens: usize,
    /// Mooncake --trace: at most this many output tokens per request, as `bench serve`.
    #[arg(long)]
    pub trace_max_output: Option<usize>,
    /// Mooncake --trace: only the trace's first N requests, as `bench serve --max-requests`.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Mooncake --trace: each simulated worker also keeps a disk tier of this many KV blocks (as a
    /// worker's `--kv-disk`): blocks its pool evicts go there, and a prefix found there is loaded
    /// instead of computed (at the profile's `disk_read_s_per_token`, when it has one). 0: none.
    #[arg(long, default_value_t = 0)]
    pub kv_disk_blocks: usize,
    #[command(flatten)]
    pub slo: crate::bench_serve::SloArgs,
    /// Colocated workers' chunked-prefill budget (as their `--chunked-prefill`); none: prefill first.
    #[arg(long)]
    pub chunked_prefill: Option<usize>,
    /// KV transfer bandwidth between workers, GB/s (`ferry bench kv` measures it; 2.6 is its
    /// TCP data path on loopback here).
    #[arg(long, default_value_t = 2.6)]
    pub kv_gbps: f64,
    /// Fixed cost of one KV transfer, ms.
    #[arg(long, default_value_t = 1.0)]
    pub kv_latency_ms: f64,
    /// Check the predictions against measurements: `SPLIT=FILE`, a split and the JSON that
    /// `ferry bench serve --out` wrote for a cluster of that split (repeat or comma-separate).
    /// Each measured rate is predicted with the workload, seed and SLOs recorded in the file, and
    /// the errors of goodput, p90 TTFT and p90 TPOT are printed (the target is within 15%).
    /// `SPLIT=FILE@PROFILE` predicts that file from its own profile (one measured just before
    /// it, on a machine whose speed drifts) instead of `--profile`.
    #[arg(long, value_delimiter = ',')]
    pub measured: Vec<String>,
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A split as written on the command line: `P:D` or `Nc`.
pub fn parse_split(s: &str) -> anyhow::Result<Split> {
    let t = s.trim();
    let num = |x: &str| x.trim().parse::<usize>().with_context(|| format!("split {s:?}: {x:?} is not a count of workers"));
    let split = if let Some((p, d)) = t.split_once(':') {
        Split::Disaggregated { prefill: num(p)?, decode: num(d)? }
    } else if let Some(n) = t.strip_suffix('c').or_else(|| t.strip_suffix('C')) {
        Split::Colocated { workers: num(n)? }
    } else {
        bail!("split {s:?}: write P:D (prefill:decode workers) or Nc (N colocated)");
    };
    let ok = match split {
        Split::Disaggregated { prefill, decode } => prefill >= 1 && decode >= 1,
        Split::Colocated { workers } => workers >= 1,
    };
    ensure!(ok, "split {s:?}: each pool needs at least one worker");
    Ok(split)
}

pub fn read_profile(path: &Path) -> anyhow::Result<Profile> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the profile {}", path.display()))?;
    let p: Profile = serde_json::from_str(&text).with_context(|| format!("{} is not a profile written by `ferry profile`", path.display()))?;
    ensure!(p.format == PROFILE_FORMAT, "{}: profile format {} (this ferry reads {PROFILE_FORMAT}); run `ferry profile` again", path.display(), p.format);
    Ok(p)
}

/// The workers of every split, as the profile measured them.
pub fn fleet(p: &Profile, chunked_prefill: Option<usize>, kv_gbps: f64, kv_latency_ms: f64) -> anyhow::Result<Fleet> {
    ensure!(kv_gbps > 0.0 && kv_latency_ms >= 0.0, "--kv-gbps must be positive and --kv-latency-ms not negative");
    let cost = CostModel::fit(p).map_err(anyhow::Error::msg)?;
    Ok(Fleet {
        cost,
        block_size: p.block_size,
        kv_blocks: p.kv_blocks,
        max_batch_tokens: p.max_batch_tokens,
        max_context: p.max_context,
        chunk_tokens: chunked_prefill,
        kv: KvLink { bytes_per_token: p.kv_bytes_per_token, bytes_per_s: kv_gbps * 1e9, latency_s: kv_latency_ms / 1e3 },
        calibration: Calibration::PROFILED,
    })
}

/// The profile at `path` and the simulated workers it makes.
fn fleet_of(path: &Path, a: &PlanArgs) -> anyhow::Result<(Profile, Fleet)> {
    let profile = read_profile(path)?;
    let f = fleet(&profile, a.chunked_prefill, a.kv_gbps, a.kv_latency_ms)?;
    Ok((profile, f))
}

/// A trace file: JSON lines of `{"at", "prompt", "output"}`, sorted here by arrival.
pub fn read_trace(path: &Path) -> anyhow::Result<Vec<SimRequest>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the trace {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let r: SimRequest = serde_json::from_str(line).with_context(|| format!("{}:{}: want {{\"at\": s, \"prompt\": n, \"output\": n}}", path.display(), i + 1))?;
        ensure!(r.at.is_finite() && r.at >= 0.0, "{}:{}: \"at\" must be seconds >= 0", path.display(), i + 1);
        ensure!(r.prompt >= 1 && r.output >= 1, "{}:{}: prompt and output must be at least 1 token", path.display(), i + 1);
        out.push(r);
    }
    ensure!(out.len() >= 2, "{}: a trace needs at least 2 requests", path.display());
    out.sort_by(|a, b| a.at.total_cmp(&b.at));
    Ok(out)
}

/// A Mooncake-format trace's requests as replayed (None when the file is in `plan`'s own format).
fn read_mooncake(path: &Path, a: &PlanArgs) -> anyhow::Result<Option<Vec<crate::trace_workload::TraceRequest>>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the trace {}", path.display()))?;
    if !text.lines().find(|l| !l.trim().is_empty()).is_some_and(crate::trace_workload::is_mooncake_line) {
        return Ok(None);
    }
    ensure!(a.trace_block_tokens >= 1, "--trace-block-tokens must be at least 1");
    let records = crate::trace_workload::parse(&text, &path.display().to_string())?;
    let replay = crate::trace_workload::Replay { block_tokens: a.trace_block_tokens, time_scale: 1.0, max_output: a.trace_max_output, max_requests: a.max_requests };
    Ok(Some(crate::trace_workload::requests(&records, &replay)))
}

/// The profile's disk tier cost ([`DiskTierCost`], from the same file; none in older profiles).
pub fn read_disk_cost(path: &Path) -> anyhow::Result<DiskTierCost> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the profile {}", path.display()))?;
    let c: DiskTierCost = serde_json::from_str(&text).with_context(|| format!("{}: disk_read_s_per_token", path.display()))?;
    ensure!(c.disk_read_s_per_token.is_none_or(|s| s.is_finite() && s >= 0.0), "{}: disk_read_s_per_token must be seconds >= 0", path.display());
    Ok(c)
}

/// The simulated workers' disk tier (`--kv-disk-blocks`, in the profile's KV blocks) and its cost.
#[derive(Clone, Copy, Debug, Default)]
pub struct DiskTier {
    pub blocks: usize,
    pub cost: DiskTierCost,
}

/// A Mooncake trace's prefix sharing: the oracle, and per split the hit rate of its prefill (or
/// colocated) workers' caches, each holding what the profile's KV blocks hold (and, with a disk
/// tier, what its disk holds behind them), requests taken in arrival order
/// ([`crate::trace_workload::CacheModel`]). The simulated latencies do not credit these hits:
/// every prompt is computed whole; with a disk tier and its cost, the seconds of reading the
/// disk hits are printed beside the seconds of computing them.
fn prefix_cache(fleet: &Fleet, splits: &[Split], reqs: &[crate::trace_workload::TraceRequest], block_tokens: usize, disk: DiskTier) -> serde_json::Value {
    use crate::trace_workload::{oracle, servable, CacheModel};
    let cache_block = fleet.block_size;
    let o = oracle(reqs, block_tokens, cache_block);
    let in_trace_blocks = |engine_blocks: usize| engine_blocks.saturating_mul(fleet.block_size) / block_tokens.max(1);
    let capacity = in_trace_blocks(fleet.kv_blocks).max(1);
    let disk_capacity = in_trace_blocks(disk.blocks);
    let mean_prompt = o.prompt_tokens / reqs.len().max(1);
    let compute_s_per_token = 1.0 / fleet.cost.prefill_rate(mean_prompt);
    let rate = |tokens: usize| tokens as f64 / o.prompt_tokens.max(1) as f64;
    let per_split: Vec<serde_json::Value> = splits
        .iter()
        .map(|&split| {
            let caches = match split {
                Split::Disaggregated { prefill, .. } => prefill,
                Split::Colocated { workers } => workers,
            };
            let mut model = CacheModel::with_disk(caches, capacity, disk_capacity, block_tokens);
            let (mut pool, mut on_disk) = (0, 0);
            for r in reqs {
                let s = model.serve_tiers(r);
                // What the engine serves is the run cut to whole blocks short of the last token;
                // the cut is counted off the disk's share first (an approximation where the
                // tiers interleave).
                let served = servable(s.total(), r.prompt_len, cache_block);
                pool += s.pool.min(served);
                on_disk += served - s.pool.min(served);
            }
            let mut v = serde_json::json!({
                "split": split.to_string(), "caches": caches, "hit_rate": rate(pool + on_disk),
                "pool_hit_rate": rate(pool), "disk_hit_rate": rate(on_disk),
            });
            if let Some(read) = disk.cost.disk_read_s_per_token {
                v["disk_read_s"] = serde_json::json!(on_disk as f64 * read);
                v["disk_compute_s"] = serde_json::json!(on_disk as f64 * compute_s_per_token);
            }
            v
        })
        .collect();
    serde_json::json!({
        "requests": reqs.len(), "block_tokens": block_tokens, "cache_block": cache_block, "capacity_blocks": capacity,
        "disk_capacity_blocks": disk_capacity, "disk_read_s_per_token": disk.cost.disk_read_s_per_token,
        "prompt_tokens": o.prompt_tokens, "oracle_hit_rate": o.hit_rate(), "oracle_servable_rate": o.servable_rate(), "splits": per_split,
    })
}

/// What to simulate at a given rate.
pub enum Workload {
    Random { requests: usize, prompt: LenDist, output: LenDist, seed: u64 },
    /// A trace and its own rate (requests over its span).
    Trace { requests: Vec<SimRequest>, rate: f64 },
}

impl Workload {
    pub fn at_rate(&self, rate: f64) -> Vec<SimRequest> {
        match self {
            Workload::Random { requests, prompt, output, seed } => loadgen::random_requests(*seed, 0, rate, *requests, *prompt, *output, 49_152)
                .into_iter()
                .map(|r| SimRequest { at: r.at, prompt: r.ids.len(), output: r.output })
                .collect(),
            Workload::Trace { requests, rate: own } => {
                let t0 = requests[0].at;
                requests.iter().map(|r| SimRequest { at: (r.at - t0) * own / rate, ..*r }).collect()
            }
        }
    }

    fn mean_prompt(&self) -> f64 {
        let reqs = self.at_rate(1.0);
        reqs.iter().map(|r| r.prompt as f64).sum::<f64>() / reqs.len().max(1) as f64
    }
}

/// One split's predictions.
#[derive(serde::Serialize)]
pub struct SplitPlan {
    pub split: Split,
    pub label: String,
    /// (offered rate, predicted summary) for each rate.
    pub at: Vec<(f64, Summary)>,
    /// Requests/s served within the SLOs for `slo_target` of requests.
    pub goodput: f64,
}

pub fn plan(fleet: &Fleet, splits: &[Split], workload: &Workload, rates: &[f64], slo: &Slo, target: f64) -> Vec<SplitPlan> {
    // The bisection's ceiling: every worker prefilling the mean prompt flat out, twice over.
    let mean = workload.mean_prompt().max(1.0);
    let per_worker = fleet.cost.prefill_rate(mean as usize) / mean;
    let bar = crate::bench_serve::progress_styled(splits.len() as u64, "{bar:40} {pos}/{len} splits  {elapsed}  {msg}");
    let out = splits
        .iter()
        .map(|&split| {
            bar.set_message(split.to_string());
            let at = rates.iter().map(|&r| (r, Summary::of(&sim::simulate(fleet, split, &workload.at_rate(r)), slo))).collect();
            let hi = 2.0 * per_worker * split.workers() as f64 + 1.0;
            let goodput = sim::goodput(fleet, split, &|r| workload.at_rate(r), slo, target, hi / 1e4, hi, 0.01);
            bar.inc(1);
            SplitPlan { split, label: split.to_string(), at, goodput }
        })
        .collect();
    bar.finish_and_clear();
    out
}

/// The best split: the highest goodput; ties go to the best attainment at the highest rate asked.
pub fn best(plans: &[SplitPlan]) -> Option<&SplitPlan> {
    let last_attainment = |p: &SplitPlan| p.at.last().map_or(0.0, |a| a.1.attainment);
    plans.iter().max_by(|a, b| a.goodput.total_cmp(&b.goodput).then(last_attainment(a).total_cmp(&last_attainment(b))))
}

pub fn run(a: PlanArgs) -> anyhow::Result<()> {
    if !a.measured.is_empty() {
        return validate(&a);
    }
    ensure!(a.workers >= 1, "--workers must be at least 1");
    ensure!(a.rates.iter().all(|r| r.is_finite() && *r > 0.0), "--rates must be positive request rates");
    ensure!(a.requests >= 2, "--requests must be at least 2");
    ensure!((0.0..=1.0).contains(&a.slo.slo_target), "--slo-target must be a fraction in 0..=1");
    let (profile, fleet) = fleet_of(a.profile.as_ref().context("--profile is needed: the profile `ferry profile` wrote for the workers")?, &a)?;
    let splits: Vec<Split> = if a.splits.is_empty() { Split::all(a.workers) } else { a.splits.iter().map(|s| parse_split(s)).collect::<anyhow::Result<_>>()? };
    let mut mooncake = None;
    let workload = match &a.trace {
        Some(path) => {
            let requests = match read_mooncake(path, &a)? {
                Some(reqs) => {
                    let sim = reqs.iter().map(|r| SimRequest { at: r.at, prompt: r.prompt_len, output: r.output }).collect();
                    mooncake = Some(reqs);
                    sim
                }
                None => read_trace(path)?,
            };
            ensure!(requests.len() >= 2, "{}: a trace needs at least 2 requests", path.display());
            let span = requests[requests.len() - 1].at - requests[0].at;
            ensure!(span > 0.0, "{}: every request arrives at the same time; a trace needs a span", path.display());
            Workload::Trace { rate: (requests.len() - 1) as f64 / span, requests }
        }
        None => Workload::Random {
            requests: a.requests,
            prompt: LenDist::parse(&a.prompt_len).map_err(anyhow::Error::msg).context("--prompt-len")?,
            output: LenDist::parse(&a.output_len).map_err(anyhow::Error::msg).context("--output-len")?,
            seed: a.seed,
        },
    };
    let slo = a.slo.slo();
    let t0 = std::time::Instant::now();
    let plans = plan(&fleet, &splits, &workload, &a.rates, &slo, a.slo.slo_target);
    let best = best(&plans).map(|p| p.label.clone());
    let disk = DiskTier { blocks: a.kv_disk_blocks, cost: read_disk_cost(a.profile.as_deref().context("--profile")?)? };
    let prefix = mooncake.as_ref().map(|reqs| prefix_cache(&fleet, &splits, reqs, a.trace_block_tokens, disk));
    if a.json {
        let v = serde_json::json!({
            "profile": a.profile, "model": profile.model, "machine": profile.machine,
            "cost_model": fleet.cost, "slo": {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms, "target": a.slo.slo_target},
            "splits": plans, "best": best, "seconds": t0.elapsed().as_secs_f64(), "prefix_cache": prefix,
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("profile: {} ({}, {} threads, measured {})", profile.model, profile.machine, profile.threads, profile.measured_at);
    println!(
        "cost model fit: prefill within {:.1}%, decode within {:.1}% of the profile's own points",
        fleet.cost.prefill_fit_error * 100.0,
        fleet.cost.decode_fit_error * 100.0
    );
    println!("SLO: TTFT <= {} ms, TPOT <= {} ms, for {:.0}% of requests\n", slo.ttft_ms, slo.tpot_ms, a.slo.slo_target * 100.0);
    println!("| split | rate (req/s) | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | SLO met | goodput (req/s) |");
    println!("|---|---|---|---|---|---|");
    for p in &plans {
        for (k, (rate, s)) in p.at.iter().enumerate() {
            let (label, goodput) = if k == 0 { (p.label.as_str(), format!("{:.2}", p.goodput)) } else { ("", String::new()) };
            let failed = if s.failed > 0 { format!(" ({} refused)", s.failed) } else { String::new() };
            println!(
                "| {label} | {rate} | {:.0} / {:.0} / {:.0} | {:.1} / {:.1} / {:.1} | {:.0}%{failed} | {goodput} |",
                s.ttft_p50_ms, s.ttft_p90_ms, s.ttft_p99_ms, s.tpot_p50_ms, s.tpot_p90_ms, s.tpot_p99_ms, s.attainment * 100.0
            );
        }
    }
    if let Some(b) = best {
        println!("\nbest split: {b}");
    }
    if let Some(p) = &prefix {
        let pct = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN) * 100.0;
        println!(
            "\nprefix cache ({} requests, {} tokens per hash id): the hash ids imply {:.1}% of prompt tokens (unbounded cache), {:.1}% in whole {}-token blocks",
            p["requests"], p["block_tokens"], pct(&p["oracle_hit_rate"]), pct(&p["oracle_servable_rate"]), p["cache_block"]
        );
        for s in p["splits"].as_array().into_iter().flatten() {
            let split = s["split"].as_str().unwrap_or("?");
            if disk.blocks == 0 {
                println!("  {split}: {} caches of {} blocks each: {:.1}% served from cache", s["caches"], p["capacity_blocks"], pct(&s["hit_rate"]));
                continue;
            }
            println!(
                "  {split}: {} caches of {} blocks each, {} on disk: {:.1}% served from the pool, {:.1}% from disk",
                s["caches"], p["capacity_blocks"], p["disk_capacity_blocks"], pct(&s["pool_hit_rate"]), pct(&s["disk_hit_rate"])
            );
            if let (Some(read), Some(compute)) = (s["disk_read_s"].as_f64(), s["disk_compute_s"].as_f64()) {
                println!("    the disk hits: {read:.2} s of reading in place of {compute:.2} s of computing");
            }
        }
    }
    eprintln!("({} splits simulated in {:.2} s)", plans.len(), t0.elapsed().as_secs_f64());
    Ok(())
}

/// The relative error of a prediction against a measurement (NaN when the measurement is 0 and
/// the prediction is not).
pub fn relative_error(predicted: f64, measured: f64) -> f64 {
    if measured == 0.0 {
        if predicted == 0.0 { 0.0 } else { f64::NAN }
    } else {
        (predicted - measured) / measured
    }
}

/// One validated cell: a split at a rate, predicted and measured.
#[derive(serde::Serialize)]
struct Cell {
    split: String,
    rate: f64,
    predicted: Summary,
    /// Goodput of the cell: requests/s served within the SLOs (attainment × rate).
    predicted_goodput: f64,
    measured_goodput: f64,
    measured_ttft_p90_ms: f64,
    measured_tpot_p90_ms: f64,
    measured_attainment: f64,
    error_goodput: f64,
    error_ttft_p90: f64,
    error_tpot_p90: f64,
    /// Per request (when the result has its requests): the median of measured / predicted TTFT
    /// and TPOT, which separates a cost that is off in every request from a few that queued.
    ttft_ratio_p50: Option<f64>,
    tpot_ratio_p50: Option<f64>,
    /// The step-time factors the cell was predicted with (1: the profile as measured).
    calibration: Calibration,
    #[serde(skip)]
    colocated: bool,
}

/// The step-time factors a `bench serve` run recorded (`step_time`: how long the workers' steps
/// took against their profile during that rate), for the roles it saw; None when it recorded none.
fn recorded_calibration(run: &serde_json::Value) -> Option<Calibration> {
    let m = run["step_time"].as_object().filter(|m| !m.is_empty())?;
    let of = |role: &str| m.get(role).and_then(|r| r["ratio"].as_f64()).filter(|r| r.is_finite() && *r > 0.0).unwrap_or(1.0);
    Some(Calibration { prefill: of("prefill"), decode: of("decode"), colocated: of("colocated") })
}

/// The median over `run`'s requests of measured / predicted TTFT and TPOT, pairing each recorded
/// request with the simulated one at its place; refused when the recorded requests are not the
/// simulated workload's (another seed or lengths). None when the result has no requests recorded.
fn per_request_ratios(run: &serde_json::Value, simulated: &[SimRequest], predicted: &[Sample], path: &Path) -> anyhow::Result<Option<(f64, f64)>> {
    let Some(recorded) = run["samples"].as_array() else { return Ok(None) };
    ensure!(recorded.len() == simulated.len(), "{}: {} requests recorded at rate {}, the workload has {}", path.display(), recorded.len(), run["rate"], simulated.len());
    let (mut ttft, mut tpot) = (Vec::new(), Vec::new());
    for (i, (m, (q, p))) in recorded.iter().zip(simulated.iter().zip(predicted)).enumerate() {
        if let Some(n) = m["prompt_tokens"].as_u64() {
            ensure!(n as usize == q.prompt, "{}: request {i} at rate {} had {n} prompt tokens, the workload's has {}: not this workload", path.display(), run["rate"], q.prompt);
        }
        if let (Some(t), true) = (m["ttft_ms"].as_f64(), p.ok && p.ttft_ms > 0.0) {
            ttft.push(t / p.ttft_ms);
        }
        if let (Some(t), true) = (m["tpot_ms"].as_f64(), p.ok && p.tpot_ms > 0.0) {
            tpot.push(t / p.tpot_ms);
        }
    }
    Ok(Some((loadgen::percentile(&ttft, 50.0), loadgen::percentile(&tpot, 50.0))))
}

fn validate(a: &PlanArgs) -> anyhow::Result<()> {
    let (cells, calibrated) = validated_cells(a)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&validation_report(&cells, &calibrated))?);
        return Ok(());
    }
    print_cells(&cells);
    if cells.iter().any(|c| c.ttft_ratio_p50.is_some()) {
        println!("\nPer request, measured / predicted (median):");
        for c in cells.iter().filter(|c| c.ttft_ratio_p50.is_some()) {
            println!("  {} at {}/s: TTFT {:.2}, TPOT {:.2}", c.split, c.rate, c.ttft_ratio_p50.unwrap_or(f64::NAN), c.tpot_ratio_p50.unwrap_or(f64::NAN));
        }
    }
    if !calibrated.is_empty() {
        println!("\nAt the step time the workers measured during each rate (their steps' time ÷ the profile's, per role):");
        print_cells(&calibrated);
    }
    Ok(())
}

/// `--measured`'s JSON report.
fn validation_report(cells: &[Cell], calibrated: &[Cell]) -> serde_json::Value {
    let report = |cells: &[Cell]| serde_json::json!({ "cells": cells, "within_15_percent": hits(cells), "of": cells.len() });
    let mut v = report(cells);
    if !calibrated.is_empty() {
        v["at_measured_step_time"] = report(calibrated);
    }
    v
}

/// Every `--measured` cell, predicted from the profile; and those whose run recorded the workers'
/// step time, predicted again at that speed.
fn validated_cells(a: &PlanArgs) -> anyhow::Result<(Vec<Cell>, Vec<Cell>)> {
    let default_fleet = a.profile.as_ref().map(|p| fleet_of(p, a)).transpose()?.map(|(_, f)| f);
    // Predicted from the profile; and, where the runs recorded the workers' step time, from the
    // profile scaled to the speed the devices ran at during each rate.
    let (mut cells, mut calibrated) = (Vec::new(), Vec::new());
    for m in &a.measured {
        let (split_s, path) = m.split_once('=').with_context(|| format!("--measured {m:?}: write SPLIT=FILE, e.g. 1:1=serve-disagg.json"))?;
        let split = parse_split(split_s)?;
        let (path, fleet) = match path.split_once('@') {
            Some((path, profile)) => (path, fleet_of(Path::new(profile), a)?.1),
            None => (path, default_fleet.with_context(|| format!("--measured {m:?} names no profile: give --profile, or write SPLIT=FILE@PROFILE"))?),
        };
        let path = Path::new(path);
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
        ensure!(v["bench"] == "serve", "{}: not a `ferry bench serve --out` result", path.display());
        let w = &v["workload"];
        ensure!(w["dataset"].is_null(), "{}: a dataset workload; only the random workload is simulated", path.display());
        let field = |x: &serde_json::Value, what: &str| x.as_f64().with_context(|| format!("{}: no number at {what}", path.display()));
        let workload = Workload::Random {
            requests: w["requests_per_rate"].as_u64().unwrap_or(50) as usize,
            prompt: LenDist::parse(w["prompt_len"].as_str().unwrap_or("64..1024")).map_err(anyhow::Error::msg)?,
            output: LenDist::parse(w["output_len"].as_str().unwrap_or("64..256")).map_err(anyhow::Error::msg)?,
            seed: w["seed"].as_u64().unwrap_or(0),
        };
        let slo = Slo { ttft_ms: field(&v["slo"]["ttft_ms"], "slo.ttft_ms")?, tpot_ms: field(&v["slo"]["tpot_ms"], "slo.tpot_ms")? };
        let runs = v["runs"].as_array().with_context(|| format!("{}: no runs", path.display()))?;
        for run in runs {
            let rate = field(&run["rate"], "runs[].rate")?;
            let requests = workload.at_rate(rate);
            let measured_attainment = field(&run["slo_attainment"], "runs[].slo_attainment")?;
            let (mt, mp) = (field(&run["ttft_ms"]["p90"], "runs[].ttft_ms.p90")?, field(&run["tpot_ms"]["p90"], "runs[].tpot_ms.p90")?);
            let cell = |fleet: &Fleet| -> anyhow::Result<Cell> {
                let samples = sim::simulate(fleet, split, &requests);
                let ratios = per_request_ratios(run, &requests, &samples, path)?;
                let predicted = Summary::of(&samples, &slo);
                let (pg, mg) = (predicted.attainment * rate, measured_attainment * rate);
                Ok(Cell {
                    split: split.to_string(),
                    rate,
                    predicted_goodput: pg,
                    measured_goodput: mg,
                    measured_ttft_p90_ms: mt,
                    measured_tpot_p90_ms: mp,
                    measured_attainment,
                    error_goodput: relative_error(pg, mg),
                    error_ttft_p90: relative_error(predicted.ttft_p90_ms, mt),
                    error_tpot_p90: relative_error(predicted.tpot_p90_ms, mp),
                    predicted,
                    ttft_ratio_p50: ratios.map(|r| r.0),
                    tpot_ratio_p50: ratios.map(|r| r.1),
                    calibration: fleet.calibration,
                    colocated: matches!(split, Split::Colocated { .. }),
                })
            };
            cells.push(cell(&fleet)?);
            if let Some(calibration) = recorded_calibration(run) {
                calibrated.push(cell(&Fleet { calibration, ..fleet })?);
            }
        }
    }
    Ok((cells, calibrated))
}

fn within(e: f64) -> bool {
    e.abs() <= 0.15
}

/// Cells within 15% on goodput, p90 TTFT and p90 TPOT.
fn hits(cells: &[Cell]) -> usize {
    cells.iter().filter(|c| within(c.error_goodput) && within(c.error_ttft_p90) && within(c.error_tpot_p90)).count()
}

fn print_cells(cells: &[Cell]) {
    let calibrated = cells.iter().any(|c| !c.calibration.is_profiled());
    println!("| split | rate | goodput pred / meas (req/s) | err | TTFT p90 pred / meas (ms) | err | TPOT p90 pred / meas (ms) | err |{}", if calibrated { " step time ÷ profile |" } else { "" });
    println!("|---|---|---|---|---|---|---|---|{}", if calibrated { "---|" } else { "" });
    let pct = |e: f64| format!("{:+.0}%{}", e * 100.0, if within(e) { "" } else { " ✗" });
    for c in cells {
        let k = c.calibration;
        println!(
            "| {} | {} | {:.3} / {:.3} | {} | {:.0} / {:.0} | {} | {:.1} / {:.1} | {} |{}",
            c.split,
            c.rate,
            c.predicted_goodput,
            c.measured_goodput,
            pct(c.error_goodput),
            c.predicted.ttft_p90_ms,
            c.measured_ttft_p90_ms,
            pct(c.error_ttft_p90),
            c.predicted.tpot_p90_ms,
            c.measured_tpot_p90_ms,
            pct(c.error_tpot_p90),
            match (calibrated, c.colocated) {
                (false, _) => String::new(),
                (true, true) => format!(" {:.2} |", k.colocated),
                (true, false) => format!(" P {:.2}, D {:.2} |", k.prefill, k.decode),
            }
        );
    }
    println!("\n{} of {} cells within 15% on all three", hits(cells), cells.len());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_step_time_becomes_the_cell_s_calibration() {
        let run = serde_json::json!({ "step_time": { "prefill": { "ratio": 1.25, "profiled_s": 30.0 }, "decode": { "ratio": 0.8, "profiled_s": 40.0 } } });
        assert_eq!(recorded_calibration(&run), Some(Calibration { prefill: 1.25, decode: 0.8, colocated: 1.0 }));
        for none in [serde_json::json!({}), serde_json::json!({ "step_time": null }), serde_json::json!({ "step_time": {} })] {
            assert_eq!(recorded_calibration(&none), None, "{none}");
        }
    }

    #[test]
    fn splits_parse_or_say_why_not() {
        assert_eq!(parse_split("1:2").unwrap(), Split::Disaggregated { prefill: 1, decode: 2 });
        assert_eq!(parse_split(" 3c").unwrap(), Split::Colocated { workers: 3 });
        for (bad, says) in [("0:2", "at least one"), ("x:1", "not a count"), ("2", "P:D"), ("0c", "at least one")] {
            let e = parse_split(bad).unwrap_err();
            assert!(format!("{e:#}").contains(says), "{bad}: {e:#}");
        }
    }

    #[test]
    fn traces_are_read_sorted_and_bad_lines_named() {
        let dir = std::env::temp_dir().join(format!("ferry-plan-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let good = dir.join("good.jsonl");
        std::fs::write(&good, "{\"at\": 2.0, \"prompt\": 10, \"output\": 3}\n\n{\"at\": 0.5, \"prompt\": 20, \"output\": 4}\n").unwrap();
        let t = read_trace(&good).unwrap();
        assert_eq!(t.iter().map(|r| r.prompt).collect::<Vec<_>>(), vec![20, 10]);
        let w = Workload::Trace { rate: 1.0 / 1.5, requests: t };
        // Twice its own rate: the gap halves.
        let fast = w.at_rate(2.0 / 1.5);
        assert!((fast[1].at - 0.75).abs() < 1e-9, "{fast:?}");
        let bad = dir.join("bad.jsonl");
        std::fs::write(&bad, "{\"at\": 0, \"prompt\": 10, \"output\": 3}\n{\"at\": 1, \"prompt\": 0, \"output\": 3}\n").unwrap();
        assert!(format!("{:#}", read_trace(&bad).unwrap_err()).contains("bad.jsonl:2"));
        std::fs::write(&bad, "{\"at\": 0, \"prompt\": 10}\n").unwrap();
        assert!(format!("{:#}", read_trace(&bad).unwrap_err()).contains("bad.jsonl:1"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[cfg(test)]
mod trace_tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        plan: PlanArgs,
    }

    /// `plan --trace` on the bundled Mooncake-format trace: read as such (not as `plan`'s own
    /// format), simulated, and its prefix caches counted: one prefill worker's cache, which holds
    /// the whole trace, serves what the oracle says; two colocated workers' caches, less or as much.
    #[test]
    fn a_mooncake_trace_is_simulated_with_its_prefix_cache() {
        let dir = std::env::temp_dir().join(format!("ferry-plan-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let prefill: Vec<_> = [(1, 32), (1, 128), (2, 64), (4, 256)].iter().map(|&(p, n)| serde_json::json!({ "prompts": p, "prompt_tokens": n, "seconds": 0.001 * (p * n) as f64 })).collect();
        let decode: Vec<_> = [(1, 64), (2, 64), (4, 64), (1, 384), (2, 384), (4, 384)].iter().map(|&(b, c)| serde_json::json!({ "batch": b, "context": c, "seconds": 0.01 })).collect();
        let profile = serde_json::json!({
            "format": PROFILE_FORMAT, "model": "hand-worked", "fingerprint": "0", "machine": "none", "threads": 1,
            "measured_at": "2026-12-06T00:00:00Z", "block_size": 16, "kv_blocks": 4096, "max_batch_tokens": 2048,
            "max_context": 8192, "kv_bytes_per_token": 1024, "prefill": prefill, "decode": decode,
        });
        let p = dir.join("profile.json");
        std::fs::write(&p, profile.to_string()).unwrap();
        let trace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/traces/mooncake_small.jsonl");
        let a = Cli::parse_from(["plan", "--profile", p.to_str().unwrap(), "--trace", trace.to_str().unwrap(), "--trace-block-tokens", "16", "--trace-max-output", "8"]).plan;
        let reqs = read_mooncake(&trace, &a).unwrap().expect("a Mooncake trace");
        assert_eq!(reqs.len(), 32);
        assert!(reqs.iter().all(|r| r.output <= 8));
        assert!(format!("{:#}", read_trace(&trace).unwrap_err()).contains("mooncake_small.jsonl:1"), "plan's own format refuses it, naming the line");
        let (_, fleet) = fleet_of(&p, &a).unwrap();
        let splits = [Split::Disaggregated { prefill: 1, decode: 1 }, Split::Colocated { workers: 2 }];
        let v = prefix_cache(&fleet, &splits, &reqs, 16, DiskTier::default());
        let oracle = v["oracle_servable_rate"].as_f64().unwrap();
        assert!(oracle > 0.3, "{v}");
        assert_eq!(v["splits"][0]["hit_rate"].as_f64(), Some(oracle), "{v}");
        assert!(v["splits"][1]["hit_rate"].as_f64().unwrap() <= oracle, "{v}");
        assert_eq!(v["splits"][0]["disk_hit_rate"].as_f64(), Some(0.0), "no disk tier, no disk hits");
        // The profile has no disk cost (an older file): it still loads. Then a pool too small to
        // hold the trace, with and without a disk tier behind it: the disk serves what the pool
        // lost, and the hit rate comes back to the oracle's.
        assert_eq!(read_disk_cost(&p).unwrap(), DiskTierCost::default());
        let small = Fleet { kv_blocks: 4, ..fleet };
        let v = prefix_cache(&small, &splits[..1], &reqs, 16, DiskTier::default());
        let lost = v["splits"][0]["hit_rate"].as_f64().unwrap();
        assert!(lost < oracle, "{v}");
        let disk = DiskTier { blocks: 1 << 20, cost: DiskTierCost { disk_read_s_per_token: Some(1e-5) } };
        let v = prefix_cache(&small, &splits[..1], &reqs, 16, disk);
        let s = &v["splits"][0];
        assert_eq!(s["hit_rate"].as_f64(), Some(oracle), "{v}");
        let (pool, on_disk) = (s["pool_hit_rate"].as_f64().unwrap(), s["disk_hit_rate"].as_f64().unwrap());
        assert!(on_disk > 0.0 && (pool + on_disk - oracle).abs() < 1e-12, "{v}");
        assert!(s["disk_read_s"].as_f64().unwrap() < s["disk_compute_s"].as_f64().unwrap(), "{v}");
        let mut with_cost = profile.clone();
        with_cost["disk_read_s_per_token"] = serde_json::json!(2e-5);
        std::fs::write(&p, with_cost.to_string()).unwrap();
        assert_eq!(read_disk_cost(&p).unwrap().disk_read_s_per_token, Some(2e-5));
        assert!(read_profile(&p).is_ok(), "the profile itself ignores the field");
        // And the simulation runs on the trace's arrivals and lengths.
        let sim: Vec<SimRequest> = reqs.iter().map(|r| SimRequest { at: r.at, prompt: r.prompt_len, output: r.output }).collect();
        let w = Workload::Trace { rate: 1.0, requests: sim };
        let plans = plan(&fleet, &splits[..1], &w, &[1.0], &a.slo.slo(), 0.9);
        assert_eq!(plans[0].at[0].1.requests, 32);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[cfg(test)]
#[path = "plan_measured_tests.rs"]
mod measured_tests;
