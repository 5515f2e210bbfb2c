//! The CUDA backend's state and values: one device context and stream, the kernels (NVRTC, loaded
//! once), a cuBLAS handle, and the first error of the current step (operations inside a step
//! record a failure instead of returning it; [`Backend::run`](crate::backend::Backend::run)
//! reports it and later operations of the step do nothing).

use super::driver::{self, describe};
use super::kv_kernels::{AttentionSplit, KvKernels};
use super::nvrtc;
use crate::error::{EngineError, Result};
use crate::weights::HostWeight;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg, ValidAsZeroBits};
use ferry_core::KvLayout;
use ferry_quant::WeightType;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Threads per block of the elementwise (grid-stride) kernels.
pub(crate) const BLOCK: u32 = 256;

/// The most rows a matmul hands the GEMV kernel (`GEMV_MAX_ROWS` in kernels/gemv.cu), and the
/// output columns each of its blocks computes (`GEMV_WARPS`).
pub(crate) const GEMV_MAX_ROWS: usize = 8;
pub(crate) const GEMV_COLS_PER_BLOCK: usize = 8;

/// A dense f32 matrix `[rows, cols]` on the device. `buf` is `None` only when its allocation
/// failed (the failure is recorded; the step reports it).
pub struct CudaTensor {
    pub(crate) buf: Option<CudaSlice<f32>>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

/// A weight on the device, in the type its GEMM reads.
pub(crate) enum WeightData {
    /// f32 (vectors always; f32 matrices, so f32 checkpoints keep the reference's precision).
    F32(CudaSlice<f32>),
    /// bf16 bits (bf16 checkpoints, and every quantized GGUF type dequantized at load).
    Bf16(CudaSlice<u16>),
    /// IEEE half bits (f16 checkpoints).
    F16(CudaSlice<u16>),
}

pub struct CudaWeight {
    pub(crate) data: WeightData,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

/// Paged K/V: per layer, `[num_blocks, kv_heads, block_size]` rows of the layout's dtype (as the
/// CPU backend), held as 32-bit words (`row_bytes` is a whole number of them: see
/// [`KvKernels::for_layout`]); the kernels read them as the stored type.
pub struct CudaKv {
    pub(crate) layout: KvLayout,
    pub(crate) num_blocks: usize,
    /// The kernels of this cache's dtype.
    pub(crate) kernels: KvKernels,
    pub(crate) k: Vec<CudaSlice<u32>>,
    pub(crate) v: Vec<CudaSlice<u32>>,
}

/// A [`BatchPlan`](crate::backend::BatchPlan) on the device (`None` if its upload failed).
pub struct CudaBatch {
    pub(crate) rows: usize,
    pub(crate) seqs: usize,
    /// Every sequence contributes exactly one row (a pure decode batch).
    pub(crate) decode_only: bool,
    /// The longest context of the batch's sequences (a split decode's parts cover it).
    pub(crate) max_ctx: usize,
    pub(crate) max_slot: u32,
    pub(crate) max_block: u32,
    pub(crate) bufs: Option<BatchBufs>,
    /// The sequences whose chunk is long enough to attend with GEMMs (see `ops.rs`).
    pub(crate) dense: Vec<DenseSeq>,
}

/// A sequence of a batch attended with GEMMs: where its rows and block table are.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DenseSeq {
    pub(crate) q_start: usize,
    pub(crate) q_len: usize,
    pub(crate) ctx_len: usize,
    pub(crate) block_start: usize,
}

/// A step's arrays on the device: one buffer (`all`, uploaded in one copy) and the device address
/// of each array in it, which kernels take as pointers (valid while `all` lives: the batch outlives
/// the step's kernels, which the step waits for).
pub(crate) struct BatchBufs {
    /// Held, not read: the addresses below point into it.
    #[allow(dead_code)]
    pub(crate) all: CudaSlice<u32>,
    /// Per row: the cache slot its K/V goes to.
    pub(crate) slots: u64,
    /// Per row: RoPE's cos and sin (f32), head_dim/2 each.
    pub(crate) cos: u64,
    pub(crate) sin: u64,
    /// Per row: its sequence.
    pub(crate) row_seq: u64,
    /// Per sequence: its first row, rows, context length, and where its block table starts in
    /// `blocks` (the concatenated tables).
    pub(crate) q_start: u64,
    pub(crate) q_len: u64,
    pub(crate) ctx_len: u64,
    pub(crate) block_start: u64,
    pub(crate) blocks: u64,
    /// Per sequence: 1 if it is in `CudaBatch::dense` (the prefill kernel skips it).
    pub(crate) skip: u64,
}

pub struct CudaBackend {
    pub(crate) ordinal: usize,
    pub(crate) ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    pub(crate) blas: CudaBlas,
    fns: HashMap<&'static str, CudaFunction>,
    name: String,
    arch: String,
    /// Upload every weight as f32 (`FERRY_CUDA_F32_WEIGHTS=1`): the reference's exact math for
    /// bf16/f16/quantized checkpoints too, at twice to eight times the memory.
    f32_weights: bool,
    /// The first failure since the last [`CudaBackend::take_error`].
    error: Mutex<Option<EngineError>>,
    /// This device's KV buffer kit (exported layers are handed out in its buffers).
    pub(crate) kit: Arc<super::bytes::Kit>,
    /// A half-precision matrix was uploaded (the model computes in bf16/f16): attention GEMMs may
    /// then use TF32 tensor cores; an f32 model keeps exact f32 GEMMs.
    pub(crate) half_weights: std::sync::atomic::AtomicBool,
    /// Streaming multiprocessors of the device (how many blocks a decode's attention aims for).
    pub(crate) sms: usize,
    /// How a decode batch's attention splits long contexts (`FERRY_CUDA_ATTENTION_SPLIT`).
    split: Mutex<AttentionSplit>,
    /// Matmuls of at most [`GEMV_MAX_ROWS`] rows against 16-bit weights use the GEMV kernel
    /// (`kernels/gemv.cu`) instead of cuBLAS (`FERRY_CUDA_GEMV=off` turns it off).
    pub(crate) gemv: std::sync::atomic::AtomicBool,
    /// Where each step's GPU time goes (`FERRY_CUDA_PROFILE=1`), reported when dropped.
    pub(crate) profile: Option<super::profile::Profile>,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        if let Some(p) = &self.profile {
            eprint!("{}", p.report());
        }
    }
}

impl CudaBackend {
    /// Open device `ordinal`, compile (or load from cache) every kernel for its architecture and
    /// create a cuBLAS handle. Fails with a clear error, never a panic, when there is no driver,
    /// no such device, no NVRTC or no cuBLAS.
    pub fn new(ordinal: usize) -> Result<Self> {
        let ctx = driver::open(ordinal)?;
        let dev = format!("cuda:{ordinal}");
        let fail = |what: &str, e: String| EngineError::DeviceUnavailable(dev.clone(), format!("{what}: {e}"));
        // SAFETY: this backend issues all its work on one stream, so cudarc's cross-stream event
        // tracking is not needed (it would record an event per kernel argument).
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| fail("cannot create a stream", describe(&e)))?;
        let (major, minor) = ctx.compute_capability().map_err(|e| fail("cannot read the compute capability", describe(&e)))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".into());
        let arch = format!("compute_{major}{minor}");
        let opts = nvrtc::CompileOptions::for_arch(arch.clone());
        let mut fns = HashMap::new();
        for (k, ptx) in nvrtc::compile_all(&opts)? {
            let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx)).map_err(|e| fail(&format!("cannot load the PTX of {}", k.file), describe(&e)))?;
            for &f in k.functions {
                let func = module.load_function(f).map_err(|e| fail(&format!("kernel {f} of {}", k.file), describe(&e)))?;
                fns.insert(f, func);
            }
        }
        let blas = CudaBlas::new(stream.clone()).map_err(|e| fail("cannot create a cuBLAS handle", format!("{e:?}")))?;
        let f32_weights = std::env::var("FERRY_CUDA_F32_WEIGHTS").is_ok_and(|v| v == "1");
        let kit = super::bytes::Kit::for_device(ordinal)?;
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| fail("cannot read the number of SMs", describe(&e)))?
            .max(1) as usize;
        let split = AttentionSplit::parse(std::env::var("FERRY_CUDA_ATTENTION_SPLIT").ok().as_deref()).map_err(EngineError::Config)?;
        let gemv = match std::env::var("FERRY_CUDA_GEMV").as_deref() {
            Err(_) | Ok("on") => true,
            Ok("off") => false,
            Ok(v) => return Err(EngineError::Config(format!("FERRY_CUDA_GEMV must be on or off, not {v:?}"))),
        };
        let profile = super::profile::Profile::from_env(&stream);
        Ok(Self { ordinal, ctx, stream, blas, fns, name, arch, f32_weights, error: Mutex::new(None), kit, half_weights: Default::default(), sms, split: Mutex::new(split), gemv: gemv.into(), profile })
    }

    /// How decode attention splits long contexts from now on (tests compare the paths).
    pub fn set_attention_split(&self, split: AttentionSplit) {
        *self.split.lock().unwrap_or_else(|p| p.into_inner()) = split;
    }

    /// Whether matmuls of few rows use the GEMV kernel from now on (tests compare both paths).
    pub fn set_gemv(&self, on: bool) {
        self.gemv.store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Time operation `op` until the guard drops, when profiling.
    pub(crate) fn timed(&self, op: &'static str) -> Option<super::profile::Timed<'_>> {
        self.profile.as_ref().map(|p| p.time(op))
    }

    pub(crate) fn attention_split(&self) -> AttentionSplit {
        *self.split.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    pub(crate) fn describe_device(&self) -> String {
        let weights = if self.f32_weights { "f32 weights" } else { "f32/bf16/f16 weights" };
        format!("cuda:{} ({}, {}, cuBLAS, {weights}, f32 activations)", self.ordinal, self.name, self.arch)
    }

    /// Record the first failure of this step.
    pub(crate) fn fail(&self, op: &str, reason: impl std::fmt::Display) {
        let mut e = self.error.lock().unwrap_or_else(|p| p.into_inner());
        if e.is_none() {
            *e = Some(EngineError::Cuda { op: op.into(), reason: reason.to_string() });
        }
    }

    /// Whether no failure is recorded (operations skip their work otherwise).
    pub(crate) fn healthy(&self) -> bool {
        self.error.lock().map(|e| e.is_none()).unwrap_or(false)
    }

    pub(crate) fn take_error(&self) -> Option<EngineError> {
        self.error.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// The value an operation returned, or the first failure recorded meanwhile (one that
    /// returned nothing without recording why is reported under `op`).
    pub(crate) fn outcome<T>(&self, op: &str, r: Option<T>) -> Result<T> {
        match (r, self.take_error()) {
            (_, Some(e)) => Err(e),
            (Some(v), None) => Ok(v),
            (None, None) => Err(EngineError::Cuda { op: op.into(), reason: "failed without a recorded cause".into() }),
        }
    }

    /// `Ok(v)` → `Some(v)`; an error is recorded under `op` → `None`.
    pub(crate) fn check<T, E: std::fmt::Debug>(&self, op: &str, r: std::result::Result<T, E>) -> Option<T> {
        r.map_err(|e| self.fail(op, format!("{e:?}"))).ok()
    }

    pub(crate) fn func(&self, name: &str) -> Option<&CudaFunction> {
        let f = self.fns.get(name);
        if f.is_none() {
            self.fail(name, "no such kernel was compiled");
        }
        f
    }

    /// A zeroed device buffer (an empty one for `n == 0`).
    pub(crate) fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, op: &str, n: usize) -> Option<CudaSlice<T>> {
        let r = if n == 0 { self.stream.null() } else { self.stream.alloc_zeros::<T>(n) };
        r.map_err(|e| self.fail(op, format!("cannot allocate {} bytes: {}", n * std::mem::size_of::<T>(), describe(&e)))).ok()
    }

    /// A device buffer of `n` elements left uninitialized (one allocation, no memset launch): for
    /// scratch whose every element the next operation writes before anything reads it.
    pub(crate) fn uninit<T: DeviceRepr + ValidAsZeroBits>(&self, op: &str, n: usize) -> Option<CudaSlice<T>> {
        if n == 0 {
            return self.zeros(op, 0);
        }
        // SAFETY: the callers write every element before reading it (see each call); T is plain
        // data (ValidAsZeroBits), so no value of it is invalid.
        let r = unsafe { self.stream.alloc::<T>(n) };
        r.map_err(|e| self.fail(op, format!("cannot allocate {} bytes: {}", n * std::mem::size_of::<T>(), describe(&e)))).ok()
    }

    /// Copy a host slice to a new device buffer.
    pub(crate) fn upload_slice<T: DeviceRepr>(&self, op: &str, host: &[T]) -> Option<CudaSlice<T>> {
        let r = if host.is_empty() { self.stream.null() } else { self.stream.clone_htod(host) };
        r.map_err(|e| self.fail(op, format!("cannot copy {} bytes to the device: {}", std::mem::size_of_val(host), describe(&e)))).ok()
    }

    /// A launch configuration for a grid-stride loop over `n` elements.
    pub(crate) fn grid(n: usize) -> LaunchConfig {
        let blocks = n.div_ceil(BLOCK as usize).clamp(1, 1 << 20) as u32;
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 }
    }

    /// Upload a weight: f32 stays f32, bf16 stays bf16, f16 stays f16; Q8_0/Q4_0/Q4_1 are
    /// dequantized to bf16 on the device, Q4_K/Q6_K on the host (ferry-quant) then converted.
    pub(crate) fn upload_weight(&self, w: &HostWeight) -> Result<CudaWeight> {
        let (rows, cols) = (w.rows(), w.cols());
        let err = |reason: String| EngineError::Cuda { op: format!("upload {}", w.name), reason };
        let data = if let (crate::weights::Storage::Random(r), WeightType::BF16, false) = (&w.storage, w.ty, self.f32_weights) {
            // A synthetic model: generate on the device (16 GB for an 8B model, no host copy).
            let mut dst = self.stream.alloc_zeros::<u16>(r.numel).map_err(|e| err(describe(&e)))?;
            let f = self.func("fill_random_bf16").ok_or_else(|| err("kernel fill_random_bf16 missing".into()))?;
            let n = r.numel as u64;
            let mut b = self.stream.launch_builder(f);
            b.arg(&mut dst).arg(&n).arg(&r.seed).arg(&r.scale);
            // SAFETY: dst holds numel u16; the kernel writes only below n.
            unsafe { b.launch(Self::grid(r.numel)) }.map_err(|e| err(describe(&e)))?;
            WeightData::Bf16(dst)
        } else if w.shape.len() == 1 || w.ty == WeightType::F32 || self.f32_weights {
            WeightData::F32(self.stream.clone_htod(w.to_f32().as_slice()).map_err(|e| err(describe(&e)))?)
        } else {
            let bytes = w.bytes();
            match w.ty {
                WeightType::BF16 | WeightType::F16 => {
                    let bits: Vec<u16> = bytes.chunks_exact(2).map(|b| u16::from_le_bytes([b[0], b[1]])).collect();
                    let dev = self.stream.clone_htod(bits.as_slice()).map_err(|e| err(describe(&e)))?;
                    if w.ty == WeightType::BF16 { WeightData::Bf16(dev) } else { WeightData::F16(dev) }
                }
                WeightType::Q8_0 | WeightType::Q4_0 | WeightType::Q4_1 => {
                    let kernel = match w.ty {
                        WeightType::Q8_0 => "dequant_q8_0_bf16",
                        WeightType::Q4_0 => "dequant_q4_0_bf16",
                        _ => "dequant_q4_1_bf16",
                    };
                    let src = self.stream.clone_htod(bytes).map_err(|e| err(describe(&e)))?;
                    let mut dst = self.stream.alloc_zeros::<u16>(rows * cols).map_err(|e| err(describe(&e)))?;
                    let n_blocks = rows * cols / 32;
                    let f = self.func(kernel).ok_or_else(|| err(format!("kernel {kernel} missing")))?;
                    let mut b = self.stream.launch_builder(f);
                    b.arg(&src).arg(&mut dst).arg(&n_blocks);
                    // SAFETY: src holds n_blocks whole blocks (HostWeight::check verified the byte
                    // length for the shape) and dst rows*cols = 32*n_blocks elements; the kernel
                    // reads and writes only within those.
                    unsafe { b.launch(Self::grid(n_blocks)) }.map_err(|e| err(describe(&e)))?;
                    WeightData::Bf16(dst)
                }
                WeightType::Q4_K | WeightType::Q6_K | WeightType::F32 => {
                    let bits: Vec<u16> = w.to_f32().into_iter().map(|x| half::bf16::from_f32(x).to_bits()).collect();
                    WeightData::Bf16(self.stream.clone_htod(bits.as_slice()).map_err(|e| err(describe(&e)))?)
                }
            }
        };
        if matches!(data, WeightData::Bf16(_) | WeightData::F16(_)) {
            self.half_weights.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(CudaWeight { data, rows, cols })
    }

    /// The KV cache: `num_blocks` blocks per layer for K and for V, in the layout's dtype.
    pub(crate) fn alloc_kv(&self, layout: &KvLayout, num_blocks: usize) -> Result<CudaKv> {
        let kernels = KvKernels::for_layout(layout).map_err(EngineError::Config)?;
        let n = num_blocks * layout.n_kv_heads * layout.block_size * kernels.row_words;
        let alloc = || {
            self.stream.alloc_zeros::<u32>(n).map_err(|e| EngineError::Cuda {
                op: "kv_alloc".into(),
                reason: format!("cannot allocate {} bytes for {num_blocks} {} KV blocks of a layer: {}", n * 4, layout.dtype, describe(&e)),
            })
        };
        let (mut k, mut v) = (Vec::with_capacity(layout.n_layers), Vec::with_capacity(layout.n_layers));
        for _ in 0..layout.n_layers {
            k.push(alloc()?);
            v.push(alloc()?);
        }
        Ok(CudaKv { layout: *layout, num_blocks, kernels, k, v })
    }

    /// Free device memory × `fraction`.
    pub(crate) fn free_memory(&self, fraction: f32) -> Result<usize> {
        if !(fraction > 0.0 && fraction <= 1.0) {
            return Err(EngineError::Config(format!("the KV memory fraction must be in (0, 1], not {fraction}")));
        }
        let (free, _total) = self.ctx.mem_get_info().map_err(|e| EngineError::Cuda { op: "mem_get_info".into(), reason: describe(&e) })?;
        Ok((free as f64 * fraction as f64) as usize)
    }
}
