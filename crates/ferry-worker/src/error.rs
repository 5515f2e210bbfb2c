//! One error type for the workers, mapped to a gRPC status exhaustively at the boundary: the
//! status code, and the [`WorkerFault`] the status carries under [`FAULT_KEY`] (the router
//! decides retry / migrate / final from the two, never from the message; see
//! `ferry_core::failure::classify`).

use ferry_core::failure::{WorkerFault, FAULT_KEY};
use ferry_engine::ErrorKind;
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
    /// The gRPC code and this worker's word on the failure (the [`WorkerFault`] sent with the
    /// status under [`FAULT_KEY`]): one exhaustive mapping, so a new error chooses both at once.
    ///
    /// Where a variant could be read two ways, it takes the reading that lets a retry succeed
    /// where one can: a transfer that fails its checks (`BadTransferToken`, `Incompatible`, a
    /// payload that does not fit) is `Transfer`, not `Invalid` — the same prompt sent through
    /// another pair works. A peer's refusal keeps the peer's own code, and its own tag when it is
    /// `Transfer` or `Overloaded` (the transfer failed its checks, or the decode worker had no room
    /// to import it: both are about the transfer or the peer's capacity, not about the peer being
    /// broken); any other refusal, tagged or not, is `Peer` (a `Sequence` or `Invalid` from the
    /// decode side is about what this worker sent it, and a fresh pair may do better; an `Engine`
    /// from it means the peer is broken).
    pub fn wire(&self) -> (Code, WorkerFault) {
        match self {
            WorkerError::InvalidRequest(_) => (Code::InvalidArgument, WorkerFault::Invalid),
            WorkerError::Exhausted(_) => (Code::ResourceExhausted, WorkerFault::Overloaded),
            WorkerError::UnknownTransfer(_) => (Code::NotFound, WorkerFault::Transfer),
            WorkerError::BadTransferToken(_) => (Code::PermissionDenied, WorkerFault::Transfer),
            WorkerError::Incompatible { .. } => (Code::FailedPrecondition, WorkerFault::Transfer),
            WorkerError::Corrupt { .. } => (Code::DataLoss, WorkerFault::Transfer),
            WorkerError::Timeout { .. } => (Code::DeadlineExceeded, WorkerFault::Transfer),
            // ABORTED, not UNAVAILABLE: this worker is fine, the peer it talks to (the decode
            // worker receiving KV) is not; the router retries and checks that peer.
            WorkerError::PeerUnavailable { .. } => (Code::Aborted, WorkerFault::Peer),
            WorkerError::PeerRefused { status, .. } => {
                let fault = match fault_of(status) {
                    Some(f @ (WorkerFault::Transfer | WorkerFault::Overloaded)) => f,
                    Some(
                        WorkerFault::Draining | WorkerFault::Peer | WorkerFault::Engine | WorkerFault::Sequence | WorkerFault::Invalid,
                    )
                    | None => WorkerFault::Peer,
                };
                (status.code(), fault)
            }
            // Seen by a sender whose receiving request went away: the transfer is void, a fresh
            // attempt may succeed.
            WorkerError::Cancelled => (Code::Cancelled, WorkerFault::Transfer),
            WorkerError::ShuttingDown => (Code::Unavailable, WorkerFault::Engine),
            // UNAVAILABLE tagged `draining`: the router tries another worker and marks this one
            // draining, not dead.
            WorkerError::Draining { .. } => (Code::Unavailable, WorkerFault::Draining),
            WorkerError::EngineFailed(_) => (Code::Unavailable, WorkerFault::Engine),
            WorkerError::SequenceFailed { .. } => (Code::Internal, WorkerFault::Sequence),
            WorkerError::GrammarFailed { .. } => (Code::InvalidArgument, WorkerFault::Invalid),
            WorkerError::Engine(e) => match e.kind() {
                ErrorKind::Invalid => (Code::InvalidArgument, WorkerFault::Invalid),
                ErrorKind::Capacity => (Code::ResourceExhausted, WorkerFault::Overloaded),
                ErrorKind::Payload => (Code::FailedPrecondition, WorkerFault::Transfer),
                ErrorKind::UnknownSequence => (Code::NotFound, WorkerFault::Sequence),
                // A device fault mid-step: this worker cannot serve, another may.
                ErrorKind::Device => (Code::Unavailable, WorkerFault::Engine),
                // Loading errors never reach a request after start; if one does, this worker's
                // engine is what failed.
                ErrorKind::Setup => (Code::Internal, WorkerFault::Engine),
            },
            WorkerError::Internal(_) => (Code::Internal, WorkerFault::Transfer),
        }
    }

    /// The gRPC code for this error ([`WorkerError::wire`]).
    pub fn code(&self) -> Code {
        self.wire().0
    }

    /// This worker's word on the failure, sent with the status under [`FAULT_KEY`]
    /// ([`WorkerError::wire`]).
    pub fn fault(&self) -> WorkerFault {
        self.wire().1
    }

    /// The status for this error: its code, its message, and its fault tag.
    pub fn status(&self) -> Status {
        let (code, fault) = self.wire();
        tagged(Status::new(code, self.to_string()), fault)
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
