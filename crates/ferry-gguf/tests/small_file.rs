//! A hand-built GGUF round-trips through the reader; malformed variants fail with the right error.

mod common;

use common::writer::{GgufWriter, header, put_kv, put_str, put_u32, put_u64, sample};
use ferry_gguf::{GgmlType, GgufError, GgufFile, MetaValue};

fn parse(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes(bytes)
}

#[test]
fn round_trip() {
    let w = sample();
    let (bytes, offsets) = w.build_with_offsets();
    let f = parse(bytes).expect("valid sample parses");
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 64);
    assert_eq!(f.data_offset() % 64, 0);
    assert_eq!(f.metadata().len(), w.kvs.len());
    for (k, v) in &w.kvs {
        assert_eq!(f.get(k), Some(v), "{k}");
    }
    assert_eq!(f.tensors().len(), w.tensors.len());
    for ((t, expected), off) in f.tensors().iter().zip(&w.tensors).zip(&offsets) {
        assert_eq!(t.name, expected.name);
        assert_eq!(t.dims, expected.dims);
        assert_eq!(t.ggml_type, GgmlType::from_id(expected.type_id));
        assert_eq!(t.offset, *off);
        assert_eq!(t.n_bytes, expected.data.len() as u64);
        assert_eq!(f.tensor_data(t), expected.data.as_slice());
        assert_eq!(f.tensor(&t.name), Some(t));
    }
    assert_eq!(f.tensor("q4_1").map(|t| t.n_elements()), Some(128));
    assert!(f.tensor("missing").is_none());
}

#[test]
fn typed_getters() {
    let f = parse(sample().build()).unwrap();
    assert_eq!(f.get_u32("t.u8").unwrap(), 200);
    assert_eq!(f.get_u32("t.i64").unwrap(), 42);
    assert_eq!(f.get_u32("t.u32").unwrap(), 576);
    assert!(matches!(
        f.get_u32("t.i32"),
        Err(GgufError::OutOfRange { .. })
    ));
    assert!(matches!(
        f.get_u32("t.u64"),
        Err(GgufError::OutOfRange { .. })
    ));
    assert!(matches!(
        f.get_u32("t.f32"),
        Err(GgufError::WrongType { .. })
    ));
    assert!(matches!(f.get_u32("nope"), Err(GgufError::MissingKey(k)) if k == "nope"));
    assert_eq!(f.get_f32("t.f32").unwrap(), 1e-5);
    assert_eq!(f.get_f32("t.f64").unwrap(), 0.25);
    assert!(matches!(
        f.get_f32("t.u32"),
        Err(GgufError::WrongType { .. })
    ));
    assert_eq!(f.get_str("t.str").unwrap(), "héllo 世界 🚀");
    assert!(f.get_bool("t.bool").unwrap());
    assert_eq!(f.get_str_array("t.strs").unwrap(), vec!["a b", "", "Ġt"]);
    assert_eq!(f.get_i32_array("t.i32s").unwrap(), vec![1, -2, 3]);
    assert_eq!(f.get_str_array("t.empty").unwrap(), Vec::<&str>::new());
    match f.get_str_array("t.i32s") {
        Err(GgufError::WrongType {
            key,
            expected,
            found,
        }) => {
            assert_eq!(
                (key.as_str(), expected, found.as_str()),
                ("t.i32s", "array of string", "array of i32")
            );
        }
        other => panic!("expected WrongType, got {other:?}"),
    }
    assert!(matches!(
        f.get_i32_array("t.str"),
        Err(GgufError::WrongType { .. })
    ));
}

#[test]
fn open_by_path_names_the_path() {
    let dir = std::env::temp_dir().join(format!("ferry-gguf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good.gguf");
    std::fs::write(&good, sample().build()).unwrap();
    let f = GgufFile::open(&good).unwrap();
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.tensor_data(f.tensor("q8_0").unwrap()), &[9u8; 34][..]);

    let bad = dir.join("bad.gguf");
    std::fs::write(&bad, b"GGUF\x01\0\0\0").unwrap();
    let err = GgufFile::open(&bad).unwrap_err();
    assert!(err.to_string().contains("bad.gguf"), "{err}");
    assert!(matches!(err.root(), GgufError::UnsupportedVersion(1)));

    let missing = dir.join("missing.gguf");
    let err = GgufFile::open(&missing).unwrap_err();
    assert!(
        matches!(err, GgufError::Io { .. }) && err.to_string().contains("missing.gguf"),
        "{err}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = sample().build();
    for len in 0..bytes.len() {
        let r = parse(bytes[..len].to_vec());
        assert!(
            r.is_err(),
            "prefix of {len} of {} bytes parsed",
            bytes.len()
        );
    }
}

#[test]
fn header_errors() {
    assert!(matches!(
        parse(b"GGML\x03\0\0\0".to_vec()),
        Err(GgufError::BadMagic { .. })
    ));
    assert!(matches!(
        parse(b"GG".to_vec()),
        Err(GgufError::Truncated { .. })
    ));
    assert!(matches!(
        parse(b"XY".to_vec()),
        Err(GgufError::BadMagic { .. })
    ));
    assert!(matches!(parse(vec![]), Err(GgufError::Truncated { .. })));
    for v in [0, 1, 4, 0x0300_0000] {
        assert!(matches!(parse(header(v, 0, 0)), Err(GgufError::UnsupportedVersion(x)) if x == v));
    }
    assert!(matches!(
        parse(header(3, u64::MAX, 0)),
        Err(GgufError::TooLarge { .. })
    ));
    assert!(matches!(
        parse(header(3, 0, 1 << 40)),
        Err(GgufError::TooLarge { .. })
    ));
    let empty = parse(header(2, 0, 0)).unwrap();
    assert_eq!(
        (
            empty.version(),
            empty.tensors().len(),
            empty.metadata().len()
        ),
        (2, 0, 0)
    );
}

/// A header with one key/value entry, then whatever `body` writes.
fn one_kv(body: impl FnOnce(&mut Vec<u8>)) -> Result<GgufFile, GgufError> {
    let mut b = header(3, 0, 1);
    body(&mut b);
    b.extend_from_slice(&[0; 64]);
    parse(b)
}

#[test]
fn metadata_errors() {
    // A 4 GiB string length in a ~100-byte file.
    let r = one_kv(|b| {
        put_str(b, "k");
        put_u32(b, 8);
        put_u64(b, 4 << 30);
    });
    assert!(
        matches!(r, Err(GgufError::Truncated { needed, .. }) if needed == 4 << 30),
        "{r:?}"
    );
    let r = one_kv(|b| put_u64(b, u64::MAX));
    assert!(matches!(r, Err(GgufError::Truncated { .. })), "{r:?}");
    // A huge array count.
    let r = one_kv(|b| {
        put_str(b, "k");
        put_u32(b, 9);
        put_u32(b, 4);
        put_u64(b, 1 << 60);
    });
    assert!(
        matches!(r, Err(GgufError::TooLarge { n, .. }) if n == 1 << 60),
        "{r:?}"
    );
    let r = one_kv(|b| {
        put_str(b, "k");
        put_u32(b, 13);
    });
    assert!(
        matches!(r, Err(GgufError::UnknownValueType { type_id: 13, .. })),
        "{r:?}"
    );
    let r = one_kv(|b| {
        put_str(b, "k");
        put_u32(b, 9);
        put_u32(b, 99);
        put_u64(b, 1);
    });
    assert!(
        matches!(r, Err(GgufError::UnknownValueType { type_id: 99, .. })),
        "{r:?}"
    );
    let r = one_kv(|b| {
        put_u64(b, 2);
        b.extend_from_slice(&[0xff, 0xfe]);
        put_u32(b, 0);
        b.push(0);
    });
    assert!(matches!(r, Err(GgufError::InvalidUtf8 { .. })), "{r:?}");
    let r = one_kv(|b| {
        put_str(b, "k");
        put_u32(b, 7);
        b.push(2);
    });
    assert!(
        matches!(r, Err(GgufError::InvalidBool { value: 2, .. })),
        "{r:?}"
    );
    let r = one_kv(|b| {
        put_str(b, "k");
        put_u32(b, 9);
        for _ in 0..8 {
            put_u32(b, 9);
            put_u64(b, 1);
        }
    });
    assert!(matches!(r, Err(GgufError::NestingTooDeep { .. })), "{r:?}");

    let mut b = header(3, 0, 2);
    put_kv(&mut b, "k", &MetaValue::U8(1));
    put_kv(&mut b, "k", &MetaValue::U8(2));
    assert!(matches!(parse(b), Err(GgufError::DuplicateKey(k)) if k == "k"));

    for bad in [
        MetaValue::U32(0),
        MetaValue::U32(48),
        MetaValue::String("32".into()),
        MetaValue::I64(-32),
    ] {
        let mut b = header(3, 0, 1);
        put_kv(&mut b, "general.alignment", &bad);
        assert!(
            matches!(parse(b), Err(GgufError::BadAlignment { .. })),
            "{bad:?}"
        );
    }
}

/// A file with one tensor info written by hand, followed by `data_len` bytes of data.
fn one_tensor(
    dims: &[u64],
    type_id: u32,
    offset: u64,
    data_len: usize,
) -> Result<GgufFile, GgufError> {
    let mut b = header(3, 1, 0);
    put_str(&mut b, "w");
    put_u32(&mut b, dims.len() as u32);
    for &d in dims {
        put_u64(&mut b, d);
    }
    put_u32(&mut b, type_id);
    put_u64(&mut b, offset);
    b.resize(b.len().next_multiple_of(32) + data_len, 0);
    parse(b)
}

#[test]
fn tensor_errors() {
    assert_eq!(
        one_tensor(&[32, 2], 3, 0, 40).unwrap().tensors()[0].n_bytes,
        40
    );
    let r = one_tensor(&[32, 2], 3, 0, 39);
    assert!(
        matches!(r, Err(GgufError::TensorOutOfBounds { n_bytes: 40, .. })),
        "{r:?}"
    );
    let r = one_tensor(&[32, 2], 3, u64::MAX - 31, 40);
    assert!(
        matches!(r, Err(GgufError::TensorOutOfBounds { .. })),
        "{r:?}"
    );
    let r = one_tensor(&[33, 2], 3, 0, 1000);
    assert!(matches!(r, Err(GgufError::BadTensorShape { .. })), "{r:?}");
    let r = one_tensor(&[1, 1, 1, 1, 1], 0, 0, 4);
    assert!(matches!(r, Err(GgufError::BadTensorShape { .. })), "{r:?}");
    let r = one_tensor(&[1 << 40, 1 << 40, 0], 0, 0, 0);
    assert!(matches!(r, Err(GgufError::BadTensorShape { .. })), "{r:?}");
    let r = one_tensor(&[u64::MAX / 2, 3], 0, 0, 4);
    assert!(matches!(r, Err(GgufError::BadTensorShape { .. })), "{r:?}");
    let r = one_tensor(&[4], 4, 0, 16);
    assert!(
        matches!(r, Err(GgufError::UnsupportedTensorType { type_id: 4, .. })),
        "{r:?}"
    );
    let r = one_tensor(&[4], 0, 16, 64);
    assert!(
        matches!(r, Err(GgufError::MisalignedTensor { offset: 16, .. })),
        "{r:?}"
    );
    let r = one_tensor(&[4], 0, 0, 16);
    assert_eq!(
        r.unwrap().tensor_data(&ferry_gguf::TensorInfo {
            name: "foreign".into(),
            dims: vec![1],
            ggml_type: GgmlType::F32,
            offset: u64::MAX,
            n_bytes: 4,
        }),
        &[] as &[u8]
    );

    let dup = GgufWriter::new()
        .tensor("a", &[1], 0, vec![0; 4])
        .tensor("a", &[1], 0, vec![0; 4])
        .build();
    assert!(matches!(parse(dup), Err(GgufError::DuplicateTensor(n)) if n == "a"));
}
