//! The registry's index of where prefixes live: which worker holds which KV blocks, kept from
//! the prefix cache events each worker sends with its heartbeats (the index itself is the pure
//! [`ferry_core::kv_index::KvIndex`]).
//!
//! A heartbeat's events are applied in order; a snapshot replaces what the worker holds. When the
//! index cannot trust a worker's entries (a gap in the numbers: a lost heartbeat, a router that
//! restarted and hears a worker mid-stream), the answer says `kv_resync` and the worker sends a
//! snapshot next. A worker that dies, deregisters or is removed leaves the index; one that
//! registers (again) starts clean, and its first heartbeat carries a snapshot.
//!
//! Each event names its tier (`KvCacheEvent.tier`: the pool, or the disk tier of a worker run with
//! `--kv-disk`), and a snapshot carries both (`snapshot_hashes`, `snapshot_disk_hashes`); an event
//! of a tier this build does not know keeps the numbering but changes nothing.
//!
//! The pipeline asks [`crate::workers::Registry::prefix_held`] and `prefix_overlaps` with a request's block
//! chain, `prefix_chain`.

use ferry_core::kv_index::{Applied, KvEvent, KvIndex, KvTier};
use ferry_proto::v1;


/// What one heartbeat's events did to the index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// The index needs a snapshot from this worker (answer `kv_resync`).
    pub resync: bool,
    /// A snapshot was applied.
    pub snapshot: bool,
    /// Blocks the index has this worker holding now, in its pool and on its disk.
    pub pool: usize,
    pub disk: usize,
}

fn held(index: &KvIndex<u64>, worker: &str, resync: bool, snapshot: bool) -> Outcome {
    Outcome { resync: resync || index.needs_resync(worker), snapshot, pool: index.blocks_of(worker, KvTier::Pool), disk: index.blocks_of(worker, KvTier::Disk) }
}

/// Apply worker `worker`'s heartbeat events (`None`: it sent none, its cache is off).
pub fn apply(index: &mut KvIndex<u64>, worker: &str, ev: Option<&v1::KvCacheEvents>) -> Outcome {
    let Some(ev) = ev else {
        return held(index, worker, false, false);
    };
    if ev.snapshot {
        index.resync(worker, ev.snapshot_seq, ev.snapshot_hashes.iter().copied(), ev.snapshot_disk_hashes.iter().copied());
    }
    let mut resync = false;
    for e in ev.events.iter().filter(|e| !ev.snapshot || e.seq > ev.snapshot_seq) {
        let event = match (ferry_proto::kv_tier_from_wire(e.tier), e.stored) {
            (Some(tier), true) => KvEvent::Stored(tier, e.hashes.clone()),
            (Some(tier), false) => KvEvent::Evicted(tier, e.hashes.clone()),
            // Unknown tier: numbered, so applied, but about nothing this index keeps.
            (None, _) => KvEvent::Stored(KvTier::Pool, Vec::new()),
        };
        if index.apply(worker, e.seq, &event) == Applied::NeedResync {
            resync = true;
            break;
        }
    }
    held(index, worker, resync, ev.snapshot)
}

/// Router metrics for one heartbeat's outcome (outside the registry's lock).
pub fn record(worker: &str, o: Outcome, distinct: usize) {
    if o.snapshot {
        metrics::counter!(crate::metrics::names::KV_SNAPSHOTS).increment(1);
    }
    if o.resync {
        metrics::counter!(crate::metrics::names::KV_RESYNCS).increment(1);
    }
    for (tier, n) in [(KvTier::Pool, o.pool), (KvTier::Disk, o.disk)] {
        metrics::gauge!(crate::metrics::names::KV_INDEXED_BLOCKS, "worker" => worker.to_string(), "tier" => tier.as_str()).set(n as f64);
    }
    metrics::gauge!(crate::metrics::names::KV_INDEXED_BLOCKS_DISTINCT).set(distinct as f64);
}

/// A worker left the index: its gauge goes to 0.
pub fn forget(index: &mut KvIndex<u64>, worker: &str) {
    if index.blocks_of(worker, KvTier::Pool) > 0 || index.blocks_of(worker, KvTier::Disk) > 0 || index.last_seq(worker) > 0 || index.needs_resync(worker) {
        for tier in KvTier::ALL {
            metrics::gauge!(crate::metrics::names::KV_INDEXED_BLOCKS, "worker" => worker.to_string(), "tier" => tier.as_str()).set(0.0);
        }
    }
    index.remove_worker(worker);
    metrics::gauge!(crate::metrics::names::KV_INDEXED_BLOCKS_DISTINCT).set(index.distinct_blocks() as f64);
}

#[cfg(test)]
#[path = "prefix_index_tests.rs"]
mod tests;
