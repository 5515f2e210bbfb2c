//! Attention's inner loops for decode rows, over KV blocks widened once to f32.
//!
//! A KV block's rows are stored as f32, f16, bf16 or int8 (see [`ferry_core::kv_dtype`]); the
//! direct attention path widens a block's keys (then its values) once into a small f32 scratch
//! that stays in L1 while every query row of the item uses it ([`widen`]: an int8 row's values
//! times its scale, in the Hadamard-turned basis it is stored in, which attention meets with a
//! query turned the same way, see `attention.rs`). The two kernels then work on f32:
//! [`dots`], a query against a block's keys 16 at a time (one accumulator per key, the 16 lane
//! sums reduced together), and [`accumulate`], probabilities times value rows into an output row
//! held in registers. Every key's dot is computed the same way whatever the other rows of the
//! block are, so a query row's result does not depend on how many keys of its last block it
//! sees, on the other rows of its item, or on the batch.
//!
//! Kernels per [`SimdLevel`] (AVX-512, AVX2 + FMA + F16C, scalar); the scalar path is the oracle
//! the tests hold every level to. The level follows `ferry_quant::SimdLevel::selected()` (so
//! `FERRY_QUANT_SIMD` caps it).

use super::simd;
use ferry_core::KvDtype;
use ferry_core::kv_dtype::stored_values;
use ferry_quant::SimdLevel;

/// Keys per [`dots`] pass: a key block's scratch is padded to a multiple of this.
pub(crate) const KEYS: usize = 16;

/// Widen consecutive rows of `hd` values stored as `dtype` to f32 (`out.len()` = rows · `hd`),
/// as stored (int8: its values times the row's scale, turned).
pub(crate) fn widen(dtype: KvDtype, hd: usize, rows: &[u8], out: &mut [f32]) {
    widen_at(SimdLevel::selected(), dtype, hd, rows, out)
}

pub(crate) fn widen_at(level: SimdLevel, dtype: KvDtype, hd: usize, rows: &[u8], out: &mut [f32]) {
    let rb = dtype.row_bytes(hd);
    assert_eq!(rows.len() / rb.max(1) * hd, out.len(), "kv widen: {} bytes of {dtype} rows of {hd} into {} values", rows.len(), out.len());
    if dtype == KvDtype::F32 {
        // The cache's f32 rows are word-aligned: a plain copy.
        return out.copy_from_slice(bytemuck::cast_slice(rows));
    }
    #[cfg(target_arch = "x86_64")]
    match level {
        SimdLevel::Avx512 if hd.is_multiple_of(16) => {
            // SAFETY: Avx512 is only selected (or passed by tests) where the CPU supports it.
            return unsafe { x512::widen(dtype, hd, rows, rb, out) };
        }
        SimdLevel::Avx2 | SimdLevel::Avx512 if hd.is_multiple_of(8) => {
            // SAFETY: as above, for AVX2 + FMA + F16C.
            return unsafe { x256::widen(dtype, hd, rows, rb, out) };
        }
        _ => {}
    }
    for (r, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(hd)) {
        stored_values(dtype, r, o);
    }
}

/// `out[t] = q · keys[t·d .. (t + 1)·d]` for every `t < out.len()` (a multiple of [`KEYS`]),
/// `d = q.len()`: a query against a widened key block.
pub(crate) fn dots(q: &[f32], keys: &[f32], out: &mut [f32]) {
    dots_at(SimdLevel::selected(), q, keys, out)
}

pub(crate) fn dots_at(level: SimdLevel, q: &[f32], keys: &[f32], out: &mut [f32]) {
    let d = q.len();
    assert!(keys.len() == out.len() * d && out.len().is_multiple_of(KEYS), "kv dots: {} key values for {} keys of {d}", keys.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    match level {
        SimdLevel::Avx512 if d.is_multiple_of(16) => {
            for (o, k) in out.chunks_exact_mut(KEYS).zip(keys.chunks_exact(KEYS * d)) {
                // SAFETY: Avx512 is only selected (or passed by tests) where the CPU supports
                // it; k holds KEYS rows of d, o KEYS values.
                unsafe { x512::dots16(q, k, o) };
            }
            return;
        }
        SimdLevel::Avx2 | SimdLevel::Avx512 => return simd::dots(q, keys, out),
        _ => {}
    }
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(d)) {
        *o = simd::dot(q, k);
    }
}

/// `acc += Σ_t p[t] · values[t·d .. (t + 1)·d]`, `d = acc.len()`: widened value rows into an
/// output row.
pub(crate) fn accumulate(acc: &mut [f32], p: &[f32], values: &[f32]) {
    accumulate_at(SimdLevel::selected(), acc, p, values)
}

pub(crate) fn accumulate_at(level: SimdLevel, acc: &mut [f32], p: &[f32], values: &[f32]) {
    let d = acc.len();
    assert_eq!(values.len(), p.len() * d, "kv accumulate: {} values for {} rows of {d}", values.len(), p.len());
    #[cfg(target_arch = "x86_64")]
    match level {
        // SAFETY: Avx512 is only selected (or passed by tests) where the CPU supports it.
        SimdLevel::Avx512 if d.is_multiple_of(16) => return unsafe { x512::accumulate(acc, p, values) },
        SimdLevel::Avx2 | SimdLevel::Avx512 => return simd::accumulate(acc, p, values),
        _ => {}
    }
    for (&pt, v) in p.iter().zip(values.chunks_exact(d)) {
        simd::axpy(acc, pt, v);
    }
}

/// The widening kernel, generated per width. `T` is the stored type (`F16`, `BF16`, `I8`
/// below), resolved at compile time.
macro_rules! widen_kernel {
    ($features:literal, $lanes:literal, $set1:ident, $mul:ident, $storeu:ident) => {
        use ferry_core::KvDtype;
        use ferry_core::kv_dtype::int8_row_scale;

        const F16: u8 = 0;
        const BF16: u8 = 1;
        const I8: u8 = 2;

        /// Bytes per value of `T`.
        const fn size(t: u8) -> usize {
            if t == I8 { 1 } else { 2 }
        }

        /// Callers checked: `hd` is a multiple of the lanes, `rows` holds `out.len() / hd` rows
        /// of `rb` bytes.
        #[target_feature(enable = $features)]
        pub(super) fn widen(dtype: KvDtype, hd: usize, rows: &[u8], rb: usize, out: &mut [f32]) {
            match dtype {
                KvDtype::F16 => widen_of::<F16>(hd, rows, rb, out),
                KvDtype::BF16 => widen_of::<BF16>(hd, rows, rb, out),
                KvDtype::Int8 => widen_of::<I8>(hd, rows, rb, out),
                KvDtype::F32 => unreachable!("f32 rows are copied"),
            }
        }

        #[target_feature(enable = $features)]
        fn widen_of<const T: u8>(hd: usize, rows: &[u8], rb: usize, out: &mut [f32]) {
            for (row, o) in rows.chunks_exact(rb).zip(out.chunks_exact_mut(hd)) {
                let scale = $set1(if T == I8 { int8_row_scale(row) } else { 1.0 });
                let mut j = 0;
                while j < hd {
                    // SAFETY: values j..j + lanes of the row lie within its rb bytes; o holds hd.
                    unsafe {
                        let v = load::<T>(row.as_ptr().add(j * size(T)));
                        $storeu(o.as_mut_ptr().add(j), if T == I8 { $mul(v, scale) } else { v });
                    }
                    j += $lanes;
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod x512 {
    use core::arch::x86_64::*;

    widen_kernel!("avx512f,avx512bw,avx512vl,avx2,fma,f16c", 16, _mm512_set1_ps, _mm512_mul_ps, _mm512_storeu_ps);

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

    /// Accumulator slot `s` takes key `SLOT_KEY[s]`: the reduction below leaves slot `s`'s sum
    /// in lane `SLOT_KEY[s]`, so the 16 sums come out in key order.
    const SLOT_KEY: [usize; 16] = [0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15];

    /// `out[t] = q · keys[t·d ..]` for 16 keys (`d = q.len()`, a multiple of 16; callers
    /// checked the lengths): one accumulator per key over d, then the 16 accumulators' lane sums
    /// in one vector, by a fixed tree of shuffles and adds.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn dots16(q: &[f32], keys: &[f32], out: &mut [f32]) {
        let d = q.len();
        let mut a = [_mm512_setzero_ps(); 16];
        let mut j = 0;
        while j < d {
            // SAFETY: j + 16 <= d; every key row holds d values.
            unsafe {
                let qv = _mm512_loadu_ps(q.as_ptr().add(j));
                for (s, a) in a.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(qv, _mm512_loadu_ps(keys.as_ptr().add(SLOT_KEY[s] * d + j)), *a);
                }
            }
            j += 16;
        }
        // Halves of 256 bits: slot i's in lanes 0-7, slot i + 8's in 8-15.
        let c: [__m512; 8] = core::array::from_fn(|i| _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(a[i], a[i + 8]), _mm512_shuffle_f32x4::<0xEE>(a[i], a[i + 8])));
        // Quarters: chunk 0 slot i, 1 slot i + 8, 2 slot i + 4, 3 slot i + 12.
        let e: [__m512; 4] = core::array::from_fn(|i| _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(c[i], c[i + 4]), _mm512_shuffle_f32x4::<0xDD>(c[i], c[i + 4])));
        // Pairs within each chunk: lanes 0, 2 of chunk k slot i's, lanes 1, 3 slot (i + 2)'s.
        let f: [__m512; 2] = core::array::from_fn(|i| _mm512_add_ps(_mm512_unpacklo_ps(e[i], e[i + 2]), _mm512_unpackhi_ps(e[i], e[i + 2])));
        let s = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(f[0], f[1]), _mm512_shuffle_ps::<0xEE>(f[0], f[1]));
        // SAFETY: out holds 16 values (callers' checks).
        unsafe { _mm512_storeu_ps(out.as_mut_ptr(), s) };
    }

    /// `acc += Σ_t p[t] · values[t·d ..]` (`d = acc.len()`, a multiple of 16; callers checked
    /// the lengths), up to 8 vectors of `acc` held in registers per pass.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    pub(super) unsafe fn accumulate(acc: &mut [f32], p: &[f32], values: &[f32]) {
        const R: usize = 8;
        let d = acc.len();
        let mut c = 0;
        while c < d {
            let w = ((d - c) / 16).min(R);
            let mut a = [_mm512_setzero_ps(); R];
            // SAFETY: columns c..c + 16w of acc and of each of the p.len() value rows exist.
            unsafe {
                for (i, a) in a.iter_mut().enumerate().take(w) {
                    *a = _mm512_loadu_ps(acc.as_ptr().add(c + 16 * i));
                }
                for (t, &pt) in p.iter().enumerate() {
                    let b = _mm512_set1_ps(pt);
                    let v = values.as_ptr().add(t * d + c);
                    for (i, a) in a.iter_mut().enumerate().take(w) {
                        *a = _mm512_fmadd_ps(b, _mm512_loadu_ps(v.add(16 * i)), *a);
                    }
                }
                for (i, a) in a.iter().enumerate().take(w) {
                    _mm512_storeu_ps(acc.as_mut_ptr().add(c + 16 * i), *a);
                }
            }
            c += 16 * w;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x256 {
    use core::arch::x86_64::*;

    widen_kernel!("avx2,fma,f16c", 8, _mm256_set1_ps, _mm256_mul_ps, _mm256_storeu_ps);

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
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::kv_dtype::{encode_row, int8_row_scale};

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
                for (d, n) in [(64, 32), (128, 16), (8, 16), (6, 16)] {
                    let (bytes, _) = rows(dtype, n, d);
                    let (mut want_rows, mut rows) = (vec![0f32; n * d], vec![0f32; n * d]);
                    widen_at(SimdLevel::Scalar, dtype, d, &bytes, &mut want_rows);
                    widen_at(level, dtype, d, &bytes, &mut rows);
                    assert_eq!(want_rows, rows, "{} {dtype} d={d}: widened rows", level.name());
                    let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin()).collect();
                    let p: Vec<f32> = (0..n).map(|i| 1.0 / (i + 1) as f32).collect();
                    let (mut want, mut got) = (vec![0f32; n], vec![0f32; n]);
                    dots_at(SimdLevel::Scalar, &q, &rows, &mut want);
                    dots_at(level, &q, &rows, &mut got);
                    for (t, (w, g)) in want.iter().zip(&got).enumerate() {
                        assert!((w - g).abs() <= 1e-4 * (1.0 + w.abs()), "{} {dtype} d={d}: dot {t} {g} vs oracle {w}", level.name());
                    }
                    let (mut want, mut got) = (vec![0.5f32; d], vec![0.5f32; d]);
                    accumulate_at(SimdLevel::Scalar, &mut want, &p, &rows);
                    accumulate_at(level, &mut got, &p, &rows);
                    for (w, g) in want.iter().zip(&got) {
                        assert!((w - g).abs() <= 1e-4 * (1.0 + w.abs()), "{} {dtype} d={d}: accumulate {g} vs oracle {w}", level.name());
                    }
                }
            }
        }
    }

    /// A key's dot is the same bits whatever the other keys of its block hold.
    #[test]
    fn a_keys_dot_does_not_depend_on_the_other_keys() {
        for level in SimdLevel::ALL.into_iter().filter(|l| l.is_supported()) {
            let d = 64;
            let (bytes, _) = rows(KvDtype::F16, KEYS, d);
            let mut keys = vec![0f32; KEYS * d];
            widen_at(level, KvDtype::F16, d, &bytes, &mut keys);
            let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.91).cos()).collect();
            let mut first = vec![0f32; KEYS];
            dots_at(level, &q, &keys, &mut first);
            for t in 0..KEYS {
                let mut other = keys.clone();
                for (u, row) in other.chunks_mut(d).enumerate() {
                    if u != t {
                        row.iter_mut().for_each(|v| *v = -*v * 3.0 + 1.0);
                    }
                }
                let mut again = vec![0f32; KEYS];
                dots_at(level, &q, &other, &mut again);
                assert_eq!(first[t].to_bits(), again[t].to_bits(), "{}: key {t}", level.name());
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
