//! The Mooncake trace format (Qin et al., "Mooncake: Trading More Storage for Less Computation",
//! FAST '25; github.com/kvcache-ai/Mooncake, `FAST25-release/traces`), as `ferry bench serve
//! --trace` replays it and `ferry plan --trace` simulates it. Pure: parsing, the prompts, the
//! oracle and a model of prefix caches; no I/O.
//!
//! A trace is JSON lines `{"timestamp": ms, "input_length": n, "output_length": m, "hash_ids":
//! [..]}`. Each hash id stands for one block of 512 prompt tokens (the last one possibly partial);
//! two requests share a block exactly when they share its hash id, and a block's id stands for
//! every token before it too (the ids form prefixes, as a prefix cache's chained block hashes do).
//!
//! Replaying one needs prompts: each hash id becomes a block of token ids drawn from a generator
//! seeded by the id ([`block_ids`]), so requests that share ids share those tokens exactly, and
//! different ids give different blocks. A block may be shortened (`block_tokens`, 512 in the
//! format): every length scales with it, so a slow machine replays the trace's structure in
//! fewer tokens. Prompt tokens past the trace's blocks, if any, are the request's own.
//!
//! The oracle ([`oracle`]) is the hit rate the ids imply: each request, in arrival order, is
//! served from cache the leading run of its blocks whose ids an earlier request had, over an
//! unbounded cache (size a trace so the workers' caches hold it). [`Oracle::servable`] is what an
//! engine can serve of that: whole cache blocks, and never the prompt's last token (it must be
//! computed for the first output token). [`CacheModel`] is the same count over bounded caches
//! (LRU by block) on several workers, each request sent where most of its prefix is held. With a
//! disk tier (`ferry plan --kv-disk-blocks`, as workers' `--kv-disk`), each worker's blocks evicted
//! from its pool go to a second LRU on disk; a prefix run may mix both, and [`Served`] tells the
//! pool's tokens from the disk's.

use anyhow::{ensure, Context};
use std::collections::{HashMap, HashSet};

/// Tokens per hash id in the format.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// One line of a trace, as written.
#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
pub struct TraceRecord {
    /// Milliseconds after the trace's start.
    pub timestamp: f64,
    pub input_length: usize,
    pub output_length: usize,
    pub hash_ids: Vec<u64>,
}

/// Whether a JSON line is in the Mooncake format (it has `hash_ids` and `timestamp`), to tell it
/// from `ferry plan`'s own `{"at", "prompt", "output"}` traces.
pub fn is_mooncake_line(line: &str) -> bool {
    serde_json::from_str::<serde_json::Value>(line).is_ok_and(|v| v.get("hash_ids").is_some() && v.get("timestamp").is_some())
}

/// The records of a trace's text, in arrival order (a stable sort, so requests at the same
/// millisecond keep the file's order). Every error names `source:line` and what is wrong.
pub fn parse(text: &str, source: &str) -> anyhow::Result<Vec<TraceRecord>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let at = || format!("{source}:{}", i + 1);
        let r: TraceRecord = serde_json::from_str(line)
            .with_context(|| format!("{}: not a Mooncake trace line (want {{\"timestamp\": ms, \"input_length\": n, \"output_length\": n, \"hash_ids\": [..]}})", at()))?;
        ensure!(r.timestamp.is_finite() && r.timestamp >= 0.0, "{}: \"timestamp\" must be milliseconds >= 0 (got {})", at(), r.timestamp);
        ensure!(r.input_length >= 1, "{}: \"input_length\" must be at least 1", at());
        out.push(r);
    }
    ensure!(!out.is_empty(), "{source}: no requests in the trace");
    out.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    Ok(out)
}

/// How a trace is replayed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Replay {
    /// Tokens per hash id (the format's 512, or fewer to replay its structure in fewer tokens).
    pub block_tokens: usize,
    /// Multiplies every time: 0.1 replays ten times faster.
    pub time_scale: f64,
    /// At most this many output tokens per request (None: the trace's).
    pub max_output: Option<usize>,
    /// Only the first this many requests (None: all).
    pub max_requests: Option<usize>,
}

/// One request to replay.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceRequest {
    /// Seconds after the first request (scaled).
    pub at: f64,
    pub prompt_len: usize,
    pub output: usize,
    pub hash_ids: Vec<u64>,
}

/// The requests `records` make under `r`: lengths scaled to `block_tokens` per hash id (rounded
/// up), times by `time_scale` from the first arrival, outputs capped (at least 1 token each).
pub fn requests(records: &[TraceRecord], r: &Replay) -> Vec<TraceRequest> {
    let t0 = records.first().map_or(0.0, |x| x.timestamp);
    records
        .iter()
        .take(r.max_requests.unwrap_or(usize::MAX))
        .map(|x| TraceRequest {
            at: (x.timestamp - t0) / 1e3 * r.time_scale,
            prompt_len: (x.input_length * r.block_tokens).div_ceil(MOONCAKE_BLOCK_TOKENS).max(1),
            output: x.output_length.min(r.max_output.unwrap_or(usize::MAX)).max(1),
            hash_ids: x.hash_ids.clone(),
        })
        .collect()
}

/// SplitMix64's output function: one well-mixed word per input.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// An ordinary vocabulary id (from 256 up: the low ids of byte-level BPE vocabularies are
/// special) drawn from `word`.
fn id_of(word: u64, vocab: u32) -> u32 {
    256 + (word % vocab.saturating_sub(256).max(1) as u64) as u32
}

/// The token at `pos` of hash id `hash_id`'s block: the same for every request that has the id.
fn block_token(hash_id: u64, pos: usize, vocab: u32) -> u32 {
    id_of(mix(mix(hash_id) ^ pos as u64), vocab)
}

/// Hash id `hash_id`'s block of `block_tokens` token ids below `vocab` (what [`prompt_ids`] puts
/// at each of a request's blocks; the tests hold them against each other).
#[cfg(test)]
pub fn block_ids(hash_id: u64, block_tokens: usize, vocab: u32) -> Vec<u32> {
    (0..block_tokens).map(|pos| block_token(hash_id, pos, vocab)).collect()
}

/// The prompt of the `index`-th request: its blocks in order, cut at its length; tokens past its
/// blocks are its own (drawn from `index`, shared with no other request).
pub fn prompt_ids(req: &TraceRequest, index: usize, block_tokens: usize, vocab: u32) -> Vec<u32> {
    (0..req.prompt_len)
        .map(|k| match req.hash_ids.get(k / block_tokens) {
            Some(&h) => block_token(h, k % block_tokens, vocab),
            None => id_of(mix(mix(!(index as u64)) ^ k as u64 ^ 0x5EED_0F0F_0000_0000), vocab),
        })
        .collect()
}

/// The leading run of `req`'s blocks (those its prompt reaches) for which `held` says yes, in tokens.
fn held_prefix(req: &TraceRequest, block_tokens: usize, held: &dyn Fn(u64) -> bool) -> usize {
    let blocks = req.prompt_len.div_ceil(block_tokens).min(req.hash_ids.len());
    let run = req.hash_ids[..blocks].iter().take_while(|&&h| held(h)).count();
    (run * block_tokens).min(req.prompt_len)
}

/// What an engine can serve of `hit` cached tokens of a `prompt_len`-token prompt: whole blocks
/// of `cache_block` tokens, short of the last prompt token.
pub fn servable(hit: usize, prompt_len: usize, cache_block: usize) -> usize {
    hit.min(prompt_len.saturating_sub(1)) / cache_block.max(1) * cache_block.max(1)
}

/// The hit rate a trace's ids imply.
#[derive(Clone, Debug, PartialEq)]
pub struct Oracle {
    pub prompt_tokens: usize,
    /// Per request: prompt tokens in the leading run of blocks an earlier request had.
    pub hits: Vec<usize>,
    /// Per request: of those, what an engine with `cache_block`-token blocks serves.
    pub servable: Vec<usize>,
}

impl Oracle {
    pub fn hit_rate(&self) -> f64 {
        self.hits.iter().sum::<usize>() as f64 / self.prompt_tokens.max(1) as f64
    }

    pub fn servable_rate(&self) -> f64 {
        self.servable.iter().sum::<usize>() as f64 / self.prompt_tokens.max(1) as f64
    }
}

/// The oracle over an unbounded cache, requests taken in order.
pub fn oracle(reqs: &[TraceRequest], block_tokens: usize, cache_block: usize) -> Oracle {
    let mut seen: HashSet<u64> = HashSet::new();
    let (mut hits, mut serv) = (Vec::new(), Vec::new());
    for r in reqs {
        let hit = held_prefix(r, block_tokens, &|h| seen.contains(&h));
        hits.push(hit);
        serv.push(servable(hit, r.prompt_len, cache_block));
        seen.extend(r.hash_ids.iter().take(r.prompt_len.div_ceil(block_tokens)));
    }
    Oracle { prompt_tokens: reqs.iter().map(|r| r.prompt_len).sum(), hits, servable: serv }
}

/// Prefix caches on `workers` workers, each holding at most `capacity` blocks (LRU), as a
/// simulation counts hits: each request goes to the worker holding the longest run of its blocks
/// (ties: the one that served least recently, which spreads cold prompts as a load balancer
/// would, then the lowest index), is served that run, and leaves all its blocks there. With a disk
/// tier ([`CacheModel::with_disk`]) the run counts blocks in the pool or on disk (as the router's
/// index does), and blocks the pool evicts move to the disk's own LRU.
pub struct CacheModel {
    block_tokens: usize,
    capacity: usize,
    caches: Vec<Lru>,
    /// Blocks each worker's disk tier holds at most (0: no disk tier).
    disk_capacity: usize,
    disks: Vec<Lru>,
    /// Per worker: the request count when it last served one.
    last_served: Vec<u64>,
    served: u64,
}

/// One worker's cached block ids, least recently used first.
#[derive(Clone, Default)]
struct Lru {
    /// Block id -> its last use.
    used: HashMap<u64, u64>,
    /// Last use -> block id (uses are unique: a counter per touch).
    order: std::collections::BTreeMap<u64, u64>,
    tick: u64,
}

impl Lru {
    fn touch(&mut self, id: u64) {
        self.tick += 1;
        if let Some(old) = self.used.insert(id, self.tick) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, id);
    }

    /// Evict least recently used blocks down to `capacity`; returns them, oldest first.
    fn shrink_to(&mut self, capacity: usize) -> Vec<u64> {
        let mut gone = Vec::new();
        while self.used.len() > capacity {
            let Some((_, id)) = self.order.pop_first() else { break };
            self.used.remove(&id);
            gone.push(id);
        }
        gone
    }
}

/// What one request was served from cache, in prompt tokens, by tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    pub worker: usize,
    pub pool: usize,
    pub disk: usize,
}

impl Served {
    pub fn total(self) -> usize {
        self.pool + self.disk
    }
}

impl CacheModel {
    /// Pools only (the tests' model; `ferry plan` builds [`CacheModel::with_disk`]).
    #[cfg(test)]
    pub fn new(workers: usize, capacity_blocks: usize, block_tokens: usize) -> CacheModel {
        let workers = workers.max(1);
        Self::with_disk(workers, capacity_blocks, 0, block_tokens)
    }

    /// [`CacheModel::new`] with a disk tier of `disk_blocks` blocks per worker behind each pool.
    pub fn with_disk(workers: usize, capacity_blocks: usize, disk_blocks: usize, block_tokens: usize) -> CacheModel {
        let workers = workers.max(1);
        CacheModel {
            block_tokens,
            capacity: capacity_blocks.max(1),
            caches: vec![Lru::default(); workers],
            disk_capacity: disk_blocks,
            disks: vec![Lru::default(); workers],
            last_served: vec![0; workers],
            served: 0,
        }
    }

    /// Serve `req`: (the worker, its prompt tokens served from cache, pool and disk together).
    #[cfg(test)]
    pub fn serve(&mut self, req: &TraceRequest) -> (usize, usize) {
        let s = self.serve_tiers(req);
        (s.worker, s.total())
    }

    /// Serve `req`: the worker, and its prompt tokens served from its pool and from its disk.
    pub fn serve_tiers(&mut self, req: &TraceRequest) -> Served {
        self.served += 1;
        let b = self.block_tokens;
        let runs: Vec<Served> = (0..self.caches.len()).map(|w| self.run(w, req)).collect();
        // The longest run, then the least recently served, then the lowest index.
        let w = (0..runs.len())
            .min_by(|&i, &j| runs[j].total().cmp(&runs[i].total()).then(self.last_served[i].cmp(&self.last_served[j])))
            .unwrap_or(0);
        self.last_served[w] = self.served;
        let (cache, disk) = (&mut self.caches[w], &mut self.disks[w]);
        for &h in req.hash_ids.iter().take(req.prompt_len.div_ceil(b)) {
            cache.touch(h);
            if disk.used.contains_key(&h) {
                disk.touch(h);
            }
        }
        if self.disk_capacity > 0 {
            for h in cache.shrink_to(self.capacity) {
                disk.touch(h);
            }
            disk.shrink_to(self.disk_capacity);
        } else {
            cache.shrink_to(self.capacity);
        }
        runs[w]
    }

    /// Worker `w`'s leading run of `req`'s blocks in its pool or on its disk, in tokens by tier.
    fn run(&self, w: usize, req: &TraceRequest) -> Served {
        let (pool, disk) = (&self.caches[w], &self.disks[w]);
        let total = held_prefix(req, self.block_tokens, &|id| pool.used.contains_key(&id) || disk.used.contains_key(&id));
        let mut s = Served { worker: w, pool: 0, disk: 0 };
        for (k, h) in req.hash_ids.iter().enumerate() {
            let tokens = total.saturating_sub(k * self.block_tokens).min(self.block_tokens);
            if tokens == 0 {
                break;
            }
            match pool.used.contains_key(h) {
                true => s.pool += tokens,
                false => s.disk += tokens,
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(at: f64, prompt_len: usize, ids: &[u64]) -> TraceRequest {
        TraceRequest { at, prompt_len, output: 1, hash_ids: ids.to_vec() }
    }

    #[test]
    fn traces_parse_in_arrival_order_and_bad_lines_are_named() {
        let text = "{\"timestamp\": 30, \"input_length\": 600, \"output_length\": 5, \"hash_ids\": [1, 2]}\n\n\
                    {\"timestamp\": 0, \"input_length\": 512, \"output_length\": 0, \"hash_ids\": [1]}\n";
        let t = parse(text, "t.jsonl").unwrap();
        assert_eq!(t.iter().map(|r| r.timestamp).collect::<Vec<_>>(), vec![0.0, 30.0]);
        assert_eq!(t[1].hash_ids, vec![1, 2]);
        for (bad, says) in [
            ("{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [1]}\n{\"timestamp\": 1, \"input_length\": 5}", "t.jsonl:2"),
            ("not json", "t.jsonl:1"),
            ("{\"timestamp\": -1, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": []}", "milliseconds >= 0"),
            ("{\"timestamp\": 0, \"input_length\": 0, \"output_length\": 1, \"hash_ids\": []}", "at least 1"),
            ("{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": [\"a\"]}", "t.jsonl:1"),
            ("{\"timestamp\": 0, \"input_length\": 5, \"output_length\": -2, \"hash_ids\": []}", "t.jsonl:1"),
            ("\n\n", "no requests"),
        ] {
            let e = format!("{:#}", parse(bad, "t.jsonl").unwrap_err());
            assert!(e.contains(says), "{bad:?}: {e}");
        }
        assert!(is_mooncake_line("{\"timestamp\": 0, \"input_length\": 5, \"output_length\": 1, \"hash_ids\": []}"));
        assert!(!is_mooncake_line("{\"at\": 0, \"prompt\": 5, \"output\": 1}"));
    }

    #[test]
    fn lengths_and_times_scale_with_the_replay() {
        let recs = parse("{\"timestamp\": 1000, \"input_length\": 700, \"output_length\": 300, \"hash_ids\": [4, 5]}\n\
                          {\"timestamp\": 3000, \"input_length\": 1, \"output_length\": 0, \"hash_ids\": [6]}", "t").unwrap();
        let r = requests(&recs, &Replay { block_tokens: 32, time_scale: 0.5, max_output: Some(100), max_requests: None });
        // 700 of 512-token blocks is 43.75 of 32-token ones: 44.
        assert_eq!((r[0].at, r[0].prompt_len, r[0].output), (0.0, 44, 100));
        assert_eq!((r[1].at, r[1].prompt_len, r[1].output), (1.0, 1, 1));
        let whole = requests(&recs, &Replay { block_tokens: 512, time_scale: 1.0, max_output: None, max_requests: Some(1) });
        assert_eq!(whole, vec![TraceRequest { at: 0.0, prompt_len: 700, output: 300, hash_ids: vec![4, 5] }]);
    }

    #[test]
    fn shared_hash_ids_give_identical_tokens_and_different_ids_different_blocks() {
        let (b, vocab) = (16, 49_152);
        let a = prompt_ids(&req(0.0, 40, &[7, 8, 9]), 0, b, vocab);
        let c = prompt_ids(&req(0.0, 48, &[7, 8, 10]), 1, b, vocab);
        assert_eq!(a.len(), 40);
        assert_eq!(a[..32], c[..32], "ids 7 and 8 are shared: so are their tokens");
        assert_ne!(a[32..40], c[32..40], "ids 9 and 10 differ");
        assert_eq!(a[..16], block_ids(7, 16, vocab)[..]);
        assert_ne!(block_ids(7, 16, vocab), block_ids(8, 16, vocab));
        assert!(a.iter().chain(&c).all(|&t| (256..vocab).contains(&t)));
        // Past its blocks a prompt is its own.
        let (x, y) = (prompt_ids(&req(0.0, 24, &[7]), 2, b, vocab), prompt_ids(&req(0.0, 24, &[7]), 3, b, vocab));
        assert_eq!(x[..16], y[..16]);
        assert_ne!(x[16..], y[16..]);
        // Distinct ids rarely collide token for token.
        let firsts: HashSet<Vec<u32>> = (0..1000).map(|h| block_ids(h, 4, vocab)).collect();
        assert_eq!(firsts.len(), 1000);
    }

    #[test]
    fn the_oracle_counts_the_leading_run_of_blocks_seen_before() {
        // Blocks of 32 tokens; the cache serves whole 16-token blocks, never the last token.
        let reqs = [
            req(0.0, 80, &[1, 2, 3]),     // cold
            req(1.0, 96, &[1, 2, 4]),     // 1, 2 seen: 64
            req(2.0, 64, &[1, 2]),        // all seen: 64, servable 48 (the last token is computed)
            req(3.0, 70, &[5, 2, 4]),     // 5 is new: the run stops there
            req(4.0, 40, &[1, 2, 3, 9]),  // reaches only 1 and 2 (40 tokens): hit 40, servable 32
        ];
        let o = oracle(&reqs, 32, 16);
        assert_eq!(o.hits, vec![0, 64, 64, 0, 40]);
        assert_eq!(o.servable, vec![0, 64, 48, 0, 32]);
        assert_eq!(o.prompt_tokens, 350);
        assert!((o.hit_rate() - 168.0 / 350.0).abs() < 1e-12);
        // Block 9 was never reached, so it is not seen.
        let o = oracle(&[req(0.0, 40, &[1, 2, 3, 9]), req(1.0, 128, &[1, 2, 3, 9])], 32, 16);
        assert_eq!(o.hits, vec![0, 64]);
        assert_eq!(servable(100, 101, 16), 96);
        assert_eq!(servable(64, 64, 16), 48);
    }

    #[test]
    fn one_unbounded_cache_model_equals_the_oracle_and_bounded_ones_evict() {
        let reqs: Vec<TraceRequest> = (0..40u64).map(|i| req(i as f64, 96, &[i % 3, 100 + i % 5, 1000 + i])).collect();
        let o = oracle(&reqs, 32, 16);
        let mut one = CacheModel::new(1, usize::MAX, 32);
        let hits: Vec<usize> = reqs.iter().map(|r| one.serve(r).1).collect();
        assert_eq!(hits, o.hits);
        // Two workers: each request goes where its prefix is, so the first block still hits after
        // its first visit (the second block may have gone elsewhere).
        let mut two = CacheModel::new(2, usize::MAX, 32);
        let served: Vec<(usize, usize)> = reqs.iter().map(|r| two.serve(r)).collect();
        assert!(served.iter().skip(3).all(|&(_, hit)| hit >= 32), "{served:?}");
        assert_eq!(served[0].0, 0);
        assert_eq!(served[1].0, 1, "a cold prompt goes to the worker that served least recently");
        // One block of room: nothing is ever still there for the next request.
        let mut tiny = CacheModel::new(1, 1, 32);
        assert!(reqs.iter().all(|r| tiny.serve(r).1 == 0));
    }

    #[test]
    fn a_disk_tier_keeps_what_the_pool_evicts() {
        // One worker, a pool of 2 blocks of 32 tokens, a disk of 3.
        let mut m = CacheModel::with_disk(1, 2, 3, 32);
        let s = |m: &mut CacheModel, len, ids: &[u64]| {
            let s = m.serve_tiers(&req(0.0, len, ids));
            (s.pool, s.disk)
        };
        assert_eq!(s(&mut m, 96, &[1, 2, 3]), (0, 0), "cold; the pool keeps 2, 3 and 1 goes to disk");
        assert_eq!(s(&mut m, 96, &[1, 2, 3]), (64, 32), "1 from disk, then 2 and 3 from the pool: one run");
        // The pool holds 2, 3 (touched last); 1 went to disk again. 4 and 5 push 2 and 3 out.
        assert_eq!(s(&mut m, 64, &[4, 5]), (0, 0));
        assert_eq!(s(&mut m, 70, &[1, 2, 3]), (0, 70), "all on disk now (the prompt reaches 3 blocks, 70 tokens)");
        // Without a disk tier, the same requests hit only what the pool still holds.
        let mut plain = CacheModel::new(1, 2, 32);
        let hits: Vec<usize> = [&[1u64, 2, 3][..], &[1, 2, 3], &[4, 5], &[1, 2, 3]].iter().map(|ids| plain.serve(&req(0.0, 32 * ids.len(), ids)).1).collect();
        assert_eq!(hits, vec![0, 0, 0, 0]);
        // Interleaved: the run counts both tiers, block by block.
        let mut m = CacheModel::with_disk(1, 2, 8, 32);
        s(&mut m, 64, &[1, 2]);
        s(&mut m, 64, &[3, 4]); // 1, 2 to disk
        s(&mut m, 32, &[1]); // 1 back in the pool (and still on disk); 3 to disk
        assert_eq!(s(&mut m, 128, &[1, 2, 3, 4]), (64, 64), "1 and 4 in the pool, 2 and 3 on disk");
    }
}
