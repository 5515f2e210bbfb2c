//! Interleaved rows (`interleave_x8` + `dot_x8_q8`, one and several activation rows): every SIMD level bit-identical to the scalar
//! kernel, and the same sums as the row-layout kernel `dot_many_q8` (which `q8.rs` checks against
//! an `f64` dot product of the exact weights with the dequantized activations), up to order.

mod common;

use common::random_row;
use ferry_quant::{Outputs, Q8Activations, SimdLevel, WeightType, X8_ROWS, X8Kernel, dot_many_q8_with, dot_x8_q8, dot_x8_q8_by, dot_x8_q8_into, dot_x8_q8_with, interleave_x8, supports_x8};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const TYPES: [WeightType; 3] = [WeightType::Q4_0, WeightType::Q4_1, WeightType::Q8_0];

fn levels() -> Vec<SimdLevel> {
    SimdLevel::ALL.into_iter().filter(|l| l.is_supported()).collect()
}

/// Every kernel this machine has (AMX only on CPUs with AMX-INT8 whose OS grants the tiles).
fn kernels() -> Vec<X8Kernel> {
    let k: Vec<X8Kernel> = X8Kernel::ALL.into_iter().filter(|k| k.is_supported()).collect();
    eprintln!("x8 kernels here: {:?}", k.iter().map(|k| k.name()).collect::<Vec<_>>());
    k
}

fn check(ty: WeightType, rows: usize, k: usize, m: usize, rng: &mut StdRng) {
    let mut w = Vec::new();
    for _ in 0..rows {
        w.extend(random_row(ty, k, rng));
    }
    let mut x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-3.0f32..3.0)).collect();
    x[..32.min(k)].fill(0.0); // a zero activation block
    let xq = Q8Activations::quantize(&x, k);
    let mut inter = vec![0u8; w.len()];
    interleave_x8(ty, &w, k, &mut inter);
    let mut want = vec![0f32; rows * m];
    dot_many_q8_with(SimdLevel::Scalar, ty, &w, &xq, &mut want);
    let mut scalar = vec![f32::NAN; rows * m];
    dot_x8_q8_with(SimdLevel::Scalar, ty, &inter, &xq, &mut scalar);
    for level in levels() {
        let mut got = vec![f32::NAN; rows * m];
        dot_x8_q8_with(level, ty, &inter, &xq, &mut got);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&scalar), "{ty} {level:?} rows {rows} k {k} m {m}: not bit-identical to the scalar kernel");
    }
    for kernel in kernels() {
        let mut got = vec![f32::NAN; rows * m];
        dot_x8_q8_by(kernel, ty, &inter, &xq, &mut got);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&scalar), "{ty} kernel {} rows {rows} k {k} m {m}: not bit-identical to the scalar kernel", kernel.name());
    }
    // Same per-block terms as the row layout, summed in another order: within f32 rounding of
    // the sum of their magnitudes.
    let rb = ty.row_bytes(k).unwrap();
    let xh: Vec<f32> = xq.quants().iter().enumerate().map(|(j, &q)| xq.scales()[j / 32] * f32::from(q)).collect();
    let mut deq = vec![0f32; k];
    for r in 0..rows {
        ferry_quant::dequantize(ty, &w[r * rb..(r + 1) * rb], &mut deq);
        for (i, xr) in xh.chunks_exact(k).enumerate() {
            let abs: f64 = xr.iter().zip(&deq).map(|(&a, &b)| (f64::from(a) * f64::from(b)).abs()).sum();
            let (g, e) = (f64::from(scalar[i * rows + r]), f64::from(want[r * m + i]));
            assert!((g - e).abs() <= 1e-5 * abs + 1e-6, "{ty} rows {rows} k {k} m {m} row {r} act {i}: interleaved {g}, row layout {e}");
        }
    }
}

#[test]
fn interleaved_rows_match_the_row_layout() {
    let mut rng = StdRng::seed_from_u64(0x58);
    for ty in TYPES {
        assert!(supports_x8(ty));
        for k in [32, 576, 1536] {
            // 24 rows: a pair of groups for the AMX kernel's tiles and a trailing group; 17 and 40
            // activation rows: a tile and a part, and two and a half tiles.
            for rows in [8, 16, 24, 48] {
                for m in [1, 2, 5, 8, 17, 40] {
                    check(ty, rows, k, m, &mut rng);
                }
            }
        }
    }
}

#[test]
fn interleave_places_every_byte_once() {
    // Distinct bytes: the interleaved matrix is a permutation of the original.
    for ty in TYPES {
        let k = 64;
        let rb = ty.row_bytes(k).unwrap();
        let w: Vec<u8> = (0..rb * X8_ROWS * 2).map(|i| (i * 7 % 251) as u8).collect();
        let mut inter = vec![0u8; w.len()];
        interleave_x8(ty, &w, k, &mut inter);
        let (mut a, mut b) = (w.clone(), inter.clone());
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(a, b, "{ty}");
        // Row 3's scale of block 1 of group 0 sits at the header's slot 3.
        let blk = ty.block_bytes();
        assert_eq!(&inter[blk * X8_ROWS + 6..blk * X8_ROWS + 8], &w[3 * rb + blk..3 * rb + blk + 2], "{ty}");
    }
}

#[test]
#[should_panic(expected = "whole groups of 8 rows")]
fn partial_groups_panic() {
    let mut dst = vec![0u8; 20 * 4];
    interleave_x8(WeightType::Q4_1, &[0u8; 20 * 4], 32, &mut dst);
}

#[test]
#[should_panic(expected = "whole groups")]
fn outputs_that_do_not_fit_panic() {
    let xq = Q8Activations::quantize(&[0f32; 64], 32); // two activation rows
    dot_x8_q8(WeightType::Q4_1, &[0u8; 160], &xq, &mut [0f32; 8]);
}

/// Tasks that each own some columns of every output row write in place
/// (`dot_x8_q8_into` on a window of a wider matrix, as the CPU matmul does): the same bits as one
/// contiguous call, and the columns outside the windows untouched. Windows of one group (the AMX
/// kernel's odd-group tail) and of two; 1, 5, 13 and 17 activation rows (VNNI, then AMX where the
/// CPU has it).
#[test]
fn windows_of_a_wider_output_are_written_in_place() {
    let mut rng = StdRng::seed_from_u64(11);
    let (k, rows, n) = (96, 3 * X8_ROWS, 3 * X8_ROWS + 5);
    for ty in TYPES {
        let rb = ty.row_bytes(k).unwrap();
        let mut w = Vec::new();
        for _ in 0..rows {
            w.extend(random_row(ty, k, &mut rng));
        }
        let mut inter = vec![0u8; w.len()];
        interleave_x8(ty, &w, k, &mut inter);
        for m in [1, 5, 13, 17] {
            let x: Vec<f32> = (0..m * k).map(|_| rng.random_range(-3.0f32..3.0)).collect();
            let xq = Q8Activations::quantize(&x, k);
            let mut whole = vec![f32::NAN; rows * m];
            dot_x8_q8(ty, &inter, &xq, &mut whole);
            // Columns 2.. of an n-wide output: windows 2..10 (one group) and 10..26 (two).
            let mut out = vec![-1.0f32; m * n];
            for (c0, cols) in [(0, X8_ROWS), (X8_ROWS, 2 * X8_ROWS)] {
                // SAFETY: rows 0..m, columns 2 + c0.. 2 + c0 + cols of the m×n buffer, written by
                // this call alone.
                let mut window = unsafe { Outputs::strided(out.as_mut_ptr().add(2 + c0), m, n, cols) };
                dot_x8_q8_into(ty, &inter[c0 * rb..(c0 + cols) * rb], &xq, &mut window);
            }
            for i in 0..m {
                for c in 0..n {
                    let got = out[i * n + c];
                    match c.checked_sub(2).filter(|&r| r < rows) {
                        Some(r) => assert_eq!(got.to_bits(), whole[i * rows + r].to_bits(), "{ty} m {m}: row {i} column {c}"),
                        None => assert_eq!(got, -1.0, "{ty} m {m}: row {i} column {c} is outside every window"),
                    }
                }
            }
        }
    }
}

#[test]
#[should_panic(expected = "window")]
fn a_window_of_the_wrong_shape_panics() {
    let xq = Q8Activations::quantize(&[0f32; 64], 32); // two activation rows
    let mut out = [0f32; 16];
    dot_x8_q8_into(WeightType::Q4_1, &[0u8; 160], &xq, &mut Outputs::contiguous(&mut out, 1));
}

#[test]
fn unsupported_types() {
    for ty in [WeightType::F32, WeightType::F16, WeightType::BF16, WeightType::Q4_K, WeightType::Q6_K] {
        assert!(!supports_x8(ty));
    }
}

/// The largest integer sums a block can make: every nibble 15 (or every `Q8_0` quant -128 or 127)
/// against activations all +127 or all -127. The SIMD kernels sum in 16 bits (AVX2) or 32 bits
/// (AVX-512 VNNI, AMX) before converting; none may saturate or wrap, so all agree with the scalar.
/// Two groups and five activation rows: the AMX kernel where the CPU has it.
#[test]
fn extreme_quants_stay_exact() {
    let (k, rows, m) = (64, 2 * X8_ROWS, 5);
    for ty in TYPES {
        let rb = ty.row_bytes(k).unwrap();
        for quant in [0xFFu8, 0x80, 0x7F] {
            let mut w = vec![quant; rb * rows];
            for blk in w.chunks_exact_mut(ty.block_bytes()) {
                // Scales (and mins) of 1.0 in f16.
                let hb = if ty == WeightType::Q4_1 { 4 } else { 2 };
                for h in (0..hb).step_by(2) {
                    blk[h..h + 2].copy_from_slice(&0x3C00u16.to_le_bytes());
                }
            }
            for sign in [1.0f32, -1.0] {
                let xq = Q8Activations::quantize(&vec![sign * 3.0; m * k], k);
                assert!(xq.quants().iter().all(|&q| q == (sign * 127.0) as i8));
                let mut inter = vec![0u8; w.len()];
                interleave_x8(ty, &w, k, &mut inter);
                let mut scalar = vec![f32::NAN; rows * m];
                dot_x8_q8_with(SimdLevel::Scalar, ty, &inter, &xq, &mut scalar);
                for kernel in kernels() {
                    let mut got = vec![f32::NAN; rows * m];
                    dot_x8_q8_by(kernel, ty, &inter, &xq, &mut got);
                    assert_eq!(got.iter().map(|f| f.to_bits()).collect::<Vec<_>>(), scalar.iter().map(|f| f.to_bits()).collect::<Vec<_>>(), "{ty} quant {quant:#x} sign {sign} {}", kernel.name());
                }
            }
        }
    }
}
