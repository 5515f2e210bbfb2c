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
//! machine as every transport ([`super::drive`], [`super::inbound`]), so a pipe changes how
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
//!   [`PipeTransport::MAX_PIPES_PER_PEER`]. A pipe whose operation fails or times out is dropped
//!   (the NCCL communicator is aborted), and the pair is not tried again for a back-off period:
//!   meanwhile transfers fall back to gRPC (see [`Fallback`](super::transport::Fallback)).
//! - Every operation has a deadline. An idle pipe on the decode side closes after
//!   [`IDLE_CLOSE`]; the prefill side retires its idle pipes well before that (sending `close`).
//!
//! The NCCL implementation of [`BytePipe`] lives with the CUDA backend (`ferry-engine`, feature
//! `cuda`); `InProcessConnector` (`kv/in_process.rs`, tests and the `testing` feature) implements
//! the same contract over in-memory queues, so the protocol, the rendezvous and the fallbacks are
//! tested on machines without GPUs.

use super::assembler::Target;
use super::drive::{drive, InboundLink, Session};
use super::frame::{self, FrameHeader, Kind, HEADER_BYTES, MAX_BUFFER_FRAME};
use super::inbound::{Chunk, Event, Link};
use super::receiver::KvReceiver;
use super::transport::{Channels, KvLink, KvTransport};
use super::MAX_CHUNK_BYTES;
use crate::{Result, WorkerError};
#[cfg(any(test, feature = "testing"))]
pub use super::in_process::InProcessConnector;
use bytes::Bytes;
use ferry_engine::KvBuffer;
use ferry_proto::v1::kv_transfer_client::KvTransferClient;
use ferry_proto::v1::{kv_chunk, KvAck, KvAckFrame, KvBegin, KvChunk, KvEnd, KvTarget, KvTransport as Transport, NcclConnectRequest};
use prost::Message;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};
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
/// The prefill side retires idle pipes sooner, so it never sends into one the peer closed.
const IDLE_RETIRE: Duration = Duration::from_secs(300);

// ---------------------------------------------------------------------------------------------
// Frames ([`super::frame`]'s format) on a pipe: the header and the body are two messages

fn send_frame(pipe: &mut dyn BytePipe, h: FrameHeader, body: &[u8], deadline: Instant) -> std::result::Result<(), String> {
    debug_assert_eq!(h.len as usize, body.len());
    pipe.send(&h.encode(), deadline)?;
    if !body.is_empty() {
        pipe.send(body, deadline)?;
    }
    Ok(())
}

/// Receive one frame; a control frame's body goes into `body` (cleared first), a data or buffer
/// frame's is left for the caller to receive where it belongs.
fn recv_frame(pipe: &mut dyn BytePipe, body: &mut Vec<u8>, deadline: Instant) -> std::result::Result<FrameHeader, String> {
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

fn send_message(pipe: &mut dyn BytePipe, kind: Kind, msg: &impl Message, deadline: Instant) -> std::result::Result<(), String> {
    let f = frame::message(kind, msg);
    pipe.send(&f[..HEADER_BYTES], deadline)?;
    if f.len() > HEADER_BYTES {
        pipe.send(&f[HEADER_BYTES..], deadline)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Prefill side

struct Idle {
    pipe: Box<dyn BytePipe>,
    since: Instant,
}

#[derive(Default)]
struct Peers {
    idle: HashMap<String, Vec<Idle>>,
    /// Pipes open (idle or busy) per peer.
    open: HashMap<String, usize>,
    /// Peers whose last set-up or transfer failed: not tried again before this instant.
    backoff: HashMap<String, Instant>,
}

/// Sends KV over pipes (the prefill side of the NCCL transport).
pub struct PipeTransport {
    connector: Arc<dyn PipeConnector>,
    /// `connector.transport()`.
    kind: Transport,
    channels: Channels,
    peers: Arc<Mutex<Peers>>,
    /// This worker's name and model fingerprint (sent with the rendezvous).
    name: String,
    fingerprint: String,
    /// Bound on each frame, and on waiting for the reply after `end`.
    pub op_timeout: Duration,
    /// After a failure, how long the pair goes without trying this transport again.
    pub backoff: Duration,
}

impl PipeTransport {
    /// At most this many pipes to one decode worker (one per concurrent transfer).
    pub const MAX_PIPES_PER_PEER: usize = 4;

    pub fn new(connector: Arc<dyn PipeConnector>, channels: Channels, name: String, fingerprint: String) -> Self {
        PipeTransport {
            kind: connector.transport(),
            connector,
            channels,
            peers: Arc::default(),
            name,
            fingerprint,
            op_timeout: Duration::from_secs(30),
            backoff: Duration::from_secs(30),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Peers> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An idle pipe to `peer`, retiring stale ones; or a reserved slot for a new one (`None`).
    fn take_idle(&self, peer: &str) -> Result<Option<Box<dyn BytePipe>>> {
        let mut p = self.lock();
        if let Some(until) = p.backoff.get(peer) {
            if Instant::now() < *until {
                let left = until.saturating_duration_since(Instant::now());
                return Err(unavailable(peer, format!("{} to this peer failed recently; not retried for another {:.0} s", self.kind, left.as_secs_f64())));
            }
        }
        let mut retired = Vec::new();
        let mut found = None;
        if let Some(list) = p.idle.get_mut(peer) {
            while let Some(i) = list.pop() {
                if i.since.elapsed() < IDLE_RETIRE {
                    found = Some(i.pipe);
                    break;
                }
                retired.push(i.pipe);
            }
        }
        let open = p.open.entry(peer.to_string()).or_insert(0);
        *open -= retired.len().min(*open);
        if found.is_none() {
            if *open >= Self::MAX_PIPES_PER_PEER {
                return Err(unavailable(peer, format!("{} {} pipes to this peer are all busy", Self::MAX_PIPES_PER_PEER, self.kind)));
            }
            *open += 1;
        }
        drop(p);
        for mut pipe in retired {
            tokio::task::spawn_blocking(move || {
                let _ = send_frame(pipe.as_mut(), FrameHeader::control(Kind::Close, 0), &[], Instant::now() + Duration::from_secs(2));
            });
        }
        Ok(found)
    }

    async fn rendezvous(&self, target: &KvTarget) -> Result<Box<dyn BytePipe>> {
        let peer = &target.grpc_addr;
        let started = Instant::now();
        let kind = self.kind;
        let id = self.connector.new_id().map_err(|e| unavailable(peer, format!("{kind} rendezvous id: {e}")))?;
        let timeout = self.connector.connect_timeout();
        let (connector, local_id) = (self.connector.clone(), id.clone());
        let local = tokio::task::spawn_blocking(move || connector.connect(&local_id, 0, timeout));
        let mut client = KvTransferClient::new(self.channels.get(peer)?);
        let req = NcclConnectRequest { unique_id: id.into(), peer: self.name.clone(), timeout_ms: timeout.as_millis() as u32, fingerprint: self.fingerprint.clone(), transport: kind as i32, device_uuid: self.connector.device_uuid().map(|u| u.to_vec()).unwrap_or_default().into() };
        let remote = tokio::time::timeout(timeout + Duration::from_secs(1), client.nccl_connect(req)).await;
        let remote = match remote {
            Ok(Ok(r)) => r.into_inner(),
            // The local join then times out on its own (its thread ends at `connect_timeout`).
            Ok(Err(s)) => return Err(unavailable(peer, format!("{kind} rendezvous refused: {}", s.message()))),
            Err(_) => return Err(unavailable(peer, format!("{kind} rendezvous timed out after {} ms", timeout.as_millis()))),
        };
        let pipe = local
            .await
            .map_err(|e| WorkerError::Internal(e.to_string()))?
            .map_err(|e| unavailable(peer, format!("{kind} pipe: {e}")))?;
        metrics::histogram!("ferry_kv_nccl_connect_seconds", "transport" => kind.to_string()).record(started.elapsed().as_secs_f64());
        tracing::info!(peer = %peer, device = remote.device, ms = started.elapsed().as_millis() as u64, transport = %kind, "device pipe up");
        Ok(pipe)
    }

    /// Give back the slot of a pipe that was lost, and keep away from the peer for a while.
    fn lost(peers: &Mutex<Peers>, peer: &str, backoff: Duration) {
        let mut p = peers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = p.open.get_mut(peer) {
            *n = n.saturating_sub(1);
        }
        p.backoff.insert(peer.to_string(), Instant::now() + backoff);
        metrics::counter!("ferry_kv_nccl_pipes_lost_total").increment(1);
    }

    fn give_back(peers: &Mutex<Peers>, peer: &str, pipe: Box<dyn BytePipe>) {
        let mut p = peers.lock().unwrap_or_else(|p| p.into_inner());
        p.backoff.remove(peer);
        p.idle.entry(peer.to_string()).or_default().push(Idle { pipe, since: Instant::now() });
    }

    /// Pipes now idle to `peer` (for tests and metrics).
    pub fn idle_pipes(&self, peer: &str) -> usize {
        self.lock().idle.get(peer).map_or(0, |l| l.len())
    }
}

fn unavailable(peer: &str, what: impl std::fmt::Display) -> WorkerError {
    WorkerError::PeerUnavailable { peer: peer.to_string(), what: what.to_string() }
}

/// Run a blocking pipe operation off the async runtime, moving the pipe there and back.
async fn on_pipe<T: Send + 'static>(
    mut pipe: Box<dyn BytePipe>,
    f: impl FnOnce(&mut dyn BytePipe) -> std::result::Result<T, String> + Send + 'static,
) -> (Option<Box<dyn BytePipe>>, std::result::Result<T, String>) {
    match tokio::task::spawn_blocking(move || {
        let r = f(pipe.as_mut());
        (pipe, r)
    })
    .await
    {
        Ok((pipe, r)) => (Some(pipe), r),
        Err(e) => (None, Err(format!("pipe task failed: {e}"))),
    }
}

#[tonic::async_trait]
impl KvTransport for PipeTransport {
    fn kind(&self) -> Transport {
        self.kind
    }

    async fn open(&self, target: &KvTarget, begin: KvBegin) -> Result<Box<dyn KvLink>> {
        let peer = target.grpc_addr.clone();
        let (pipe, fresh) = match self.take_idle(&peer)? {
            Some(p) => (p, false),
            None => match self.rendezvous(target).await {
                Ok(p) => (p, true),
                Err(e) => {
                    Self::lost(&self.peers, &peer, self.backoff);
                    return Err(e);
                }
            },
        };
        let msg = KvChunk { transfer_id: target.transfer_id, part: Some(kv_chunk::Part::Begin(begin)) };
        let deadline = Instant::now() + self.op_timeout;
        let (pipe, r) = on_pipe(pipe, move |p| send_message(p, Kind::Begin, &msg, deadline)).await;
        match (pipe, r) {
            (Some(pipe), Ok(())) => Ok(Box::new(PipeLink { pipe: Some(pipe), peer, peers: self.peers.clone(), op_timeout: self.op_timeout, backoff: self.backoff, kind: self.kind })),
            (_, Err(e)) => {
                Self::lost(&self.peers, &peer, self.backoff);
                Err(unavailable(&peer, format!("{} pipe ({}): sending begin: {e}", self.kind, if fresh { "new" } else { "pooled" })))
            }
            (None, Ok(())) => unreachable!("a pipe task that returned Ok gave the pipe back"),
        }
    }
}

struct PipeLink {
    /// `None` once the transfer ended or the pipe was lost.
    pipe: Option<Box<dyn BytePipe>>,
    peer: String,
    peers: Arc<Mutex<Peers>>,
    op_timeout: Duration,
    backoff: Duration,
    kind: Transport,
}

impl PipeLink {
    async fn op<T: Send + 'static>(&mut self, what: &str, f: impl FnOnce(&mut dyn BytePipe) -> std::result::Result<T, String> + Send + 'static) -> Result<T> {
        let pipe = self.pipe.take().ok_or_else(|| unavailable(&self.peer, format!("{} pipe already closed", self.kind)))?;
        let (pipe, r) = on_pipe(pipe, f).await;
        match r {
            Ok(v) => {
                self.pipe = pipe;
                Ok(v)
            }
            Err(e) => {
                // A failed or timed-out operation leaves the pipe out of step: drop it (which
                // aborts the communicator), and keep away from the peer for a while.
                PipeTransport::lost(&self.peers, &self.peer, self.backoff);
                Err(unavailable(&self.peer, format!("{} pipe: {what}: {e}", self.kind)))
            }
        }
    }
}

#[tonic::async_trait]
impl KvLink for PipeLink {
    fn kind(&self) -> Transport {
        self.kind
    }

    async fn data(&mut self, offset: u64, data: Bytes, crc: u32) -> Result<()> {
        let deadline = Instant::now() + self.op_timeout;
        let h = FrameHeader { kind: Kind::Data, len: data.len() as u64, offset, crc };
        self.op("sending data", move |p| send_frame(p, h, &data, deadline)).await
    }

    fn takes_buffers(&self) -> bool {
        true
    }

    async fn buffer(&mut self, offset: u64, buf: KvBuffer) -> Result<u32> {
        let deadline = Instant::now() + self.op_timeout;
        let len = buf.len();
        let frames = self
            .op("sending a layer from its buffer", move |p| {
                let mut frames = 0;
                for r in super::chunk_ranges(len, MAX_BUFFER_FRAME) {
                    // On a GPU: waits for the gather, then one reduction kernel.
                    let sum = buf.checksum(r.clone()).map_err(|e| format!("checksum of the layer: {e}"))?;
                    let h = FrameHeader { kind: Kind::Buffer, len: r.len() as u64, offset: offset + r.start as u64, crc: sum };
                    p.send(&h.encode(), deadline)?;
                    p.send_buffer(&buf, r, deadline)?;
                    frames += 1;
                }
                Ok(frames)
            })
            .await?;
        metrics::counter!("ferry_kv_buffer_bytes_total", "side" => "send").increment(len as u64);
        Ok(frames)
    }

    async fn end(mut self: Box<Self>, end: KvEnd) -> Result<KvAck> {
        let deadline = Instant::now() + self.op_timeout;
        let reply = self
            .op("sending end and waiting for the reply", move |p| {
                send_message(p, Kind::End, &KvChunk { transfer_id: 0, part: Some(kv_chunk::Part::End(end)) }, deadline)?;
                let mut body = Vec::new();
                let h = recv_frame(p, &mut body, deadline)?;
                frame::reply(&h, &body)
            })
            .await?;
        // The transfer is over either way: the pipe is in step and goes back to the pool.
        if let Some(pipe) = self.pipe.take() {
            PipeTransport::give_back(&self.peers, &self.peer, pipe);
        }
        super::transport::ack_of(&self.peer, reply)
    }
}

impl Drop for PipeLink {
    /// Abandoned mid-transfer (the prefill failed or was cancelled): tell the decode side, so the
    /// pipe stays in step and goes back to the pool; if that fails, the pipe is dropped.
    fn drop(&mut self) {
        let Some(mut pipe) = self.pipe.take() else { return };
        let (peer, peers, backoff) = (self.peer.clone(), self.peers.clone(), self.backoff);
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            PipeTransport::lost(&peers, &peer, backoff);
            return;
        };
        rt.spawn_blocking(move || {
            match send_frame(pipe.as_mut(), FrameHeader::control(Kind::Abort, 0), &[], Instant::now() + Duration::from_secs(5)) {
                Ok(()) => PipeTransport::give_back(&peers, &peer, pipe),
                Err(_) => PipeTransport::lost(&peers, &peer, backoff),
            }
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Decode side

/// `KvTransfer.NcclConnect`: join the communicator, then serve transfers on it from a thread of
/// its own until the peer closes it, it idles for [`IDLE_CLOSE`], or an operation fails.
pub async fn accept(receiver: Arc<KvReceiver>, connector: Option<Arc<dyn PipeConnector>>, req: NcclConnectRequest, op_timeout: Duration, slots: &PipeSlots) -> Result<u32> {
    // Peers that predate the field ask for NCCL.
    let wanted = match Transport::try_from(req.transport).unwrap_or(Transport::Unspecified) {
        Transport::Unspecified => Transport::Nccl,
        k => k,
    };
    let connector = match connector {
        Some(c) if c.transport() == wanted => c,
        Some(c) => return Err(WorkerError::PeerUnavailable { peer: req.peer, what: format!("this decode worker's device pipes are {}, not {wanted}", c.transport()) }),
        None => return Err(WorkerError::PeerUnavailable { peer: req.peer, what: format!("this decode worker has no {wanted} pipes (it runs on the CPU, or the library could not be loaded)") }),
    };
    if wanted == Transport::Nccl && !req.device_uuid.is_empty() && connector.device_uuid().is_some_and(|u| req.device_uuid[..] == u[..]) {
        return Err(WorkerError::PeerUnavailable {
            peer: req.peer,
            what: "both workers are on the same GPU, where NCCL cannot pair two ranks (use --kv-transport cuda-ipc)".into(),
        });
    }
    if req.fingerprint != receiver.fingerprint() {
        return Err(WorkerError::Incompatible { id: 0, what: format!("{wanted} peer {} serves model {}, this worker {}", req.peer, req.fingerprint, receiver.fingerprint()) });
    }
    // Held from here until the pipe closes: the rendezvous RPC is not authenticated by a
    // transfer token, so what callers can make this worker hold is bounded.
    let slot = slots.take().ok_or_else(|| WorkerError::Exhausted(format!("{} device pipes are open or being set up on this worker", PipeSlots::MAX)))?;
    let timeout = Duration::from_millis(req.timeout_ms.clamp(100, 30_000) as u64);
    let id = req.unique_id.to_vec();
    let c = connector.clone();
    let pipe = tokio::task::spawn_blocking(move || c.connect(&id, 1, timeout))
        .await
        .map_err(|e| WorkerError::Internal(e.to_string()))?
        .map_err(|e| WorkerError::PeerUnavailable { peer: req.peer.clone(), what: format!("{wanted} pipe: {e}") })?;
    let rt = tokio::runtime::Handle::current();
    let peer = req.peer.clone();
    std::thread::Builder::new()
        .name("ferry-kv-pipe".into())
        .spawn(move || {
            let _slot = slot;
            metrics::gauge!("ferry_kv_nccl_pipes").increment(1.0);
            match serve(&receiver, pipe, &rt, op_timeout) {
                Ok(()) => tracing::debug!(peer = %peer, transport = %wanted, "device pipe closed"),
                Err(e) => tracing::warn!(peer = %peer, transport = %wanted, "device pipe dropped: {e}"),
            }
            metrics::gauge!("ferry_kv_nccl_pipes").decrement(1.0);
        })
        .map_err(|e| WorkerError::Internal(format!("starting a KV pipe thread: {e}")))?;
    Ok(connector.device())
}

/// The pipes (open or being set up) a decode worker allows at once.
#[derive(Default)]
pub struct PipeSlots(Arc<std::sync::atomic::AtomicUsize>);

/// One taken slot, given back when dropped.
pub struct PipeSlot(Arc<std::sync::atomic::AtomicUsize>);

impl PipeSlots {
    pub const MAX: usize = 64;

    fn take(&self) -> Option<PipeSlot> {
        use std::sync::atomic::Ordering::AcqRel;
        self.0.fetch_update(AcqRel, std::sync::atomic::Ordering::Acquire, |n| (n < Self::MAX).then_some(n + 1)).ok()?;
        Some(PipeSlot(self.0.clone()))
    }

    /// Slots now taken.
    pub fn taken(&self) -> usize {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

impl Drop for PipeSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// A pipe as a link: transfers one after another; every receive is bounded by a deadline (the
/// idle close between transfers, the operation timeout inside one).
struct PipeInbound {
    pipe: Box<dyn BytePipe>,
    op_timeout: Duration,
    /// Scratch for control bodies and dropped chunks.
    body: Vec<u8>,
}

impl PipeInbound {
    fn deadline(&self) -> Instant {
        Instant::now() + self.op_timeout
    }
}

/// A pipe operation that failed: the pipe is out of step.
fn pipe_broken(e: String) -> Event {
    Event::Broken(format!("device pipe: {e}"))
}

impl InboundLink for PipeInbound {
    async fn next(&mut self, idle: bool) -> Event {
        let deadline = Instant::now() + if idle { IDLE_CLOSE } else { self.op_timeout };
        match recv_frame(self.pipe.as_mut(), &mut self.body, deadline) {
            Ok(h) => h.event(&self.body),
            Err(e) => pipe_broken(e),
        }
    }

    async fn take(&mut self, c: Chunk, target: Target<'_>) -> Event {
        let deadline = self.deadline();
        let r = match target {
            Target::Host(v) => {
                let start = v.len();
                v.resize(start + c.len, 0);
                let r = self.pipe.recv(&mut v[start..], deadline);
                if r.is_err() {
                    v.truncate(start);
                }
                r
            }
            Target::Buffer(buf, range) => self.pipe.recv_buffer(buf, range, deadline),
        };
        match r {
            Ok(()) => {
                if c.buffer {
                    metrics::counter!("ferry_kv_buffer_bytes_total", "side" => "receive").increment(c.len as u64);
                }
                Event::Landed
            }
            Err(e) => pipe_broken(e),
        }
    }

    async fn skip(&mut self, c: Chunk) -> Event {
        let deadline = self.deadline();
        let r = if c.buffer {
            // Where buffer frames are received (device memory under NCCL), as the sender sent it.
            self.pipe.alloc_buffer(c.len).and_then(|mut scratch| self.pipe.recv_buffer(&mut scratch, 0..c.len, deadline))
        } else {
            self.body.resize(c.len, 0);
            self.pipe.recv(&mut self.body, deadline)
        };
        r.map_or_else(pipe_broken, |()| Event::Landed)
    }

    fn alloc(&mut self, len: usize) -> std::result::Result<KvBuffer, String> {
        self.pipe.alloc_buffer(len)
    }

    async fn reply(&mut self, reply: KvAckFrame) -> Result<()> {
        let deadline = self.deadline();
        send_message(self.pipe.as_mut(), Kind::Reply, &reply, deadline)
            .map_err(|e| WorkerError::PeerUnavailable { peer: "prefill worker".into(), what: format!("device pipe: sending the reply: {e}") })
    }
}

/// Serve transfers on `pipe` (blocking: this is the pipe's own thread) until the sender retires
/// it, it idles for [`IDLE_CLOSE`], or an operation fails.
pub(super) fn serve(receiver: &Arc<KvReceiver>, pipe: Box<dyn BytePipe>, rt: &tokio::runtime::Handle, op_timeout: Duration) -> Result<()> {
    let mut link = PipeInbound { pipe, op_timeout, body: Vec::with_capacity(MAX_CHUNK_BYTES) };
    rt.block_on(drive(&mut Session::new(receiver, Link::Pipe), &mut link))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipe_slots_are_bounded_and_come_back() {
        let slots = PipeSlots::default();
        let held: Vec<PipeSlot> = (0..PipeSlots::MAX).map(|_| slots.take().expect("a slot")).collect();
        assert!(slots.take().is_none(), "no slot past the limit");
        drop(held);
        assert_eq!(slots.taken(), 0);
        assert!(slots.take().is_some());
    }

    #[test]
    fn in_process_pipes_need_both_ranks_and_matching_sizes() {
        let c = InProcessConnector::new();
        let id = c.new_id().unwrap();
        let c2 = c.clone();
        let id2 = id.clone();
        let t = std::thread::spawn(move || c2.connect(&id2, 1, Duration::from_secs(5)));
        let mut a = c.connect(&id, 0, Duration::from_secs(5)).unwrap();
        let mut b = t.join().unwrap().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        a.send(b"hello", deadline).unwrap();
        let mut buf = [0u8; 5];
        b.recv(&mut buf, deadline).unwrap();
        assert_eq!(&buf, b"hello");
        a.send(b"hi", deadline).unwrap();
        let mut wrong = [0u8; 3];
        assert!(b.recv(&mut wrong, deadline).unwrap_err().contains("sizes must match"));
        // Only one rank joins: it gives up at its timeout.
        let id = c.new_id().unwrap();
        let t0 = Instant::now();
        assert!(c.connect(&id, 0, Duration::from_millis(100)).is_err());
        assert!(t0.elapsed() >= Duration::from_millis(100));
    }

    /// First GPU run: a NCCL pair on one GPU waited out the 10 s connect timeout before falling
    /// back. With both UUIDs known, the decode side refuses at once.
    #[tokio::test]
    async fn a_nccl_pair_on_one_gpu_is_refused_at_once() {
        let layout = ferry_core::KvLayout { dtype: ferry_core::KvDtype::F32, block_size: 16, n_layers: 1, n_kv_heads: 1, head_dim: 4 };
        let receiver = KvReceiver::sink("fp".into(), layout);
        let c = InProcessConnector::new();
        *c.uuid.lock().unwrap() = Some([7; 16]);
        let req = |uuid: &[u8]| NcclConnectRequest { unique_id: c.new_id().unwrap().into(), peer: "p".into(), timeout_ms: 100, fingerprint: "fp".into(), transport: Transport::Nccl as i32, device_uuid: uuid.to_vec().into() };
        let slots = PipeSlots::default();
        let t = Instant::now();
        let e = accept(receiver.clone(), Some(c.clone()), req(&[7; 16]), Duration::from_secs(1), &slots).await.unwrap_err();
        assert!(e.to_string().contains("same GPU"), "{e}");
        assert!(t.elapsed() < Duration::from_secs(1));
        // Another GPU's UUID goes on to the rendezvous (which times out here: no rank 0 joins).
        let e = accept(receiver, Some(c.clone()), req(&[8; 16]), Duration::from_secs(1), &slots).await.unwrap_err();
        assert!(!e.to_string().contains("same GPU"), "{e}");
    }
}
