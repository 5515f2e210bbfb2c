//! Ferry's inference engine: Llama-family models (Llama, Mistral, Qwen2, Qwen3) loaded from HF
//! safetensors folders or GGUF files, run over a paged KV cache on a [`backend::Backend`] (CPU now,
//! CUDA behind a feature), with sampling and streaming detokenization.
//!
//! The engine knows nothing of networking: the cluster drives [`Engine::step`] and ships the
//! payloads of [`Engine::export_kv`].

pub mod backend;
pub mod bench;
pub mod config;
pub mod engine;
pub mod error;
pub mod fetch;
pub mod kv_disk;
pub mod loader;
pub mod model;
pub mod sampler;
pub mod stop;
pub mod weights;

pub use backend::cpu::{Activations, CpuBackend};
pub use backend::{Device, DeviceBackend, KvBuffer};
pub use config::ModelConfig;
pub use engine::{Engine, EngineConfig, FinishReason, Generation, KvView, Logits, Prefetch, SeqId, Sequence, StepClock, StepItem};
pub use error::{EngineError, ErrorKind, Result};
