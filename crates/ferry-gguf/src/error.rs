//! The crate's one error type. Every variant names what was being read and the values involved;
//! parse errors carry the byte offset where the problem was found.

use std::path::PathBuf;

/// Everything that can go wrong opening or querying a GGUF file.
///
/// All variants are final for the file in question: retrying the same bytes gives the same error.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file could not be opened or mapped.
    #[error("cannot read GGUF file {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A parse error in a file opened by path; `source` is the underlying problem.
    #[error("invalid GGUF file {path}: {source}")]
    InFile {
        path: PathBuf,
        #[source]
        source: Box<GgufError>,
    },
    #[error("not a GGUF file: magic bytes are {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: Vec<u8> },
    #[error(
        "unsupported GGUF version {0} (supported: 2, 3; a huge number suggests a big-endian file)"
    )]
    UnsupportedVersion(u32),
    #[error(
        "truncated while reading {what} at offset {offset}: need {needed} bytes, {available} left"
    )]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        available: u64,
    },
    #[error("{what} at offset {offset} is {n}, more than the {available} bytes left could hold")]
    TooLarge {
        what: String,
        offset: u64,
        n: u64,
        available: u64,
    },
    #[error("{what} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 { what: String, offset: u64 },
    #[error("{what} at offset {offset} has unknown metadata value type {type_id}")]
    UnknownValueType {
        what: String,
        offset: u64,
        type_id: u32,
    },
    #[error("{what} at offset {offset} is a bool stored as {value} (must be 0 or 1)")]
    InvalidBool {
        what: String,
        offset: u64,
        value: u8,
    },
    #[error("{what} at offset {offset} nests arrays deeper than {max} levels")]
    NestingTooDeep { what: String, offset: u64, max: u32 },
    #[error("metadata key {0:?} appears more than once")]
    DuplicateKey(String),
    #[error("tensor {0:?} appears more than once")]
    DuplicateTensor(String),
    #[error("general.alignment is {value}; it must be a non-zero power of two that fits in u32")]
    BadAlignment { value: String },
    #[error("tensor {name:?} has an invalid shape {dims:?}: {reason}")]
    BadTensorShape {
        name: String,
        dims: Vec<u64>,
        reason: String,
    },
    #[error("tensor {name:?} has ggml type id {type_id}, which this reader does not know")]
    UnsupportedTensorType { name: String, type_id: u32 },
    #[error("tensor {name:?} data offset {offset} is not a multiple of the alignment {alignment}")]
    MisalignedTensor {
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error(
        "tensor {name:?} data [{offset}, {offset} + {n_bytes}) lies outside the file ({file_len} bytes)"
    )]
    TensorOutOfBounds {
        name: String,
        offset: u64,
        n_bytes: u64,
        file_len: u64,
    },
    #[error("metadata key {0:?} is missing")]
    MissingKey(String),
    #[error("metadata key {key:?} has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },
    #[error("metadata key {key:?} holds {value}, which does not fit in {target}")]
    OutOfRange {
        key: String,
        value: String,
        target: &'static str,
    },
}

impl GgufError {
    /// The underlying error, looking through [`GgufError::InFile`].
    pub fn root(&self) -> &GgufError {
        match self {
            GgufError::InFile { source, .. } => source.root(),
            other => other,
        }
    }
}
