//! Measurements that put engine figures in context: the machine's memory read bandwidth (the
//! decode roofline) measured with the same thread count, in the same run.

use crate::backend::cpu::simd::dot;
use rayon::prelude::*;
use std::time::Instant;

/// Read bandwidth in bytes/s: `threads` threads each summing their share of a `bytes`-sized
/// f32 buffer (far larger than the caches); best of `repeats`.
pub fn memory_read_bandwidth(threads: usize, bytes: usize, repeats: usize) -> f64 {
    let n = bytes / 4;
    let a: Vec<f32> = (0..n).map(|i| (i % 7) as f32).collect();
    let b: Vec<f32> = (0..n).map(|i| (i % 5) as f32).collect();
    let pool = rayon::ThreadPoolBuilder::new().num_threads(threads.max(1)).build().expect("thread pool");
    let chunk = n.div_ceil(threads.max(1) * 4);
    let mut best = 0f64;
    for _ in 0..repeats.max(1) {
        let t = Instant::now();
        let s: f32 = pool.install(|| a.par_chunks(chunk).zip(b.par_chunks(chunk)).map(|(x, y)| dot(x, y)).sum());
        let secs = t.elapsed().as_secs_f64();
        std::hint::black_box(s);
        best = best.max((2 * n * 4) as f64 / secs);
    }
    best
}

/// Median of a non-empty list.
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}
