//! `ferry bench spec-rows`: what verifying proposed tokens costs a decode step. `--batch` sequences
//! at a given context step with their last token alone (plain decode) and with it plus r - 1
//! proposed tokens each (r rows per sequence, all of whose logits are computed, as speculation
//! verifies them), rolled back after each step so the context stays put; the sizes are
//! interleaved round by round, so the machine's drift falls on all of them alike. Each size's
//! median step time, its ratio to one row, and the cost of one more row relative to a decode
//! step, `(t_r / t_1 - 1) / (r - 1)`: the `c` of speculation's choice of K (docs/architecture.md,
//! "Speculative decoding"). And the ceiling: `r · t_1 / t_r`, the output tokens/s a step of r rows
//! per sequence gives against plain decode of the same batch if every proposal were accepted. No
//! proposer can beat the largest of these at that batch, so it bounds what speculation can buy a
//! decode worker that is saturated at that batch.

use crate::ModelArgs;
use ferry_engine::bench::median;
use ferry_engine::{Logits, StepItem};
use serde_json::json;
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct SpecRowsArgs {
    /// The model and engine flags (the serving default: q8 activations).
    #[command(flatten)]
    pub model: ModelArgs,
    /// Rows per step to measure (1 is plain decode and always measured).
    #[arg(long, default_value = "2,3,4,6,8", value_delimiter = ',')]
    pub rows: Vec<usize>,
    /// Tokens of context each sequence holds.
    #[arg(long, default_value_t = 512)]
    pub context: usize,
    /// Sequences per step (each with its own context, all with the same rows).
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Rounds (each size steps once per round, in turn).
    #[arg(long, default_value_t = 60)]
    pub rounds: usize,
}

pub fn rows(a: SpecRowsArgs) -> anyhow::Result<()> {
    let mut sizes = vec![1];
    sizes.extend(a.rows.iter().copied().filter(|&r| r > 1));
    sizes.dedup();
    anyhow::ensure!(a.rounds >= 3 && a.context >= 1 && a.batch >= 1, "--rounds must be at least 3, --context and --batch positive");
    let mut e = a.model.load(crate::ActivationsArg::Q8)?;
    let max = *sizes.iter().max().unwrap_or(&1);
    anyhow::ensure!(a.context + max < e.config().max_position, "--context {} and {max} rows pass the model's context of {}", a.context, e.config().max_position);
    let vocab = e.config().vocab_size as u32;
    let mut seqs = Vec::with_capacity(a.batch);
    for b in 0..a.batch as u32 {
        // A prompt of its own per sequence (no prefix shared through the cache).
        let prompt: Vec<u32> = (0..a.context as u32).map(|i| (i * 7919 + 13 + b * 104_729) % vocab).collect();
        let seq = e.new_sequence();
        e.prefill(seq, &prompt)?;
        seqs.push(seq);
    }
    let held = e.seq_len(seqs[0])?;
    let tokens: Vec<u32> = (0..max as u32).map(|i| (i * 31 + 5) % vocab).collect();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); sizes.len()];
    let bar = crate::bench_serve::progress_styled(a.rounds as u64, "{bar:40} {pos}/{len} rounds  {elapsed}");
    for round in 0..a.rounds + 1 {
        for (i, &r) in sizes.iter().enumerate() {
            let logits = if r == 1 { Logits::Last } else { Logits::All };
            let items: Vec<StepItem> = seqs.iter().map(|&seq| StepItem { seq, tokens: &tokens[..r], logits }).collect();
            let t0 = Instant::now();
            e.step(&items, &mut |_, _| {})?;
            let dt = t0.elapsed().as_secs_f64();
            for &seq in &seqs {
                e.truncate(seq, held)?;
            }
            // Round 0 warms every size up.
            if round > 0 {
                times[i].push(dt);
            }
        }
        bar.inc(u64::from(round > 0));
    }
    bar.finish_and_clear();
    for seq in seqs {
        e.release(seq)?;
    }
    let one = median(times[0].clone());
    let results: Vec<_> = sizes
        .iter()
        .zip(&times)
        .map(|(&r, t)| {
            let ms = median(t.clone()) * 1e3;
            let ratio = ms / (one * 1e3);
            let per_row = if r > 1 { (ratio - 1.0) / (r - 1) as f64 } else { 0.0 };
            json!({ "rows": r, "step_ms_p50": ms, "vs_one_row": ratio, "cost_per_extra_row": per_row, "ceiling_vs_decode": r as f64 / ratio })
        })
        .collect();
    let ceiling = results.iter().map(|r| r["ceiling_vs_decode"].as_f64().unwrap_or(0.0)).fold(1.0, f64::max);
    let out = json!({ "bench": "spec-rows", "context": a.context, "batch": a.batch, "rounds": a.rounds, "results": results, "ceiling_vs_decode": ceiling });
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
