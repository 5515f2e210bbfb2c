//! The engine's one error type. Each variant names the operation and the values involved, and says
//! (via [`EngineError::is_retryable`]) whether the same request could succeed elsewhere.

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
}

impl EngineError {
    /// True when the failure is about this engine's capacity, not the request: another worker
    /// with free KV blocks could serve it.
    pub fn is_retryable(&self) -> bool {
        matches!(self, EngineError::Pool(ferry_core::PoolError::Exhausted { .. }))
    }

    /// True when the backend itself failed (the device is gone, a CUDA call failed): nothing more
    /// can run on this engine, whichever sequence was in the step. Every other error of a step is
    /// about its items (a token out of range, a full pool, an unknown sequence).
    pub fn is_device_fault(&self) -> bool {
        matches!(self, EngineError::DeviceUnavailable(..) | EngineError::Cuda { .. })
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io { path: path.into(), source }
    }
    pub(crate) fn bad_model(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        EngineError::BadModel { path: path.into(), reason: reason.into() }
    }
}

pub type Result<T, E = EngineError> = std::result::Result<T, E>;
