//! `dot_rows` at every SIMD level this CPU supports, against an `f64` dot product over the exact
//! dequantization, on random data with a fixed seed.

mod common;

use common::{close, random_row, random_x, ref_dots};
use ferry_quant::{SimdLevel, WeightType, dot_rows, dot_rows_with};
use rand::SeedableRng;
use rand::rngs::StdRng;

fn levels() -> Vec<SimdLevel> {
    let (yes, no): (Vec<_>, Vec<_>) = SimdLevel::ALL.into_iter().partition(|l| l.is_supported());
    if !no.is_empty() {
        eprintln!("SIMD levels not supported by this CPU, not tested: {no:?}");
    }
    yes
}

fn check(ty: WeightType, k: usize, m: usize, rng: &mut StdRng) {
    let w = random_row(ty, k, rng);
    let x = random_x(m * k, rng);
    let want = ref_dots(ty, &w, &x, k);
    for level in levels() {
        let mut out = vec![f32::NAN; m];
        dot_rows_with(level, ty, &w, &x, &mut out);
        for (r, (&got, &want)) in out.iter().zip(&want).enumerate() {
            assert!(close(got, want), "{ty} {level:?} k {k} m {m} row {r}: got {got}, want {want:?}");
        }
    }
}

#[test]
fn every_type_and_level() {
    let mut rng = StdRng::seed_from_u64(0x5eed);
    for ty in WeightType::ALL {
        for k in [32, 256, 576, 1536] {
            if ty.row_bytes(k).is_none() {
                continue;
            }
            for m in [1, 3, 8, 16] {
                check(ty, k, m, &mut rng);
            }
        }
    }
}

#[test]
fn every_tile_combination() {
    // m = 1..=17 covers every split into tiles (16/8/4/2/1 rows) and a remainder after 16.
    let mut rng = StdRng::seed_from_u64(17);
    for ty in WeightType::ALL {
        let k = ty.block_elems().max(64);
        for m in 1..=17 {
            check(ty, k, m, &mut rng);
        }
    }
}

#[test]
fn dense_rows_with_tails() {
    // Dense rows need not be a multiple of the 32-element runs the SIMD kernels use.
    let mut rng = StdRng::seed_from_u64(3);
    for ty in [WeightType::F32, WeightType::F16, WeightType::BF16] {
        for k in [1, 7, 31, 33, 100, 577] {
            for m in [1, 2, 9] {
                check(ty, k, m, &mut rng);
            }
        }
    }
}

#[test]
fn dispatcher_uses_selected_level() {
    let mut rng = StdRng::seed_from_u64(4);
    let ty = WeightType::Q4_1;
    let (w, x) = (random_row(ty, 576, &mut rng), random_x(2 * 576, &mut rng));
    let (mut a, mut b) = ([0f32; 2], [0f32; 2]);
    dot_rows(ty, &w, &x, &mut a);
    dot_rows_with(SimdLevel::selected(), ty, &w, &x, &mut b);
    assert_eq!(a, b);
    assert_eq!(ferry_quant::simd_level(), SimdLevel::selected().name());
    assert!(SimdLevel::selected().is_supported());
}

#[test]
fn empty_out_is_a_no_op() {
    dot_rows(WeightType::Q8_0, &[], &[], &mut []);
}

#[test]
#[should_panic(expected = "not a multiple")]
fn ragged_x_panics() {
    dot_rows(WeightType::F32, &[0u8; 12], &[0f32; 7], &mut [0f32; 2]);
}

#[test]
#[should_panic(expected = "weight bytes")]
fn short_weight_row_panics() {
    dot_rows(WeightType::Q4_1, &[0u8; 19], &[0f32; 32], &mut [0f32; 1]);
}
