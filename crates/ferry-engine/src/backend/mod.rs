//! The compute interface the model code is written against: exactly the operations a
//! Llama-family forward pass needs, over opaque device tensors, weights and paged KV storage.
//!
//! One forward step runs a flat batch of token rows that may mix prefill chunks and decode tokens
//! of many sequences (continuous batching, as in vLLM and Sarathi-Serve); [`BatchPlan`] says which
//! rows belong to which sequence, where each row's K/V goes, and which cached tokens each attends to.
//! The CPU backend lives in [`cpu`], the CUDA backend in [`cuda`] (feature `cuda`); [`device`]
//! picks one at run time.
//!
//! Errors: operations inside a step do not return `Result` (a step makes hundreds of calls); a
//! device backend records its first failure and reports it from [`Backend::run`], which wraps the
//! whole step, and skips the remaining work of that step.

mod buffer;
pub mod cpu;
pub mod cuda;
pub mod device;
mod rope;

pub use buffer::KvBuffer;
pub use device::{Device, DeviceBackend};
pub use rope::RopeTable;

use crate::error::Result;
use crate::weights::HostWeight;
use ferry_core::KvLayout;

/// One sequence's part of a batch: query rows `q_start..q_start+q_len` are its newest tokens,
/// at positions `ctx_len-q_len..ctx_len`; each attends causally to its cached prefix and itself.
#[derive(Clone, Debug)]
pub struct SeqPlan {
    pub q_start: usize,
    pub q_len: usize,
    pub ctx_len: usize,
    pub blocks: Vec<u32>,
}

/// The host-side description of one forward step.
#[derive(Clone, Debug, Default)]
pub struct BatchPlan {
    /// Position of each token row.
    pub positions: Vec<u32>,
    /// KV slot (`block * block_size + offset`) each token row writes.
    pub slots: Vec<u32>,
    pub seqs: Vec<SeqPlan>,
}

pub trait Backend: Send + Sync + Sized + 'static {
    /// A dense f32 matrix `[rows, cols]` on the device.
    type Tensor: Send;
    /// A weight (matrix in its storage type, or vector) on the device.
    type Weight: Send + Sync;
    /// Paged K/V storage for all layers.
    type Kv: Send;
    /// A [`BatchPlan`] in device form (positions, slots, block tables, RoPE angles).
    type Batch;

    fn describe(&self) -> String;
    /// Run a whole forward step in the backend's execution context (the CPU backend runs it on
    /// its own thread pool, so the many parallel regions of a step start without cross-thread
    /// hand-offs; a GPU backend binds its device and stream, waits for the step's work, and
    /// returns the first error any operation of the step met).
    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> Result<R>;
    fn upload(&self, w: &HostWeight) -> Result<Self::Weight>;
    /// A new `[rows, cols]` tensor to be written: every operation writes all of its output, so
    /// a backend need not clear it first (the CPU's comes zeroed, a GPU's uninitialized).
    fn tensor(&self, rows: usize, cols: usize) -> Self::Tensor;
    fn rows(&self, t: &Self::Tensor) -> usize;
    fn prepare(&self, plan: &BatchPlan, rope: &RopeTable) -> Self::Batch;

    /// `out[i] = table[ids[i]]` (dequantized).
    fn embed(&self, table: &Self::Weight, ids: &[u32], out: &mut Self::Tensor);
    /// `out = x / rms(x) * w`, row-wise.
    fn rms_norm(&self, x: &Self::Tensor, w: &Self::Weight, eps: f32, out: &mut Self::Tensor);
    /// RMSNorm over each `head_dim` slice of each row, in place (Qwen3's q/k norm).
    fn head_rms_norm(&self, x: &mut Self::Tensor, w: &Self::Weight, head_dim: usize, eps: f32);
    /// `x += y`.
    fn add(&self, x: &mut Self::Tensor, y: &Self::Tensor);
    /// `x += y`, then `out = x / rms(x) * w`: a residual add and the norm that reads its sum (a
    /// GPU does both in one kernel; by default, [`Backend::add`] then [`Backend::rms_norm`]).
    fn add_rms_norm(&self, x: &mut Self::Tensor, y: &Self::Tensor, w: &Self::Weight, eps: f32, out: &mut Self::Tensor) {
        self.add(x, y);
        self.rms_norm(x, w, eps, out);
    }
    /// For each `(w, bias)` pair: `out = x · wᵀ (+ bias)`. Several projections of the same input
    /// run as one parallel pass.
    fn matmul(&self, x: &Self::Tensor, ws: &[(&Self::Weight, Option<&Self::Weight>)], outs: &mut [&mut Self::Tensor]);
    /// Rotate each `head_dim` slice of each row by its row's position (HF rotate-half convention).
    fn rope(&self, x: &mut Self::Tensor, batch: &Self::Batch, head_dim: usize);
    /// [`Backend::rope`] of a step's queries and keys (a GPU does both in one kernel).
    fn rope_qk(&self, q: &mut Self::Tensor, k: &mut Self::Tensor, batch: &Self::Batch, head_dim: usize) {
        self.rope(q, batch, head_dim);
        self.rope(k, batch, head_dim);
    }
    /// `gate = silu(gate) * up`.
    fn silu_mul(&self, gate: &mut Self::Tensor, up: &Self::Tensor);
    /// Store each row's K and V at its slot in `layer`.
    fn kv_write(&self, kv: &mut Self::Kv, layer: usize, k: &Self::Tensor, v: &Self::Tensor, batch: &Self::Batch);
    /// Causal attention of each query row over its sequence's cached K/V (GQA).
    fn attention(&self, q: &Self::Tensor, kv: &Self::Kv, layer: usize, batch: &Self::Batch, out: &mut Self::Tensor);
    /// A new tensor of the selected rows.
    fn gather_rows(&self, x: &Self::Tensor, rows: &[usize]) -> Self::Tensor;
    /// Copy a tensor to the host, row-major.
    fn to_host(&self, x: &Self::Tensor) -> Vec<f32>;

    /// Bytes the KV cache may take when the backend has a fixed memory pool: `fraction` of the
    /// device memory free now (after the weights are uploaded). `None` for host memory, where the
    /// engine sizes the cache from the context length instead.
    fn kv_budget_bytes(&self, fraction: f32) -> Result<Option<usize>>;
    fn kv_alloc(&self, layout: &KvLayout, num_blocks: usize) -> Result<Self::Kv>;
    /// Append one layer of a sequence's K then V, token-contiguous `[tokens, kv_heads, head_dim]`,
    /// to `out` (the export payload's per-layer section).
    fn kv_export_layer(&self, kv: &Self::Kv, layer: usize, blocks: &[u32], tokens: usize, out: &mut Vec<u8>) -> Result<()>;
    /// The inverse of `kv_export_layer`: scatter `section` (K then V) into the given blocks.
    fn kv_import_layer(&self, kv: &mut Self::Kv, layer: usize, blocks: &[u32], tokens: usize, section: &[u8]) -> Result<()>;

    /// As [`Backend::kv_export_layer`], into a buffer in the backend's own memory (a device
    /// backend gathers into device memory and returns without waiting for the copy; users of the
    /// buffer wait for it).
    fn kv_export_layer_buffer(&self, kv: &Self::Kv, layer: usize, blocks: &[u32], tokens: usize) -> Result<KvBuffer> {
        let mut out = Vec::new();
        self.kv_export_layer(kv, layer, blocks, tokens, &mut out)?;
        Ok(KvBuffer::Host(out))
    }

    /// As [`Backend::kv_import_layer`], from bytes `section` of `buf` (a device backend
    /// scatters straight from a buffer on its own device).
    fn kv_import_layer_buffer(&self, kv: &mut Self::Kv, layer: usize, blocks: &[u32], tokens: usize, buf: &KvBuffer, section: std::ops::Range<usize>) -> Result<()> {
        import_layer_via_host(self, kv, layer, blocks, tokens, buf, section)
    }
}

/// [`Backend::kv_import_layer`] from bytes `section` of `buf` through host memory: a host buffer
/// in place, a device buffer copied out first. The default of `kv_import_layer_buffer`, and a
/// device backend's way for a buffer that is not on its device.
pub(crate) fn import_layer_via_host<B: Backend>(be: &B, kv: &mut B::Kv, layer: usize, blocks: &[u32], tokens: usize, buf: &KvBuffer, section: std::ops::Range<usize>) -> Result<()> {
    match buf.as_host() {
        Some(host) => {
            let bytes = host.get(section.clone()).ok_or_else(|| {
                crate::error::EngineError::Config(format!("KV section {}..{} outside a {}-byte buffer", section.start, section.end, host.len()))
            })?;
            be.kv_import_layer(kv, layer, blocks, tokens, bytes)
        }
        None => be.kv_import_layer(kv, layer, blocks, tokens, &buf.to_host(section)?),
    }
}
