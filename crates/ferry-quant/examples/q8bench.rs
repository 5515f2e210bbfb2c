//! Single-thread throughput of the 8-bit-activation paths (`dot_many_q8`, `dot_x8_q8`) next to the `f32` one
//! (`dot_many`), at the selected SIMD level.
//!
//! `cargo run --release -p ferry-quant --example q8bench`
//!
//! Shapes: 1536x576 (in cache) and 49152x576 (rotated over copies exceeding 96 MB, so it streams
//! from memory), m = 1 and 8 activation rows. Reported in G weights/s (each weight feeds m
//! products). "q8+quant" includes quantizing the activations on every matvec; "x8" is the
//! 8-bit-activation kernel on the same matrices with eight rows interleaved (`dot_x8_q8`, m = 1).
//!
//! A second table runs the interleaved kernel at 1-64 activation rows (batched decode, speculative
//! verification) with every kernel the CPU has (`X8Kernel`: AVX2, AVX-512 VNNI, AMX), the kernels
//! alternating trial by trial so that the machine's drift falls on all alike; "vs m=1" is a matvec
//! of m rows against one of one row with the same kernel.

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use ferry_quant::{Q8Activations, WeightType, X8Kernel, dot_many, dot_many_q8, dot_x8_q8, dot_x8_q8_by, interleave_x8, simd_level, supports_x8};
use rand::SeedableRng;
use rand::rngs::StdRng;

const TRIALS: usize = 5;
const TRIAL_TIME: Duration = Duration::from_millis(60);
const OUT_OF_CACHE_BYTES: usize = 96 << 20;

/// Seconds per run of `f`: the best of `TRIALS` trials.
fn time(mut f: impl FnMut()) -> f64 {
    f();
    (0..TRIALS)
        .map(|_| {
            let start = Instant::now();
            let mut n = 0u32;
            while n < 2 || start.elapsed() < TRIAL_TIME {
                f();
                n += 1;
            }
            start.elapsed().as_secs_f64() / f64::from(n)
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    println!("simd level: {}", simd_level());
    println!("{:<5} {:>10} {:>2} {:>9} {:>9} {:>9} {:>8} {:>9}", "type", "rows x k", "m", "f32 Gw/s", "q8 Gw/s", "q8+quant", "speedup", "x8 Gw/s");
    let mut rng = StdRng::seed_from_u64(7);
    for ty in [WeightType::Q4_1, WeightType::Q4_0, WeightType::Q8_0] {
        for (rows, k, out_of_cache) in [(1536usize, 576usize, false), (49152, 576, true)] {
            let rb = ty.row_bytes(k).expect("whole blocks");
            let copies = if out_of_cache { OUT_OF_CACHE_BYTES.div_ceil(rows * rb) } else { 1 };
            let mut mats = vec![vec![0u8; rows * rb]; copies];
            for mat in &mut mats {
                common::fill_random(ty, mat, &mut rng);
            }
            for m in [1usize, 8] {
                let xbuf = common::random_x(m * k + 16, &mut rng);
                let skip = xbuf.as_ptr().align_offset(64).min(16);
                let x = &xbuf[skip..skip + m * k];
                let mut out = vec![0f32; rows * m];
                let mut run = |f: &mut dyn FnMut(&[u8], &mut [f32])| {
                    let mut c = 0;
                    let secs = time(|| {
                        f(&mats[c % copies], &mut out);
                        c += 1;
                        black_box(&out);
                    });
                    (rows * k) as f64 / secs / 1e9
                };
                let f32_gws = run(&mut |w, o| dot_many(ty, w, k, x, o));
                let xq = Q8Activations::quantize(x, k);
                let q8_gws = run(&mut |w, o| dot_many_q8(ty, w, &xq, o));
                let mut xq2 = Q8Activations::default();
                let q8q_gws = run(&mut |w, o| {
                    xq2.quantize_into(x, k);
                    dot_many_q8(ty, w, &xq2, o)
                });
                // Interleaved rows (decode only): the same matrices, repacked.
                let x8_gws = if m == 1 && supports_x8(ty) {
                    let inter: Vec<Vec<u8>> = mats.iter().map(|w| {
                        let mut d = vec![0u8; w.len()];
                        interleave_x8(ty, w, k, &mut d);
                        d
                    }).collect();
                    let mut c = 0;
                    let secs = time(|| {
                        dot_x8_q8(ty, &inter[c % copies], &xq, &mut out);
                        c += 1;
                        black_box(&out);
                    });
                    format!("{:.2}", (rows * k) as f64 / secs / 1e9)
                } else {
                    "-".into()
                };
                println!(
                    "{:<5} {:>10} {:>2} {:>9.2} {:>9.2} {:>9.2} {:>7.2}x {:>9}",
                    ty.name(),
                    format!("{rows}x{k}"),
                    m,
                    f32_gws,
                    q8_gws,
                    q8q_gws,
                    q8_gws / f32_gws,
                    x8_gws
                );
            }
        }
    }
    x8_by_rows(&mut rng);
}

/// `dot_x8_q8` at several activation rows and every supported kernel, in and out of cache.
fn x8_by_rows(rng: &mut StdRng) {
    let levels: Vec<X8Kernel> = X8Kernel::ALL.into_iter().filter(|l| *l != X8Kernel::Scalar && l.is_supported()).collect();
    println!();
    println!("interleaved kernel by activation rows (ms per matvec, median of {TRIALS} alternating trials; vs m=1: against the same kernel at one row)");
    print!("{:<5} {:>10} {:>2}", "type", "rows x k", "m");
    for l in &levels {
        print!(" {:>9} {:>7}", format!("{} ms", l.name()), "vs m=1");
    }
    println!();
    let ty = WeightType::Q4_1;
    for (rows, k, out_of_cache) in [(1536usize, 576usize, false), (49152, 576, true)] {
        let rb = ty.row_bytes(k).expect("whole blocks");
        let copies = if out_of_cache { OUT_OF_CACHE_BYTES.div_ceil(rows * rb) } else { 1 };
        let mats: Vec<Vec<u8>> = (0..copies)
            .map(|_| {
                let mut w = vec![0u8; rows * rb];
                common::fill_random(ty, &mut w, rng);
                let mut d = vec![0u8; w.len()];
                interleave_x8(ty, &w, k, &mut d);
                d
            })
            .collect();
        let mut one = vec![0f64; levels.len()];
        for m in [1usize, 2, 4, 8, 12, 16, 32, 64] {
            let xq = Q8Activations::quantize(&common::random_x(m * k, rng), k);
            let mut out = vec![0f32; rows * m];
            let mut trials = vec![Vec::new(); levels.len()];
            let mut c = 0;
            for _ in 0..TRIALS {
                for (li, &level) in levels.iter().enumerate() {
                    let start = Instant::now();
                    let mut n = 0u32;
                    while n < 2 || start.elapsed() < TRIAL_TIME {
                        dot_x8_q8_by(level, ty, &mats[c % copies], &xq, &mut out);
                        c += 1;
                        n += 1;
                        black_box(&out);
                    }
                    trials[li].push(start.elapsed().as_secs_f64() * 1e3 / f64::from(n));
                }
            }
            print!("{:<5} {:>10} {:>2}", ty.name(), format!("{rows}x{k}"), m);
            for (li, t) in trials.iter_mut().enumerate() {
                t.sort_by(f64::total_cmp);
                let ms = t[t.len() / 2];
                if m == 1 {
                    one[li] = ms;
                }
                print!(" {:>9.3} {:>7.2}", ms, ms / one[li]);
            }
            println!();
        }
    }
}
