//! `ferry bench serve --trace`: a Mooncake-format trace read and scaled as the options say, its
//! own rate, and its oracle beside what a run measured. The format, the prompts and the oracle
//! themselves are [`crate::trace_workload`]'s (pure); this is the part that reads files and
//! results.

use crate::bench_serve::ServeBenchArgs;
use crate::trace_workload;
use anyhow::Context;
use serde_json::json;

/// `--trace`'s requests, as replayed: the file read, lengths and times scaled, capped.
pub(crate) fn requests(a: &ServeBenchArgs, path: &std::path::Path) -> anyhow::Result<Vec<trace_workload::TraceRequest>> {
    anyhow::ensure!(a.trace_block_tokens >= 1, "--trace-block-tokens must be at least 1");
    anyhow::ensure!(a.trace_time_scale.is_finite() && a.trace_time_scale >= 0.0, "--trace-time-scale must be a number >= 0");
    let text = std::fs::read_to_string(path).with_context(|| format!("reading the trace {}", path.display()))?;
    let records = trace_workload::parse(&text, &path.display().to_string())?;
    let replay = trace_workload::Replay { block_tokens: a.trace_block_tokens, time_scale: a.trace_time_scale, max_output: a.trace_max_output, max_requests: a.requests };
    Ok(trace_workload::requests(&records, &replay))
}

/// A replayed trace's own rate: requests over the span of their arrivals (0 when they all
/// arrive at once).
pub(crate) fn rate(reqs: &[trace_workload::TraceRequest]) -> f64 {
    let span = reqs.last().map_or(0.0, |r| r.at);
    if span > 0.0 { (reqs.len() - 1) as f64 / span } else { 0.0 }
}

/// The oracle of a replayed trace beside what the run measured: over the requests that
/// completed (a failed request's prompt counts on neither side).
pub(crate) fn oracle(reqs: &[trace_workload::TraceRequest], block_tokens: usize, cache_block: usize, run: &serde_json::Value) -> serde_json::Value {
    let o = trace_workload::oracle(reqs, block_tokens, cache_block);
    let ok: Vec<bool> = run["samples"].as_array().map_or(Vec::new(), |v| v.iter().map(|s| s["ok"].as_bool().unwrap_or(false)).collect());
    let (mut prompt, mut hit, mut servable) = (0, 0, 0);
    for (i, r) in reqs.iter().enumerate().filter(|(i, _)| ok.get(*i).copied().unwrap_or(false)) {
        prompt += r.prompt_len;
        hit += o.hits[i];
        servable += o.servable[i];
    }
    let measured = run["cache_hit_rate"].as_f64().unwrap_or(0.0);
    let servable_rate = servable as f64 / prompt.max(1) as f64;
    json!({
        "hit_rate": hit as f64 / prompt.max(1) as f64,
        "servable_hit_rate": servable_rate,
        "cache_block": cache_block,
        "block_tokens": block_tokens,
        "measured_hit_rate": measured,
        "measured_over_servable": measured / servable_rate,
        "per_request_hits": o.hits,
    })
}


#[cfg(test)]
mod tests {
    use super::*;
    use trace_workload::TraceRequest;

    #[test]
    fn the_oracle_counts_only_the_requests_that_completed() {
        let req = |at, ids: &[u64]| TraceRequest { at, prompt_len: 48, output: 1, hash_ids: ids.to_vec() };
        let reqs = [req(0.0, &[1, 2, 3]), req(1.0, &[1, 2, 4]), req(2.0, &[1, 5, 6])];
        assert_eq!(rate(&reqs), 1.0);
        // All three completed: 32 + 16 of 144 prompt tokens; the run measured as much.
        let run = json!({ "cache_hit_rate": 48.0 / 144.0, "samples": [{ "ok": true }, { "ok": true }, { "ok": true }] });
        let v = oracle(&reqs, 16, 16, &run);
        assert!((v["hit_rate"].as_f64().unwrap() - 48.0 / 144.0).abs() < 1e-12, "{v}");
        assert!((v["measured_over_servable"].as_f64().unwrap() - 1.0).abs() < 1e-12, "{v}");
        // The second failed: its 32 hit tokens and 48 prompt tokens count on neither side.
        let run = json!({ "cache_hit_rate": 0.0, "samples": [{ "ok": true }, { "ok": false }, { "ok": true }] });
        assert!((oracle(&reqs, 16, 16, &run)["hit_rate"].as_f64().unwrap() - 16.0 / 96.0).abs() < 1e-12);
    }
}
