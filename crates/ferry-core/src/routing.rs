//! Routing policy for the disaggregated pools, as pure functions over plain data (no runtime):
//! which prefill worker runs a prompt, which decode workers may hold the sequence (and in what
//! order the router asks them), and when a worker's lease has run out.
//!
//! After sglang's router (`select_worker_pair`) and Dynamo's KV-aware router: prefill is balanced
//! on outstanding prompt tokens (prefill cost is linear in them), decode on free KV blocks (decode
//! admission is bounded by KV memory, not compute).

use std::time::Duration;

/// A worker's role in the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkerRole {
    Prefill,
    Decode,
    /// Prefill and decode on the same worker (the colocated baseline).
    Colocated,
}

impl WorkerRole {
    /// The prefix of worker ids the router assigns (`prefill-1`, `decode-2`).
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
            WorkerRole::Colocated => "colocated",
        }
    }
}

impl std::fmt::Display for WorkerRole {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A worker's state as the router sees it. Only `Ready` workers get new requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum WorkerState {
    Ready,
    /// An operator stopped new requests; in-flight ones finish.
    Draining,
    /// Lease expired or a call failed at the transport level.
    Dead,
}

impl WorkerState {
    pub const ALL: [WorkerState; 3] = [WorkerState::Ready, WorkerState::Draining, WorkerState::Dead];

    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Ready => "ready",
            WorkerState::Draining => "draining",
            WorkerState::Dead => "dead",
        }
    }
}

impl std::fmt::Display for WorkerState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the prefill policy needs to know about one worker.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillCandidate {
    pub id: String,
    pub state: WorkerState,
    /// Requests the router has in flight on it.
    pub inflight: u32,
    /// Prompt tokens the router has sent it and not yet seen finish prefill.
    pub outstanding_tokens: u64,
    /// Prompt tokens the worker reported queued (or in progress) at its last heartbeat, every
    /// router's, less those this router has seen finish there since (a report lags by up to a
    /// heartbeat; the prompt that just finished is still in it).
    pub reported_queue_tokens: u64,
    /// The worker's measured prefill throughput (tokens/s; 0 until it has run a step).
    pub tokens_per_s: f64,
    /// The worker's measured rate of loading prefix tokens from its disk tier (tokens/s; 0 when
    /// it has none or has not read yet: then [`DISK_TOKEN_COST`] prices a disk token).
    pub disk_read_tokens_per_s: f64,
}

/// What one prompt costs at one worker: tokens it must compute (the prompt less the prefix its
/// cache holds) and tokens it loads from its disk tier instead of computing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefillWork {
    pub compute: usize,
    pub disk: usize,
}

impl PrefillWork {
    /// A prompt computed whole (no cache, or nothing of it held).
    pub fn compute(tokens: usize) -> PrefillWork {
        PrefillWork { compute: tokens, disk: 0 }
    }
}

/// The cost of loading one token's KV from a worker's disk tier, as a fraction of computing it,
/// until the worker has measured its read rate (`disk_read_tokens_per_s` 0). On a CPU, SmolLM2
/// recomputes a token in ~1-3 ms while its ~46 KB of KV loads from the page cache in ~10 µs
/// (~0.005 of it); 0.1 leaves room for cold reads from the device, per-file overhead and GPUs,
/// which compute a token in microseconds. A disk hit then ranks between a pool hit (free) and a
/// recompute, and the worker's measured rate replaces the guess as soon as it has read.
pub const DISK_TOKEN_COST: f64 = 0.1;

impl PrefillCandidate {
    /// Prompt tokens ahead of a new request there: the worker's report holds this router's
    /// outstanding prompts as well as other routers', so the larger of the two (their sum would
    /// count this router's prompts twice, and steer a conversation's next turn away from the
    /// worker that holds its prefix).
    pub fn queued_tokens(&self) -> u64 {
        self.outstanding_tokens.max(self.reported_queue_tokens)
    }

    /// Expected seconds until a new prompt of `prompt_tokens` finishes prefill there: the queue
    /// ahead of it plus itself, at the worker's measured rate. None until the rate is known.
    pub fn expected_seconds(&self, prompt_tokens: usize) -> Option<f64> {
        self.expected_seconds_for(PrefillWork::compute(prompt_tokens))
    }

    /// [`Self::expected_seconds`] for a prompt whose cached prefix is partly on disk: the queue
    /// and the tokens to compute at the prefill rate, plus the disk tokens at the read rate
    /// (or at [`DISK_TOKEN_COST`] of the prefill rate until it is measured).
    pub fn expected_seconds_for(&self, work: PrefillWork) -> Option<f64> {
        (self.tokens_per_s > 0.0).then(|| {
            let compute = (self.queued_tokens() as f64 + work.compute as f64) / self.tokens_per_s;
            let read_rate = match self.disk_read_tokens_per_s > 0.0 {
                true => self.disk_read_tokens_per_s,
                false => self.tokens_per_s / DISK_TOKEN_COST,
            };
            compute + work.disk as f64 / read_rate
        })
    }

    /// Before the rates are known, the same cost in tokens: queued and computed tokens, plus
    /// each disk token at [`DISK_TOKEN_COST`] of one.
    fn expected_tokens(&self, work: PrefillWork) -> f64 {
        self.queued_tokens() as f64 + work.compute as f64 + work.disk as f64 * DISK_TOKEN_COST
    }
}

/// What the decode policy needs to know about one worker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodeCandidate {
    pub id: String,
    pub state: WorkerState,
    /// As the worker reported at its last heartbeat.
    pub total_blocks: u32,
    pub free_blocks: u32,
    pub reserved_blocks: u32,
    pub active_sequences: u32,
    /// The router's own, current view: requests it has in flight there and the KV blocks they
    /// were admitted for. Heartbeats lag (a second, by default); without these a burst of
    /// requests between two heartbeats would all go to the same worker.
    pub router_inflight: u32,
    pub router_promised_blocks: u32,
}

impl DecodeCandidate {
    /// Blocks not yet promised to anyone: the worker's last report, or the router's own count
    /// of what it has sent there since, whichever is lower.
    pub fn available_blocks(&self) -> u32 {
        let reported = self.free_blocks.saturating_sub(self.reserved_blocks);
        reported.min(self.total_blocks.saturating_sub(self.router_promised_blocks))
    }

    /// Sequences running there: the later of the report and the router's own count.
    pub fn active(&self) -> u32 {
        self.active_sequences.max(self.router_inflight)
    }
}

/// The prefill worker for a prompt of `prompt_tokens`: among `Ready` workers, the one expected to
/// finish it first — prompt tokens queued ahead (the router's own count plus the worker's
/// reported queue) plus the prompt, over the worker's measured throughput — so a slower or
/// busier worker gets less (DistServe §4 routes on the same queueing estimate). While any ready
/// worker's rate is still unknown, the fewest queued tokens instead. Ties: fewest in-flight
/// requests, then the smallest id. `None` when no worker is ready.
pub fn pick_prefill(candidates: &[PrefillCandidate], prompt_tokens: usize) -> Option<usize> {
    pick_prefill_for(candidates, &|_| PrefillWork::compute(prompt_tokens))
}

/// [`pick_prefill`] where the work differs by worker (`work(i)`: the prompt less what worker
/// `i`'s prefix cache holds of it in its pool, and what it holds only on disk, which it loads
/// instead of computing), so cached prefixes weigh against queues in the same unit: seconds until
/// the prompt is done there. A disk hit thus ranks between a pool hit and a recompute.
pub fn pick_prefill_for(candidates: &[PrefillCandidate], work: &dyn Fn(usize) -> PrefillWork) -> Option<usize> {
    let ready = || candidates.iter().enumerate().filter(|(_, c)| c.state == WorkerState::Ready);
    let by_time = ready().all(|(_, c)| c.tokens_per_s > 0.0);
    ready()
        .min_by(|&(i, a), &(j, b)| {
            let first = if by_time {
                let t = |c: &PrefillCandidate, k: usize| c.expected_seconds_for(work(k)).unwrap_or(f64::INFINITY);
                t(a, i).total_cmp(&t(b, j))
            } else {
                a.expected_tokens(work(i)).total_cmp(&b.expected_tokens(work(j)))
            };
            first.then(a.inflight.cmp(&b.inflight)).then_with(|| a.id.cmp(&b.id))
        })
        .map(|(i, _)| i)
}

/// The decode workers that can hold a sequence of `need_blocks` KV blocks, best first: `Ready`,
/// enough unreserved blocks, ordered by most free blocks, then fewest active sequences, then id.
/// The router asks them in this order; one that refuses (RESOURCE_EXHAUSTED) passes to the next.
pub fn rank_decode(candidates: &[DecodeCandidate], need_blocks: u32) -> Vec<usize> {
    let mut order: Vec<usize> = (0..candidates.len())
        .filter(|&i| candidates[i].state == WorkerState::Ready && candidates[i].available_blocks() >= need_blocks)
        .collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&candidates[a], &candidates[b]);
        b.available_blocks()
            .cmp(&a.available_blocks())
            .then(a.active().cmp(&b.active()))
            .then_with(|| a.id.cmp(&b.id))
    });
    order
}

/// KV blocks a request may need: its whole sequence (prompt plus the token budget, capped at the
/// context) in blocks of `block_size` tokens, rounded up. With `choices` > 1 (one prefill, then
/// that many sequences) the prompt's full blocks are shared and counted once; each further
/// choice holds its own copy of the prompt's last partial block and its own generated tokens.
pub fn blocks_needed(prompt_tokens: usize, max_tokens: usize, choices: u32, max_context: usize, block_size: u32) -> u32 {
    let tokens = prompt_tokens.saturating_add(max_tokens).min(max_context);
    let bs = block_size.max(1) as usize;
    let one = tokens.div_ceil(bs);
    let shared = prompt_tokens.min(tokens) / bs;
    let more = (choices.max(1) as usize - 1).saturating_mul(one - shared);
    one.saturating_add(more).min(u32::MAX as usize) as u32
}

/// Whether a lease renewed at `last_heartbeat` has run out at `now` (times as offsets from any
/// common origin, so tests need no clock). A heartbeat exactly `lease` ago is still in time.
pub fn lease_expired(last_heartbeat: Duration, now: Duration, lease: Duration) -> bool {
    now.saturating_sub(last_heartbeat) > lease
}

#[cfg(test)]
mod tests {
    use super::*;
    use WorkerState::*;

    fn p(id: &str, state: WorkerState, inflight: u32, outstanding: u64, queue: u64) -> PrefillCandidate {
        PrefillCandidate {
            id: id.into(),
            state,
            inflight,
            outstanding_tokens: outstanding,
            reported_queue_tokens: queue,
            tokens_per_s: 0.0,
            disk_read_tokens_per_s: 0.0,
        }
    }

    fn rated(mut c: PrefillCandidate, tokens_per_s: f64) -> PrefillCandidate {
        c.tokens_per_s = tokens_per_s;
        c
    }

    fn d(id: &str, state: WorkerState, free: u32, reserved: u32, active: u32) -> DecodeCandidate {
        DecodeCandidate {
            id: id.into(),
            state,
            total_blocks: 100,
            free_blocks: free,
            reserved_blocks: reserved,
            active_sequences: active,
            router_inflight: 0,
            router_promised_blocks: 0,
        }
    }

    /// The router's own accounting between heartbeats.
    fn routed(mut c: DecodeCandidate, inflight: u32, promised: u32) -> DecodeCandidate {
        c.router_inflight = inflight;
        c.router_promised_blocks = promised;
        c
    }

    #[test]
    fn pick_prefill_table() {
        let cases: Vec<(&str, Vec<PrefillCandidate>, Option<usize>)> = vec![
            ("empty", vec![], None),
            ("none ready", vec![p("a", Dead, 0, 0, 0), p("b", Draining, 0, 0, 0)], None),
            ("least tokens", vec![p("a", Ready, 1, 500, 0), p("b", Ready, 3, 100, 0)], Some(1)),
            ("reported queue counts", vec![p("a", Ready, 0, 0, 900), p("b", Ready, 0, 100, 0)], Some(1)),
            ("tie -> fewer inflight", vec![p("a", Ready, 2, 100, 0), p("b", Ready, 1, 50, 50)], Some(1)),
            ("tie -> id order", vec![p("b", Ready, 1, 10, 0), p("a", Ready, 1, 10, 0)], Some(1)),
            ("skips dead even if idle", vec![p("a", Dead, 0, 0, 0), p("b", Ready, 9, 9000, 0)], Some(1)),
            ("skips draining", vec![p("a", Draining, 0, 0, 0), p("b", Ready, 1, 1, 0)], Some(1)),
        ];
        for (name, cands, want) in cases {
            assert_eq!(pick_prefill(&cands, 100), want, "{name}");
        }
    }

    #[test]
    fn pick_prefill_by_expected_time_once_rates_are_known() {
        let cases: Vec<(&str, Vec<PrefillCandidate>, usize, Option<usize>)> = vec![
            // A fast worker with a longer queue beats a slow idle-ish one: 1100/4000 s < 300/400 s.
            ("fast but busier wins", vec![rated(p("a", Ready, 2, 1000, 0), 4000.0), rated(p("b", Ready, 0, 200, 0), 400.0)], 100, Some(0)),
            // Equal rates: the same choice as by tokens.
            ("equal rates = fewest tokens", vec![rated(p("a", Ready, 0, 600, 0), 1000.0), rated(p("b", Ready, 0, 100, 50), 1000.0)], 100, Some(1)),
            // The prompt's own size counts: a long prompt goes where it finishes first.
            ("long prompt to the fast one", vec![rated(p("a", Ready, 0, 0, 0), 300.0), rated(p("b", Ready, 0, 400, 0), 3000.0)], 2000, Some(1)),
            ("short prompt to the idle one", vec![rated(p("a", Ready, 0, 0, 0), 300.0), rated(p("b", Ready, 0, 400, 0), 3000.0)], 10, Some(0)),
            // One rate unknown (a fresh worker): by tokens, so the new worker is not starved.
            ("unknown rate falls back to tokens", vec![rated(p("a", Ready, 0, 500, 0), 5000.0), p("b", Ready, 0, 100, 0)], 100, Some(1)),
            // A draining worker's rate does not matter.
            ("not-ready rates ignored", vec![p("a", Draining, 0, 0, 0), rated(p("b", Ready, 0, 900, 0), 10.0), rated(p("c", Ready, 0, 100, 0), 10.0)], 1, Some(2)),
        ];
        for (name, cands, prompt, want) in cases {
            assert_eq!(pick_prefill(&cands, prompt), want, "{name}");
        }
        let c = rated(p("a", Ready, 0, 300, 100), 1000.0);
        assert_eq!(c.expected_seconds(600), Some(0.9), "the report's 100 are among the router's 300");
        let c = rated(p("a", Ready, 0, 300, 700), 1000.0);
        assert_eq!(c.expected_seconds(300), Some(1.0), "another router's 400 more");
        assert_eq!(p("a", Ready, 0, 0, 0).expected_seconds(1), None);
    }

    /// Three workers alike but for what they hold of a 1000-token prompt: all of it but the last
    /// block in the pool (`pool`), the same on disk only (`disk`), nothing (`miss`). Whatever the
    /// rates, the pool hit goes first, then the disk hit, then the recompute.
    #[test]
    fn a_disk_hit_ranks_between_a_pool_hit_and_a_recompute() {
        let hit = 992;
        let work = |id: &str| match id {
            "pool" => PrefillWork { compute: 1000 - hit, disk: 0 },
            "disk" => PrefillWork { compute: 1000 - hit, disk: hit },
            _ => PrefillWork::compute(1000),
        };
        // (case, prefill rate, measured disk rate)
        let cases = [("rates unknown: by tokens", 0.0, 0.0), ("disk rate not measured", 2000.0, 0.0), ("disk rate measured", 2000.0, 50_000.0)];
        for (name, rate, disk_rate) in cases {
            let mk = |id: &str| PrefillCandidate { tokens_per_s: rate, disk_read_tokens_per_s: disk_rate, ..p(id, Ready, 0, 100, 0) };
            let all = vec![mk("miss"), mk("disk"), mk("pool")];
            let mut order = Vec::new();
            let mut cands = all.clone();
            while let Some(i) = pick_prefill_for(&cands, &|i| work(&cands[i].id)) {
                order.push(cands[i].id.clone());
                cands[i].state = Dead;
            }
            assert_eq!(order, ["pool", "disk", "miss"], "{name}");
        }
    }

    #[test]
    fn pick_prefill_prices_disk_tokens_against_queues() {
        let base = |id: &str, queued: u64, disk_rate: f64| PrefillCandidate { tokens_per_s: 1000.0, disk_read_tokens_per_s: disk_rate, ..p(id, Ready, 0, queued, 0) };
        // (case, candidates, work per candidate, the pick)
        let cases: Vec<(&str, Vec<PrefillCandidate>, Vec<PrefillWork>, usize)> = vec![
            // 1000 tokens on disk cost 0.1 s at the default price (1000 tok/s / 0.1); 2000 queued
            // tokens ahead of it cost 2 s: the idle worker's recompute (1 s) wins.
            ("a much shorter queue beats a disk hit", vec![base("disk", 2000, 0.0), base("idle", 0, 0.0)], vec![PrefillWork { compute: 0, disk: 1000 }, PrefillWork::compute(1000)], 1),
            // A short queue ahead of the disk hit is worth waiting for: 0.2 + 0.1 s < 1 s.
            ("a disk hit beats a slightly shorter queue", vec![base("disk", 200, 0.0), base("idle", 0, 0.0)], vec![PrefillWork { compute: 0, disk: 1000 }, PrefillWork::compute(1000)], 0),
            // A measured read rate slower than computing (a slow disk, a fast GPU): recompute.
            ("a slow disk loses to computing", vec![base("disk", 0, 500.0), base("idle", 0, 0.0)], vec![PrefillWork { compute: 0, disk: 1000 }, PrefillWork::compute(1000)], 1),
            // The measured rate replaces the default price: 1000 / 100k tok/s = 0.01 s.
            ("a fast disk beats a short queue", vec![base("disk", 0, 100_000.0), base("pool", 50, 0.0)], vec![PrefillWork { compute: 0, disk: 1000 }, PrefillWork::compute(0)], 0),
        ];
        for (name, cands, work, want) in cases {
            assert_eq!(pick_prefill_for(&cands, &|i| work[i]), Some(want), "{name}");
        }
        let c = PrefillCandidate { disk_read_tokens_per_s: 4000.0, ..base("a", 500, 0.0) };
        assert_eq!(c.expected_seconds_for(PrefillWork { compute: 500, disk: 2000 }), Some(1.5));
        assert_eq!(base("a", 0, 0.0).expected_seconds_for(PrefillWork { compute: 0, disk: 1000 }), Some(0.1));
    }

    #[test]
    fn rank_decode_table() {
        let cases: Vec<(&str, Vec<DecodeCandidate>, u32, Vec<usize>)> = vec![
            ("empty", vec![], 1, vec![]),
            ("most free first", vec![d("a", Ready, 10, 0, 0), d("b", Ready, 20, 0, 5)], 4, vec![1, 0]),
            ("reserved subtracts", vec![d("a", Ready, 30, 25, 0), d("b", Ready, 20, 0, 0)], 4, vec![1, 0]),
            ("too small filtered", vec![d("a", Ready, 3, 0, 0), d("b", Ready, 8, 5, 0), d("c", Ready, 4, 0, 0)], 4, vec![2]),
            ("tie -> fewer active", vec![d("a", Ready, 10, 0, 3), d("b", Ready, 10, 0, 1)], 1, vec![1, 0]),
            ("tie -> id", vec![d("b", Ready, 10, 0, 1), d("a", Ready, 10, 0, 1)], 1, vec![1, 0]),
            ("not ready filtered", vec![d("a", Dead, 99, 0, 0), d("b", Draining, 99, 0, 0), d("c", Ready, 5, 0, 0)], 2, vec![2]),
            ("zero need takes all ready", vec![d("a", Ready, 0, 0, 0), d("b", Ready, 1, 0, 0)], 0, vec![1, 0]),
            // Between heartbeats: equal reports, but the router just sent work to `a`.
            ("router's promises count", vec![routed(d("a", Ready, 100, 0, 0), 1, 10), d("b", Ready, 100, 0, 0)], 4, vec![1, 0]),
            ("router's inflight breaks ties", vec![routed(d("a", Ready, 50, 0, 0), 2, 0), d("b", Ready, 50, 0, 1)], 4, vec![1, 0]),
            ("stale report cannot hide promises", vec![routed(d("a", Ready, 100, 0, 0), 3, 98)], 4, vec![]),
        ];
        for (name, cands, need, want) in cases {
            assert_eq!(rank_decode(&cands, need), want, "{name}");
        }
    }

    #[test]
    fn blocks_needed_table() {
        // (prompt, max_tokens, choices, max_context, block_size, want)
        let cases = [
            (10, 6, 1, 2048, 16, 1),
            (10, 7, 1, 2048, 16, 2),
            (2000, 128, 1, 2048, 16, 128),
            (0, 0, 1, 2048, 16, 0),
            (5, 5, 1, 2048, 0, 10),
            // Three choices of a 40-token prompt: 2 full blocks shared, then each choice holds
            // ceil(56 / 16) - 2 = 2 blocks of its own (its copy of the partial block included).
            (40, 16, 3, 2048, 16, 4 + 2 + 2),
            // A prompt of whole blocks: nothing to copy; each choice only its new tokens.
            (32, 16, 2, 2048, 16, 3 + 1),
            // Capped at the context: each choice's own part ends there too.
            (2000, 128, 2, 2048, 16, 128 + 3),
        ];
        for (prompt, max, choices, ctx, bs, want) in cases {
            assert_eq!(blocks_needed(prompt, max, choices, ctx, bs), want, "{prompt} {max} {choices} {ctx} {bs}");
        }
    }

    #[test]
    fn lease_table() {
        let s = Duration::from_millis;
        // (last, now, lease, expired)
        let cases = [
            (s(0), s(0), s(3000), false),
            (s(0), s(3000), s(3000), false),
            (s(0), s(3001), s(3000), true),
            (s(5000), s(1000), s(3000), false), // clock read before the heartbeat landed
        ];
        for (last, now, lease, want) in cases {
            assert_eq!(lease_expired(last, now, lease), want, "{last:?} {now:?} {lease:?}");
        }
    }
}
