//! AVX2 kernel for eight interleaved weight rows against one Q8 activation row (see
//! `crate::x8` for the layout and the arithmetic, which the scalar kernel there spells out).
//!
//! Per block of 32 elements and group of 8 rows: four 32-byte loads of quants (lane `r` = 4
//! bytes of row `r`), low and high nibbles masked out, each `vpmaddubsw` against 4 activation
//! bytes broadcast to every lane, the eight 16-bit results summed (at most 8 · 2 · 15 · 127 =
//! 30480, so no overflow), one `vpmaddwd` with ones (row sums in the 32-bit lanes), one
//! conversion, and one FMA with the eight rows' `d_w · d_x`; the min term is one more FMA.

use core::arch::x86_64::*;

use crate::q8::Q8Activations;
use crate::types::{QK, WeightType};
use crate::x8::{X8_ROWS, header_bytes};

/// Bytes ahead of the current block that the kernel prefetches (as `prefetch_ahead`).
const PREFETCH_BYTES: usize = 4096;

/// `out[r * m + i]` for every row `r` of the interleaved groups `w` and activation row `i`
/// (lengths checked by the caller).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot(ty: WeightType, w: &[u8], xq: &Q8Activations, out: &mut [f32]) {
    match ty {
        WeightType::Q4_1 => groups::<true>(w, xq, out),
        WeightType::Q4_0 => groups::<false>(w, xq, out),
        WeightType::Q8_0 => groups_q8_0(w, xq, out),
        _ => unreachable!("checked by the caller"),
    }
}

/// `MIN`: `Q4_1` (mins in the header); otherwise `Q4_0` (min term `-8 d_w s_x`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn groups<const MIN: bool>(w: &[u8], xq: &Q8Activations, out: &mut [f32]) {
    let ty = if MIN { WeightType::Q4_1 } else { WeightType::Q4_0 };
    let (nb, m) = (xq.k() / QK, xq.rows());
    let (bb, hb) = (ty.block_bytes() * X8_ROWS, header_bytes(ty));
    let (xq8, xd, xs) = (xq.quants(), xq.scales(), xq.sums());
    // These make every access below in bounds.
    assert!(xq8.len() >= m * nb * QK && xd.len() >= m * nb && xs.len() >= m * nb && w.len() >= out.len() / (X8_ROWS * m) * nb * bb);
    let (mask, ones) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi16(1));
    let wp = w.as_ptr();
    for (gi, o) in out.chunks_exact_mut(X8_ROWS * m).enumerate() {
        for i in 0..m {
            let (mut acc, mut macc) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for b in 0..nb {
                let off = (gi * nb + b) * bb;
                // SAFETY: group gi's block b is bytes off..off + bb of w (assert above); row i's
                // x block b is xq8[(i nb + b) 32..][..32]; xd, xs entries i nb + b exist.
                // Prefetches have no architectural effect (and stay within w).
                unsafe {
                    let blk = wp.add(off);
                    let ahead = off + PREFETCH_BYTES;
                    if i == 0 && ahead + bb <= w.len() {
                        let p = wp.add(ahead);
                        _mm_prefetch::<_MM_HINT_T0>(p.cast());
                        _mm_prefetch::<_MM_HINT_T0>(p.add(64).cast());
                        _mm_prefetch::<_MM_HINT_T0>(p.add(bb - 1).cast());
                    }
                    let xb = i * nb + b;
                    let x = xq8.as_ptr().add(xb * QK);
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
                    let f = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum, ones));
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
                    acc = _mm256_fmadd_ps(f, _mm256_mul_ps(d, _mm256_set1_ps(*xd.as_ptr().add(xb))), acc);
                    let c = if MIN { _mm256_cvtph_ps(_mm_loadu_si128(blk.add(2 * X8_ROWS).cast())) } else { d };
                    macc = _mm256_fmadd_ps(c, _mm256_set1_ps(*xs.as_ptr().add(xb)), macc);
                }
            }
            let r = if MIN { _mm256_add_ps(acc, macc) } else { _mm256_fmadd_ps(_mm256_set1_ps(-8.0), macc, acc) };
            let mut v = [0f32; X8_ROWS];
            // SAFETY: v holds exactly 8 floats.
            unsafe { _mm256_storeu_ps(v.as_mut_ptr(), r) };
            for (row, v) in v.into_iter().enumerate() {
                o[row * m + i] = v;
            }
        }
    }
}

/// `Q8_0`: signed weights, so `vpmaddubsw` takes `|w|` and the activations with `w`'s signs
/// (`vpsignb`); a pair sum reaches 2 · 128 · 127, so each slice goes to 32 bits (`vpmaddwd`)
/// before the eight are added.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn groups_q8_0(w: &[u8], xq: &Q8Activations, out: &mut [f32]) {
    let (nb, m) = (xq.k() / QK, xq.rows());
    let (bb, hb) = (WeightType::Q8_0.block_bytes() * X8_ROWS, header_bytes(WeightType::Q8_0));
    let (xq8, xd) = (xq.quants(), xq.scales());
    // These make every access below in bounds.
    assert!(xq8.len() >= m * nb * QK && xd.len() >= m * nb && w.len() >= out.len() / (X8_ROWS * m) * nb * bb);
    let ones = _mm256_set1_epi16(1);
    let wp = w.as_ptr();
    for (gi, o) in out.chunks_exact_mut(X8_ROWS * m).enumerate() {
        for i in 0..m {
            let mut acc = _mm256_setzero_ps();
            for b in 0..nb {
                let off = (gi * nb + b) * bb;
                // SAFETY: as in `groups`: block b of group gi lies within w, row i's x block b
                // within xq8, entry i nb + b within xd; prefetches stay within w.
                unsafe {
                    let blk = wp.add(off);
                    let ahead = off + PREFETCH_BYTES;
                    if i == 0 && ahead + bb <= w.len() {
                        let p = wp.add(ahead);
                        for l in [0, 64, 128, 192, bb - 1] {
                            _mm_prefetch::<_MM_HINT_T0>(p.add(l).cast());
                        }
                    }
                    let xb = i * nb + b;
                    let x = xq8.as_ptr().add(xb * QK);
                    let mut isum = _mm256_setzero_si256();
                    for g in 0..8 {
                        let v = _mm256_loadu_si256(blk.add(hb + 32 * g).cast());
                        let xg = _mm256_set1_epi32(x.add(4 * g).cast::<i32>().read_unaligned());
                        let p = _mm256_maddubs_epi16(_mm256_abs_epi8(v), _mm256_sign_epi8(xg, v));
                        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, ones));
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(*xd.as_ptr().add(xb))), acc);
                }
            }
            let mut v = [0f32; X8_ROWS];
            // SAFETY: v holds exactly 8 floats.
            unsafe { _mm256_storeu_ps(v.as_mut_ptr(), acc) };
            for (row, v) in v.into_iter().enumerate() {
                o[row * m + i] = v;
            }
        }
    }
}
