//! Test and benchmark data: random weight rows of every type with sane scales, random
//! activations, and an `f64` reference dot product over the exact dequantization.

#![allow(dead_code)] // each test binary uses a different subset

use ferry_quant::{WeightType, dequantize};
use half::{bf16, f16};
use rand::Rng;

/// Byte offsets of the `f16` scale fields inside one block of `ty`.
pub fn scale_offsets(ty: WeightType) -> &'static [usize] {
    match ty {
        WeightType::F32 | WeightType::F16 | WeightType::BF16 => &[],
        WeightType::Q8_0 | WeightType::Q4_0 => &[0],
        WeightType::Q4_1 | WeightType::Q4_K => &[0, 2],
        WeightType::Q6_K => &[208],
    }
}

/// Fills `w` (a whole number of blocks of `ty`) with random data: dense values in (-1, 1); for
/// quantized types random quants and `f16` scales of magnitude 1e-3..5e-2 with random sign.
pub fn fill_random(ty: WeightType, w: &mut [u8], rng: &mut impl Rng) {
    match ty {
        WeightType::F32 => {
            for c in w.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.random_range(-1.0f32..1.0).to_le_bytes());
            }
        }
        WeightType::F16 => {
            for c in w.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes());
            }
        }
        WeightType::BF16 => {
            for c in w.chunks_exact_mut(2) {
                c.copy_from_slice(&bf16::from_f32(rng.random_range(-1.0f32..1.0)).to_le_bytes());
            }
        }
        _ => {
            rng.fill_bytes(w);
            for blk in w.chunks_exact_mut(ty.block_bytes()) {
                for &o in scale_offsets(ty) {
                    let v = rng.random_range(1e-3f32..5e-2) * if rng.random_bool(0.5) { 1.0 } else { -1.0 };
                    blk[o..o + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
            }
        }
    }
}

/// A random row of `k` elements of `ty` (`k` a whole number of blocks).
pub fn random_row(ty: WeightType, k: usize, rng: &mut impl Rng) -> Vec<u8> {
    let mut w = vec![0u8; ty.row_bytes(k).expect("k must be a whole number of blocks")];
    fill_random(ty, &mut w, rng);
    w
}

/// `n` activations uniform in (-1, 1).
pub fn random_x(n: usize, rng: &mut impl Rng) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

/// `(sum x*w, sum |x*w|)` in `f64` over `dequantize(w)`, for each of the `x.len() / k` rows.
pub fn ref_dots(ty: WeightType, w: &[u8], x: &[f32], k: usize) -> Vec<(f64, f64)> {
    let mut deq = vec![0f32; k];
    dequantize(ty, w, &mut deq);
    x.chunks_exact(k)
        .map(|xr| {
            xr.iter().zip(&deq).fold((0f64, 0f64), |(s, a), (&xv, &wv)| {
                let p = f64::from(xv) * f64::from(wv);
                (s + p, a + p.abs())
            })
        })
        .collect()
}

/// Whether `got` is within the documented tolerance of the reference `(dot, abs_sum)`.
pub fn close(got: f32, (dot, abs_sum): (f64, f64)) -> bool {
    (f64::from(got) - dot).abs() <= 1e-5 * abs_sum + 1e-6
}
