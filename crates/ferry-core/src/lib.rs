//! Ferry's pure types and decisions: no I/O, no async runtime, no device code.
//!
//! - [`block_pool`]: the paged KV cache's bookkeeping (vLLM's PagedAttention, SOSP '23 §4.2): a pool
//!   of fixed-size blocks with a free list and reference counts, and per-sequence block tables.
//! - [`prefix_cache`]: content-addressed full blocks (hash chains, index, LRU of cached blocks,
//!   stored/evicted events) that let a sequence attach a cached prompt prefix without recomputing it.
//! - [`kv_payload`]: the self-describing layout of one sequence's exported KV, the unit the cluster
//!   ships from a prefill worker to a decode worker.
//! - [`kv_index`]: the router's index of which worker holds which KV blocks, from their events.
//! - [`sampling`]: sampling parameters and their validation.
//! - [`processors`]: vLLM's logits processors (penalties, logit bias, `min_tokens`, bad words).
//! - [`logprobs`]: token log-probabilities (log-softmax of the raw logits, top alternatives).
//! - [`stop`]: stop strings over streamed text.
//! - [`failure`]: what the router does when a call to a worker fails (retry, migrate, wait, final).
//! - [`cache_policy`]: what prefix caches change in routing: decode ranking by prefix held, and
//!   whether a decode worker computes a short suffix itself.
//! - [`routing`]: the router's policy: prefill pick, decode ranking, leases.
//! - [`profile`]: a worker's measured step costs and the cost model fitted to them.
//! - [`autoscale`]: `ferry router --autoscale`'s policy (the split to run next, with hysteresis).
//! - [`sim`]: `ferry plan`'s discrete-event simulation of a router and its pools.
//! - [`arrivals`], [`slo`]: seeded Poisson arrivals and the latency/SLO arithmetic the simulator and
//!   the autoscaler use (the benchmarks' load generator itself lives in the `ferry` crate).
//! - [`schedule`]: what goes into an engine step (decode batch, prompt chunks, prompt admission).
//! - [`spec`]: speculative decoding's proposers without a draft model (prompt lookup, suffix index).

pub mod arrivals;
pub mod autoscale;
pub mod block_pool;
pub mod cache_policy;
pub mod failure;
pub mod finish;
pub mod kv_index;
pub mod kv_payload;
pub mod logprobs;
pub mod phase_clock;
pub mod prefix_cache;
pub mod processors;
pub mod profile;
#[cfg(test)]
mod prefix_cache_props;
pub mod routing;
pub mod kv_dtype;
pub mod sampling;
pub mod schedule;
pub mod sim;
pub mod slo;
pub mod spec;
pub mod stop;
pub mod text;

pub use block_pool::{BlockId, BlockPool, BlockTable, PoolError};
pub use prefix_cache::{BlockHash, CacheEvent, CacheEventKind, CacheStats, DiskEvent, Parent, Tenant};
pub use kv_index::{KvTier, Overlap};
pub use logprobs::{TokenLogprob, MAX_TOP_LOGPROBS};
pub use kv_payload::{KvDtype, KvLayout, KvPayloadError, KvPayloadHeader, KvSpan};
pub use routing::{WorkerRole, WorkerState};
pub use processors::Processors;
pub use sampling::{SamplingError, SamplingParams, MAX_CHOICES};
pub use stop::{Released, StopMatcher};
