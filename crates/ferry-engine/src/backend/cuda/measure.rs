//! The device's physical limits, measured in the same run as a benchmark: memory bandwidth (a
//! device-to-device copy; the decode roofline) and bf16 matrix throughput (a cuBLAS GEMM; the
//! prefill ceiling). Run on an H200 (docs/benchmarks.md).

use super::backend::CudaBackend;
use super::dense::Gemm;
use super::driver::describe;
use crate::error::{EngineError, Result};
use cudarc::cublas::sys as blas;
use cudarc::driver::{DevicePtr, DevicePtrMut};
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
        let g = Gemm::single(false, false, n, n, n, n, n, n);
        self.time_gemm("bf16_gemm_flops", &g, (n * n, n * n, n * n), true, repeats)
    }

    /// FLOP/s of the matmul `out[m, n] = x[m, k] · w[n, k]ᵀ` laid out as the backend's own
    /// (row-major weights, bf16 x and w, f32 accumulation), with an f32 output as the backend
    /// writes today or a bf16 one (`out_bf16`); best of `repeats` after one warm-up. What the
    /// model's prefill matmuls can reach, next to [`CudaBackend::bf16_gemm_flops`]'s square peak.
    pub fn matmul_flops(&self, m: usize, n: usize, k: usize, out_bf16: bool, repeats: usize) -> Result<f64> {
        let g = Gemm::single(true, false, n, m, k, k, k, n);
        self.time_gemm("matmul_flops", &g, (n * k, m * k, m * n), out_bf16, repeats)
    }

    /// Time one cuBLAS GEMM `g` over operands of `sizes` (A, B, C elements; A and B bf16, C bf16
    /// or f32): FLOP/s, best of `repeats` after one warm-up.
    fn time_gemm(&self, op: &str, g: &Gemm, sizes: (usize, usize, usize), out_bf16: bool, repeats: usize) -> Result<f64> {
        self.ctx.bind_to_thread().map_err(|e| err("bind the context", describe(&e)))?;
        let a = self.stream.clone_htod(&vec![0x3f80u16; sizes.0]).map_err(|e| err(op, describe(&e)))?;
        let b = self.stream.clone_htod(&vec![0x3f00u16; sizes.1]).map_err(|e| err(op, describe(&e)))?;
        // The output as 16-bit words: one per bf16 value, two per f32 one.
        let (c_words, c_ty) = if out_bf16 { (sizes.2, blas::cudaDataType::CUDA_R_16BF) } else { (2 * sizes.2, blas::cudaDataType::CUDA_R_32F) };
        let mut c = self.stream.alloc_zeros::<u16>(c_words).map_err(|e| err(op, describe(&e)))?;
        let bf16 = blas::cudaDataType::CUDA_R_16BF;
        let flops = 2.0 * g.m as f64 * g.n as f64 * g.k as f64 * g.batch as f64;
        let mut best = 0f64;
        for i in 0..=repeats.max(1) {
            self.stream.synchronize().map_err(|e| err(op, describe(&e)))?;
            let t = Instant::now();
            {
                let (pa, _ga) = a.device_ptr(&self.stream);
                let (pb, _gb) = b.device_ptr(&self.stream);
                let (pc, _gc) = c.device_ptr_mut(&self.stream);
                let r = self.cublas_gemm(op, g, (pa, bf16), (pb, bf16), (pc, c_ty), blas::cublasComputeType_t::CUBLAS_COMPUTE_32F);
                self.outcome(op, r)?;
            }
            self.stream.synchronize().map_err(|e| err(op, describe(&e)))?;
            if i > 0 {
                best = best.max(flops / t.elapsed().as_secs_f64());
            }
        }
        Ok(best)
    }
}
