//! The real default model file: SmolLM2-135M-Instruct Q4_1.

mod common;

use std::collections::BTreeMap;

use ferry_gguf::{GgmlType, GgufFile};

#[test]
fn smollm2_index_and_metadata() {
    let f = GgufFile::open(&common::smollm2_gguf()).expect("open SmolLM2 GGUF");
    assert_eq!(f.version(), 3);
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.get_u32("llama.block_count").unwrap(), 30);
    assert_eq!(f.get_u32("llama.embedding_length").unwrap(), 576);
    assert_eq!(f.get_u32("llama.feed_forward_length").unwrap(), 1536);
    assert_eq!(f.get_u32("llama.attention.head_count").unwrap(), 9);
    assert_eq!(f.get_u32("llama.attention.head_count_kv").unwrap(), 3);
    assert_eq!(f.get_u32("llama.context_length").unwrap(), 8192);
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 100_000.0);
    assert_eq!(
        f.get_f32("llama.attention.layer_norm_rms_epsilon").unwrap(),
        1e-5
    );
    assert_eq!(f.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(f.get_str("tokenizer.ggml.pre").unwrap(), "smollm");
    assert_eq!(
        f.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
        49152
    );
    assert_eq!(
        f.get_str_array("tokenizer.ggml.merges").unwrap().len(),
        48900
    );
    assert_eq!(
        f.get_i32_array("tokenizer.ggml.token_type").unwrap().len(),
        49152
    );

    let tensors = f.tensors();
    assert_eq!(tensors.len(), 272);
    let mut by_type: BTreeMap<String, usize> = BTreeMap::new();
    for t in tensors {
        *by_type.entry(t.ggml_type.name()).or_default() += 1;
        assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
        assert_eq!(t.offset % f.alignment(), 0);
    }
    let expected: BTreeMap<String, usize> = [
        ("F32".to_string(), 61),
        ("Q4_1".to_string(), 210),
        ("Q8_0".to_string(), 1),
    ]
    .into();
    assert_eq!(by_type, expected);

    let embd = f.tensor("token_embd.weight").unwrap();
    assert_eq!(
        (embd.ggml_type, embd.dims.as_slice()),
        (GgmlType::Q8_0, &[576, 49152][..])
    );
    assert_eq!(embd.n_bytes, 576 / 32 * 34 * 49152);
    assert!(f.tensor("output.weight").is_none(), "embeddings are tied");
    let q = f.tensor("blk.29.attn_q.weight").unwrap();
    assert_eq!(
        (q.ggml_type, q.dims.as_slice()),
        (GgmlType::Q4_1, &[576, 576][..])
    );
    let k = f.tensor("blk.0.attn_k.weight").unwrap();
    assert_eq!(k.dims, [576, 192]);
    let norm = f.tensor("output_norm.weight").unwrap();
    assert_eq!((norm.ggml_type, norm.n_bytes), (GgmlType::F32, 576 * 4));
    // The last tensor ends at the end of the file.
    let end = tensors.iter().map(|t| t.offset + t.n_bytes).max().unwrap();
    assert_eq!(end, f.file_len());
}

/// Prefixes of the real header (metadata and tensor index end at `data_offset`) never parse.
#[test]
fn smollm2_header_prefixes_fail_cleanly() {
    let path = common::smollm2_gguf();
    let f = GgufFile::open(&path).unwrap();
    let head_len = f.data_offset() as usize;
    let bytes = std::fs::read(&path).unwrap();
    for i in 0..200 {
        let len = i * head_len / 200 + i % 7;
        assert!(
            GgufFile::from_bytes(bytes[..len].to_vec()).is_err(),
            "prefix {len}"
        );
    }
}
