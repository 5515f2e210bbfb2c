//! The receiver's reply to a transfer, both ways: a [`WorkerError`] as the `KvError` a decode
//! worker answers with, and that answer as the sender's result.

use crate::error::{Result, WorkerError};
use ferry_proto::v1::{kv_ack_frame, KvAck, KvAckFrame};

/// A receiver's reply frame (TCP data path, NCCL pipes) as the transfer's result.
pub fn ack_of(peer: &str, reply: KvAckFrame) -> Result<KvAck> {
    match reply.result {
        Some(kv_ack_frame::Result::Ack(a)) => Ok(a),
        Some(kv_ack_frame::Result::Error(e)) => Err(WorkerError::PeerRefused { peer: peer.to_string(), status: status_of(&e) }),
        None => Err(unavailable(peer, "empty reply")),
    }
}

/// A reply frame's error as the status it stands for (code, message, fault tag).
pub fn status_of(e: &ferry_proto::v1::KvError) -> tonic::Status {
    let status = tonic::Status::new(tonic::Code::from_i32(e.code), e.message.clone());
    match ferry_core::failure::WorkerFault::parse(&e.fault) {
        Some(f) => crate::error::tagged(status, f),
        None => status,
    }
}

/// A receiver's error as a reply frame: its code, message and fault tag.
pub fn kv_error(e: &WorkerError) -> ferry_proto::v1::KvError {
    ferry_proto::v1::KvError { code: e.code() as i32, message: e.to_string(), fault: e.fault().as_str().to_string() }
}

pub fn unavailable(peer: &str, what: impl std::fmt::Display) -> WorkerError {
    WorkerError::PeerUnavailable { peer: peer.to_string(), what: what.to_string() }
}

