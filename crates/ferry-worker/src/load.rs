//! A worker's load, published by its engine thread after every step and read by the services,
//! the heartbeat and the metrics without taking the engine; and its prefix cache's event log
//! ([`crate::cache_log`]), which the heartbeats carry to the routers.

use crate::cache_log::CacheLog;
use ferry_engine::Engine;
use ferry_proto::v1::WorkerLoad;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The instant queue timestamps are measured from (so they fit an atomic).
fn epoch() -> Instant {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// Blocks promised to one admitted request; returned when dropped.
pub struct Reservation {
    gauge: Arc<LoadGauge>,
    blocks: u64,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.gauge.blocks_committed.fetch_sub(self.blocks, Relaxed);
    }
}

#[derive(Default)]
pub struct LoadGauge {
    pub blocks_total: AtomicU64,
    pub blocks_free: AtomicU64,
    /// Blocks promised to admitted requests (used or not): the admission ledger.
    pub blocks_committed: AtomicU64,
    pub active_sequences: AtomicU64,
    pub queued_requests: AtomicU64,
    /// Prefill: prompts submitted and not yet started (the bounded queue; see
    /// [`crate::prefill::PrefillOptions::queue_max`]).
    pub waiting_requests: AtomicU64,
    pub queued_prefill_tokens: AtomicU64,
    pub block_size: AtomicU64,
    /// Prefill throughput (tokens/s, f64 bits): moving averages over steps of the tokens and
    /// of the seconds, divided ([`LoadGauge::record_prefill_step`]).
    pub prefill_rate_bits: AtomicU64,
    prefill_tokens_avg_bits: AtomicU64,
    prefill_seconds_avg_bits: AtomicU64,
    /// When the oldest prompt still waiting to start was queued: microseconds since [`epoch`]
    /// plus one; 0 when none waits.
    oldest_queued_us: AtomicU64,
    /// Of the free blocks, those holding a cached prefix (no sequence holds them).
    pub blocks_cached: AtomicU64,
    /// The engine keeps a prefix cache (and so publishes cache events).
    pub prefix_cache: AtomicBool,
    /// The cache's events, for the routers' indexes.
    pub cache_log: CacheLog,
    /// The engine's priced steps (f64 bits): seconds taken, seconds the profile says.
    step_seconds_bits: AtomicU64,
    step_model_seconds_bits: AtomicU64,
    /// The disk tier's measured read rate (prefix tokens loaded per second, f64 bits; 0: no
    /// tier, or nothing read yet), for the router's pricing of disk hits.
    disk_read_rate_bits: AtomicU64,
    /// Blocks in the disk tier, as the cache log tells (set at every publish).
    disk_blocks: AtomicU64,
}

impl LoadGauge {
    pub fn snapshot(&self) -> WorkerLoad {
        let g = |a: &AtomicU64| a.load(Relaxed);
        WorkerLoad {
            kv_blocks_total: g(&self.blocks_total) as u32,
            kv_blocks_free: g(&self.blocks_free) as u32,
            kv_blocks_reserved: self.reserved_unused() as u32,
            active_sequences: g(&self.active_sequences) as u32,
            queued_prefill_tokens: g(&self.queued_prefill_tokens),
            block_size: g(&self.block_size) as u32,
            prefill_tokens_per_s: self.prefill_rate(),
            queue_oldest_ms: self.oldest_queued_age(Instant::now()).as_secs_f64() * 1e3,
            queued_requests: g(&self.waiting_requests) as u32,
            kv_blocks_cached: g(&self.blocks_cached) as u32,
            step_seconds: f64::from_bits(g(&self.step_seconds_bits)),
            step_model_seconds: f64::from_bits(g(&self.step_model_seconds_bits)),
            disk_read_tokens_per_s: self.disk_read_rate(),
            kv_disk_blocks: g(&self.disk_blocks),
        }
    }

    /// The disk tier's read rate, as last set.
    pub fn disk_read_rate(&self) -> f64 {
        f64::from_bits(self.disk_read_rate_bits.load(Relaxed))
    }

    /// Publish the disk tier's measured read rate (prefix tokens loaded per second).
    pub fn set_disk_read_rate(&self, tokens_per_s: f64) {
        self.disk_read_rate_bits.store(tokens_per_s.max(0.0).to_bits(), Relaxed);
    }

    /// Publish the engine's priced steps ([`ferry_engine::Engine::price`]) against `busy`, the
    /// seconds the worker's loop spent on them: the step itself and the work between steps that
    /// the profile does not contain (admitting requests, importing arriving KV, sampling,
    /// streaming tokens), so that the ratio is how much slower than its profile the worker
    /// serves, not only computes. Nothing priced: both zero.
    pub fn record_clock(&self, c: ferry_engine::StepClock, busy: f64) {
        let seconds = if c.steps > 0 { busy } else { 0.0 };
        self.step_seconds_bits.store(seconds.to_bits(), Relaxed);
        self.step_model_seconds_bits.store(c.model_seconds.to_bits(), Relaxed);
    }

    pub fn prefill_rate(&self) -> f64 {
        f64::from_bits(self.prefill_rate_bits.load(Relaxed))
    }

    /// Fold one step into the throughput: moving averages (weight 0.3 for the newest) of the
    /// tokens and of the seconds, and their ratio, so that each step counts by its size: a step
    /// of a few tokens (a suffix after a cached prefix), dominated by what every step costs, does
    /// not drag the rate a long prompt is priced at (an average of per-step rates would).
    pub fn record_prefill_step(&self, tokens: usize, seconds: f64) {
        if tokens == 0 || seconds <= 0.0 {
            return;
        }
        let fold = |avg: &AtomicU64, now: f64| {
            let old = f64::from_bits(avg.load(Relaxed));
            let new = if old > 0.0 { 0.7 * old + 0.3 * now } else { now };
            avg.store(new.to_bits(), Relaxed);
            new
        };
        let tokens = fold(&self.prefill_tokens_avg_bits, tokens as f64);
        let seconds = fold(&self.prefill_seconds_avg_bits, seconds);
        self.prefill_rate_bits.store((tokens / seconds).to_bits(), Relaxed);
    }

    /// Committed blocks not yet allocated in the pool (what the free count does not show yet).
    pub fn reserved_unused(&self) -> u64 {
        let used = self.blocks_total.load(Relaxed).saturating_sub(self.blocks_free.load(Relaxed));
        self.blocks_committed.load(Relaxed).saturating_sub(used)
    }

    /// Promise `blocks` to a request if the ledger has room; the guard gives them back.
    pub fn try_reserve(self: &Arc<Self>, blocks: u64) -> Option<Reservation> {
        let total = self.blocks_total.load(Relaxed);
        self.blocks_committed
            .fetch_update(Relaxed, Relaxed, |c| (c + blocks <= total).then_some(c + blocks))
            .ok()
            .map(|_| Reservation { gauge: self.clone(), blocks })
    }

    /// Record when the oldest waiting prompt was queued (None: nothing waits).
    pub fn set_oldest_queued(&self, enqueued: Option<Instant>) {
        let v = enqueued.map_or(0, |t| t.saturating_duration_since(epoch()).as_micros().min(u64::MAX as u128 - 1) as u64 + 1);
        self.oldest_queued_us.store(v, Relaxed);
    }

    /// How long the oldest waiting prompt has waited at `now` (zero when none waits).
    pub fn oldest_queued_age(&self, now: Instant) -> Duration {
        match self.oldest_queued_us.load(Relaxed) {
            0 => Duration::ZERO,
            v => now.saturating_duration_since(epoch() + Duration::from_micros(v - 1)),
        }
    }

    /// KV blocks used or promised, as a fraction of the pool (0 when there is no pool yet).
    pub fn kv_utilization(&self) -> f64 {
        let s = self.snapshot();
        let used = s.kv_blocks_total.saturating_sub(s.kv_blocks_free) as f64;
        if s.kv_blocks_total == 0 { 0.0 } else { ((used + s.kv_blocks_reserved as f64) / s.kv_blocks_total as f64).min(1.0) }
    }

    /// Publish to the Prometheus gauges too.
    pub fn export(&self, role: &'static str) {
        let s = self.snapshot();
        metrics::gauge!(crate::cluster::metrics::names::KV_BLOCKS, "role" => role, "state" => "free").set(s.kv_blocks_free as f64);
        metrics::gauge!(crate::cluster::metrics::names::KV_BLOCKS, "role" => role, "state" => "used")
            .set(s.kv_blocks_total.saturating_sub(s.kv_blocks_free) as f64);
        metrics::gauge!(crate::cluster::metrics::names::KV_BLOCKS, "role" => role, "state" => "reserved").set(s.kv_blocks_reserved as f64);
        metrics::gauge!(crate::cluster::metrics::names::ACTIVE_SEQUENCES, "role" => role).set(s.active_sequences as f64);
        metrics::gauge!(crate::cluster::metrics::names::QUEUE_DEPTH, "role" => role).set(self.queued_requests.load(Relaxed) as f64);
        metrics::gauge!(crate::cluster::metrics::names::QUEUED_PREFILL_TOKENS, "role" => role).set(s.queued_prefill_tokens as f64);
        if role == "prefill" {
            metrics::gauge!(crate::cluster::metrics::names::PREFILL_TOKENS_PER_SECOND).set(s.prefill_tokens_per_s);
            metrics::gauge!(crate::cluster::metrics::names::QUEUE_WAITING, "role" => role).set(s.queued_requests as f64);
        }
        metrics::gauge!(crate::cluster::metrics::names::KV_UTILIZATION, "role" => role).set(self.kv_utilization());
        if s.step_model_seconds > 0.0 {
            metrics::gauge!(crate::cluster::metrics::names::PRICED_STEP_SECONDS, "role" => role, "clock" => "measured").set(s.step_seconds);
            metrics::gauge!(crate::cluster::metrics::names::PRICED_STEP_SECONDS, "role" => role, "clock" => "profile").set(s.step_model_seconds);
        }
        metrics::gauge!(crate::cluster::metrics::names::QUEUE_OLDEST_SECONDS, "role" => role).set(self.oldest_queued_age(Instant::now()).as_secs_f64());
    }
}

impl LoadGauge {
    /// On the engine thread, at every publish: record the priced steps against the seconds the loop
    /// was busy around them, `busy` ([`LoadGauge::record_clock`]), move the cache's new events into
    /// the log, record how many blocks are cached, and set the prefix cache metrics (`role`:
    /// prefill, decode, colocated).
    pub fn publish(&self, engine: &mut Engine, role: &'static str, busy: f64) {
        let load = self;
        // Dropped sequence handles give their blocks back before anything is counted.
        engine.reclaim();
        load.record_clock(engine.clock(), busy);
        let enabled = engine.prefix_cache_enabled();
        load.prefix_cache.store(enabled, Relaxed);
        if !enabled {
            return;
        }
        let events = engine.drain_cache_events();
        let disk_events = engine.drain_disk_events();
        let (indexed, lost) = {
            let mut log = load.cache_log.lock();
            let lost = log.lost;
            if !events.is_empty() {
                log.push(&events);
            }
            if !disk_events.is_empty() {
                log.push_disk(&disk_events);
            }
            load.disk_blocks.store(log.held_disk() as u64, Relaxed);
            (log.held(), log.lost - lost)
        };
        if lost > 0 {
            tracing::warn!(lost, "prefix cache: the engine dropped events between drains; routers may route on stale entries until blocks turn over");
            metrics::counter!(crate::cluster::metrics::names::PREFIX_CACHE_EVENTS_LOST, "role" => role).increment(lost);
        }
        let cached = engine.cached_blocks();
        load.blocks_cached.store(cached as u64, Relaxed);
        let s = engine.cache_stats();
        metrics::gauge!(crate::cluster::metrics::names::PREFIX_CACHE_BLOCKS, "role" => role, "state" => "cached").set(cached as f64);
        metrics::gauge!(crate::cluster::metrics::names::PREFIX_CACHE_BLOCKS, "role" => role, "state" => "used").set(engine.used_blocks() as f64);
        metrics::gauge!(crate::cluster::metrics::names::PREFIX_CACHE_BLOCKS, "role" => role, "state" => "indexed").set(indexed as f64);
        metrics::counter!(crate::cluster::metrics::names::PREFIX_CACHE_QUERIES, "role" => role).absolute(s.queries);
        metrics::counter!(crate::cluster::metrics::names::PREFIX_CACHE_HITS, "role" => role).absolute(s.hits);
        metrics::counter!(crate::cluster::metrics::names::PREFIX_CACHE_HIT_BLOCKS, "role" => role).absolute(s.hit_blocks);
        metrics::counter!(crate::cluster::metrics::names::PREFIX_CACHE_HIT_TOKENS, "role" => role).absolute(s.hit_tokens);
        metrics::counter!(crate::cluster::metrics::names::PREFIX_CACHE_STORED, "role" => role).absolute(s.stored);
        metrics::counter!(crate::cluster::metrics::names::PREFIX_CACHE_EVICTIONS, "role" => role).absolute(s.evictions);
        metrics::counter!(crate::cluster::metrics::names::PREFIX_CACHE_VERIFY_MISSES, "role" => role).absolute(s.verify_misses);
        load.publish_disk(engine, role);
    }

    /// The disk tier's share of [`LoadGauge::publish`] (its events went into the log there): its
    /// read rate into the heartbeat, its metrics. Nothing without a tier.
    fn publish_disk(&self, engine: &mut Engine, role: &'static str) {
        use crate::cluster::metrics::names as n;
        let hit_tokens = engine.disk_hit_tokens();
        let bs = engine.kv_layout().block_size;
        let Some(s) = engine.kv_disk().map(|d| d.stats()) else { return };
        self.set_disk_read_rate(s.read_tokens_per_s(bs).unwrap_or(0.0));
        metrics::gauge!(n::KV_DISK_BLOCKS, "role" => role).set(s.blocks as f64);
        metrics::gauge!(n::KV_DISK_BYTES, "role" => role).set(s.bytes as f64);
        metrics::gauge!(n::KV_DISK_CAPACITY, "role" => role).set(s.capacity_bytes as f64);
        metrics::gauge!(n::KV_DISK_WRITE_QUEUE, "role" => role).set(s.write_queue as f64);
        metrics::counter!(n::KV_DISK_HIT_TOKENS, "role" => role).absolute(hit_tokens);
        metrics::counter!(n::KV_DISK_WRITTEN_BLOCKS, "role" => role).absolute(s.written_blocks);
        metrics::counter!(n::KV_DISK_WRITTEN_BYTES, "role" => role).absolute(s.written_bytes);
        metrics::counter!(n::KV_DISK_WRITE_DROPPED, "role" => role).absolute(s.write_dropped);
        metrics::counter!(n::KV_DISK_READ_BLOCKS, "role" => role).absolute(s.read_blocks);
        metrics::counter!(n::KV_DISK_READ_BYTES, "role" => role).absolute(s.read_bytes);
        metrics::counter!(n::KV_DISK_EVICTIONS, "role" => role).absolute(s.evicted);
        metrics::counter!(n::KV_DISK_CORRUPT, "role" => role).absolute(s.corrupt);
        metrics::gauge!(n::KV_DISK_READ_RATE, "role" => role).set(s.read_tokens_per_s(bs).unwrap_or(0.0));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_published_step_time_is_the_loop_s_busy_time_against_the_priced_steps() {
        let g = LoadGauge::default();
        // Nothing priced: the loop's time is not published (no profile to compare it with).
        g.record_clock(ferry_engine::StepClock::default(), 3.0);
        assert_eq!((g.snapshot().step_seconds, g.snapshot().step_model_seconds), (0.0, 0.0));
        // Priced: the loop's busy seconds (steps and the work around them), not the engine's.
        g.record_clock(ferry_engine::StepClock { steps: 4, seconds: 2.0, model_seconds: 1.5 }, 2.2);
        assert_eq!((g.snapshot().step_seconds, g.snapshot().step_model_seconds), (2.2, 1.5));
    }

    #[test]
    fn reservations_never_exceed_the_pool_and_come_back() {
        let g = Arc::new(LoadGauge::default());
        g.blocks_total.store(10, Relaxed);
        g.blocks_free.store(10, Relaxed);
        let a = g.try_reserve(6).expect("fits");
        assert!(g.try_reserve(5).is_none());
        let b = g.try_reserve(4).expect("fits exactly");
        assert_eq!(g.snapshot().kv_blocks_reserved, 10);
        g.blocks_free.store(7, Relaxed); // 3 of the promised blocks now in use
        assert_eq!(g.snapshot().kv_blocks_reserved, 7);
        drop(a);
        drop(b);
        assert_eq!(g.blocks_committed.load(Relaxed), 0);
        assert!(g.try_reserve(10).is_some());
    }

    #[test]
    fn prefill_rate_is_a_moving_average() {
        let g = LoadGauge::default();
        assert_eq!(g.snapshot().prefill_tokens_per_s, 0.0);
        g.record_prefill_step(1000, 1.0);
        assert_eq!(g.prefill_rate(), 1000.0);
        g.record_prefill_step(2000, 1.0);
        assert!((g.prefill_rate() - 1300.0).abs() < 1e-9);
        g.record_prefill_step(0, 1.0);
        assert!((g.snapshot().prefill_tokens_per_s - 1300.0).abs() < 1e-9);
    }

    #[test]
    fn a_short_prefill_step_counts_by_its_size() {
        let g = LoadGauge::default();
        g.record_prefill_step(1000, 1.0);
        // 10 tokens in 0.1 s (100 tokens/s, a fixed cost per step): tokens 703, seconds 0.73.
        g.record_prefill_step(10, 0.1);
        assert!((g.prefill_rate() - 703.0 / 0.73).abs() < 1e-6, "{}", g.prefill_rate());
        // Steps of one size alone: their own rate.
        for _ in 0..50 {
            g.record_prefill_step(10, 0.1);
        }
        assert!((g.prefill_rate() - 100.0).abs() < 1e-3);
    }

    #[test]
    fn kv_utilization_counts_used_and_promised_blocks() {
        let g = Arc::new(LoadGauge::default());
        assert_eq!(g.kv_utilization(), 0.0);
        g.blocks_total.store(10, Relaxed);
        g.blocks_free.store(10, Relaxed);
        assert_eq!(g.kv_utilization(), 0.0);
        let _r = g.try_reserve(4).expect("fits");
        assert_eq!(g.kv_utilization(), 0.4);
        g.blocks_free.store(8, Relaxed); // 2 of the 4 promised now allocated
        assert_eq!(g.kv_utilization(), 0.4);
        g.blocks_free.store(3, Relaxed); // more allocated than promised (prefill pools do not reserve)
        assert_eq!(g.kv_utilization(), 0.7);
    }

    #[test]
    fn oldest_queued_age_grows_until_the_queue_empties() {
        let g = LoadGauge::default();
        let t0 = Instant::now();
        assert_eq!(g.oldest_queued_age(t0), Duration::ZERO);
        g.set_oldest_queued(Some(t0));
        let age = g.oldest_queued_age(t0 + Duration::from_millis(1500));
        assert!(age >= Duration::from_millis(1499) && age <= Duration::from_millis(1500), "{age:?}");
        g.set_oldest_queued(None);
        assert_eq!(g.oldest_queued_age(t0 + Duration::from_secs(9)), Duration::ZERO);
    }
}
