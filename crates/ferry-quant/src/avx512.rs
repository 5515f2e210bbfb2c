//! AVX-512 (F + BW + VL) kernels for `dot_rows` and `dequantize` (x86-64).
//!
//! Same structure as `avx2.rs`: [`Block`] unpacks one 32-element block into two `__m512`; `row1`
//! handles `m = 1` two blocks at a time, and a tile kernel runs a block against `R` activation
//! rows with `R x A` accumulators. With 32 `zmm` registers a tile holds 16 rows (16 accumulators
//! and 2 weight vectors), so for the decode batch sizes the engine uses (`m <= 16`) every block
//! is unpacked exactly once. Activation rows that start 64-byte aligned avoid split loads.
//!
//! The machines this crate was written on have no AVX-512, so this file is exercised by the same
//! tests only where the CPU has it (`cargo test` skips unsupported levels); `FERRY_QUANT_SIMD=avx2`
//! falls back to the AVX2 kernels.
//!
//! Unpacking, per block of 32:
//! - `Q4_1` / `Q4_0`: a 16-entry table of the block's possible weights, `t[i] = (d * i) + m`
//!   (`Q4_0`: `d * (i - 8)`), computed with the same roundings as the exact dequantizer, then two
//!   `vpermps` lookups: the 16 packed bytes zero-extended to 32-bit lanes index the table with
//!   their low 4 bits (elements 0..16), and shifted right by 4 with their high nibbles (16..32).
//!   The weights are therefore bit-identical to `dequantize`.
//! - `Q8_0`: `vpmovsxbd` of 16 bytes at a time, `w = q * d` (exact).
//! - `F16`: `vcvtph2ps`; `BF16`: zero-extend to 32 bits and shift left by 16; `F32`: loads.
//!
//! The same unpacking, stored instead of multiplied, gives a SIMD `dequantize` that is
//! bit-identical to the scalar one. K-quants are in `avx512/kquant.rs`.

pub(crate) mod amx;
mod kquant;
pub(crate) mod x8;

use core::arch::x86_64::*;

use crate::scalar;
use crate::types::{QK, WeightType};

/// `dot_rows` for AVX-512. Preconditions as `crate::dot_rows_at` checks them (a violation
/// panics, never reads out of bounds): `out` non-empty, `x.len() == out.len() * k`,
/// `w.len() == ty.row_bytes(k)`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) fn dot_rows(ty: WeightType, w: &[u8], x: &[f32], k: usize, out: &mut [f32]) {
    match ty {
        WeightType::F32 => rows::<F32>(w, x, k, out),
        WeightType::F16 => rows::<F16>(w, x, k, out),
        WeightType::BF16 => rows::<Bf16>(w, x, k, out),
        WeightType::Q8_0 => rows::<Q8_0>(w, x, k, out),
        WeightType::Q4_0 => rows::<Q4_0>(w, x, k, out),
        WeightType::Q4_1 => rows::<Q4_1>(w, x, k, out),
        WeightType::Q4_K | WeightType::Q6_K => kquant::dot_rows(ty, w, x, k, out),
    }
}

/// Exact dequantization (same preconditions as `scalar::dequantize`). The SIMD unpacking is
/// bit-identical to the scalar reference: see the module docs.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) fn dequantize(ty: WeightType, src: &[u8], dst: &mut [f32]) {
    match ty {
        WeightType::F32 => deq::<F32>(src, dst),
        WeightType::F16 => deq::<F16>(src, dst),
        WeightType::BF16 => deq::<Bf16>(src, dst),
        WeightType::Q8_0 => deq::<Q8_0>(src, dst),
        WeightType::Q4_0 => deq::<Q4_0>(src, dst),
        WeightType::Q4_1 => deq::<Q4_1>(src, dst),
        WeightType::Q4_K | WeightType::Q6_K => kquant::dequantize(ty, src, dst),
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn deq<B: Block>(src: &[u8], dst: &mut [f32]) {
    let whole = dst.len() / QK * QK;
    for (blk, y) in src.chunks_exact(B::BYTES).zip(dst[..whole].chunks_exact_mut(QK)) {
        // SAFETY: `chunks_exact` yields exactly `BYTES` bytes; the features are enabled here.
        let v = unsafe { B::unpack(blk.as_ptr()) };
        for (j, v) in v.into_iter().enumerate() {
            // SAFETY: `y` holds 32 floats; store j covers y[16j .. 16j + 16] within it.
            unsafe { _mm512_storeu_ps(y.as_mut_ptr().add(16 * j), v) };
        }
    }
    if whole < dst.len() {
        // Dense types only: the last `len % 32` elements.
        let esize = B::TY.block_bytes();
        scalar::dequantize(B::TY, &src[whole * esize..], &mut dst[whole..]);
    }
}

/// A format whose weights come in runs of 32 elements of `BYTES` bytes (for dense types, a run
/// of 32 elements; a row's tail beyond the last whole run is handled by `rows`).
trait Block {
    const TY: WeightType;
    const BYTES: usize;
    /// The 32 weights of one block, in element order.
    ///
    /// # Safety
    /// `b` must point to `BYTES` readable bytes.
    unsafe fn unpack(b: *const u8) -> [__m512; 2];
}

struct F32;
struct F16;
struct Bf16;
struct Q8_0;
struct Q4_0;
struct Q4_1;

impl Block for F32 {
    const TY: WeightType = WeightType::F32;
    const BYTES: usize = 128;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn unpack(b: *const u8) -> [__m512; 2] {
        // SAFETY: two 64-byte loads cover bytes 0..128 = BYTES (caller's contract).
        unsafe { [_mm512_loadu_ps(b.cast()), _mm512_loadu_ps(b.add(64).cast())] }
    }
}

impl Block for F16 {
    const TY: WeightType = WeightType::F16;
    const BYTES: usize = 64;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn unpack(b: *const u8) -> [__m512; 2] {
        // SAFETY: two 32-byte loads cover bytes 0..64 = BYTES (caller's contract).
        unsafe {
            [
                _mm512_cvtph_ps(_mm256_loadu_si256(b.cast())),
                _mm512_cvtph_ps(_mm256_loadu_si256(b.add(32).cast())),
            ]
        }
    }
}

impl Block for Bf16 {
    const TY: WeightType = WeightType::BF16;
    const BYTES: usize = 64;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn unpack(b: *const u8) -> [__m512; 2] {
        // SAFETY: two 32-byte loads cover bytes 0..64 = BYTES (caller's contract).
        let (h0, h1) = unsafe {
            (
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(b.cast())),
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(b.add(32).cast())),
            )
        };
        [_mm512_castsi512_ps(_mm512_slli_epi32::<16>(h0)), _mm512_castsi512_ps(_mm512_slli_epi32::<16>(h1))]
    }
}

/// `f16` values at `p` (2 bytes) and `p + 2` (2 bytes) as `f32` in lanes 0 and 1.
///
/// # Safety
/// `p` must point to 4 readable bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn load_f16x2(p: *const u8) -> __m128 {
    // SAFETY: reads 4 bytes at `p` (caller's contract), unaligned.
    let bits = unsafe { p.cast::<i32>().read_unaligned() };
    _mm_cvtph_ps(_mm_cvtsi32_si128(bits))
}

/// The `f16` at `p` as `f32` in lane 0.
///
/// # Safety
/// `p` must point to 2 readable bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn load_f16(p: *const u8) -> __m128 {
    // SAFETY: reads 2 bytes at `p` (caller's contract), unaligned.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits)))
}

impl Block for Q8_0 {
    const TY: WeightType = WeightType::Q8_0;
    const BYTES: usize = 34;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn unpack(b: *const u8) -> [__m512; 2] {
        // SAFETY: reads bytes 0..2 (d) and 2..34 (two 16-byte loads): within BYTES.
        let (d, q0, q1) = unsafe {
            (
                _mm512_broadcastss_ps(load_f16(b)),
                _mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(2).cast())),
                _mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(18).cast())),
            )
        };
        [_mm512_mul_ps(_mm512_cvtepi32_ps(q0), d), _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d)]
    }
}

/// Two table lookups: 16 packed bytes at `qs` select from `tbl` by low nibble (elements 0..16)
/// and by high nibble (elements 16..32).
///
/// # Safety
/// `qs` must point to 16 readable bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn lookup_nibbles(qs: *const u8, tbl: __m512) -> [__m512; 2] {
    // SAFETY: one 16-byte load at `qs` (caller's contract).
    let raw = unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(qs.cast())) };
    // vpermps uses only the low 4 bits of each index lane.
    [_mm512_permutexvar_ps(raw, tbl), _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(raw), tbl)]
}

impl Block for Q4_0 {
    const TY: WeightType = WeightType::Q4_0;
    const BYTES: usize = 18;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn unpack(b: *const u8) -> [__m512; 2] {
        let qm8 = _mm512_setr_ps(-8., -7., -6., -5., -4., -3., -2., -1., 0., 1., 2., 3., 4., 5., 6., 7.);
        // SAFETY: reads bytes 0..2 (d) and 2..18 (qs): within BYTES.
        unsafe {
            let d = _mm512_broadcastss_ps(load_f16(b));
            lookup_nibbles(b.add(2), _mm512_mul_ps(qm8, d))
        }
    }
}

impl Block for Q4_1 {
    const TY: WeightType = WeightType::Q4_1;
    const BYTES: usize = 20;
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn unpack(b: *const u8) -> [__m512; 2] {
        let iota = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
        // SAFETY: reads bytes 0..4 (d, m) and 4..20 (qs): within BYTES.
        unsafe {
            let dm = load_f16x2(b);
            let d = _mm512_broadcastss_ps(dm);
            let m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
            // Not an FMA: the table must round like the exact dequantizer, (d * q) then + m.
            lookup_nibbles(b.add(4), _mm512_add_ps(_mm512_mul_ps(iota, d), m))
        }
    }
}

/// All rows of `out` against one weight row, in tiles of 16, 8, 4, 2 and 1 activation rows.
#[inline(never)] // one function per type keeps each prologue small
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn rows<B: Block>(w: &[u8], x: &[f32], k: usize, out: &mut [f32]) {
    let m = out.len();
    let mut r = 0;
    while r < m {
        let (xs, os) = (&x[r * k..], &mut out[r..]);
        r += match m - r {
            16.. => tile::<B, 16, 1>(w, xs, k, os),
            8..=15 => tile::<B, 8, 2>(w, xs, k, os),
            4..=7 => tile::<B, 4, 2>(w, xs, k, os),
            2 | 3 => tile::<B, 2, 2>(w, xs, k, os),
            _ => row1::<B>(w, xs, k, os),
        };
    }
    let whole = k / QK * QK;
    if whole < k {
        // Dense types only: the last `k % 32` elements.
        let ty = B::TY;
        let mut buf = [0f32; QK];
        let tail = &mut buf[..k - whole];
        let esize = ty.block_bytes();
        scalar::dequantize(ty, &w[whole * esize..k * esize], tail);
        for (r, o) in out.iter_mut().enumerate() {
            let xs = &x[r * k + whole..(r + 1) * k];
            *o += tail.iter().zip(xs).map(|(a, b)| a * b).sum::<f32>();
        }
    }
}

/// Rows `0..R` of `out` (`out[r]` = dot of the first `k / 32 * 32` weights with `x[r*k..]`).
/// Returns `R`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn tile<B: Block, const R: usize, const A: usize>(w: &[u8], x: &[f32], k: usize, out: &mut [f32]) -> usize {
    let nb = k / QK;
    // These checks make every load below in bounds; the callers satisfy them.
    assert!(out.len() >= R && x.len() >= R * k && w.len() >= nb * B::BYTES);
    let mut acc = [[_mm512_setzero_ps(); A]; R];
    let xp = x.as_ptr();
    for (b, blk) in w.chunks_exact(B::BYTES).take(nb).enumerate() {
        // SAFETY: `chunks_exact` yields exactly `BYTES` bytes; the features are enabled here.
        let wv = unsafe { B::unpack(blk.as_ptr()) };
        // j outer, rows inner: consecutive FMAs go to different accumulators.
        for (j, wv) in wv.iter().enumerate() {
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: r < R and b < nb, so r*k + 32b + 16j + 16 <= r*k + 32nb <= R*k <= x.len().
                let xv = unsafe { _mm512_loadu_ps(xp.add(r * k + QK * b + 16 * j)) };
                acc[j % A] = _mm512_fmadd_ps(*wv, xv, acc[j % A]);
            }
        }
    }
    for (o, acc) in out.iter_mut().zip(&mut acc) {
        // Pairwise tree over the A accumulators (A is a power of two).
        let mut n = A;
        while n > 1 {
            n /= 2;
            for i in 0..n {
                acc[i] = _mm512_add_ps(acc[i], acc[i + n]);
            }
        }
        *o = _mm512_reduce_add_ps(acc[0]);
    }
    R
}

/// `out[0]` = dot of the first `k / 32 * 32` weights with `x[..k]`: the decode case (`m = 1`),
/// two blocks per iteration into four accumulators. Returns 1.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn row1<B: Block>(w: &[u8], x: &[f32], k: usize, out: &mut [f32]) -> usize {
    let nb = k / QK;
    assert!(!out.is_empty() && x.len() >= nb * QK && w.len() >= nb * B::BYTES);
    let (mut a0, mut a1, mut a2, mut a3) = (_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps());
    let xp = x.as_ptr();
    let mut pairs = w[..nb * B::BYTES].chunks_exact(2 * B::BYTES);
    for (i, pair) in pairs.by_ref().enumerate() {
        // SAFETY: `pair` holds exactly two blocks of `BYTES` bytes; the features are enabled here.
        let (u, v) = unsafe { (B::unpack(pair.as_ptr()), B::unpack(pair.as_ptr().add(B::BYTES))) };
        // SAFETY: block pair i covers x[64i .. 64i + 64], and 64i + 64 <= 32nb <= x.len().
        unsafe {
            let p = xp.add(64 * i);
            a0 = _mm512_fmadd_ps(u[0], _mm512_loadu_ps(p), a0);
            a1 = _mm512_fmadd_ps(u[1], _mm512_loadu_ps(p.add(16)), a1);
            a2 = _mm512_fmadd_ps(v[0], _mm512_loadu_ps(p.add(32)), a2);
            a3 = _mm512_fmadd_ps(v[1], _mm512_loadu_ps(p.add(48)), a3);
        }
    }
    if pairs.remainder().len() == B::BYTES {
        // SAFETY: the remainder is one whole block; it covers x[32(nb-1) .. 32nb], within x.
        unsafe {
            let u = B::unpack(pairs.remainder().as_ptr());
            let p = xp.add(QK * (nb - 1));
            a0 = _mm512_fmadd_ps(u[0], _mm512_loadu_ps(p), a0);
            a1 = _mm512_fmadd_ps(u[1], _mm512_loadu_ps(p.add(16)), a1);
        }
    }
    out[0] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
    1
}
