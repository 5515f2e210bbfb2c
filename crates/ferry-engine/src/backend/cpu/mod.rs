//! The CPU backend: multithreaded (a rayon pool per backend) with run-time SIMD dispatch. Weights
//! stay in their file's storage type and are dequantized inside the kernels.

mod attention;
mod kv_rows;
mod matmul;
/// The matmul switch: steps of at most this many rows take the row-dot path (and, with 8-bit
/// activations, quantize them), longer ones the GEMM path. Public so tests read it.
pub use matmul::{GEMV_MAX_ROWS, Q8_GEMV_MAX_ROWS};
pub(crate) mod simd;

use super::{Backend, BatchPlan, RopeTable};
use crate::error::{EngineError, Result};
use crate::weights::{HostWeight, Storage};
use ferry_core::KvLayout;
use ferry_core::kv_dtype::encode_row;
use ferry_quant::WeightType;
use rayon::prelude::*;

/// A raw pointer that parallel tasks use to write disjoint parts of one buffer.
#[derive(Clone, Copy)]
pub(crate) struct SyncPtr(pub *mut f32);
// SAFETY: every user writes only to index ranges no other task touches (stated at each use).
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// The pointer (a method, so closures capture the whole Send/Sync wrapper).
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

pub struct CpuTensor {
    pub(crate) data: Vec<f32>,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
}

impl CpuTensor {
    /// A tensor holding `data` (`rows × cols`, row-major), truncated or zero-padded to that size.
    pub fn from_data(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        let mut data = data;
        data.resize(rows * cols, 0.0);
        Self { data, rows, cols }
    }
}

pub struct CpuWeight {
    pub(crate) ty: WeightType,
    pub(crate) rows: usize,
    pub(crate) cols: usize,
    pub(crate) row_bytes: usize,
    pub(crate) storage: Storage,
    /// Dequantized copy for vectors (norm weights, biases), and for f32 matrices whose mapped
    /// bytes are not 4-byte aligned.
    pub(crate) f32_copy: Option<Vec<f32>>,
    /// Rows interleaved in groups of 8, for the 8-bit-activation decode kernel (Q8 mode only).
    pub(crate) x8: Option<Storage>,
}

impl CpuWeight {
    pub(crate) fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }
    pub(crate) fn row(&self, r: usize) -> &[u8] {
        &self.bytes()[r * self.row_bytes..(r + 1) * self.row_bytes]
    }
    /// The weight as f32 values when it is stored (or copied) as f32.
    pub(crate) fn as_f32(&self) -> Option<&[f32]> {
        if let Some(c) = &self.f32_copy {
            return Some(c);
        }
        if self.ty == WeightType::F32 {
            return bytemuck::try_cast_slice(self.bytes()).ok();
        }
        None
    }
    pub(crate) fn vector(&self) -> &[f32] {
        self.f32_copy.as_deref().expect("vector weights are uploaded with an f32 copy")
    }
}

/// Paged K/V: per layer, `[num_blocks, kv_heads, block_size]` rows of `head_dim` values stored
/// as the layout's dtype (see [`ferry_core::kv_dtype`]), in word-aligned buffers (f32 rows are
/// read as f32 slices).
pub struct CpuKv {
    pub(crate) layout: KvLayout,
    k: Vec<Vec<u32>>,
    v: Vec<Vec<u32>>,
}

/// Byte offset of row (block, kv head, offset in block) in a layer's K or V bytes of a cache laid
/// out as `l`.
#[inline]
fn row_offset(l: &KvLayout, block: u32, head: usize, within: usize) -> usize {
    ((block as usize * l.n_kv_heads + head) * l.block_size + within) * l.row_bytes()
}

impl CpuKv {
    /// Byte offset of row (block, kv head, offset in block) in a layer's K or V bytes.
    #[inline]
    pub(crate) fn offset(&self, block: u32, head: usize, within: usize) -> usize {
        row_offset(&self.layout, block, head, within)
    }
    /// Layer `layer`'s K bytes.
    pub(crate) fn k(&self, layer: usize) -> &[u8] {
        bytemuck::cast_slice(&self.k[layer])
    }
    /// Layer `layer`'s V bytes.
    pub(crate) fn v(&self, layer: usize) -> &[u8] {
        bytemuck::cast_slice(&self.v[layer])
    }
    /// Layer `layer`'s K and V bytes, writable.
    fn kv_mut(&mut self, layer: usize) -> (&mut [u8], &mut [u8]) {
        (bytemuck::cast_slice_mut(&mut self.k[layer]), bytemuck::cast_slice_mut(&mut self.v[layer]))
    }
}

pub struct CpuBatch {
    pub(crate) plan: BatchPlan,
    pub(crate) cos: Vec<f32>,
    pub(crate) sin: Vec<f32>,
}

/// How the CPU backend multiplies activations with quantized weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activations {
    /// f32 activations against exactly dequantized weights: the reference's math.
    #[default]
    Exact,
    /// Single-row (decode) matmuls quantize the activation row to 8 bits per block of 32 and use
    /// integer dot products against Q4_0/Q4_1/Q8_0 weights, as llama.cpp does: faster, not exact.
    Q8,
}

pub struct CpuBackend {
    pool: rayon::ThreadPool,
    threads: usize,
    pub(crate) activations: Activations,
    /// Most activation rows a matmul runs by row-dot kernels (see [`CpuBackend::gemv_max_rows`]).
    gemv_max_rows: usize,
}

impl CpuBackend {
    /// A backend with `threads` worker threads (0 = one per core).
    pub fn new(threads: usize) -> Result<Self> {
        Self::with_activations(threads, Activations::Exact)
    }

    pub fn with_activations(threads: usize, activations: Activations) -> Result<Self> {
        let threads = if threads == 0 { std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1) } else { threads };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("ferry-cpu-{i}"))
            .build()
            .map_err(|e| EngineError::DeviceUnavailable("cpu".into(), e.to_string()))?;
        Ok(Self { pool, threads, activations, gemv_max_rows: matmul::GEMV_MAX_ROWS })
    }
    pub fn threads(&self) -> usize {
        self.threads
    }
    /// Most activation rows a matmul computes with the row-dot kernels, each row exactly as it
    /// would be alone (so decode steps of up to this many rows are batch-invariant): `GEMV_MAX_ROWS`,
    /// or `Q8_GEMV_MAX_ROWS` once [`pack_weights`] gave every matrix an interleaved copy for
    /// 8-bit activations. Longer steps dequantize the weights for an f32 GEMM.
    pub fn gemv_max_rows(&self) -> usize {
        self.gemv_max_rows
    }
    /// Raise the row-dot switch to `Q8_GEMV_MAX_ROWS` (when every matrix has an interleaved
    /// copy and the activations are 8-bit; the caller checks).
    pub(crate) fn set_all_interleaved(&mut self) {
        self.gemv_max_rows = matmul::Q8_GEMV_MAX_ROWS;
    }
    pub(crate) fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }
}

fn rms_norm_row(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let ss = simd::dot(x, x);
    let inv = 1.0 / (ss / x.len() as f32 + eps).sqrt();
    for ((o, x), w) in out.iter_mut().zip(x).zip(w) {
        *o = w * (x * inv);
    }
}

impl Backend for CpuBackend {
    type Tensor = CpuTensor;
    type Weight = CpuWeight;
    type Kv = CpuKv;
    type Batch = CpuBatch;

    fn describe(&self) -> String {
        let act = match self.activations {
            Activations::Exact => "f32 activations",
            Activations::Q8 => "q8 decode activations",
        };
        format!("cpu ({} threads, {}, {act})", self.threads, ferry_quant::simd_level())
    }

    fn run<R: Send>(&self, f: impl FnOnce() -> R + Send) -> Result<R> {
        Ok(self.pool.install(f))
    }

    fn upload(&self, w: &HostWeight) -> Result<CpuWeight> {
        let is_vector = w.shape.len() == 1;
        let aligned = bytemuck::try_cast_slice::<u8, f32>(w.bytes()).is_ok();
        let f32_copy = if is_vector || (w.ty == WeightType::F32 && !aligned) { Some(w.to_f32()) } else { None };
        let x8 = if self.activations == Activations::Q8 { w.x8.clone() } else { None };
        Ok(CpuWeight { ty: w.ty, rows: w.rows(), cols: w.cols(), row_bytes: w.row_bytes(), storage: w.storage.clone(), f32_copy, x8 })
    }

    fn tensor(&self, rows: usize, cols: usize) -> CpuTensor {
        CpuTensor { data: vec![0.0; rows * cols], rows, cols }
    }

    fn rows(&self, t: &CpuTensor) -> usize {
        t.rows
    }

    fn prepare(&self, plan: &BatchPlan, rope: &RopeTable) -> CpuBatch {
        let (cos, sin) = rope.angles(&plan.positions);
        CpuBatch { plan: plan.clone(), cos, sin }
    }

    fn embed(&self, table: &CpuWeight, ids: &[u32], out: &mut CpuTensor) {
        for (row, &id) in out.data.chunks_mut(out.cols).zip(ids) {
            ferry_quant::dequantize(table.ty, table.row(id as usize), row);
        }
    }

    fn rms_norm(&self, x: &CpuTensor, w: &CpuWeight, eps: f32, out: &mut CpuTensor) {
        let w = w.vector();
        let cols = x.cols;
        self.install(|| {
            out.data.par_chunks_mut(cols).zip(x.data.par_chunks(cols)).for_each(|(o, x)| rms_norm_row(x, w, eps, o));
        });
    }

    fn head_rms_norm(&self, x: &mut CpuTensor, w: &CpuWeight, head_dim: usize, eps: f32) {
        let w = w.vector();
        let mut tmp = vec![0f32; head_dim];
        for head in x.data.chunks_mut(head_dim) {
            rms_norm_row(head, w, eps, &mut tmp);
            head.copy_from_slice(&tmp);
        }
    }

    fn add(&self, x: &mut CpuTensor, y: &CpuTensor) {
        let add = |a: &mut [f32], b: &[f32]| a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
        if x.rows <= self.gemv_max_rows {
            add(&mut x.data, &y.data);
            return;
        }
        // A prompt's rows: split between the threads (a serial pass here idles the others).
        let cols = x.cols;
        self.install(|| x.data.par_chunks_mut(cols * 16).zip(y.data.par_chunks(cols * 16)).for_each(|(a, b)| add(a, b)));
    }

    fn matmul(&self, x: &CpuTensor, ws: &[(&CpuWeight, Option<&CpuWeight>)], outs: &mut [&mut CpuTensor]) {
        matmul::matmul(self, x, ws, outs);
    }

    fn rope(&self, x: &mut CpuTensor, batch: &CpuBatch, head_dim: usize) {
        let half = head_dim / 2;
        let rotate = |r: usize, row: &mut [f32]| {
            let (cos, sin) = (&batch.cos[r * half..(r + 1) * half], &batch.sin[r * half..(r + 1) * half]);
            for head in row.chunks_mut(head_dim) {
                let (a, b) = head.split_at_mut(half);
                for i in 0..half {
                    let (x1, x2) = (a[i], b[i]);
                    a[i] = x1 * cos[i] - x2 * sin[i];
                    b[i] = x2 * cos[i] + x1 * sin[i];
                }
            }
        };
        let cols = x.cols;
        if x.rows <= self.gemv_max_rows {
            x.data.chunks_mut(cols).enumerate().for_each(|(r, row)| rotate(r, row));
            return;
        }
        self.install(|| x.data.par_chunks_mut(cols).enumerate().with_min_len(16).for_each(|(r, row)| rotate(r, row)));
    }

    fn silu_mul(&self, gate: &mut CpuTensor, up: &CpuTensor) {
        let cols = gate.cols;
        self.install(|| {
            gate.data.par_chunks_mut(cols).zip(up.data.par_chunks(cols)).for_each(|(g, u)| simd::silu_mul(g, u));
        });
    }

    fn kv_write(&self, kv: &mut CpuKv, layer: usize, k: &CpuTensor, v: &CpuTensor, batch: &CpuBatch) {
        let l = kv.layout;
        let (hd, rb, bs) = (l.head_dim, l.row_bytes(), l.block_size);
        let (kb, vb) = kv.kv_mut(layer);
        for (r, &slot) in batch.plan.slots.iter().enumerate() {
            for h in 0..l.n_kv_heads {
                let dst = row_offset(&l, slot / bs as u32, h, slot as usize % bs);
                let src = r * k.cols + h * hd;
                encode_row(l.dtype, &k.data[src..src + hd], &mut kb[dst..dst + rb]);
                encode_row(l.dtype, &v.data[src..src + hd], &mut vb[dst..dst + rb]);
            }
        }
    }

    fn attention(&self, q: &CpuTensor, kv: &CpuKv, layer: usize, batch: &CpuBatch, out: &mut CpuTensor) {
        attention::attention(self, q, kv, layer, &batch.plan, out);
    }

    fn gather_rows(&self, x: &CpuTensor, rows: &[usize]) -> CpuTensor {
        let mut data = Vec::with_capacity(rows.len() * x.cols);
        for &r in rows {
            data.extend_from_slice(&x.data[r * x.cols..(r + 1) * x.cols]);
        }
        CpuTensor { data, rows: rows.len(), cols: x.cols }
    }

    fn to_host(&self, x: &CpuTensor) -> Vec<f32> {
        x.data.clone()
    }

    fn kv_budget_bytes(&self, _fraction: f32) -> Result<Option<usize>> {
        Ok(None)
    }

    fn kv_alloc(&self, layout: &KvLayout, num_blocks: usize) -> Result<CpuKv> {
        let words = (num_blocks * layout.n_kv_heads * layout.block_size * layout.row_bytes()).div_ceil(4);
        // vec![0; n] maps zeroed pages lazily: untouched blocks cost no memory.
        let layer = || vec![0u32; words];
        Ok(CpuKv { layout: *layout, k: (0..layout.n_layers).map(|_| layer()).collect(), v: (0..layout.n_layers).map(|_| layer()).collect() })
    }

    fn kv_export_layer(&self, kv: &CpuKv, layer: usize, blocks: &[u32], tokens: usize, out: &mut Vec<u8>) -> Result<()> {
        let (heads, bs, rb) = (kv.layout.n_kv_heads, kv.layout.block_size, kv.layout.row_bytes());
        for store in [kv.k(layer), kv.v(layer)] {
            for t in 0..tokens {
                for h in 0..heads {
                    let o = kv.offset(blocks[t / bs], h, t % bs);
                    out.extend_from_slice(&store[o..o + rb]);
                }
            }
        }
        Ok(())
    }

    /// `section` is in this cache's dtype (the engine converts a payload of another type first).
    fn kv_import_layer(&self, kv: &mut CpuKv, layer: usize, blocks: &[u32], tokens: usize, section: &[u8]) -> Result<()> {
        let l = kv.layout;
        let (heads, bs, rb) = (l.n_kv_heads, l.block_size, l.row_bytes());
        let want = l.layer_bytes(tokens);
        if section.len() != want {
            return Err(EngineError::Config(format!("a KV section of {} bytes for {tokens} tokens (expected {want})", section.len())));
        }
        let (kb, vb) = kv.kv_mut(layer);
        let (ks, vs) = section.split_at(want / 2);
        for (store, bytes) in [(kb, ks), (vb, vs)] {
            // Rows in payload order: token by token, KV head by KV head.
            for (i, row) in bytes.chunks_exact(rb).enumerate() {
                let (t, h) = (i / heads, i % heads);
                let o = row_offset(&l, blocks[t / bs], h, t % bs);
                store[o..o + rb].copy_from_slice(row);
            }
        }
        Ok(())
    }
}

/// Copy every weight matrix of `w` into one anonymous, huge-page-advised arena (64-byte aligned
/// tensors). Decode streams all weights every step; from the file's page-cache pages (4 KiB,
/// scattered) the hardware prefetchers stop at every page boundary and the TLB misses, which
/// costs as much as the arithmetic. The model file stays mapped only for what is not copied.
///
/// With `interleave` (the 8-bit-activation mode), every matrix the interleaved decode kernel
/// supports (`Q4_0`/`Q4_1`/`Q8_0`, rows a multiple of 8) also gets a copy with its rows in groups
/// of 8 (`HostWeight::x8`), after all the row-layout matrices: matmuls of at most
/// [`CpuBackend::gemv_max_rows`] rows (decode) read only those copies, longer prompts only the
/// originals. It costs their size again in memory. Returns whether every matrix a matmul reads
/// got such a copy (then the backend's row-dot switch may rise to `Q8_GEMV_MAX_ROWS`).
pub fn pack_weights(w: &mut crate::weights::WeightSet, n_layers: usize, interleave: bool) -> Result<bool> {
    const ALIGN: usize = 64;
    let x8_ok = |t: &HostWeight| interleave && ferry_quant::supports_x8(t.ty) && t.rows().is_multiple_of(ferry_quant::X8_ROWS) && t.rows() > 0;
    // Arena size: every matrix, plus room for an interleaved copy of each that may get one.
    let mut total = 0usize;
    for t in w.tensors.values().filter(|t| t.shape.len() == 2) {
        let n = t.bytes().len().next_multiple_of(ALIGN);
        total += if x8_ok(t) { 2 * n } else { n };
    }
    if total == 0 {
        return Ok(false);
    }
    let mut arena = memmap2::MmapMut::map_anon(total).map_err(|e| EngineError::DeviceUnavailable("cpu".into(), format!("cannot map {total} bytes for weights: {e}")))?;
    #[cfg(target_os = "linux")]
    let _ = arena.advise(memmap2::Advice::HugePage);
    // (key, offset, len, interleaved copy)
    let mut placed = Vec::new();
    let mut off = 0usize;
    // In the order a forward pass reads them, so a decode step streams the arena front to back.
    let keys: Vec<_> = crate::weights::WeightKey::all(n_layers).into_iter().filter(|k| w.tensors.get(k).is_some_and(|t| t.shape.len() == 2)).collect();
    for k in &keys {
        let t = &w.tensors[k];
        let n = t.bytes().len();
        arena[off..off + n].copy_from_slice(t.bytes());
        placed.push((*k, off, n, false));
        off += n.next_multiple_of(ALIGN);
    }
    // The embedding table is only looked up by row, unless it doubles as the output projection.
    let untied = w.tensors.contains_key(&crate::weights::WeightKey::LmHead);
    let multiplied = |k: &crate::weights::WeightKey| !(untied && *k == crate::weights::WeightKey::Embed);
    let all_interleaved = interleave && keys.iter().filter(|k| multiplied(k)).all(|k| x8_ok(&w.tensors[k]));
    for k in &keys {
        let t = &w.tensors[k];
        if x8_ok(t) && multiplied(k) {
            let n = t.bytes().len();
            ferry_quant::interleave_x8(t.ty, t.bytes(), t.cols(), &mut arena[off..off + n]);
            placed.push((*k, off, n, true));
            off += n.next_multiple_of(ALIGN);
        }
    }
    let map = std::sync::Arc::new(arena.make_read_only().map_err(|e| EngineError::DeviceUnavailable("cpu".into(), e.to_string()))?);
    for (k, offset, len, x8) in placed {
        if let Some(t) = w.tensors.get_mut(&k) {
            let s = Storage::Mapped { map: map.clone(), offset, len };
            if x8 { t.x8 = Some(s) } else { t.storage = s }
        }
    }
    Ok(all_interleaved)
}
