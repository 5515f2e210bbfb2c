//! The engine's one error type. Each variant names the operation and the values involved, and says
//! (via [`EngineError::kind`]) whether the same request could succeed elsewhere.

use std::path::PathBuf;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum EngineError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: invalid JSON: {source}")]
    Json { path: PathBuf, source: serde_json::Error },
    #[error("{path}: not a usable model: {reason}")]
    BadModel { path: PathBuf, reason: String },
    #[error("{path}: invalid safetensors file: {reason}")]
    BadSafetensors { path: PathBuf, reason: String },
    #[error(transparent)]
    Gguf(#[from] ferry_gguf::GgufError),
    #[error(transparent)]
    Tokenizer(#[from] ferry_tokenizer::TokenizerError),
    #[error("unsupported architecture {arch:?} (supported: {supported})")]
    UnsupportedArch { arch: String, supported: &'static str },
    #[error("model config: {0}")]
    Config(String),
    #[error("tensor {name}: expected shape {expected:?}, found {found:?}")]
    TensorShape { name: String, expected: Vec<usize>, found: Vec<usize> },
    #[error("tensor {name} is missing from the model files")]
    MissingTensor { name: String },
    #[error("tensor {name}: unsupported dtype {dtype}")]
    UnsupportedDtype { name: String, dtype: String },
    #[error("prompt is empty")]
    EmptyPrompt,
    #[error("prompt of {tokens} tokens plus {max_new} new tokens exceeds the context length {context}")]
    ContextOverflow { tokens: usize, max_new: usize, context: usize },
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error(transparent)]
    Sampling(#[from] ferry_core::SamplingError),
    #[error(transparent)]
    Pool(#[from] ferry_core::PoolError),
    #[error(transparent)]
    KvPayload(#[from] ferry_core::KvPayloadError),
    #[error("unknown sequence {0}")]
    UnknownSequence(u64),
    #[error("cannot fetch the default model: {0}")]
    Fetch(String),
    #[error("device {0} is not available: {1}")]
    DeviceUnavailable(String, String),
    #[error("--device {0}: this ferry was built without CUDA support; rebuild with --features cuda")]
    CudaNotBuilt(String),
    #[error("invalid device {0:?}: expected cpu, cuda or cuda:N")]
    BadDevice(String),
    #[error("CUDA {op} failed: {reason}")]
    Cuda { op: String, reason: String },
    #[error("kernel {file}: NVRTC compilation failed: {log}")]
    KernelCompile { file: String, log: String },
    #[error(transparent)]
    KvDisk(#[from] crate::kv_disk::DiskError),
}

/// What an [`EngineError`] says about the request that met it: the one classification a worker
/// maps to both its gRPC code and its fault tag (`ferry_worker::error`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// The request itself is wrong: every engine would refuse it (final).
    Invalid,
    /// This engine has no room now; another with free KV blocks could serve it (retryable).
    Capacity,
    /// A KV payload that does not fit this engine: the transfer failed, another pair may work.
    Payload,
    /// A sequence this engine does not hold: that one request is lost here.
    UnknownSequence,
    /// The backend itself failed (the device is gone, a CUDA call failed): nothing more can run on
    /// this engine, whichever sequence was in the step.
    Device,
    /// Loading and setup: never met by a request after start; if one is, this engine failed.
    Setup,
}

impl EngineError {
    /// This error's [`ErrorKind`] (exhaustive: a new variant must choose one).
    pub fn kind(&self) -> ErrorKind {
        match self {
            EngineError::EmptyPrompt
            | EngineError::ContextOverflow { .. }
            | EngineError::TokenOutOfRange { .. }
            | EngineError::Sampling(_) => ErrorKind::Invalid,
            EngineError::Pool(_) => ErrorKind::Capacity,
            EngineError::KvPayload(_) => ErrorKind::Payload,
            EngineError::UnknownSequence(_) => ErrorKind::UnknownSequence,
            EngineError::DeviceUnavailable(..) | EngineError::Cuda { .. } => ErrorKind::Device,
            EngineError::Io { .. }
            | EngineError::Json { .. }
            | EngineError::BadModel { .. }
            | EngineError::BadSafetensors { .. }
            | EngineError::Gguf(_)
            | EngineError::Tokenizer(_)
            | EngineError::UnsupportedArch { .. }
            | EngineError::Config(_)
            | EngineError::TensorShape { .. }
            | EngineError::MissingTensor { .. }
            | EngineError::UnsupportedDtype { .. }
            | EngineError::Fetch(_)
            | EngineError::CudaNotBuilt(_)
            | EngineError::BadDevice(_)
            | EngineError::KernelCompile { .. }
            | EngineError::KvDisk(_) => ErrorKind::Setup,
        }
    }

    /// True when the backend itself failed ([`ErrorKind::Device`]). Every other error of a step is
    /// about its items (a token out of range, a full pool, an unknown sequence).
    pub fn is_device_fault(&self) -> bool {
        self.kind() == ErrorKind::Device
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io { path: path.into(), source }
    }
    pub(crate) fn bad_model(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        EngineError::BadModel { path: path.into(), reason: reason.into() }
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
