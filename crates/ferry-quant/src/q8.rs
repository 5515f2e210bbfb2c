//! Decode with 8-bit activations, as llama.cpp does: each activation row is quantized to blocks of
//! 32 `i8` with one `f32` scale (`block_q8_1` semantics), and weight blocks of `Q8_0`, `Q4_0` and
//! `Q4_1` are multiplied with integer dot products, one `f32` multiply-add per block.
//!
//! Per block of 32, with activation scale `d_x`, quants `q` and `s_x = d_x * Σq`:
//! - `Q8_0`: `d_w * d_x * Σ q_w q`
//! - `Q4_0`: `d_w * d_x * Σ n q - 8 * d_w * s_x`
//! - `Q4_1`: `d_w * d_x * Σ n q + m_w * s_x`
//!
//! (`n` the unsigned nibbles.) The integer sums are exact, so the result is the dot product of the
//! exact weights with the dequantized activations `d_x * q`, up to `f32` rounding of the scale
//! products and of the summation. The quantization itself costs accuracy (about `d_x / 2` per
//! element); this path is opt-in.
//!
//! The scalar kernel here is the reference; `avx2/q8.rs` has the SIMD one.

use crate::SimdLevel;
use crate::types::{QK, WeightType, f16_to_f32, le_u16};

/// One block of 32 quants, aligned for whole-vector loads.
#[repr(C, align(32))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct QBlock(pub(crate) [i8; QK]);

/// Activation rows quantized to Q8 blocks of 32 (llama.cpp's `block_q8_1` semantics): per block a
/// scale `d = max|x| / 127`, 32 values `q = round(x / d)` as `i8` (`d = 0` → all zero), and
/// `s = d * Σq`.
///
/// As in llama.cpp, `x / d` is computed as `x * (1 / d)` and rounded half away from zero; every
/// SIMD level gives the same bits.
#[derive(Clone, Debug, Default)]
pub struct Q8Activations {
    /// Scales, `m * k / 32`, row-major (row `i`, block `b` at `i * k / 32 + b`).
    d: Vec<f32>,
    /// `d * Σq` per block, same layout as `d`.
    s: Vec<f32>,
    /// Quants, `m * k / 32` blocks, row-major.
    q: Vec<QBlock>,
    k: usize,
    m: usize,
    /// The scales and sums laid out for the AMX kernel, made by the first matmul that takes it.
    #[cfg(target_arch = "x86_64")]
    amx: std::sync::OnceLock<crate::avx512::amx::Scales>,
}

impl Q8Activations {
    /// Quantize `m = x.len() / k` rows of `k`.
    ///
    /// # Panics
    /// If `k` is not a positive multiple of 32 or `x.len()` is not a multiple of `k` (caller bugs).
    pub fn quantize(x: &[f32], k: usize) -> Self {
        let mut a = Self::default();
        a.quantize_into(x, k);
        a
    }

    /// As [`quantize`](Self::quantize), reusing this value's buffers.
    ///
    /// # Panics
    /// As [`quantize`](Self::quantize).
    pub fn quantize_into(&mut self, x: &[f32], k: usize) {
        assert!(k > 0 && k.is_multiple_of(QK), "ferry_quant::Q8Activations: k = {k} is not a positive multiple of 32");
        assert!(x.len().is_multiple_of(k), "ferry_quant::Q8Activations: {} values are not whole rows of k = {k}", x.len());
        let nblocks = x.len() / QK;
        self.d.resize(nblocks, 0.0);
        self.s.resize(nblocks, 0.0);
        self.q.resize(nblocks, QBlock::default());
        self.k = k;
        self.m = x.len() / k;
        #[cfg(target_arch = "x86_64")]
        {
            self.amx = std::sync::OnceLock::new();
        }
        let blocks = x.chunks_exact(QK).zip(self.q.iter_mut()).zip(self.d.iter_mut().zip(self.s.iter_mut()));
        #[cfg(target_arch = "x86_64")]
        if SimdLevel::selected() >= SimdLevel::Avx2 {
            for ((x, q), (d, s)) in blocks {
                // SAFETY: selected() only returns supported levels, so AVX2, FMA and F16C are
                // available; `x` is one whole block of 32 values.
                (*d, *s) = unsafe { crate::avx2::q8::quantize_block(x, &mut q.0) };
            }
            return;
        }
        for ((x, q), (d, s)) in blocks {
            (*d, *s) = quantize_block(x, &mut q.0);
        }
    }

    /// Activation rows `m`.
    pub fn rows(&self) -> usize {
        self.m
    }

    /// Elements per row.
    pub fn k(&self) -> usize {
        self.k
    }

    /// Block scales `d`, `rows() * k() / 32`, row-major.
    pub fn scales(&self) -> &[f32] {
        &self.d
    }

    /// Block sums `s = d * Σq`, same layout as [`scales`](Self::scales).
    pub fn sums(&self) -> &[f32] {
        &self.s
    }

    /// Quants, `rows() * k()`, row-major.
    pub fn quants(&self) -> &[i8] {
        // SAFETY: `QBlock` is `repr(C)` around `[i8; 32]` with size 32 (its alignment 32 adds no
        // padding), so `len` blocks are `32 * len` contiguous, initialized `i8`.
        unsafe { std::slice::from_raw_parts(self.q.as_ptr().cast::<i8>(), self.m * self.k) }
    }

    pub(crate) fn blocks(&self) -> &[QBlock] {
        &self.q
    }

    /// The scales, sums and padded last tile for the AMX kernel (made on first use, then shared).
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn amx_scales(&self) -> &crate::avx512::amx::Scales {
        self.amx.get_or_init(|| crate::avx512::amx::Scales::new(self))
    }
}

/// Reference quantization of one block: returns `(d, s)`. Operation for operation the same as
/// the AVX2 version (`max` of `|x|` is exact whatever the order).
pub(crate) fn quantize_block(x: &[f32], q: &mut [i8; QK]) -> (f32, f32) {
    let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut sum = 0i32;
    for (q, &v) in q.iter_mut().zip(x) {
        // `round` is half away from zero (C's `roundf`, as llama.cpp's reference uses).
        let r = (v * id).round() as i8;
        *q = r;
        sum += i32::from(r);
    }
    (d, d * sum as f32)
}

/// Whether [`dot_many_q8`] supports weights of this type (`Q8_0`, `Q4_0`, `Q4_1`).
pub fn supports_q8(ty: WeightType) -> bool {
    matches!(ty, WeightType::Q8_0 | WeightType::Q4_0 | WeightType::Q4_1)
}

/// As [`dot_many`](crate::dot_many), but against Q8-quantized activations:
/// `out[r*m + i] = Σ_blocks (weight block r · activation block i)` computed with integer products
/// and per-block `f32` scales, where `m = xq.rows()` and `n = w_rows.len() / ty.row_bytes(xq.k())`
/// weight rows. Uses the kernels of [`SimdLevel::selected`].
///
/// # Panics
/// On inconsistent lengths or an unsupported type (caller bugs).
pub fn dot_many_q8(ty: WeightType, w_rows: &[u8], xq: &Q8Activations, out: &mut [f32]) {
    dot_many_q8_at(SimdLevel::selected(), ty, w_rows, xq, out);
}

/// [`dot_many_q8`] with the kernels of a given level (tests and benchmarks compare levels;
/// `Avx512` uses the AVX2 kernels).
///
/// # Panics
/// As [`dot_many_q8`], and if `level` is not supported by this CPU.
pub fn dot_many_q8_with(level: SimdLevel, ty: WeightType, w_rows: &[u8], xq: &Q8Activations, out: &mut [f32]) {
    assert!(level.is_supported(), "ferry_quant::dot_many_q8: SIMD level {} not supported by this CPU", level.name());
    dot_many_q8_at(level, ty, w_rows, xq, out);
}

fn dot_many_q8_at(level: SimdLevel, ty: WeightType, w: &[u8], xq: &Q8Activations, out: &mut [f32]) {
    assert!(supports_q8(ty), "ferry_quant::dot_many_q8: weight type {ty} is not supported");
    let (k, m) = (xq.k, xq.m);
    assert!(m > 0, "ferry_quant::dot_many_q8: no activation rows");
    let rb = ty.row_bytes(k).expect("k is a multiple of 32");
    let n = w.len() / rb;
    assert!(
        n * rb == w.len() && n * m == out.len(),
        "ferry_quant::dot_many_q8: {} weight bytes / out {} do not fit {m} activation rows of k = {k} ({rb}-byte weight rows)",
        w.len(),
        out.len()
    );
    match level {
        SimdLevel::Scalar => dot_many_scalar(ty, w, rb, xq, out),
        #[cfg(target_arch = "x86_64")]
        SimdLevel::Avx2 | SimdLevel::Avx512 => {
            // SAFETY: callers pass only supported levels, and Avx512 includes AVX2, FMA and F16C;
            // the lengths were checked above.
            unsafe { crate::avx2::q8::dot_many(ty, w, rb, xq, out) }
        }
        #[cfg(not(target_arch = "x86_64"))]
        SimdLevel::Avx2 | SimdLevel::Avx512 => unreachable!("not supported on this architecture"),
    }
}

/// Reference kernel: per block, the exact integer sum times `d_w * d_x`, plus the min term.
fn dot_many_scalar(ty: WeightType, w: &[u8], rb: usize, xq: &Q8Activations, out: &mut [f32]) {
    let (m, nb) = (xq.m, xq.k / QK);
    let bb = ty.block_bytes();
    for (row, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(m)) {
        for (i, o) in o.iter_mut().enumerate() {
            let xs = i * nb..(i + 1) * nb;
            let blocks = row.chunks_exact(bb).zip(&xq.q[xs.clone()]).zip(xq.d[xs.clone()].iter().zip(&xq.s[xs]));
            *o = blocks
                .map(|((wb, q), (&dx, &sx))| {
                    let q = &q.0;
                    let dw = f16_to_f32(le_u16(wb, 0));
                    let (isum, min_term) = match ty {
                        WeightType::Q8_0 => (wb[2..2 + QK].iter().zip(q).map(|(&w, &q)| i32::from(w as i8) * i32::from(q)).sum(), 0.0),
                        WeightType::Q4_0 => (nibble_dot(&wb[2..2 + QK / 2], q), -8.0 * dw * sx),
                        _ => (nibble_dot(&wb[4..4 + QK / 2], q), f16_to_f32(le_u16(wb, 2)) * sx),
                    };
                    (dw * dx) * isum as f32 + min_term
                })
                .sum();
        }
    }
}

/// `Σ n_j q_j` over the 32 nibbles of `qs` (low nibbles are elements 0..16, high ones 16..32).
fn nibble_dot(qs: &[u8], q: &[i8; QK]) -> i32 {
    qs.iter()
        .enumerate()
        .map(|(j, &b)| i32::from(b & 0x0F) * i32::from(q[j]) + i32::from(b >> 4) * i32::from(q[j + QK / 2]))
        .sum()
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn avx2_quantization_matches_scalar_bits() {
        if !SimdLevel::Avx2.is_supported() {
            return;
        }
        // A simple LCG: values of many magnitudes, exact halves, zeros and a zero block.
        let mut state = 0x1234_5678_u64;
        let mut x: Vec<f32> = (0..32 * 200)
            .map(|i| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let v = ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2f32.powi(i % 19 - 9);
                if i % 7 == 0 { (v * 8.0).round() / 2.0 } else { v }
            })
            .collect();
        x[..32].fill(0.0);
        x[32] = 127.0;
        x[33] = 2.5;
        x[34] = -0.5;
        for xb in x.chunks_exact(QK) {
            let (mut a, mut b) = ([0i8; QK], [0i8; QK]);
            let want = quantize_block(xb, &mut a);
            // SAFETY: AVX2, FMA and F16C were checked above.
            let got = unsafe { crate::avx2::q8::quantize_block(xb, &mut b) };
            assert_eq!((got.0.to_bits(), got.1.to_bits(), b), (want.0.to_bits(), want.1.to_bits(), a), "{xb:?}");
        }
    }
}
