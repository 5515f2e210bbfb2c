//! [`GgufFile`]: a validated GGUF image over a memory map (or owned bytes), with typed metadata
//! getters and zero-copy access to tensor data.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::Path;

use crate::parse::{Index, parse};
use crate::{GgufError, MetaValue, TensorInfo};

enum Storage {
    Mmap(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// An open, fully validated GGUF file. Construction checks every length, count, shape and
/// tensor bound, so the accessors below cannot fail on well-formed use.
pub struct GgufFile {
    storage: Storage,
    version: u32,
    metadata: BTreeMap<String, MetaValue>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
    alignment: u64,
    data_offset: u64,
}

impl GgufFile {
    /// Memory-maps and validates the file at `path`. Errors name the path.
    pub fn open(path: &Path) -> Result<GgufFile, GgufError> {
        let io_err = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io_err)?;
        // SAFETY: the map is read-only and private to this value. As with every mmap reader, a
        // process truncating or rewriting the file while it is mapped could change the bytes under
        // us; model files are not modified in place while served.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(io_err)?;
        Self::from_storage(Storage::Mmap(mmap)).map_err(|e| GgufError::InFile {
            path: path.to_path_buf(),
            source: Box::new(e),
        })
    }

    /// Validates an in-memory GGUF image (tests, fuzzing, files fetched into memory).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        Self::from_storage(Storage::Owned(bytes))
    }

    fn from_storage(storage: Storage) -> Result<GgufFile, GgufError> {
        let Index {
            version,
            metadata,
            tensors,
            by_name,
            alignment,
            data_offset,
        } = parse(storage.bytes())?;
        Ok(GgufFile {
            storage,
            version,
            metadata,
            tensors,
            by_name,
            alignment,
            data_offset,
        })
    }

    /// The GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Absolute file offset where the tensor data section starts.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Total size of the file in bytes.
    pub fn file_len(&self) -> u64 {
        self.storage.bytes().len() as u64
    }

    /// All metadata, ordered by key.
    pub fn metadata(&self) -> &BTreeMap<String, MetaValue> {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    fn require(&self, key: &str) -> Result<&MetaValue, GgufError> {
        self.get(key)
            .ok_or_else(|| GgufError::MissingKey(key.into()))
    }

    /// An integer value of any width that fits in `u32`.
    pub fn get_u32(&self, key: &str) -> Result<u32, GgufError> {
        let v = self.require(key)?;
        let n = v
            .as_integer()
            .ok_or_else(|| wrong_type(key, "integer", v))?;
        u32::try_from(n).map_err(|_| GgufError::OutOfRange {
            key: key.into(),
            value: n.to_string(),
            target: "u32",
        })
    }

    /// An `f32`, or an `f64` narrowed to `f32`.
    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        match self.require(key)? {
            MetaValue::F32(x) => Ok(*x),
            MetaValue::F64(x) => Ok(*x as f32),
            v => Err(wrong_type(key, "f32 or f64", v)),
        }
    }

    pub fn get_bool(&self, key: &str) -> Result<bool, GgufError> {
        let v = self.require(key)?;
        v.as_bool().ok_or_else(|| wrong_type(key, "bool", v))
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| wrong_type(key, "string", v))
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        const EXPECTED: &str = "array of string";
        let v = self.require(key)?;
        let items = v.as_array().ok_or_else(|| wrong_type(key, EXPECTED, v))?;
        items
            .iter()
            .map(|item| item.as_str().ok_or_else(|| wrong_type(key, EXPECTED, v)))
            .collect()
    }

    /// An array of integers (of any width) that each fit in `i32`.
    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>, GgufError> {
        const EXPECTED: &str = "array of integers";
        let v = self.require(key)?;
        let items = v.as_array().ok_or_else(|| wrong_type(key, EXPECTED, v))?;
        items
            .iter()
            .map(|item| {
                let n = item
                    .as_integer()
                    .ok_or_else(|| wrong_type(key, EXPECTED, v))?;
                i32::try_from(n).map_err(|_| GgufError::OutOfRange {
                    key: key.into(),
                    value: n.to_string(),
                    target: "i32",
                })
            })
            .collect()
    }

    /// Tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.by_name.get(name).and_then(|&i| self.tensors.get(i))
    }

    /// The bytes of a tensor from this file (bounds were checked at open). A `TensorInfo` that
    /// did not come from this file and does not fit in it yields an empty slice.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let bytes = self.storage.bytes();
        let range = usize::try_from(t.offset)
            .ok()
            .zip(usize::try_from(t.n_bytes).ok())
            .and_then(|(start, len)| Some(start..start.checked_add(len)?));
        range.and_then(|r| bytes.get(r)).unwrap_or(&[])
    }
}

fn wrong_type(key: &str, expected: &'static str, found: &MetaValue) -> GgufError {
    GgufError::WrongType {
        key: key.into(),
        expected,
        found: found.type_name(),
    }
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("file_len", &self.file_len())
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .finish()
    }
}
