//! AMX-INT8 kernel for interleaved weight rows against several Q8 activation rows (Intel Xeon
//! since Sapphire Rapids): the tile unit multiplies a 16 × 32 byte tile of weights with a tile of
//! 16 activation rows' 32 quants in one instruction (`tdpbusd`: unsigned nibbles × signed
//! activations; `tdpbssd` for `Q8_0`'s signed weights), where VNNI takes 64 `vpdpbusd`. That is
//! what speculative verification and batched decode need: extra activation rows nearly free.
//!
//! Per pair of 8-row groups (16 weight rows) and block of 32: the two groups' quants are unpacked
//! (`Q4`: nibbles to bytes) into one 16 × 32 byte tile, each row its block's 32 elements in order,
//! for all blocks at once; the activations are packed once per [`Q8Activations`] into tiles of 16
//! rows × 32 quants in the tile unit's pairs-of-four layout (row `kk` holds quants `4kk..4kk + 4`
//! of each of the 16 rows). Each block's integer sums (exact, 16 × 16 of them) go through memory
//! to the AVX-512 part, which does what every other level does per (weight row, activation row)
//! and block, in the same order: `acc = fma(Σ, d_w · d_x, acc)`, `macc = fma(c_w, s_x, macc)`,
//! and at the end `Q4_1` `acc + macc`, `Q4_0` `fma(-8, macc, acc)`, `Q8_0` `acc`. So the results
//! are bit for bit the scalar kernel's (`crate::x8`), and a row's result does not depend on the
//! other rows of the batch.
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

/// Activation rows from which the x8 matmul takes this kernel (below it the VNNI kernel, whose
/// cost grows with the rows from a lower start, is as fast; measured with `examples/q8bench`).
pub(crate) const MIN_ROWS: usize = 12;

/// Weight rows per tile (two interleaved groups) and activation rows per tile.
const WT: usize = 2 * X8_ROWS;
const AT: usize = 16;
/// Bytes of one 16 × 32 tile (weights, and the activations' 8 × 64).
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

/// The activations packed for the tile unit, made once per [`Q8Activations`] (every matmul task
/// of a step shares them).
#[derive(Clone, Debug, Default)]
pub(crate) struct Packed {
    /// Per activation tile `t` and block `b`: 8 rows of 64 bytes, row `kk` holding quants
    /// `4kk..4kk + 4` of the tile's rows in turn (rows past `m` zero).
    quants: Vec<i8>,
    /// Per tile and block: the 16 rows' scales `d_x` and sums `s_x` (0 past `m`).
    d: Vec<[f32; AT]>,
    s: Vec<[f32; AT]>,
}

impl Packed {
    pub(crate) fn new(xq: &Q8Activations) -> Packed {
        let (nb, m) = (xq.k() / QK, xq.rows());
        let tiles = m.div_ceil(AT);
        let mut p = Packed { quants: vec![0; tiles * nb * TILE_BYTES], d: vec![[0.0; AT]; tiles * nb], s: vec![[0.0; AT]; tiles * nb] };
        let (q, d, s) = (xq.quants(), xq.scales(), xq.sums());
        for i in 0..m {
            let (t, n) = (i / AT, i % AT);
            for b in 0..nb {
                let tb = t * nb + b;
                let src = &q[(i * nb + b) * QK..][..QK];
                let dst = &mut p.quants[tb * TILE_BYTES..][..TILE_BYTES];
                for (kk, four) in src.chunks_exact(4).enumerate() {
                    dst[kk * 64 + 4 * n..][..4].copy_from_slice(four);
                }
                p.d[tb][n] = d[i * nb + b];
                p.s[tb][n] = s[i * nb + b];
            }
        }
        p
    }
}

/// The tile configuration: two sets of three tiles, so that two blocks' products are in flight
/// at once (tmm0 / tmm3 the 16 × 16 `i32` sums, tmm1 / tmm4 the weights, 16 rows of 32 bytes,
/// tmm2 / tmm5 the activations, 8 rows of 64 bytes).
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

/// Two blocks' integer sums, 16 rows of 16 `i32` each.
#[repr(C, align(64))]
struct Sums([[i32; WT * AT]; 2]);

/// `out[r * m + i]` for every row `r` of the interleaved groups `w` and activation row `i`
/// (lengths checked by the caller, `m >= 1`).
///
/// # Safety
/// The CPU must pass [`supported`] (and so the VNNI kernel's `supported`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(crate) unsafe fn dot(ty: WeightType, w: &[u8], xq: &Q8Activations, out: &mut [f32]) {
    let (nb, m) = (xq.k() / QK, xq.rows());
    let bb = ty.block_bytes() * X8_ROWS;
    let groups = out.len() / (X8_ROWS * m);
    assert!(w.len() >= groups * nb * bb && out.len() == groups * X8_ROWS * m);
    let packed = xq.amx_packed();
    let tiles = m.div_ceil(AT);
    let mut a = vec![0u8; nb * TILE_BYTES];
    let (mut dw, mut cw) = (vec![[0f32; WT]; nb], vec![[0f32; WT]; nb]);
    let mut sums = Sums([[0; WT * AT]; 2]);
    let cfg = TileConfig::new();
    // SAFETY: the configuration is a valid palette-1 layout (64 bytes, aligned).
    unsafe { asm!("ldtilecfg [{0}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
    let pairs = groups / 2;
    for pair in 0..pairs {
        for b in 0..nb {
            for g in 0..2 {
                let blk = &w[((2 * pair + g) * nb + b) * bb..][..bb];
                // SAFETY: blk is one block of a group (header then quant slices, as x8.rs lays
                // it out) and a[b]'s rows 8g..8g + 8 are 256 bytes of a.
                unsafe { unpack(ty, blk, a.as_mut_ptr().add(b * TILE_BYTES + g * X8_ROWS * 32), &mut dw[b][8 * g..8 * g + 8], &mut cw[b][8 * g..8 * g + 8]) };
            }
        }
        let next = &w[((2 * pair + 2) * nb * bb).min(w.len())..((2 * pair + 4) * nb * bb).min(w.len())];
        for t in 0..tiles {
            let mut acc = [_mm512_setzero_ps(); WT];
            let mut b = 0;
            while b < nb {
                let two = b + 1 < nb;
                if t == 0 {
                    // The next pair's bytes, asked for while this pair computes (it is unpacked
                    // in a burst, which the hardware prefetcher does not run ahead of).
                    prefetch(next, 2 * b * next.len() / (2 * nb).max(1), 2 * next.len().div_ceil(nb));
                }
                let (a0, b0) = (a[b * TILE_BYTES..].as_ptr(), packed.quants[(t * nb + b) * TILE_BYTES..].as_ptr());
                let (s0, s1) = (sums.0[0].as_mut_ptr(), sums.0[1].as_mut_ptr());
                // SAFETY: a's and the packed activations' blocks b (and b + 1 when `two`) are whole
                // tiles (512 bytes, rows 32 and 64 bytes apart); sums holds two 16 × 16 results of
                // 64-byte rows.
                unsafe {
                    match (ty == WeightType::Q8_0, two) {
                        (false, true) => asm!(
                            "tilezero tmm0", "tilezero tmm3",
                            "tileloadd tmm1, [{a0} + {s32}*1]", "tileloadd tmm2, [{b0} + {s64}*1]",
                            "tileloadd tmm4, [{a1} + {s32}*1]", "tileloadd tmm5, [{b1} + {s64}*1]",
                            "tdpbusd tmm0, tmm1, tmm2", "tdpbusd tmm3, tmm4, tmm5",
                            "tilestored [{s0} + {s64}*1], tmm0", "tilestored [{s1} + {s64}*1], tmm3",
                            a0 = in(reg) a0, b0 = in(reg) b0, a1 = in(reg) a0.add(TILE_BYTES), b1 = in(reg) b0.add(TILE_BYTES),
                            s0 = in(reg) s0, s1 = in(reg) s1, s32 = in(reg) 32usize, s64 = in(reg) 64usize, options(nostack)),
                        (true, true) => asm!(
                            "tilezero tmm0", "tilezero tmm3",
                            "tileloadd tmm1, [{a0} + {s32}*1]", "tileloadd tmm2, [{b0} + {s64}*1]",
                            "tileloadd tmm4, [{a1} + {s32}*1]", "tileloadd tmm5, [{b1} + {s64}*1]",
                            "tdpbssd tmm0, tmm1, tmm2", "tdpbssd tmm3, tmm4, tmm5",
                            "tilestored [{s0} + {s64}*1], tmm0", "tilestored [{s1} + {s64}*1], tmm3",
                            a0 = in(reg) a0, b0 = in(reg) b0, a1 = in(reg) a0.add(TILE_BYTES), b1 = in(reg) b0.add(TILE_BYTES),
                            s0 = in(reg) s0, s1 = in(reg) s1, s32 = in(reg) 32usize, s64 = in(reg) 64usize, options(nostack)),
                        (false, false) => asm!(
                            "tilezero tmm0", "tileloadd tmm1, [{a0} + {s32}*1]", "tileloadd tmm2, [{b0} + {s64}*1]",
                            "tdpbusd tmm0, tmm1, tmm2", "tilestored [{s0} + {s64}*1], tmm0",
                            a0 = in(reg) a0, b0 = in(reg) b0, s0 = in(reg) s0, s32 = in(reg) 32usize, s64 = in(reg) 64usize, options(nostack)),
                        (true, false) => asm!(
                            "tilezero tmm0", "tileloadd tmm1, [{a0} + {s32}*1]", "tileloadd tmm2, [{b0} + {s64}*1]",
                            "tdpbssd tmm0, tmm1, tmm2", "tilestored [{s0} + {s64}*1], tmm0",
                            a0 = in(reg) a0, b0 = in(reg) b0, s0 = in(reg) s0, s32 = in(reg) 32usize, s64 = in(reg) 64usize, options(nostack)),
                    }
                }
                // The blocks in order, as every kernel sums them.
                for (j, sums) in sums.0.iter().enumerate().take(1 + usize::from(two)) {
                    // SAFETY: a [f32; 16] is one vector.
                    let dx = unsafe { _mm512_loadu_ps(packed.d[t * nb + b + j].as_ptr()) };
                    for (r, acc) in acc.iter_mut().enumerate() {
                        // SAFETY: row r of the sums is 16 aligned i32.
                        let isum = unsafe { _mm512_load_si512(sums[r * AT..].as_ptr().cast()) };
                        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(_mm512_set1_ps(dw[b + j][r]), dx), *acc);
                    }
                }
                b += 1 + usize::from(two);
            }
            if ty != WeightType::Q8_0 {
                let mut macc = [_mm512_setzero_ps(); WT];
                for b in 0..nb {
                    // SAFETY: as dx above.
                    let sx = unsafe { _mm512_loadu_ps(packed.s[t * nb + b].as_ptr()) };
                    for (r, macc) in macc.iter_mut().enumerate() {
                        *macc = _mm512_fmadd_ps(_mm512_set1_ps(cw[b][r]), sx, *macc);
                    }
                }
                for (acc, macc) in acc.iter_mut().zip(macc) {
                    *acc = if ty == WeightType::Q4_1 { _mm512_add_ps(*acc, macc) } else { _mm512_fmadd_ps(_mm512_set1_ps(-8.0), macc, *acc) };
                }
            }
            let n = (m - t * AT).min(AT);
            let mask: __mmask16 = if n == AT { !0 } else { (1u16 << n) - 1 };
            for (r, acc) in acc.into_iter().enumerate() {
                let o = &mut out[(pair * WT + r) * m + t * AT..][..n];
                // SAFETY: the mask writes exactly o's n values.
                unsafe { _mm512_mask_storeu_ps(o.as_mut_ptr(), mask, acc) };
            }
        }
    }
    // SAFETY: releases the tile state this function configured.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
    if groups % 2 == 1 {
        let last = groups - 1;
        // supported() implies the VNNI kernel's features; the group's bytes and outputs are whole.
        super::x8::dot(ty, &w[last * nb * bb..][..nb * bb], xq, &mut out[last * X8_ROWS * m..]);
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

/// Unpack one interleaved block of 8 rows (`blk`: header, then the quant slices) into 8 tile rows
/// of 32 bytes at `dst` (each row its 32 elements in order: `Q4` nibbles as bytes, `Q8_0` as is),
/// with the rows' scales into `d` and their min terms (`Q4_1` mins, `Q4_0` scales) into `c`.
///
/// # Safety
/// `dst` must be valid for 256 bytes; the CPU as for [`dot`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn unpack(ty: WeightType, blk: &[u8], dst: *mut u8, d: &mut [f32], c: &mut [f32]) {
    let hb = header_bytes(ty);
    let f16s = |off: usize, out: &mut [f32]| {
        assert!(out.len() == X8_ROWS);
        // SAFETY: 16 bytes of blk (8 f16) in, 8 f32 of out out.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), _mm256_cvtph_ps(_mm_loadu_si128(blk[off..off + 16].as_ptr().cast()))) };
    };
    f16s(0, d);
    match ty {
        WeightType::Q4_1 => f16s(2 * X8_ROWS, c),
        WeightType::Q4_0 => c.copy_from_slice(d),
        _ => {}
    }
    // Dword (row q, slice g) of the slices 0..4 (slice g's 8 rows' dwords at 8g..8g + 8) for rows
    // 0..4 and 4..8: output dword 4q + g.
    let rows_lo = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
    let rows_hi = _mm512_add_epi32(rows_lo, _mm512_set1_epi32(4));
    // Two rows of 32 bytes from the first and second halves of two 4-row sources: 16-byte lanes
    // (a0, b0, a1, b1) and (a2, b2, a3, b3).
    let pair01 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    let pair23 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    let q = blk[hb..].as_ptr();
    // SAFETY: the quant slices are 128 (Q4) or 256 (Q8_0) bytes after the header, within blk;
    // the stores write dst's 256 bytes.
    unsafe {
        let store = |off: usize, a: __m512i, b: __m512i| {
            _mm512_storeu_si512(dst.add(off).cast(), _mm512_permutex2var_epi64(a, pair01, b));
            _mm512_storeu_si512(dst.add(off + 64).cast(), _mm512_permutex2var_epi64(a, pair23, b));
        };
        if ty == WeightType::Q8_0 {
            let z = [0, 1, 2, 3].map(|i| _mm512_loadu_si512(q.add(64 * i).cast()));
            // Slices 0..4 and 4..8 of rows 0..4 and 4..8; a row is the first's 16 bytes, then the second's.
            let (t0, t1) = (_mm512_permutex2var_epi32(z[0], rows_lo, z[1]), _mm512_permutex2var_epi32(z[0], rows_hi, z[1]));
            let (t2, t3) = (_mm512_permutex2var_epi32(z[2], rows_lo, z[3]), _mm512_permutex2var_epi32(z[2], rows_hi, z[3]));
            store(0, t0, t2);
            store(128, t1, t3);
        } else {
            let (z0, z1) = (_mm512_loadu_si512(q.cast()), _mm512_loadu_si512(q.add(64).cast()));
            let nib = _mm512_set1_epi8(0x0F);
            for (half, idx) in [rows_lo, rows_hi].into_iter().enumerate() {
                let p = _mm512_permutex2var_epi32(z0, idx, z1);
                // Elements 0..16 are the low nibbles of a row's 16 bytes, 16..32 the high ones.
                let (lo, hi) = (_mm512_and_si512(p, nib), _mm512_and_si512(_mm512_srli_epi16(p, 4), nib));
                store(128 * half, lo, hi);
            }
        }
    }
}
