//! The device's physical limits, measured in the same run as a benchmark: memory bandwidth (a
//! device-to-device copy; the decode roofline) and bf16 matrix throughput (a cuBLAS GEMM; the
//! prefill ceiling). Status: built, **never run on a GPU**.

use super::backend::CudaBackend;
use super::driver::describe;
use crate::error::{EngineError, Result};
use cudarc::cublas::sys as blas;
use cudarc::driver::{DevicePtr, DevicePtrMut};
use std::ffi::c_void;
use std::time::Instant;

fn err(op: &str, e: impl std::fmt::Display) -> EngineError {
    EngineError::Cuda { op: op.into(), reason: e.to_string() }
}

impl CudaBackend {
    /// Bytes per second a device-to-device copy of `bytes` moves, counting each byte read and
    /// written (as nvbandwidth and vendor figures do); best of `repeats` after one warm-up.
    pub fn copy_bandwidth(&self, bytes: usize, repeats: usize) -> Result<f64> {
        self.ctx.bind_to_thread().map_err(|e| err("bind the context", describe(&e)))?;
        let n = bytes / 4;
        let src = self.stream.alloc_zeros::<u32>(n).map_err(|e| err("copy_bandwidth", describe(&e)))?;
        let mut dst = self.stream.alloc_zeros::<u32>(n).map_err(|e| err("copy_bandwidth", describe(&e)))?;
        let mut best = 0f64;
        for i in 0..=repeats.max(1) {
            self.stream.synchronize().map_err(|e| err("copy_bandwidth", describe(&e)))?;
            let t = Instant::now();
            self.stream.memcpy_dtod(&src, &mut dst).map_err(|e| err("copy_bandwidth", describe(&e)))?;
            self.stream.synchronize().map_err(|e| err("copy_bandwidth", describe(&e)))?;
            if i > 0 {
                best = best.max((2 * n * 4) as f64 / t.elapsed().as_secs_f64());
            }
        }
        Ok(best)
    }

    /// FLOP/s of an `n`×`n`×`n` bf16 GEMM (bf16 in and out, f32 accumulation, as the model's
    /// GEMMs), best of `repeats` after one warm-up.
    pub fn bf16_gemm_flops(&self, n: usize, repeats: usize) -> Result<f64> {
        self.ctx.bind_to_thread().map_err(|e| err("bind the context", describe(&e)))?;
        let ni = i32::try_from(n).map_err(|_| err("bf16_gemm_flops", format!("n = {n} is too large")))?;
        // Non-zero operands (a GEMM over zeros runs faster than over data): 1.0 and 0.5 in bf16.
        let a = self.stream.clone_htod(&vec![0x3f80u16; n * n]).map_err(|e| err("bf16_gemm_flops", describe(&e)))?;
        let b = self.stream.clone_htod(&vec![0x3f00u16; n * n]).map_err(|e| err("bf16_gemm_flops", describe(&e)))?;
        let mut c = self.stream.alloc_zeros::<u16>(n * n).map_err(|e| err("bf16_gemm_flops", describe(&e)))?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let mut best = 0f64;
        for i in 0..=repeats.max(1) {
            self.stream.synchronize().map_err(|e| err("bf16_gemm_flops", describe(&e)))?;
            let t = Instant::now();
            {
                let (pa, _ga) = a.device_ptr(&self.stream);
                let (pb, _gb) = b.device_ptr(&self.stream);
                let (pc, _gc) = c.device_ptr_mut(&self.stream);
                // SAFETY: A, B, C are n×n bf16 on this handle's stream, alive past the call;
                // alpha/beta are host f32 as CUBLAS_COMPUTE_32F expects.
                unsafe {
                    cudarc::cublas::result::gemm_ex(
                        *self.blas.handle(),
                        blas::cublasOperation_t::CUBLAS_OP_N,
                        blas::cublasOperation_t::CUBLAS_OP_N,
                        ni,
                        ni,
                        ni,
                        &alpha as *const f32 as *const c_void,
                        pa as *const c_void,
                        blas::cudaDataType::CUDA_R_16BF,
                        ni,
                        pb as *const c_void,
                        blas::cudaDataType::CUDA_R_16BF,
                        ni,
                        &beta as *const f32 as *const c_void,
                        pc as *mut c_void,
                        blas::cudaDataType::CUDA_R_16BF,
                        ni,
                        blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                        blas::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
                    )
                }
                .map_err(|e| err("cublasGemmEx", format!("{e:?}")))?;
            }
            self.stream.synchronize().map_err(|e| err("bf16_gemm_flops", describe(&e)))?;
            if i > 0 {
                best = best.max(2.0 * (n as f64).powi(3) / t.elapsed().as_secs_f64());
            }
        }
        Ok(best)
    }
}
