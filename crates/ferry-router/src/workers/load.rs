//! What the pipeline asks of the registry: ready workers ([`Ready`]), candidates with their
//! load for routing, the prefix index, and the in-flight accounting ([`InflightGuard`]).

use std::collections::HashMap;
use std::sync::Arc;

use ferry_core::prefix_cache::{BlockHash, block_hashes};
use ferry_core::routing::{DecodeCandidate, PrefillCandidate};
use ferry_core::kv_index::{KvTier, Overlap};
use ferry_core::{KvDtype, WorkerRole, WorkerState};

use crate::workers::registry::Registry;

/// Ready workers per role ([`Registry::ready`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ready {
    pub prefill: u32,
    pub decode: u32,
    pub colocated: u32,
}

impl Ready {
    /// Whether workers ready in these numbers can serve a request: a prefill and a decode worker,
    /// or a colocated one. gRPC `Health`, HTTP `/health` and [`crate::pipeline::start`] all ask this.
    pub fn can_serve(self) -> bool {
        (self.prefill > 0 && self.decode > 0) || self.colocated > 0
    }
}

impl Registry {
    /// Ready workers per role.
    pub fn ready(&self) -> Ready {
        let inner = self.lock();
        let n = |r| {
            inner
                .workers
                .values()
                .filter(|w| w.role == r && w.state == WorkerState::Ready)
                .count() as u32
        };
        Ready { prefill: n(WorkerRole::Prefill), decode: n(WorkerRole::Decode), colocated: n(WorkerRole::Colocated) }
    }

    /// Workers per (role, state), every combination present (for gauges).
    pub fn counts(&self) -> Vec<(WorkerRole, WorkerState, u32)> {
        let inner = self.lock();
        let mut out = Vec::new();
        for role in [
            WorkerRole::Prefill,
            WorkerRole::Decode,
            WorkerRole::Colocated,
        ] {
            for state in WorkerState::ALL {
                let n = inner
                    .workers
                    .values()
                    .filter(|w| w.role == role && w.state == state)
                    .count() as u32;
                out.push((role, state, n));
            }
        }
        out
    }

    /// Prefill candidates (in id order) for [`ferry_core::routing::pick_prefill`].
    pub fn prefill_candidates(&self) -> Vec<PrefillCandidate> {
        self.lock()
            .workers
            .values()
            .filter(|w| w.role == WorkerRole::Prefill)
            .map(|w| PrefillCandidate {
                id: w.id.clone(),
                state: w.state,
                inflight: w.inflight,
                outstanding_tokens: w.outstanding_prefill_tokens,
                reported_queue_tokens: w.load.queued_prefill_tokens,
                tokens_per_s: w.load.prefill_tokens_per_s,
                disk_read_tokens_per_s: w.load.disk_read_tokens_per_s,
            })
            .collect()
    }

    /// Candidates of `role` (decode or colocated: both admit by KV blocks) and the smallest block
    /// size among the ready ones (0 if unknown).
    pub fn decode_candidates(&self, role: WorkerRole) -> (Vec<DecodeCandidate>, u32) {
        let inner = self.lock();
        let decode = inner.workers.values().filter(|w| w.role == role);
        let block_size = decode
            .clone()
            .filter(|w| w.state == WorkerState::Ready)
            .map(|w| w.load.block_size)
            .min()
            .unwrap_or(0);
        let cands = decode
            .map(|w| DecodeCandidate {
                id: w.id.clone(),
                state: w.state,
                total_blocks: w.load.kv_blocks_total,
                free_blocks: w.load.kv_blocks_free,
                reserved_blocks: w.load.kv_blocks_reserved,
                active_sequences: w.load.active_sequences,
                router_inflight: w.inflight,
                router_promised_blocks: w.promised_blocks.min(u32::MAX as u64) as u32,
            })
            .collect();
        (cands, block_size)
    }

    fn adjust(&self, id: &str, inflight: i64, tokens: i64, blocks: i64) {
        if let Some(w) = self.lock().workers.get_mut(id) {
            w.inflight = (w.inflight as i64 + inflight).max(0) as u32;
            w.outstanding_prefill_tokens =
                (w.outstanding_prefill_tokens as i64 + tokens).max(0) as u64;
            // A prompt that finished prefill is in the worker's last report still (until its next
            // heartbeat): out of it now.
            if tokens < 0 {
                w.load.queued_prefill_tokens = w.load.queued_prefill_tokens.saturating_sub(tokens.unsigned_abs());
            }
            w.promised_blocks = (w.promised_blocks as i64 + blocks).max(0) as u64;
        }
        if inflight < 0 {
            self.room.notify_waiters();
        }
    }
}

/// One request in flight on one worker (and, for prefill, its prompt tokens): counted while the
/// guard lives, given back on drop, whatever path the request takes.
pub struct InflightGuard {
    registry: Arc<Registry>,
    worker: String,
    tokens: u64,
    blocks: u64,
}

impl InflightGuard {
    /// A prefill request of `tokens` prompt tokens.
    pub fn new(registry: &Arc<Registry>, worker: &str, tokens: u64) -> InflightGuard {
        registry.adjust(worker, 1, tokens as i64, 0);
        InflightGuard {
            registry: registry.clone(),
            worker: worker.into(),
            tokens,
            blocks: 0,
        }
    }

    /// A decode request admitted for `blocks` KV blocks.
    pub fn decode(registry: &Arc<Registry>, worker: &str, blocks: u64) -> InflightGuard {
        registry.adjust(worker, 1, 0, blocks as i64);
        InflightGuard {
            registry: registry.clone(),
            worker: worker.into(),
            tokens: 0,
            blocks,
        }
    }
}

impl Drop for InflightGuard {
    fn drop(&mut self) {
        self.registry.adjust(
            &self.worker,
            -1,
            -(self.tokens as i64),
            -(self.blocks as i64),
        );
    }
}

/// A request's block chains, one per KV dtype the live workers store (the dtype is part of a
/// block's hash, so an int8 worker and an f32 one hash the same prompt differently).
#[derive(Clone, Debug, Default)]
pub struct PrefixChains(Vec<(KvDtype, Vec<u64>)>);

impl PrefixChains {
    /// One chain, for workers storing `dtype`.
    pub fn single(dtype: KvDtype, chain: Vec<u64>) -> Self {
        Self(vec![(dtype, chain)])
    }
    /// The chain as workers storing `dtype` hash it (empty if none does).
    pub fn of(&self, dtype: KvDtype) -> &[u64] {
        self.0.iter().find(|(d, _)| *d == dtype).map(|(_, c)| c.as_slice()).unwrap_or_default()
    }
    /// No chain at all (no worker registered, or no full block).
    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|(_, c)| c.is_empty())
    }
}

/// The prefix index ([`kv`]) as the pipeline asks it.
impl Registry {
    /// How many of its chain's leading blocks (at most `max_blocks`) worker `worker_id` holds, in
    /// its pool or on its disk, as its events tell (none for a worker the index does not know or
    /// does not trust until its snapshot comes).
    pub fn prefix_held(&self, worker_id: &str, chains: &PrefixChains, max_blocks: usize) -> Overlap {
        let inner = self.lock();
        let Some(w) = inner.workers.get(worker_id) else { return Overlap::default() };
        let chain = chains.of(w.kv_dtype);
        inner.kv.overlap(worker_id, &chain[..chain.len().min(max_blocks)])
    }

    /// For every worker holding at least `chain`'s first block: how many leading blocks it holds
    /// (in either tier).
    pub fn prefix_overlaps(&self, chain: &[u64]) -> HashMap<String, usize> {
        self.lock().kv.overlaps(chain).into_iter().map(|(w, o)| (w, o.total())).collect()
    }

    /// Blocks the index has worker `worker_id` holding in its pool.
    pub fn prefix_blocks(&self, worker_id: &str) -> usize {
        self.prefix_blocks_in(worker_id, KvTier::Pool)
    }

    /// Blocks the index has worker `worker_id` holding in `tier`.
    pub fn prefix_blocks_in(&self, worker_id: &str, tier: KvTier) -> usize {
        self.lock().kv.blocks_of(worker_id, tier)
    }

    /// A request's block chains as the workers hash them: the full blocks of `tokens` (of
    /// `block_size` tokens) under the pool's model fingerprint, each live worker's KV dtype and
    /// the request's cache `salt` (empty: shared by all). Empty before any worker registered.
    pub fn prefix_chain(&self, salt: &[u8], tokens: &[u32], block_size: usize) -> PrefixChains {
        let (fp, mut dtypes) = {
            let inner = self.lock();
            let Some(fp) = inner.fingerprint.clone() else { return PrefixChains::default() };
            (fp, inner.workers.values().filter(|w| w.state != WorkerState::Dead).map(|w| w.kv_dtype).collect::<Vec<_>>())
        };
        if block_size == 0 {
            return PrefixChains::default();
        }
        dtypes.sort_by_key(|d| d.name());
        dtypes.dedup();
        PrefixChains(
            dtypes
                .into_iter()
                .map(|d| (d, block_hashes(BlockHash::cache_root(fp.as_bytes(), d, salt), tokens, block_size).into_iter().map(|h| h.0).collect()))
                .collect(),
        )
    }
}
