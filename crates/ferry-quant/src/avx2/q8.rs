//! AVX2 kernels for 8-bit activations (see `crate::q8`): block quantization and the integer dot.
//!
//! Per weight block and activation row: `vpmaddubsw` (unsigned weights × signed activations →
//! 16 `i16` pair sums, at most 2·15·127 for nibbles and 2·128·127 for `Q8_0`, so never
//! saturating), `vpmaddwd` with ones (→ 8 `i32`), `vcvtdq2ps`, and one FMA with `d_w * d_x`.
//! `Q8_0` weights are signed: `|w|` is the unsigned operand and the activations take `w`'s signs
//! (`vpsignb`). Each weight block is unpacked once for a tile of up to 8 activation rows (tiles
//! 8, 4, 2, 1 as in `avx2.rs`); with one activation row (decode), two weight rows go per pass so
//! that they share each activation block's load and scale. The `Q4_0`/`Q4_1` min terms
//! (`c_w * s_x`) need one scalar per weight block: the kernel stores `c_w` to a small buffer and takes its dot product with the
//! activation sums `s_x` once per chunk of blocks, per row.

use core::arch::x86_64::*;

use super::hsum;
use crate::q8::{Q8Activations, QBlock};
use crate::types::{QK, WeightType};

/// Quantizes one block of 32 (see `crate::q8::quantize_block`, which this matches bit for bit):
/// returns `(d, s)`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn quantize_block(x: &[f32], q: &mut [i8; QK]) -> (f32, f32) {
    assert!(x.len() >= QK);
    // SAFETY: x holds at least 32 floats: the loads cover x[0..32].
    let v = unsafe { [0, 1, 2, 3].map(|j| _mm256_loadu_ps(x.as_ptr().add(8 * j))) };
    let sign = _mm256_set1_ps(-0.0);
    let abs = v.map(|v| _mm256_andnot_ps(sign, v));
    let mx = _mm256_max_ps(_mm256_max_ps(abs[0], abs[1]), _mm256_max_ps(abs[2], abs[3]));
    let m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps::<1>(mx));
    let m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    let d = amax / 127.0;
    let id = _mm256_set1_ps(if d != 0.0 { 1.0 / d } else { 0.0 });
    let (half, one) = (_mm256_set1_ps(0.5), _mm256_set1_ps(1.0));
    // Round half away from zero, exactly as `f32::round`: truncate, then step away from zero
    // when the (exactly computed) fraction is at least one half.
    let r = v.map(|v| {
        let v = _mm256_mul_ps(v, id);
        let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(v);
        let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(v, t));
        let away = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(frac, half), _mm256_or_ps(one, _mm256_and_ps(v, sign)));
        _mm256_add_ps(t, away)
    });
    // The sum of 32 integers of magnitude <= 127 is exact in f32.
    let sum = hsum(_mm256_add_ps(_mm256_add_ps(r[0], r[1]), _mm256_add_ps(r[2], r[3])));
    let i = r.map(|r| _mm256_cvtps_epi32(r));
    // packs interleave 128-bit lanes: [0-3 of i0, i1, i2, i3 | 4-7 of i0, i1, i2, i3] as i32 groups.
    let p = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
    let p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    // SAFETY: q is 32 bytes; storeu has no alignment requirement.
    unsafe { _mm256_storeu_si256(q.as_mut_ptr().cast(), p) };
    (d, d * sum)
}

/// `out[r*m + i]` for every weight row `r` (of `rb` bytes) and activation row `i` of `xq`.
/// Preconditions as checked by `crate::q8::dot_many_q8_at`; `ty` must be supported.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_many(ty: WeightType, w: &[u8], rb: usize, xq: &Q8Activations, out: &mut [f32]) {
    match ty {
        WeightType::Q8_0 => many::<Q8_0>(w, rb, xq, out),
        WeightType::Q4_0 => many::<Q4_0>(w, rb, xq, out),
        WeightType::Q4_1 => many::<Q4_1>(w, rb, xq, out),
        _ => unreachable!("checked by the caller"),
    }
}

/// A weight block format for the integer kernel.
trait Weights {
    const BYTES: usize;
    /// Factor of the min term `Σ c_w s_x` (0: no min term).
    const MIN: f32;
    /// `(u, sg, dc)`: the unsigned `maddubs` operand, the signs to apply to the activations
    /// (`Q8_0` only), and `d_w` in lane 0 of `dc` (`c_w` in lane 0 of [`min_coef`](Self::min_coef)`(dc)`).
    ///
    /// # Safety
    /// `b` must point to `BYTES` readable bytes.
    unsafe fn load(b: *const u8) -> (__m256i, __m256i, __m128);
    /// The min coefficient `c_w` in lane 0.
    ///
    /// # Safety
    /// The CPU must support AVX2 (as for every function here).
    unsafe fn min_coef(dc: __m128) -> __m128;
    /// 16 `i16` sums of adjacent products of weights and activations `x`.
    ///
    /// # Safety
    /// The CPU must support AVX2.
    unsafe fn mul(u: __m256i, sg: __m256i, x: __m256i) -> __m256i;
}

struct Q8_0;
struct Q4_0;
struct Q4_1;

/// The 32 nibbles of 16 bytes at `qs` as bytes in element order (low nibbles, then high ones).
///
/// # Safety
/// `qs` must point to 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(qs: *const u8) -> __m256i {
    // SAFETY: one 16-byte load at qs (caller's contract), into both 128-bit halves.
    let v = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(qs.cast())) };
    // The upper half shifted right by 4 within 64-bit lanes: each byte's low 4 bits are then its
    // high nibble (the bits shifted in from the next byte land above them and are masked off).
    _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_setr_epi64x(0, 0, 4, 4)), _mm256_set1_epi8(0x0F))
}

impl Weights for Q8_0 {
    const BYTES: usize = 34;
    const MIN: f32 = 0.0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(b: *const u8) -> (__m256i, __m256i, __m128) {
        // SAFETY: reads bytes 0..2 (d) and 2..34 (qs): within BYTES.
        unsafe {
            let w = _mm256_loadu_si256(b.add(2).cast());
            (_mm256_abs_epi8(w), w, super::load_f16(b))
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn min_coef(dc: __m128) -> __m128 {
        dc
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mul(u: __m256i, sg: __m256i, x: __m256i) -> __m256i {
        _mm256_maddubs_epi16(u, _mm256_sign_epi8(x, sg))
    }
}

impl Weights for Q4_0 {
    const BYTES: usize = 18;
    const MIN: f32 = -8.0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(b: *const u8) -> (__m256i, __m256i, __m128) {
        // SAFETY: reads bytes 0..2 (d) and 2..18 (qs): within BYTES.
        unsafe {
            let u = nibbles(b.add(2));
            (u, u, super::load_f16(b))
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn min_coef(dc: __m128) -> __m128 {
        dc // c_w = d_w, times MIN = -8
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mul(u: __m256i, _: __m256i, x: __m256i) -> __m256i {
        _mm256_maddubs_epi16(u, x)
    }
}

impl Weights for Q4_1 {
    const BYTES: usize = 20;
    const MIN: f32 = 1.0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(b: *const u8) -> (__m256i, __m256i, __m128) {
        // SAFETY: reads bytes 0..4 (d, m) and 4..20 (qs): within BYTES.
        unsafe {
            let dm = b.cast::<i32>().read_unaligned();
            let u = nibbles(b.add(4));
            (u, u, _mm_cvtph_ps(_mm_cvtsi32_si128(dm)))
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn min_coef(dc: __m128) -> __m128 {
        _mm_movehdup_ps(dc) // m_w from lane 1
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn mul(u: __m256i, _: __m256i, x: __m256i) -> __m256i {
        _mm256_maddubs_epi16(u, x)
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn many<B: Weights>(w: &[u8], rb: usize, xq: &Q8Activations, out: &mut [f32]) {
    let m = xq.rows();
    if m == 1 {
        // Decode: two weight rows per pass share each activation block's load and scale.
        let mut pairs = w.chunks_exact(2 * rb).zip(out.chunks_exact_mut(2));
        for (i, (rows, o)) in pairs.by_ref().enumerate() {
            super::prefetch_ahead(w, rb, 2 * i);
            super::prefetch_ahead(w, rb, 2 * i + 1);
            (o[0], o[1]) = row_pair::<B>(&rows[..rb], &rows[rb..], xq);
        }
        let done = w.len() / (2 * rb) * 2;
        if done * rb < w.len() {
            tile::<B, 1, 4>(&w[done * rb..], xq, 0, &mut out[done..]);
        }
        return;
    }
    for (i, (row, o)) in w.chunks_exact(rb).zip(out.chunks_exact_mut(m)).enumerate() {
        super::prefetch_ahead(w, rb, i);
        let mut r = 0;
        while r < m {
            let o = &mut o[r..];
            r += match m - r {
                8.. => tile::<B, 8, 1>(row, xq, r, o),
                4..=7 => tile::<B, 4, 2>(row, xq, r, o),
                2 | 3 => tile::<B, 2, 4>(row, xq, r, o),
                _ => tile::<B, 1, 4>(row, xq, r, o),
            };
        }
    }
}

/// Weight blocks per chunk of the min-term buffer.
const CHUNK: usize = 64;

/// `out[0..R]`: one weight row against activation rows `r0..r0 + R`, `A` accumulators per row.
/// Returns `R`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn tile<B: Weights, const R: usize, const A: usize>(w: &[u8], xq: &Q8Activations, r0: usize, out: &mut [f32]) -> usize {
    let nb = xq.k() / QK;
    let (xb, xd, xs) = (xq.blocks(), xq.scales(), xq.sums());
    // These make every access in `step` in bounds.
    assert!(w.len() >= nb * B::BYTES && xb.len() >= (r0 + R) * nb && xd.len() == xb.len() && xs.len() == xb.len() && out.len() >= R);
    let mut acc = [[_mm256_setzero_ps(); R]; A];
    // R = 1 (decode): the min term goes straight into A scalar accumulators. Otherwise the
    // block's coefficients go to `cbuf`, dotted with each row's sums once per chunk.
    let mut macc = [_mm_setzero_ps(); A];
    let mut mins = [0f32; R];
    let mut cbuf = [0f32; CHUNK];
    let mut c0 = 0;
    while c0 < nb {
        let c1 = (c0 + CHUNK).min(nb);
        let mut b = c0;
        while b + A <= c1 {
            for (a, (acc, macc)) in acc.iter_mut().zip(&mut macc).enumerate() {
                // SAFETY: b + a < c1 <= nb, and the assert above covers rows r0..r0 + R.
                unsafe { step::<B, R>(w, xb, xd, xs, nb, r0, b + a, &mut cbuf[b + a - c0], macc, acc) };
            }
            b += A;
        }
        while b < c1 {
            // SAFETY: as above, b < c1 <= nb.
            unsafe { step::<B, R>(w, xb, xd, xs, nb, r0, b, &mut cbuf[b - c0], &mut macc[0], &mut acc[0]) };
            b += 1;
        }
        if B::MIN != 0.0 && R > 1 {
            for (r, mn) in mins.iter_mut().enumerate() {
                let base = (r0 + r) * nb;
                *mn += dot(&cbuf[..c1 - c0], &xs[base + c0..base + c1]);
            }
        }
        c0 = c1;
    }
    if R == 1 {
        mins[0] = macc.iter().map(|&v| _mm_cvtss_f32(v)).sum();
    }
    for (r, o) in out[..R].iter_mut().enumerate() {
        let mut v = acc[0][r];
        for acc in &acc[1..] {
            v = _mm256_add_ps(v, acc[r]);
        }
        *o = hsum(v) + B::MIN * mins[r];
    }
    R
}

/// Two weight rows against the single activation row of `xq` (the decode case, `m = 1`): the
/// same per-block arithmetic as `tile::<B, 1, _>` (so the same sums up to accumulation order),
/// with the activation block and its scale loaded once for both rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn row_pair<B: Weights>(w0: &[u8], w1: &[u8], xq: &Q8Activations) -> (f32, f32) {
    let nb = xq.k() / QK;
    let (xb, xd, xs) = (xq.blocks(), xq.scales(), xq.sums());
    // These make every access below in bounds.
    assert!(w0.len() >= nb * B::BYTES && w1.len() >= nb * B::BYTES && xb.len() >= nb && xd.len() >= nb && xs.len() >= nb);
    let ones = _mm256_set1_epi16(1);
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (mut m0, mut m1) = (_mm_setzero_ps(), _mm_setzero_ps());
    for b in 0..nb {
        // SAFETY: b < nb: block b lies within w0 and w1, entry b within xb, xd and xs; blocks are
        // 32-byte aligned.
        unsafe {
            let x = _mm256_load_si256(xb.as_ptr().add(b).cast());
            let dx = _mm_load_ss(xd.as_ptr().add(b));
            let (u0, sg0, dc0) = B::load(w0.as_ptr().add(b * B::BYTES));
            let (u1, sg1, dc1) = B::load(w1.as_ptr().add(b * B::BYTES));
            let p0 = _mm256_cvtepi32_ps(_mm256_madd_epi16(B::mul(u0, sg0, x), ones));
            let p1 = _mm256_cvtepi32_ps(_mm256_madd_epi16(B::mul(u1, sg1, x), ones));
            a0 = _mm256_fmadd_ps(p0, _mm256_broadcastss_ps(_mm_mul_ss(dc0, dx)), a0);
            a1 = _mm256_fmadd_ps(p1, _mm256_broadcastss_ps(_mm_mul_ss(dc1, dx)), a1);
            if B::MIN != 0.0 {
                let s = _mm_load_ss(xs.as_ptr().add(b));
                m0 = _mm_fmadd_ss(B::min_coef(dc0), s, m0);
                m1 = _mm_fmadd_ss(B::min_coef(dc1), s, m1);
            }
        }
    }
    (hsum(a0) + B::MIN * _mm_cvtss_f32(m0), hsum(a1) + B::MIN * _mm_cvtss_f32(m1))
}

/// Weight block `b` against block `b` of activation rows `r0..r0 + R`: `acc[r] += (d_w d_x) Σ`;
/// for the min term (if the format has one) adds `c_w * s_x` to `macc` when `R = 1`, else stores
/// `c_w` to `c`.
///
/// # Safety
/// `w` must hold block `b` (`(b + 1) * BYTES` bytes), and `xb`, `xd`, `xs` entries `(r0 + r) * nb + b`
/// for `r < R` must exist.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn step<B: Weights, const R: usize>(
    w: &[u8],
    xb: &[QBlock],
    xd: &[f32],
    xs: &[f32],
    nb: usize,
    r0: usize,
    b: usize,
    c: &mut f32,
    macc: &mut __m128,
    acc: &mut [__m256; R],
) {
    // SAFETY: block b lies within w (caller's contract).
    let (u, sg, dc) = unsafe { B::load(w.as_ptr().add(b * B::BYTES)) };
    if B::MIN != 0.0 {
        // SAFETY: AVX2 is enabled in this function.
        let cw = unsafe { B::min_coef(dc) };
        if R == 1 {
            // SAFETY: entry r0 * nb + b of xs exists (caller's contract).
            *macc = _mm_fmadd_ss(cw, unsafe { _mm_load_ss(xs.as_ptr().add(r0 * nb + b)) }, *macc);
        } else {
            *c = _mm_cvtss_f32(cw);
        }
    }
    let dw = _mm256_broadcastss_ps(dc);
    let ones = _mm256_set1_epi16(1);
    for (r, acc) in acc.iter_mut().enumerate() {
        let i = (r0 + r) * nb + b;
        // SAFETY: i is within xb and xd (caller's contract); blocks are 32-byte aligned.
        let (x, dx) = unsafe { (_mm256_load_si256(xb.as_ptr().add(i).cast()), _mm256_broadcast_ss(&*xd.as_ptr().add(i))) };
        // SAFETY: AVX2 is enabled in this function.
        let p = _mm256_madd_epi16(unsafe { B::mul(u, sg, x) }, ones);
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dw, dx), *acc);
    }
}

/// `Σ a[i] b[i]` over `a.len()` (<= `b.len()`) elements.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let b = &b[..a.len()];
    let mut acc = _mm256_setzero_ps();
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        // SAFETY: each chunk holds exactly 8 floats.
        acc = unsafe { _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr()), _mm256_loadu_ps(y.as_ptr()), acc) };
    }
    hsum(acc) + tail
}
