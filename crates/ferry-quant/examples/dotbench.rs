//! Single-thread throughput of `dot_rows` (and `dequantize`) for every weight type and SIMD level.
//!
//! `cargo run --release -p ferry-quant --example dotbench [-- TYPE...]`
//!
//! Shapes (rows x k; K-quants round k up to 768): 1536x576 and 576x1536 stay in L2; 49152x576 (the vocabulary projection) is
//! rotated over enough copies to exceed 96 MB, so it streams from memory. For each shape, one
//! "matvec" is `dot_rows` over every weight row with `m` activation rows (m = 1 and 8). Reported:
//! weight bytes read per second (GB/s), weights per second (Gw/s; each weight feeds m products),
//! and multiply-adds per second (GMAC/s = Gw/s * m).

#[path = "../tests/common/mod.rs"]
mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use ferry_quant::{SimdLevel, WeightType, dequantize_with, dot_rows_with, simd_level};
use rand::SeedableRng;
use rand::rngs::StdRng;

/// Each measurement is the fastest of `TRIALS` trials of at least `TRIAL_TIME` (the machine has two
/// cores shared with builds and other jobs; the minimum is the least disturbed figure).
const TRIALS: usize = 5;
const TRIAL_TIME: Duration = Duration::from_millis(40);
const OUT_OF_CACHE_BYTES: usize = 96 << 20;

/// Seconds per run of `f`: the best of `TRIALS` trials, each running `f` at least twice and for
/// at least `TRIAL_TIME`.
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
    let filter: Vec<String> = std::env::args().skip(1).collect();
    let levels: Vec<SimdLevel> = SimdLevel::ALL.into_iter().filter(|l| l.is_supported()).collect();
    println!("selected simd level: {}; benchmarked: {:?}", simd_level(), levels.iter().map(|l| l.name()).collect::<Vec<_>>());
    println!(
        "{:<5} {:>11} {:>3} {:<7} {:>10} {:>8} {:>8} {:>8}",
        "type", "rows x k", "m", "level", "us/matvec", "GB/s", "Gw/s", "GMAC/s"
    );
    let mut rng = StdRng::seed_from_u64(7);
    for ty in WeightType::ALL {
        if !filter.is_empty() && !filter.iter().any(|f| f == ty.name()) {
            continue;
        }
        for (rows, k, out_of_cache) in [(1536usize, 576usize, false), (576, 1536, false), (49152, 576, true)] {
            // K-quant rows are whole 256-element blocks: 576 becomes 768.
            let k = k.next_multiple_of(ty.block_elems());
            let rb = ty.row_bytes(k).expect("whole blocks");
            let copies = if out_of_cache { OUT_OF_CACHE_BYTES.div_ceil(rows * rb) } else { 1 };
            let mut mats = vec![vec![0u8; rows * rb]; copies];
            for mat in &mut mats {
                common::fill_random(ty, mat, &mut rng);
            }
            for m in [1usize, 8] {
                // Activations start on a 64-byte boundary, as the engine's should.
                let xbuf = common::random_x(m * k + 16, &mut rng);
                let skip = xbuf.as_ptr().align_offset(64).min(16);
                let x = &xbuf[skip..skip + m * k];
                let mut out = vec![0f32; m];
                for &level in &levels {
                    let mut c = 0;
                    let secs = time(|| {
                        let mat = &mats[c % copies];
                        c += 1;
                        for row in mat.chunks_exact(rb) {
                            dot_rows_with(level, ty, row, x, &mut out);
                            black_box(&out);
                        }
                    });
                    let weights = (rows * k) as f64;
                    println!(
                        "{:<5} {:>11} {:>3} {:<7} {:>10.1} {:>8.2} {:>8.2} {:>8.2}",
                        ty.name(),
                        format!("{rows}x{k}"),
                        m,
                        level.name(),
                        secs * 1e6,
                        (rows * rb) as f64 / secs / 1e9,
                        weights / secs / 1e9,
                        weights * m as f64 / secs / 1e9
                    );
                }
            }
        }
        // Prefill path: exact dequantization of an in-cache matrix into an f32 scratch.
        let (rows, k) = (1536, 576usize.next_multiple_of(ty.block_elems()));
        let rb = ty.row_bytes(k).expect("whole blocks");
        let mut mat = vec![0u8; rows * rb];
        common::fill_random(ty, &mut mat, &mut rng);
        let mut dst = vec![0f32; rows * k];
        for &level in &levels {
            let secs = time(|| {
                dequantize_with(level, ty, &mat, &mut dst);
                black_box(&dst);
            });
            println!(
                "{:<5} {:>11}     {:<7} dequantize {:>8.1} us, {:.2} Gw/s",
                ty.name(),
                format!("{rows}x{k}"),
                level.name(),
                secs * 1e6,
                (rows * k) as f64 / secs / 1e9
            );
        }
    }
}
