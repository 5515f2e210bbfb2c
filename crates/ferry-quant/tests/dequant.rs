//! Scalar dequantization of hand-built blocks against values worked out by hand, every SIMD
//! level against the scalar reference bit for bit, and the `WeightType` table.

mod common;

use ferry_quant::{SimdLevel, WeightType, dequantize, dequantize_with};
use half::f16;
use rand::SeedableRng;
use rand::rngs::StdRng;

fn f16b(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_le_bytes()
}

/// Dequantizes with the scalar reference, checks that every supported SIMD level gives the same
/// bits, and returns the values.
fn deq(ty: WeightType, src: &[u8], n: usize) -> Vec<f32> {
    let mut want = vec![f32::NAN; n];
    dequantize_with(SimdLevel::Scalar, ty, src, &mut want);
    for level in SimdLevel::ALL.into_iter().filter(|l| l.is_supported()) {
        let mut got = vec![f32::NAN; n];
        dequantize_with(level, ty, src, &mut got);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()), "{ty} {level:?} element {i}: {g} != {w}");
        }
    }
    let mut dispatched = vec![f32::NAN; n];
    dequantize(ty, src, &mut dispatched);
    assert_eq!(dispatched, want);
    want
}

#[test]
fn simd_levels_match_scalar_on_random_rows() {
    let mut rng = StdRng::seed_from_u64(11);
    for ty in WeightType::ALL {
        for k in [32, 256, 576, 1536, 37, 5] {
            if ty.row_bytes(k).is_some() {
                deq(ty, &common::random_row(ty, k, &mut rng), k);
            }
        }
    }
}

#[test]
fn type_table() {
    use WeightType::*;
    let want = [
        (F32, 1, 4, "f32"),
        (F16, 1, 2, "f16"),
        (BF16, 1, 2, "bf16"),
        (Q8_0, 32, 34, "q8_0"),
        (Q4_0, 32, 18, "q4_0"),
        (Q4_1, 32, 20, "q4_1"),
        (Q4_K, 256, 144, "q4_k"),
        (Q6_K, 256, 210, "q6_k"),
    ];
    for (ty, elems, bytes, name) in want {
        assert_eq!((ty.block_elems(), ty.block_bytes(), ty.name()), (elems, bytes, name));
        assert_eq!(ty.to_string(), name);
        assert_eq!(ty.row_bytes(0), Some(0));
        assert_eq!(ty.row_bytes(elems * 18), Some(bytes * 18));
    }
    assert_eq!(Q4_1.row_bytes(576), Some(360));
    assert_eq!(Q8_0.row_bytes(33), None);
    assert_eq!(Q4_K.row_bytes(576), None);
    assert_eq!(F16.row_bytes(7), Some(14));
    assert_eq!(F32.row_bytes(usize::MAX / 2), None); // overflow
}

#[test]
fn dense() {
    let mut src = Vec::new();
    for v in [1.5f32, -0.0, 3.25e-3] {
        src.extend_from_slice(&v.to_le_bytes());
    }
    assert_eq!(deq(WeightType::F32, &src, 3), [1.5, -0.0, 3.25e-3]);
    // f16: 0x3C00 = 1.0, 0xC000 = -2.0, 0x0001 = 2^-24 (smallest subnormal), 0x7BFF = 65504.
    let src = [0x00, 0x3C, 0x00, 0xC0, 0x01, 0x00, 0xFF, 0x7B];
    assert_eq!(deq(WeightType::F16, &src, 4), [1.0, -2.0, 2f32.powi(-24), 65504.0]);
    // bf16: 0x3F80 = 1.0, 0xC0A0 = -5.0, 0x3E20 = 0.15625.
    let src = [0x80, 0x3F, 0xA0, 0xC0, 0x20, 0x3E];
    assert_eq!(deq(WeightType::BF16, &src, 3), [1.0, -5.0, 0.15625]);
}

#[test]
fn q8_0() {
    // d = 0.5; qs = [-128, -1, 0, 1, 127, then 5..32].
    let mut b = f16b(0.5).to_vec();
    let qs: Vec<i8> = [-128i8, -1, 0, 1, 127].into_iter().chain(5..32).collect();
    b.extend(qs.iter().map(|&q| q as u8));
    let y = deq(WeightType::Q8_0, &b, 32);
    assert_eq!(y[..5], [-64.0, -0.5, 0.0, 0.5, 63.5]);
    assert_eq!(y[31], 15.5);
}

#[test]
fn q4_0() {
    // d = 2; byte j holds low nibble j and high nibble 15 - j.
    let mut b = f16b(2.0).to_vec();
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    let y = deq(WeightType::Q4_0, &b, 32);
    // element j = 2 * (j - 8); element 16 + j = 2 * (15 - j - 8).
    assert_eq!(y[0], -16.0);
    assert_eq!(y[8], 0.0);
    assert_eq!(y[15], 14.0);
    assert_eq!(y[16], 14.0);
    assert_eq!(y[31], -16.0);
    for j in 0..16 {
        assert_eq!(y[j], 2.0 * (j as f32 - 8.0));
        assert_eq!(y[16 + j], 2.0 * (7.0 - j as f32));
    }
}

#[test]
fn q4_1() {
    // d = 0.25, m = -1.5; byte j holds low nibble j and high nibble 15 - j.
    let mut b = f16b(0.25).to_vec();
    b.extend(f16b(-1.5));
    b.extend((0..16u8).map(|j| j | ((15 - j) << 4)));
    // Two blocks: the second with d = 3, m = 0.1 (f16(0.1) = 1638 / 2^14) and all nibbles 15.
    b.extend(f16b(3.0));
    b.extend(f16b(0.1));
    b.extend([0xFF; 16]);
    let y = deq(WeightType::Q4_1, &b, 64);
    assert_eq!(y[0], -1.5);
    assert_eq!(y[1], -1.25);
    assert_eq!(y[15], 2.25);
    assert_eq!(y[16], 2.25);
    assert_eq!(y[31], -1.5);
    let m = 1638.0 / 16384.0;
    assert_eq!(y[32], 45.0 + m);
    assert_eq!(y[63], 45.0 + m);
}

/// Packs eight 6-bit (scale, min) pairs the way llama.cpp's Q4_K stores them.
fn pack_q4k_scales(sc: [u8; 8], mn: [u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = mn[j] | ((mn[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4);
    }
    s
}

#[test]
fn q4_k() {
    let (d, dmin) = (0.5f32, 0.25f32);
    let sc = [1, 2, 3, 4, 50, 33, 17, 63];
    let mn = [0, 5, 10, 15, 20, 40, 61, 63];
    let mut b = f16b(d).to_vec();
    b.extend(f16b(dmin));
    b.extend(pack_q4k_scales(sc, mn));
    // qs[i]: low nibble i % 16, high nibble 15 - i % 16.
    let qs: Vec<u8> = (0..128u32).map(|i| ((i % 16) | ((15 - i % 16) << 4)) as u8).collect();
    b.extend(&qs);
    assert_eq!(b.len(), 144);
    let y = deq(WeightType::Q4_K, &b, 256);
    // By hand: element 64g + l = d*sc[2g]*lo(qs[32g+l]) - dmin*mn[2g], +32 uses the high nibble
    // and sub-block 2g + 1.
    assert_eq!(y[0], 0.0); // 0.5*1*0 - 0.25*0
    assert_eq!(y[33], 12.75); // qs[1] hi = 14: 0.5*2*14 - 0.25*5
    assert_eq!(y[133], 120.0); // g=2, qs[69] lo = 5: 0.5*50*5 - 0.25*20
    assert_eq!(y[199], 44.25); // g=3, qs[103] lo = 7: 0.5*17*7 - 0.25*61
    assert_eq!(y[255], -15.75); // g=3, qs[127] hi = 0: 0.5*63*0 - 0.25*63
    for g in 0..4 {
        for l in 0..32 {
            let q = qs[32 * g + l];
            let lo = d * f32::from(sc[2 * g]) * f32::from(q & 15) - dmin * f32::from(mn[2 * g]);
            let hi = d * f32::from(sc[2 * g + 1]) * f32::from(q >> 4) - dmin * f32::from(mn[2 * g + 1]);
            assert_eq!((y[64 * g + l], y[64 * g + 32 + l]), (lo, hi), "g {g} l {l}");
        }
    }
}

#[test]
fn q6_k() {
    // Quants L[i] = (7i mod 64) - 32, scales sc[s] = 3*(s - 8), d = 0.125.
    let lq: Vec<i32> = (0..256).map(|i| (i * 7 % 64) - 32).collect();
    let sc: Vec<i8> = (0..16).map(|s| (3 * (s - 8)) as i8).collect();
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for h in 0..2 {
        for l in 0..32 {
            let q = [0, 32, 64, 96].map(|o| (lq[128 * h + l + o] + 32) as u8);
            ql[64 * h + l] = (q[0] & 15) | ((q[2] & 15) << 4);
            ql[64 * h + l + 32] = (q[1] & 15) | ((q[3] & 15) << 4);
            qh[32 * h + l] = (q[0] >> 4) | ((q[1] >> 4) << 2) | ((q[2] >> 4) << 4) | ((q[3] >> 4) << 6);
        }
    }
    let mut b = ql.to_vec();
    b.extend(qh);
    b.extend(sc.iter().map(|&s| s as u8));
    b.extend(f16b(0.125));
    assert_eq!(b.len(), 210);
    let y = deq(WeightType::Q6_K, &b, 256);
    assert_eq!(y[0], 96.0); // 0.125 * -24 * -32
    assert_eq!(y[255], 65.625); // 0.125 * 21 * 25
    for (i, &v) in y.iter().enumerate() {
        assert_eq!(v, 0.125 * f32::from(sc[i / 16]) * lq[i] as f32, "element {i}");
    }
}

#[test]
#[should_panic(expected = "expected Some(20)")]
fn dequantize_length_mismatch_panics() {
    dequantize(WeightType::Q4_1, &[0u8; 19], &mut [0f32; 32]);
}

#[test]
#[should_panic(expected = "expected None")]
fn dequantize_partial_block_panics() {
    dequantize(WeightType::Q8_0, &[0u8; 34], &mut [0f32; 31]);
}
