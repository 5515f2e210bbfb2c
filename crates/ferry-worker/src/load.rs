//! A worker's load, published by its engine thread after every step and read by the services,
//! the heartbeat and the metrics without taking the engine.

use ferry_proto::v1::WorkerLoad;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

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
    pub queued_prefill_tokens: AtomicU64,
    pub block_size: AtomicU64,
    /// Prefill throughput (tokens/s, f64 bits): an exponential moving average over steps.
    pub prefill_rate_bits: AtomicU64,
    /// Age of the oldest request waiting to start, in microseconds.
    pub queue_oldest_us: AtomicU64,
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
            queue_oldest_ms: g(&self.queue_oldest_us) as f64 / 1e3,
        }
    }

    pub fn prefill_rate(&self) -> f64 {
        f64::from_bits(self.prefill_rate_bits.load(Relaxed))
    }

    /// Fold one step's throughput into the moving average (weight 0.3 for the newest).
    pub fn record_prefill_step(&self, tokens: usize, seconds: f64) {
        if tokens == 0 || seconds <= 0.0 {
            return;
        }
        let now = tokens as f64 / seconds;
        let old = self.prefill_rate();
        let avg = if old > 0.0 { 0.7 * old + 0.3 * now } else { now };
        self.prefill_rate_bits.store(avg.to_bits(), Relaxed);
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

    /// Publish to the Prometheus gauges too.
    pub fn export(&self, role: &'static str) {
        let s = self.snapshot();
        metrics::gauge!("ferry_worker_kv_blocks", "role" => role, "state" => "free").set(s.kv_blocks_free as f64);
        metrics::gauge!("ferry_worker_kv_blocks", "role" => role, "state" => "used")
            .set(s.kv_blocks_total.saturating_sub(s.kv_blocks_free) as f64);
        metrics::gauge!("ferry_worker_kv_blocks", "role" => role, "state" => "reserved").set(s.kv_blocks_reserved as f64);
        metrics::gauge!("ferry_worker_active_sequences", "role" => role).set(s.active_sequences as f64);
        metrics::gauge!("ferry_worker_queue_depth", "role" => role).set(self.queued_requests.load(Relaxed) as f64);
        metrics::gauge!("ferry_worker_queued_prefill_tokens", "role" => role).set(s.queued_prefill_tokens as f64);
        if role == "prefill" {
            metrics::gauge!("ferry_worker_prefill_tokens_per_second").set(s.prefill_tokens_per_s);
            metrics::gauge!("ferry_worker_queue_oldest_seconds", "role" => role).set(s.queue_oldest_ms / 1e3);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
