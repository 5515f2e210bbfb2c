//! `KvTransfer` on a decode worker: `PushKv` (a transfer's chunks as a client-streaming gRPC
//! call, one [`InboundLink`] under the receive loop) and `NcclConnect` (the rendezvous of a
//! device pipe, [`super::pipe`]).

use super::assembler::Target;
use super::drive::{before_stall, drive, InboundLink, Session};
use super::inbound::{Event, Link};
use super::pipe::{accept, PipeSlots};
use super::transfers::KvReceiver;
use crate::error::{Result, WorkerError};
use crate::kv::chunks::Chunk;
use crate::kv::device::PipeConnector;
use crate::kv::replies::status_of;
use bytes::Bytes;
use ferry_proto::v1::{kv_ack_frame, kv_chunk, KvAck, KvAckFrame, KvChunk, NcclConnectRequest, NcclConnectResponse};
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status, Streaming};

/// `KvTransfer`: `PushKv` (chunks as a client-streaming gRPC call) and `NcclConnect` (the
/// rendezvous of a device-to-device pipe, see [`super::pipe`]).
pub struct KvTransferService {
    receiver: Arc<KvReceiver>,
    pipes: Option<Arc<dyn PipeConnector>>,
    /// Longest wait for the next chunk (or pipe frame) of a transfer that has begun.
    stall: Duration,
    pipe_slots: PipeSlots,
}

impl KvTransferService {
    pub fn new(receiver: Arc<KvReceiver>, pipes: Option<Arc<dyn PipeConnector>>, stall: Duration) -> Self {
        KvTransferService { receiver, pipes, stall, pipe_slots: Default::default() }
    }
}

/// `PushKv`'s stream as a link: protobuf messages are its frames, the reply its response.
struct GrpcInbound {
    stream: Streaming<KvChunk>,
    stall: Duration,
    /// The transfer the first message named; every later one must name it too.
    id: Option<u64>,
    /// The bytes of the data chunk read last.
    data: Bytes,
    reply: Option<KvAckFrame>,
}

impl InboundLink for GrpcInbound {
    async fn next(&mut self, _idle: bool) -> Event {
        let msg = match before_stall(self.stall, self.stream.message()).await {
            Ok(Ok(Some(m))) => m,
            Ok(Ok(None)) => return Event::Closed,
            Ok(Err(status)) => return Event::Broken(status.to_string()),
            Err(stalled) => return stalled,
        };
        if *self.id.get_or_insert(msg.transfer_id) != msg.transfer_id {
            return Event::Malformed("chunk for another transfer".into());
        }
        match msg.part {
            Some(kv_chunk::Part::Begin(begin)) => Event::Begin { id: msg.transfer_id, begin },
            Some(kv_chunk::Part::Data(d)) => {
                let c = Chunk { offset: d.offset, len: d.data.len(), crc: d.crc32, buffer: false };
                self.data = d.data;
                Event::Chunk(c)
            }
            Some(kv_chunk::Part::End(end)) => Event::End(end),
            None => Event::Malformed("a chunk with no part".into()),
        }
    }

    async fn take(&mut self, _c: Chunk, target: Target<'_>) -> Event {
        match target {
            Target::Host(v) => {
                v.extend_from_slice(&std::mem::take(&mut self.data));
                Event::Landed
            }
            Target::Buffer(..) => Event::Broken("a gRPC chunk cannot fill a device buffer".into()),
        }
    }

    async fn skip(&mut self, _c: Chunk) -> Event {
        self.data = Bytes::new();
        Event::Landed
    }

    async fn reply(&mut self, reply: KvAckFrame) -> Result<()> {
        self.reply = Some(reply);
        Ok(())
    }
}

#[tonic::async_trait]
impl ferry_proto::v1::kv_transfer_server::KvTransfer for KvTransferService {
    async fn push_kv(&self, req: Request<Streaming<KvChunk>>) -> std::result::Result<Response<KvAck>, Status> {
        let mut link = GrpcInbound { stream: req.into_inner(), stall: self.stall, id: None, data: Bytes::new(), reply: None };
        let mut session = Session::new(&self.receiver, Link::Stream);
        let driven = drive(&mut session, &mut link).await;
        match (link.reply, driven) {
            (Some(KvAckFrame { result: Some(kv_ack_frame::Result::Ack(ack)) }), _) => Ok(Response::new(ack)),
            (Some(KvAckFrame { result: Some(kv_ack_frame::Result::Error(e)) }), _) => Err(status_of(&e)),
            (_, Err(e)) => Err(e.into()),
            (_, Ok(())) => Err(WorkerError::Internal("the KV stream ended without an answer".into()).into()),
        }
    }

    async fn nccl_connect(&self, req: Request<NcclConnectRequest>) -> std::result::Result<Response<NcclConnectResponse>, Status> {
        let req = req.into_inner();
        let peer = req.peer.clone();
        match accept(self.receiver.clone(), self.pipes.clone(), req, self.stall, &self.pipe_slots).await {
            Ok(device) => {
                metrics::counter!(crate::cluster::metrics::names::KV_NCCL_CONNECTS, "outcome" => "ok").increment(1);
                Ok(Response::new(NcclConnectResponse { device }))
            }
            Err(e) => {
                metrics::counter!(crate::cluster::metrics::names::KV_NCCL_CONNECTS, "outcome" => "error").increment(1);
                tracing::warn!(peer = %peer, "NCCL rendezvous failed: {e}");
                // UNAVAILABLE rather than ABORTED: the prefill side falls back to another transport.
                let code = match &e {
                    WorkerError::PeerUnavailable { .. } => tonic::Code::Unavailable,
                    e => e.code(),
                };
                Err(crate::error::tagged(Status::new(code, e.to_string()), e.fault()))
            }
        }
    }
}
