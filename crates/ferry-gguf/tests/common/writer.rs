//! A minimal GGUF writer for tests: builds valid files from metadata and tensors, plus the
//! low-level `put_*` helpers tests use to hand-craft invalid ones.

use ferry_gguf::MetaValue;

pub fn put_u32(out: &mut Vec<u8>, v: u32) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub fn put_u64(out: &mut Vec<u8>, v: u64) {
    out.extend_from_slice(&v.to_le_bytes());
}

pub fn put_str(out: &mut Vec<u8>, s: &str) {
    put_u64(out, s.len() as u64);
    out.extend_from_slice(s.as_bytes());
}

/// Magic, version, tensor count, key/value count.
pub fn header(version: u32, n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut out = b"GGUF".to_vec();
    put_u32(&mut out, version);
    put_u64(&mut out, n_tensors);
    put_u64(&mut out, n_kv);
    out
}

/// The GGUF value type id of a value (arrays: 9; empty arrays are written as arrays of u8).
pub fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(_) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

/// The value's payload (without its type id).
pub fn put_value(out: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => out.push(*x),
        MetaValue::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        MetaValue::Bool(x) => out.push(u8::from(*x)),
        MetaValue::String(s) => put_str(out, s),
        MetaValue::Array(items) => {
            put_u32(out, items.first().map_or(0, type_id));
            put_u64(out, items.len() as u64);
            for item in items {
                put_value(out, item);
            }
        }
    }
}

pub fn put_kv(out: &mut Vec<u8>, key: &str, v: &MetaValue) {
    put_str(out, key);
    put_u32(out, type_id(v));
    put_value(out, v);
}

pub struct TestTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub data: Vec<u8>,
}

/// Builds a valid GGUF image; tensor data is laid out in order, each padded to the alignment.
pub struct GgufWriter {
    pub version: u32,
    pub alignment: u64,
    pub kvs: Vec<(String, MetaValue)>,
    pub tensors: Vec<TestTensor>,
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            alignment: 32,
            kvs: vec![],
            tensors: vec![],
        }
    }

    pub fn kv(mut self, key: &str, v: MetaValue) -> Self {
        if key == "general.alignment"
            && let Some(a) = v.as_integer()
        {
            self.alignment = a as u64;
        }
        self.kvs.push((key.into(), v));
        self
    }

    pub fn tensor(mut self, name: &str, dims: &[u64], type_id: u32, data: Vec<u8>) -> Self {
        self.tensors.push(TestTensor {
            name: name.into(),
            dims: dims.to_vec(),
            type_id,
            data,
        });
        self
    }

    /// Returns the image and each tensor's absolute data offset.
    pub fn build_with_offsets(&self) -> (Vec<u8>, Vec<u64>) {
        let mut out = header(
            self.version,
            self.tensors.len() as u64,
            self.kvs.len() as u64,
        );
        for (k, v) in &self.kvs {
            put_kv(&mut out, k, v);
        }
        let mut rel = Vec::new();
        let mut next = 0u64;
        for t in &self.tensors {
            put_str(&mut out, &t.name);
            put_u32(&mut out, t.dims.len() as u32);
            for &d in &t.dims {
                put_u64(&mut out, d);
            }
            put_u32(&mut out, t.type_id);
            put_u64(&mut out, next);
            rel.push(next);
            next = (next + t.data.len() as u64).next_multiple_of(self.alignment);
        }
        pad_to(&mut out, self.alignment);
        let data_start = out.len() as u64;
        for (i, t) in self.tensors.iter().enumerate() {
            out.extend_from_slice(&t.data);
            if i + 1 < self.tensors.len() {
                pad_to(&mut out, self.alignment);
            }
        }
        (out, rel.iter().map(|r| r + data_start).collect())
    }

    pub fn build(&self) -> Vec<u8> {
        self.build_with_offsets().0
    }
}

fn pad_to(out: &mut Vec<u8>, alignment: u64) {
    while !(out.len() as u64).is_multiple_of(alignment) {
        out.push(0);
    }
}

/// A small valid file exercising every value type and a few tensor types.
pub fn sample() -> GgufWriter {
    use MetaValue::*;
    GgufWriter::new()
        .kv("general.architecture", String("llama".into()))
        .kv("general.alignment", U32(64))
        .kv("t.u8", U8(200))
        .kv("t.i8", I8(-5))
        .kv("t.u16", U16(60000))
        .kv("t.i16", I16(-300))
        .kv("t.u32", U32(576))
        .kv("t.i32", I32(-7))
        .kv("t.u64", U64(1 << 40))
        .kv("t.i64", I64(42))
        .kv("t.f32", F32(1e-5))
        .kv("t.f64", F64(0.25))
        .kv("t.bool", Bool(true))
        .kv("t.str", String("héllo 世界 🚀".into()))
        .kv(
            "t.strs",
            Array(vec![
                String("a b".into()),
                String("".into()),
                String("Ġt".into()),
            ]),
        )
        .kv("t.i32s", Array(vec![I32(1), I32(-2), I32(3)]))
        .kv(
            "t.nested",
            Array(vec![Array(vec![U8(1), U8(2)]), Array(vec![U8(3)])]),
        )
        .kv("t.empty", Array(vec![]))
        .tensor("f32", &[4, 3], 0, (0..48u8).collect())
        .tensor("q4_1", &[64, 2], 3, vec![7; 2 * 2 * 20])
        .tensor("q8_0", &[32], 8, vec![9; 34])
        .tensor("f16.scalar", &[], 1, vec![1, 2])
}
