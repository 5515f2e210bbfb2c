//! Property tests: no byte flip, truncation or random body makes the reader panic, and whatever
//! it accepts can be queried safely.

mod common;

use common::writer::{header, sample};
use ferry_gguf::GgufFile;
use proptest::prelude::*;

/// Parses, and when that succeeds touches every accessor, so a bad index would show up here.
fn exercise(bytes: Vec<u8>) {
    let len = bytes.len() as u64;
    if let Ok(f) = GgufFile::from_bytes(bytes) {
        for (k, v) in f.metadata() {
            let _ = (
                f.get_u32(k),
                f.get_f32(k),
                f.get_str(k),
                f.get_str_array(k),
                f.get_i32_array(k),
            );
            let _ = v.type_name();
        }
        for t in f.tensors() {
            let data = f.tensor_data(t);
            assert_eq!(data.len() as u64, t.n_bytes);
            assert!(t.offset + t.n_bytes <= len);
            let _ = t.n_elements();
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn flips_and_truncations(
        flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in prop::option::of(any::<prop::sample::Index>()),
    ) {
        let mut bytes = sample().build();
        for (i, b) in flips {
            let i = i.index(bytes.len());
            bytes[i] = b;
        }
        if let Some(cut) = cut {
            bytes.truncate(cut.index(bytes.len()));
        }
        exercise(bytes);
    }

    #[test]
    fn random_bytes_after_magic(body in prop::collection::vec(any::<u8>(), 0..512)) {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&body);
        exercise(bytes);
    }

    /// Plausible headers (version 3, small counts) so the random bytes reach the metadata and
    /// tensor parsers instead of failing at the counts.
    #[test]
    fn random_bytes_after_header(
        n_tensors in 0u64..4,
        n_kv in 0u64..4,
        body in prop::collection::vec(any::<u8>(), 0..512),
    ) {
        let mut bytes = header(3, n_tensors, n_kv);
        bytes.extend_from_slice(&body);
        exercise(bytes);
    }
}
