//! AVX2 kernel for eight interleaved weight rows against Q8 activation rows (see
//! `crate::x8` for the layout and the arithmetic, which the scalar kernel there spells out).
//!
//! Per block of 32 elements and group of 8 rows: four 32-byte loads of quants (lane `r` = 4
//! bytes of row `r`), low and high nibbles masked out, each `vpmaddubsw` against 4 activation
//! bytes broadcast to every lane, the eight 16-bit results summed (at most 8 · 2 · 15 · 127 =
//! 30480, so no overflow), one `vpmaddwd` with ones (row sums in the 32-bit lanes), one
//! conversion, and one FMA with the eight rows' `d_w · d_x`; the min term is one more FMA.
//! With several activation rows, each block is unpacked once for up to four of them.

use core::arch::x86_64::*;

use crate::q8::Q8Activations;
use crate::types::WeightType;
use crate::x8::{X8_ROWS, header_bytes};

/// Activation rows taken together over one pass of a group's blocks (each block unpacked once
/// for all of them); their accumulators stay in registers.
pub(crate) const TILE: usize = 4;

/// Defines `groups::<F>` and `tile::<F, T>`, the loops that run a [`Format`] over a matrix of
/// groups, compiled for the target features `$features` (the AVX2 kernel's, or those of the
/// AVX-512 VNNI kernel, whose `Format`s need them to inline). Used inside the kernel's entry
/// point, so each instance is private to it.
macro_rules! driver {
    ($features:literal) => {
        #[inline]
        #[target_feature(enable = $features)]
        fn groups<F: $crate::avx2::x8::Format>(w: &[u8], xq: &$crate::q8::Q8Activations, out: &mut $crate::x8::Outputs<'_>) {
            use $crate::avx2::x8::TILE;
            use $crate::types::QK;
            use $crate::x8::X8_ROWS;
            let (nb, m) = (xq.k() / QK, xq.rows());
            let bb = F::TY.block_bytes() * X8_ROWS;
            let (xq8, xd, xs) = (xq.quants(), xq.scales(), xq.sums());
            // These make every access below in bounds.
            let groups = w.len() / (nb * bb);
            assert!(xq8.len() >= m * nb * QK && xd.len() >= m * nb && xs.len() >= m * nb && out.rows() >= m && out.cols() >= groups * X8_ROWS);
            for gi in 0..groups {
                let mut i0 = 0;
                while i0 < m {
                    let n = (m - i0).min(TILE);
                    // SAFETY: rows i0..i0 + n exist (n >= 1) and the assert above bounds every access.
                    unsafe {
                        match n {
                            4 => tile::<F, 4>(w, xq8, xd, xs, nb, gi, i0, out),
                            3 => tile::<F, 3>(w, xq8, xd, xs, nb, gi, i0, out),
                            2 => tile::<F, 2>(w, xq8, xd, xs, nb, gi, i0, out),
                            _ => tile::<F, 1>(w, xq8, xd, xs, nb, gi, i0, out),
                        }
                    }
                    i0 += n;
                }
            }
        }

        /// Activation rows `i0..i0 + T` against group `gi` (outputs `out[i * ld + 8 gi ..][..8]`).
        ///
        /// # Safety
        /// `i0 + T <= m`, `w`, `xq8`, `xd`, `xs` hold group `gi`'s blocks and those rows' blocks,
        /// and `out` those rows' outputs (as `groups` asserts).
        #[allow(clippy::too_many_arguments)]
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn tile<F: $crate::avx2::x8::Format, const T: usize>(w: &[u8], xq8: &[i8], xd: &[f32], xs: &[f32], nb: usize, gi: usize, i0: usize, out: &mut $crate::x8::Outputs<'_>) {
            use core::arch::x86_64::*;
            use $crate::types::QK;
            use $crate::x8::X8_ROWS;
            let bb = F::TY.block_bytes() * X8_ROWS;
            let (mut acc, mut macc) = ([_mm256_setzero_ps(); T], [_mm256_setzero_ps(); T]);
            let (wp, xp) = (w.as_ptr(), xq8.as_ptr());
            for b in 0..nb {
                let off = (gi * nb + b) * bb;
                if i0 == 0 {
                    // The first rows stream the group from memory (a block's bytes a page ahead are
                    // asked for, as in the row-layout kernels); later tiles find it in L1.
                    $crate::avx2::prefetch_ahead(w, bb, gi * nb + b);
                }
                // SAFETY: group gi's block b is bytes off..off + bb of w (caller's contract).
                let blk = unsafe { F::load(wp.add(off)) };
                for t in 0..T {
                    let xb = (i0 + t) * nb + b;
                    // SAFETY: row i0 + t's x block b is quants 32 xb..32 xb + 32, and xd[xb], xs[xb]
                    // exist (caller's contract).
                    unsafe { F::apply(&blk, xp.add(xb * QK), *xd.as_ptr().add(xb), *xs.as_ptr().add(xb), &mut acc[t], &mut macc[t]) };
                }
            }
            for t in 0..T {
                let o = out.run(i0 + t, gi * X8_ROWS, X8_ROWS);
                // SAFETY: o holds exactly 8 floats; AVX2 and FMA are enabled here.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr(), F::finish(acc[t], macc[t])) };
            }
        }
    };
}
pub(crate) use driver;

/// Run `i` of `out`, output `r`, for every row `r` of the interleaved groups `w` and activation row `i`
/// (lengths checked by the caller).
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn dot(ty: WeightType, w: &[u8], xq: &Q8Activations, out: &mut crate::x8::Outputs<'_>) {
    driver!("avx2,fma,f16c");
    match ty {
        WeightType::Q4_1 => groups::<Q4<true>>(w, xq, out),
        WeightType::Q4_0 => groups::<Q4<false>>(w, xq, out),
        WeightType::Q8_0 => groups::<Q8_0>(w, xq, out),
        _ => unreachable!("checked by the caller"),
    }
}

/// One format's arithmetic on one block of a group, in two parts: unpacking the 8 rows' block
/// once ([`Format::load`]), then each activation row's terms from it ([`Format::apply`]), so a
/// step of several rows unpacks each weight block once. Each row's operations, and their order,
/// are those of a row alone: the result does not depend on the other rows (bit for bit).
pub(crate) trait Format {
    const TY: WeightType;
    /// A block of the group's 8 rows, unpacked.
    type Block: Copy;
    /// # Safety
    /// `blk` must point to the group's block (`TY.block_bytes() * 8` bytes); the CPU must
    /// support AVX2, FMA and F16C (as for every function here).
    unsafe fn load(blk: *const u8) -> Self::Block;
    /// Add one activation row's terms for the block: the scaled integer sum to `acc`, the min
    /// term (if any) to `macc`.
    ///
    /// # Safety
    /// `x` must point to the 32 activation quants of the same block.
    unsafe fn apply(b: &Self::Block, x: *const i8, dx: f32, sx: f32, acc: &mut __m256, macc: &mut __m256);
    /// The 8 rows' results from the two accumulators.
    ///
    /// # Safety
    /// The CPU must support AVX2 and FMA (as for every function here).
    unsafe fn finish(acc: __m256, macc: __m256) -> __m256;
}

/// `Q4_1` (`MIN`: mins in the header) or `Q4_0` (min term `-8 d_w s_x`).
pub(crate) struct Q4<const MIN: bool>;
pub(crate) struct Q8_0;

/// A Q4 block of 8 rows: the low and high nibbles of its four 32-byte slices (lo0, hi0, lo1,
/// ...), the rows' scales, and their mins (Q4_1) or scales again (Q4_0).
#[derive(Clone, Copy)]
pub(crate) struct Q4Block {
    pub q: [__m256i; 8],
    pub d: __m256,
    pub c: __m256,
}

impl<const MIN: bool> Format for Q4<MIN> {
    const TY: WeightType = if MIN { WeightType::Q4_1 } else { WeightType::Q4_0 };
    type Block = Q4Block;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(blk: *const u8) -> Q4Block {
        let hb = header_bytes(Self::TY);
        let mask = _mm256_set1_epi8(0x0F);
        // SAFETY: the loads stay within the block (header, then four 32-byte slices).
        unsafe {
            let mut q = [_mm256_setzero_si256(); 8];
            for g in 0..4 {
                let v = _mm256_loadu_si256(blk.add(hb + 32 * g).cast());
                q[2 * g] = _mm256_and_si256(v, mask);
                q[2 * g + 1] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk.cast()));
            let c = if MIN { _mm256_cvtph_ps(_mm_loadu_si128(blk.add(2 * X8_ROWS).cast())) } else { d };
            Q4Block { q, d, c }
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn apply(b: &Q4Block, x: *const i8, dx: f32, sx: f32, acc: &mut __m256, macc: &mut __m256) {
        // SAFETY: the loads stay within the 32 activation quants (caller's contract).
        unsafe {
            let mut isum = _mm256_setzero_si256();
            for g in 0..4 {
                let xl = _mm256_set1_epi32(x.add(4 * g).cast::<i32>().read_unaligned());
                let xh = _mm256_set1_epi32(x.add(16 + 4 * g).cast::<i32>().read_unaligned());
                isum = _mm256_add_epi16(isum, _mm256_maddubs_epi16(b.q[2 * g], xl));
                isum = _mm256_add_epi16(isum, _mm256_maddubs_epi16(b.q[2 * g + 1], xh));
            }
            let f = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum, _mm256_set1_epi16(1)));
            *acc = _mm256_fmadd_ps(f, _mm256_mul_ps(b.d, _mm256_set1_ps(dx)), *acc);
            *macc = _mm256_fmadd_ps(b.c, _mm256_set1_ps(sx), *macc);
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn finish(acc: __m256, macc: __m256) -> __m256 {
        if MIN { _mm256_add_ps(acc, macc) } else { _mm256_fmadd_ps(_mm256_set1_ps(-8.0), macc, acc) }
    }
}

/// A Q8_0 block of 8 rows: its eight 32-byte slices (their signs go to the activations) and
/// their magnitudes, and the rows' scales.
#[derive(Clone, Copy)]
pub(crate) struct Q8Block {
    pub v: [__m256i; 8],
    pub a: [__m256i; 8],
    pub d: __m256,
}

/// Signed weights: `vpmaddubsw` takes `|w|` and the activations with `w`'s signs (`vpsignb`); a
/// pair sum reaches 2 · 128 · 127, so each slice goes to 32 bits (`vpmaddwd`) before the eight
/// are added.
impl Format for Q8_0 {
    const TY: WeightType = WeightType::Q8_0;
    type Block = Q8Block;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load(blk: *const u8) -> Q8Block {
        let hb = header_bytes(Self::TY);
        // SAFETY: as for `Q4`, with eight slices.
        unsafe {
            let (mut v, mut a) = ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 8]);
            for g in 0..8 {
                v[g] = _mm256_loadu_si256(blk.add(hb + 32 * g).cast());
                a[g] = _mm256_abs_epi8(v[g]);
            }
            Q8Block { v, a, d: _mm256_cvtph_ps(_mm_loadu_si128(blk.cast())) }
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn apply(b: &Q8Block, x: *const i8, dx: f32, _sx: f32, acc: &mut __m256, _macc: &mut __m256) {
        // SAFETY: as for `Q4`.
        unsafe {
            let mut isum = _mm256_setzero_si256();
            for g in 0..8 {
                let xg = _mm256_set1_epi32(x.add(4 * g).cast::<i32>().read_unaligned());
                let p = _mm256_maddubs_epi16(b.a[g], _mm256_sign_epi8(xg, b.v[g]));
                isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
            }
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(b.d, _mm256_set1_ps(dx)), *acc);
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn finish(acc: __m256, _macc: __m256) -> __m256 {
        acc
    }
}

