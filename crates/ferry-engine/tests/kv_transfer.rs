//! The unit the cluster ships: prefill in one engine, export the KV, import it into a fresh engine,
//! decode there; the tokens equal those of uninterrupted generation.

mod common;
use common::*;
use ferry_engine::{Logits, StepItem};

fn roundtrip(model: &std::path::Path, prompt: &[u32], n: usize) {
    let mut a = engine(model);
    let uninterrupted = greedy(&mut a, prompt, n);

    // Prefill on A, streaming each layer out as it finishes (as a prefill worker does).
    let seq = a.new_sequence();
    let mut layers: Vec<Vec<u8>> = Vec::new();
    let logits = a
        .step(&[StepItem { seq, tokens: prompt, logits: Logits::Last }], &mut |l, view| {
            let mut buf = Vec::new();
            view.export_layer(seq, l, &mut buf).unwrap();
            assert_eq!(l, layers.len(), "layers arrive in order");
            layers.push(buf);
        })
        .unwrap()
        .pop()
        .unwrap();
    let first = ferry_engine::sampler::argmax(&logits);
    let payload = a.export_kv(seq).unwrap();
    // The streamed sections are exactly the payload's body.
    let header = ferry_core::kv_payload::HEADER_BYTES;
    assert_eq!(layers.concat(), payload[header..].to_vec(), "layer-wise export equals whole export");
    a.release(seq).unwrap();
    assert_eq!(a.free_blocks(), a.total_blocks());

    let mut b = engine(model);
    let free_before = b.free_blocks();
    let seq_b = b.import_kv(&payload).unwrap();
    assert_eq!(b.seq_len(seq_b).unwrap(), prompt.len());
    assert!(b.free_blocks() < free_before);
    let resumed = continue_greedy(&mut b, seq_b, first, n);
    assert_eq!(resumed, uninterrupted, "decode after import differs from uninterrupted generation");
    b.release(seq_b).unwrap();
    assert_eq!(b.free_blocks(), b.total_blocks());

    // The buffer path (what a device pipe delivers): a header, and the body in a buffer where
    // the backend keeps KV; the same tokens again.
    let body = ferry_engine::KvBuffer::Host(payload[header..].to_vec());
    let seq_c = b.import_kv_buffer(&payload[..header], &body).unwrap();
    assert_eq!(continue_greedy(&mut b, seq_c, first, n), uninterrupted, "decode after a buffer import");
    b.release(seq_c).unwrap();
}

#[test]
fn export_import_golden_models() {
    for name in GOLDEN_MODELS {
        let dir = golden_dir(name);
        let ids = Tensors::open(dir.join("golden.safetensors")).ids("input_ids");
        roundtrip(&dir, &ids, 16);
    }
}

#[test]
fn export_import_smollm2() {
    let path = smollm2_path();
    let e = engine(&path);
    let prompt = e.encode("Once upon a time, there was a little robot who").unwrap();
    drop(e);
    roundtrip(&path, &prompt, 24);
}

#[test]
fn import_rejects_bad_payloads_and_stores_nothing() {
    let dir = golden_dir("llama-gqa");
    let ids = Tensors::open(dir.join("golden.safetensors")).ids("input_ids");
    let mut a = engine(&dir);
    let seq = a.new_sequence();
    a.prefill(seq, &ids).unwrap();
    let payload = a.export_kv(seq).unwrap();

    // Another model's layout (MQA: 1 KV head instead of 2).
    let mut other = engine(&golden_dir("llama3-ropescaled"));
    let free = other.free_blocks();
    let err = other.import_kv(&payload).unwrap_err().to_string();
    assert!(err.contains("layout"), "{err}");
    assert_eq!(other.free_blocks(), free);

    let mut b = engine(&dir);
    let free = b.free_blocks();
    for (what, bad) in [
        ("truncated", payload[..payload.len() - 4].to_vec()),
        ("extended", [payload.clone(), vec![0; 4]].concat()),
        ("bad magic", [b"XXXXXXXX".to_vec(), payload[8..].to_vec()].concat()),
        ("header only", payload[..10].to_vec()),
    ] {
        assert!(b.import_kv(&bad).is_err(), "{what} payload accepted");
        assert_eq!(b.free_blocks(), free, "{what} payload stored blocks");
    }
    // The good one still imports.
    let s = b.import_kv(&payload).unwrap();
    b.release(s).unwrap();

    // The same checks on a body delivered in a buffer.
    let h = ferry_core::kv_payload::HEADER_BYTES;
    let body = |bytes: &[u8]| ferry_engine::KvBuffer::Host(bytes.to_vec());
    for (what, header, buf) in [
        ("short body", &payload[..h], body(&payload[h..payload.len() - 4])),
        ("long body", &payload[..h], body(&[&payload[h..], &[0; 4][..]].concat())),
        ("truncated header", &payload[..h - 1], body(&payload[h..])),
    ] {
        let err = b.import_kv_buffer(header, &buf).unwrap_err().to_string();
        assert!(!err.is_empty(), "{what}");
        assert_eq!(b.free_blocks(), free, "{what} body stored blocks");
    }
    let err = other.import_kv_buffer(&payload[..h], &body(&payload[h..])).unwrap_err().to_string();
    assert!(err.contains("layout"), "{err}");
    let s = b.import_kv_buffer(&payload[..h], &body(&payload[h..])).unwrap();
    b.release(s).unwrap();
}
