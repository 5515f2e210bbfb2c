//! `out = x · wᵀ (+ bias)` for f32 activations against weights in any storage type.
//!
//! Two regimes, as in llama.cpp and every CPU engine: with few activation rows (decode) the work is
//! memory-bound, so each weight row is read once and dotted against all activation rows with the
//! dequantizing kernels of `ferry-quant`; with many rows (prefill) it is compute-bound, so chunks of
//! weight rows are dequantized exactly to f32 and multiplied with an f32 GEMM. Both are exact f32
//! math over exactly dequantized weights. Threads split the output columns of all the projections
//! of one call, so Q/K/V (or gate/up) cost one parallel region.
//!
//! With `Activations::Q8` (opt-in), the few-row regime quantizes the activations to 8 bits and
//! uses integer kernels instead: on the interleaved copy of the weights (`CpuWeight::x8`) when
//! there is one, else (one row only) on the row layout.

use super::{Activations, CpuBackend, CpuTensor, CpuWeight, SyncPtr};
use rayon::prelude::*;

/// At most this many activation rows use the row-dot (GEMV) path. Its cost grows with every row
/// (each weight is dequantized in registers once per activation row), the GEMM path's mostly does
/// not (each weight is dequantized once per call): SmolLM2 Q4_1 decode steps of 10 and 12
/// sequences took 0.68-0.96x as long by row-dot as by GEMM in 22 of 24 paired runs (1 and 2
/// threads), 16 about the same, 20 and more longer (docs/benchmarks.md, issue #2's section).
pub const GEMV_MAX_ROWS: usize = 12;
/// The same switch with 8-bit activations when every matrix has an interleaved copy (the x8
/// kernels, `CpuWeight::x8`): a row there costs a fraction of an exact row-dot row, while the
/// GEMM path still dequantizes every weight to f32 once per call, so the row-dot path stays
/// cheaper far longer (docs/benchmarks.md, "The q8 switch"). Up to here q8 steps are
/// batch-invariant bit for bit.
pub const Q8_GEMV_MAX_ROWS: usize = 64;

/// One unit of parallel work: output columns `r0..r1` of projection `w`.
#[derive(Clone, Copy)]
struct Task {
    w: usize,
    r0: usize,
    r1: usize,
}

/// Each projection's output columns in tasks of `chunk(w)` columns (the last one shorter).
fn tasks(ws: &[(&CpuWeight, Option<&CpuWeight>)], chunk: impl Fn(&CpuWeight) -> usize) -> Vec<Task> {
    let mut t = Vec::new();
    for (i, (w, _)) in ws.iter().enumerate() {
        let c = chunk(w).max(1);
        let mut r0 = 0;
        while r0 < w.rows {
            let r1 = (r0 + c).min(w.rows);
            t.push(Task { w: i, r0, r1 });
            r0 = r1;
        }
    }
    t
}

pub(crate) fn matmul(be: &CpuBackend, x: &CpuTensor, ws: &[(&CpuWeight, Option<&CpuWeight>)], outs: &mut [&mut CpuTensor]) {
    let m = x.rows;
    for ((w, _), o) in ws.iter().zip(outs.iter()) {
        assert_eq!(w.cols, x.cols, "matmul: weight has {} columns, input {}", w.cols, x.cols);
        assert_eq!((o.rows, o.cols), (m, w.rows), "matmul: output shape");
    }
    if m == 0 {
        return;
    }
    let ptrs: Vec<SyncPtr> = outs.iter_mut().map(|o| SyncPtr(o.data.as_mut_ptr())).collect();
    let threads = be.threads();
    if m <= be.gemv_max_rows() {
        // Long runs of rows per task: each thread streams a few long ranges of weights, which the
        // kernels' software prefetch (a page ahead) keeps ahead of; two tasks per thread still
        // balance the work. (Tasks cut to equal bytes across Q/K/V, or four per thread, measured
        // no better through this machine's noise.) Whole groups of 8 rows, for the interleaved
        // kernel.
        let tasks = tasks(ws, |w| (w.rows / (threads * 2)).clamp(16, 4096).next_multiple_of(ferry_quant::X8_ROWS));
        // 8-bit activations: for one row (any Q4_0/Q4_1/Q8_0 weight), or for a few rows against
        // interleaved weights (the row-layout q8 kernel loses to the exact one for m > 1).
        // (Only when some weight takes them: f32/bf16/f16 and K-quant weights, whose rows need not
        // be whole blocks of 32, keep the exact path.)
        let takes_q8 = |w: &CpuWeight| w.x8.is_some() || (m == 1 && ferry_quant::supports_q8(w.ty));
        let q8 = (be.activations == Activations::Q8 && ws.iter().any(|(w, _)| takes_q8(w))).then(|| ferry_quant::Q8Activations::quantize(&x.data, x.cols));
        be.install(|| {
            tasks.par_iter().for_each_init(Vec::new, |tmp: &mut Vec<f32>, t| {
                let (w, bias) = ws[t.w];
                let n = w.rows;
                let bias = bias.map(|b| b.vector());
                let rows = t.r1 - t.r0;
                let wb = &w.bytes()[t.r0 * w.row_bytes..t.r1 * w.row_bytes];
                let out = ptrs[t.w];
                let b = |r: usize| bias.map_or(0.0, |b| b[r]);
                // Tasks start at multiples of 8 rows, and a weight has an interleaved copy only if
                // its row count is a multiple of 8: the task is whole groups. The kernel writes
                // the task's columns of every output row in place.
                if let (Some(xq), Some(x8)) = (&q8, &w.x8) {
                    // SAFETY: tasks cover disjoint column ranges of each output, and rows 0..m,
                    // columns r0..r1 at a stride of n lie inside its m*n elements; no other task
                    // touches those columns during the call.
                    let mut window = unsafe { ferry_quant::Outputs::strided(out.get().add(t.r0), m, n, rows) };
                    ferry_quant::dot_x8_q8_into(w.ty, &x8.bytes()[t.r0 * w.row_bytes..t.r1 * w.row_bytes], xq, &mut window);
                    if let Some(bv) = bias {
                        for i in 0..m {
                            // SAFETY: as above, this task's columns of row i.
                            let dst = unsafe { std::slice::from_raw_parts_mut(out.get().add(i * n + t.r0), rows) };
                            dst.iter_mut().zip(&bv[t.r0..t.r1]).for_each(|(d, b)| *d += b);
                        }
                    }
                    return;
                }
                tmp.resize(rows * m, 0.0);
                let tmp = &mut tmp[..];
                match &q8 {
                    Some(xq) if m == 1 && ferry_quant::supports_q8(w.ty) => ferry_quant::dot_many_q8(w.ty, wb, xq, tmp),
                    _ => ferry_quant::dot_many(w.ty, wb, w.cols, &x.data, tmp),
                }
                // The row-layout kernels give one run of activation rows per column.
                for (j, vals) in tmp.chunks_exact(m).enumerate() {
                    let r = t.r0 + j;
                    for (i, v) in vals.iter().enumerate() {
                        // SAFETY: tasks cover disjoint column ranges of each output, and
                        // (i, r) < (m, n) is inside the output buffer of m*n elements.
                        unsafe { *out.get().add(i * n + r) = v + b(r) };
                    }
                }
            });
        });
        return;
    }
    // Multiples of 24 columns: whole 6-wide micro-kernel tiles of `gemm` (AVX2 f32: 16 × 6), so
    // no task ends in a narrow edge tile.
    // Two tasks per thread per projection: `gemm` packs the activations once per call, so fewer,
    // wider tasks pack less (+2-5% prefill against four per thread, paired within one process);
    // one per thread loses more to imbalance than it saves.
    let tasks = tasks(ws, |w| (w.rows / (threads * 2)).div_ceil(24).clamp(1, 22) * 24);
    be.install(|| {
        tasks.par_iter().for_each_init(Vec::new, |scratch: &mut Vec<f32>, t| {
            let (w, bias) = ws[t.w];
            let (n, k, nc) = (w.rows, w.cols, t.r1 - t.r0);
            let rhs: &[f32] = match w.as_f32() {
                Some(all) => &all[t.r0 * k..t.r1 * k],
                None => {
                    scratch.resize(nc * k, 0.0);
                    ferry_quant::dequantize(w.ty, &w.bytes()[t.r0 * w.row_bytes..t.r1 * w.row_bytes], scratch);
                    scratch
                }
            };
            let dst = ptrs[t.w].get();
            // SAFETY: dst points at an m×n row-major buffer; this task writes only columns
            // r0..r1 (disjoint from every other task). lhs is m×k row-major, rhs holds nc rows of
            // k (read as the k×nc matrix wᵀ via its strides); all pointers are in bounds.
            unsafe {
                gemm::gemm(
                    m,
                    nc,
                    k,
                    dst.add(t.r0),
                    1,
                    n as isize,
                    false,
                    x.data.as_ptr(),
                    1,
                    k as isize,
                    rhs.as_ptr(),
                    k as isize,
                    1,
                    0.0,
                    1.0,
                    false,
                    false,
                    false,
                    gemm::Parallelism::None,
                );
            }
            if let Some(b) = bias.map(|b| b.vector()) {
                for i in 0..m {
                    for r in t.r0..t.r1 {
                        // SAFETY: as above, (i, r) is inside this task's columns of the output.
                        unsafe { *dst.add(i * n + r) += b[r] };
                    }
                }
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weights::Storage;
    use ferry_quant::WeightType;

    #[test]
    fn q8_mode_leaves_f32_weights_of_any_width_exact() {
        // 48 columns is not a whole number of Q8 blocks: the f32 weight must take the exact path
        // (it used to reach the activation quantizer, which panics on such a width).
        let be = CpuBackend::with_activations(1, Activations::Q8).unwrap();
        let (n, k) = (3, 48);
        let wv: Vec<f32> = (0..n * k).map(|i| (i % 7) as f32 - 3.0).collect();
        let storage = Storage::Owned(std::sync::Arc::new(bytemuck::cast_slice(&wv).to_vec()));
        let w = CpuWeight { ty: WeightType::F32, rows: n, cols: k, row_bytes: 4 * k, storage, f32_copy: None, x8: None };
        let x = CpuTensor::from_data(1, k, (0..k).map(|i| i as f32 * 0.25).collect());
        let mut out = CpuTensor::from_data(1, n, Vec::new());
        matmul(&be, &x, &[(&w, None)], &mut [&mut out]);
        for r in 0..n {
            let want: f32 = (0..k).map(|c| wv[r * k + c] * x.data[c]).sum();
            assert!((out.data[r] - want).abs() <= 1e-4 * want.abs().max(1.0), "row {r}: {} vs {want}", out.data[r]);
        }
    }
}
