//! CUDA operations outside the [`Backend`](crate::backend::Backend) trait: sampling on the device
//! (greedy and top-p, so a decode step can return token ids instead of logits), the fused
//! residual-add + RMSNorm, and host ↔ device tensors for tests. Each returns its own error.

use super::backend::{BLOCK, CudaBackend, CudaTensor, CudaWeight, WeightData};
use crate::error::{EngineError, Result};
use cudarc::driver::{LaunchConfig, PushKernelArg};

/// Threads per block of the sampling kernels (SAMPLE_BLOCK in sampling.cu).
const SAMPLE_THREADS: u32 = 1024;

impl CudaBackend {
    /// Run `f` (which records failures) and return its value or the first failure.
    fn direct<T>(&self, f: impl FnOnce() -> Option<T>) -> Result<T> {
        let _ = self.take_error();
        let r = f();
        if let Err(e) = self.stream.synchronize() {
            self.fail("stream synchronize", super::driver::describe(&e));
        }
        self.outcome("direct operation", r)
    }

    /// A device tensor holding `data` (`rows × cols`, row-major).
    pub fn tensor_from(&self, rows: usize, cols: usize, data: &[f32]) -> Result<CudaTensor> {
        if data.len() != rows * cols {
            return Err(EngineError::Config(format!("{} values for a {rows}x{cols} tensor", data.len())));
        }
        self.direct(|| Some(CudaTensor { buf: Some(self.upload_slice("tensor_from", data)?), rows, cols }))
    }

    /// Greedy sampling: the first index of each row's maximum.
    pub fn argmax(&self, logits: &CudaTensor) -> Result<Vec<u32>> {
        self.direct(|| {
            let (rows, vocab) = (logits.rows, logits.cols);
            let buf = logits.buf.as_ref()?;
            let mut out = self.zeros::<u32>("argmax", rows)?;
            let v = i32::try_from(vocab).ok()?;
            let f = self.func("argmax_f32")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(buf).arg(&v).arg(&mut out);
            let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (SAMPLE_THREADS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: logits are rows×vocab, out holds rows ids.
            self.check("argmax_f32", unsafe { b.launch(cfg) })?;
            self.check("argmax", self.stream.clone_dtoh(&out))
        })
    }

    /// Top-p sampling at `temperature` (> 0) with one uniform draw in [0, 1) per row (see
    /// kernels/sampling.cu for how it differs from the host sampler).
    pub fn sample_top_p(&self, logits: &CudaTensor, temperature: f32, top_p: f32, uniforms: &[f32]) -> Result<Vec<u32>> {
        if !(temperature > 0.0 && temperature.is_finite()) || !(top_p > 0.0 && top_p <= 1.0) || uniforms.len() != logits.rows || uniforms.iter().any(|u| !(0.0..1.0).contains(u)) {
            return Err(EngineError::Config(format!(
                "top-p sampling needs temperature > 0 (got {temperature}), top_p in (0, 1] (got {top_p}) and one draw in [0, 1) per row ({} for {} rows)",
                uniforms.len(),
                logits.rows
            )));
        }
        self.direct(|| {
            let (rows, vocab) = (logits.rows, logits.cols);
            let buf = logits.buf.as_ref()?;
            let u = self.upload_slice("sample_top_p", uniforms)?;
            let mut out = self.zeros::<u32>("sample_top_p", rows)?;
            let v = i32::try_from(vocab).ok()?;
            let f = self.func("sample_top_p_f32")?;
            let mut b = self.stream.launch_builder(f);
            b.arg(buf).arg(&v).arg(&temperature).arg(&top_p).arg(&u).arg(&mut out);
            let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (SAMPLE_THREADS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: logits are rows×vocab, uniforms and out hold rows values.
            self.check("sample_top_p_f32", unsafe { b.launch(cfg) })?;
            self.check("sample_top_p", self.stream.clone_dtoh(&out))
        })
    }

    /// Queue `x += y; out = rmsnorm(x) * w` in one kernel (the step's [`Backend::add_rms_norm`]
    /// and the direct form below); a bad shape is the error.
    ///
    /// [`Backend::add_rms_norm`]: crate::backend::Backend::add_rms_norm
    pub(crate) fn launch_add_rms_norm(&self, x: &mut CudaTensor, y: &CudaTensor, w: &CudaWeight, eps: f32, out: &mut CudaTensor) -> std::result::Result<(), String> {
        let WeightData::F32(wv) = &w.data else { return Err("norm weights must be f32 vectors".into()) };
        if (x.rows, x.cols) != (y.rows, y.cols) || (x.rows, x.cols) != (out.rows, out.cols) || wv.len() != x.cols {
            return Err(format!("add_rms_norm: x {}x{}, y {}x{}, out {}x{}, weight {}", x.rows, x.cols, y.rows, y.cols, out.rows, out.cols, wv.len()));
        }
        let (Ok(r), Ok(c)) = (i32::try_from(x.rows), i32::try_from(x.cols)) else { return Err(format!("{}x{} does not fit the kernel's int arguments", x.rows, x.cols)) };
        if x.rows == 0 {
            return Ok(());
        }
        // A tensor without a buffer is one whose allocation failed (in a step, recorded then; the
        // direct form below cleared that record, so it is said again here).
        let (Some(xb), Some(yb), Some(ob)) = (x.buf.as_mut(), y.buf.as_ref(), out.buf.as_mut()) else { return Err("a tensor whose allocation failed".into()) };
        let Some(f) = self.func("add_rms_norm_f32") else { return Ok(()) };
        let mut b = self.stream.launch_builder(f);
        b.arg(xb).arg(yb).arg(wv).arg(ob).arg(&r).arg(&c).arg(&eps);
        let cfg = LaunchConfig { grid_dim: (x.rows as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: x, y, out are rows×cols, w holds cols.
        self.check("add_rms_norm_f32", unsafe { b.launch(cfg) });
        Ok(())
    }

    /// `x += y; out = rmsnorm(x) * w` in one kernel, waited for.
    pub fn add_rms_norm(&self, x: &mut CudaTensor, y: &CudaTensor, w: &CudaWeight, eps: f32, out: &mut CudaTensor) -> Result<()> {
        self.direct(|| match self.launch_add_rms_norm(x, y, w, eps, out) {
            Ok(()) => Some(()),
            Err(e) => {
                self.fail("add_rms_norm", e);
                None
            }
        })
    }
}
