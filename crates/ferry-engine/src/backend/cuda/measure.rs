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
        self.ctx.bind_to_thread().map_err(|e| err("bind the context", describe(&e)))?;
        let a = self.stream.clone_htod(&vec![0x3f80u16; n * n]).map_err(|e| err("bf16_gemm_flops", describe(&e)))?;
        let b = self.stream.clone_htod(&vec![0x3f00u16; n * n]).map_err(|e| err("bf16_gemm_flops", describe(&e)))?;
        let mut c = self.stream.alloc_zeros::<u16>(n * n).map_err(|e| err("bf16_gemm_flops", describe(&e)))?;
        let bf16 = blas::cudaDataType::CUDA_R_16BF;
        let g = Gemm::single(false, false, n, n, n, n, n, n);
        let mut best = 0f64;
        for i in 0..=repeats.max(1) {
            self.stream.synchronize().map_err(|e| err("bf16_gemm_flops", describe(&e)))?;
            let t = Instant::now();
            {
                let (pa, _ga) = a.device_ptr(&self.stream);
                let (pb, _gb) = b.device_ptr(&self.stream);
                let (pc, _gc) = c.device_ptr_mut(&self.stream);
                let r = self.cublas_gemm("bf16_gemm_flops", &g, (pa, bf16), (pb, bf16), (pc, bf16), blas::cublasComputeType_t::CUBLAS_COMPUTE_32F);
                self.outcome("bf16_gemm_flops", r)?;
            }
            self.stream.synchronize().map_err(|e| err("bf16_gemm_flops", describe(&e)))?;
            if i > 0 {
                best = best.max(2.0 * (n as f64).powi(3) / t.elapsed().as_secs_f64());
            }
        }
        Ok(best)
    }
}
