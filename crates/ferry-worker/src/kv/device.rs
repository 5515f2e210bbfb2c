//! KV over a device-to-device pipe per prefill→decode pair: a two-rank NCCL communicator
//! (`--kv-transport nccl`), or CUDA IPC between two processes of one node (`cuda-ipc`: the decode
//! side exports its receive buffer, the prefill side maps it and copies into it; host frames over
//! a Unix socket). Everything below holds for both; the connector says which it is
//! ([`PipeConnector::transport`]).
//!
//! NCCL point-to-point gives an ordered pipe of messages whose sizes both sides must agree on. On
//! it this module runs the same transfer as the other transports — `begin`, checksummed `data`
//! chunks, `end`, then the decode worker's reply — in the TCP data path's [`frame`]s (the fixed
//! header and the body as two messages). The decode side is the same receive loop and state
//! machine as every transport ([`crate::kv::receive::drive`], [`crate::kv::receive::inbound`]), so a pipe changes how
//! bytes move and nothing about what is accepted.
//!
//! - **Layers as buffers.** A layer the engine exported as a [`KvBuffer`] goes as
//!   [`Kind::Buffer`] frames: the header on the host, the body by [`BytePipe::send_buffer`] from
//!   where it lives (on a GPU: device to device, no host copy), checked with a word checksum
//!   computed where the bytes are. The decode side receives them into one body buffer from
//!   [`BytePipe::alloc_buffer`] (on its GPU), which its engine imports from.
//!
//! - **Rendezvous** over the gRPC control plane: the prefill worker (rank 0) creates the unique
//!   id and joins; at the same time it calls `KvTransfer.NcclConnect` on the decode worker, which
//!   joins as rank 1. Both give up after a timeout (NCCL's own init would wait forever).
//! - **One transfer at a time per pipe.** Idle pipes are pooled per decode worker and reused; a
//!   second concurrent transfer to the same worker sets up another pipe, up to
//!   [`crate::kv::send::PipeTransport::MAX_PIPES_PER_PEER`]. A pipe whose operation fails or times out is dropped
//!   (the NCCL communicator is aborted), and the pair is not tried again for a back-off period:
//!   meanwhile transfers fall back to gRPC (see [`Fallback`](crate::kv::send::Fallback)).
//! - Every operation has a deadline. An idle pipe on the decode side closes after
//!   [`IDLE_CLOSE`]; the prefill side retires its idle pipes well before that (sending `close`).
//!
//! The NCCL implementation of [`BytePipe`] lives with the CUDA backend (`ferry-engine`, feature
//! `cuda`); `InProcessConnector` (`kv/in_process.rs`, tests and the `testing` feature) implements
//! the same contract over in-memory queues, so the protocol, the rendezvous and the fallbacks are
//! tested on machines without GPUs.
//!
//! This file holds what both sides share: the pipe's contract ([`BytePipe`], [`PipeConnector`]),
//! and frames on a pipe (the header and the body as two messages). The prefill side is
//! [`crate::kv::send::pipe`], the decode side [`crate::kv::receive::pipe`].

use crate::kv::frame::{self, FrameHeader, Kind, HEADER_BYTES};
use ferry_engine::KvBuffer;
use ferry_proto::v1::KvTransport as Transport;
use prost::Message;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// One end of a two-rank communicator: ordered messages, each received with the exact size it
/// was sent with (NCCL point-to-point semantics). Blocking; every call is bounded by a deadline.
pub trait BytePipe: Send {
    /// Send `data`; the peer takes it with a `recv` of the same length.
    fn send(&mut self, data: &[u8], deadline: Instant) -> std::result::Result<(), String>;
    /// Receive exactly `buf.len()` bytes.
    fn recv(&mut self, buf: &mut [u8], deadline: Instant) -> std::result::Result<(), String>;
    /// Send bytes `range` of `buf` as one message, from where they are (an NCCL pipe sends a
    /// device buffer device to device; this default copies to the host and sends that).
    fn send_buffer(&mut self, buf: &KvBuffer, range: Range<usize>, deadline: Instant) -> std::result::Result<(), String> {
        let host = buf.to_host(range).map_err(|e| e.to_string())?;
        self.send(&host, deadline)
    }
    /// Receive one message of `range.len()` bytes into bytes `range` of `buf`.
    fn recv_buffer(&mut self, buf: &mut KvBuffer, range: Range<usize>, deadline: Instant) -> std::result::Result<(), String> {
        let mut host = vec![0u8; range.len()];
        self.recv(&mut host, deadline)?;
        buf.write(range.start, &host).map_err(|e| e.to_string())
    }
    /// A buffer of `len` bytes to receive a payload body into, where this pipe delivers (the
    /// GPU's memory for NCCL; host memory by default).
    fn alloc_buffer(&mut self, len: usize) -> std::result::Result<KvBuffer, String> {
        Ok(KvBuffer::Host(vec![0; len]))
    }
}

/// Makes pipes: the rendezvous half that each side runs.
pub trait PipeConnector: Send + Sync {
    /// What this is, for logs (`"nccl on cuda:0"`).
    fn describe(&self) -> String;
    /// The transport these pipes are (`Nccl` or `CudaIpc`): what a worker registers, and what
    /// the rendezvous asks the peer for.
    fn transport(&self) -> Transport;
    /// A fresh rendezvous id (rank 0 creates it; the NCCL unique id).
    fn new_id(&self) -> std::result::Result<Vec<u8>, String>;
    /// Join the two-rank communicator `id` as `rank` (0: the prefill worker, 1: the decode
    /// worker). Blocks until both ranks joined, or fails at `timeout`.
    fn connect(&self, id: &[u8], rank: u32, timeout: Duration) -> std::result::Result<Box<dyn BytePipe>, String>;
    /// The CUDA device the pipes live on.
    fn device(&self) -> u32 {
        0
    }
    /// That device's UUID, where known: a NCCL rendezvous between two workers on the same GPU
    /// is refused at once instead of timing out.
    fn device_uuid(&self) -> Option<[u8; 16]>;
    /// How long the prefill side waits for a rendezvous.
    fn connect_timeout(&self) -> Duration {
        Duration::from_secs(10)
    }
}

/// A connector for a worker's config (`Debug` for the config's sake).
#[derive(Clone)]
pub struct Pipes(pub Arc<dyn PipeConnector>);

impl std::fmt::Debug for Pipes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0.describe())
    }
}

/// How long an idle pipe stays open on the decode side.
pub const IDLE_CLOSE: Duration = Duration::from_secs(600);
// ---------------------------------------------------------------------------------------------
// Frames ([`super::frame`]'s format) on a pipe: the header and the body are two messages

pub fn send_frame(pipe: &mut dyn BytePipe, h: FrameHeader, body: &[u8], deadline: Instant) -> std::result::Result<(), String> {
    debug_assert_eq!(h.len as usize, body.len());
    pipe.send(&h.encode(), deadline)?;
    if !body.is_empty() {
        pipe.send(body, deadline)?;
    }
    Ok(())
}

/// Receive one frame; a control frame's body goes into `body` (cleared first), a data or buffer
/// frame's is left for the caller to receive where it belongs.
pub fn recv_frame(pipe: &mut dyn BytePipe, body: &mut Vec<u8>, deadline: Instant) -> std::result::Result<FrameHeader, String> {
    let mut hb = [0u8; HEADER_BYTES];
    pipe.recv(&mut hb, deadline)?;
    let h = FrameHeader::decode(&hb)?;
    body.clear();
    if h.is_chunk() {
        return Ok(h);
    }
    body.resize(h.len as usize, 0);
    if h.len > 0 {
        pipe.recv(body, deadline)?;
    }
    Ok(h)
}

pub fn send_message(pipe: &mut dyn BytePipe, kind: Kind, msg: &impl Message, deadline: Instant) -> std::result::Result<(), String> {
    let f = frame::message(kind, msg);
    pipe.send(&f[..HEADER_BYTES], deadline)?;
    if f.len() > HEADER_BYTES {
        pipe.send(&f[HEADER_BYTES..], deadline)?;
    }
    Ok(())
}

