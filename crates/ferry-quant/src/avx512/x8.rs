//! AVX-512 VNNI kernel for eight interleaved weight rows against Q8 activation rows: the AVX2
//! kernel (`crate::avx2::x8`, same layout, same unpacking, same loops) with its integer dot
//! products done by `vpdpbusd` (`u8 × i8`, four products summed into each 32-bit lane, added to
//! the accumulator: one instruction where AVX2 needs `vpmaddubsw`, a 16-bit add, and at the end a
//! `vpmaddwd`). It runs on 256-bit vectors (AVX-512 VL), so the layout, the broadcasts and the
//! float part are the AVX2 kernel's unchanged.
//!
//! Bit for bit the same results as the AVX2 and scalar kernels: the integer sums are exact in both
//! (AVX2's 16-bit partial sums stay below 2^15, see there; here they are 32-bit from the start),
//! and the conversion, scale and accumulation per block are the same operations in the same
//! order. Per activation row and block of a `Q4` group this is 8 `vpdpbusd` and one add where
//! AVX2 takes 8 `vpmaddubsw`, 8 adds and a `vpmaddwd`: extra activation rows (batched decode,
//! speculative verification) cost about half as much.

use core::arch::x86_64::*;
use std::sync::OnceLock;

use crate::avx2::x8::{Format, Q4, Q4Block, Q8_0, Q8Block, driver};
use crate::q8::Q8Activations;
use crate::types::WeightType;

/// Whether this CPU has the instructions (AVX-512 VNNI and VL, besides the AVX2 kernel's).
/// Detected once: every matmul task of a decode step asks.
pub(crate) fn supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        std::is_x86_feature_detected!("avx512vnni")
            && std::is_x86_feature_detected!("avx512vl")
            && std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    })
}

/// Run `i` of `out`, output `r`, for every row `r` of the interleaved groups `w` and activation row `i`
/// (lengths checked by the caller; the CPU must pass [`supported`]).
#[target_feature(enable = "avx512vnni,avx512vl,avx2,fma,f16c")]
pub(crate) fn dot(ty: WeightType, w: &[u8], xq: &Q8Activations, out: &mut crate::x8::Outputs<'_>) {
    driver!("avx512vnni,avx512vl,avx2,fma,f16c");
    match ty {
        WeightType::Q4_1 => groups::<Q4Vnni<true>>(w, xq, out),
        WeightType::Q4_0 => groups::<Q4Vnni<false>>(w, xq, out),
        WeightType::Q8_0 => groups::<Q8Vnni>(w, xq, out),
        _ => unreachable!("checked by the caller"),
    }
}

/// `Q4_1` / `Q4_0` with `vpdpbusd`: the nibbles are the unsigned operand, the activations the
/// signed one, as `vpmaddubsw` takes them.
struct Q4Vnni<const MIN: bool>;

impl<const MIN: bool> Format for Q4Vnni<MIN> {
    const TY: WeightType = <Q4<MIN> as Format>::TY;
    type Block = Q4Block;
    #[inline]
    #[target_feature(enable = "avx512vnni,avx512vl,avx2,fma,f16c")]
    unsafe fn load(blk: *const u8) -> Q4Block {
        // SAFETY: the caller's contract is the AVX2 format's.
        unsafe { <Q4<MIN> as Format>::load(blk) }
    }
    #[inline]
    #[target_feature(enable = "avx512vnni,avx512vl,avx2,fma,f16c")]
    unsafe fn apply(b: &Q4Block, x: *const i8, dx: f32, sx: f32, acc: &mut __m256, macc: &mut __m256) {
        // SAFETY: the loads stay within the 32 activation quants (caller's contract).
        unsafe {
            // Two chains (low and high nibbles), so each `vpdpbusd` waits on half as many.
            let (mut lo, mut hi) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for g in 0..4 {
                let xl = _mm256_set1_epi32(x.add(4 * g).cast::<i32>().read_unaligned());
                let xh = _mm256_set1_epi32(x.add(16 + 4 * g).cast::<i32>().read_unaligned());
                lo = _mm256_dpbusd_epi32(lo, b.q[2 * g], xl);
                hi = _mm256_dpbusd_epi32(hi, b.q[2 * g + 1], xh);
            }
            let f = _mm256_cvtepi32_ps(_mm256_add_epi32(lo, hi));
            *acc = _mm256_fmadd_ps(f, _mm256_mul_ps(b.d, _mm256_set1_ps(dx)), *acc);
            *macc = _mm256_fmadd_ps(b.c, _mm256_set1_ps(sx), *macc);
        }
    }
    #[inline]
    #[target_feature(enable = "avx512vnni,avx512vl,avx2,fma,f16c")]
    unsafe fn finish(acc: __m256, macc: __m256) -> __m256 {
        // SAFETY: the same features as the AVX2 format's.
        unsafe { <Q4<MIN> as Format>::finish(acc, macc) }
    }
}

/// `Q8_0` with `vpdpbusd`: `|w|` unsigned against the activations with `w`'s signs (`vpsignb`),
/// as the AVX2 kernel does.
struct Q8Vnni;

impl Format for Q8Vnni {
    const TY: WeightType = WeightType::Q8_0;
    type Block = Q8Block;
    #[inline]
    #[target_feature(enable = "avx512vnni,avx512vl,avx2,fma,f16c")]
    unsafe fn load(blk: *const u8) -> Q8Block {
        // SAFETY: the caller's contract is the AVX2 format's.
        unsafe { <Q8_0 as Format>::load(blk) }
    }
    #[inline]
    #[target_feature(enable = "avx512vnni,avx512vl,avx2,fma,f16c")]
    unsafe fn apply(b: &Q8Block, x: *const i8, dx: f32, _sx: f32, acc: &mut __m256, _macc: &mut __m256) {
        // SAFETY: as for `Q4Vnni`.
        unsafe {
            let (mut s0, mut s1) = (_mm256_setzero_si256(), _mm256_setzero_si256());
            for g in (0..8).step_by(2) {
                let x0 = _mm256_set1_epi32(x.add(4 * g).cast::<i32>().read_unaligned());
                let x1 = _mm256_set1_epi32(x.add(4 * g + 4).cast::<i32>().read_unaligned());
                s0 = _mm256_dpbusd_epi32(s0, b.a[g], _mm256_sign_epi8(x0, b.v[g]));
                s1 = _mm256_dpbusd_epi32(s1, b.a[g + 1], _mm256_sign_epi8(x1, b.v[g + 1]));
            }
            let f = _mm256_cvtepi32_ps(_mm256_add_epi32(s0, s1));
            *acc = _mm256_fmadd_ps(f, _mm256_mul_ps(b.d, _mm256_set1_ps(dx)), *acc);
        }
    }
    #[inline]
    #[target_feature(enable = "avx512vnni,avx512vl,avx2,fma,f16c")]
    unsafe fn finish(acc: __m256, _macc: __m256) -> __m256 {
        acc
    }
}
