//! 8-bit activations: quantization bounds, and `dot_many_q8` at every SIMD level against an `f64`
//! dot product of the exact weights with the dequantized activations.

mod common;

use common::{random_row, random_x};
use ferry_quant::{Q8Activations, SimdLevel, WeightType, dequantize, dot_many_q8, dot_many_q8_with, supports_q8};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const TYPES: [WeightType; 3] = [WeightType::Q8_0, WeightType::Q4_0, WeightType::Q4_1];

fn levels() -> Vec<SimdLevel> {
    SimdLevel::ALL.into_iter().filter(|l| l.is_supported()).collect()
}

/// Standard normal values (Box-Muller).
fn normal(n: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let (u, v): (f64, f64) = (rng.random_range(f64::EPSILON..1.0), rng.random());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        })
        .collect()
}

/// `d * q` for every element.
fn dequantized(xq: &Q8Activations) -> Vec<f32> {
    xq.quants().iter().enumerate().map(|(j, &q)| xq.scales()[j / 32] * f32::from(q)).collect()
}

#[test]
fn quantize_bounds_and_sums() {
    let mut rng = StdRng::seed_from_u64(1);
    let mut x = normal(3 * 576, &mut rng);
    x[32..64].fill(0.0); // an all-zero block
    let xq = Q8Activations::quantize(&x, 576);
    assert_eq!((xq.rows(), xq.k(), xq.quants().len(), xq.scales().len()), (3, 576, 3 * 576, 3 * 18));
    for (b, xs) in x.chunks_exact(32).enumerate() {
        let (d, q) = (xq.scales()[b], &xq.quants()[32 * b..32 * b + 32]);
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        assert_eq!(d, amax / 127.0);
        for (&x, &q) in xs.iter().zip(q) {
            assert!((x - d * f32::from(q)).abs() <= d * 0.5 * (1.0 + 1e-6), "block {b}: x {x}, d {d}, q {q}");
        }
        let sum: i32 = q.iter().map(|&q| i32::from(q)).sum();
        assert_eq!(xq.sums()[b], d * sum as f32);
    }
    assert!(xq.quants()[32..64].iter().all(|&q| q == 0) && xq.scales()[1] == 0.0);
    // Reusing buffers that held other shapes gives the same result.
    let mut again = Q8Activations::quantize(&normal(5 * 64, &mut rng), 64);
    again.quantize_into(&x, 576);
    assert_eq!((again.quants(), again.scales(), again.sums()), (xq.quants(), xq.scales(), xq.sums()));
}

#[test]
fn quantize_matches_reference_rounding() {
    // Values that scale to exact halves and to just below them: round half away from zero.
    let mut x = vec![0f32; 32];
    x[0] = 127.0;
    x[1] = 2.5;
    x[2] = -2.5;
    x[3] = 0.49999997;
    x[4] = -0.5;
    let xq = Q8Activations::quantize(&x, 32);
    assert_eq!(xq.scales()[0], 1.0);
    assert_eq!(&xq.quants()[..5], &[127, 3, -3, 0, -1]);
}

fn check(ty: WeightType, k: usize, m: usize, rng: &mut StdRng) {
    let n = 5;
    let mut w = Vec::new();
    for _ in 0..n {
        w.extend(random_row(ty, k, rng));
    }
    let x = random_x(m * k, rng);
    let xq = Q8Activations::quantize(&x, k);
    let xh = dequantized(&xq);
    let rb = ty.row_bytes(k).unwrap();
    let mut deq = vec![0f32; k];
    for level in levels() {
        let mut out = vec![f32::NAN; n * m];
        dot_many_q8_with(level, ty, &w, &xq, &mut out);
        for r in 0..n {
            dequantize(ty, &w[r * rb..(r + 1) * rb], &mut deq);
            for (i, xr) in xh.chunks_exact(k).enumerate() {
                let (dot, abs) = xr.iter().zip(&deq).fold((0f64, 0f64), |(s, a), (&x, &w)| {
                    let p = f64::from(x) * f64::from(w);
                    (s + p, a + p.abs())
                });
                let got = out[r * m + i];
                assert!((f64::from(got) - dot).abs() <= 1e-5 * abs + 1e-6, "{ty} {level:?} k {k} m {m} row {r} act {i}: got {got}, want {dot}");
            }
        }
    }
}

#[test]
fn integer_dot_is_exact_up_to_scale_rounding() {
    let mut rng = StdRng::seed_from_u64(0x98);
    for ty in TYPES {
        assert!(supports_q8(ty));
        for k in [32, 576, 1536, 4096] {
            for m in [1, 3, 8] {
                check(ty, k, m, &mut rng);
            }
        }
    }
}

#[test]
fn every_tile_combination() {
    let mut rng = StdRng::seed_from_u64(5);
    for ty in TYPES {
        for m in 1..=17 {
            check(ty, 96, m, &mut rng);
        }
    }
}

#[test]
fn quantization_error_is_small() {
    let mut rng = StdRng::seed_from_u64(9);
    let k = 1536;
    for ty in TYPES {
        let w = random_row(ty, k, &mut rng);
        let mut deq = vec![0f32; k];
        dequantize(ty, &w, &mut deq);
        let x = normal(4 * k, &mut rng);
        let mut out = [0f32; 4];
        dot_many_q8(ty, &w, &Q8Activations::quantize(&x, k), &mut out);
        for (xr, &got) in x.chunks_exact(k).zip(&out) {
            let (dot, abs) = xr.iter().zip(&deq).fold((0f64, 0f64), |(s, a), (&x, &w)| {
                let p = f64::from(x) * f64::from(w);
                (s + p, a + p.abs())
            });
            assert!((f64::from(got) - dot).abs() <= 2e-2 * abs, "{ty}: got {got}, want {dot} (sum |w x| {abs})");
        }
    }
}

#[test]
fn unsupported_types() {
    for ty in [WeightType::F32, WeightType::F16, WeightType::BF16, WeightType::Q4_K, WeightType::Q6_K] {
        assert!(!supports_q8(ty));
    }
}

#[test]
#[should_panic(expected = "not supported")]
fn unsupported_type_panics() {
    let xq = Q8Activations::quantize(&[0f32; 256], 256);
    dot_many_q8(WeightType::Q4_K, &[0u8; 144], &xq, &mut [0f32; 1]);
}

#[test]
#[should_panic(expected = "do not fit")]
fn ragged_weights_panic() {
    let xq = Q8Activations::quantize(&[0f32; 64], 64);
    dot_many_q8(WeightType::Q4_1, &[0u8; 39], &xq, &mut [0f32; 1]);
}

#[test]
#[should_panic(expected = "multiple of 32")]
fn bad_k_panics() {
    Q8Activations::quantize(&[0f32; 48], 48);
}
