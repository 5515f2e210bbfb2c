//! AVX2 + FMA + F16C kernels for `dot_rows` and `dequantize` (x86-64).
//!
//! Structure (shared with `avx512.rs`): every 32-element block type implements [`Block`], which
//! unpacks one block into four `__m256` of `f32` weights. For the decode case (`m = 1`), `row1`
//! unpacks two blocks per iteration into four accumulators; for the formats whose weights are
//! `d * q + c` with small integer `q` (`Q4_0`, `Q4_1`, `Q8_0`), `row1_scaled` instead multiplies
//! the integer-valued quants with `x` and scales once per block (`d * Σ q x`), adding `Σ c · Σx`
//! from the activation's block sums: a third fewer vector operations than dequantizing each
//! weight (the kernel is instruction-bound, not bandwidth-bound, on AVX2). For `m > 1`, a tile
//! kernel runs the weight row against `R` activation rows: each block is unpacked once per tile and multiplied
//! into `R x A` vector accumulators (`A` independent chains per row hide FMA latency when `R` is
//! small). Tiles are 8, 4 and 2 rows (8 accumulators + 4 weight vectors fit the 16 `ymm`
//! registers), so `m = 16` unpacks each block twice, ~10% over the 128 FMAs it then feeds.
//! Activation rows that start 32-byte aligned avoid split loads (worth ~20% at `m = 8`).
//!
//! Unpacking, per block of 32:
//! - `Q4_1`: two `vpmovzxbd` of 8 packed bytes; `& 0xF` gives elements 0..16, `>> 4` gives 16..32;
//!   `cvtdq2ps`, then `w = fma(q, d, m)`. This equals the reference `(d * q) + m` bit for bit:
//!   `d * q` is exact in `f32` (an 11-bit significand times a 4-bit integer), so the FMA's one
//!   rounding is the reference's rounding of the sum. (Likewise `d * q` below is exact.)
//! - `Q4_0`: the same nibbles, `- 8` as integers, then `w = q * d` (exact).
//! - `Q8_0`: `vpmovsxbd` of 8 bytes at a time, `w = q * d` (exact).
//! - `F16`: `vcvtph2ps`; `BF16`: zero-extend to 32 bits and shift left by 16; `F32`: loads.
//!
//! The same unpacking, stored instead of multiplied, gives a SIMD `dequantize` that is
//! bit-identical to the scalar one. K-quants are in `avx2/kquant.rs`.

mod kquant;
pub(crate) mod q8;
pub(crate) mod x8;

use core::arch::x86_64::*;

use crate::scalar;
use crate::types::{QK, WeightType};

/// `dot_rows` for AVX2. Preconditions as `crate::dot_rows_at` checks them (a violation panics,
/// never reads out of bounds): `out` non-empty, `x.len() == out.len() * k`, `w.len() == ty.row_bytes(k)`.
#[target_feature(enable = "avx2,fma,f16c")]
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

/// `dot_rows` over consecutive weight rows of `rb` bytes: `out[r*m..(r+1)*m]` for row r.
/// Preconditions as checked by `crate::dot_many`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot_many(ty: WeightType, w: &[u8], rb: usize, x: &[f32], k: usize, m: usize, out: &mut [f32]) {
    #[target_feature(enable = "avx2,fma,f16c")]
    fn each<B: Block>(w: &[u8], rb: usize, x: &[f32], k: usize, m: usize, out: &mut [f32]) {
        if m == 1 && B::SCALED {
            // The decode case: the activation's block sums once for all rows.
            let sums = block_sums::<B>(x);
            for (i, (row, o)) in w.chunks_exact(rb).zip(out.iter_mut()).enumerate() {
                prefetch_ahead(w, rb, i);
                row1_scaled::<B>(row, x, &sums, k, std::slice::from_mut(o));
            }
            return;
        }
        for (i, (row, o)) in w.chunks_exact(rb).zip(out.chunks_exact_mut(m)).enumerate() {
            prefetch_ahead(w, rb, i);
            rows::<B>(row, x, k, o);
        }
    }
    match ty {
        WeightType::F32 => each::<F32>(w, rb, x, k, m, out),
        WeightType::F16 => each::<F16>(w, rb, x, k, m, out),
        WeightType::BF16 => each::<Bf16>(w, rb, x, k, m, out),
        WeightType::Q8_0 => each::<Q8_0>(w, rb, x, k, m, out),
        WeightType::Q4_0 => each::<Q4_0>(w, rb, x, k, m, out),
        WeightType::Q4_1 => each::<Q4_1>(w, rb, x, k, m, out),
        WeightType::Q4_K | WeightType::Q6_K => {
            for (row, o) in w.chunks_exact(rb).zip(out.chunks_exact_mut(m)) {
                kquant::dot_rows(ty, row, x, k, o);
            }
        }
    }
}

/// Bytes ahead of the current row that `prefetch_ahead` asks for.
const PREFETCH_BYTES: usize = 4096;

/// Prefetch the cache lines `PREFETCH_BYTES` ahead of row `i` of `w` (rows of `rb` bytes): one
/// row's worth per row. Decode streams every weight once; the hardware prefetcher restarts at each
/// 4 KiB page and ramps up per stream, so without this the kernel waits on demand misses (out of
/// cache it ran at ~70% of its in-cache speed).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn prefetch_ahead(w: &[u8], rb: usize, i: usize) {
    let start = i * rb + PREFETCH_BYTES;
    let end = (start + rb).min(w.len());
    let mut off = start;
    while off < end {
        // SAFETY: off < w.len(); a prefetch has no architectural effect.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(w.as_ptr().add(off).cast()) };
        off += 64;
    }
}

/// Exact dequantization (same preconditions as `scalar::dequantize`). The SIMD unpacking is
/// bit-identical to the scalar reference: see the module docs.
#[target_feature(enable = "avx2,fma,f16c")]
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

#[target_feature(enable = "avx2,fma,f16c")]
fn deq<B: Block>(src: &[u8], dst: &mut [f32]) {
    let whole = dst.len() / QK * QK;
    for (blk, y) in src.chunks_exact(B::BYTES).zip(dst[..whole].chunks_exact_mut(QK)) {
        // SAFETY: `chunks_exact` yields exactly `BYTES` bytes; the features are enabled here.
        let v = unsafe { B::unpack(blk.as_ptr()) };
        for (j, v) in v.into_iter().enumerate() {
            // SAFETY: `y` holds 32 floats; store j covers y[8j .. 8j + 8] within it.
            unsafe { _mm256_storeu_ps(y.as_mut_ptr().add(8 * j), v) };
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
    unsafe fn unpack(b: *const u8) -> [__m256; 4];

    /// Whether the block is `d * q + c` with small integer quants `q` (see [`row1_scaled`]), which the
    /// decode kernel multiplies before scaling.
    const SCALED: bool = false;
    /// Whether `c` is non-zero (a per-block offset, `Q4_1`'s min).
    const OFFSET: bool = false;
    /// The block's quants `q` as `f32` (unscaled) and `(d, c)` in lanes 0 and 1. Only called
    /// when [`SCALED`](Self::SCALED).
    ///
    /// # Safety
    /// `b` must point to `BYTES` readable bytes.
    #[inline(always)]
    unsafe fn quants(_b: *const u8) -> ([__m256; 4], __m128) {
        unreachable!("quants() of a format that is not SCALED")
    }
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
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(b: *const u8) -> [__m256; 4] {
        // SAFETY: the 4 loads cover bytes 0..128 = BYTES (caller's contract); loadu has no alignment need.
        unsafe { [0, 1, 2, 3].map(|j| _mm256_loadu_ps(b.add(32 * j).cast())) }
    }
}

impl Block for F16 {
    const TY: WeightType = WeightType::F16;
    const BYTES: usize = 64;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(b: *const u8) -> [__m256; 4] {
        // SAFETY: the 4 loads of 16 bytes cover bytes 0..64 = BYTES (caller's contract).
        unsafe { [0, 1, 2, 3].map(|j| _mm256_cvtph_ps(_mm_loadu_si128(b.add(16 * j).cast()))) }
    }
}

impl Block for Bf16 {
    const TY: WeightType = WeightType::BF16;
    const BYTES: usize = 64;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(b: *const u8) -> [__m256; 4] {
        // SAFETY: the 4 loads of 16 bytes cover bytes 0..64 = BYTES (caller's contract).
        unsafe {
            [0, 1, 2, 3].map(|j| {
                let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(b.add(16 * j).cast()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(h))
            })
        }
    }
}

/// The `f16` at `p` as `f32` in lane 0 (lanes 1..4 zero).
///
/// # Safety
/// `p` must point to 2 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_f16(p: *const u8) -> __m128 {
    // SAFETY: reads 2 bytes at `p` (caller's contract), unaligned.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits)))
}

impl Block for Q8_0 {
    const TY: WeightType = WeightType::Q8_0;
    const BYTES: usize = 34;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(b: *const u8) -> [__m256; 4] {
        // SAFETY: reads bytes 0..2 (d) and 2..34 (four 8-byte loads): within BYTES.
        unsafe {
            let d = _mm256_broadcastss_ps(load_f16(b));
            [0, 1, 2, 3].map(|j| {
                let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(b.add(2 + 8 * j).cast()));
                _mm256_mul_ps(_mm256_cvtepi32_ps(q), d)
            })
        }
    }
    const SCALED: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(b: *const u8) -> ([__m256; 4], __m128) {
        // SAFETY: reads bytes 0..2 (d) and 2..34 (four 8-byte loads): within BYTES.
        unsafe {
            let q = [0, 1, 2, 3].map(|j| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(b.add(2 + 8 * j).cast()))));
            (q, load_f16(b))
        }
    }
}

/// The 32 nibbles of a `Q4_0`/`Q4_1` block at `qs` (16 bytes) as `i32` lanes in element order:
/// low nibbles of bytes 0..8, 8..16, then high nibbles of bytes 0..8, 8..16.
///
/// # Safety
/// `qs` must point to 16 readable bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(qs: *const u8) -> [__m256i; 4] {
    // SAFETY: two 8-byte loads at qs and qs + 8 (caller's contract).
    let (v0, v1) = unsafe {
        (_mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.cast())), _mm256_cvtepu8_epi32(_mm_loadl_epi64(qs.add(8).cast())))
    };
    let mask = _mm256_set1_epi32(0x0F);
    [
        _mm256_and_si256(v0, mask),
        _mm256_and_si256(v1, mask),
        _mm256_srli_epi32::<4>(v0),
        _mm256_srli_epi32::<4>(v1),
    ]
}

impl Block for Q4_0 {
    const TY: WeightType = WeightType::Q4_0;
    const BYTES: usize = 18;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(b: *const u8) -> [__m256; 4] {
        // SAFETY: reads bytes 0..2 (d) and 2..18 (qs): within BYTES.
        let (d, q) = unsafe { (_mm256_broadcastss_ps(load_f16(b)), nibbles(b.add(2))) };
        let eight = _mm256_set1_epi32(8);
        q.map(|q| _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, eight)), d))
    }
    const SCALED: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(b: *const u8) -> ([__m256; 4], __m128) {
        // SAFETY: reads bytes 0..2 (d) and 2..18 (qs): within BYTES.
        let (d, q) = unsafe { (load_f16(b), nibbles(b.add(2))) };
        let eight = _mm256_set1_epi32(8);
        (q.map(|q| _mm256_cvtepi32_ps(_mm256_sub_epi32(q, eight))), d)
    }
}

impl Block for Q4_1 {
    const TY: WeightType = WeightType::Q4_1;
    const BYTES: usize = 20;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(b: *const u8) -> [__m256; 4] {
        // SAFETY: reads bytes 0..4 (d, m) and 4..20 (qs): within BYTES.
        let (dm, q) = unsafe {
            let dm = b.cast::<i32>().read_unaligned();
            (_mm_cvtph_ps(_mm_cvtsi32_si128(dm)), nibbles(b.add(4)))
        };
        let d = _mm256_broadcastss_ps(dm);
        let m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
        q.map(|q| _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m))
    }
    const SCALED: bool = true;
    const OFFSET: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quants(b: *const u8) -> ([__m256; 4], __m128) {
        // SAFETY: reads bytes 0..4 (d, m) and 4..20 (qs): within BYTES.
        unsafe {
            let dm = b.cast::<i32>().read_unaligned();
            (nibbles(b.add(4)).map(|q| _mm256_cvtepi32_ps(q)), _mm_cvtph_ps(_mm_cvtsi32_si128(dm)))
        }
    }
}

/// All rows of `out` against one weight row, in tiles of 8, 4, 2 and 1 activation rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn rows<B: Block>(w: &[u8], x: &[f32], k: usize, out: &mut [f32]) {
    let m = out.len();
    let mut r = 0;
    while r < m {
        let (xs, os) = (&x[r * k..], &mut out[r..]);
        r += match m - r {
            8.. => tile::<B, 8, 1>(w, xs, k, os),
            4..=7 => tile::<B, 4, 2>(w, xs, k, os),
            2 | 3 => tile::<B, 2, 4>(w, xs, k, os),
            _ if B::SCALED => {
                let sums = block_sums::<B>(&xs[..k]);
                row1_scaled::<B>(w, xs, &sums, k, os)
            }
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
#[target_feature(enable = "avx2,fma,f16c")]
fn tile<B: Block, const R: usize, const A: usize>(w: &[u8], x: &[f32], k: usize, out: &mut [f32]) -> usize {
    let nb = k / QK;
    // These checks make every load below in bounds; the callers satisfy them, so they cost a few
    // compares per tile.
    assert!(out.len() >= R && x.len() >= R * k && w.len() >= nb * B::BYTES);
    let mut acc = [[_mm256_setzero_ps(); A]; R];
    let xp = x.as_ptr();
    for (b, blk) in w.chunks_exact(B::BYTES).take(nb).enumerate() {
        // SAFETY: `chunks_exact` yields exactly `BYTES` bytes; the features are enabled here.
        let wv = unsafe { B::unpack(blk.as_ptr()) };
        // j outer, rows inner: consecutive FMAs go to different accumulators.
        for (j, wv) in wv.iter().enumerate() {
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: r < R and b < nb, so r*k + 32b + 8j + 8 <= r*k + 32nb <= R*k <= x.len().
                let xv = unsafe { _mm256_loadu_ps(xp.add(r * k + QK * b + 8 * j)) };
                acc[j % A] = _mm256_fmadd_ps(*wv, xv, acc[j % A]);
            }
        }
    }
    for (o, acc) in out.iter_mut().zip(&mut acc) {
        // Pairwise tree over the A accumulators (A is a power of two).
        let mut n = A;
        while n > 1 {
            n /= 2;
            for i in 0..n {
                acc[i] = _mm256_add_ps(acc[i], acc[i + n]);
            }
        }
        *o = hsum(acc[0]);
    }
    R
}

/// `out[0]` = dot of the first `k / 32 * 32` weights with `x[..k]`: the decode case (`m = 1`),
/// two blocks per iteration into four accumulators. Returns 1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn row1<B: Block>(w: &[u8], x: &[f32], k: usize, out: &mut [f32]) -> usize {
    let nb = k / QK;
    assert!(!out.is_empty() && x.len() >= nb * QK && w.len() >= nb * B::BYTES);
    let (mut a0, mut a1, mut a2, mut a3) = (_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps());
    let xp = x.as_ptr();
    let mut pairs = w[..nb * B::BYTES].chunks_exact(2 * B::BYTES);
    for (i, pair) in pairs.by_ref().enumerate() {
        // SAFETY: `pair` holds exactly two blocks of `BYTES` bytes; the features are enabled here.
        let (u, v) = unsafe { (B::unpack(pair.as_ptr()), B::unpack(pair.as_ptr().add(B::BYTES))) };
        // SAFETY: block pair i covers x[64i .. 64i + 64], and 64i + 64 <= 32nb <= x.len().
        unsafe {
            let p = xp.add(64 * i);
            a0 = _mm256_fmadd_ps(u[0], _mm256_loadu_ps(p), a0);
            a1 = _mm256_fmadd_ps(u[1], _mm256_loadu_ps(p.add(8)), a1);
            a2 = _mm256_fmadd_ps(u[2], _mm256_loadu_ps(p.add(16)), a2);
            a3 = _mm256_fmadd_ps(u[3], _mm256_loadu_ps(p.add(24)), a3);
            a0 = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(p.add(32)), a0);
            a1 = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(p.add(40)), a1);
            a2 = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(p.add(48)), a2);
            a3 = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(p.add(56)), a3);
        }
    }
    if pairs.remainder().len() == B::BYTES {
        // SAFETY: the remainder is one whole block; it covers x[32(nb-1) .. 32nb], within x.
        unsafe {
            let u = B::unpack(pairs.remainder().as_ptr());
            let p = xp.add(QK * (nb - 1));
            a0 = _mm256_fmadd_ps(u[0], _mm256_loadu_ps(p), a0);
            a1 = _mm256_fmadd_ps(u[1], _mm256_loadu_ps(p.add(8)), a1);
            a2 = _mm256_fmadd_ps(u[2], _mm256_loadu_ps(p.add(16)), a2);
            a3 = _mm256_fmadd_ps(u[3], _mm256_loadu_ps(p.add(24)), a3);
        }
    }
    out[0] = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    1
}

/// Per block of 32 of `x`, its sum `S` as `[0, S, 0, 0]` (lane 1 meets the offset `c` in the
/// block's `(d, c)` vector, see [`row1_scaled`]); empty when the format has no offset.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn block_sums<B: Block>(x: &[f32]) -> Vec<__m128> {
    if !B::OFFSET {
        return Vec::new();
    }
    x.chunks_exact(QK)
        .map(|b| {
            let p = b.as_ptr();
            // SAFETY: each chunk holds exactly 32 floats.
            let (v0, v1, v2, v3) = unsafe { (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))) };
            _mm_setr_ps(0.0, hsum(_mm256_add_ps(_mm256_add_ps(v0, v1), _mm256_add_ps(v2, v3))), 0.0, 0.0)
        })
        .collect()
}

/// `out[0]` for a [`SCALED`](Block::SCALED) format, the decode case: per block, the dot product
/// of the unscaled quants with `x` (integer-valued `f32` weights: no rounding but the
/// summation's), times `d`; plus `Σ c · S` over the blocks, from the activation's block sums `S`
/// (`sums`, from [`block_sums`]). Mathematically the same sum as `row1`'s `Σ (d q + c) x`, with
/// one FMA per block for the scaling instead of four. Returns 1.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn row1_scaled<B: Block>(w: &[u8], x: &[f32], sums: &[__m128], k: usize, out: &mut [f32]) -> usize {
    let nb = k / QK;
    assert!(!out.is_empty() && x.len() >= nb * QK && w.len() >= nb * B::BYTES && (!B::OFFSET || sums.len() >= nb));
    let (wp, xp) = (w.as_ptr(), x.as_ptr());
    // SAFETY (the closure's callers): b < nb, so block b's bytes lie within w, x[32b .. 32b + 32]
    // within x, and sums[b] within sums (checked above).
    let block = |b: usize, acc: __m256, off: __m128| unsafe {
        let (q, dc) = B::quants(wp.add(b * B::BYTES));
        let p = xp.add(QK * b);
        // One chain per block: the two blocks in flight per iteration (and the out-of-order
        // window) hide its latency.
        let mut t = _mm256_mul_ps(q[0], _mm256_loadu_ps(p));
        t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(p.add(8)), t);
        t = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(p.add(16)), t);
        t = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(p.add(24)), t);
        let acc = _mm256_fmadd_ps(t, _mm256_broadcastss_ps(dc), acc);
        // Lane 1: c * S (lane 0 is d * 0).
        let off = if B::OFFSET { _mm_fmadd_ps(dc, *sums.as_ptr().add(b), off) } else { off };
        (acc, off)
    };
    let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    let (mut o0, mut o1) = (_mm_setzero_ps(), _mm_setzero_ps());
    let mut b = 0;
    while b + 2 <= nb {
        (a0, o0) = block(b, a0, o0);
        (a1, o1) = block(b + 1, a1, o1);
        b += 2;
    }
    if b < nb {
        (a0, o0) = block(b, a0, o0);
    }
    out[0] = hsum(_mm256_add_ps(a0, a1)) + _mm_cvtss_f32(_mm_movehdup_ps(_mm_add_ps(o0, o1)));
    1
}

/// Sum of the eight lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
}
