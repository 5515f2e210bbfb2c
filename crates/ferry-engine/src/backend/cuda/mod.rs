//! The CUDA backend (feature `cuda`): cudarc with the driver, NVRTC and cuBLAS loaded at run time,
//! so building it needs no CUDA toolkit and a machine without a driver gets an error, not a crash.
//!
//! - Kernels: `kernels/*.cu` ([`kernels::KERNELS`]), compiled with NVRTC for the device's
//!   `compute_XY` on first use, cached per process and on disk by source hash ([`nvrtc`]).
//! - Activations are dense f32 matrices; weights are f32 (kept exact, so the golden fixtures hold
//!   to 1e-3) or bf16 (bf16/f16 files, and quantized GGUF types dequantized at load); GEMMs go
//!   through cuBLAS with f32 accumulation.
//! - The paged KV cache stores rows of its dtype (f32, bf16, f16 or int8 with a scale per row,
//!   `ferry_core::kv_dtype`), `[blocks, kv_heads, block_size]` rows per layer like the CPU
//!   backend's, sized from free device memory; attention reads them as stored ([`kv_kernels`]
//!   picks the kernels); export/import gather/scatter through a contiguous
//!   device buffer in the payload layout; [`DeviceBytes`] hands such a buffer to a device-to-device
//!   transport (NCCL) without a copy to the host.
//!
//! Without the feature, [`CudaBackend`] still exists (uninhabited) and [`CudaBackend::new`] says
//! the build has no CUDA.

pub mod dense;
pub mod kernels;
pub mod kv_kernels;

#[cfg(feature = "cuda")]
mod backend;
#[cfg(feature = "cuda")]
mod bytes;
#[cfg(feature = "cuda")]
mod direct;
#[cfg(feature = "cuda")]
mod driver;
#[cfg(feature = "cuda")]
mod measure;
#[cfg(feature = "cuda")]
pub mod ipc;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
mod ops;
// Its accounting is plain numbers, built (and unit-tested) without the feature too.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
mod profile;

#[cfg(feature = "cuda")]
pub use backend::{CudaBackend, CudaBatch, CudaKv, CudaTensor, CudaWeight};
#[cfg(feature = "cuda")]
pub use bytes::DeviceBytes;
#[cfg(feature = "cuda")]
pub use driver::device_uuid;

/// Stands in for the CUDA backend in a build without the `cuda` feature: it cannot be created.
#[cfg(not(feature = "cuda"))]
pub enum CudaBackend {}

#[cfg(not(feature = "cuda"))]
impl CudaBackend {
    /// Always [`EngineError::CudaNotBuilt`](crate::EngineError::CudaNotBuilt) in this build.
    pub fn new(ordinal: usize) -> crate::Result<Self> {
        Err(crate::EngineError::CudaNotBuilt(format!("cuda:{ordinal}")))
    }
}
