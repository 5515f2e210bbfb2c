//! Property tests: arbitrary bytes (any f16 scale, NaN and infinity included) never make
//! `dequantize` or `dot_rows` panic; every SIMD level dequantizes to the reference's bits, and its
//! `dot_rows` agrees with the reference wherever the reference is finite.

mod common;

use common::{close, ref_dots};
use ferry_quant::{SimdLevel, WeightType, dequantize_with, dot_rows_with};
use proptest::prelude::*;

/// (type, k, m, weight bytes, activations).
fn case() -> impl Strategy<Value = (WeightType, usize, usize, Vec<u8>, Vec<f32>)> {
    (0..WeightType::ALL.len(), 1usize..=6, 1usize..=17)
        .prop_flat_map(|(t, n, m)| {
            let ty = WeightType::ALL[t];
            // Quantized: n whole blocks; dense: 1..=6 runs of 37 elements (exercises tails).
            let k = if ty.block_elems() == 1 { 37 * n } else { ty.block_elems() * n };
            let bytes = ty.row_bytes(k).unwrap_or(0);
            (
                Just(ty),
                Just(k),
                Just(m),
                proptest::collection::vec(any::<u8>(), bytes),
                proptest::collection::vec(-100f32..100f32, m * k),
            )
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_blocks((ty, k, m, w, x) in case()) {
        let mut want_w = vec![0f32; k];
        dequantize_with(SimdLevel::Scalar, ty, &w, &mut want_w);
        let want = ref_dots(ty, &w, &x, k);
        for level in SimdLevel::ALL.into_iter().filter(|l| l.is_supported()) {
            let mut got_w = vec![0f32; k];
            dequantize_with(level, ty, &w, &mut got_w);
            for (g, e) in got_w.iter().zip(&want_w) {
                prop_assert!(g.to_bits() == e.to_bits() || (g.is_nan() && e.is_nan()), "{} {:?}: {} != {}", ty, level, g, e);
            }
            let mut out = vec![0f32; m];
            dot_rows_with(level, ty, &w, &x, &mut out);
            for (r, (&got, &want)) in out.iter().zip(&want).enumerate() {
                // Compare only where the reference is finite and far from f32 overflow.
                if want.0.is_finite() && want.1 < 1e30 {
                    prop_assert!(close(got, want), "{} {:?} k {} m {} row {}: got {}, want {:?}", ty, level, k, m, r, got, want);
                }
            }
        }
    }
}
