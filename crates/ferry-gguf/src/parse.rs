//! Parsing and validation of a whole GGUF image: header, metadata, tensor index, data bounds.
//! Layout per the GGUF spec (ggml `docs/gguf.md`, versions 2 and 3): magic `GGUF`, `u32` version,
//! `u64` tensor count, `u64` key/value count, the key/value pairs, the tensor infos, padding to
//! `general.alignment`, then tensor data. Every check happens here, so queries cannot fail later.

use std::collections::{BTreeMap, HashMap};

use crate::cursor::Cursor;
use crate::value::ValueType;
use crate::{GgmlType, GgufError, MetaValue, TensorInfo};

/// Alignment of the tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: u32 = 4;
/// Deepest array nesting accepted (ggml itself writes none; the spec allows it).
pub const MAX_ARRAY_NESTING: u32 = 4;

const MAGIC: &[u8; 4] = b"GGUF";
/// Smallest possible key/value entry: key length, value type, a one-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest possible tensor info: name length, dim count, type, offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

/// Everything known about a file once it has been validated.
pub(crate) struct Index {
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: Vec<TensorInfo>,
    pub by_name: HashMap<String, usize>,
    pub alignment: u64,
    pub data_offset: u64,
}

pub(crate) fn parse(bytes: &[u8]) -> Result<Index, GgufError> {
    let head = &bytes[..bytes.len().min(4)];
    if head != &MAGIC[..head.len()] {
        return Err(GgufError::BadMagic {
            found: head.to_vec(),
        });
    }
    let mut c = Cursor::new(bytes);
    c.take(4, || "magic".into())?;
    let version = c.u32(|| "version".into())?;
    if !(2..=3).contains(&version) {
        return Err(GgufError::UnsupportedVersion(version));
    }
    let n_tensors = c.count(MIN_TENSOR_INFO_BYTES, || "tensor infos".into())?;
    let n_kv = c.count(MIN_KV_BYTES, || "metadata entries".into())?;

    let metadata = read_metadata(&mut c, n_kv)?;
    let alignment = alignment(&metadata)?;

    let mut tensors = Vec::with_capacity(n_tensors);
    let mut by_name = HashMap::with_capacity(n_tensors);
    for i in 0..n_tensors {
        let t = read_tensor_info(&mut c, i, alignment)?;
        if by_name.insert(t.name.clone(), i).is_some() {
            return Err(GgufError::DuplicateTensor(t.name));
        }
        tensors.push(t);
    }

    let file_len = bytes.len() as u64;
    let data_offset =
        (c.offset())
            .checked_next_multiple_of(alignment)
            .ok_or(GgufError::TooLarge {
                what: "tensor data offset".into(),
                offset: c.offset(),
                n: c.offset(),
                available: c.remaining(),
            })?;
    for t in &mut tensors {
        let start = data_offset.checked_add(t.offset);
        match start.and_then(|s| s.checked_add(t.n_bytes)) {
            Some(end) if end <= file_len => t.offset += data_offset,
            _ => {
                return Err(GgufError::TensorOutOfBounds {
                    name: t.name.clone(),
                    offset: data_offset.saturating_add(t.offset),
                    n_bytes: t.n_bytes,
                    file_len,
                });
            }
        }
    }
    Ok(Index {
        version,
        metadata,
        tensors,
        by_name,
        alignment,
        data_offset,
    })
}

fn read_metadata(
    c: &mut Cursor<'_>,
    n_kv: usize,
) -> Result<BTreeMap<String, MetaValue>, GgufError> {
    let mut metadata = BTreeMap::new();
    for i in 0..n_kv {
        let key = c.string(|| format!("key of metadata entry {i}"))?;
        let type_offset = c.offset();
        let type_id = c.u32(|| format!("value type of key {key:?}"))?;
        let vt = ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
            what: format!("value of key {key:?}"),
            offset: type_offset,
            type_id,
        })?;
        let value = read_value(c, vt, &key, 0)?;
        if metadata.contains_key(&key) {
            return Err(GgufError::DuplicateKey(key));
        }
        metadata.insert(key, value);
    }
    Ok(metadata)
}

fn read_value(
    c: &mut Cursor<'_>,
    vt: ValueType,
    key: &str,
    depth: u32,
) -> Result<MetaValue, GgufError> {
    let what = || format!("value of key {key:?}");
    Ok(match vt {
        ValueType::U8 => MetaValue::U8(c.u8(what)?),
        ValueType::I8 => MetaValue::I8(c.u8(what)? as i8),
        ValueType::U16 => MetaValue::U16(c.u16(what)?),
        ValueType::I16 => MetaValue::I16(c.u16(what)? as i16),
        ValueType::U32 => MetaValue::U32(c.u32(what)?),
        ValueType::I32 => MetaValue::I32(c.u32(what)? as i32),
        ValueType::U64 => MetaValue::U64(c.u64(what)?),
        ValueType::I64 => MetaValue::I64(c.u64(what)? as i64),
        ValueType::F32 => MetaValue::F32(f32::from_bits(c.u32(what)?)),
        ValueType::F64 => MetaValue::F64(f64::from_bits(c.u64(what)?)),
        ValueType::Bool => {
            let offset = c.offset();
            match c.u8(what)? {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                value => {
                    return Err(GgufError::InvalidBool {
                        what: what(),
                        offset,
                        value,
                    });
                }
            }
        }
        ValueType::String => MetaValue::String(c.string(what)?),
        ValueType::Array => {
            let offset = c.offset();
            let type_id = c.u32(|| format!("element type of array {key:?}"))?;
            let elem = ValueType::from_id(type_id).ok_or_else(|| GgufError::UnknownValueType {
                what: format!("element of array {key:?}"),
                offset,
                type_id,
            })?;
            if elem == ValueType::Array && depth + 1 >= MAX_ARRAY_NESTING {
                return Err(GgufError::NestingTooDeep {
                    what: what(),
                    offset,
                    max: MAX_ARRAY_NESTING,
                });
            }
            let n = c.count(elem.min_size(), || format!("elements of array {key:?}"))?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(read_value(c, elem, key, depth + 1)?);
            }
            MetaValue::Array(items)
        }
    })
}

fn alignment(metadata: &BTreeMap<String, MetaValue>) -> Result<u64, GgufError> {
    let Some(v) = metadata.get("general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    match v.as_integer() {
        Some(a) if a > 0 && a <= i128::from(u32::MAX) && (a as u64).is_power_of_two() => {
            Ok(a as u64)
        }
        _ => Err(GgufError::BadAlignment {
            value: format!("{v:?}"),
        }),
    }
}

fn read_tensor_info(c: &mut Cursor<'_>, i: usize, alignment: u64) -> Result<TensorInfo, GgufError> {
    let name = c.string(|| format!("name of tensor {i}"))?;
    let n_dims = c.u32(|| format!("dimension count of tensor {name:?}"))?;
    if n_dims > MAX_DIMS {
        return Err(GgufError::BadTensorShape {
            name,
            dims: vec![],
            reason: format!("{n_dims} dimensions, at most {MAX_DIMS} allowed"),
        });
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for d in 0..n_dims {
        dims.push(c.u64(|| format!("dimension {d} of tensor {name:?}"))?);
    }
    let type_id = c.u32(|| format!("type of tensor {name:?}"))?;
    let ggml_type = GgmlType::from_id(type_id);
    let offset = c.u64(|| format!("data offset of tensor {name:?}"))?;
    let n_bytes = tensor_bytes(&name, &dims, ggml_type)?;
    if offset % alignment != 0 {
        return Err(GgufError::MisalignedTensor {
            name,
            offset,
            alignment,
        });
    }
    Ok(TensorInfo {
        name,
        dims,
        ggml_type,
        offset,
        n_bytes,
    })
}

/// Bytes a tensor of this shape and type occupies, overflow-checked.
fn tensor_bytes(name: &str, dims: &[u64], ggml_type: GgmlType) -> Result<u64, GgufError> {
    let (Some(block_elems), Some(block_bytes)) = (ggml_type.block_elems(), ggml_type.block_bytes())
    else {
        return Err(GgufError::UnsupportedTensorType {
            name: name.into(),
            type_id: ggml_type.id(),
        });
    };
    let shape_err = |reason: String| GgufError::BadTensorShape {
        name: name.into(),
        dims: dims.to_vec(),
        reason,
    };
    let row = dims.first().copied().unwrap_or(1);
    if row % block_elems != 0 {
        return Err(shape_err(format!(
            "row length {row} is not a multiple of the {ggml_type} block size {block_elems}"
        )));
    }
    let too_big = || shape_err("element count or byte size overflows u64".into());
    dims.iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(too_big)?;
    let rows = dims
        .iter()
        .skip(1)
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(too_big)?;
    (row / block_elems)
        .checked_mul(block_bytes)
        .and_then(|row_bytes| row_bytes.checked_mul(rows))
        .ok_or_else(too_big)
}
