//! `ferry profile`: measure one worker's step costs on this machine and write them as a
//! [`Profile`] (JSON) for `ferry plan`, then print the cost model fitted to them
//! ([`CostModel::fit`]).
//!
//! Measured, one [`Engine::step`] at a time, with the engine configured as a worker started with
//! the same flags (model, `--threads`, `--activations`, `--kv-tokens`, `--max-batch-tokens`):
//! - prefill steps: `prompts` fresh sequences computing a whole prompt of `len` random tokens each
//!   (the last row's logits only, as a prefill worker asks), `--repeats` steps per pass after one
//!   warm-up;
//! - decode steps: `batch` sequences of `context` tokens, each advancing one token per step,
//!   `--steps` steps per pass. The sequences are forks of `batch` distinct prefilled ones, so
//!   each row attends its own KV in memory (forks of a single sequence would share their blocks
//!   and read the same memory, hiding what KV reads cost a real batch).
//!
//! The grid is walked `--passes` times and each point keeps the median of all its steps: a
//! shared machine has slow and fast spells of tens of seconds (decode steps measured a minute
//! apart on the 2-core development VM differed by up to 1.8×), and points measured in one spell
//! would carry it into every prediction.

use crate::ModelArgs;
use anyhow::Context;
use ferry_core::profile::{CostModel, DecodePoint, DiskTierCost, PROFILE_FORMAT, PrefillPoint, Profile};
use ferry_engine::bench::median;
use ferry_engine::{Engine, Logits, SeqId, StepItem};
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime};

/// The workers' default (`ferry decode|prefill|colocated`), so a profile taken without
/// `--activations` prices the steps the workers of a plan will run.
const DEFAULT_ACTIVATIONS: crate::ActivationsArg = crate::ActivationsArg::Q8;

#[derive(clap::Args, Debug)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// KV cache capacity in tokens, as the workers' `--kv-tokens` (default: 4 contexts, at most 2 GiB).
    #[arg(long)]
    pub kv_tokens: Option<usize>,
    /// Most tokens per forward step, as the workers' `--max-batch-tokens`.
    #[arg(long, default_value_t = 2048)]
    pub max_batch_tokens: usize,
    /// Prefill: prompt lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "16,32,64,128,256,512")]
    pub prompt_lens: Vec<usize>,
    /// Prefill: prompts per step (combinations over --max-batch-tokens tokens are skipped).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4")]
    pub prompts: Vec<usize>,
    /// Prefill: timed steps per point in each pass, after one warm-up.
    #[arg(long, default_value_t = 1)]
    pub repeats: usize,
    /// Decode: sequences per step (with exact activations 12 and 13 straddle the CPU matmul's
    /// switch from its row-dot to its GEMM path, and the fit follows that jump only from points on
    /// both sides; in q8 mode with every matrix interleaved the switch is at 64).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,12,13,16")]
    pub batches: Vec<usize>,
    /// Decode: tokens each sequence holds when the timed steps start.
    #[arg(long, value_delimiter = ',', default_value = "64,256,1024")]
    pub contexts: Vec<usize>,
    /// Decode: timed steps per point in each pass (each adds a token to every sequence).
    #[arg(long, default_value_t = 8)]
    pub steps: usize,
    /// Walks over the whole grid; each point keeps the median of its steps from every pass, so
    /// that a slow or fast spell of the machine does not decide it.
    #[arg(long, default_value_t = 3)]
    pub passes: usize,
    /// The profile to write (JSON; `ferry plan --profile` reads it).
    #[arg(long, default_value = "profile.json")]
    pub out: PathBuf,
}

/// What to measure: the flags' lists, checked, sorted and without repeats.
#[derive(Clone, Debug)]
pub struct Grid {
    prompt_lens: Vec<usize>,
    prompts: Vec<usize>,
    repeats: usize,
    batches: Vec<usize>,
    contexts: Vec<usize>,
    steps: usize,
    passes: usize,
}

/// A list flag's values, sorted and deduplicated; an empty list or a zero is refused.
fn list(flag: &str, values: &[usize]) -> anyhow::Result<Vec<usize>> {
    anyhow::ensure!(!values.is_empty(), "--{flag} is empty: give one or more positive numbers separated by commas");
    anyhow::ensure!(!values.contains(&0), "--{flag}: every value must be at least 1 (got {values:?})");
    let mut v = values.to_vec();
    v.sort_unstable();
    v.dedup();
    Ok(v)
}

impl Grid {
    pub fn new(a: &ProfileArgs) -> anyhow::Result<Grid> {
        anyhow::ensure!(a.repeats >= 1, "--repeats must be at least 1");
        anyhow::ensure!(a.steps >= 1, "--steps must be at least 1");
        anyhow::ensure!(a.passes >= 1, "--passes must be at least 1");
        anyhow::ensure!(a.max_batch_tokens >= 1, "--max-batch-tokens must be at least 1");
        anyhow::ensure!(a.kv_tokens != Some(0), "--kv-tokens must be at least 1");
        let grid = Grid {
            prompt_lens: list("prompt-lens", &a.prompt_lens)?,
            prompts: list("prompts", &a.prompts)?,
            repeats: a.repeats,
            batches: list("batches", &a.batches)?,
            contexts: list("contexts", &a.contexts)?,
            steps: a.steps,
            passes: a.passes,
        };
        // What `CostModel::fit` needs to determine three coefficients per phase, refused now
        // rather than after minutes of measuring: with one prompt length the attended pairs are
        // proportional to the tokens, with one batch or one context a decode step's context is
        // proportional to its rows or constant.
        let points = grid.prefill_points(a.max_batch_tokens);
        let mut lens: Vec<usize> = points.iter().map(|p| p.1).collect();
        lens.sort_unstable();
        lens.dedup();
        anyhow::ensure!(
            points.len() >= 3 && lens.len() >= 2,
            "--prompts × --prompt-lens give {} prefill points within --max-batch-tokens {}; the cost model needs 3 or more, of 2 or more prompt lengths",
            points.len(),
            a.max_batch_tokens
        );
        anyhow::ensure!(
            grid.batches.len() >= 2 && grid.contexts.len() >= 2,
            "the decode cost model needs 2 or more --batches and 2 or more --contexts (got {:?} and {:?})",
            grid.batches,
            grid.contexts
        );
        Ok(grid)
    }

    /// The prefill points `(prompts, len)` one step of `max_batch_tokens` can hold.
    pub fn prefill_points(&self, max_batch_tokens: usize) -> Vec<(usize, usize)> {
        let all = self.prompts.iter().flat_map(|&k| self.prompt_lens.iter().map(move |&n| (k, n)));
        all.filter(|&(k, n)| k * n <= max_batch_tokens).collect()
    }

    /// Whether `engine` can run every point: contexts, step budget, KV blocks.
    fn check(&self, engine: &Engine) -> anyhow::Result<()> {
        let (ctx, bs, total, mbt) = (engine.config().max_position, engine.kv_layout().block_size, engine.total_blocks(), engine.max_batch_tokens());
        if let Some(&n) = self.prompt_lens.iter().find(|&&n| n > ctx) {
            anyhow::bail!("--prompt-lens: {n} tokens is more than the model's context ({ctx})");
        }
        let points = self.prefill_points(mbt);
        let (widest, longest) = (self.widest(), self.contexts.iter().max().copied().unwrap_or(0));
        anyhow::ensure!(longest + self.steps <= ctx, "--contexts {longest} plus --steps {} is more than the model's context ({ctx})", self.steps);
        let prefill_blocks = points.iter().map(|&(k, n)| k * n.div_ceil(bs)).max().unwrap_or(0);
        // The prefilled sequences of every context, held through the passes, and a fork of each
        // of the longest: its copy of their last partial block and the blocks its steps fill.
        let held: usize = self.contexts.iter().map(|c| c.div_ceil(bs)).sum();
        let decode_blocks = widest * (held + (longest + self.steps).div_ceil(bs) - longest / bs);
        let need = prefill_blocks.max(decode_blocks);
        anyhow::ensure!(
            need <= total,
            "the grid needs {need} KV blocks of {bs} tokens; the engine has {total}: raise --kv-tokens, or lower --batches / --contexts / --prompts"
        );
        Ok(())
    }

    fn widest(&self) -> usize {
        self.batches.iter().max().copied().unwrap_or(0)
    }

    fn points(&self, max_batch_tokens: usize) -> usize {
        (self.prefill_points(max_batch_tokens).len() + self.batches.len() * self.contexts.len()) * self.passes
    }
}

/// Random token ids below the vocabulary's size, from a fixed seed (the same run, the same ids).
struct Tokens {
    uniform: Box<dyn FnMut() -> f64>,
    vocab: usize,
}

impl Tokens {
    fn new(vocab: usize) -> Tokens {
        Tokens { uniform: Box::new(ferry_core::arrivals::uniforms(0x5eed)), vocab }
    }
    fn draw(&mut self, n: usize) -> Vec<u32> {
        (0..n).map(|_| (((self.uniform)() * self.vocab as f64) as usize).min(self.vocab - 1) as u32).collect()
    }
}

/// Run `f` over `seqs`, then release them whether it succeeded or not.
fn releasing<T>(engine: &mut Engine, seqs: Vec<SeqId>, f: impl FnOnce(&mut Engine, &[SeqId]) -> anyhow::Result<T>) -> anyhow::Result<T> {
    let out = f(engine, &seqs);
    let mut released = Ok(());
    for s in seqs {
        if let Err(e) = engine.release(s) {
            released = released.and(Err(e));
        }
    }
    let out = out?;
    released?;
    Ok(out)
}

/// Seconds of one step of `prompts` fresh sequences each computing a whole prompt of `len` tokens.
fn prefill_step(engine: &mut Engine, tokens: &mut Tokens, prompts: usize, len: usize) -> anyhow::Result<f64> {
    let ids: Vec<Vec<u32>> = (0..prompts).map(|_| tokens.draw(len)).collect();
    let seqs = (0..prompts).map(|_| engine.new_sequence()).collect();
    releasing(engine, seqs, |engine, seqs| {
        let items: Vec<StepItem> = seqs.iter().zip(&ids).map(|(&seq, t)| StepItem { seq, tokens: t, logits: Logits::Last }).collect();
        let t = Instant::now();
        engine.step(&items, &mut |_, _| {})?;
        Ok(t.elapsed().as_secs_f64())
    })
}

/// Time `steps` decode steps of `seqs`, one token each, into `times`.
fn decode_steps(engine: &mut Engine, tokens: &mut Tokens, seqs: &[SeqId], steps: usize, times: &mut Vec<f64>) -> anyhow::Result<()> {
    for _ in 0..steps {
        let next = tokens.draw(seqs.len());
        let items: Vec<StepItem> = seqs.iter().zip(&next).map(|(&seq, t)| StepItem { seq, tokens: std::slice::from_ref(t), logits: Logits::Last }).collect();
        let t = Instant::now();
        engine.step(&items, &mut |_, _| {})?;
        times.push(t.elapsed().as_secs_f64());
    }
    Ok(())
}

/// Seconds kept to the nanosecond (what `Instant` resolves), so that the JSON reads back equal.
fn ns(s: f64) -> f64 {
    (s * 1e9).round() / 1e9
}

/// Measure every point of `grid` on `engine`, ticking `bar` once per point and pass.
pub fn measure(engine: &mut Engine, grid: &Grid, bar: &indicatif::ProgressBar) -> anyhow::Result<(Vec<PrefillPoint>, Vec<DecodePoint>)> {
    grid.check(engine)?;
    let mut tokens = Tokens::new(engine.config().vocab_size);
    let prefill_points = grid.prefill_points(engine.max_batch_tokens());
    let mut prefill_runs = vec![Vec::new(); prefill_points.len()];
    let widest = grid.widest();
    // `widest` sequences prefilled to each context, held through the passes.
    let bases = (0..widest * grid.contexts.len()).map(|_| engine.new_sequence()).collect();
    let decode_runs = releasing(engine, bases, |engine, bases| {
        for (c, &context) in grid.contexts.iter().enumerate() {
            bar.set_message(format!("decode: prefilling {widest} sequences to {context} tokens"));
            for &seq in &bases[c * widest..(c + 1) * widest] {
                engine.prefill(seq, &tokens.draw(context))?;
            }
        }
        let mut decode_runs = vec![Vec::new(); grid.contexts.len() * grid.batches.len()];
        for pass in 0..grid.passes {
            let of = |what: String| if grid.passes > 1 { format!("pass {}/{}: {what}", pass + 1, grid.passes) } else { what };
            for (i, &(prompts, len)) in prefill_points.iter().enumerate() {
                bar.set_message(of(format!("prefill: {prompts} × {len} tokens")));
                if pass == 0 {
                    prefill_step(engine, &mut tokens, prompts, len)?;
                }
                for _ in 0..grid.repeats {
                    prefill_runs[i].push(prefill_step(engine, &mut tokens, prompts, len)?);
                }
                bar.inc(1);
            }
            for (c, &context) in grid.contexts.iter().enumerate() {
                for (b, &batch) in grid.batches.iter().enumerate() {
                    bar.set_message(of(format!("decode: batch {batch}, context {context}")));
                    let mut forks = Vec::with_capacity(batch);
                    let forked = bases[c * widest..][..batch].iter().try_for_each(|&s| engine.fork(s).map(|f| forks.push(f)));
                    releasing(engine, forks, |engine, forks| {
                        forked?;
                        decode_steps(engine, &mut tokens, forks, grid.steps, &mut decode_runs[c * grid.batches.len() + b])
                    })?;
                    bar.inc(1);
                }
            }
        }
        Ok(decode_runs)
    })?;
    let prefill = prefill_points.iter().zip(prefill_runs).map(|(&(prompts, len), runs)| PrefillPoint { prompts, prompt_tokens: len, seconds: ns(median(runs)) }).collect();
    let points = grid.contexts.iter().flat_map(|&context| grid.batches.iter().map(move |&batch| (batch, context)));
    let decode = points.zip(decode_runs).map(|((batch, context), runs)| DecodePoint { batch, context, seconds: ns(median(runs)) }).collect();
    Ok((prefill, decode))
}

/// Compute threads of the engine (on a GPU, the host threads `--threads` asked for).
fn threads(engine: &Engine, requested: usize) -> usize {
    #[cfg(not(feature = "cuda"))]
    let _ = requested;
    match engine.backend() {
        ferry_engine::DeviceBackend::Cpu(b) => b.threads(),
        #[cfg(feature = "cuda")]
        ferry_engine::DeviceBackend::Cuda(_) => match requested {
            0 => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            n => n,
        },
    }
}

/// The CPU's model name and core count (best effort), and the backend.
fn machine(engine: &Engine) -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = info.lines().find_map(|l| l.strip_prefix("model name")?.split_once(':').map(|(_, v)| v.trim().to_owned()));
    let cores = match info.lines().filter(|l| l.starts_with("processor")).count() {
        0 => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        n => n,
    };
    format!("{}, {cores} cores; {}", cpu.unwrap_or_else(|| "unknown CPU".into()), ferry_engine::backend::Backend::describe(engine.backend()))
}

/// `t` as RFC 3339 in UTC, to the second (civil-from-days: H. Hinnant, "chrono-Compatible
/// Low-Level Date Algorithms").
fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let (days, s) = ((secs / 86_400) as i64, secs % 86_400);
    let z = days + 719_468;
    let (era, doe) = (z.div_euclid(146_097), z.rem_euclid(146_097));
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z", s / 3600, s % 3600 / 60, s % 60)
}

/// The profile of `engine` with its measured points.
pub fn profile(engine: &Engine, model: String, threads: usize, (prefill, decode): (Vec<PrefillPoint>, Vec<DecodePoint>)) -> Profile {
    let layout = engine.kv_layout();
    Profile {
        format: PROFILE_FORMAT,
        model,
        fingerprint: engine.fingerprint.clone(),
        machine: machine(engine),
        threads,
        measured_at: rfc3339(SystemTime::now()),
        block_size: layout.block_size,
        kv_blocks: engine.total_blocks(),
        max_batch_tokens: engine.max_batch_tokens(),
        max_context: engine.config().max_position,
        kv_bytes_per_token: layout.bytes_per_token(),
        kv_dtype: layout.dtype,
        prefill,
        decode,
    }
}

/// Checks that `--out` can be written (before minutes of measuring), then writes the profile
/// there whole: into a temporary sibling, renamed over it.
struct OutFile {
    path: PathBuf,
    tmp: PathBuf,
}

impl OutFile {
    fn probe(path: &Path) -> anyhow::Result<OutFile> {
        anyhow::ensure!(!path.is_dir(), "--out {} is a folder, not a file", path.display());
        let name = path.file_name().with_context(|| format!("--out {:?} names no file", path.display()))?;
        let tmp = path.with_file_name(format!("{}.part{}", name.to_string_lossy(), std::process::id()));
        std::fs::File::create(&tmp).with_context(|| format!("--out {}: cannot write there", path.display()))?;
        let _ = std::fs::remove_file(&tmp);
        Ok(OutFile { path: path.to_owned(), tmp })
    }

    fn write(&self, p: &Profile, disk: DiskTierCost) -> anyhow::Result<()> {
        // The disk tier's cost beside the profile's fields, as `ferry plan` reads it.
        let mut v = serde_json::to_value(p)?;
        if let (Some(o), serde_json::Value::Object(d)) = (v.as_object_mut(), serde_json::to_value(disk)?) {
            o.extend(d);
        }
        let json = serde_json::to_string_pretty(&v)? + "\n";
        let written = std::fs::write(&self.tmp, json).and_then(|()| std::fs::rename(&self.tmp, &self.path));
        if written.is_err() {
            let _ = std::fs::remove_file(&self.tmp);
        }
        written.with_context(|| format!("--out {}: cannot write the profile", self.path.display()))
    }
}

/// `s` seconds in a unit that suits it, three significant figures.
fn human(s: f64) -> String {
    let (v, unit) = match s.abs() {
        a if a >= 1.0 => (s, "s"),
        a if a >= 1e-3 => (s * 1e3, "ms"),
        a if a >= 1e-6 => (s * 1e6, "µs"),
        _ => (s * 1e9, "ns"),
    };
    let digits = match v.abs() {
        a if a >= 100.0 => 0,
        a if a >= 10.0 => 1,
        _ => 2,
    };
    format!("{v:.digits$} {unit}")
}

/// The human summary: both fits, with the point each misses most, and warnings past 10%.
fn summary(p: &Profile, m: &CostModel) -> String {
    let worst = |pts: Vec<(String, f64, f64)>| {
        pts.into_iter()
            .max_by(|a, b| ((a.2 - a.1) / a.1).abs().total_cmp(&((b.2 - b.1) / b.1).abs()))
            .map(|(what, t, fit)| format!("{what}: measured {}, fitted {}", human(t), human(fit)))
            .unwrap_or_default()
    };
    let pre = worst(
        p.prefill
            .iter()
            .map(|q| (format!("{} × {} tokens", q.prompts, q.prompt_tokens), q.seconds, m.step(0, 0, &vec![(0, q.prompt_tokens); q.prompts])))
            .collect(),
    );
    let dec =
        worst(p.decode.iter().map(|q| (format!("batch {}, context {}", q.batch, q.context), q.seconds, m.step(q.batch, q.batch * q.context, &[]))).collect());
    // A fit may come out with a negative coefficient: `a - b`, not `a + -b`.
    let plus = |s: f64| if s < 0.0 { format!("- {}", human(-s)) } else { format!("+ {}", human(s)) };
    let (a, b) = (m.prefill, m.decode);
    let mut out = format!(
        "prefill step = {} {}/token {}/attended pair; fit error {:.1}% (worst: {pre})\n\
         decode step  = {} {}/row {}/context token; fit error {:.1}% (worst: {dec})\n",
        human(a.a),
        plus(a.b),
        plus(a.c),
        m.prefill_fit_error * 100.0,
        human(b.a),
        plus(b.b),
        plus(b.c),
        m.decode_fit_error * 100.0,
    );
    for (phase, e) in [("prefill", m.prefill_fit_error), ("decode", m.decode_fit_error)] {
        if e > 0.10 {
            out +=
                &format!("warning: the {phase} cost model misses a measured step by {:.1}% (over 10%): plans priced with it are that uncertain\n", e * 100.0);
        }
    }
    out
}

/// Blocks `ferry profile` writes and reads back to price a disk hit.
const DISK_PROBE_BLOCKS: usize = 64;

/// What a disk hit costs on this machine ([`ferry_engine::kv_disk::measure_read_cost`]): in a
/// folder of `kv_disk` when given (the disk a worker would use), else of the temp dir.
fn disk_read_cost(engine: &Engine, kv_disk: Option<&Path>) -> anyhow::Result<DiskTierCost> {
    let base = kv_disk.map_or_else(std::env::temp_dir, Path::to_path_buf);
    let dir = base.join(format!("ferry-profile-disk-probe-{}", std::process::id()));
    let layout = engine.kv_layout();
    let identity = ferry_engine::kv_disk::Identity::new(&engine.fingerprint, &layout);
    let s = ferry_engine::kv_disk::measure_read_cost(&dir, &identity, layout.n_layers * layout.layer_bytes(layout.block_size), DISK_PROBE_BLOCKS)?;
    Ok(DiskTierCost { disk_read_s_per_token: Some(s) })
}

pub fn run(a: ProfileArgs) -> anyhow::Result<()> {
    let grid = Grid::new(&a)?;
    let out = OutFile::probe(&a.out)?;
    let start = Instant::now();
    let mut engine = a.model.load_with(DEFAULT_ACTIVATIONS, |c| {
        c.kv_tokens = a.kv_tokens;
        c.max_batch_tokens = a.max_batch_tokens;
        // The disk tier is measured apart, below (its own folder, nothing of the steps').
        c.kv_disk = None;
    })?;
    let name = ferry_tokenizer::served_name(&ferry_engine::fetch::resolve_model(Some(&a.model.model))?);
    let bar = crate::bench_serve::progress_styled(grid.points(engine.max_batch_tokens()) as u64, "{bar:30} {pos}/{len} points  {elapsed}  {wide_msg}");
    let points = measure(&mut engine, &grid, &bar);
    bar.finish_and_clear();
    let p = profile(&engine, name, threads(&engine, a.model.threads), points?);
    let disk = disk_read_cost(&engine, a.model.kv.kv_disk.as_deref())?;
    out.write(&p, disk)?;
    println!("ferry profile: a disk hit (--kv-disk) reads {} of KV per prompt token", human(disk.disk_read_s_per_token.unwrap_or(0.0)));
    println!(
        "ferry profile: {} ({}) on {}: {} prefill and {} decode points in {:.0} s, written to {}",
        p.model,
        p.fingerprint,
        p.machine,
        p.prefill.len(),
        p.decode.len(),
        start.elapsed().as_secs_f64(),
        a.out.display()
    );
    let model = CostModel::fit(&p).map_err(|e| anyhow::anyhow!("{e} (the profile is written to {})", a.out.display()))?;
    print!("{}", summary(&p, &model));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(clap::Parser)]
    struct Cli {
        #[command(flatten)]
        a: ProfileArgs,
    }

    fn args(flags: &[&str]) -> Result<ProfileArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("profile").chain(flags.iter().copied())).map(|c| c.a)
    }

    #[test]
    fn a_tiny_engine_is_profiled_and_fitted() {
        let grid = ["--prompt-lens", "8,16,32", "--prompts", "1,2", "--batches", "1,2,4", "--contexts", "8,16"];
        let rest = ["--model", "synthetic:tiny", "--threads", "1", "--repeats", "1", "--steps", "2", "--max-batch-tokens", "32"];
        let a = args(&[&grid[..], &rest[..]].concat()).unwrap();
        let grid = Grid::new(&a).unwrap();
        let mut engine = a.model.load_with(DEFAULT_ACTIVATIONS, |c| c.max_batch_tokens = a.max_batch_tokens).unwrap();
        let points = measure(&mut engine, &grid, &indicatif::ProgressBar::hidden()).unwrap();
        assert_eq!(engine.active_sequences(), 0, "every sequence released");
        let p = profile(&engine, "tiny".into(), threads(&engine, 1), points);
        // 2 × 32 tokens is over the step budget of 32.
        let measured: Vec<(usize, usize)> = p.prefill.iter().map(|q| (q.prompts, q.prompt_tokens)).collect();
        assert_eq!(measured, [(1, 8), (1, 16), (1, 32), (2, 8), (2, 16)]);
        assert_eq!(p.decode.len(), 6);
        assert!(p.prefill.iter().all(|q| q.seconds > 0.0) && p.decode.iter().all(|q| q.seconds > 0.0), "{p:?}");
        assert_eq!((p.threads, p.max_batch_tokens, p.max_context, p.block_size), (1, 32, 512, 16));
        // The profile prices the serving path: q8 activations, its KV dtype.
        assert_eq!(p.kv_dtype, crate::FAST_KV_DTYPE);
        assert_eq!(p.kv_bytes_per_token, 2 * 2 * 2 * crate::FAST_KV_DTYPE.row_bytes(16), "2 layers × K and V × 2 heads × a row of 16 values");
        let back: Profile = serde_json::from_str(&serde_json::to_string_pretty(&p).unwrap()).unwrap();
        assert_eq!(back, p);
        CostModel::fit(&p).unwrap();
    }

    #[test]
    fn bad_flags_are_refused_by_name() {
        let err = |flags: &[&str]| match args(flags) {
            Ok(a) => Grid::new(&a).err().map(|e| e.to_string()).unwrap_or_default(),
            Err(e) => e.to_string(),
        };
        assert!(err(&["--prompts", "1,0"]).contains("--prompts"));
        assert!(err(&["--batches", "1,x"]).contains("--batches"));
        assert!(err(&["--contexts", ""]).contains("--contexts"));
        assert!(err(&["--repeats", "0"]).contains("--repeats"));
        assert!(err(&["--steps", "0"]).contains("--steps"));
        assert!(err(&["--passes", "0"]).contains("--passes"));
        assert!(err(&["--prompt-lens", "16,-3"]).contains("--prompt-lens"));
        // Grids the cost model cannot be fitted to.
        assert!(err(&["--prompt-lens", "16"]).contains("--prompt-lens"));
        assert!(err(&["--prompt-lens", "16,32", "--prompts", "1"]).contains("--prompt-lens"));
        assert!(err(&["--prompt-lens", "16,32", "--prompts", "1,2", "--max-batch-tokens", "31"]).contains("--max-batch-tokens"));
        assert!(err(&["--contexts", "64"]).contains("--contexts"));
        assert!(err(&["--batches", "4"]).contains("--batches"));
        let a = args(&["--model", "synthetic:tiny", "--out", "/nonexistent-folder/profile.json"]).unwrap();
        assert!(run(a).unwrap_err().to_string().contains("--out"));
        let a = args(&["--model", "synthetic:tiny", "--out", "/tmp"]).unwrap();
        assert!(run(a).unwrap_err().to_string().contains("--out"));
    }

    #[test]
    fn grids_the_engine_cannot_run_are_refused() {
        let a = args(&["--model", "synthetic:tiny", "--threads", "1", "--kv-tokens", "64", "--batches", "4,8", "--contexts", "50,100"]).unwrap();
        let mut engine = a.model.load_with(DEFAULT_ACTIVATIONS, |c| c.kv_tokens = a.kv_tokens).unwrap();
        let e = measure(&mut engine, &Grid::new(&a).unwrap(), &indicatif::ProgressBar::hidden()).unwrap_err().to_string();
        assert!(e.contains("--kv-tokens"), "{e}");
        let a = args(&["--model", "synthetic:tiny", "--contexts", "64,510"]).unwrap();
        let e = measure(&mut engine, &Grid::new(&a).unwrap(), &indicatif::ProgressBar::hidden()).unwrap_err().to_string();
        assert!(e.contains("--contexts"), "{e}");
    }

    #[test]
    fn times_are_rfc3339_utc() {
        let at = |s: u64| rfc3339(SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(s));
        assert_eq!(at(0), "1970-01-01T00:00:00Z");
        assert_eq!(at(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(at(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(at(4_107_542_399), "2100-02-28T23:59:59Z");
    }
}
