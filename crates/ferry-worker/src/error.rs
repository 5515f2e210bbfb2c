//! One error type for the workers, mapped to a gRPC status exhaustively at the boundary: the
//! status code, and the [`WorkerFault`] the status carries under [`FAULT_KEY`] (the router
//! decides retry / migrate / final from the two, never from the message; see
//! `ferry_core::failure::classify`).

use ferry_core::failure::{WorkerFault, FAULT_KEY};
use thiserror::Error;
use tonic::metadata::MetadataValue;
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
    /// The engine thread is gone (its channel is closed): nothing more can run here.
    #[error("worker is shutting down: its engine thread has stopped")]
    ShuttingDown,
    /// This worker is draining (shutting down gracefully): another one should take the request.
    #[error("worker {worker} is draining and takes no new requests")]
    Draining { worker: String },
    /// This worker's engine is broken (the engine thread panicked, the device failed): the worker
    /// fails readiness, deregisters and exits; every request it held moves elsewhere.
    #[error("the engine failed ({0}); this worker is taking itself out")]
    EngineFailed(String),
    /// One sequence failed in a step (the rest of its batch went on).
    #[error("request {request_id}: {what}")]
    SequenceFailed { request_id: String, what: String },
    /// The request's own grammar failed while sampling under it (a mask over its step budget, a
    /// token it refuses): final, the same grammar fails again on any worker.
    #[error("request {request_id}: the request's grammar failed {what}")]
    GrammarFailed { request_id: String, what: String },
    #[error(transparent)]
    Engine(#[from] ferry_engine::EngineError),
    /// Plumbing of a KV transfer that failed in this worker (a buffer of the wrong size, a copy
    /// to the host, a task that did not finish).
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
            // UNAVAILABLE tagged `draining`: the router tries another worker and marks this one
            // draining, not dead.
            WorkerError::Draining { .. } => Code::Unavailable,
            WorkerError::EngineFailed(_) => Code::Unavailable,
            WorkerError::SequenceFailed { .. } => Code::Internal,
            WorkerError::GrammarFailed { .. } => Code::InvalidArgument,
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

    /// This worker's word on the failure, sent with the status under [`FAULT_KEY`].
    ///
    /// Where a variant could be read two ways, it takes the reading that lets a retry succeed
    /// where one can: a transfer that fails its checks (`BadTransferToken`, `Incompatible`, a
    /// payload that does not fit) is `Transfer`, not `Invalid` — the same prompt sent through
    /// another pair works. A peer's refusal keeps the peer's own tag when it is `Transfer` or
    /// `Overloaded` (the transfer failed its checks, or the decode worker had no room to import
    /// it: both are about the transfer or the peer's capacity, not about the peer being broken);
    /// any other refusal, tagged or not, is `Peer` (a `Sequence` or `Invalid` from the decode side
    /// is about what this worker sent it, and a fresh pair may do better; an `Engine` from it
    /// means the peer is broken).
    pub fn fault(&self) -> WorkerFault {
        match self {
            WorkerError::InvalidRequest(_) => WorkerFault::Invalid,
            WorkerError::Exhausted(_) => WorkerFault::Overloaded,
            WorkerError::UnknownTransfer(_)
            | WorkerError::BadTransferToken(_)
            | WorkerError::Incompatible { .. }
            | WorkerError::Corrupt { .. }
            | WorkerError::Timeout { .. } => WorkerFault::Transfer,
            WorkerError::PeerUnavailable { .. } => WorkerFault::Peer,
            WorkerError::PeerRefused { status, .. } => match fault_of(status) {
                Some(f @ (WorkerFault::Transfer | WorkerFault::Overloaded)) => f,
                Some(
                    WorkerFault::Draining | WorkerFault::Peer | WorkerFault::Engine | WorkerFault::Sequence | WorkerFault::Invalid,
                )
                | None => WorkerFault::Peer,
            },
            // Seen by a sender whose receiving request went away: the transfer is void, a fresh
            // attempt may succeed.
            WorkerError::Cancelled => WorkerFault::Transfer,
            WorkerError::ShuttingDown | WorkerError::EngineFailed(_) => WorkerFault::Engine,
            WorkerError::Draining { .. } => WorkerFault::Draining,
            WorkerError::SequenceFailed { .. } => WorkerFault::Sequence,
            WorkerError::GrammarFailed { .. } => WorkerFault::Invalid,
            WorkerError::Engine(e) => {
                use ferry_engine::EngineError as E;
                match e {
                    E::EmptyPrompt | E::ContextOverflow { .. } | E::TokenOutOfRange { .. } | E::Sampling(_) => {
                        WorkerFault::Invalid
                    }
                    E::Pool(_) => WorkerFault::Overloaded,
                    E::KvPayload(_) => WorkerFault::Transfer,
                    // A sequence the engine does not know: that one request is lost here.
                    E::UnknownSequence(_) => WorkerFault::Sequence,
                    E::DeviceUnavailable(..) | E::Cuda { .. } => WorkerFault::Engine,
                    // Loading errors never reach a request after start; if one does, this
                    // worker's engine is what failed.
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
                    | E::KernelCompile { .. } => WorkerFault::Engine,
                }
            }
            WorkerError::Internal(_) => WorkerFault::Transfer,
        }
    }

    /// The status for this error: its code, its message, and its fault tag.
    pub fn status(&self) -> Status {
        tagged(Status::new(self.code(), self.to_string()), self.fault())
    }
}

/// `status` with `fault` under [`FAULT_KEY`] (replacing any tag it had).
pub fn tagged(mut status: Status, fault: WorkerFault) -> Status {
    status.metadata_mut().insert(FAULT_KEY, MetadataValue::from_static(fault.as_str()));
    status
}

/// The fault tag a status carries (None: untagged, or a value this version does not know).
pub fn fault_of(status: &Status) -> Option<WorkerFault> {
    status.metadata().get(FAULT_KEY).and_then(|v| v.to_str().ok()).and_then(WorkerFault::parse)
}

impl From<WorkerError> for Status {
    fn from(e: WorkerError) -> Status {
        e.status()
    }
}

impl From<ferry_core::SamplingError> for WorkerError {
    fn from(e: ferry_core::SamplingError) -> Self {
        WorkerError::InvalidRequest(e.to_string())
    }
}

pub type Result<T, E = WorkerError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_engine::EngineError as E;
    use WorkerFault as F;

    fn peer(status: Status) -> WorkerError {
        WorkerError::PeerRefused { peer: "d".into(), status }
    }

    #[test]
    fn every_error_carries_its_fault_tag() {
        let s = String::new;
        let cases: Vec<(WorkerError, Code, F)> = vec![
            (WorkerError::InvalidRequest(s()), Code::InvalidArgument, F::Invalid),
            (WorkerError::Exhausted(s()), Code::ResourceExhausted, F::Overloaded),
            (WorkerError::UnknownTransfer(1), Code::NotFound, F::Transfer),
            (WorkerError::BadTransferToken(1), Code::PermissionDenied, F::Transfer),
            (WorkerError::Incompatible { id: 1, what: s() }, Code::FailedPrecondition, F::Transfer),
            (WorkerError::Corrupt { id: 1, what: s() }, Code::DataLoss, F::Transfer),
            (WorkerError::Timeout { id: 1, ms: 5, what: "the KV" }, Code::DeadlineExceeded, F::Transfer),
            (WorkerError::PeerUnavailable { peer: s(), what: s() }, Code::Aborted, F::Peer),
            (peer(Status::data_loss("x")), Code::DataLoss, F::Peer),
            (peer(tagged(Status::data_loss("x"), F::Transfer)), Code::DataLoss, F::Transfer),
            (peer(tagged(Status::resource_exhausted("x"), F::Overloaded)), Code::ResourceExhausted, F::Overloaded),
            (peer(tagged(Status::unavailable("x"), F::Engine)), Code::Unavailable, F::Peer),
            (peer(tagged(Status::internal("x"), F::Sequence)), Code::Internal, F::Peer),
            (peer(tagged(Status::invalid_argument("x"), F::Invalid)), Code::InvalidArgument, F::Peer),
            (peer(tagged(Status::unavailable("x"), F::Draining)), Code::Unavailable, F::Peer),
            (WorkerError::Cancelled, Code::Cancelled, F::Transfer),
            (WorkerError::ShuttingDown, Code::Unavailable, F::Engine),
            (WorkerError::Draining { worker: s() }, Code::Unavailable, F::Draining),
            (WorkerError::EngineFailed(s()), Code::Unavailable, F::Engine),
            (WorkerError::SequenceFailed { request_id: s(), what: s() }, Code::Internal, F::Sequence),
            (WorkerError::GrammarFailed { request_id: s(), what: s() }, Code::InvalidArgument, F::Invalid),
            (WorkerError::Engine(E::EmptyPrompt), Code::InvalidArgument, F::Invalid),
            (WorkerError::Engine(E::ContextOverflow { tokens: 9, max_new: 1, context: 8 }), Code::InvalidArgument, F::Invalid),
            (WorkerError::Engine(E::TokenOutOfRange { id: 9, vocab: 8 }), Code::InvalidArgument, F::Invalid),
            (WorkerError::Engine(E::Sampling(ferry_core::SamplingError::EmptyStop)), Code::InvalidArgument, F::Invalid),
            (WorkerError::Engine(E::Pool(ferry_core::PoolError::Exhausted { requested: 2, free: 1, total: 4 })), Code::ResourceExhausted, F::Overloaded),
            (WorkerError::Engine(E::UnknownSequence(3)), Code::NotFound, F::Sequence),
            (WorkerError::Engine(E::DeviceUnavailable("cuda:0".into(), s())), Code::Unavailable, F::Engine),
            (WorkerError::Engine(E::Cuda { op: s(), reason: s() }), Code::Unavailable, F::Engine),
            (WorkerError::Engine(E::Config(s())), Code::Internal, F::Engine),
            (WorkerError::Internal(s()), Code::Internal, F::Transfer),
        ];
        for (e, code, fault) in cases {
            let what = format!("{e:?}");
            let status = Status::from(e);
            assert_eq!(status.code(), code, "{what}");
            assert_eq!(fault_of(&status), Some(fault), "{what}");
            assert_eq!(status.metadata().get(FAULT_KEY).and_then(|v| v.to_str().ok()), Some(fault.as_str()), "{what}");
        }
    }

    #[test]
    fn an_untagged_or_unknown_tag_reads_as_none() {
        assert_eq!(fault_of(&Status::internal("x")), None);
        let mut s = Status::internal("x");
        s.metadata_mut().insert(FAULT_KEY, MetadataValue::from_static("meltdown"));
        assert_eq!(fault_of(&s), None);
    }
}
