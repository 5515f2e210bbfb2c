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
//! The orchestration asks [`Registry::prefix_held`] and [`Registry::prefix_overlaps`] with a
//! request's block chain, [`Registry::prefix_chain`].

use std::collections::HashMap;

use ferry_core::kv_index::{Applied, KvEvent, KvIndex};
use ferry_core::prefix_cache::{BlockHash, block_hashes};
use ferry_proto::v1;

use super::Registry;

/// What one heartbeat's events did to the index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Outcome {
    /// The index needs a snapshot from this worker (answer `kv_resync`).
    pub resync: bool,
    /// A snapshot was applied.
    pub snapshot: bool,
    /// Blocks the index has this worker holding now.
    pub blocks: usize,
}

/// Apply worker `worker`'s heartbeat events (`None`: it sent none, its cache is off).
pub(super) fn apply(index: &mut KvIndex<u64>, worker: &str, ev: Option<&v1::KvCacheEvents>) -> Outcome {
    let Some(ev) = ev else {
        return Outcome { resync: index.needs_resync(worker), snapshot: false, blocks: index.blocks_of(worker) };
    };
    if ev.snapshot {
        index.resync(worker, ev.snapshot_seq, ev.snapshot_hashes.iter().copied());
    }
    let mut resync = false;
    for e in ev.events.iter().filter(|e| !ev.snapshot || e.seq > ev.snapshot_seq) {
        let event = match e.stored {
            true => KvEvent::Stored(e.hashes.clone()),
            false => KvEvent::Evicted(e.hashes.clone()),
        };
        if index.apply(worker, e.seq, &event) == Applied::NeedResync {
            resync = true;
            break;
        }
    }
    Outcome { resync: resync || index.needs_resync(worker), snapshot: ev.snapshot, blocks: index.blocks_of(worker) }
}

/// Router metrics for one heartbeat's outcome (outside the registry's lock).
pub(super) fn record(worker: &str, o: Outcome, distinct: usize) {
    if o.snapshot {
        metrics::counter!("ferry_router_kv_snapshots_total").increment(1);
    }
    if o.resync {
        metrics::counter!("ferry_router_kv_resyncs_total").increment(1);
    }
    metrics::gauge!("ferry_router_kv_indexed_blocks", "worker" => worker.to_string()).set(o.blocks as f64);
    metrics::gauge!("ferry_router_kv_indexed_blocks_distinct").set(distinct as f64);
}

/// A worker left the index: its gauge goes to 0.
pub(super) fn forget(index: &mut KvIndex<u64>, worker: &str) {
    if index.blocks_of(worker) > 0 || index.last_seq(worker) > 0 || index.needs_resync(worker) {
        metrics::gauge!("ferry_router_kv_indexed_blocks", "worker" => worker.to_string()).set(0.0);
    }
    index.remove_worker(worker);
    metrics::gauge!("ferry_router_kv_indexed_blocks_distinct").set(index.distinct_blocks() as f64);
}

impl Registry {
    /// How many of `chain`'s leading blocks worker `worker_id` holds, as its events tell (0 for a
    /// worker the index does not know or does not trust until its snapshot comes).
    pub fn prefix_held(&self, worker_id: &str, chain: &[u64]) -> usize {
        self.lock().kv.overlap(worker_id, chain)
    }

    /// For every worker holding at least `chain`'s first block: how many leading blocks it holds.
    pub fn prefix_overlaps(&self, chain: &[u64]) -> HashMap<String, usize> {
        self.lock().kv.overlaps(chain)
    }

    /// Blocks the index has worker `worker_id` holding.
    pub fn prefix_blocks(&self, worker_id: &str) -> usize {
        self.lock().kv.blocks_of(worker_id)
    }

    /// A request's block chain as the workers hash it: the full blocks of `tokens` (of
    /// `block_size` tokens) under the pool's model fingerprint and the request's cache `salt`
    /// (empty: shared by all). Empty before any worker registered (no fingerprint yet).
    pub fn prefix_chain(&self, salt: &[u8], tokens: &[u32], block_size: usize) -> Vec<u64> {
        let Some(fp) = self.fingerprint() else { return Vec::new() };
        if block_size == 0 {
            return Vec::new();
        }
        block_hashes(BlockHash::root(fp.as_bytes(), salt), tokens, block_size).into_iter().map(|h| h.0).collect()
    }
}

#[cfg(test)]
mod tests;
