//! `ferry bench serve --workload multiturn`: conversations against a router, the traffic prefix
//! caching is for. Each user's turn repeats the previous prompt and the answer the server
//! streamed, then adds a new message ([`crate::multiturn`]); turns of one user are sent one
//! after another with a think time between, users start at Poisson arrivals of each `--rates`
//! value. Per rate it reports TTFT percentiles by turn, prompt tokens sent and served from a
//! cache (the router's `cached_tokens`), the share an unbounded cache would have served (the
//! oracle), and KV bytes shipped per turn.

use crate::bench_serve::{stream, ServeBenchArgs};
use crate::loadgen::{self, LenDist, Sample};
use crate::multiturn::{conversations, next_prompt, MultiturnSpec, PrefixOracle};
use ferry_proto::v1::{generate_request, TokenInput};
use serde_json::json;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One turn's outcome.
#[derive(Clone, Debug)]
struct TurnRecord {
    /// The conversation (its place in the workload) and the turn in it.
    conv: usize,
    turn: usize,
    sample: Sample,
    prompt_tokens: usize,
    cached_tokens: usize,
    oracle_tokens: usize,
    kv_bytes: u64,
    /// The answer's token ids.
    answer: Vec<u32>,
}

/// Run every conversation at one start rate; the records of every turn, and the wall time.
async fn run_rate(seed: u64, block_size: usize, client: &crate::remote::Client, spec: &MultiturnSpec, bar: &indicatif::ProgressBar) -> anyhow::Result<(Vec<TurnRecord>, f64)> {
    let mut u = loadgen::uniforms(seed);
    let (system, convs) = conversations(spec, &mut u);
    let system = Arc::new(system);
    let oracle = Arc::new(Mutex::new(PrefixOracle::new(block_size)));
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::new();
    for (conv_index, conv) in convs.into_iter().enumerate() {
        let (client, system, oracle, bar) = (client.clone(), system.clone(), oracle.clone(), bar.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(start + Duration::from_secs_f64(conv.start_s)).await;
            let mut history: Vec<u32> = Vec::new();
            let mut out = Vec::new();
            for (turn, t) in conv.turns.iter().enumerate() {
                tokio::time::sleep(Duration::from_secs_f64(t.think_s)).await;
                let prompt = next_prompt(&system, &history, &t.message);
                let oracle_tokens = oracle.lock().unwrap_or_else(|e| e.into_inner()).hit(&prompt);
                let s = stream(client.clone(), generate_request::Input::Tokens(TokenInput { ids: prompt.clone() }), t.max_tokens).await;
                bar.inc(1);
                let summary = s.summary.clone().unwrap_or_default();
                out.push(TurnRecord {
                    conv: conv_index,
                    turn: turn + 1,
                    sample: s.sample.clone(),
                    prompt_tokens: prompt.len(),
                    cached_tokens: summary.cached_tokens as usize,
                    oracle_tokens,
                    kv_bytes: summary.kv.map_or(0, |k| k.bytes),
                    answer: s.ids.clone(),
                });
                if !s.sample.ok {
                    // The conversation cannot go on without its answer.
                    break;
                }
                oracle.lock().unwrap_or_else(|e| e.into_inner()).record(&prompt, &s.ids);
                history = prompt.into_iter().chain(s.ids).collect();
            }
            out
        }));
    }
    let mut records = Vec::new();
    for t in tasks {
        records.extend(t.await?);
    }
    Ok((records, start.elapsed().as_secs_f64()))
}

/// A digest of every answer, in conversation and turn order: two runs of one workload (a cache
/// tier on and off, say) gave the same answers exactly when their digests agree.
fn answers_digest(records: &[TurnRecord]) -> String {
    use std::hash::{Hash, Hasher};
    let mut rs: Vec<&TurnRecord> = records.iter().collect();
    rs.sort_by_key(|r| (r.conv, r.turn));
    // SipHash with fixed keys: the same in every run of this build.
    let mut h = std::hash::DefaultHasher::new();
    for r in rs {
        (r.conv, r.turn, r.sample.ok, &r.answer).hash(&mut h);
    }
    format!("{:016x}", h.finish())
}

fn summary(rate: f64, spec: &MultiturnSpec, records: &[TurnRecord], wall: f64) -> serde_json::Value {
    let ok: Vec<&TurnRecord> = records.iter().filter(|r| r.sample.ok).collect();
    let pct = |v: &[f64]| json!({ "p50": loadgen::percentile(v, 50.0), "p90": loadgen::percentile(v, 90.0), "p99": loadgen::percentile(v, 99.0) });
    let turns: Vec<serde_json::Value> = (1..=spec.turns)
        .map(|turn| {
            let these: Vec<&&TurnRecord> = ok.iter().filter(|r| r.turn == turn).collect();
            let ttft: Vec<f64> = these.iter().map(|r| r.sample.ttft_ms).collect();
            let n = these.len().max(1) as f64;
            json!({
                "turn": turn,
                "completed": these.len(),
                "ttft_ms": pct(&ttft),
                "prompt_tokens_mean": these.iter().map(|r| r.prompt_tokens as f64).sum::<f64>() / n,
                "cached_tokens_mean": these.iter().map(|r| r.cached_tokens as f64).sum::<f64>() / n,
                "kv_bytes_mean": these.iter().map(|r| r.kv_bytes as f64).sum::<f64>() / n,
            })
        })
        .collect();
    let sum = |f: &dyn Fn(&TurnRecord) -> u64| ok.iter().map(|r| f(r)).sum::<u64>();
    let (prompt, cached, oracle) = (sum(&|r| r.prompt_tokens as u64), sum(&|r| r.cached_tokens as u64), sum(&|r| r.oracle_tokens as u64));
    let later: Vec<f64> = ok.iter().filter(|r| r.turn >= 2).map(|r| r.sample.ttft_ms).collect();
    let tpot: Vec<f64> = ok.iter().map(|r| r.sample.tpot_ms).collect();
    json!({
        "rate": rate,
        "requests": records.len(),
        "completed": ok.len(),
        "wall_s": wall,
        "turns": turns,
        "ttft_ms": pct(&ok.iter().map(|r| r.sample.ttft_ms).collect::<Vec<_>>()),
        "ttft_ms_turns_2_plus": pct(&later),
        "tpot_ms": pct(&tpot),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "prefill_tokens_computed": prompt - cached.min(prompt),
        "oracle_cached_tokens": oracle,
        "oracle_hit_rate": if prompt > 0 { oracle as f64 / prompt as f64 } else { 0.0 },
        "cached_share_of_oracle": if oracle > 0 { cached as f64 / oracle as f64 } else { 0.0 },
        "kv_bytes": sum(&|r| r.kv_bytes),
        "kv_bytes_per_turn": if ok.is_empty() { 0.0 } else { sum(&|r| r.kv_bytes) as f64 / ok.len() as f64 },
        "answers_digest": answers_digest(records),
    })
}

pub fn run(a: &ServeBenchArgs, client: crate::remote::Client, vocab: u32, rt: &tokio::runtime::Runtime) -> anyhow::Result<serde_json::Value> {
    let user_tokens = a.user_tokens.clone().unwrap_or_else(|| "20..60".into());
    let (think_ms, block_size) = (a.think_ms.unwrap_or(1000.0), a.block_size.unwrap_or(16));
    let spec = MultiturnSpec {
        users: a.users.unwrap_or(8),
        turns: a.turns.unwrap_or(4),
        system_tokens: a.system_tokens.unwrap_or(300),
        user_tokens: LenDist::parse(&user_tokens).map_err(|e| anyhow::anyhow!("--user-tokens: {e}"))?,
        answer_tokens: LenDist::parse(&a.output_len).map_err(|e| anyhow::anyhow!("--output-len: {e}"))?,
        think_s: think_ms / 1e3,
        start_rate: 0.0,
        vocab,
    };
    anyhow::ensure!(spec.users >= 1 && spec.turns >= 1, "--users and --turns must be at least 1");
    anyhow::ensure!(think_ms.is_finite() && think_ms >= 0.0, "--think-ms must be a non-negative number");
    anyhow::ensure!(block_size >= 1, "--block-size must be at least 1");
    let bar = crate::bench_serve::progress((spec.users * spec.turns * a.rates.len()) as u64);
    let mut runs = Vec::new();
    for (rate_index, &rate) in a.rates.iter().enumerate() {
        bar.set_message(format!("{rate} conversations/s"));
        let spec = MultiturnSpec { start_rate: rate, ..spec.clone() };
        // Each rate its own conversations (system prompt included): the same ones again would be
        // served from the cache the earlier rate filled, beyond the oracle.
        let (records, wall) = rt.block_on(run_rate(loadgen::rate_seed(a.seed, rate_index), block_size, &client, &spec, &bar))?;
        runs.push(summary(rate, &spec, &records, wall));
    }
    bar.finish_and_clear();
    println!("{}: multi-turn, {} users x {} turns, system prompt {} tokens, messages {user_tokens} tokens, answers {} tokens, think {think_ms} ms", a.label, spec.users, spec.turns, spec.system_tokens, a.output_len);
    for r in &runs {
        let f = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
        println!(
            "rate {} conv/s: {}/{} turns completed in {:.1} s; prompt tokens {} (cached {}, oracle {} = {:.1}% of prompts; cached = {:.1}% of the oracle); KV shipped {:.0} KiB/turn; answers digest {}",
            r["rate"], r["completed"], r["requests"], f(&r["wall_s"]), r["prompt_tokens"], r["cached_tokens"], r["oracle_cached_tokens"],
            f(&r["oracle_hit_rate"]) * 100.0, f(&r["cached_share_of_oracle"]) * 100.0, f(&r["kv_bytes_per_turn"]) / 1024.0, r["answers_digest"].as_str().unwrap_or("")
        );
        println!("  {:>4} {:>9} {:>9} {:>9} {:>13} {:>13} {:>12}", "turn", "completed", "TTFT p50", "TTFT p99", "prompt tokens", "cached tokens", "KV KiB");
        for t in r["turns"].as_array().into_iter().flatten() {
            println!(
                "  {:>4} {:>9} {:>9.0} {:>9.0} {:>13.0} {:>13.0} {:>12.1}",
                t["turn"].as_u64().unwrap_or(0), t["completed"].as_u64().unwrap_or(0), f(&t["ttft_ms"]["p50"]), f(&t["ttft_ms"]["p99"]), f(&t["prompt_tokens_mean"]), f(&t["cached_tokens_mean"]), f(&t["kv_bytes_mean"]) / 1024.0
            );
        }
    }
    Ok(json!({
        "bench": "serve",
        "workload": { "kind": "multiturn", "users": spec.users, "turns": spec.turns, "system_tokens": spec.system_tokens, "user_tokens": user_tokens,
                      "answer_tokens": a.output_len, "think_ms": think_ms, "block_size": block_size, "seed": a.seed },
        "label": a.label,
        "router": a.router,
        "runs": runs,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(turn: usize, ttft: f64, prompt: usize, cached: usize, oracle: usize) -> TurnRecord {
        TurnRecord { conv: 0, turn, sample: Sample { ok: true, ttft_ms: ttft, tpot_ms: 10.0, e2e_ms: 100.0, output_tokens: 4 }, prompt_tokens: prompt, cached_tokens: cached, oracle_tokens: oracle, kv_bytes: 1000, answer: vec![turn as u32] }
    }

    #[test]
    fn the_summary_counts_cache_against_the_oracle_per_turn() {
        let spec = MultiturnSpec { users: 2, turns: 2, system_tokens: 8, user_tokens: LenDist::Fixed(4), answer_tokens: LenDist::Fixed(4), think_s: 0.0, start_rate: 1.0, vocab: 1000 };
        let mut failed = rec(2, 0.0, 30, 0, 0);
        failed.sample.ok = false;
        let rs = [rec(1, 100.0, 12, 0, 0), rec(1, 80.0, 12, 8, 8), rec(2, 20.0, 20, 16, 16), failed];
        let s = summary(1.0, &spec, &rs, 2.0);
        assert_eq!((s["requests"].as_u64(), s["completed"].as_u64()), (Some(4), Some(3)));
        assert_eq!((s["prompt_tokens"].as_u64(), s["cached_tokens"].as_u64(), s["prefill_tokens_computed"].as_u64()), (Some(44), Some(24), Some(20)));
        assert_eq!(s["cached_share_of_oracle"].as_f64(), Some(1.0));
        assert_eq!(s["turns"][0]["completed"].as_u64(), Some(2));
        assert_eq!(s["turns"][1]["completed"].as_u64(), Some(1));
        assert_eq!(s["ttft_ms_turns_2_plus"]["p50"].as_f64(), Some(20.0));
        assert_eq!(s["kv_bytes_per_turn"].as_f64(), Some(1000.0));
        // The digest follows the answers, not the order they finished in.
        let mut swapped = rs.clone();
        swapped.swap(0, 2);
        assert_eq!(answers_digest(&swapped), answers_digest(&rs));
        swapped[0].answer = vec![99];
        assert_ne!(answers_digest(&swapped), answers_digest(&rs));
    }
}
