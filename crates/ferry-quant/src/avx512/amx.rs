//! AMX-INT8 kernel for interleaved weight rows against several Q8 activation rows (Intel Xeon
//! since Sapphire Rapids): the tile unit multiplies a tile of up to 16 activation rows' 32 quants
//! of a block with the block of 16 weight rows in one instruction (`tdpbsud`: signed activations
//! × unsigned nibbles; `tdpbssd` for `Q8_0`'s signed weights), where VNNI takes 32 `vpdpbusd` per
//! 8 activation rows. That is what speculative verification and batched decode need: extra
//! activation rows nearly free.
//!
//! The activation tile is loaded straight from [`Q8Activations`] (row `i` of block `b` at
//! `32 (i · nb + b)`, rows `k` bytes apart); a last tile of fewer than 16 rows from a copy padded
//! with zero rows ([`Scales`], made once per activations). The weight
//! tile is the tile unit's pairs-of-four layout, row `kk` holding elements `4kk..4kk + 4` of each
//! of the 16 rows, which the interleaved layout nearly is: its slice `g` holds bytes
//! `4g..4g + 4` of the 8 rows of a group, so row `kk` is the low nibbles of slice `kk` of the two
//! groups of a pair, row `4 + kk` their high nibbles (`Q8_0`: slice `kk` as is). Each block's
//! integer sums (exact) go through memory to the AVX-512 part, one vector of 16 weight rows per
//! activation row, which does what every other level does per (weight row, activation row) and
//! block, in the same order: `acc = fma(Σ, d_w · d_x, acc)`, `macc = fma(c_w, s_x, macc)`, and at
//! the end `Q4_1` `acc + macc`, `Q4_0` `fma(-8, macc, acc)`, `Q8_0` `acc`. So the results are bit
//! for bit the scalar kernel's (`crate::x8`), and a row's result does not depend on the other
//! rows of the batch.
//!
//! A trailing group of 8 rows (an odd number of groups) runs the VNNI kernel. Linux grants a
//! process the tile state only when asked (`arch_prctl(ARCH_REQ_XCOMP_PERM)`); [`supported`] asks
//! once. `FERRY_QUANT_AMX=off` keeps the VNNI kernel (for side-by-side measurement).

use core::arch::asm;
use core::arch::x86_64::*;
use std::sync::OnceLock;

use crate::q8::Q8Activations;
use crate::types::{QK, WeightType};
use crate::x8::{X8_ROWS, header_bytes};

/// Activation rows from which the x8 matmul takes this kernel: from 8 rows it beats VNNI alone
/// (`examples/q8bench`), but through the engine a batch of 8 gained nothing measurable with it
/// (the tile set-up per matmul task; 3% slower before the per-thread scratch and the shared
/// scales), while a batch of 12 steps 5-7% faster; so VNNI keeps steps of up to 11 rows.
pub(crate) const MIN_ROWS: usize = 12;

/// Weight rows per tile (two interleaved groups) and activation rows per tile.
const WT: usize = 2 * X8_ROWS;
const AT: usize = 16;
/// Bytes of one weight tile (8 rows of 64).
const TILE_BYTES: usize = 512;

/// Whether this CPU has AMX-TILE and AMX-INT8 (besides the VNNI kernel's features), the kernel
/// granted the tile state to this process, and `FERRY_QUANT_AMX` is not `off`. Decided once.
pub(crate) fn supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| {
        if std::env::var("FERRY_QUANT_AMX").is_ok_and(|v| v.trim().eq_ignore_ascii_case("off")) {
            return false;
        }
        // CPUID leaf 7, subleaf 0: EDX bit 24 AMX-TILE, bit 25 AMX-INT8.
        // CPUID leaf 7 exists on every CPU with AVX2, which the VNNI check implies.
        let edx = super::x8::supported().then(|| __cpuid_count(7, 0).edx);
        edx.is_some_and(|e| e & (3 << 24) == 3 << 24) && std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bw") && tile_permission()
    })
}

/// Ask Linux for the tile data state (process-wide, once): without it the first tile instruction
/// raises SIGILL. Elsewhere: not granted.
fn tile_permission() -> bool {
    #[cfg(target_os = "linux")]
    {
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with these arguments only changes which extended states this process
        // may use; it reads and writes no memory of ours.
        unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
    }
    #[cfg(not(target_os = "linux"))]
    false
}

/// The tile configuration: two sets of three tiles, so that two blocks' products are in flight
/// at once (tmm0 / tmm3 the 16 × 16 `i32` sums, tmm1 / tmm4 the activations, 16 rows of 32
/// bytes, tmm2 / tmm5 the weights, 8 rows of 64 bytes).
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new() -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1; // palette 1
        for (t, (rows, colsb)) in [(16u8, 64u16), (16, 32), (8, 64)].into_iter().cycle().take(6).enumerate() {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
            c[48 + t] = rows;
        }
        TileConfig(c)
    }
}

/// Two blocks' integer sums, 16 activation rows of 16 `i32` each.
#[repr(C, align(64))]
struct Sums([[i32; AT * WT]; 2]);

/// The activations' scales `d_x` and sums `s_x` per activation tile and block (16 rows, 0 past
/// the last), and the quants of a last tile of fewer than 16 rows padded to 16 with zero rows;
/// made once per [`Q8Activations`] and shared by every matmul task that reads them.
#[derive(Clone, Debug, Default)]
pub(crate) struct Scales {
    d: Vec<[f32; AT]>,
    s: Vec<[f32; AT]>,
    tail: Vec<i8>,
}

impl Scales {
    pub(crate) fn new(xq: &Q8Activations) -> Scales {
        let (nb, m) = (xq.k() / QK, xq.rows());
        let tiles = m.div_ceil(AT);
        let full = m / AT * AT;
        let mut tail = Vec::new();
        if full < m {
            tail = vec![0i8; AT * xq.k()];
            tail[..(m - full) * xq.k()].copy_from_slice(&xq.quants()[full * xq.k()..]);
        }
        let mut t = Scales { d: vec![[0.0; AT]; tiles * nb], s: vec![[0.0; AT]; tiles * nb], tail };
        for i in 0..m {
            for b in 0..nb {
                t.d[(i / AT) * nb + b][i % AT] = xq.scales()[i * nb + b];
                t.s[(i / AT) * nb + b][i % AT] = xq.sums()[i * nb + b];
            }
        }
        t
    }
}

/// A pair of groups unpacked: per block the weight tile, the 16 rows' scales and min terms. One
/// per thread, kept between calls (a decode step makes ~1,000 of them).
#[derive(Default)]
struct Pair {
    tiles: Vec<u8>,
    d: Vec<__m512>,
    c: Vec<__m512>,
}

thread_local! {
    static PAIR: std::cell::RefCell<Pair> = std::cell::RefCell::default();
}

/// Run `i` of `out`, output `r`, for every row `r` of the interleaved groups `w` and activation
/// row `i` (lengths checked by the caller, `m >= 1`).
///
/// # Safety
/// The CPU must pass [`supported`] (and so the VNNI kernel's `supported`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot(ty: WeightType, w: &[u8], xq: &Q8Activations, out: &mut crate::x8::Outputs<'_>) {
    let (nb, m) = (xq.k() / QK, xq.rows());
    let bb = ty.block_bytes() * X8_ROWS;
    let groups = w.len() / (nb * bb);
    assert!(out.rows() >= m && out.cols() >= groups * X8_ROWS);
    let mut pair = PAIR.take();
    pair.tiles.resize(nb * TILE_BYTES, 0);
    pair.d.resize(nb, _mm512_setzero_ps());
    pair.c.resize(nb, _mm512_setzero_ps());
    let scales = xq.amx_scales();
    let cfg = TileConfig::new();
    // SAFETY: the configuration is a valid palette-1 layout (64 bytes, aligned).
    unsafe { asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
    for p in 0..groups / 2 {
        for b in 0..nb {
            let blk = |g: usize| &w[((2 * p + g) * nb + b) * bb..][..bb];
            // SAFETY: the pair's two blocks b, and its tile b (512 bytes of `tiles`).
            unsafe { unpack(ty, blk(0), blk(1), pair.tiles.as_mut_ptr().add(b * TILE_BYTES), &mut pair.d[b], &mut pair.c[b]) };
        }
        let next = &w[((2 * p + 2) * nb * bb).min(w.len())..((2 * p + 4) * nb * bb).min(w.len())];
        let mut i0 = 0;
        while i0 < m {
            let rows = (m - i0).min(AT);
            // The tile's 16 rows: the activations' own, or the padded copy of the last few.
            let xt = if rows == AT { &xq.quants()[i0 * nb * QK..] } else { &scales.tail[..] };
            assert!(xt.len() >= AT * nb * QK);
            // SAFETY: xt holds the tile's 16 rows (asserted), the pair's tiles are unpacked, and
            // the outputs of rows i0..i0 + rows exist.
            unsafe {
                match rows.div_ceil(4) {
                    1 => tile::<4>(ty, &pair, xq, xt, scales, i0, rows, next, p, out),
                    2 => tile::<8>(ty, &pair, xq, xt, scales, i0, rows, next, p, out),
                    3 => tile::<12>(ty, &pair, xq, xt, scales, i0, rows, next, p, out),
                    _ => tile::<16>(ty, &pair, xq, xt, scales, i0, rows, next, p, out),
                }
            }
            i0 += AT;
        }
    }
    // SAFETY: releases the tile state this function configured.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
    PAIR.set(pair);
    if groups % 2 == 1 {
        let last = groups - 1;
        // supported() implies the VNNI kernel's features; the group's bytes and outputs are whole.
        super::x8::dot(ty, &w[last * nb * bb..][..nb * bb], xq, &mut out.from_col(last * X8_ROWS));
    }
}

/// Activation rows `i0..i0 + rows` (`rows <= R`, a multiple of 4 at least `rows`: the tile's
/// sums for the rows past `rows` are computed and dropped) against pair `p`.
///
/// # Safety
/// As [`dot`]'s loop states.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const R: usize>(ty: WeightType, pair: &Pair, xq: &Q8Activations, xt: &[i8], scales: &Scales, i0: usize, rows: usize, next: &[u8], p: usize, out: &mut crate::x8::Outputs<'_>) {
    let (nb, k) = (xq.k() / QK, xq.k());
    let (xd, xs) = (&scales.d[i0 / AT * nb..][..nb], &scales.s[i0 / AT * nb..][..nb]);
    let mut sums = Sums([[0; AT * WT]; 2]);
    let mut acc = [_mm512_setzero_ps(); R];
    let mut b = 0;
    while b < nb {
        let two = b + 1 < nb;
        if i0 == 0 {
            // The next pair's bytes, asked for while this pair computes (they are unpacked in a
            // burst, which the hardware prefetcher does not run ahead of).
            prefetch(next, b * next.len() / nb, 2 * next.len().div_ceil(nb));
        }
        let (a0, w0) = (xt[b * QK..].as_ptr(), pair.tiles[b * TILE_BYTES..].as_ptr());
        let (s0, s1) = (sums.0[0].as_mut_ptr(), sums.0[1].as_mut_ptr());
        // One block's product (`$op`: tdpbsud or tdpbssd) into tmm0, or two into tmm0 and tmm3.
        macro_rules! products {
            ($op:literal, 1) => {
                asm!(
                    "tilezero tmm0", "tileloadd tmm1, [{a0} + {k}*1]", "tileloadd tmm2, [{w0} + {s64}*1]",
                    concat!($op, " tmm0, tmm1, tmm2"), "tilestored [{s0} + {s64}*1], tmm0",
                    a0 = in(reg) a0, w0 = in(reg) w0, s0 = in(reg) s0, k = in(reg) k, s64 = in(reg) 64usize, options(nostack))
            };
            ($op:literal, 2) => {
                asm!(
                    "tilezero tmm0", "tilezero tmm3",
                    "tileloadd tmm1, [{a0} + {k}*1]", "tileloadd tmm2, [{w0} + {s64}*1]",
                    "tileloadd tmm4, [{a1} + {k}*1]", "tileloadd tmm5, [{w1} + {s64}*1]",
                    concat!($op, " tmm0, tmm1, tmm2"), concat!($op, " tmm3, tmm4, tmm5"),
                    "tilestored [{s0} + {s64}*1], tmm0", "tilestored [{s1} + {s64}*1], tmm3",
                    a0 = in(reg) a0, w0 = in(reg) w0, a1 = in(reg) a0.add(QK), w1 = in(reg) w0.add(TILE_BYTES),
                    s0 = in(reg) s0, s1 = in(reg) s1, k = in(reg) k, s64 = in(reg) 64usize, options(nostack))
            };
        }
        // SAFETY: activation tile b (and b + 1): 16 rows of 32 bytes, k apart, within xt; weight
        // tiles b (and b + 1) within pair.tiles; sums holds two 16 × 16 results of 64-byte rows.
        unsafe {
            match (ty == WeightType::Q8_0, two) {
                (false, true) => products!("tdpbsud", 2),
                (true, true) => products!("tdpbssd", 2),
                (false, false) => products!("tdpbsud", 1),
                (true, false) => products!("tdpbssd", 1),
            }
        }
        // The blocks in order, as every kernel sums them.
        for (j, sums) in sums.0.iter().enumerate().take(1 + usize::from(two)) {
            let dx = &xd[b + j];
            for (n, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row n of the sums is 16 aligned i32.
                let isum = unsafe { _mm512_load_si512(sums[n * WT..].as_ptr().cast()) };
                *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(pair.d[b + j], _mm512_set1_ps(dx[n])), *acc);
            }
        }
        b += 1 + usize::from(two);
    }
    if ty != WeightType::Q8_0 {
        let mut macc = [_mm512_setzero_ps(); R];
        for (&c, sx) in pair.c.iter().zip(xs) {
            for (n, macc) in macc.iter_mut().enumerate() {
                *macc = _mm512_fmadd_ps(c, _mm512_set1_ps(sx[n]), *macc);
            }
        }
        for (acc, macc) in acc.iter_mut().zip(macc) {
            *acc = if ty == WeightType::Q4_1 { _mm512_add_ps(*acc, macc) } else { _mm512_fmadd_ps(_mm512_set1_ps(-8.0), macc, *acc) };
        }
    }
    // Weight rows 16 p.. of activation row i0 + n: one vector, out[(i0 + n) ld + 16 p..][..16].
    for (n, acc) in acc.into_iter().enumerate().take(rows) {
        let o = out.run(i0 + n, WT * p, WT);
        // SAFETY: o holds 16 floats.
        unsafe { _mm512_storeu_ps(o.as_mut_ptr(), acc) };
    }
}

/// Ask for `len` bytes of `bytes` from `start` on (clipped to it) to be brought into the cache.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn prefetch(bytes: &[u8], start: usize, len: usize) {
    let mut off = start;
    while off < (start + len).min(bytes.len()) {
        // SAFETY: off < bytes.len(); a prefetch has no architectural effect.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().add(off).cast()) };
        off += 64;
    }
}

/// Unpack block `b` of a pair of groups (`g0`, `g1`: each a header, then the quant slices) into
/// the weight tile at `dst` (8 rows of 64 bytes: row `kk` the two groups' slice `kk` low nibbles,
/// row `4 + kk` their high nibbles; `Q8_0`: row `kk` the two slices `kk`), with the 16 rows'
/// scales into `d` and their min terms (`Q4_1` mins, `Q4_0` scales) into `c`.
///
/// # Safety
/// `dst` must be valid for 512 bytes; the CPU as for [`dot`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack(ty: WeightType, g0: &[u8], g1: &[u8], dst: *mut u8, d: &mut __m512, c: &mut __m512) {
    let hb = header_bytes(ty);
    // 8 f16 of each group's header at `off`, as 16 f32.
    let halves = |off: usize| {
        // SAFETY: 16 bytes of each block's header.
        let (h0, h1) = unsafe { (_mm_loadu_si128(g0[off..off + 16].as_ptr().cast()), _mm_loadu_si128(g1[off..off + 16].as_ptr().cast())) };
        _mm512_cvtph_ps(_mm256_set_m128i(h1, h0))
    };
    *d = halves(0);
    *c = match ty {
        WeightType::Q4_1 => halves(2 * X8_ROWS),
        WeightType::Q4_0 => *d,
        _ => _mm512_setzero_ps(),
    };
    let slices = if ty == WeightType::Q8_0 { 8 } else { 4 };
    assert!(g0.len() >= hb + 32 * slices && g1.len() >= hb + 32 * slices);
    let nib = _mm512_set1_epi8(0x0F);
    for kk in 0..slices {
        // SAFETY: slice kk of each block (asserted above); rows kk and 4 + kk of dst's 512 bytes.
        unsafe {
            let (l0, l1) = (_mm256_loadu_si256(g0[hb + 32 * kk..].as_ptr().cast()), _mm256_loadu_si256(g1[hb + 32 * kk..].as_ptr().cast()));
            let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(l0), l1);
            if ty == WeightType::Q8_0 {
                _mm512_storeu_si512(dst.add(64 * kk).cast(), both);
            } else {
                _mm512_storeu_si512(dst.add(64 * kk).cast(), _mm512_and_si512(both, nib));
                _mm512_storeu_si512(dst.add(64 * (4 + kk)).cast(), _mm512_and_si512(_mm512_srli_epi16::<4>(both), nib));
            }
        }
    }
}
