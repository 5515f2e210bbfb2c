//! A worker's engine thread, prefill or decode, started before its services ([`EngineHandle`]).

use crate::decode::{self, Scheduling, SpecConfig};
use crate::fault::{EngineFault, FaultInjection};
use crate::load::LoadGauge;
use crate::prefill;
use crate::role::Role;
use ferry_engine::Engine;
use std::sync::Arc;

/// A worker's engine thread, started before its services.
pub enum EngineHandle {
    Prefill(prefill::PrefillHandle),
    Decode(decode::DecodeHandle),
}

/// How a worker's engine thread runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineOptions {
    /// Chunked prefill's per-step budget for a colocated worker (None: prefill first). Prefill
    /// workers chunk long prompts at the engine's `max_batch_tokens`.
    pub chunk_tokens: Option<usize>,
    /// Prefill workers: most prompts waiting to start (`--queue-max`).
    pub queue_max: usize,
    /// Failures injected on purpose (tests; see [`crate::fault::FaultInjection`]).
    pub faults: FaultInjection,
    /// Speculative decoding on decode and colocated workers (`--speculate`, `--spec-tokens`).
    pub spec: SpecConfig,
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions { chunk_tokens: None, queue_max: prefill::DEFAULT_QUEUE_MAX, faults: FaultInjection::default(), spec: SpecConfig::default() }
    }
}

impl EngineHandle {
    /// `chunk_tokens`: chunked prefill's per-step budget for a colocated worker (None: prefill
    /// first). Fault injection follows this process's environment ([`crate::fault::FaultInjection::from_env`]).
    pub fn start(role: Role, engine: Engine, model: &str, chunk_tokens: Option<usize>) -> Self {
        Self::start_with(role, engine, model, EngineOptions { chunk_tokens, faults: FaultInjection::from_env(), ..Default::default() })
    }

    pub fn start_with(role: Role, engine: Engine, model: &str, opts: EngineOptions) -> Self {
        let model = model.to_string();
        let EngineOptions { chunk_tokens, queue_max, faults, spec } = opts;
        let prefix_cache = engine.prefix_cache_enabled();
        let handle = match role {
            Role::Prefill => EngineHandle::Prefill(prefill::spawn_with(engine, model, prefill::PrefillOptions { queue_max, faults })),
            Role::Decode => EngineHandle::Decode(decode::spawn_with(engine, model, Scheduling { spec, ..Default::default() }, faults)),
            Role::Colocated => {
                EngineHandle::Decode(decode::spawn_with(engine, model, Scheduling { accept_prompts: true, chunk_tokens, spec }, faults))
            }
        };
        // Known before the first registration (the engine thread also sets it at every publish).
        handle.load().prefix_cache.store(prefix_cache, std::sync::atomic::Ordering::Relaxed);
        handle
    }

    /// Set once the engine thread has failed.
    pub fn fault(&self) -> Arc<EngineFault> {
        match self {
            EngineHandle::Prefill(h) => h.fault.clone(),
            EngineHandle::Decode(h) => h.fault.clone(),
        }
    }

    /// The live load gauge (KV blocks, sequences, queue), as the heartbeat reports it.
    pub fn load(&self) -> Arc<LoadGauge> {
        match self {
            EngineHandle::Prefill(h) => h.load.clone(),
            EngineHandle::Decode(h) => h.load.clone(),
        }
    }
}
