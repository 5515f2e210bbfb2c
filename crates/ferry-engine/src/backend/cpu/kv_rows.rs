//! Attention's two inner loops over KV rows stored as f16, bf16 or int8 (see
//! [`ferry_core::kv_dtype`]), read as stored: each kernel widens a row's values to f32 in
//! registers (int8 rows multiplied by their scale once per row, after the dot product or into the
//! probability), so no f32 copy of the cache is made. f32 rows use the f32 kernels in `simd.rs`.
//!
//! They read a row's values as stored (`stored_values`: an int8 row's values in the Hadamard-turned
//! basis, which attention meets with a query turned the same way, see `attention.rs`).
//!
//! One kernel body per width (AVX-512: 16 lanes, AVX2 + F16C: 8 lanes), generic over how a type
//! widens its lanes; the scalar path (`stored_values` per row) is the oracle the tests hold every
//! level to. The level follows `ferry_quant::SimdLevel::selected()` (so `FERRY_QUANT_SIMD` caps it).

use super::simd;
use ferry_core::KvDtype;
use ferry_core::kv_dtype::{int8_row_scale, stored_values};
use ferry_quant::SimdLevel;

/// `out[t] = q · row_t` over `out.len()` consecutive rows of `q.len()` values stored as `dtype`.
pub(crate) fn dots(dtype: KvDtype, q: &[f32], rows: &[u8], out: &mut [f32]) {
    dots_at(SimdLevel::selected(), dtype, q, rows, out)
}

/// `acc += Σ_t p[t] · row_t` over `p.len()` consecutive rows of `acc.len()` values stored as `dtype`.
pub(crate) fn accumulate(dtype: KvDtype, acc: &mut [f32], p: &[f32], rows: &[u8]) {
    accumulate_at(SimdLevel::selected(), dtype, acc, p, rows)
}

pub(crate) fn dots_at(level: SimdLevel, dtype: KvDtype, q: &[f32], rows: &[u8], out: &mut [f32]) {
    let d = q.len();
    let rb = dtype.row_bytes(d);
    assert_eq!(rows.len(), out.len() * rb, "kv dots: {} bytes for {} {dtype} rows of {d}", rows.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    match (level, dtype) {
        (_, KvDtype::F32) => return simd::dots(q, bytemuck::cast_slice(rows), out),
        (SimdLevel::Avx512, _) if d.is_multiple_of(16) => {
            // SAFETY: Avx512 is only selected (or passed by tests) where the CPU supports it.
            return unsafe { x512::dots(dtype, q, rows, rb, out) };
        }
        (SimdLevel::Avx2 | SimdLevel::Avx512, _) if d.is_multiple_of(8) => {
            // SAFETY: as above, for AVX2 + FMA + F16C.
            return unsafe { x256::dots(dtype, q, rows, rb, out) };
        }
        _ => {}
    }
    let mut tmp = vec![0f32; d];
    for (o, r) in out.iter_mut().zip(rows.chunks_exact(rb)) {
        stored_values(dtype, r, &mut tmp);
        *o = simd::dot(q, &tmp);
    }
}

pub(crate) fn accumulate_at(level: SimdLevel, dtype: KvDtype, acc: &mut [f32], p: &[f32], rows: &[u8]) {
    let d = acc.len();
    let rb = dtype.row_bytes(d);
    assert_eq!(rows.len(), p.len() * rb, "kv accumulate: {} bytes for {} {dtype} rows of {d}", rows.len(), p.len());
    #[cfg(target_arch = "x86_64")]
    match (level, dtype) {
        (_, KvDtype::F32) => return simd::accumulate(acc, p, bytemuck::cast_slice(rows)),
        (SimdLevel::Avx512, _) if d.is_multiple_of(16) => {
            // SAFETY: Avx512 is only selected (or passed by tests) where the CPU supports it.
            return unsafe { x512::accumulate(dtype, acc, p, rows, rb) };
        }
        (SimdLevel::Avx2 | SimdLevel::Avx512, _) if d.is_multiple_of(8) => {
            // SAFETY: as above, for AVX2 + FMA + F16C.
            return unsafe { x256::accumulate(dtype, acc, p, rows, rb) };
        }
        _ => {}
    }
    let mut tmp = vec![0f32; d];
    for (&pt, r) in p.iter().zip(rows.chunks_exact(rb)) {
        stored_values(dtype, r, &mut tmp);
        simd::axpy(acc, pt, &tmp);
    }
}

/// A row's multiplier: its int8 scale, 1 for float types.
#[inline(always)]
fn row_scale(dtype: KvDtype, row: &[u8]) -> f32 {
    if dtype == KvDtype::Int8 { int8_row_scale(row) } else { 1.0 }
}

/// Widen consecutive rows of `hd` values to f32 (`out.len()` = rows · `hd`), as stored (int8:
/// turned): the GEMM path's tile gather.
pub(crate) fn widen(dtype: KvDtype, hd: usize, rows: &[u8], out: &mut [f32]) {
    if dtype == KvDtype::F32 {
        // The cache's f32 rows are word-aligned: a plain copy.
        return out.copy_from_slice(bytemuck::cast_slice(rows));
    }
    for (r, o) in rows.chunks_exact(dtype.row_bytes(hd)).zip(out.chunks_exact_mut(hd)) {
        stored_values(dtype, r, o);
    }
}

/// The AVX-512 and AVX2 kernels: one body, generated per width. `T` is the stored type
/// (`F16`, `BF16`, `I8` below), resolved at compile time.
macro_rules! row_kernels {
    ($features:literal, $lanes:literal, $zero:ident, $fmadd:ident, $set1:ident, $loadu:ident, $storeu:ident, $add:ident) => {
        use super::row_scale;
        use ferry_core::KvDtype;

        const F16: u8 = 0;
        const BF16: u8 = 1;
        const I8: u8 = 2;

        /// Bytes per value of `T`.
        const fn size(t: u8) -> usize {
            if t == I8 { 1 } else { 2 }
        }

        #[target_feature(enable = $features)]
        pub(super) fn dots(dtype: KvDtype, q: &[f32], rows: &[u8], rb: usize, out: &mut [f32]) {
            match dtype {
                KvDtype::F16 => dots_of::<F16>(dtype, q, rows, rb, out),
                KvDtype::BF16 => dots_of::<BF16>(dtype, q, rows, rb, out),
                KvDtype::Int8 => dots_of::<I8>(dtype, q, rows, rb, out),
                KvDtype::F32 => unreachable!("f32 rows take the f32 kernels"),
            }
        }

        #[target_feature(enable = $features)]
        pub(super) fn accumulate(dtype: KvDtype, acc: &mut [f32], p: &[f32], rows: &[u8], rb: usize) {
            match dtype {
                KvDtype::F16 => acc_of::<F16>(dtype, acc, p, rows, rb),
                KvDtype::BF16 => acc_of::<BF16>(dtype, acc, p, rows, rb),
                KvDtype::Int8 => acc_of::<I8>(dtype, acc, p, rows, rb),
                KvDtype::F32 => unreachable!("f32 rows take the f32 kernels"),
            }
        }

        /// Callers checked: `q.len()` is a multiple of the lanes and `rows` holds `out.len()` rows
        /// of `rb` bytes, each starting with `q.len()` values of `T`.
        #[target_feature(enable = $features)]
        fn dots_of<const T: u8>(dtype: KvDtype, q: &[f32], rows: &[u8], rb: usize, out: &mut [f32]) {
            let d = q.len();
            // Four rows at a time: each query vector loaded once for the four, one accumulator
            // per row, and the four sums reduced together.
            let n = out.len();
            let mut quads = out.chunks_exact_mut(4);
            for (o, rows) in (&mut quads).zip(rows.chunks_exact(4 * rb)) {
                let mut a = [$zero(); 4];
                let mut j = 0;
                while j < d {
                    // SAFETY: j + lanes <= d; q holds d floats.
                    let qv = unsafe { $loadu(q.as_ptr().add(j)) };
                    for (r, a) in a.iter_mut().enumerate() {
                        // SAFETY: row r's values j..j + lanes lie within its rb bytes.
                        *a = $fmadd(qv, unsafe { load::<T>(rows.as_ptr().add(r * rb + j * size(T))) }, *a);
                    }
                    j += $lanes;
                }
                let s = hsum4(a);
                for (r, o) in o.iter_mut().enumerate() {
                    *o = s[r] * row_scale(dtype, &rows[r * rb..(r + 1) * rb]);
                }
            }
            let done = n - quads.into_remainder().len();
            for (o, row) in out[done..].iter_mut().zip(rows[done * rb..].chunks_exact(rb)) {
                let (mut a0, mut a1) = ($zero(), $zero());
                let mut j = 0;
                while j < d {
                    // SAFETY: j + lanes <= d values of T lie within the row; q holds d floats.
                    let (k, qv) = unsafe { (load::<T>(row.as_ptr().add(j * size(T))), $loadu(q.as_ptr().add(j))) };
                    if (j / $lanes) % 2 == 0 { a0 = $fmadd(qv, k, a0) } else { a1 = $fmadd(qv, k, a1) }
                    j += $lanes;
                }
                *o = hsum($add(a0, a1)) * row_scale(dtype, row);
            }
        }

        #[target_feature(enable = $features)]
        fn acc_of<const T: u8>(dtype: KvDtype, acc: &mut [f32], p: &[f32], rows: &[u8], rb: usize) {
            const R: usize = 8; // accumulator vectors per pass
            let d = acc.len();
            let mut c = 0;
            while c < d {
                let w = ((d - c) / $lanes).min(R);
                let mut a = [$zero(); R];
                for (i, a) in a.iter_mut().enumerate().take(w) {
                    // SAFETY: c + lanes·(i + 1) <= d.
                    *a = unsafe { $loadu(acc.as_ptr().add(c + $lanes * i)) };
                }
                for (&pt, row) in p.iter().zip(rows.chunks_exact(rb)) {
                    let b = $set1(pt * row_scale(dtype, row));
                    for (i, a) in a.iter_mut().enumerate().take(w) {
                        // SAFETY: values c + lanes·i .. + lanes lie within the row's d values.
                        *a = $fmadd(b, unsafe { load::<T>(row.as_ptr().add((c + $lanes * i) * size(T))) }, *a);
                    }
                }
                for (i, a) in a.iter().enumerate().take(w) {
                    // SAFETY: as the loads above.
                    unsafe { $storeu(acc.as_mut_ptr().add(c + $lanes * i), *a) };
                }
                c += $lanes * w;
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod x512 {
    use core::arch::x86_64::*;

    row_kernels!("avx512f,avx512bw,avx512vl,avx2,fma,f16c", 16, _mm512_setzero_ps, _mm512_fmadd_ps, _mm512_set1_ps, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_add_ps);

    /// 16 values of `T` at `p`, widened to f32.
    ///
    /// # Safety
    /// `p` covers 16 values of `T`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn load<const T: u8>(p: *const u8) -> __m512 {
        // SAFETY: the caller's contract.
        unsafe {
            match T {
                F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())),
                BF16 => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast())))),
                _ => _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast()))),
            }
        }
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    fn hsum(v: __m512) -> f32 {
        _mm512_reduce_add_ps(v)
    }

    /// The lane sums of four vectors: each folded to 8 lanes, then as AVX2's.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    fn hsum4(a: [__m512; 4]) -> [f32; 4] {
        let half = |v: __m512| _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v))));
        super::super::simd::hsum4_avx2([half(a[0]), half(a[1]), half(a[2]), half(a[3])])
    }
}

#[cfg(target_arch = "x86_64")]
mod x256 {
    use core::arch::x86_64::*;

    row_kernels!("avx2,fma,f16c", 8, _mm256_setzero_ps, _mm256_fmadd_ps, _mm256_set1_ps, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_add_ps);

    /// 8 values of `T` at `p`, widened to f32.
    ///
    /// # Safety
    /// `p` covers 8 values of `T`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load<const T: u8>(p: *const u8) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe {
            match T {
                F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                BF16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())))),
                _ => _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p.cast()))),
            }
        }
    }

    use super::super::simd::{hsum_avx2 as hsum, hsum4_avx2 as hsum4};
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::kv_dtype::encode_row;

    fn rows(dtype: KvDtype, n: usize, d: usize) -> (Vec<u8>, Vec<f32>) {
        let vals: Vec<f32> = (0..n * d).map(|i| ((i * 7919 % 1000) as f32 / 250.0 - 2.0) * if i % 13 == 0 { 4.0 } else { 1.0 }).collect();
        let rb = dtype.row_bytes(d);
        let mut bytes = vec![0u8; n * rb];
        for (v, b) in vals.chunks(d).zip(bytes.chunks_mut(rb)) {
            encode_row(dtype, v, b);
        }
        (bytes, vals)
    }

    /// Every level's kernels against the scalar oracle, for every stored type and head sizes
    /// that take the wide, narrow and fallback paths.
    #[test]
    fn every_level_matches_the_scalar_oracle() {
        for level in SimdLevel::ALL.into_iter().filter(|l| l.is_supported()) {
            for dtype in KvDtype::ALL {
                for (d, n) in [(64, 19), (128, 5), (8, 3), (6, 2)] {
                    let (bytes, _) = rows(dtype, n, d);
                    let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin()).collect();
                    let p: Vec<f32> = (0..n).map(|i| 1.0 / (i + 1) as f32).collect();
                    let (mut want, mut got) = (vec![0f32; n], vec![0f32; n]);
                    dots_at(SimdLevel::Scalar, dtype, &q, &bytes, &mut want);
                    dots_at(level, dtype, &q, &bytes, &mut got);
                    for (w, g) in want.iter().zip(&got) {
                        assert!((w - g).abs() <= 1e-4 * (1.0 + w.abs()), "{} {dtype} d={d}: dots {g} vs oracle {w}", level.name());
                    }
                    let (mut want, mut got) = (vec![0.5f32; d], vec![0.5f32; d]);
                    accumulate_at(SimdLevel::Scalar, dtype, &mut want, &p, &bytes);
                    accumulate_at(level, dtype, &mut got, &p, &bytes);
                    for (w, g) in want.iter().zip(&got) {
                        assert!((w - g).abs() <= 1e-4 * (1.0 + w.abs()), "{} {dtype} d={d}: accumulate {g} vs oracle {w}", level.name());
                    }
                }
            }
        }
    }

    #[test]
    fn widened_rows_are_the_stored_turned_values() {
        let (bytes, vals) = rows(KvDtype::Int8, 4, 16);
        let mut out = vec![0f32; 64];
        widen(KvDtype::Int8, 16, &bytes, &mut out);
        for ((o, v), b) in out.chunks(16).zip(vals.chunks(16)).zip(bytes.chunks(KvDtype::Int8.row_bytes(16))) {
            // The row's values turned (int8 stores them so), within half a step of its scale.
            let mut turned = v.to_vec();
            ferry_core::kv_dtype::hadamard(&mut turned);
            let s = int8_row_scale(b);
            assert!(o.iter().zip(&turned).all(|(a, b)| (a - b).abs() <= s * 0.5 + 1e-6));
        }
    }
}
