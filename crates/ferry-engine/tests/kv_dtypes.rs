//! The KV cache in every stored type (`EngineConfig::kv_dtype`): the golden HF logits within each
//! type's bound, payloads converted on import between types, capacity in bytes, and the prefix
//! cache and forks on a quantized cache.

mod common;
use common::*;
use ferry_core::kv_dtype::convert_rows;
use ferry_core::kv_payload::HEADER_BYTES;
use ferry_core::{KvDtype, KvPayloadHeader};
use ferry_engine::sampler::argmax;
use ferry_engine::{Engine, EngineConfig};

fn engine_with(path: &std::path::Path, kv_dtype: KvDtype) -> Engine {
    Engine::load(path, &EngineConfig { threads: 2, device: test_device(), kv_dtype, ..Default::default() }).expect("load model")
}

/// Largest |Δlogit| against HF's f32 logits each type may show on the golden models (measured
/// 2026-12-06: f32 6.8e-6, f16 9.6e-3, bf16 6.0e-2, int8 1.8e-1, at most, over the four models;
/// int8 1.6e-1 with its rows turned by the Hadamard transform, 2026-12-07).
fn bound(dt: KvDtype) -> f32 {
    match dt {
        KvDtype::F32 => 1e-3,
        KvDtype::F16 => 2e-2,
        KvDtype::BF16 => 1.2e-1,
        KvDtype::Int8 => 3.5e-1,
    }
}

#[test]
fn every_kv_dtype_holds_the_golden_logits_within_its_bound() {
    for name in GOLDEN_MODELS {
        let dir = golden_dir(name);
        let g = Tensors::open(dir.join("golden.safetensors"));
        let (ids, want) = (g.ids("input_ids"), g.f32("logits"));
        let mut worst = Vec::new();
        for dt in KvDtype::ALL {
            let mut e = engine_with(&dir, dt);
            assert_eq!(e.kv_layout().dtype, dt);
            let d = max_abs_diff(&e.score(&ids).unwrap(), &want);
            println!("{name} {dt}: max |Δlogit| = {d:.2e}");
            assert!(d <= bound(dt), "{name} {dt}: max |Δlogit| {d} > {}", bound(dt));
            // Decoding (the per-row kernels, not the prefill GEMMs) reads the stored type too.
            greedy(&mut e, &ids, 8);
            assert_eq!(e.free_blocks(), e.total_blocks(), "{name} {dt}: KV blocks leaked");
            worst.push(d);
        }
        // Fewer bits, more error: the types are not silently stored as f32.
        assert!(worst[0] < worst[2] && worst[2] < worst[1], "{name}: f32 < f16 < bf16 expected, got {worst:?}");
    }
}

/// A payload exported from an int8 cache and imported into an f32 one (and the reverse) holds
/// exactly the rows the conversion gives, and decoding goes on from it.
#[test]
fn a_payload_in_another_dtype_is_converted_on_import() {
    let dir = golden_dir("llama-gqa");
    let prompt: Vec<u32> = (0..37).map(|i| (i * 7 + 3) % 200 + 1).collect();
    for (from, to) in [(KvDtype::Int8, KvDtype::F32), (KvDtype::F32, KvDtype::Int8), (KvDtype::BF16, KvDtype::Int8)] {
        let (mut src, mut dst) = (engine_with(&dir, from), engine_with(&dir, to));
        let seq = src.new_sequence();
        let logits = src.prefill(seq, &prompt).unwrap();
        let payload = src.export_kv(seq).unwrap();
        assert_eq!(KvPayloadHeader::decode(&payload).unwrap().layout.dtype, from, "the payload says what it carries");
        let imported = dst.import_kv(&payload).unwrap();
        let back = dst.export_kv(imported).unwrap();
        let hd = src.kv_layout().head_dim;
        let want = convert_rows(from, to, hd, &payload[HEADER_BYTES..]).unwrap();
        assert!(back[HEADER_BYTES..] == want[..], "{from} -> {to}: the imported rows are not the converted rows");
        // Both engines decode on from the same first token.
        let first = argmax(&logits);
        let next = argmax(&dst.prefill(imported, &[first]).unwrap());
        assert!((next as usize) < dst.config().vocab_size);
        dst.release(imported).unwrap();
        src.release(seq).unwrap();
        assert_eq!(dst.free_blocks(), dst.total_blocks());
    }
}

/// `kv_memory` is bytes: the same budget holds 2x the blocks as bf16 and ~3.8x as int8 (a
/// 64-value row is 68 bytes with its scale, against 256).
#[test]
fn capacity_in_bytes_follows_the_dtype() {
    let dir = golden_dir("llama-gqa");
    let blocks = |dt| {
        let e = Engine::load(&dir, &EngineConfig { threads: 1, kv_dtype: dt, kv_memory: Some(8 << 20), ..Default::default() }).unwrap();
        let per_block = e.kv_layout().bytes_per_token() * e.kv_layout().block_size;
        assert!(e.total_blocks() * per_block <= 8 << 20 && (e.total_blocks() + 1) * per_block > 8 << 20, "{dt}: {} blocks of {per_block} bytes", e.total_blocks());
        e.total_blocks() as f64
    };
    let f32 = blocks(KvDtype::F32);
    let hd = engine_with(&dir, KvDtype::F32).kv_layout().head_dim as f64;
    assert!((blocks(KvDtype::BF16) / f32 - 2.0).abs() < 0.02);
    assert!((blocks(KvDtype::Int8) / f32 - 4.0 * hd / (hd + 4.0)).abs() < 0.05);
    let e = Engine::load(&dir, &EngineConfig { threads: 1, kv_memory: Some(1000), ..Default::default() }).err().expect("too small");
    assert!(e.to_string().contains("holds no block"), "{e}");
}

/// On an int8 cache: a repeated prompt starts on its cached blocks with the same output, a fork
/// of a partial block continues like its parent, and nothing leaks.
#[test]
fn prefix_cache_and_forks_work_on_an_int8_cache() {
    let dir = golden_dir("llama-gqa");
    let mut e = engine_with(&dir, KvDtype::Int8);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 11 + 5) % 200 + 1).collect();
    let params = ferry_core::SamplingParams { ignore_eos: true, ..ferry_core::SamplingParams::greedy(10) };
    let first = e.generate(&prompt, &params, &mut |_| {}).unwrap();
    assert!(e.cached_prefix_len(&prompt, &[]) >= 32, "the prompt's full blocks stay cached");
    let again = e.generate(&prompt, &params, &mut |_| {}).unwrap();
    assert_eq!(first.tokens, again.tokens);
    let seq = e.new_sequence();
    e.prefill(seq, &prompt[..21]).unwrap();
    let fork = e.fork(seq).unwrap();
    let (a, b) = (e.prefill(seq, &[7]).unwrap(), e.prefill(fork, &[7]).unwrap());
    assert_eq!(a, b, "a fork continues exactly like its parent");
    e.release(seq).unwrap();
    e.release(fork).unwrap();
    assert_eq!(e.free_blocks(), e.total_blocks());
}
