//! The prefill side of a device pipe ([`crate::kv::device`]): [`PipeTransport`] sends a
//! transfer's frames over a pooled pipe per decode worker, set up by a rendezvous over gRPC.

use super::transport::{Channels, KvLink, KvTransport};
use crate::error::{Result, WorkerError};
use crate::kv::chunks::chunk_ranges;
use crate::kv::device::{recv_frame, send_frame, send_message, BytePipe, PipeConnector};
use crate::kv::frame::{self, FrameHeader, Kind, MAX_BUFFER_FRAME};
use crate::kv::replies::ack_of;
use bytes::Bytes;
use ferry_engine::KvBuffer;
use ferry_proto::v1::kv_transfer_client::KvTransferClient;
use ferry_proto::v1::{kv_chunk, KvAck, KvBegin, KvChunk, KvEnd, KvTarget, KvTransport as Transport, NcclConnectRequest};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The prefill side retires idle pipes sooner, so it never sends into one the peer closed.
const IDLE_RETIRE: Duration = Duration::from_secs(300);


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
        metrics::histogram!(crate::cluster::metrics::names::KV_NCCL_CONNECT_SECONDS, "transport" => kind.to_string()).record(started.elapsed().as_secs_f64());
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
        metrics::counter!(crate::cluster::metrics::names::KV_NCCL_PIPES_LOST).increment(1);
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
        use ferry_core::phase_clock::{record, span};
        let asked = Instant::now();
        let deadline = asked + self.op_timeout;
        let len = buf.len();
        let frames = self
            .op("sending a layer from its buffer", move |p| {
                record("send: hop to a blocking thread (per layer)", asked.elapsed());
                let mut frames = 0;
                for r in chunk_ranges(len, MAX_BUFFER_FRAME) {
                    // On a GPU: waits for the gather, then one reduction kernel.
                    let sum = {
                        let _t = span("send: checksum (waits for the export)");
                        buf.checksum(r.clone()).map_err(|e| format!("checksum of the layer: {e}"))?
                    };
                    let h = FrameHeader { kind: Kind::Buffer, len: r.len() as u64, offset: offset + r.start as u64, crc: sum };
                    {
                        let _t = span("send: frame header");
                        p.send(&h.encode(), deadline)?;
                    }
                    let _t = span("send: frame body (all of the pipe's steps)");
                    p.send_buffer(&buf, r, deadline)?;
                    frames += 1;
                }
                Ok(frames)
            })
            .await?;
        metrics::counter!(crate::cluster::metrics::names::KV_BUFFER_BYTES, "side" => "send").increment(len as u64);
        Ok(frames)
    }

    async fn end(mut self: Box<Self>, end: KvEnd) -> Result<KvAck> {
        let deadline = Instant::now() + self.op_timeout;
        let reply = self
            .op("sending end and waiting for the reply", move |p| {
                let _t = ferry_core::phase_clock::span("send: end, then wait for the reply");
                send_message(p, Kind::End, &KvChunk { transfer_id: 0, part: Some(kv_chunk::Part::End(end)) }, deadline)?;
                let mut body = Vec::new();
                let h = recv_frame(p, &mut body, deadline)?;
                frame::reply(&h, &body)
            })
            .await?;
        ferry_core::phase_clock::print_report("kv pipe sender, one transfer");
        // The transfer is over either way: the pipe is in step and goes back to the pool.
        if let Some(pipe) = self.pipe.take() {
            PipeTransport::give_back(&self.peers, &self.peer, pipe);
        }
        ack_of(&self.peer, reply)
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
