//! K-quants (`Q4_K`, `Q6_K`) with AVX-512: each 256-element super-block is dequantized with SIMD
//! into a stack buffer (bit-identical to the scalar reference), then dotted with every activation
//! row by vector FMAs. Same structure as `avx2/kquant.rs`, 16 lanes at a time.

use core::arch::x86_64::*;

use crate::types::{QK_K, WeightType, f16_to_f32, le_u16, q4k_scale_min};

/// Activation rows sharing one dequantized super-block.
const GROUP: usize = 16;

/// `dot_rows` for `Q4_K` / `Q6_K` (`w` is a whole number of super-blocks, `x` holds `out.len()`
/// rows of `k`). Each row keeps four vector accumulators across super-blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) fn dot_rows(ty: WeightType, w: &[u8], x: &[f32], k: usize, out: &mut [f32]) {
    let mut buf = [0f32; QK_K];
    for (g, outs) in out.chunks_mut(GROUP).enumerate() {
        let mut acc = [[_mm512_setzero_ps(); 4]; GROUP];
        for (b, blk) in w.chunks_exact(ty.block_bytes()).enumerate() {
            deq_block(ty, blk, &mut buf);
            for (r, acc) in acc.iter_mut().enumerate().take(outs.len()) {
                let start = (g * GROUP + r) * k + b * QK_K;
                dot256(&buf, &x[start..start + QK_K], acc);
            }
        }
        for (o, a) in outs.iter_mut().zip(&acc) {
            *o = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3])));
        }
    }
}

/// Exact dequantization of whole `Q4_K` / `Q6_K` super-blocks.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) fn dequantize(ty: WeightType, src: &[u8], dst: &mut [f32]) {
    for (blk, y) in src.chunks_exact(ty.block_bytes()).zip(dst.chunks_exact_mut(QK_K)) {
        deq_block(ty, blk, y);
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn deq_block(ty: WeightType, b: &[u8], y: &mut [f32]) {
    if ty == WeightType::Q4_K { deq_q4k(b, y) } else { deq_q6k(b, y) }
}

/// One `Q4_K` super-block (144 bytes) to 256 floats. Bit-identical to the reference
/// `d1 * q - m1` (computed here as a multiply, then a subtract).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn deq_q4k(b: &[u8], y: &mut [f32]) {
    assert!(b.len() >= 144 && y.len() >= QK_K);
    let d = f16_to_f32(le_u16(b, 0));
    let dmin = f16_to_f32(le_u16(b, 2));
    let mask = _mm512_set1_epi32(0x0F);
    for g in 0..4 {
        let (sc1, mn1) = q4k_scale_min(2 * g, &b[4..16]);
        let (sc2, mn2) = q4k_scale_min(2 * g + 1, &b[4..16]);
        let (d1, m1) = (_mm512_set1_ps(d * f32::from(sc1)), _mm512_set1_ps(dmin * f32::from(mn1)));
        let (d2, m2) = (_mm512_set1_ps(d * f32::from(sc2)), _mm512_set1_ps(dmin * f32::from(mn2)));
        for c in 0..2 {
            // SAFETY: reads qs bytes 32g + 16c .. + 16, i.e. block bytes 16 + 32g + 16c .. <= 144;
            // stores y[64g + 16c ..] and y[64g + 32 + 16c ..], 16 floats each, <= 256 (asserted).
            unsafe {
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(b.as_ptr().add(16 + 32 * g + 16 * c).cast()));
                let lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, mask));
                let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(v));
                _mm512_storeu_ps(y.as_mut_ptr().add(64 * g + 16 * c), _mm512_sub_ps(_mm512_mul_ps(lo, d1), m1));
                _mm512_storeu_ps(y.as_mut_ptr().add(64 * g + 32 + 16 * c), _mm512_sub_ps(_mm512_mul_ps(hi, d2), m2));
            }
        }
    }
}

/// One `Q6_K` super-block (210 bytes) to 256 floats: `(d * sc) * (q - 32)` with the reference's
/// two roundings.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn deq_q6k(b: &[u8], y: &mut [f32]) {
    assert!(b.len() >= 210 && y.len() >= QK_K);
    let d = f16_to_f32(le_u16(b, 208));
    let (lo4, hi2, off) = (_mm512_set1_epi32(0x0F), _mm512_set1_epi32(0x30), _mm512_set1_epi32(32));
    for h in 0..2 {
        for l in [0, 16] {
            // SAFETY: reads ql bytes 64h + l (+ 32) .. + 16 <= 128 and qh bytes 128 + 32h + l .. + 16
            // <= 192, inside the 210-byte block (asserted).
            let (qa, qb, qh) = unsafe {
                let p = b.as_ptr();
                (
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(64 * h + l).cast())),
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(64 * h + 32 + l).cast())),
                    _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(128 + 32 * h + l).cast())),
                )
            };
            // 6-bit quants: low 4 bits from a nibble of ql, high 2 bits from a 2-bit field of qh.
            let q = [
                _mm512_or_si512(_mm512_and_si512(qa, lo4), _mm512_and_si512(_mm512_slli_epi32::<4>(qh), hi2)),
                _mm512_or_si512(_mm512_and_si512(qb, lo4), _mm512_and_si512(_mm512_slli_epi32::<2>(qh), hi2)),
                _mm512_or_si512(_mm512_srli_epi32::<4>(qa), _mm512_and_si512(qh, hi2)),
                _mm512_or_si512(_mm512_srli_epi32::<4>(qb), _mm512_and_si512(_mm512_srli_epi32::<2>(qh), hi2)),
            ];
            for (t, q) in q.into_iter().enumerate() {
                // All 16 lanes l .. l + 16 share scale l / 16 of their quarter.
                let s = d * f32::from(b[192 + 8 * h + l / 16 + 2 * t] as i8);
                let w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, off)), _mm512_set1_ps(s));
                // SAFETY: stores y[128h + 32t + l .. + 16], within 256 (asserted).
                unsafe { _mm512_storeu_ps(y.as_mut_ptr().add(128 * h + 32 * t + l), w) };
            }
        }
    }
}

/// `acc[j] += w[i] * x[i]` over 256 elements, `j` cycling over four accumulators.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn dot256(w: &[f32; QK_K], x: &[f32], acc: &mut [__m512; 4]) {
    assert!(x.len() >= QK_K);
    for i in 0..QK_K / 64 {
        for (j, a) in acc.iter_mut().enumerate() {
            let o = 64 * i + 16 * j;
            // SAFETY: o + 16 <= 256 <= len of both `w` and `x` (asserted above).
            let (wv, xv) = unsafe { (_mm512_loadu_ps(w.as_ptr().add(o)), _mm512_loadu_ps(x.as_ptr().add(o))) };
            *a = _mm512_fmadd_ps(wv, xv, *a);
        }
    }
}
