//! [`Backend`] for [`CudaBackend`]: each operation checks shapes on the host, then launches its
//! kernel (`kernels/*.cu`) or cuBLAS GEMM on the backend's stream. A failure is recorded, not
//! returned, and the step's [`Backend::run`] reports it.

use super::backend::{BLOCK, GEMV_COLS_PER_BLOCK, GEMV_MAX_ROWS, BatchBufs, CudaBackend, CudaBatch, CudaKv, CudaTensor, CudaWeight, DenseSeq, WeightData};
use super::bytes::{f32s_of, DeviceBytes};
use super::dense::{Chunk, Gemm};
use super::kv_kernels::{GATHER, MERGE, SCATTER};
use super::driver::describe;
use crate::backend::{Backend, BatchPlan, KvBuffer, RopeTable};
use crate::error::{EngineError, Result};
use crate::weights::HostWeight;
use cudarc::cublas::sys as blas;
use cudarc::driver::{CudaSlice, CudaView, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg};
use ferry_core::KvLayout;
use std::ffi::c_void;

/// Threads per block of the attention kernels (ATT_WARPS warps in attention.cu).
const ATT_THREADS: u32 = 128;
/// Largest head_dim the attention kernels take (32 lanes × ATT_DIMS_PER_LANE).
const ATT_MAX_HEAD_DIM: usize = 256;
/// Prefill chunks of at least this many rows attend with GEMMs (tensor cores; the kernel reads
/// each key once per query row, which long prompts cannot afford).
const DENSE_ATTENTION_MIN_Q: usize = 64;

fn i32_of(op: &str, be: &CudaBackend, v: usize) -> Option<i32> {
    i32::try_from(v).map_err(|_| be.fail(op, format!("size {v} does not fit the kernel's int argument"))).ok()
}

impl CudaBackend {
    /// `out = x · wᵀ` (row-major), by cuBLAS with f32 accumulation; x is cast to the weight's
    /// half type first when the weight is bf16/f16 (once per matmul call: `half_x` keeps the
    /// bf16 and the f16 copy for the call's other weights).
    fn gemm(&self, x: &CudaSlice<f32>, m: usize, w: &CudaWeight, out: &mut CudaSlice<f32>, half_x: &mut [Option<CudaSlice<u16>>; 2]) -> Option<()> {
        let (n, k) = (w.rows, w.cols);
        let op = "matmul";
        // Column-major view: outᵀ[n, m] = W[k, n]ᵀ · xᵀ[k, m], so A = W (transposed), B = x.
        let (a_ptr, a_ty, b_ptr, b_ty, _ga, _gb);
        match &w.data {
            WeightData::F32(wd) => {
                let (pa, ga) = wd.device_ptr(&self.stream);
                let (pb, gb) = x.device_ptr(&self.stream);
                (a_ptr, a_ty, b_ptr, b_ty, _ga, _gb) = (pa, blas::cudaDataType::CUDA_R_32F, pb, blas::cudaDataType::CUDA_R_32F, ga, gb);
            }
            WeightData::Bf16(wd) | WeightData::F16(wd) => {
                let (cast, ty, slot) = match &w.data {
                    WeightData::Bf16(_) => ("to_bf16_f32", blas::cudaDataType::CUDA_R_16BF, 0),
                    _ => ("to_f16_f32", blas::cudaDataType::CUDA_R_16F, 1),
                };
                if half_x[slot].is_none() {
                    let _t = self.timed("· matmul: cast x to 16 bits");
                    let count = m * k;
                    let mut h = self.uninit::<u16>(op, count)?;
                    let f = self.func(cast)?;
                    let mut b = self.stream.launch_builder(f);
                    b.arg(x).arg(&mut h).arg(&count);
                    // SAFETY: x holds m*k f32 (checked by the caller) and h m*k u16, every one
                    // written here.
                    self.check(cast, unsafe { b.launch(Self::grid(count)) })?;
                    half_x[slot] = Some(h);
                }
                let h = half_x[slot].as_ref()?;
                let (pa, ga) = wd.device_ptr(&self.stream);
                let (pb, gb) = h.device_ptr(&self.stream);
                (a_ptr, a_ty, b_ptr, b_ty, _ga, _gb) = (pa, ty, pb, ty, ga, gb);
            }
        }
        let (c_ptr, _gc) = out.device_ptr_mut(&self.stream);
        // A is n×k (row-major weight, lda = k), B is m×k (row-major activations, ldb = k), C is
        // m×n (row-major output, ldc = n); the guards keep them alive past the call.
        let g = Gemm::single(true, false, n, m, k, k, k, n);
        self.cublas_gemm("matmul", &g, (a_ptr, a_ty), (b_ptr, b_ty), (c_ptr, blas::cudaDataType::CUDA_R_32F), blas::cublasComputeType_t::CUBLAS_COMPUTE_32F)
    }

    /// The GEMV kernel for a matmul of `x` against `ws`, if it takes it: at most
    /// [`GEMV_MAX_ROWS`] rows, every weight 16-bit of one type with a width of x's that is a
    /// multiple of 8, and the kernel not turned off.
    fn gemv_kernel(&self, x: &CudaTensor, ws: &[(&CudaWeight, Option<&CudaWeight>)]) -> Option<&'static str> {
        if x.rows > GEMV_MAX_ROWS || !x.cols.is_multiple_of(8) || !self.gemv.load(std::sync::atomic::Ordering::Relaxed) {
            return None;
        }
        let kind = |w: &CudaWeight| match w.data {
            WeightData::Bf16(_) => Some("gemv_bf16"),
            WeightData::F16(_) => Some("gemv_f16"),
            WeightData::F32(_) => None,
        };
        let first = kind(ws.first()?.0)?;
        ws.iter().all(|(w, _)| kind(w) == Some(first)).then_some(first)
    }

    /// `outs[i] = x · ws[i]ᵀ` by the GEMV kernel, up to three weights per launch (their columns
    /// laid end to end over one grid); shapes were checked by the caller.
    fn gemv(&self, kernel: &'static str, x: &CudaSlice<f32>, m: usize, k: usize, ws: &[(&CudaWeight, Option<&CudaWeight>)], outs: &mut [&mut CudaTensor]) -> Option<()> {
        let op = "matmul (GEMV)";
        let (mi, ki) = (i32_of(op, self, m)?, i32_of(op, self, k)?);
        let f = self.func(kernel)?;
        for (ws, outs) in ws.chunks(3).zip(outs.chunks_mut(3)) {
            // (weight address, output address, columns) per matrix; unused slots take no columns.
            let mut slots = [(0u64, 0u64, 0i32); 3];
            let mut guards = Vec::new();
            let mut total = 0usize;
            for (i, ((w, _), out)) in ws.iter().zip(outs.iter_mut()).enumerate() {
                let (WeightData::Bf16(wd) | WeightData::F16(wd)) = &w.data else {
                    self.fail(op, "a 32-bit weight in a 16-bit GEMV");
                    return None;
                };
                let ob = out.buf.as_mut()?;
                let (pw, gw) = wd.device_ptr(&self.stream);
                let (po, go) = ob.device_ptr_mut(&self.stream);
                slots[i] = (pw, po, i32_of(op, self, w.rows)?);
                guards.push((gw, go));
                total += w.rows;
            }
            if total == 0 {
                continue;
            }
            let Ok(blocks) = u32::try_from(total.div_ceil(GEMV_COLS_PER_BLOCK)) else {
                self.fail(op, format!("{total} output columns in one launch"));
                return None;
            };
            let mut b = self.stream.launch_builder(f);
            b.arg(x).arg(&mi).arg(&ki);
            for (w, o, n) in &slots {
                b.arg(w).arg(o).arg(n);
            }
            let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (32 * GEMV_COLS_PER_BLOCK as u32, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: x holds m·k f32 (checked by the caller), each used slot a weight of n·k
            // 16-bit values and an output of m·n f32 (shapes checked), all from aligned
            // allocations with k % 8 == 0, so every 16-byte chunk the kernel loads is aligned; the
            // kernel writes each (row, column) of the used slots once and reads nothing of a slot
            // with no columns. The guards keep the buffers' stream order until after the launch.
            self.check(kernel, unsafe { b.launch(cfg) })?;
            drop(guards);
        }
        Some(())
    }

    /// `out[r, c] += bias[c]` for the `rows` rows of a matmul's output.
    fn add_bias(&self, out: &mut CudaSlice<f32>, bias: &CudaWeight, rows: usize, cols: usize) -> Option<()> {
        let WeightData::F32(bv) = &bias.data else {
            self.fail("matmul", "biases must be f32 vectors");
            return None;
        };
        if bv.len() != cols {
            self.fail("matmul", format!("bias of {} for {cols} outputs", bv.len()));
            return None;
        }
        let (r, c, f) = (i32_of("add_bias", self, rows)?, i32_of("add_bias", self, cols)?, self.func("add_bias_f32")?);
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(bv).arg(&r).arg(&c);
        // SAFETY: out is rows×cols, bias cols.
        self.check("add_bias_f32", unsafe { b.launch(Self::grid(rows * cols)) }).map(drop)
    }

    /// `rope_f32` of `q` and, when given, `k` (a step's queries and keys), in one launch.
    fn launch_rope(&self, q: &mut CudaTensor, k: Option<&mut CudaTensor>, batch: &CudaBatch, head_dim: usize) {
        let _t = self.timed("rope");
        if !self.healthy() || q.rows == 0 {
            return;
        }
        let (k_rows, k_cols) = k.as_ref().map_or((q.rows, 0), |k| (k.rows, k.cols));
        if head_dim == 0 || head_dim % 2 != 0 || q.cols % head_dim != 0 || k_cols % head_dim != 0 || q.rows != batch.rows || k_rows != batch.rows {
            return self.fail("rope", format!("q {}x{}, k {k_rows}x{k_cols} with head_dim {head_dim} for a batch of {} rows", q.rows, q.cols, batch.rows));
        }
        let (Some(bb), Some(qb)) = (batch.bufs.as_ref(), q.buf.as_mut()) else { return };
        // No keys: a null address the kernel never reads (it takes k_cols = 0 pairs of it).
        let (kp, _guard) = match k {
            Some(k) => match k.buf.as_mut() {
                Some(kb) => {
                    let (p, g) = kb.device_ptr_mut(&self.stream);
                    (p, Some(g))
                }
                None => return,
            },
            None => (0, None),
        };
        let ints = [q.rows, q.cols, k_cols, head_dim].map(|v| i32_of("rope", self, v));
        let ([Some(r), Some(qc), Some(kc), Some(h)], Some(f)) = (ints, self.func("rope_f32")) else { return };
        let mut b = self.stream.launch_builder(f);
        b.arg(qb).arg(&kp).arg(&bb.cos).arg(&bb.sin).arg(&r).arg(&qc).arg(&kc).arg(&h);
        // SAFETY: q is rows×q_cols and k (when given) rows×k_cols (checked); cos/sin hold
        // rows×head_dim/2 (from the same plan's positions, and the rope table has head_dim/2
        // frequencies: the model builds both from its config).
        self.check("rope_f32", unsafe { b.launch(Self::grid(q.rows * (q.cols + k_cols) / 2)) });
    }

    fn launch_rms_norm(&self, x: u64, w: &CudaSlice<f32>, out: u64, rows: usize, cols: usize, eps: f32) -> Option<()> {
        let (r, c) = (i32_of("rms_norm", self, rows)?, i32_of("rms_norm", self, cols)?);
        let f = self.func("rms_norm_f32")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&x).arg(w).arg(&out).arg(&r).arg(&c).arg(&eps);
        let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: x and out address rows*cols f32 (possibly the same buffer: each element is read
        // before it is written by the same thread), w holds cols f32.
        self.check("rms_norm_f32", unsafe { b.launch(cfg) }).map(drop)
    }

    /// Gather a layer of a sequence into a new device buffer, K then V (queued on the stream):
    /// whole rows of the cache's dtype, as 32-bit words (held as f32 words, as [`DeviceBytes`]
    /// keeps them; only bits are copied).
    fn export(&self, kv: &CudaKv, layer: usize, blocks: &[u32], tokens: usize) -> Option<CudaSlice<f32>> {
        let l = kv.layout;
        let per = tokens * l.n_kv_heads * kv.kernels.row_words;
        let op = "kv_export_layer";
        let table = self.upload_slice(op, blocks)?;
        // Every word is written by the two gathers below (K, then V), so no memset.
        let mut out = self.uninit::<f32>(op, 2 * per)?;
        let ints = [tokens, l.n_kv_heads, kv.kernels.row_words, l.block_size].map(|v| i32_of(op, self, v));
        let [t, h, d, bs] = [ints[0]?, ints[1]?, ints[2]?, ints[3]?];
        let f = self.func(GATHER)?;
        for (i, cache) in [&kv.k[layer], &kv.v[layer]].into_iter().enumerate() {
            let mut dst = out.slice_mut(i * per..(i + 1) * per);
            let mut b = self.stream.launch_builder(f);
            b.arg(cache).arg(&table).arg(&mut dst).arg(&t).arg(&h).arg(&d).arg(&bs);
            // SAFETY: the caller checked that blocks cover `tokens` and are < num_blocks; the cache
            // holds num_blocks*kv_heads*block_size rows of row_words words, dst tokens*kv_heads.
            self.check(GATHER, unsafe { b.launch(Self::grid(per)) })?;
        }
        Some(out)
    }

    /// Scatter a layer section (K then V, `2 * tokens * kv_heads` rows of the cache's dtype, as
    /// 32-bit words on this device) into the sequence's blocks.
    fn import(&self, kv: &mut CudaKv, layer: usize, blocks: &[u32], tokens: usize, src: &CudaView<'_, f32>) -> Option<()> {
        let l = kv.layout;
        let per = tokens * l.n_kv_heads * kv.kernels.row_words;
        let op = "kv_import_layer";
        let table = self.upload_slice(op, blocks)?;
        let ints = [tokens, l.n_kv_heads, kv.kernels.row_words, l.block_size].map(|v| i32_of(op, self, v));
        let [t, h, d, bs] = [ints[0]?, ints[1]?, ints[2]?, ints[3]?];
        let f = self.func(SCATTER)?;
        let (k, v) = (&mut kv.k[layer], &mut kv.v[layer]);
        for (i, cache) in [k, v].into_iter().enumerate() {
            let part = src.slice(i * per..(i + 1) * per);
            let mut b = self.stream.launch_builder(f);
            b.arg(&part).arg(&table).arg(cache).arg(&t).arg(&h).arg(&d).arg(&bs);
            // SAFETY: as in export: blocks are checked, part holds tokens*kv_heads rows of words.
            self.check(SCATTER, unsafe { b.launch(Self::grid(per)) })?;
        }
        Some(())
    }

    /// Run an export or import (`f` records failures), wait for the stream, and report.
    fn kv_op<T>(&self, op: &str, f: impl FnOnce() -> Option<T>) -> Result<T> {
        self.ctx.bind_to_thread().map_err(|e| EngineError::Cuda { op: "bind the context".into(), reason: describe(&e) })?;
        let r = f();
        if let Err(e) = self.stream.synchronize() {
            self.fail(op, describe(&e));
        }
        self.outcome(op, r)
    }

    /// A decode batch's attention with each sequence's keys split into parts of `part_len`
    /// (`paged_attention_split_<dtype>`, a block per sequence, head and part), then the parts
    /// merged into `out` (`paged_attention_merge_f32`). `ints`: seqs, heads, KV heads, head_dim,
    /// block size.
    #[allow(clippy::too_many_arguments)]
    fn split_decode(&self, q: &CudaSlice<f32>, kc: &CudaSlice<u32>, vc: &CudaSlice<u32>, kernel: &str, bb: &BatchBufs, ints: [i32; 5], scale: f32, part_len: usize, max_ctx: usize, out: &mut CudaSlice<f32>) -> Option<()> {
        let op = "split decode attention";
        let _t = self.timed("· attention: split + merge");
        let [seqs, nh, kvh, hd, bs] = ints;
        let parts = max_ctx.div_ceil(part_len);
        let (pairs, len, n_parts) = (seqs as usize * nh as usize, i32_of(op, self, part_len)?, i32_of(op, self, parts)?);
        let mut acc = self.uninit::<f32>(op, pairs * parts * hd as usize)?;
        let mut stats = self.uninit::<f32>(op, pairs * parts * 2)?;
        let block = (ATT_THREADS, 1, 1);
        let f = self.func(kernel)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(q).arg(kc).arg(vc).arg(&mut acc).arg(&mut stats).arg(&bb.q_start).arg(&bb.ctx_len).arg(&bb.block_start).arg(&bb.blocks);
        b.arg(&seqs).arg(&nh).arg(&kvh).arg(&hd).arg(&bs).arg(&scale).arg(&len);
        let cfg = LaunchConfig { grid_dim: (seqs as u32, nh as u32, n_parts as u32), block_dim: block, shared_mem_bytes: 0 };
        // SAFETY: as for the unsplit decode (block tables cover ctx_len, blocks below num_blocks);
        // acc and stats hold a partial for every (sequence, head, part) of the grid, each written
        // by its block (an empty part writes -inf, 0 and zeros).
        self.check(kernel, unsafe { b.launch(cfg) })?;
        let f = self.func(MERGE)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(&acc).arg(&stats).arg(out).arg(&bb.q_start).arg(&seqs).arg(&nh).arg(&hd).arg(&n_parts);
        let cfg = LaunchConfig { grid_dim: (seqs as u32, nh as u32, 1), block_dim: block, shared_mem_bytes: 0 };
        // SAFETY: acc and stats were written whole above; out has a row of nh·hd f32 at each
        // sequence's q_start (the caller checked out's shape against the batch).
        self.check(MERGE, unsafe { b.launch(cfg) }).map(drop)
    }

    /// Attention of one long chunk with GEMMs, as HF's eager attention: gather the sequence's
    /// K and V from the paged cache (widened to f32 from the cache's dtype), then per KV head `S = scale·Q·Kᵀ` for its query heads (one
    /// strided-batched GEMM), the causal softmax, and `O = P·V` written into the chunk's rows of
    /// `out` (the GEMMs as [`super::dense::Chunk`] describes them; a CPU test runs the same
    /// descriptions). Half-precision models run the GEMMs on TF32 tensor cores, f32 models in
    /// exact f32.
    #[allow(clippy::too_many_arguments)]
    fn dense_attention(&self, q: &CudaSlice<f32>, kv: &CudaKv, layer: usize, blocks: u64, d: &DenseSeq, n_heads: usize, out: &mut CudaSlice<f32>) -> Option<()> {
        let l = kv.layout;
        let c = Chunk { q_start: d.q_start, q_len: d.q_len, ctx_len: d.ctx_len, n_heads, kv_heads: l.n_kv_heads, head_dim: l.head_dim };
        let op = "dense attention";
        let _t = self.timed("· attention: dense GEMMs");
        let ints = [d.ctx_len, l.n_kv_heads, l.head_dim, l.block_size, c.group() * d.q_len, d.q_len, d.ctx_len - d.q_len].map(|v| i32_of(op, self, v));
        let [Some(ctx), Some(kvh), Some(hd), Some(bs), Some(rows), Some(q_len), Some(offset)] = ints else { return None };
        // The context's K and V, token-contiguous f32: [ctx, kv_heads·head_dim] each (f32 rows
        // copied as words, others widened: the kernel takes head_dim either way).
        // The sequence's block table: from word d.block_start of the batch's tables.
        let table = blocks + 4 * d.block_start as u64;
        let per = d.ctx_len * l.n_kv_heads * l.head_dim;
        // Every element of these is written (the gathers, the QKᵀ GEMM) before it is read.
        let (mut kbuf, mut vbuf) = (self.uninit::<f32>(op, per)?, self.uninit::<f32>(op, per)?);
        let gather = self.func(kv.kernels.widen)?;
        for (cache, dst) in [(&kv.k[layer], &mut kbuf), (&kv.v[layer], &mut vbuf)] {
            let mut b = self.stream.launch_builder(gather);
            b.arg(cache).arg(&table).arg(dst).arg(&ctx).arg(&kvh).arg(&hd).arg(&bs);
            // SAFETY: the block table covers ctx_len tokens (the engine reserved them) and every
            // block is below num_blocks (checked by the caller); dst holds ctx·kv_heads·head_dim
            // f32; the kernel reads rows of the cache's dtype (f32 rows: head_dim words).
            self.check(kv.kernels.widen, unsafe { b.launch(Self::grid(per)) })?;
        }
        // Scores of one KV head's query heads: [group, q_len, ctx], reused across KV heads.
        let mut scores = self.uninit::<f32>(op, c.group() * d.q_len * d.ctx_len)?;
        let compute = if self.half_weights.load(std::sync::atomic::Ordering::Relaxed) {
            blas::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32
        } else {
            blas::cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let softmax = self.func("causal_softmax_f32")?;
        let f32t = blas::cudaDataType::CUDA_R_32F;
        for g in 0..l.n_kv_heads {
            {
                let (pk, _gk) = kbuf.device_ptr(&self.stream);
                let (pq, _gq) = q.device_ptr(&self.stream);
                let (ps, _gs) = scores.device_ptr_mut(&self.stream);
                self.cublas_gemm("attention QKᵀ", &c.scores(g), (pk, f32t), (pq, f32t), (ps, f32t), compute)?;
            }
            let mut b = self.stream.launch_builder(softmax);
            b.arg(&mut scores).arg(&rows).arg(&q_len).arg(&ctx).arg(&offset);
            let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: scores holds rows·ctx f32.
            self.check("causal_softmax_f32", unsafe { b.launch(cfg) })?;
            let (pv, _gv) = vbuf.device_ptr(&self.stream);
            let (ps, _gs) = scores.device_ptr(&self.stream);
            let (po, _go) = out.device_ptr_mut(&self.stream);
            self.cublas_gemm("attention PV", &c.values(g), (pv, f32t), (ps, f32t), (po, f32t), compute)?;
        }
        Some(())
    }

    /// Turn `n_rows` rows of `head_dim` f32 values in `x` in place by the Hadamard transform
    /// (`turn`: `hadamard_rows_f32`, one warp per row).
    fn turn_rows(&self, turn: &str, x: &mut CudaSlice<f32>, n_rows: usize, head_dim: i32) -> Option<()> {
        let f = self.func(turn)?;
        let n = i32_of(turn, self, n_rows)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(&n).arg(&head_dim);
        // SAFETY: x holds n_rows·head_dim f32 (the caller's query copy or attention output), and
        // head_dim is at most the kernel's shared row (KvKernels::for_layout refuses longer).
        self.check(turn, unsafe { b.launch(Self::grid(n_rows * 32)) }).map(drop)
    }

    /// One cuBLAS GEMM as `g` describes it (column-major, beta 0, f32 alpha), over operands
    /// at device addresses a, b, c of the given types: `cublasGemmEx` for one product,
    /// `cublasGemmStridedBatchedEx` for a batch. Failures are recorded under `what`.
    pub(crate) fn cublas_gemm(&self, what: &str, g: &Gemm, a: (u64, blas::cudaDataType), b: (u64, blas::cudaDataType), c: (u64, blas::cudaDataType), compute: blas::cublasComputeType_t) -> Option<()> {
        let dims = [g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.batch].map(|v| i32_of(what, self, v));
        let [Some(m), Some(n), Some(k), Some(lda), Some(ldb), Some(ldc), Some(batch)] = dims else { return None };
        let t = |x: bool| if x { blas::cublasOperation_t::CUBLAS_OP_T } else { blas::cublasOperation_t::CUBLAS_OP_N };
        let at = |(base, ty): (u64, blas::cudaDataType), off: usize| {
            let size = if matches!(ty, blas::cudaDataType::CUDA_R_32F) { 4 } else { 2 };
            (base + (off * size) as u64) as *const c_void
        };
        let (pa, pb, pc) = (at(a, g.a_off), at(b, g.b_off), at(c, g.c_off) as *mut c_void);
        let (alpha, zero) = (&g.alpha as *const f32 as *const c_void, &0.0f32 as *const f32 as *const c_void);
        let algo = blas::cublasGemmAlgo_t::CUBLAS_GEMM_DFALT;
        // SAFETY: the caller passes operands on this handle's stream, alive past the call and
        // holding the extents `g` addresses; alpha/beta are host f32 as the f32 compute types expect.
        let r = unsafe {
            if g.batch == 1 {
                cudarc::cublas::result::gemm_ex(*self.blas.handle(), t(g.trans_a), t(g.trans_b), m, n, k, alpha, pa, a.1, lda, pb, b.1, ldb, zero, pc, c.1, ldc, compute, algo)
            } else {
                cudarc::cublas::result::gemm_strided_batched_ex(
                    *self.blas.handle(),
                    t(g.trans_a),
                    t(g.trans_b),
                    m,
                    n,
                    k,
                    alpha,
                    pa,
                    a.1,
                    lda,
                    g.stride_a as i64,
                    pb,
                    b.1,
                    ldb,
                    g.stride_b as i64,
                    zero,
                    pc,
                    c.1,
                    ldc,
                    g.stride_c as i64,
                    batch,
                    compute,
                    algo,
                )
            }
        };
        self.check(&format!("cuBLAS GEMM ({what})"), r)
    }

    /// Checks shared by export and import: the layer exists and the blocks cover the tokens.
    fn check_kv_range(kv: &CudaKv, layer: usize, blocks: &[u32], tokens: usize) -> Result<()> {
        let bs = kv.layout.block_size;
        if layer >= kv.k.len() || blocks.len() < tokens.div_ceil(bs) || blocks.iter().any(|&b| b as usize >= kv.num_blocks) {
            return Err(EngineError::Cuda {
                op: "kv transfer".into(),
                reason: format!("layer {layer} of {}, {} blocks for {tokens} tokens (block size {bs}, cache of {} blocks)", kv.k.len(), blocks.len(), kv.num_blocks),
            });
        }
        Ok(())
    }
}

impl Backend for CudaBackend {
    type Tensor = CudaTensor;
    type Weight = CudaWeight;
    type Kv = CudaKv;
    type Batch = CudaBatch;

    fn describe(&self) -> String {
        self.describe_device()
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> Result<R> {
        self.ctx.bind_to_thread().map_err(|e| EngineError::Cuda { op: "bind the context".into(), reason: describe(&e) })?;
        let _ = self.take_error();
        if let Some(p) = &self.profile {
            p.begin_step();
        }
        let r = f();
        if let Err(e) = self.stream.synchronize() {
            self.fail("the step (stream synchronize)", describe(&e));
        }
        if let Some(p) = &self.profile {
            p.end_step();
        }
        match self.take_error() {
            Some(e) => Err(e),
            None => Ok(r),
        }
    }

    fn upload(&self, w: &HostWeight) -> Result<CudaWeight> {
        self.upload_weight(w)
    }

    fn tensor(&self, rows: usize, cols: usize) -> CudaTensor {
        let _t = self.timed("tensor (alloc)");
        // No memset (a launch per tensor): every operation writes its whole output.
        CudaTensor { buf: self.uninit("tensor", rows * cols), rows, cols }
    }

    fn rows(&self, t: &CudaTensor) -> usize {
        t.rows
    }

    fn prepare(&self, plan: &BatchPlan, rope: &RopeTable) -> CudaBatch {
        let _t = self.timed("prepare (uploads)");
        let decode_only = plan.seqs.iter().all(|s| s.q_len == 1);
        if let Some(p) = &self.profile {
            p.step_kind(decode_only, plan.seqs.len(), plan.positions.len());
        }
        let (cos, sin) = rope.angles(&plan.positions);
        let mut row_seq = vec![0u32; plan.positions.len()];
        let (mut q_start, mut q_len, mut ctx_len, mut block_start, mut blocks) = (vec![], vec![], vec![], vec![], vec![]);
        for (i, s) in plan.seqs.iter().enumerate() {
            for r in row_seq.iter_mut().skip(s.q_start).take(s.q_len) {
                *r = i as u32;
            }
            q_start.push(s.q_start as u32);
            q_len.push(s.q_len as u32);
            ctx_len.push(s.ctx_len as u32);
            block_start.push(blocks.len() as u32);
            blocks.extend_from_slice(&s.blocks);
        }
        let dense: Vec<DenseSeq> = plan
            .seqs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.q_len >= DENSE_ATTENTION_MIN_Q)
            .map(|(i, s)| DenseSeq { q_start: s.q_start, q_len: s.q_len, ctx_len: s.ctx_len, block_start: block_start[i] as usize })
            .collect();
        let skip: Vec<u32> = plan.seqs.iter().map(|s| u32::from(s.q_len >= DENSE_ATTENTION_MIN_Q)).collect();
        // Every array in one buffer of 32-bit words (cos and sin as their f32 bits): one copy to
        // the device per step, not one per array.
        let mut words = Vec::with_capacity(plan.slots.len() + cos.len() + sin.len() + row_seq.len() + 5 * plan.seqs.len() + blocks.len());
        let mut put = |a: &mut dyn Iterator<Item = u32>| {
            let at = words.len();
            words.extend(a);
            at
        };
        let at = [
            put(&mut plan.slots.iter().copied()),
            put(&mut cos.iter().map(|v| v.to_bits())),
            put(&mut sin.iter().map(|v| v.to_bits())),
            put(&mut row_seq.iter().copied()),
            put(&mut q_start.iter().copied()),
            put(&mut q_len.iter().copied()),
            put(&mut ctx_len.iter().copied()),
            put(&mut block_start.iter().copied()),
            put(&mut blocks.iter().copied()),
            put(&mut skip.iter().copied()),
        ];
        let bufs = self.upload_slice("prepare", &words).map(|all| {
            let base = all.device_ptr(&self.stream).0;
            let [slots, cos, sin, row_seq, q_start, q_len, ctx_len, block_start, blocks, skip] = at.map(|o| base + 4 * o as u64);
            BatchBufs { all, slots, cos, sin, row_seq, q_start, q_len, ctx_len, block_start, blocks, skip }
        });
        CudaBatch {
            rows: plan.positions.len(),
            seqs: plan.seqs.len(),
            decode_only,
            max_ctx: plan.seqs.iter().map(|s| s.ctx_len).max().unwrap_or(0),
            max_slot: plan.slots.iter().copied().max().unwrap_or(0),
            max_block: blocks.iter().copied().max().unwrap_or(0),
            bufs,
            dense,
        }
    }

    fn embed(&self, table: &CudaWeight, ids: &[u32], out: &mut CudaTensor) {
        let _t = self.timed("embed");
        if !self.healthy() || ids.is_empty() {
            return;
        }
        if out.rows != ids.len() || out.cols != table.cols {
            return self.fail("embed", format!("{} ids of width {} into a {}x{} tensor", ids.len(), table.cols, out.rows, out.cols));
        }
        let Some(ids_dev) = self.upload_slice("embed", ids) else { return };
        let (Some(o), Some(n), Some(c), Some(v)) = (out.buf.as_mut(), i32_of("embed", self, ids.len()), i32_of("embed", self, table.cols), i32_of("embed", self, table.rows)) else { return };
        let total = ids.len() * table.cols;
        let name = match &table.data {
            WeightData::F32(_) => "embedding_f32",
            WeightData::Bf16(_) => "embedding_bf16",
            WeightData::F16(_) => "embedding_f16",
        };
        let Some(f) = self.func(name) else { return };
        let mut b = self.stream.launch_builder(f);
        match &table.data {
            WeightData::F32(t) => b.arg(t),
            WeightData::Bf16(t) | WeightData::F16(t) => b.arg(t),
        };
        b.arg(&ids_dev).arg(o).arg(&n).arg(&c).arg(&v);
        // SAFETY: the table is vocab×cols, out ids.len()×cols; ids ≥ vocab write zeros.
        self.check(name, unsafe { b.launch(Self::grid(total)) });
    }

    fn rms_norm(&self, x: &CudaTensor, w: &CudaWeight, eps: f32, out: &mut CudaTensor) {
        let _t = self.timed("rms_norm");
        if !self.healthy() || x.rows == 0 {
            return;
        }
        let WeightData::F32(wv) = &w.data else { return self.fail("rms_norm", "norm weights must be f32 vectors") };
        if (out.rows, out.cols) != (x.rows, x.cols) || wv.len() != x.cols {
            return self.fail("rms_norm", format!("x {}x{}, weight {}, out {}x{}", x.rows, x.cols, wv.len(), out.rows, out.cols));
        }
        let (Some(xb), Some(ob)) = (x.buf.as_ref(), out.buf.as_mut()) else { return };
        let (xp, _gx) = xb.device_ptr(&self.stream);
        let (op, _go) = ob.device_ptr_mut(&self.stream);
        self.launch_rms_norm(xp, wv, op, x.rows, x.cols, eps);
    }

    fn head_rms_norm(&self, x: &mut CudaTensor, w: &CudaWeight, head_dim: usize, eps: f32) {
        let _t = self.timed("head_rms_norm");
        if !self.healthy() || x.rows == 0 {
            return;
        }
        let WeightData::F32(wv) = &w.data else { return self.fail("head_rms_norm", "norm weights must be f32 vectors") };
        if head_dim == 0 || x.cols % head_dim != 0 || wv.len() != head_dim {
            return self.fail("head_rms_norm", format!("{} columns, head_dim {head_dim}, weight {}", x.cols, wv.len()));
        }
        let (rows, cols) = (x.rows * (x.cols / head_dim), head_dim);
        let Some(xb) = x.buf.as_mut() else { return };
        let (xp, _g) = xb.device_ptr_mut(&self.stream);
        self.launch_rms_norm(xp, wv, xp, rows, cols, eps);
    }

    fn add(&self, x: &mut CudaTensor, y: &CudaTensor) {
        let _t = self.timed("add");
        if !self.healthy() || x.rows == 0 {
            return;
        }
        if (x.rows, x.cols) != (y.rows, y.cols) {
            return self.fail("add", format!("{}x{} += {}x{}", x.rows, x.cols, y.rows, y.cols));
        }
        let n = x.rows * x.cols;
        let (Some(xb), Some(yb), Some(f)) = (x.buf.as_mut(), y.buf.as_ref(), self.func("add_f32")) else { return };
        let mut b = self.stream.launch_builder(f);
        b.arg(xb).arg(yb).arg(&n);
        // SAFETY: both hold n f32.
        self.check("add_f32", unsafe { b.launch(Self::grid(n)) });
    }

    fn matmul(&self, x: &CudaTensor, ws: &[(&CudaWeight, Option<&CudaWeight>)], outs: &mut [&mut CudaTensor]) {
        let _t = self.timed("matmul");
        if !self.healthy() || x.rows == 0 {
            return;
        }
        if ws.len() != outs.len() {
            return self.fail("matmul", format!("{} weights for {} outputs", ws.len(), outs.len()));
        }
        let Some(xb) = x.buf.as_ref() else { return };
        for ((w, _), out) in ws.iter().zip(outs.iter()) {
            if w.cols != x.cols || (out.rows, out.cols) != (x.rows, w.rows) {
                return self.fail("matmul", format!("x {}x{} · w {}x{}ᵀ into {}x{}", x.rows, x.cols, w.rows, w.cols, out.rows, out.cols));
            }
        }
        if let Some(kernel) = self.gemv_kernel(x, ws) {
            if self.gemv(kernel, xb, x.rows, x.cols, ws, outs).is_none() {
                return;
            }
        } else {
            let mut half_x = [None, None];
            for ((w, _), out) in ws.iter().zip(outs.iter_mut()) {
                let Some(ob) = out.buf.as_mut() else { return };
                if self.gemm(xb, x.rows, w, ob, &mut half_x).is_none() {
                    return;
                }
            }
        }
        for ((w, bias), out) in ws.iter().zip(outs.iter_mut()) {
            if let (Some(bias), Some(ob)) = (bias, out.buf.as_mut())
                && self.add_bias(ob, bias, x.rows, w.rows).is_none()
            {
                return;
            }
        }
    }

    fn rope(&self, x: &mut CudaTensor, batch: &CudaBatch, head_dim: usize) {
        self.launch_rope(x, None, batch, head_dim);
    }

    fn rope_qk(&self, q: &mut CudaTensor, k: &mut CudaTensor, batch: &CudaBatch, head_dim: usize) {
        self.launch_rope(q, Some(k), batch, head_dim);
    }

    fn add_rms_norm(&self, x: &mut CudaTensor, y: &CudaTensor, w: &CudaWeight, eps: f32, out: &mut CudaTensor) {
        let _t = self.timed("add_rms_norm");
        if !self.healthy() || x.rows == 0 {
            return;
        }
        if let Err(e) = self.launch_add_rms_norm(x, y, w, eps, out) {
            self.fail("add_rms_norm", e);
        }
    }

    fn silu_mul(&self, gate: &mut CudaTensor, up: &CudaTensor) {
        let _t = self.timed("silu_mul");
        if !self.healthy() || gate.rows == 0 {
            return;
        }
        if (gate.rows, gate.cols) != (up.rows, up.cols) {
            return self.fail("silu_mul", format!("gate {}x{}, up {}x{}", gate.rows, gate.cols, up.rows, up.cols));
        }
        let n = gate.rows * gate.cols;
        let (Some(g), Some(u), Some(f)) = (gate.buf.as_mut(), up.buf.as_ref(), self.func("silu_mul_f32")) else { return };
        let mut b = self.stream.launch_builder(f);
        b.arg(g).arg(u).arg(&n);
        // SAFETY: both hold n f32.
        self.check("silu_mul_f32", unsafe { b.launch(Self::grid(n)) });
    }

    fn kv_write(&self, kv: &mut CudaKv, layer: usize, k: &CudaTensor, v: &CudaTensor, batch: &CudaBatch) {
        let _t = self.timed("kv_write");
        if !self.healthy() || k.rows == 0 {
            return;
        }
        let l = kv.layout;
        let row = l.n_kv_heads * l.head_dim;
        let cap = (kv.num_blocks * l.block_size) as u64;
        if layer >= kv.k.len() || (k.rows, k.cols) != (batch.rows, row) || (v.rows, v.cols) != (batch.rows, row) || batch.max_slot as u64 >= cap {
            return self.fail("kv_write", format!("layer {layer}, k {}x{}, v {}x{}, batch of {} rows, slot {} of {cap}", k.rows, k.cols, v.rows, v.cols, batch.rows, batch.max_slot));
        }
        let (Some(bb), Some(kb), Some(vb)) = (batch.bufs.as_ref(), k.buf.as_ref(), v.buf.as_ref()) else { return };
        let ints = [k.rows, l.n_kv_heads, l.head_dim, l.block_size].map(|x| i32_of("kv_write", self, x));
        let (Some(r), Some(h), Some(d), Some(bs)) = (ints[0], ints[1], ints[2], ints[3]) else { return };
        let name = kv.kernels.write;
        let Some(f) = self.func(name) else { return };
        // int8: a warp per (token, KV head) row; the others: a thread per value.
        let threads = if kv.kernels.write_per_row() { k.rows * l.n_kv_heads * 32 } else { k.rows * row };
        let (kc, vc) = (&mut kv.k[layer], &mut kv.v[layer]);
        let mut b = self.stream.launch_builder(f);
        b.arg(kb).arg(vb).arg(kc).arg(vc).arg(&bb.slots).arg(&r).arg(&h).arg(&d).arg(&bs);
        // SAFETY: every slot is below the cache's capacity (checked), k/v are rows×kv_heads·head_dim;
        // the cache holds rows of the layout's dtype (alloc_kv sized it from the same layout).
        self.check(name, unsafe { b.launch(Self::grid(threads)) });
    }

    fn attention(&self, q: &CudaTensor, kv: &CudaKv, layer: usize, batch: &CudaBatch, out: &mut CudaTensor) {
        let _t = self.timed("attention");
        if !self.healthy() || q.rows == 0 {
            return;
        }
        let l = kv.layout;
        if l.head_dim == 0 || l.head_dim > ATT_MAX_HEAD_DIM || l.n_kv_heads == 0 || q.cols % l.head_dim != 0 {
            return self.fail("attention", format!("head_dim {} (at most {ATT_MAX_HEAD_DIM}), {} KV heads, q width {}", l.head_dim, l.n_kv_heads, q.cols));
        }
        let n_heads = q.cols / l.head_dim;
        if n_heads % l.n_kv_heads != 0 || layer >= kv.k.len() || q.rows != batch.rows || (out.rows, out.cols) != (q.rows, q.cols) || (batch.seqs > 0 && batch.max_block as usize >= kv.num_blocks) {
            return self.fail("attention", format!("{n_heads} heads over {} KV heads, layer {layer}, q {}x{}, out {}x{}, batch of {} rows", l.n_kv_heads, q.rows, q.cols, out.rows, out.cols, batch.rows));
        }
        let (Some(bb), Some(qb), Some(ob)) = (batch.bufs.as_ref(), q.buf.as_ref(), out.buf.as_mut()) else { return };
        let ints = [q.rows, n_heads, l.n_kv_heads, l.head_dim, l.block_size, batch.seqs].map(|x| i32_of("attention", self, x));
        let [Some(rows), Some(nh), Some(kvh), Some(hd), Some(bs), Some(seqs)] = ints else { return };
        // Rows stored turned (int8): attend with the query turned the same way (a copy), then
        // turn the output back (q·k = Hq·Hk; the weighted sum of turned values is the turned sum).
        let turned_q;
        let qb = match kv.kernels.turn {
            Some(turn) => {
                let Some(mut t) = self.uninit::<f32>("attention", q.rows * q.cols) else { return };
                if self.check("attention: copy the query", self.stream.memcpy_dtod(qb, &mut t)).is_none() || self.turn_rows(turn, &mut t, q.rows * n_heads, hd).is_none() {
                    return;
                }
                turned_q = t;
                &turned_q
            }
            None => qb,
        };
        let scale = 1.0 / (l.head_dim as f32).sqrt();
        let (kc, vc) = (&kv.k[layer], &kv.v[layer]);
        let block = (ATT_THREADS, 1, 1);
        let split = if batch.decode_only { self.attention_split().part_len(batch.seqs * n_heads, batch.max_ctx, self.sms) } else { None };
        if let Some(part_len) = split {
            if self.split_decode(qb, kc, vc, kv.kernels.split, bb, [seqs, nh, kvh, hd, bs], scale, part_len, batch.max_ctx, ob).is_none() {
                return;
            }
        } else if batch.decode_only {
            let Some(f) = self.func(kv.kernels.decode) else { return };
            let mut b = self.stream.launch_builder(f);
            b.arg(qb).arg(kc).arg(vc).arg(&mut *ob).arg(&bb.q_start).arg(&bb.ctx_len).arg(&bb.block_start).arg(&bb.blocks);
            b.arg(&seqs).arg(&nh).arg(&kvh).arg(&hd).arg(&bs).arg(&scale);
            let cfg = LaunchConfig { grid_dim: (batch.seqs as u32, n_heads as u32, 1), block_dim: block, shared_mem_bytes: 0 };
            // SAFETY: the plan's block tables cover each sequence's ctx_len tokens (the engine
            // reserves them before the step) and every block is below num_blocks (checked).
            self.check(kv.kernels.decode, unsafe { b.launch(cfg) });
        } else {
            let dense_rows: usize = batch.dense.iter().map(|d| d.q_len).sum();
            if dense_rows < q.rows {
                let Some(f) = self.func(kv.kernels.prefill) else { return };
                let mut b = self.stream.launch_builder(f);
                b.arg(qb).arg(kc).arg(vc).arg(&mut *ob).arg(&bb.row_seq).arg(&bb.q_start).arg(&bb.q_len).arg(&bb.ctx_len).arg(&bb.block_start).arg(&bb.blocks);
                b.arg(&bb.skip).arg(&rows).arg(&nh).arg(&kvh).arg(&hd).arg(&bs).arg(&scale);
                let cfg = LaunchConfig { grid_dim: (q.rows as u32, n_heads as u32, 1), block_dim: block, shared_mem_bytes: 0 };
                // SAFETY: as for decode; every row maps to its sequence through row_seq.
                self.check(kv.kernels.prefill, unsafe { b.launch(cfg) });
            }
            for d in &batch.dense {
                if self.dense_attention(qb, kv, layer, bb.blocks, d, n_heads, ob).is_none() {
                    return;
                }
            }
        }
        if let Some(turn) = kv.kernels.turn {
            self.turn_rows(turn, ob, q.rows * n_heads, hd);
        }
    }

    fn gather_rows(&self, x: &CudaTensor, rows: &[usize]) -> CudaTensor {
        let mut out = self.tensor(rows.len(), x.cols);
        let _t = self.timed("gather_rows");
        if !self.healthy() || rows.is_empty() {
            return out;
        }
        if let Some(&r) = rows.iter().find(|&&r| r >= x.rows) {
            self.fail("gather_rows", format!("row {r} of a {}-row tensor", x.rows));
            return out;
        }
        let idx: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
        let (Some(dev_idx), Some(xb), Some(n), Some(c), Some(f)) = (self.upload_slice("gather_rows", &idx), x.buf.as_ref(), i32_of("gather_rows", self, rows.len()), i32_of("gather_rows", self, x.cols), self.func("gather_rows_f32")) else { return out };
        let Some(ob) = out.buf.as_mut() else { return out };
        let mut b = self.stream.launch_builder(f);
        b.arg(xb).arg(&dev_idx).arg(ob).arg(&n).arg(&c);
        // SAFETY: every index is below x.rows (checked); out is rows.len()×cols.
        self.check("gather_rows_f32", unsafe { b.launch(Self::grid(rows.len() * x.cols)) });
        out
    }

    fn to_host(&self, x: &CudaTensor) -> Vec<f32> {
        let _t = self.timed("to_host");
        let n = x.rows * x.cols;
        if !self.healthy() || n == 0 {
            return vec![0.0; n];
        }
        let Some(buf) = x.buf.as_ref() else { return vec![0.0; n] };
        self.check("to_host", self.stream.clone_dtoh(buf)).unwrap_or_else(|| vec![0.0; n])
    }

    fn kv_budget_bytes(&self, fraction: f32) -> Result<Option<usize>> {
        self.free_memory(fraction).map(Some)
    }

    fn kv_alloc(&self, layout: &KvLayout, num_blocks: usize) -> Result<CudaKv> {
        self.alloc_kv(layout, num_blocks)
    }

    fn kv_export_layer(&self, kv: &CudaKv, layer: usize, blocks: &[u32], tokens: usize, out: &mut Vec<u8>) -> Result<()> {
        Self::check_kv_range(kv, layer, blocks, tokens)?;
        if tokens == 0 {
            return Ok(());
        }
        let host = self.kv_op("kv_export_layer", || {
            let dev = self.export(kv, layer, blocks, tokens)?;
            self.check("kv_export_layer", self.stream.clone_dtoh(&dev))
        })?;
        out.extend_from_slice(bytemuck::cast_slice(&host));
        Ok(())
    }

    fn kv_import_layer(&self, kv: &mut CudaKv, layer: usize, blocks: &[u32], tokens: usize, section: &[u8]) -> Result<()> {
        Self::check_kv_range(kv, layer, blocks, tokens)?;
        let want = kv.layout.layer_bytes(tokens);
        if section.len() != want {
            return Err(EngineError::Cuda { op: "kv_import_layer".into(), reason: format!("a section of {} bytes for {tokens} tokens (expected {want})", section.len()) });
        }
        if tokens == 0 {
            return Ok(());
        }
        let host = f32s_of(section);
        self.kv_op("kv_import_layer", || {
            let src = self.upload_slice("kv_import_layer", &host)?;
            self.import(kv, layer, blocks, tokens, &src.slice(..))
        })
    }

    /// The gather stays on the device: the buffer is handed out with an event recorded after
    /// it, without waiting (prefill goes on with the next layer while the transport waits).
    fn kv_export_layer_buffer(&self, kv: &CudaKv, layer: usize, blocks: &[u32], tokens: usize) -> Result<KvBuffer> {
        Self::check_kv_range(kv, layer, blocks, tokens)?;
        self.ctx.bind_to_thread().map_err(|e| EngineError::Cuda { op: "bind the context".into(), reason: describe(&e) })?;
        if tokens == 0 {
            return Ok(KvBuffer::Cuda(DeviceBytes::zeroed(&self.kit, 0)?));
        }
        let dev = self.outcome("kv_export_layer", self.export(kv, layer, blocks, tokens))?;
        Ok(KvBuffer::Cuda(DeviceBytes::filled(dev, self.kit.clone(), &self.stream)?))
    }

    /// A buffer on this device is scattered from where it is; anything else goes through the host.
    fn kv_import_layer_buffer(&self, kv: &mut CudaKv, layer: usize, blocks: &[u32], tokens: usize, buf: &KvBuffer, section: std::ops::Range<usize>) -> Result<()> {
        let db = match buf {
            KvBuffer::Cuda(db) if db.ordinal() == self.ordinal => db,
            _ => return crate::backend::import_layer_via_host(self, kv, layer, blocks, tokens, buf, section),
        };
        Self::check_kv_range(kv, layer, blocks, tokens)?;
        let want = kv.layout.layer_bytes(tokens);
        if section.len() != want || section.end > db.len() || section.start % 4 != 0 {
            return Err(EngineError::Cuda {
                op: "kv_import_layer".into(),
                reason: format!("section {}..{} of a {}-byte buffer for {tokens} tokens (expected {want} bytes, word-aligned)", section.start, section.end, db.len()),
            });
        }
        if tokens == 0 {
            return Ok(());
        }
        let words = db.slice()?;
        self.kv_op("kv_import_layer", || self.import(kv, layer, blocks, tokens, &words.slice(section.start / 4..section.end / 4)))
    }
}
