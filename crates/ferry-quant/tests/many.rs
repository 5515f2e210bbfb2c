//! `dot_many` (a range of rows in one call) equals `dot_rows` row by row.

use ferry_quant::{dot_many, dot_rows, WeightType};

#[test]
fn dot_many_equals_row_by_row() {
    for ty in [WeightType::F32, WeightType::F16, WeightType::BF16, WeightType::Q8_0, WeightType::Q4_0, WeightType::Q4_1, WeightType::Q4_K, WeightType::Q6_K] {
        let k = 512;
        let rb = ty.row_bytes(k).unwrap();
        let n = 5;
        // Deterministic bytes; f16 scales kept finite by masking the exponent's top bits.
        let w: Vec<u8> = (0..n * rb).map(|i| ((i * 2654435761usize) >> 7) as u8 & 0x3b).collect();
        for m in [1, 3, 8] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i as f32) * 0.37).sin()).collect();
            let mut many = vec![0f32; n * m];
            dot_many(ty, &w, k, &x, &mut many);
            for r in 0..n {
                let mut one = vec![0f32; m];
                dot_rows(ty, &w[r * rb..(r + 1) * rb], &x, &mut one);
                assert_eq!(&many[r * m..(r + 1) * m], &one[..], "{ty:?} m={m} row {r}");
            }
        }
    }
}
