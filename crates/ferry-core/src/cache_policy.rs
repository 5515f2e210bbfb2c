//! What prefix caches change in the router's decisions, as pure functions over plain data.
//!
//! - [`rank_decode_with_prefix`]: a decode worker that holds a conversation's prefix goes first,
//!   while it has room: everything it holds is KV that need not move, but a worker that holds
//!   every conversation would take every turn, so the prefix wins only while the worker keeps a
//!   share of its blocks free and runs not many more sequences than the least busy one. Past
//!   that, load decides as without a cache ([`crate::routing::rank_decode`]).
//! - [`plan_turn`]: once a decode worker holding most of a prompt is picked, whether it computes
//!   the rest itself (no prefill worker, no KV moved) or a prefill worker computes the prompt and
//!   ships only the blocks the decode worker lacks. Short suffixes are cheaper locally: one step
//!   of a few tokens in the decode batch, against a round trip to a prefill worker that must
//!   recompute whatever it does not hold itself (the answers a decode worker generated have KV
//!   only there). But the decode worker's steps are shared: when prompts already queue there
//!   (several turns arriving at once) while a prefill worker would be done sooner, the turn goes
//!   remote. Conditional disaggregation, as Dynamo's disaggregated router and llm-d do it, with
//!   the interference DistServe (arXiv:2401.09670) disaggregates to avoid priced in: computing a
//!   suffix locally delays the new prompt's first token by its queue and its compute, and every
//!   sequence decoding there by the compute (they share the steps); sending it to a prefill
//!   worker delays that prompt alone, by the prefill worker's queue and work. The path that adds
//!   the least delay in all is taken ([`TurnTimes`]).

use crate::routing::{rank_decode, DecodeCandidate};

/// How much a held prefix counts against load.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefixWeights {
    /// A prefix holder goes first only while, after taking the request, at least this share of
    /// its blocks stays available.
    pub min_headroom: f64,
    /// ... and it runs at most this many sequences more than the least busy candidate.
    pub max_extra_sequences: u32,
}

impl Default for PrefixWeights {
    fn default() -> Self {
        PrefixWeights { min_headroom: 0.2, max_extra_sequences: 4 }
    }
}

/// Decode workers that can hold a sequence of `need_blocks`, best first, where `held[i]` is how
/// many of its leading blocks candidate `i` holds cached. Those blocks need no room (they are
/// attached, not allocated), so a holder needs only `need_blocks - held`. Holders with room go
/// first, most held first; the rest follow in [`rank_decode`]'s order.
pub fn rank_decode_with_prefix(candidates: &[DecodeCandidate], held: &[u32], need_blocks: u32, w: PrefixWeights) -> Vec<usize> {
    let held_of = |i: usize| held.get(i).copied().unwrap_or(0).min(need_blocks);
    // Feasible: room for what is not held.
    let feasible: Vec<usize> = (0..candidates.len())
        .filter(|&i| candidates[i].state == crate::WorkerState::Ready && candidates[i].available_blocks() >= need_blocks - held_of(i))
        .collect();
    let least_busy = feasible.iter().map(|&i| candidates[i].active()).min().unwrap_or(0);
    let roomy = |i: usize| {
        let c = &candidates[i];
        let after = c.available_blocks().saturating_sub(need_blocks - held_of(i)) as f64;
        after >= w.min_headroom * c.total_blocks as f64 && c.active() <= least_busy + w.max_extra_sequences
    };
    let mut first: Vec<usize> = feasible.iter().copied().filter(|&i| held_of(i) > 0 && roomy(i)).collect();
    first.sort_by(|&a, &b| held_of(b).cmp(&held_of(a)).then(candidates[a].active().cmp(&candidates[b].active())).then_with(|| candidates[a].id.cmp(&candidates[b].id)));
    // The rest in load order; a holder without room still needs only its unheld blocks.
    let by_load = rank_decode(candidates, 0);
    let rest: Vec<usize> = by_load.into_iter().filter(|i| feasible.contains(i) && !first.contains(i)).collect();
    first.extend(rest);
    first
}

/// What to do with a prompt once its decode worker is chosen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TurnPlan {
    /// The decode worker computes the last `compute` tokens itself; nothing moves.
    Local { compute: usize },
    /// A prefill worker computes the prompt from its own cached prefix (`prefill_from` tokens)
    /// and ships the KV from block `ship_from_block` on (what the decode worker lacks).
    Remote { prefill_from: usize, ship_from_block: usize },
}

/// What the plan is made from (token counts; held prefixes are whole blocks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TurnFacts {
    pub prompt_tokens: usize,
    /// Leading prompt tokens the chosen decode worker holds cached.
    pub decode_held: usize,
    /// Leading prompt tokens the chosen prefill worker holds cached.
    pub prefill_held: usize,
    pub block_size: usize,
}

/// What is known of how soon each path would finish the prompt (each part unknown until
/// measured; then the token counts alone decide).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct TurnTimes {
    /// The decode worker's measured prompt throughput in its own steps, beside the decodes it
    /// runs (tokens/s; 0: not measured yet).
    pub local_tokens_per_s: f64,
    /// Prompt tokens already waiting for the decode worker's steps (other turns computed there).
    pub local_queued: usize,
    /// Sequences decoding on the decode worker: each waits out a suffix computed in its steps.
    pub local_running: usize,
    /// The router's expected seconds for the best prefill worker to compute this prompt: its
    /// queue, and the prompt less the prefix it holds ([`crate::routing::PrefillCandidate::expected_seconds_for`]).
    pub remote_seconds: Option<f64>,
}

impl TurnTimes {
    /// Seconds until the decode worker would have computed `compute` more tokens.
    pub fn local_seconds(&self, compute: usize) -> Option<f64> {
        (self.local_tokens_per_s > 0.0).then(|| (self.local_queued + compute) as f64 / self.local_tokens_per_s)
    }

    /// The delay computing `compute` tokens here adds in all: the prompt's own wait, and the
    /// compute time again for each running sequence whose steps carry it.
    pub fn local_cost(&self, compute: usize) -> Option<f64> {
        let own = self.local_seconds(compute)?;
        Some(own + self.local_running as f64 * compute as f64 / self.local_tokens_per_s)
    }

    /// Both are known and the prefill worker adds less delay.
    fn remote_sooner(&self, compute: usize) -> bool {
        matches!((self.local_cost(compute), self.remote_seconds), (Some(local), Some(remote)) if remote < local)
    }
}

/// Local when at most `local_max` tokens are left to compute on the decode worker (and it holds
/// something: a cold prompt always goes to a prefill worker) and a prefill worker would not add
/// less delay ([`TurnTimes::local_cost`]); else remote.
pub fn plan_turn(f: TurnFacts, local_max: usize, times: TurnTimes) -> TurnPlan {
    let bs = f.block_size.max(1);
    // At least the last token is computed somewhere (its logits give the first new token).
    let usable = |held: usize| (held / bs * bs).min(f.prompt_tokens.saturating_sub(1) / bs * bs);
    let (decode_held, prefill_held) = (usable(f.decode_held), usable(f.prefill_held));
    let compute = f.prompt_tokens - decode_held;
    if decode_held > 0 && compute <= local_max && !times.remote_sooner(compute) {
        TurnPlan::Local { compute }
    } else {
        TurnPlan::Remote { prefill_from: prefill_held, ship_from_block: decode_held / bs }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::WorkerState::*;

    fn d(id: &str, free: u32, active: u32) -> DecodeCandidate {
        DecodeCandidate { id: id.into(), state: Ready, total_blocks: 100, free_blocks: free, reserved_blocks: 0, active_sequences: active, router_inflight: 0, router_promised_blocks: 0 }
    }

    #[test]
    fn rank_decode_with_prefix_table() {
        let w = PrefixWeights::default();
        let cases: Vec<(&str, Vec<DecodeCandidate>, Vec<u32>, u32, Vec<usize>)> = vec![
            ("nothing held: load order", vec![d("a", 50, 0), d("b", 80, 0)], vec![0, 0], 10, vec![1, 0]),
            ("no index yet (held empty): load order", vec![d("a", 50, 0), d("b", 80, 0)], vec![], 10, vec![1, 0]),
            ("holder first though fuller", vec![d("a", 50, 1), d("b", 90, 0)], vec![8, 0], 10, vec![0, 1]),
            ("most held first", vec![d("a", 60, 0), d("b", 60, 0), d("c", 90, 0)], vec![3, 8, 0], 10, vec![1, 0, 2]),
            // After taking it `a` would have 25 - 2 = 23 of 100 free (>= 20%): still first.
            ("headroom kept", vec![d("a", 25, 0), d("b", 90, 0)], vec![8, 0], 10, vec![0, 1]),
            // 15 - 2 = 13 < 20: the holder loses its precedence, load decides.
            ("holder too full", vec![d("a", 15, 0), d("b", 90, 0)], vec![8, 0], 10, vec![1, 0]),
            ("holder too busy", vec![d("a", 60, 9), d("b", 70, 2)], vec![8, 0], 10, vec![1, 0]),
            // Held blocks need no room: `a` has 4 free, needs 10 - 8 = 2.
            ("held blocks need no room", vec![d("a", 4, 0), d("b", 3, 0)], vec![8, 0], 10, vec![0]),
            ("not ready skipped", vec![DecodeCandidate { state: Draining, ..d("a", 90, 0) }, d("b", 50, 0)], vec![8, 0], 10, vec![1]),
            ("held beyond need capped", vec![d("a", 50, 0), d("b", 50, 0)], vec![30, 10], 10, vec![0, 1]),
        ];
        for (name, cands, held, need, want) in cases {
            assert_eq!(rank_decode_with_prefix(&cands, &held, need, w), want, "{name}");
        }
    }

    #[test]
    fn plan_turn_table() {
        let f = |prompt, decode_held, prefill_held| TurnFacts { prompt_tokens: prompt, decode_held, prefill_held, block_size: 16 };
        let cases = [
            ("cold prompt: remote, whole", f(300, 0, 0), TurnPlan::Remote { prefill_from: 0, ship_from_block: 0 }),
            ("short suffix: local", f(300, 256, 0), TurnPlan::Local { compute: 44 }),
            ("long suffix: remote, ship the rest", f(600, 256, 160), TurnPlan::Remote { prefill_from: 160, ship_from_block: 16 }),
            ("everything held: still compute the last block's tokens", f(320, 320, 0), TurnPlan::Local { compute: 16 }),
            ("held not block-aligned: whole blocks only", f(300, 250, 0), TurnPlan::Local { compute: 60 }),
            ("prefill holds more than decode", f(1000, 32, 900), TurnPlan::Remote { prefill_from: 896, ship_from_block: 2 }),
        ];
        for (name, facts, want) in cases {
            assert_eq!(plan_turn(facts, 128, TurnTimes::default()), want, "{name}");
        }
        assert_eq!(plan_turn(f(300, 256, 0), 0, TurnTimes::default()), TurnPlan::Remote { prefill_from: 0, ship_from_block: 16 }, "local off");
    }

    #[test]
    fn plan_turn_takes_the_path_that_adds_less_delay_once_both_are_known() {
        let facts = TurnFacts { prompt_tokens: 300, decode_held: 256, prefill_held: 0, block_size: 16 };
        let local = TurnPlan::Local { compute: 44 };
        let remote = TurnPlan::Remote { prefill_from: 0, ship_from_block: 16 };
        let t = |rate, queued, remote| TurnTimes { local_tokens_per_s: rate, local_queued: queued, local_running: 0, remote_seconds: remote };
        let cases = [
            ("nothing measured: the token counts decide", t(0.0, 500, Some(0.01)), local),
            ("no prefill worker estimate: local", t(100.0, 500, None), local),
            // (0 + 44) / 100 = 0.44 s here against 1 s there.
            ("idle decode worker, busy prefill worker: local", t(100.0, 0, Some(1.0)), local),
            // (200 + 44) / 100 = 2.44 s here against 1 s there.
            ("turns queued here, the prefill worker sooner: remote", t(100.0, 200, Some(1.0)), remote),
            ("a tie stays local (nothing moves)", t(100.0, 56, Some(1.0)), local),
        ];
        for (name, times, want) in cases {
            assert_eq!(plan_turn(facts, 128, times), want, "{name}");
        }
        // 44 tokens at 100/s: 0.44 s for the prompt, and 0.44 s for each of 3 running sequences
        // (1.76 s in all) against 1 s there: remote; with one running (0.88 s): local.
        let busy = |running| TurnTimes { local_running: running, ..t(100.0, 0, Some(1.0)) };
        assert_eq!(plan_turn(facts, 128, busy(3)), remote, "three decoding here would each wait out the suffix");
        assert_eq!(plan_turn(facts, 128, busy(1)), local, "one decoding here");
        // A suffix over the cap is remote however slow the prefill worker is.
        let long = TurnFacts { prompt_tokens: 600, ..facts };
        assert_eq!(plan_turn(long, 128, t(1000.0, 0, Some(60.0))), TurnPlan::Remote { prefill_from: 0, ship_from_block: 16 });
    }
}
