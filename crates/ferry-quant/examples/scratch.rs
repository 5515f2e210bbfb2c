#[path = "../tests/common/mod.rs"]
mod common;
use ferry_quant::*;
use rand::SeedableRng;
use std::hint::black_box;
#[repr(C)]
struct Ts { s: i64, ns: i64 }
unsafe extern "C" { fn clock_gettime(c: i32, t: *mut Ts) -> i32; }
fn cpu() -> f64 { let mut t = Ts { s: 0, ns: 0 }; unsafe { clock_gettime(3, &mut t) }; t.s as f64 + t.ns as f64 * 1e-9 }

fn main() {
    let mut rng = rand::rngs::StdRng::seed_from_u64(1);
    let ty = match std::env::var("TY").as_deref() { Ok("q8_0") => WeightType::Q8_0, Ok("f16") => WeightType::F16, Ok("f32") => WeightType::F32, Ok("bf16") => WeightType::BF16, Ok("q4_0") => WeightType::Q4_0, Ok("q4_k") => WeightType::Q4_K, Ok("q6_k") => WeightType::Q6_K, _ => WeightType::Q4_1 };
    let ks: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().unwrap()).collect();
    let ks = if ks.is_empty() { vec![32usize, 64, 128, 576, 1536, 4096] } else { ks };
    for k in ks {
        let rows = (1 << 19) / k;
        let rb = ty.row_bytes(k).unwrap();
        let mut mat = vec![0u8; rows * rb];
        common::fill_random(ty, &mut mat, &mut rng);
        let mm: usize = std::env::var("M").ok().and_then(|v| v.parse().ok()).unwrap_or(1);
        let x = common::random_x(k * mm, &mut rng);
        let mut out = vec![0f32; mm];
        let mut best = f64::MAX;
        for _ in 0..reps() {
            let t = cpu();
            for row in mat.chunks_exact(rb) {
                dot_rows(ty, row, &x, &mut out);
                black_box(&out);
            }
            best = best.min(cpu() - t);
        }
        let blocks = (rows * k / 32) as f64;
        println!("k {k:5}: {:.2} ns/call, {:.3} ns/block, {:.2} Gw/s", best / rows as f64 * 1e9, best / blocks * 1e9, (rows*k) as f64 / best / 1e9);
    }
}
fn reps() -> usize { std::env::var("REPS").ok().and_then(|v| v.parse().ok()).unwrap_or(20) }
