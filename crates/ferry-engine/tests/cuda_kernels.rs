//! Every CUDA kernel against its CPU oracle, through the `Backend` trait (the CPU backend is the
//! oracle) on random inputs, plus the device-only operations (sampling, fused add+norm) against
//! host reference code. Needs a GPU, so each test is `#[ignore]`d ("needs a GPU"): a plain `cargo
//! test` reports it ignored, not ok, and `.ci/run` lists these by name as the only skips it allows;
//! `--include-ignored` runs them (scripts/gpu_check.sh does), and there, without a usable device,
//! each prints a `SKIPPED: cuda_kernels::<test>: why` line, unless `FERRY_REQUIRE_GPU=1` makes that a
//! failure (GPU sessions).
#![cfg(feature = "cuda")]

use ferry_core::{KvDtype, KvLayout};
use ferry_engine::backend::cuda::CudaBackend;
use ferry_engine::backend::cuda::kv_kernels::AttentionSplit;
use ferry_engine::backend::{Backend, BatchPlan, RopeTable, SeqPlan};
use ferry_engine::config::{FreqDtype, RopeConfig};
use ferry_engine::weights::{HostWeight, Storage};
use ferry_engine::backend::cpu::CpuTensor;
use ferry_engine::{CpuBackend, sampler::Rng};
use ferry_quant::WeightType;
use std::sync::Arc;

/// The GPU for test `test`, or None after a `SKIPPED` line (`.ci/run` allows these by name).
fn gpu(test: &str) -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(be) => Some(be),
        Err(e) => {
            assert!(std::env::var_os("FERRY_REQUIRE_GPU").is_none(), "FERRY_REQUIRE_GPU is set but: {e}");
            skipped(&format!("cuda_kernels::{test}"), &format!("no usable CUDA device ({e})"));
            None
        }
    }
}

/// Says that test `test` cannot run and why, as one `SKIPPED: test: why` line straight to stderr
/// (past the test harness's capture): `.ci/run` fails on any such line it does not allow.
fn skipped(test: &str, why: &dyn std::fmt::Display) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("\nSKIPPED: {test}: {why}\n").as_bytes());
}


fn cpu() -> CpuBackend {
    CpuBackend::new(2).expect("cpu backend")
}

fn random(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| ((rng.uniform() * 2.0 - 1.0) as f32) * scale).collect()
}

fn weight(name: &str, ty: WeightType, shape: &[usize], bytes: Vec<u8>) -> HostWeight {
    HostWeight { name: name.into(), ty, shape: shape.to_vec(), storage: Storage::Owned(Arc::new(bytes)), x8: None }
}

fn f32_weight(name: &str, shape: &[usize], v: &[f32]) -> HostWeight {
    weight(name, WeightType::F32, shape, bytemuck::cast_slice(v).to_vec())
}

/// Q8_0 / Q4_0 / Q4_1 blocks with random scales and quants (valid f16 scales).
fn quant_bytes(rng: &mut Rng, ty: WeightType, n_blocks: usize) -> Vec<u8> {
    let mut out = Vec::new();
    for _ in 0..n_blocks {
        let d = half::f16::from_f32(0.01 + rng.uniform() as f32 * 0.05).to_le_bytes();
        out.extend_from_slice(&d);
        let qbytes = match ty {
            WeightType::Q8_0 => 32,
            WeightType::Q4_1 => {
                out.extend_from_slice(&half::f16::from_f32(-(rng.uniform() as f32) * 0.2).to_le_bytes());
                16
            }
            _ => 16,
        };
        out.extend((0..qbytes).map(|_| (rng.next_u64() & 0xff) as u8));
    }
    out
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "lengths");
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max)
}

/// Upload `data` as a tensor on both backends.
macro_rules! both {
    ($g:expr, $c:expr, $rows:expr, $cols:expr, $data:expr) => {{
        let d: &[f32] = &$data;
        ($g.tensor_from($rows, $cols, d).expect("upload"), CpuTensor::from_data($rows, $cols, d.to_vec()))
    }};
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu_check.sh does)"]
fn elementwise_norm_rope_match_the_cpu() {
    let Some(g) = gpu("elementwise_norm_rope_match_the_cpu") else { return };
    let c = cpu();
    let mut rng = Rng::new(1);
    let (rows, hd, heads) = (7, 64, 4);
    let cols = hd * heads;
    let x = random(&mut rng, rows * cols, 2.0);
    let y = random(&mut rng, rows * cols, 2.0);
    let w = f32_weight("norm", &[cols], &random(&mut rng, cols, 1.0));
    let hw = f32_weight("head_norm", &[hd], &random(&mut rng, hd, 1.0));
    let (gw, cw, ghw, chw) = (g.upload(&w).unwrap(), c.upload(&w).unwrap(), g.upload(&hw).unwrap(), c.upload(&hw).unwrap());
    g.run(|| {
        let (gx, cx) = both!(g, c, rows, cols, x);
        let (gy, cy) = both!(g, c, rows, cols, y);
        // rms_norm
        let (mut go, mut co) = (g.tensor(rows, cols), c.tensor(rows, cols));
        g.rms_norm(&gx, &gw, 1e-5, &mut go);
        c.rms_norm(&cx, &cw, 1e-5, &mut co);
        let d = max_diff(&g.to_host(&go), &c.to_host(&co));
        assert!(d < 1e-4, "rms_norm_f32: {d}");
        // head_rms_norm (in place)
        let (mut gh, mut ch) = both!(g, c, rows, cols, x);
        g.head_rms_norm(&mut gh, &ghw, hd, 1e-6);
        c.head_rms_norm(&mut ch, &chw, hd, 1e-6);
        let d = max_diff(&g.to_host(&gh), &c.to_host(&ch));
        assert!(d < 1e-4, "rms_norm_f32 per head: {d}");
        // add, silu_mul
        let (mut ga, mut ca) = both!(g, c, rows, cols, x);
        g.add(&mut ga, &gy);
        c.add(&mut ca, &cy);
        assert!(max_diff(&g.to_host(&ga), &c.to_host(&ca)) == 0.0, "add_f32");
        let (mut gs, mut cs) = both!(g, c, rows, cols, x);
        g.silu_mul(&mut gs, &gy);
        c.silu_mul(&mut cs, &cy);
        let d = max_diff(&g.to_host(&gs), &c.to_host(&cs));
        assert!(d < 1e-4, "silu_mul_f32: {d}");
        // rope, from the same host table
        let rope = RopeTable::new(&RopeConfig { theta: 10000.0, llama3: None, freq_factors: None, freq_dtype: FreqDtype::F32 }, hd);
        let plan = BatchPlan { positions: (0..rows as u32).map(|p| p * 13 + 5).collect(), slots: vec![], seqs: vec![] };
        let (gb, cb) = (g.prepare(&plan, &rope), c.prepare(&plan, &rope));
        let (mut gr, mut cr) = both!(g, c, rows, cols, x);
        g.rope(&mut gr, &gb, hd);
        c.rope(&mut cr, &cb, hd);
        let d = max_diff(&g.to_host(&gr), &c.to_host(&cr));
        assert!(d < 1e-5, "rope_f32: {d}");
        // rope_qk: the queries (4 heads) and keys (2 heads) of a step in one launch
        let (mut gq, mut cq) = both!(g, c, rows, cols, x);
        let (mut gk, mut ck) = both!(g, c, rows, 2 * hd, y[..rows * 2 * hd].to_vec());
        g.rope_qk(&mut gq, &mut gk, &gb, hd);
        c.rope_qk(&mut cq, &mut ck, &cb, hd);
        let (dq, dk) = (max_diff(&g.to_host(&gq), &c.to_host(&cq)), max_diff(&g.to_host(&gk), &c.to_host(&ck)));
        assert!(dq < 1e-5 && dk < 1e-5, "rope_f32 (queries and keys in one launch): q {dq}, k {dk}");
        // gather_rows
        let sel = [6, 0, 3];
        let d = max_diff(&g.to_host(&g.gather_rows(&gx, &sel)), &c.to_host(&c.gather_rows(&cx, &sel)));
        assert!(d == 0.0, "gather_rows_f32");
        // fused add + norm (device only) against add then norm on the CPU
        let (mut gx2, _) = both!(g, c, rows, cols, x);
        let mut go2 = g.tensor(rows, cols);
        g.add_rms_norm(&mut gx2, &gy, &gw, 1e-5, &mut go2).unwrap();
        let mut cx2 = CpuTensor::from_data(rows, cols, x.clone());
        c.add(&mut cx2, &cy);
        let mut co2 = c.tensor(rows, cols);
        c.rms_norm(&cx2, &cw, 1e-5, &mut co2);
        let d = max_diff(&g.to_host(&go2), &c.to_host(&co2));
        assert!(d < 1e-4, "add_rms_norm_f32: {d}");
        // the same through the step's Backend::add_rms_norm (the CPU's: add, then rms_norm)
        let (mut gx3, mut cx3) = both!(g, c, rows, cols, x);
        let (mut go3, mut co3) = (g.tensor(rows, cols), c.tensor(rows, cols));
        Backend::add_rms_norm(&g, &mut gx3, &gy, &gw, 1e-5, &mut go3);
        Backend::add_rms_norm(&c, &mut cx3, &cy, &cw, 1e-5, &mut co3);
        assert!(max_diff(&g.to_host(&gx3), &c.to_host(&cx3)) == 0.0, "Backend::add_rms_norm: the sum");
        let d = max_diff(&g.to_host(&go3), &c.to_host(&co3));
        assert!(d < 1e-4, "Backend::add_rms_norm: {d}");
    })
    .unwrap();
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu_check.sh does)"]
fn matmul_and_embedding_match_the_cpu_for_every_weight_type() {
    let Some(g) = gpu("matmul_and_embedding_match_the_cpu_for_every_weight_type") else { return };
    let c = cpu();
    let mut rng = Rng::new(2);
    // n = 100: the GEMV kernel's last block of 8 columns is partly past the matrix.
    let (n, k) = (100, 128);
    let x = random(&mut rng, 9 * k, 1.0);
    for ty in [WeightType::F32, WeightType::BF16, WeightType::F16, WeightType::Q8_0, WeightType::Q4_0, WeightType::Q4_1] {
        let bytes = match ty {
            WeightType::F32 => bytemuck::cast_slice(&random(&mut rng, n * k, 0.1)).to_vec(),
            WeightType::BF16 => random(&mut rng, n * k, 0.1).iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
            WeightType::F16 => random(&mut rng, n * k, 0.1).iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
            _ => quant_bytes(&mut rng, ty, n * k / 32),
        };
        let w = weight("w", ty, &[n, k], bytes);
        let bias = f32_weight("b", &[n], &random(&mut rng, n, 1.0));
        let (gw, cw, gbias, cbias) = (g.upload(&w).unwrap(), c.upload(&w).unwrap(), g.upload(&bias).unwrap(), c.upload(&bias).unwrap());
        // Rows 1, 5 and 8: the GEMV kernel for 16-bit weights (gemv_<type>); 9, and 5 with the
        // kernel off: cuBLAS.
        for (m, gemv) in [(1, true), (5, true), (8, true), (9, true), (5, false)] {
            g.set_gemv(gemv);
            let x = &x[..m * k];
            g.run(|| {
                let (gx, cx) = both!(g, c, m, k, x.to_vec());
                let (mut go, mut co) = (g.tensor(m, n), c.tensor(m, n));
                g.matmul(&gx, &[(&gw, Some(&gbias))], &mut [&mut go]);
                c.matmul(&cx, &[(&cw, Some(&cbias))], &mut [&mut co]);
                let (gv, cv) = (g.to_host(&go), c.to_host(&co));
                // f32 weights: f32 GEMM. Half weights: activations rounded to bf16/f16 (and
                // quantized weights to bf16) before an f32-accumulated product, so the error scales
                // with the outputs: relative to the largest one (quantized weights here reach ±7.6,
                // so the outputs ±60; bf16 keeps 8 significant bits, 2^-8 = 3.9e-3).
                let scale = cv.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
                let tol = if ty == WeightType::F32 { 1e-4 } else { 1e-2 };
                let d = max_diff(&gv, &cv) / scale;
                println!("matmul {} ({m} rows, GEMV kernel {}): max |Δ| / max |out| {d:.2e} (max |out| {scale:.1})", ty.name(), if gemv { "allowed" } else { "off" });
                assert!(d < tol, "matmul {} ({m} rows): {d}", ty.name());
            })
            .unwrap();
        }
        g.set_gemv(true);
        g.run(|| {
            // Embedding rows of the same table: the dequantized (bf16-rounded) values exactly.
            let ids = [3u32, 0, 95, 3];
            let (mut ge, mut ce) = (g.tensor(ids.len(), k), c.tensor(ids.len(), k));
            g.embed(&gw, &ids, &mut ge);
            c.embed(&cw, &ids, &mut ce);
            let want: Vec<f32> = match ty {
                WeightType::F32 | WeightType::BF16 | WeightType::F16 => c.to_host(&ce),
                _ => c.to_host(&ce).iter().map(|v| half::bf16::from_f32(*v).to_f32()).collect(),
            };
            assert_eq!(g.to_host(&ge), want, "embedding/dequant {}", ty.name());
        })
        .unwrap();
    }
}

/// One matmul call with several weights that read the same x (a layer's q, k and v; gate and up):
/// the GEMV kernel lays up to three of them over one grid, so four weights of different widths
/// take two launches (3 + 1); each output against the CPU's. A call that mixes a 16-bit and an f32
/// weight goes to cuBLAS.
#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu_check.sh does)"]
fn matmuls_of_several_weights_match_the_cpu() {
    let Some(g) = gpu("matmuls_of_several_weights_match_the_cpu") else { return };
    let c = cpu();
    let mut rng = Rng::new(5);
    let k = 256;
    let widths = [100, 24, 24, 56];
    for ty in [WeightType::BF16, WeightType::F16, WeightType::Q4_0] {
        let host: Vec<HostWeight> = widths
            .iter()
            .map(|&n| {
                let bytes = match ty {
                    WeightType::BF16 => random(&mut rng, n * k, 0.1).iter().flat_map(|v| half::bf16::from_f32(*v).to_le_bytes()).collect(),
                    WeightType::F16 => random(&mut rng, n * k, 0.1).iter().flat_map(|v| half::f16::from_f32(*v).to_le_bytes()).collect(),
                    _ => quant_bytes(&mut rng, ty, n * k / 32),
                };
                weight("w", ty, &[n, k], bytes)
            })
            .collect();
        let mixed = f32_weight("f", &[24, k], &random(&mut rng, 24 * k, 0.1));
        let (gw, cw): (Vec<_>, Vec<_>) = host.iter().chain([&mixed]).map(|w| (g.upload(w).unwrap(), c.upload(w).unwrap())).unzip();
        let rows: Vec<usize> = host.iter().chain([&mixed]).map(|w| w.rows()).collect();
        for m in [1, 8] {
            let x = random(&mut rng, m * k, 1.0);
            // The four 16-bit weights together, then the first with the f32 one.
            for set in [vec![0, 1, 2, 3], vec![0, 4]] {
                g.run(|| {
                    let (gx, cx) = both!(g, c, m, k, x);
                    let gws: Vec<_> = set.iter().map(|&i| (&gw[i], None)).collect();
                    let cws: Vec<_> = set.iter().map(|&i| (&cw[i], None)).collect();
                    let mut gouts: Vec<_> = set.iter().map(|&i| g.tensor(m, rows[i])).collect();
                    let mut couts: Vec<_> = set.iter().map(|&i| c.tensor(m, rows[i])).collect();
                    g.matmul(&gx, &gws, &mut gouts.iter_mut().collect::<Vec<_>>());
                    c.matmul(&cx, &cws, &mut couts.iter_mut().collect::<Vec<_>>());
                    for (i, (go, co)) in gouts.iter().zip(&couts).enumerate() {
                        let (gv, cv) = (g.to_host(go), c.to_host(co));
                        let scale = cv.iter().fold(0f32, |m, v| m.max(v.abs())).max(1.0);
                        let d = max_diff(&gv, &cv) / scale;
                        println!("matmul of weights {set:?} ({}, {m} rows), output {i}: max |Δ| / max |out| {d:.2e}", ty.name());
                        assert!(d < 1e-2, "matmul of weights {set:?} ({}, {m} rows), output {i}: {d}", ty.name());
                    }
                })
                .unwrap();
            }
        }
    }
}

/// A synthetic model's random bf16 weights made on the device (`fill_random_bf16`) are the bits
/// the host makes (`weights::random_bf16`), read back through the embedding kernel.
#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu_check.sh does)"]
fn random_weights_on_the_device_match_the_host() {
    let Some(g) = gpu("random_weights_on_the_device_match_the_host") else { return };
    let c = cpu();
    let (rows, cols) = (300, 256);
    let w = HostWeight {
        name: "random".into(),
        ty: WeightType::BF16,
        shape: vec![rows, cols],
        storage: Storage::Random(Arc::new(ferry_engine::weights::RandomBf16::new(42, 0.035, rows * cols))),
        x8: None,
    };
    let (gw, cw) = (g.upload(&w).unwrap(), c.upload(&w).unwrap());
    let ids: Vec<u32> = (0..rows as u32).collect();
    g.run(|| {
        let (mut ge, mut ce) = (g.tensor(rows, cols), c.tensor(rows, cols));
        g.embed(&gw, &ids, &mut ge);
        c.embed(&cw, &ids, &mut ce);
        assert_eq!(g.to_host(&ge), c.to_host(&ce), "fill_random_bf16 vs random_bf16");
    })
    .unwrap();
}

/// Exported rows of `dtype` from the GPU against the CPU's: float types bit for bit; int8 rows'
/// scales within 1 ulp and their values within ±1 (the kernel's division and rounding may land
/// on the other side of a tie; its Hadamard turn is the CPU's operations in the CPU's order).
fn assert_rows_match(dtype: KvDtype, head_dim: usize, gpu: &[u8], cpu: &[u8], what: &str) {
    assert_eq!(gpu.len(), cpu.len(), "{what}: payload lengths");
    if dtype != KvDtype::Int8 {
        assert!(gpu == cpu, "{what}: {dtype} rows differ from the CPU's (encode_row)");
        return;
    }
    let rb = dtype.row_bytes(head_dim);
    for (i, (g, c)) in gpu.chunks_exact(rb).zip(cpu.chunks_exact(rb)).enumerate() {
        let (gs, cs) = (ferry_core::kv_dtype::int8_row_scale(g), ferry_core::kv_dtype::int8_row_scale(c));
        assert!((gs.to_bits() as i64 - cs.to_bits() as i64).abs() <= 1, "{what}: row {i} scale {gs} vs the CPU's {cs}");
        for (d, (&a, &b)) in g[..head_dim].iter().zip(&c[..head_dim]).enumerate() {
            assert!((a as i8 as i32 - b as i8 as i32).abs() <= 1, "{what}: row {i} value {d}: {} vs the CPU's {}", a as i8, b as i8);
        }
    }
}

/// For every KV dtype (f32 at head_dim 64 and 96, bf16 at 64, f16 at 96, int8 at 128): a cache
/// with three sequences, blocks out of order, GQA (8 query heads over 2 KV heads); kv_write's rows
/// against the CPU's (`encode_row`), then, the CPU's rows imported into the GPU cache (so both
/// hold the same bytes), attention against the CPU's over the same dtype within 1e-4 (f32 math
/// on both sides, summed in another order): whole prompts, a chunk after a cached prefix (one
/// long enough for the GEMM path, which widens K/V when it gathers them), a decode batch. Then
/// export/import round trips, through the host and through a device buffer.
#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu_check.sh does)"]
fn paged_attention_and_kv_transfer_match_the_cpu() {
    let Some(g) = gpu("paged_attention_and_kv_transfer_match_the_cpu") else { return };
    for (dtype, hd) in [(KvDtype::F32, 64), (KvDtype::BF16, 64), (KvDtype::F16, 96), (KvDtype::Int8, 128), (KvDtype::F32, 96)] {
        attention_and_transfer(&g, dtype, hd);
    }
    // A large buffer, so the checksum runs many blocks and the atomics meet.
    let big: Vec<u8> = (0..(3usize << 20) + 4).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
    let mut dev = ferry_engine::KvBuffer::Cuda(ferry_engine::backend::cuda::DeviceBytes::alloc(0, big.len()).unwrap());
    dev.write(0, &big).unwrap();
    assert_eq!(dev.checksum(0..big.len()).unwrap(), ferry_core::kv_payload::word_checksum(&big), "kv_checksum_f32 over 3 MiB");
}

fn attention_and_transfer(g: &CudaBackend, dtype: KvDtype, hd: usize) {
    let c = cpu();
    let mut rng = Rng::new(3);
    let (kvh, nh, bs) = (2, 8, 16);
    let layout = KvLayout { dtype, block_size: bs, n_layers: 2, n_kv_heads: kvh, head_dim: hd };
    let (mut gkv, mut ckv) = (g.kv_alloc(&layout, 32).unwrap(), c.kv_alloc(&layout, 32).unwrap());
    let rope = RopeTable::new(&RopeConfig { theta: 10000.0, llama3: None, freq_factors: None, freq_dtype: FreqDtype::F32 }, hd);
    // Sequence A: 40 tokens, blocks [7, 2, 19]; sequence B: 21 tokens, blocks [4, 30]; sequence
    // C: 100 tokens, so its chunks of 64 rows or more attend with GEMMs (causal_softmax_f32).
    let seqs = [(40usize, vec![7u32, 2, 19]), (21, vec![4, 30]), (100, vec![8, 9, 10, 11, 12, 13, 14])];
    // Step 1: write everything (each sequence's whole context as one prefill).
    let mut plan = BatchPlan::default();
    for (len, blocks) in &seqs {
        let q_start = plan.positions.len();
        plan.positions.extend(0..*len as u32);
        plan.slots.extend((0..*len).map(|p| blocks[p / bs] * bs as u32 + (p % bs) as u32));
        plan.seqs.push(SeqPlan { q_start, q_len: *len, ctx_len: *len, blocks: blocks.clone() });
    }
    let rows = plan.positions.len();
    let q = random(&mut rng, rows * nh * hd, 1.0);
    let mut k = random(&mut rng, rows * kvh * hd, 1.0);
    let v = random(&mut rng, rows * kvh * hd, 1.0);
    // A row of zeros (int8: scale 0) and one with a large value (int8: spread over the row by the
    // Hadamard turn, which the kernel does in shared memory as the CPU does in order).
    k[..hd].fill(0.0);
    k[hd * 3] = 300.0;
    let check = |plan: &BatchPlan, q: &[f32], gkv: &ferry_engine::backend::cuda::CudaKv, ckv: &ferry_engine::backend::cpu::CpuKv, what: &str| {
        let rows = plan.positions.len();
        let (gb, cb) = (g.prepare(plan, &rope), c.prepare(plan, &rope));
        g.run(|| {
            let (gq, cq) = both!(g, c, rows, nh * hd, q.to_vec());
            let (mut go, mut co) = (g.tensor(rows, nh * hd), c.tensor(rows, nh * hd));
            g.attention(&gq, gkv, 1, &gb, &mut go);
            c.attention(&cq, ckv, 1, &cb, &mut co);
            let d = max_diff(&g.to_host(&go), &c.to_host(&co));
            println!("{what} ({dtype}, head_dim {hd}): max |Δ| {d:.2e}");
            assert!(d < 1e-4, "{what} ({dtype}, head_dim {hd}): {d}");
        })
        .unwrap();
    };
    {
        let (gb, cb) = (g.prepare(&plan, &rope), c.prepare(&plan, &rope));
        g.run(|| {
            let (gk, ck) = both!(g, c, rows, kvh * hd, k);
            let (gv, cv) = both!(g, c, rows, kvh * hd, v);
            g.kv_write(&mut gkv, 1, &gk, &gv, &gb);
            c.kv_write(&mut ckv, 1, &ck, &cv, &cb);
        })
        .unwrap();
    }
    // kv_write: the stored rows (read back through export) are the CPU's; then the CPU's rows go
    // into the GPU cache, so attention compares the kernels over the same bytes.
    for (len, blocks) in &seqs {
        let (mut gp, mut cp) = (Vec::new(), Vec::new());
        g.kv_export_layer(&gkv, 1, blocks, *len, &mut gp).unwrap();
        c.kv_export_layer(&ckv, 1, blocks, *len, &mut cp).unwrap();
        assert_rows_match(dtype, hd, &gp, &cp, &format!("kv_write_{dtype} of {len} tokens"));
        g.kv_import_layer(&mut gkv, 1, blocks, *len, &cp).unwrap();
    }
    let w = dtype.name();
    check(&plan, &q, &gkv, &ckv, &format!("paged_attention_prefill_{w} (whole prompts)"));
    // A chunk after a cached prefix: the last 5 tokens of A, the last 9 of B, the last 70 of C.
    let mut chunk = BatchPlan::default();
    let mut qc = Vec::new();
    for (i, (len, blocks)) in seqs.iter().enumerate() {
        let n = [5, 9, 70][i];
        let q_start = chunk.positions.len();
        chunk.positions.extend((len - n) as u32..*len as u32);
        chunk.slots.extend((len - n..*len).map(|p| blocks[p / bs] * bs as u32 + (p % bs) as u32));
        chunk.seqs.push(SeqPlan { q_start, q_len: n, ctx_len: *len, blocks: blocks.clone() });
        qc.extend(random(&mut rng, n * nh * hd, 1.0));
    }
    check(&chunk, &qc, &gkv, &ckv, &format!("paged_attention_prefill_{w} and kv_widen (cached prefix)"));
    // A decode batch: one token per sequence at different lengths.
    let mut dec = BatchPlan::default();
    for (i, (len, blocks)) in seqs.iter().enumerate() {
        dec.positions.push(*len as u32 - 1);
        dec.slots.push(0);
        dec.seqs.push(SeqPlan { q_start: i, q_len: 1, ctx_len: *len, blocks: blocks.clone() });
    }
    let qd = random(&mut rng, seqs.len() * nh * hd, 1.0);
    check(&dec, &qd, &gkv, &ckv, &format!("paged_attention_decode_{w}"));
    // The same batch with each sequence's keys split into parts and merged (flash-decoding): C's
    // 100 keys in 15 parts of 7 (B's 21 fill three, its other twelve are empty), 7 of 15, 2 of 50.
    for keys in [7, 16, 64] {
        g.set_attention_split(AttentionSplit::Keys(keys));
        check(&dec, &qd, &gkv, &ckv, &format!("paged_attention_split_{w} + paged_attention_merge_f32 (parts for {keys} keys)"));
    }
    g.set_attention_split(AttentionSplit::Auto);
    // Export: the same payload bytes; import into other blocks and export again.
    let (len, blocks) = &seqs[0];
    let (mut gp, mut cp) = (Vec::new(), Vec::new());
    g.kv_export_layer(&gkv, 1, blocks, *len, &mut gp).unwrap();
    c.kv_export_layer(&ckv, 1, blocks, *len, &mut cp).unwrap();
    assert_eq!(gp, cp, "kv_gather_u32 ({dtype}): export payload differs from the CPU's");
    let other = [11u32, 25, 0];
    g.kv_import_layer(&mut gkv, 0, &other, *len, &gp).unwrap();
    let mut again = Vec::new();
    g.kv_export_layer(&gkv, 0, &other, *len, &mut again).unwrap();
    assert_eq!(again, cp, "kv_scatter_u32 then kv_gather_u32 round trip ({dtype})");
    assert!(g.kv_import_layer(&mut gkv, 0, &other, *len, &gp[1..]).is_err(), "a short section is refused");

    // The device-to-device path: the export stays on the GPU, its word checksum (kv_checksum_f32)
    // matches the host oracle, and importing from it (no host copy) gives the same cache.
    let buf = g.kv_export_layer_buffer(&gkv, 1, blocks, *len).unwrap();
    assert!(buf.as_host().is_none(), "the export buffer is on the device");
    assert_eq!(buf.to_host(0..buf.len()).unwrap(), cp, "kv_gather_u32 into a device buffer ({dtype})");
    for r in [0..buf.len(), 4..buf.len() - 8, 0..4, 0..0] {
        assert_eq!(buf.checksum(r.clone()).unwrap(), ferry_core::kv_payload::word_checksum(&cp[r.clone()]), "kv_checksum_f32 over {r:?}");
    }
    let other2 = [3u32, 9, 27];
    g.kv_import_layer_buffer(&mut gkv, 0, &other2, *len, &buf, 0..buf.len()).unwrap();
    let mut again = Vec::new();
    g.kv_export_layer(&gkv, 0, &other2, *len, &mut again).unwrap();
    assert_eq!(again, cp, "kv_scatter_u32 from a device buffer ({dtype})");
    assert!(g.kv_import_layer_buffer(&mut gkv, 0, &other2, *len, &buf, 4..buf.len()).is_err(), "a short section is refused");
    // A layout whose rows are not whole words is refused with the reason.
    let odd = KvLayout { head_dim: 6, ..layout };
    if dtype == KvDtype::Int8 {
        let e = g.kv_alloc(&odd, 4).err().expect("int8 rows of head_dim 6 are refused").to_string();
        assert!(e.contains("32-bit words"), "{e}");
    }
}

/// Host reference of sample_top_p_f32 (same threshold rule, same index-order walk), in f64.
fn top_p_reference(logits: &[f32], temperature: f32, top_p: f32, u: f32) -> (u32, Vec<bool>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let e: Vec<f64> = logits.iter().map(|&l| (((l - max) / temperature) as f64).exp()).collect();
    let total: f64 = e.iter().sum();
    let p: Vec<f64> = e.iter().map(|x| x / total).collect();
    let mut sorted = p.clone();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let mut cum = 0.0;
    let mut thr = sorted[0];
    for s in &sorted {
        cum += s;
        thr = *s;
        if cum >= top_p as f64 {
            break;
        }
    }
    let kept: Vec<bool> = p.iter().map(|&x| x >= thr).collect();
    let mass: f64 = p.iter().zip(&kept).filter(|(_, k)| **k).map(|(x, _)| x).sum();
    let mut t = u as f64 * mass;
    let mut pick = kept.iter().rposition(|&k| k).unwrap_or(0) as u32;
    for (i, (&x, &k)) in p.iter().zip(&kept).enumerate() {
        if k {
            if t < x {
                pick = i as u32;
                break;
            }
            t -= x;
        }
    }
    (pick, kept)
}

#[test]
#[ignore = "needs a GPU: run with --include-ignored (scripts/gpu_check.sh does)"]
fn sampling_on_the_device_matches_the_host() {
    let Some(g) = gpu("sampling_on_the_device_matches_the_host") else { return };
    let mut rng = Rng::new(4);
    let (rows, vocab) = (16, 49152);
    let mut logits = random(&mut rng, rows * vocab, 8.0);
    logits[3 * vocab + 77] = 100.0; // a clear winner
    logits[5 * vocab + 10] = 50.0; // a tie: the first index wins
    logits[5 * vocab + 20] = 50.0;
    let t = g.tensor_from(rows, vocab, &logits).unwrap();
    let want: Vec<u32> = logits.chunks(vocab).map(ferry_engine::sampler::argmax).collect();
    assert_eq!(g.argmax(&t).unwrap(), want, "argmax_f32");
    let uniforms: Vec<f32> = (0..rows).map(|_| rng.uniform() as f32).collect();
    for (temperature, top_p) in [(1.0, 0.9), (0.7, 0.5), (1.3, 1.0)] {
        let got = g.sample_top_p(&t, temperature, top_p, &uniforms).unwrap();
        let mut same = 0;
        for (r, row) in logits.chunks(vocab).enumerate() {
            let (pick, kept) = top_p_reference(row, temperature, top_p, uniforms[r]);
            assert!(kept[got[r] as usize], "row {r}: token {} is outside the nucleus", got[r]);
            same += usize::from(pick == got[r]);
        }
        println!("sample_top_p_f32 (T={temperature}, p={top_p}): {same}/{rows} rows pick the reference's token");
        assert!(same * 10 >= rows * 9, "sample_top_p_f32: only {same}/{rows} rows agree with the reference");
    }
    assert!(g.sample_top_p(&t, 0.0, 0.9, &uniforms).is_err(), "temperature 0 is refused");
}
