//! One error type for the workers, mapped to a gRPC status exhaustively at the boundary.

use thiserror::Error;
use tonic::{Code, Status};

#[derive(Debug, Error)]
pub enum WorkerError {
    /// The request itself is wrong; no worker would accept it.
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// This worker is full; another one may take the request.
    #[error("no room: {0}")]
    Exhausted(String),
    /// No such transfer (never admitted, already finished, or timed out).
    #[error("unknown KV transfer {0}")]
    UnknownTransfer(u64),
    #[error("KV transfer {0}: wrong transfer token")]
    BadTransferToken(u64),
    /// Model fingerprint or KV layout differ between the two workers.
    #[error("KV transfer {id}: {what}")]
    Incompatible { id: u64, what: String },
    /// A chunk failed its checksum, or sizes/order do not add up.
    #[error("KV transfer {id}: {what}")]
    Corrupt { id: u64, what: String },
    #[error("KV transfer {id} timed out after {ms} ms waiting for {what}")]
    Timeout { id: u64, ms: u64, what: &'static str },
    /// The peer could not be reached or went away.
    #[error("peer {peer} unavailable: {what}")]
    PeerUnavailable { peer: String, what: String },
    /// The peer answered with an error status.
    #[error("peer {peer} refused: {status}")]
    PeerRefused { peer: String, status: Status },
    #[error("request cancelled")]
    Cancelled,
    #[error("worker is shutting down")]
    ShuttingDown,
    /// This worker is draining (shutting down gracefully): another one should take the request.
    #[error("worker {worker} is draining and takes no new requests")]
    Draining { worker: String },
    #[error(transparent)]
    Engine(#[from] ferry_engine::EngineError),
    #[error("{0}")]
    Internal(String),
}

impl WorkerError {
    /// The gRPC code for this error.
    pub fn code(&self) -> Code {
        match self {
            WorkerError::InvalidRequest(_) => Code::InvalidArgument,
            WorkerError::Exhausted(_) => Code::ResourceExhausted,
            WorkerError::UnknownTransfer(_) => Code::NotFound,
            WorkerError::BadTransferToken(_) => Code::PermissionDenied,
            WorkerError::Incompatible { .. } => Code::FailedPrecondition,
            WorkerError::Corrupt { .. } => Code::DataLoss,
            WorkerError::Timeout { .. } => Code::DeadlineExceeded,
            // ABORTED, not UNAVAILABLE: this worker is fine, the peer it talks to (the decode
            // worker receiving KV) is not; the router retries and checks that peer.
            WorkerError::PeerUnavailable { .. } => Code::Aborted,
            // A refusal by the decode worker is passed on with its own code.
            WorkerError::PeerRefused { status, .. } => status.code(),
            WorkerError::Cancelled => Code::Cancelled,
            WorkerError::ShuttingDown => Code::Unavailable,
            // UNAVAILABLE with the `ferry-refusal: draining` metadata: the router tries another
            // worker and marks this one draining, not dead.
            WorkerError::Draining { .. } => Code::Unavailable,
            WorkerError::Engine(e) => {
                use ferry_engine::EngineError as E;
                match e {
                    E::EmptyPrompt | E::ContextOverflow { .. } | E::TokenOutOfRange { .. } | E::Sampling(_) => {
                        Code::InvalidArgument
                    }
                    E::Pool(_) => Code::ResourceExhausted,
                    E::KvPayload(_) => Code::FailedPrecondition,
                    E::UnknownSequence(_) => Code::NotFound,
                    // A device fault mid-step: this worker cannot serve, another may.
                    E::DeviceUnavailable(..) | E::Cuda { .. } => Code::Unavailable,
                    E::Io { .. }
                    | E::Json { .. }
                    | E::BadModel { .. }
                    | E::BadSafetensors { .. }
                    | E::Gguf(_)
                    | E::Tokenizer(_)
                    | E::UnsupportedArch { .. }
                    | E::Config(_)
                    | E::TensorShape { .. }
                    | E::MissingTensor { .. }
                    | E::UnsupportedDtype { .. }
                    | E::Fetch(_)
                    | E::CudaNotBuilt(_)
                    | E::BadDevice(_)
                    | E::KernelCompile { .. } => Code::Internal,
                }
            }
            WorkerError::Internal(_) => Code::Internal,
        }
    }
}

impl From<WorkerError> for Status {
    fn from(e: WorkerError) -> Status {
        let mut status = Status::new(e.code(), e.to_string());
        if matches!(e, WorkerError::Draining { .. }) {
            status
                .metadata_mut()
                .insert(crate::drain::REFUSAL_KEY, tonic::metadata::MetadataValue::from_static(crate::drain::REFUSAL_DRAINING));
        }
        status
    }
}

impl From<ferry_core::SamplingError> for WorkerError {
    fn from(e: ferry_core::SamplingError) -> Self {
        WorkerError::InvalidRequest(e.to_string())
    }
}

pub type Result<T, E = WorkerError> = std::result::Result<T, E>;
