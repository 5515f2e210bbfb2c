//! What a KV dtype costs and buys, every dtype measured side by side in one process on the same
//! weights:
//!
//! - `ferry bench kv-fidelity`: perplexity on a text (default: the GPL-2.0 text in
//!   `tests/fixtures/text`, which no test was tuned on), greedy continuations of windows of that
//!   text against f32's, and how far each type's log-probabilities of f32's tokens move.
//! - `ferry bench kv-decode`: decode step time of a batch at long contexts (the KV each step
//!   reads grows with the context and shrinks with the type), interleaved across the types, and
//!   how many sequences of a given length a fixed `--kv-memory` admits.

use crate::ModelArgs;
use anyhow::Context;
use ferry_core::kv_dtype::encode_row;
use ferry_core::logprobs::log_sum_exp;
use ferry_core::kv_payload::KvPayloadHeader;
use ferry_core::{KvDtype, SamplingParams};
use ferry_engine::bench::{median, memory_read_bandwidth};
use ferry_engine::{Engine, Logits, StepItem};
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct FidelityArgs {
    /// The model and engine flags (`--kv-dtype` is refused: every type of `--dtypes` is measured).
    #[command(flatten)]
    pub model: ModelArgs,
    /// The types to compare with f32 (f32 is always measured, as the reference).
    #[arg(long, default_value = "bf16,f16,int8", value_delimiter = ',', value_parser = crate::parse_kv_dtype)]
    pub dtypes: Vec<KvDtype>,
    /// A UTF-8 text for the perplexity and the prompts (default: the GPL-2.0 text in tests/fixtures/text).
    #[arg(long)]
    pub text: Option<std::path::PathBuf>,
    /// Most tokens of the text scored for the perplexity.
    #[arg(long, default_value_t = 2048)]
    pub score_tokens: usize,
    /// Greedy continuations compared with f32's.
    #[arg(long, default_value_t = 20)]
    pub prompts: usize,
    /// Tokens of text each prompt holds.
    #[arg(long, default_value_t = 48)]
    pub prompt_len: usize,
    /// Tokens each continuation generates.
    #[arg(long = "gen", default_value_t = 64)]
    pub gen_tokens: usize,
}

const DEFAULT_TEXT: &str = include_str!("../../../tests/fixtures/text/gpl-2.0.txt");

/// The log-probabilities `e` gives each token of `cont` after `prompt` (teacher-forced).
fn forced_logprobs(e: &mut Engine, prompt: &[u32], cont: &[u32]) -> anyhow::Result<Vec<f64>> {
    let vocab = e.config().vocab_size;
    let seq: Vec<u32> = prompt.iter().chain(cont).copied().collect();
    let lg = e.score(&seq)?;
    Ok((prompt.len() - 1..seq.len() - 1).map(|pos| {
            let row = &lg[pos * vocab..(pos + 1) * vocab];
            row[seq[pos + 1] as usize] as f64 - log_sum_exp(row)
        })
        .collect())
}

/// These benches measure every type of `--dtypes`: a `--kv-dtype` would be ignored, so it is refused.
fn no_kv_dtype(model: &ModelArgs, bench: &str) -> anyhow::Result<()> {
    match model.kv.kv_dtype {
        Some(d) => anyhow::bail!("`bench {bench}` measures each type of --dtypes; --kv-dtype {d} does not apply (name the types with --dtypes)"),
        None => Ok(()),
    }
}

fn load(model: &ModelArgs, dtype: KvDtype) -> anyhow::Result<Engine> {
    let mut m = model.clone();
    m.kv.kv_dtype = Some(dtype);
    // The activations the fidelity tools default to: exact, so only the KV type differs.
    m.load(crate::ActivationsArg::Exact)
}

pub fn fidelity(a: FidelityArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.prompts >= 1 && a.prompt_len >= 1 && a.gen_tokens >= 1 && a.score_tokens >= 2, "--prompts, --prompt-len, --gen and --score-tokens must be positive");
    no_kv_dtype(&a.model, "kv-fidelity")?;
    let text = match &a.text {
        Some(p) => std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        None => DEFAULT_TEXT.to_string(),
    };
    let mut dtypes = vec![KvDtype::F32];
    dtypes.extend(a.dtypes.iter().filter(|d| **d != KvDtype::F32));
    let mut engines = Vec::new();
    for &d in &dtypes {
        engines.push(load(&a.model, d)?);
    }
    let ids = engines[0].encode(&text)?;
    let scored = &ids[..ids.len().min(a.score_tokens).min(engines[0].config().max_position - 1)];
    anyhow::ensure!(ids.len() >= a.prompt_len + 1, "the text holds {} tokens, fewer than one prompt", ids.len());
    let vocab = engines[0].config().vocab_size;
    // Prompts: windows spread over the text.
    let stride = (ids.len() - a.prompt_len) / a.prompts.max(1);
    let prompts: Vec<&[u32]> = (0..a.prompts).map(|i| &ids[i * stride..i * stride + a.prompt_len]).collect();
    let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(a.gen_tokens) };
    eprintln!("kv-fidelity: {} tokens scored, {} prompts of {} tokens, {} generated each, types {:?}", scored.len(), a.prompts, a.prompt_len, a.gen_tokens, dtypes);
    // f32's continuations are the reference, with its log-probabilities of them.
    let (mut reference, mut reference_lp) = (Vec::new(), Vec::new());
    for p in &prompts {
        let want = engines[0].generate(p, &params, &mut |_| {})?.tokens;
        reference_lp.push(forced_logprobs(&mut engines[0], p, &want)?);
        reference.push(want);
    }
    let mut rows = Vec::new();
    let mut ppl_f32 = 0.0;
    for (d, e) in dtypes.iter().zip(engines.iter_mut()) {
        let t = Instant::now();
        let logits = e.score(scored)?;
        let ppl = crate::score::perplexity(&logits, scored, vocab);
        if *d == KvDtype::F32 {
            ppl_f32 = ppl;
        }
        let (mut identical, mut first_diff, mut max_dlp, mut sum_dlp, mut n_dlp) = (0, Vec::new(), 0f64, 0f64, 0usize);
        // f32 is the reference: its continuations were generated above, not again here.
        let against = if *d == KvDtype::F32 { 0 } else { prompts.len() };
        identical += prompts.len() - against;
        for ((p, want), want_lp) in prompts.iter().zip(&reference).zip(&reference_lp).take(against) {
            let got = e.generate(p, &params, &mut |_| {})?.tokens;
            if got == *want {
                identical += 1;
            } else {
                first_diff.push(got.iter().zip(want).take_while(|(a, b)| a == b).count());
            }
            for (lp, lp32) in forced_logprobs(e, p, want)?.iter().zip(want_lp) {
                let dl = (lp - lp32).abs();
                max_dlp = max_dlp.max(dl);
                sum_dlp += dl;
                n_dlp += 1;
            }
        }
        rows.push(serde_json::json!({
            "kv_dtype": d.name(),
            "perplexity": ppl,
            "perplexity_vs_f32": ppl / ppl_f32 - 1.0,
            "greedy_identical": identical,
            "greedy_prompts": prompts.len(),
            // A count out of 20 is a coarse rate: its 95% interval says how coarse.
            "greedy_identical_ci95": wilson95(identical, prompts.len()),
            "first_difference_at": first_diff,
            "max_abs_dlogprob": max_dlp,
            "mean_abs_dlogprob": sum_dlp / n_dlp.max(1) as f64,
            "seconds": t.elapsed().as_secs_f64(),
        }));
        eprintln!("kv-fidelity: {d} done");
    }
    let out = serde_json::json!({
        "bench": "kv-fidelity",
        "model": a.model.model,
        "backend": ferry_engine::backend::Backend::describe(engines[0].backend()),
        "scored_tokens": scored.len(),
        "prompt_len": a.prompt_len,
        "gen": a.gen_tokens,
        "dtypes": rows,
    });
    println!("{out}");
    Ok(())
}

/// The 95% Wilson score interval of a rate of `k` in `n` (sound at 0 and at n, unlike the normal
/// approximation).
fn wilson95(k: usize, n: usize) -> [f64; 2] {
    if n == 0 {
        return [0.0, 1.0];
    }
    let (k, n, z) = (k as f64, n as f64, 1.959_964);
    let p = k / n;
    let d = 1.0 + z * z / n;
    let centre = (p + z * z / (2.0 * n)) / d;
    let half = z * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt() / d;
    [(centre - half).max(0.0), (centre + half).min(1.0)]
}

#[derive(clap::Args, Debug)]
pub struct DecodeArgs {
    /// The model and engine flags (`--kv-dtype` is refused: every type of `--dtypes` is
    /// measured; `--kv-memory`, default 1 GiB, sizes the capacity figures).
    #[command(flatten)]
    pub model: ModelArgs,
    #[arg(long, default_value = "f32,bf16,int8", value_delimiter = ',', value_parser = crate::parse_kv_dtype)]
    pub dtypes: Vec<KvDtype>,
    /// Sequences decoding together.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens of KV each sequence holds.
    #[arg(long, default_value = "128,1024,2048,4096", value_delimiter = ',')]
    pub contexts: Vec<usize>,
    /// Decode steps per timing.
    #[arg(long, default_value_t = 8)]
    pub steps: usize,
    /// Timings per (type, context), interleaved across the types.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Capacity figures: sequences of this many tokens a `--kv-memory` cache holds.
    #[arg(long, default_value_t = 2048)]
    pub capacity_tokens: usize,
}

/// A payload of `tokens` tokens of made-up KV in `e`'s layout (attention's cost does not depend
/// on the values; made-up values spare the prefill of batch x context tokens per type).
fn made_up_payload(e: &Engine, tokens: usize) -> Vec<u8> {
    let layout = e.kv_layout();
    let header = KvPayloadHeader { layout, tokens };
    let mut out = header.encode().to_vec();
    let (rb, hd) = (layout.row_bytes(), layout.head_dim);
    let rows = header.body_bytes() / rb;
    out.resize(out.len() + rows * rb, 0);
    let mut x = vec![0f32; hd];
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    for row in out[ferry_core::kv_payload::HEADER_BYTES..].chunks_exact_mut(rb) {
        for v in x.iter_mut() {
            state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            *v = ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 4.0;
        }
        encode_row(layout.dtype, &x, row);
    }
    out
}

pub fn decode(a: DecodeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(a.batch >= 1 && a.steps >= 1 && a.rounds >= 1 && !a.contexts.is_empty() && a.contexts.iter().all(|&c| c >= 1), "--batch, --steps, --rounds and every context must be positive");
    no_kv_dtype(&a.model, "kv-decode")?;
    let max_ctx = *a.contexts.iter().max().expect("checked non-empty");
    let threads = match a.model.threads {
        0 => std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        n => n,
    };
    // Room for the batch at the longest context plus every step the rounds take.
    let room = a.batch * (max_ctx + a.steps * a.rounds + 32);
    let mut engines = Vec::new();
    for &d in &a.dtypes {
        let mut m = a.model.clone();
        m.kv.kv_dtype = Some(d);
        // The serving path's activations by default: the step a decode worker runs.
        engines.push(m.load_with(crate::ActivationsArg::Q8, |c| c.kv_tokens = Some(room))?);
    }
    anyhow::ensure!(max_ctx + a.steps * a.rounds < engines[0].config().max_position, "the longest context plus the steps exceeds the model's {} tokens", engines[0].config().max_position);
    let bw = memory_read_bandwidth(threads, 512 << 20, 5);
    let weights = engines[0].decode_weight_bytes();
    let mut points = Vec::new();
    for &ctx in &a.contexts {
        eprintln!("kv-decode: batch {} at context {ctx}", a.batch);
        let mut seqs = Vec::new();
        for e in engines.iter_mut() {
            let payload = made_up_payload(e, ctx);
            let s: Vec<_> = (0..a.batch).map(|_| e.import_kv(&payload)).collect::<Result<_, _>>()?;
            seqs.push(s);
        }
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); engines.len()];
        for _ in 0..a.rounds {
            for ((e, s), t) in engines.iter_mut().zip(&seqs).zip(times.iter_mut()) {
                let items: Vec<StepItem> = s.iter().map(|&seq| StepItem { seq, tokens: &[17], logits: Logits::Last }).collect();
                e.step(&items, &mut |_, _| {})?; // the caches and branch predictors of this type
                let start = Instant::now();
                for _ in 0..a.steps {
                    e.step(&items, &mut |_, _| {})?;
                }
                t.push(start.elapsed().as_secs_f64() / a.steps as f64);
            }
        }
        for ((e, s), t) in engines.iter_mut().zip(seqs).zip(times) {
            let layout = e.kv_layout();
            let kv_bytes = a.batch * (ctx + a.steps * a.rounds / 2) * layout.bytes_per_token();
            let step = median(t);
            points.push(serde_json::json!({
                "kv_dtype": layout.dtype.name(),
                "context": ctx,
                "step_ms": step * 1e3,
                "tpot_ms": step * 1e3,
                "tok_s": a.batch as f64 / step,
                "kv_bytes_per_step": kv_bytes,
                "weight_bytes_per_step": weights,
                "roofline_step_ms": (kv_bytes + weights) as f64 / bw * 1e3,
            }));
            for seq in s {
                e.release(seq)?;
            }
        }
    }
    // Capacity: what a fixed KV memory holds, per type (the engine's own block arithmetic).
    let kv_memory = a.model.kv.kv_memory.unwrap_or(1 << 30);
    let capacity: Vec<_> = engines
        .iter()
        .map(|e| {
            let l = e.kv_layout();
            let blocks = kv_memory / (l.bytes_per_token() * l.block_size);
            serde_json::json!({
                "kv_dtype": l.dtype.name(),
                "bytes_per_token": l.bytes_per_token(),
                "blocks": blocks,
                "sequences": blocks / a.capacity_tokens.div_ceil(l.block_size),
            })
        })
        .collect();
    let out = serde_json::json!({
        "bench": "kv-decode",
        "model": a.model.model,
        "backend": ferry_engine::backend::Backend::describe(engines[0].backend()),
        "threads": threads,
        "batch": a.batch,
        "steps": a.steps,
        "rounds": a.rounds,
        "memory_read_gb_s": bw / 1e9,
        "points": points,
        "kv_memory": kv_memory,
        "capacity_tokens": a.capacity_tokens,
        "capacity": capacity,
    });
    println!("{out}");
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn wilson_intervals_match_the_textbook() {
        // Reference values: Wilson (1927) score interval, z = 1.96, as tabulated by Newcombe
        // (1998, Statistics in Medicine 17:857, Table I: 81/263 -> 0.2553-0.3662; 15/148 ->
        // 0.0624-0.1605; 0/20 -> 0-0.1611; 1/29 -> 0.0061-0.1718).
        for (k, n, lo, hi) in [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)] {
            let [l, h] = super::wilson95(k, n);
            assert!((l - lo).abs() < 6e-5 && (h - hi).abs() < 6e-5, "{k}/{n}: {l:.4}-{h:.4}, want {lo}-{hi}");
        }
        assert_eq!(super::wilson95(5, 0), [0.0, 1.0]);
    }
}
