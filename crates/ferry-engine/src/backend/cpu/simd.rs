//! Small f32 vector kernels for the attention and elementwise paths: AVX2+FMA when the CPU has it
//! (detected once), a portable fallback otherwise. Matmul kernels live in `ferry-quant`.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::sync::OnceLock;

fn has_avx2() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    #[cfg(target_arch = "x86_64")]
    {
        *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        *HAS.get_or_init(|| false)
    }
}

/// Σ a[i]·b[i].
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time; lengths are equal (asserted).
        return unsafe { dot_avx2(a, b) };
    }
    dot_scalar(a, b)
}

/// y[i] += alpha·x[i].
#[inline]
pub fn axpy(y: &mut [f32], alpha: f32, x: &[f32]) {
    assert_eq!(y.len(), x.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time; lengths are equal (asserted).
        return unsafe { axpy_avx2(y, alpha, x) };
    }
    for (y, x) in y.iter_mut().zip(x) {
        *y += alpha * x;
    }
}

/// `out[t] = q · keys[t*d .. (t+1)*d]` for `t < out.len()`, `d = q.len()`: one query against a run
/// of contiguous key rows (a KV block). Four keys per pass share the loads of `q`.
#[inline]
pub fn dots(q: &[f32], keys: &[f32], out: &mut [f32]) {
    let d = q.len();
    assert_eq!(keys.len(), out.len() * d, "dots: {} key values for {} rows of {d}", keys.len(), out.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && d.is_multiple_of(8) {
        // SAFETY: AVX2 and FMA were detected at run time; lengths checked above.
        return unsafe { dots_avx2(q, keys, out) };
    }
    for (o, k) in out.iter_mut().zip(keys.chunks_exact(d)) {
        *o = dot(q, k);
    }
}

/// `acc += Σ_t p[t] · values[t*d .. (t+1)*d]`, `d = acc.len()`: the value side of attention over
/// a run of contiguous value rows, with `acc` held in registers across the run.
#[inline]
pub fn accumulate(acc: &mut [f32], p: &[f32], values: &[f32]) {
    let d = acc.len();
    assert_eq!(values.len(), p.len() * d, "accumulate: {} values for {} rows of {d}", values.len(), p.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2() && d.is_multiple_of(8) {
        // SAFETY: AVX2 and FMA were detected at run time; lengths checked above.
        return unsafe { accumulate_avx2(acc, p, values) };
    }
    for (&pt, v) in p.iter().zip(values.chunks_exact(d)) {
        axpy(acc, pt, v);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dots_avx2(q: &[f32], keys: &[f32], out: &mut [f32]) {
    let d = q.len();
    let n = out.len();
    let (pq, pk) = (q.as_ptr(), keys.as_ptr());
    let mut t = 0;
    // SAFETY: d is a multiple of 8 and keys holds n rows of d (callers' checks), so every load
    // below (rows t..t + 4 < n, columns j..j + 8 <= d) is in bounds.
    unsafe {
        while t + 4 <= n {
            let k = pk.add(t * d);
            let mut a = [_mm256_setzero_ps(); 4];
            let mut j = 0;
            while j < d {
                let qv = _mm256_loadu_ps(pq.add(j));
                for (r, a) in a.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k.add(r * d + j)), *a);
                }
                j += 8;
            }
            out[t..t + 4].copy_from_slice(&hsum4_avx2(a));
            t += 4;
        }
    }
    while t < n {
        // SAFETY: as above; row t < n.
        out[t] = unsafe { dot_avx2(q, std::slice::from_raw_parts(pk.add(t * d), d)) };
        t += 1;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn accumulate_avx2(acc: &mut [f32], p: &[f32], values: &[f32]) {
    const W: usize = 8; // vectors of acc per pass (64 floats)
    let d = acc.len();
    let (pa, pv) = (acc.as_mut_ptr(), values.as_ptr());
    let mut c = 0;
    // SAFETY: d is a multiple of 8 and values holds p.len() rows of d (callers' checks): columns
    // c..c + 8w <= d of rows t < p.len() are in bounds, as are acc[c..c + 8w].
    unsafe {
        while c < d {
            let w = ((d - c) / 8).min(W);
            let mut a = [_mm256_setzero_ps(); W];
            for (i, a) in a.iter_mut().enumerate().take(w) {
                *a = _mm256_loadu_ps(pa.add(c + 8 * i));
            }
            for (t, &pt) in p.iter().enumerate() {
                let b = _mm256_set1_ps(pt);
                let v = pv.add(t * d + c);
                for (i, a) in a.iter_mut().enumerate().take(w) {
                    *a = _mm256_fmadd_ps(b, _mm256_loadu_ps(v.add(8 * i)), *a);
                }
            }
            for (i, a) in a.iter().enumerate().take(w) {
                _mm256_storeu_ps(pa.add(c + 8 * i), *a);
            }
            c += 8 * w;
        }
    }
}

/// `v = softmax(scale · v)` in place (`scale > 0`): the maximum is subtracted before the
/// exponential, as in every exact softmax. Vectorized passes on the AVX2 path (max, exp, sum,
/// normalize); an empty `v` is left alone.
pub fn softmax_scaled(v: &mut [f32], scale: f32) {
    if v.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time.
        unsafe { scale_sub_max_avx2(v, scale) };
        exp_inplace(v);
        // SAFETY: as above.
        unsafe { normalize_avx2(v) };
        return;
    }
    let max = v.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) * scale;
    v.iter_mut().for_each(|x| *x = *x * scale - max);
    exp_inplace(v);
    let inv = 1.0 / v.iter().sum::<f32>();
    v.iter_mut().for_each(|x| *x *= inv);
}

/// `v[i] = v[i] * scale - max(v) * scale` (for `scale > 0`, `max(v · scale)` is `max(v) · scale`
/// exactly: rounding is monotonic).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn scale_sub_max_avx2(v: &mut [f32], scale: f32) {
    let n = v.len();
    let p = v.as_mut_ptr();
    // SAFETY: every vector access below is at i + 8 <= n (loop conditions).
    unsafe {
        let mut m = [_mm256_set1_ps(f32::NEG_INFINITY); 2];
        let mut i = 0;
        while i + 16 <= n {
            m[0] = _mm256_max_ps(m[0], _mm256_loadu_ps(p.add(i)));
            m[1] = _mm256_max_ps(m[1], _mm256_loadu_ps(p.add(i + 8)));
            i += 16;
        }
        if i + 8 <= n {
            m[0] = _mm256_max_ps(m[0], _mm256_loadu_ps(p.add(i)));
            i += 8;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_max_ps(m[0], m[1]));
        let max = lanes.iter().chain(&v[i..]).fold(f32::NEG_INFINITY, |a, &x| a.max(x)) * scale;
        let (vs, vm) = (_mm256_set1_ps(scale), _mm256_set1_ps(max));
        let mut j = 0;
        while j + 8 <= n {
            _mm256_storeu_ps(p.add(j), _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p.add(j)), vs), vm));
            j += 8;
        }
        v[j..].iter_mut().for_each(|x| *x = *x * scale - max);
    }
}

/// `v /= sum(v)`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn normalize_avx2(v: &mut [f32]) {
    let n = v.len();
    let p = v.as_mut_ptr();
    // SAFETY: every vector access below is at i + 8 <= n (loop conditions).
    unsafe {
        let mut a = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (k, a) in a.iter_mut().enumerate() {
                *a = _mm256_add_ps(*a, _mm256_loadu_ps(p.add(i + 8 * k)));
            }
            i += 32;
        }
        while i + 8 <= n {
            a[0] = _mm256_add_ps(a[0], _mm256_loadu_ps(p.add(i)));
            i += 8;
        }
        let sum = hsum_avx2(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]))) + v[i..].iter().sum::<f32>();
        let inv = 1.0 / sum;
        let vi = _mm256_set1_ps(inv);
        let mut j = 0;
        while j + 8 <= n {
            _mm256_storeu_ps(p.add(j), _mm256_mul_ps(_mm256_loadu_ps(p.add(j)), vi));
            j += 8;
        }
        v[j..].iter_mut().for_each(|x| *x *= inv);
    }
}

/// v[i] = exp(v[i]) (relative error ~2e-7 on the AVX2 path: Cephes' polynomial after range
/// reduction by ln 2; inputs below -87.3 give ~1e-38 instead of a subnormal or 0).
#[inline]
pub fn exp_inplace(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time.
        return unsafe { exp_avx2(v) };
    }
    v.iter_mut().for_each(|x| *x = x.exp());
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_avx2(v: &mut [f32]) {
    let n = v.len();
    let p = v.as_mut_ptr();
    let mut i = 0;
    // SAFETY: i + 8 <= n before each unaligned load/store of 8 floats; features enabled above.
    unsafe {
        while i + 8 <= n {
            _mm256_storeu_ps(p.add(i), exp8(_mm256_loadu_ps(p.add(i))));
            i += 8;
        }
    }
    v[i..].iter_mut().for_each(|x| *x = x.exp());
}

/// exp of 8 lanes: [`exp_inplace`]'s vector path.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
fn exp8(x: __m256) -> __m256 {
    let (hi, lo) = (_mm256_set1_ps(88.37), _mm256_set1_ps(-87.33));
    let log2e = _mm256_set1_ps(std::f32::consts::LOG2_E);
    let (ln2_hi, ln2_lo) = (_mm256_set1_ps(0.693_359_4), _mm256_set1_ps(-2.121_944_4e-4));
    let c = [1.987_569_1e-4f32, 1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5].map(|c| _mm256_set1_ps(c));
    let one = _mm256_set1_ps(1.0);
    let x = _mm256_max_ps(_mm256_min_ps(x, hi), lo);
    let k = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, log2e));
    let r = _mm256_fnmadd_ps(k, ln2_lo, _mm256_fnmadd_ps(k, ln2_hi, x));
    let mut y = c[0];
    for &cc in &c[1..] {
        y = _mm256_fmadd_ps(y, r, cc);
    }
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, one));
    let scale = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)));
    _mm256_mul_ps(y, _mm256_castsi256_ps(scale))
}

/// `g[i] = g[i] / (1 + exp(-g[i])) · u[i]`: SiLU of the gate times the up projection, with
/// [`exp_inplace`]'s exp, in one pass.
pub fn silu_mul(g: &mut [f32], u: &[f32]) {
    assert_eq!(g.len(), u.len(), "silu_mul: {} gate values, {} up values", g.len(), u.len());
    let mut i = 0;
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: AVX2 and FMA were detected at run time; lengths checked above.
        i = unsafe { silu_mul_avx2(g, u) };
    }
    for (g, u) in g[i..].iter_mut().zip(&u[i..]) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// The whole vectors of [`silu_mul`]; returns where the rest starts.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(g: &mut [f32], u: &[f32]) -> usize {
    let (n, pg, pu) = (g.len(), g.as_mut_ptr(), u.as_ptr());
    let one = _mm256_set1_ps(1.0);
    let mut i = 0;
    // SAFETY: i + 8 <= n = u.len() before each load and store of 8 floats.
    unsafe {
        while i + 8 <= n {
            let x = _mm256_loadu_ps(pg.add(i));
            let e = exp8(_mm256_xor_ps(x, _mm256_set1_ps(-0.0)));
            _mm256_storeu_ps(pg.add(i), _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(pu.add(i))));
            i += 8;
        }
    }
    i
}

/// Turn each row of `hd` values in `x` (`x.len()` a multiple of `hd`) by the normalized
/// Walsh-Hadamard transform, bit for bit as `ferry_core::kv_dtype::hadamard` (the definition):
/// the same butterflies in the same stage order, each one rounding, then the same product.
pub fn hadamard_rows(x: &mut [f32], hd: usize) {
    assert!(hd > 0 && x.len().is_multiple_of(hd), "hadamard_rows: {} values in rows of {hd}", x.len());
    #[cfg(target_arch = "x86_64")]
    {
        let n = ferry_core::kv_dtype::hadamard_width(hd);
        if has_avx2() && n >= 8 {
            // SAFETY: AVX2 and FMA were detected at run time; x is whole segments of n values
            // (n divides hd, which divides x.len()), n a multiple of 8.
            return unsafe { hadamard_avx2(x, n) };
        }
    }
    x.chunks_exact_mut(hd).for_each(ferry_core::kv_dtype::hadamard);
}

/// [`hadamard_rows`] on segments of `n` values (a power of two, at least 8). Stages 1, 2 and 4
/// pair lanes inside one vector: `v·sign + swapped(v)` gives `a + b` in the first lane of each
/// pair and `a − b` in the second with one rounding each (the product by ±1 is exact); stages of
/// 8 and more pair whole vectors.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hadamard_avx2(x: &mut [f32], n: usize) {
    let norm = _mm256_set1_ps(1.0 / (n as f32).sqrt());
    let s1 = _mm256_setr_ps(1.0, -1.0, 1.0, -1.0, 1.0, -1.0, 1.0, -1.0);
    let s2 = _mm256_setr_ps(1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0);
    let s4 = _mm256_setr_ps(1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0);
    for seg in x.chunks_exact_mut(n) {
        let p = seg.as_mut_ptr();
        // SAFETY (all loads and stores below): offsets stay below n, within seg.
        unsafe {
            for c in (0..n).step_by(8) {
                let mut v = _mm256_loadu_ps(p.add(c));
                v = _mm256_fmadd_ps(v, s1, _mm256_permute_ps::<0b10_11_00_01>(v));
                v = _mm256_fmadd_ps(v, s2, _mm256_permute_ps::<0b01_00_11_10>(v));
                v = _mm256_fmadd_ps(v, s4, _mm256_permute2f128_ps::<0x01>(v, v));
                _mm256_storeu_ps(p.add(c), v);
            }
            let mut h = 8;
            while h < n {
                for base in (0..n).step_by(2 * h) {
                    for c in (base..base + h).step_by(8) {
                        let (a, b) = (_mm256_loadu_ps(p.add(c)), _mm256_loadu_ps(p.add(c + h)));
                        _mm256_storeu_ps(p.add(c), _mm256_add_ps(a, b));
                        _mm256_storeu_ps(p.add(c + h), _mm256_sub_ps(a, b));
                    }
                }
                h *= 2;
            }
            for c in (0..n).step_by(8) {
                _mm256_storeu_ps(p.add(c), _mm256_mul_ps(_mm256_loadu_ps(p.add(c)), norm));
            }
        }
    }
}

fn dot_scalar(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for j in 0..8 {
            acc[j] += a[c * 8 + j] * b[c * 8 + j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: callers guarantee AVX2+FMA; every load below is bounds-checked by its loop condition.
    unsafe {
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    let mut acc0 = _mm256_setzero_ps();
    let mut acc1 = _mm256_setzero_ps();
    let mut i = 0;
    // SAFETY (all loads below): i + 16 <= n or i + 8 <= n is checked before each unaligned load.
    while i + 16 <= n {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8)), _mm256_loadu_ps(pb.add(i + 8)), acc1);
        i += 16;
    }
    while i + 8 <= n {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
        i += 8;
    }
    let mut s = hsum_avx2(_mm256_add_ps(acc0, acc1));
    while i < n {
        s += a[i] * b[i];
        i += 1;
    }
    s
    }
}

/// Sum of the eight lanes.
/// The lane sums of four vectors, reduced together.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn hsum4_avx2(a: [__m256; 4]) -> [f32; 4] {
    // [a0 a0 a1 a1 | a0 a0 a1 a1] pairs, then [a0 a1 a2 a3 | ...]: lane sums of each a.
    let h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    let mut s = [0f32; 4];
    // SAFETY: s holds four floats.
    unsafe { _mm_storeu_ps(s.as_mut_ptr(), _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h))) };
    s
}

#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn hsum_avx2(v: __m256) -> f32 {
    let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn axpy_avx2(y: &mut [f32], alpha: f32, x: &[f32]) {
    // SAFETY: callers guarantee AVX2+FMA; every access below is bounds-checked by its loop condition.
    unsafe {
    let n = y.len();
    let (py, px) = (y.as_mut_ptr(), x.as_ptr());
    let va = _mm256_set1_ps(alpha);
    let mut i = 0;
    // SAFETY: i + 8 <= n is checked before each unaligned load/store; x and y have length n.
    while i + 8 <= n {
        let r = _mm256_fmadd_ps(va, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)));
        _mm256_storeu_ps(py.add(i), r);
        i += 8;
    }
    while i < n {
        y[i] += alpha * x[i];
        i += 1;
    }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hadamard_rows_are_the_definitions_bit_for_bit() {
        // 64 and 128: whole rows; 96: segments of 32; 8; 6: segments of 2 (the scalar path).
        for hd in [64usize, 128, 96, 8, 6] {
            let x: Vec<f32> = (0..hd * 5).map(|i| ((i as f32 * 0.731).sin() * 3.0) * if i % 11 == 0 { 20.0 } else { 1.0 }).collect();
            let mut got = x.clone();
            hadamard_rows(&mut got, hd);
            let mut want = x.clone();
            want.chunks_exact_mut(hd).for_each(ferry_core::kv_dtype::hadamard);
            assert!(got.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()), "head_dim {hd}");
        }
    }

    #[test]
    fn exp_matches_libm() {
        let mut v: Vec<f32> = (0..2001).map(|i| -87.0 + i as f32 * 0.0875).collect();
        v.extend([0.0, -1e-30, 1e-30, 0.5, -0.5]);
        let want: Vec<f32> = v.iter().map(|x| x.exp()).collect();
        exp_inplace(&mut v);
        for (i, (g, w)) in v.iter().zip(&want).enumerate() {
            let tol = 4e-7 * w.abs();
            assert!((g - w).abs() <= tol, "exp at {i}: {g} vs {w}");
        }
        // Far below the range: (almost) zero, never NaN or negative.
        let mut tiny = vec![-1000.0f32; 9];
        exp_inplace(&mut tiny);
        assert!(tiny.iter().all(|&x| (0.0..1e-37).contains(&x)));
    }

    /// The fused pass gives the bits of its definition: negate, exp as `exp_inplace`, divide,
    /// multiply (a vector's worth and a tail).
    #[test]
    fn silu_mul_is_its_definition_bit_for_bit() {
        let g: Vec<f32> = (0..35).map(|i| (i as f32 - 17.0) * 0.61).chain([0.0, -0.0, 90.0, -90.0]).collect();
        let u: Vec<f32> = (0..g.len()).map(|i| (i as f32 * 0.3).cos()).collect();
        let mut e: Vec<f32> = g.iter().map(|x| -x).collect();
        exp_inplace(&mut e);
        let want: Vec<f32> = g.iter().zip(&u).zip(&e).map(|((g, u), e)| g / (1.0 + e) * u).collect();
        let mut got = g.clone();
        silu_mul(&mut got, &u);
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "value {i}: {a} vs {b}");
        }
    }

    #[test]
    fn block_dots_and_accumulate_match_scalar() {
        for d in [8, 64, 72, 128, 6] {
            for n in [1, 3, 4, 5, 16] {
                let q: Vec<f32> = (0..d).map(|i| (i as f32 * 0.37).sin()).collect();
                let kv: Vec<f32> = (0..n * d).map(|i| (i as f32 * 0.11).cos()).collect();
                let mut got = vec![0f32; n];
                dots(&q, &kv, &mut got);
                for (t, g) in got.iter().enumerate() {
                    let want: f64 = q.iter().zip(&kv[t * d..(t + 1) * d]).map(|(a, b)| *a as f64 * *b as f64).sum();
                    assert!((*g as f64 - want).abs() < 1e-5, "dots d={d} n={n} t={t}: {g} vs {want}");
                }
                let p: Vec<f32> = (0..n).map(|t| 0.1 + t as f32 * 0.05).collect();
                let mut acc: Vec<f32> = (0..d).map(|i| i as f32 * 0.01).collect();
                let want: Vec<f64> = (0..d).map(|i| i as f64 * 0.01f32 as f64 + (0..n).map(|t| p[t] as f64 * kv[t * d + i] as f64).sum::<f64>()).collect();
                accumulate(&mut acc, &p, &kv);
                for i in 0..d {
                    assert!((acc[i] as f64 - want[i]).abs() < 1e-5, "accumulate d={d} n={n} i={i}");
                }
            }
        }
    }

    #[test]
    fn softmax_matches_f64() {
        for n in [1, 5, 8, 17, 40, 130] {
            let v: Vec<f32> = (0..n).map(|i| ((i * 7919 % 97) as f32 - 40.0) * 0.37).collect();
            let scale = 0.125f32;
            let m = v.iter().map(|&x| x as f64 * scale as f64).fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = v.iter().map(|&x| (x as f64 * scale as f64 - m).exp()).collect();
            let total: f64 = e.iter().sum();
            let mut got = v.clone();
            softmax_scaled(&mut got, scale);
            for (i, (g, w)) in got.iter().zip(&e).enumerate() {
                let w = w / total;
                assert!((*g as f64 - w).abs() <= 2e-6 * w + 1e-9, "n={n} i={i}: {g} vs {w}");
            }
        }
        let mut empty: [f32; 0] = [];
        softmax_scaled(&mut empty, 1.0);
    }

    #[test]
    fn dot_and_axpy_match_scalar() {
        for n in [1, 7, 8, 15, 16, 17, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            assert!((dot(&a, &b) as f64 - want).abs() < 1e-5, "n={n}");
            let mut y = b.clone();
            axpy(&mut y, 0.5, &a);
            for i in 0..n {
                assert!((y[i] - (b[i] + 0.5 * a[i])).abs() < 1e-6);
            }
        }
    }
}
