//! AVX2 kernel for eight interleaved weight rows against Q8 activation rows (see
//! `crate::x8` for the layout and the arithmetic, which the scalar kernel there spells out).
//!
//! Per block of 32 elements and group of 8 rows: four 32-byte loads of quants (lane `r` = 4
//! bytes of row `r`), low and high nibbles masked out, each `vpmaddubsw` against 4 activation
//! bytes broadcast to every lane, the eight 16-bit results summed (at most 8 · 2 · 15 · 127 =
//! 30480, so no overflow), one `vpmaddwd` with ones (row sums in the 32-bit lanes), one
//! conversion, and one FMA with the eight rows' `d_w · d_x`; the min term is one more FMA.

use core::arch::x86_64::*;

use super::prefetch_ahead;
use crate::q8::Q8Activations;
use crate::types::{QK, WeightType};
use crate::x8::{X8_ROWS, header_bytes};

/// `out[r * m + i]` for every row `r` of the interleaved groups `w` and activation row `i`
/// (lengths checked by the caller).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot(ty: WeightType, w: &[u8], xq: &Q8Activations, out: &mut [f32]) {
    match ty {
        WeightType::Q4_1 => groups::<Q4<true>>(w, xq, out),
        WeightType::Q4_0 => groups::<Q4<false>>(w, xq, out),
        WeightType::Q8_0 => groups::<Q8_0>(w, xq, out),
        _ => unreachable!("checked by the caller"),
    }
}

/// One format's arithmetic on one block of a group.
trait Format {
    const TY: WeightType;
    /// Add the block's terms for the 8 rows: the scaled integer sum to `acc`, the min term (if
    /// any) to `macc`.
    ///
    /// # Safety
    /// `blk` must point to the group's block (`TY.block_bytes() * 8` bytes), `x` to the 32
    /// activation quants of the same block.
    unsafe fn block(blk: *const u8, x: *const i8, dx: f32, sx: f32, acc: &mut __m256, macc: &mut __m256);
    /// The 8 rows' results from the two accumulators.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA (as for every function here).
    unsafe fn finish(acc: __m256, macc: __m256) -> __m256;
}

/// `Q4_1` (`MIN`: mins in the header) or `Q4_0` (min term `-8 d_w s_x`).
struct Q4<const MIN: bool>;
struct Q8_0;

impl<const MIN: bool> Format for Q4<MIN> {
    const TY: WeightType = if MIN { WeightType::Q4_1 } else { WeightType::Q4_0 };
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block(blk: *const u8, x: *const i8, dx: f32, sx: f32, acc: &mut __m256, macc: &mut __m256) {
        let hb = header_bytes(Self::TY);
        let mask = _mm256_set1_epi8(0x0F);
        // SAFETY: the loads stay within the block (header, then four 32-byte slices) and the
        // 32 activation quants (caller's contract).
        unsafe {
            let mut isum = _mm256_setzero_si256();
            for g in 0..4 {
                let v = _mm256_loadu_si256(blk.add(hb + 32 * g).cast());
                let lo = _mm256_and_si256(v, mask);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
                let xl = _mm256_set1_epi32(x.add(4 * g).cast::<i32>().read_unaligned());
                let xh = _mm256_set1_epi32(x.add(16 + 4 * g).cast::<i32>().read_unaligned());
                isum = _mm256_add_epi16(isum, _mm256_maddubs_epi16(lo, xl));
                isum = _mm256_add_epi16(isum, _mm256_maddubs_epi16(hi, xh));
            }
            let f = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum, _mm256_set1_epi16(1)));
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
            *acc = _mm256_fmadd_ps(f, _mm256_mul_ps(d, _mm256_set1_ps(dx)), *acc);
            let c = if MIN { _mm256_cvtph_ps(_mm_loadu_si128(blk.add(2 * X8_ROWS).cast())) } else { d };
            *macc = _mm256_fmadd_ps(c, _mm256_set1_ps(sx), *macc);
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn finish(acc: __m256, macc: __m256) -> __m256 {
        if MIN { _mm256_add_ps(acc, macc) } else { _mm256_fmadd_ps(_mm256_set1_ps(-8.0), macc, acc) }
    }
}

/// Signed weights: `vpmaddubsw` takes `|w|` and the activations with `w`'s signs (`vpsignb`); a
/// pair sum reaches 2 · 128 · 127, so each slice goes to 32 bits (`vpmaddwd`) before the eight
/// are added.
impl Format for Q8_0 {
    const TY: WeightType = WeightType::Q8_0;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block(blk: *const u8, x: *const i8, dx: f32, _sx: f32, acc: &mut __m256, _macc: &mut __m256) {
        let hb = header_bytes(Self::TY);
        // SAFETY: as for `Q4`, with eight slices.
        unsafe {
            let mut isum = _mm256_setzero_si256();
            for g in 0..8 {
                let v = _mm256_loadu_si256(blk.add(hb + 32 * g).cast());
                let xg = _mm256_set1_epi32(x.add(4 * g).cast::<i32>().read_unaligned());
                let p = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(xg, v));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(dx)), *acc);
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn finish(acc: __m256, _macc: __m256) -> __m256 {
        acc
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn groups<F: Format>(w: &[u8], xq: &Q8Activations, out: &mut [f32]) {
    let (nb, m) = (xq.k() / QK, xq.rows());
    let bb = F::TY.block_bytes() * X8_ROWS;
    let (xq8, xd, xs) = (xq.quants(), xq.scales(), xq.sums());
    // These make every access below in bounds.
    assert!(xq8.len() >= m * nb * QK && xd.len() >= m * nb && xs.len() >= m * nb && w.len() >= out.len() / (X8_ROWS * m) * nb * bb);
    let wp = w.as_ptr();
    for (gi, o) in out.chunks_exact_mut(X8_ROWS * m).enumerate() {
        for i in 0..m {
            let (mut acc, mut macc) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for b in 0..nb {
                let off = (gi * nb + b) * bb;
                if i == 0 {
                    // The first activation row streams the group from memory (a block's bytes a
                    // page ahead are asked for, as in the row-layout kernels); the others find it
                    // in L1.
                    prefetch_ahead(w, bb, gi * nb + b);
                }
                let xb = i * nb + b;
                // SAFETY: group gi's block b is bytes off..off + bb of w, row i's x block b is
                // xq8[32 xb..32 xb + 32], and xd[xb], xs[xb] exist (assert above).
                unsafe { F::block(wp.add(off), xq8.as_ptr().add(xb * QK), *xd.as_ptr().add(xb), *xs.as_ptr().add(xb), &mut acc, &mut macc) };
            }
            let mut v = [0f32; X8_ROWS];
            // SAFETY: v holds exactly 8 floats; AVX2 and FMA are enabled here.
            unsafe { _mm256_storeu_ps(v.as_mut_ptr(), F::finish(acc, macc)) };
            for (row, v) in v.into_iter().enumerate() {
                o[row * m + i] = v;
            }
        }
    }
}
