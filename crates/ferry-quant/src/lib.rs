//! GGML block-quantized weight formats on CPU: layouts, exact dequantization, and dot-product
//! kernels of `f32` activations against one quantized weight row.
//!
//! Formats are llama.cpp's (GGUF): `Q8_0`, `Q4_0`, `Q4_1`, `Q4_K`, `Q6_K`, plus dense `F32`, `F16`
//! and `BF16` ([`WeightType`] documents the layouts). The engine uses two entry points:
//!
//! - [`dot_rows`] for decode: one weight row against a few activation rows, dequantizing inside
//!   the kernel so weights stay quantized in memory (the engine parallelizes over weight rows).
//! - [`dequantize`] for prefill: whole rows to `f32` scratch for an `f32` GEMM. It is exact: the
//!   same `f32` values as llama.cpp's `dequantize_row_*`.
//!
//! The opt-in 8-bit-activation decode path has its own entry points: [`dot_many_q8`] on the row
//! layout, and [`dot_x8_q8`] on a copy made by [`interleave_x8`] with eight rows interleaved (one
//! vector lane per row; the fast one, see `x8.rs`).
//!
//! Kernels exist for three [`SimdLevel`]s: AVX-512 (F+BW+VL), AVX2 (+FMA+F16C) and portable
//! scalar code. At the AVX-512 level the interleaved kernel uses VNNI (`vpdpbusd`) where the CPU
//! has it, and the AVX2 kernel where it does not. The best level the CPU supports is detected once,
//! at first use; the environment variable `FERRY_QUANT_SIMD` (`scalar`, `avx2`, `avx512`) can lower
//! it, for debugging and benchmarks. Each SIMD kernel file keeps the structure of the others, and
//! the scalar module is the oracle the tests compare them against (llm.c's habit: kernel and
//! reference side by side).

mod q8;
mod scalar;
mod types;
mod x8;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use std::sync::OnceLock;

pub use q8::{Q8Activations, dot_many_q8, dot_many_q8_with, supports_q8};
pub use types::WeightType;
pub use x8::{Outputs, X8_ROWS, X8Kernel, dot_x8_q8, dot_x8_q8_by, dot_x8_q8_into, dot_x8_q8_with, interleave_x8, supports_x8};

/// An instruction-set level with its own set of kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SimdLevel {
    /// Portable Rust, any target.
    Scalar,
    /// x86-64 with AVX2, FMA and F16C.
    Avx2,
    /// x86-64 with AVX-512 F, BW and VL (and everything `Avx2` needs).
    Avx512,
}

impl SimdLevel {
    /// Every level, lowest first.
    pub const ALL: [SimdLevel; 3] = [SimdLevel::Scalar, SimdLevel::Avx2, SimdLevel::Avx512];

    /// "scalar", "avx2" or "avx512".
    pub fn name(self) -> &'static str {
        match self {
            SimdLevel::Scalar => "scalar",
            SimdLevel::Avx2 => "avx2",
            SimdLevel::Avx512 => "avx512",
        }
    }

    /// Whether this CPU can run this level's kernels (checked at run time, every call).
    pub fn is_supported(self) -> bool {
        match self {
            SimdLevel::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx2 => {
                std::is_x86_feature_detected!("avx2")
                    && std::is_x86_feature_detected!("fma")
                    && std::is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            SimdLevel::Avx512 => {
                SimdLevel::Avx2.is_supported()
                    && std::is_x86_feature_detected!("avx512f")
                    && std::is_x86_feature_detected!("avx512bw")
                    && std::is_x86_feature_detected!("avx512vl")
            }
            #[cfg(not(target_arch = "x86_64"))]
            SimdLevel::Avx2 | SimdLevel::Avx512 => false,
        }
    }

    /// The level [`dot_rows`] and [`dequantize`] use: the best supported one, capped by the
    /// environment variable `FERRY_QUANT_SIMD` if set. Detected once and cached.
    pub fn selected() -> SimdLevel {
        static SELECTED: OnceLock<SimdLevel> = OnceLock::new();
        *SELECTED.get_or_init(|| {
            let best = SimdLevel::ALL.into_iter().rev().find(|l| l.is_supported()).unwrap_or(SimdLevel::Scalar);
            let cap = std::env::var("FERRY_QUANT_SIMD")
                .ok()
                .and_then(|v| SimdLevel::ALL.into_iter().find(|l| l.name() == v.trim()));
            cap.map_or(best, |c| c.min(best))
        })
    }
}

/// `dot_rows` for `n` consecutive weight rows at once: `out[r*m + i] = dot(w_rows[r], x[i*k..])`
/// where `n = w_rows.len() / ty.row_bytes(k)` and `m = out.len() / n`. One dispatch and one set of
/// checks for the whole range (the per-call cost of [`dot_rows`] is ~15 ns, a quarter of a
/// 576-wide Q4_1 row).
///
/// # Panics
/// If the lengths are inconsistent (caller bugs).
pub fn dot_many(ty: WeightType, w_rows: &[u8], k: usize, x: &[f32], out: &mut [f32]) {
    let rb = ty.row_bytes(k).expect("ferry_quant::dot_many: k is not a multiple of the block size");
    let n = w_rows.len() / rb;
    assert!(n * rb == w_rows.len() && n > 0, "ferry_quant::dot_many: {} bytes is not a whole number of {rb}-byte rows", w_rows.len());
    let m = out.len() / n;
    assert!(m * n == out.len() && m * k == x.len(), "ferry_quant::dot_many: out {} / x {} do not fit {n} rows of k = {k}", out.len(), x.len());
    match SimdLevel::selected() {
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => {
            // SAFETY: selected() only returns supported levels; lengths were checked above.
            unsafe { avx2::dot_many(ty, w_rows, rb, x, k, m, out) }
        }
        level => {
            for (w, o) in w_rows.chunks_exact(rb).zip(out.chunks_exact_mut(m)) {
                dot_rows_at(level, ty, w, x, o);
            }
        }
    }
}

/// Which SIMD level was selected at run time ("avx512", "avx2", "scalar"), for logs and benchmarks.
pub fn simd_level() -> &'static str {
    SimdLevel::selected().name()
}

/// Exact dequantization of `dst.len()` elements from `src`, with the kernels of
/// [`SimdLevel::selected`].
///
/// Every element is the `f32` llama.cpp's `dequantize_row_*` computes from the same bytes: scales
/// are converted `f16 -> f32`, then e.g. `Q4_1` is `(d * q) + m` with two roundings (no fused
/// multiply-add). Every SIMD level gives the same bits. See [`WeightType`] for the layouts.
///
/// # Panics
/// If `src.len() != ty.row_bytes(dst.len())`, including when `dst.len()` is not a whole number of
/// blocks (a caller bug).
pub fn dequantize(ty: WeightType, src: &[u8], dst: &mut [f32]) {
    dequantize_at(SimdLevel::selected(), ty, src, dst);
}

/// [`dequantize`] with the kernels of a given level (tests and benchmarks compare levels).
///
/// # Panics
/// As [`dequantize`], and if `level` is not supported by this CPU.
pub fn dequantize_with(level: SimdLevel, ty: WeightType, src: &[u8], dst: &mut [f32]) {
    assert!(level.is_supported(), "ferry_quant::dequantize: SIMD level {} not supported by this CPU", level.name());
    dequantize_at(level, ty, src, dst);
}

/// Checks the lengths and runs `level`'s dequantizer. `level` must be supported.
fn dequantize_at(level: SimdLevel, ty: WeightType, src: &[u8], dst: &mut [f32]) {
    let expected = ty.row_bytes(dst.len());
    assert!(
        expected == Some(src.len()),
        "ferry_quant::dequantize: {} bytes for {} {} elements, expected {:?}",
        src.len(),
        dst.len(),
        ty,
        expected
    );
    match level {
        SimdLevel::Scalar => scalar::dequantize(ty, src, dst),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => {
            // SAFETY: callers pass only supported levels, so AVX2, FMA and F16C are available.
            unsafe { avx2::dequantize(ty, src, dst) }
        }
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => {
            // SAFETY: callers pass only supported levels, so AVX-512 F/BW/VL, AVX2, FMA and F16C
            // are available.
            unsafe { avx512::dequantize(ty, src, dst) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        SimdLevel::Avx2 | SimdLevel::Avx512 => unreachable!("not supported on this architecture"),
    }
}

/// `out[i] = dot(weight_row, x[i*k .. (i+1)*k])` for `i` in `0..out.len()`, where
/// `k = x.len() / out.len()`, with the kernels of [`SimdLevel::selected`].
///
/// `w_row` holds one row of `k` elements in format `ty`. Each weight block is unpacked once per
/// group of activation rows (up to 16 rows with AVX-512, 8 with AVX2). The result equals the dot
/// product of `x` with [`dequantize`]`(w_row)` up to `f32` summation-order rounding (relative
/// error well under `1e-5` of `sum |x * w|`). An empty `out` is a no-op.
///
/// Performance: `x` starting on a 64-byte boundary (with `k * 4` a multiple of 64, as for
/// `k = 576`) avoids loads that straddle cache lines; `m > 1` costs ~20% more without it.
///
/// # Panics
/// If `x.len()` is not a multiple of `out.len()`, or `w_row.len() != ty.row_bytes(k)` (caller bugs).
pub fn dot_rows(ty: WeightType, w_row: &[u8], x: &[f32], out: &mut [f32]) {
    // `selected()` only returns supported levels.
    dot_rows_at(SimdLevel::selected(), ty, w_row, x, out);
}

/// [`dot_rows`] with the kernels of a given level (tests and benchmarks compare levels).
///
/// # Panics
/// As [`dot_rows`], and if `level` is not supported by this CPU.
pub fn dot_rows_with(level: SimdLevel, ty: WeightType, w_row: &[u8], x: &[f32], out: &mut [f32]) {
    assert!(level.is_supported(), "ferry_quant::dot_rows: SIMD level {} not supported by this CPU", level.name());
    dot_rows_at(level, ty, w_row, x, out);
}

/// Checks the lengths and runs `level`'s kernel. `level` must be supported (checked by callers).
/// This runs once per weight row, so it avoids divisions and repeated feature checks.
#[inline(always)]
fn dot_rows_at(level: SimdLevel, ty: WeightType, w_row: &[u8], x: &[f32], out: &mut [f32]) {
    let m = out.len();
    if m == 0 {
        return;
    }
    let k = if m == 1 { x.len() } else { x.len() / m };
    assert!(k * m == x.len(), "ferry_quant::dot_rows: x.len() = {} is not a multiple of out.len() = {}", x.len(), m);
    let expected = ty.row_bytes(k);
    assert!(
        expected == Some(w_row.len()),
        "ferry_quant::dot_rows: {} weight bytes for a {} row of k = {}, expected {:?}",
        w_row.len(),
        ty,
        k,
        expected
    );
    match level {
        SimdLevel::Scalar => scalar::dot_rows(ty, w_row, x, out),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 => {
            // SAFETY: callers pass only supported levels, so AVX2, FMA and F16C are available.
            unsafe { avx2::dot_rows(ty, w_row, x, k, out) }
        }
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx512 => {
            // SAFETY: callers pass only supported levels, so AVX-512 F/BW/VL, AVX2, FMA and F16C
            // are available.
            unsafe { avx512::dot_rows(ty, w_row, x, k, out) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        SimdLevel::Avx2 | SimdLevel::Avx512 => unreachable!("not supported on this architecture"),
    }
}
