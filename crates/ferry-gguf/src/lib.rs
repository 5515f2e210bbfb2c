//! A validating reader for llama.cpp's GGUF model files (spec: ggml `docs/gguf.md`, v2 and v3).
//!
//! [`GgufFile::open`] memory-maps a file and checks all of it up front — magic, version, every
//! length and count against the bytes that remain (nothing read from the file is allocated before
//! it is known to fit), metadata value types, `general.alignment`, each tensor's byte size from
//! its dims and [`GgmlType`] (overflow-checked), and that every tensor's data lies inside the file.
//! Afterwards metadata getters return typed values and [`GgufFile::tensor_data`] is a plain
//! slice. No input makes it panic.
//!
//! This crate does no compute: dequantization lives elsewhere.

mod cursor;
mod error;
mod file;
mod ggml_type;
mod parse;
mod value;

pub use error::GgufError;
pub use file::GgufFile;
pub use ggml_type::GgmlType;
pub use parse::{DEFAULT_ALIGNMENT, MAX_ARRAY_NESTING, MAX_DIMS};
pub use value::MetaValue;

/// One entry of the tensor index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: `dims[0]` is the innermost dimension (the row length).
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute byte offset of the data in the file.
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of values (product of the dims; 1 for a scalar).
    pub fn n_elements(&self) -> u64 {
        // Validated infos cannot overflow; saturate for hand-made ones rather than panic.
        self.dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
    }
}
