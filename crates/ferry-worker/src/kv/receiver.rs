//! The decode side of a KV transfer: transfers it admitted and waits for, and the ways chunks
//! arrive (the `KvTransfer.PushKv` gRPC stream and the TCP data path here, the device pipe in
//! [`super::pipe`]). Each is a thin [`InboundLink`] under the one receive loop ([`drive`]) and
//! its [`super::inbound`] state machine; a finished payload goes to the request that admitted
//! it, which imports it and only then lets the receiver acknowledge (so the prefill side's lease
//! covers the whole handoff).

use super::assembler::{payload_len, Assembled, Expectation, Target};
use super::drive::{before_stall, drive, InboundLink, Session};
use super::frame::{self, Kind};
use super::inbound::{Chunk, Event, Link};
use crate::{Result, WorkerError};
use bytes::Bytes;
use ferry_core::{KvLayout, KvSpan};
use ferry_proto::v1::{kv_ack_frame, kv_chunk, KvAck, KvAckFrame, KvChunk, KvError, NcclConnectRequest, NcclConnectResponse};
use ferry_proto::ClusterSecret;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tonic::{Request, Response, Status, Streaming};

/// A complete payload handed to the request that admitted it; `ack` answers the sender.
pub struct Delivery {
    pub assembled: Assembled,
    pub ack: oneshot::Sender<Result<(), Status>>,
}

/// Where an admitted transfer's payload (or its failure) goes: the request waiting for it.
pub(crate) type Waiter = oneshot::Sender<Result<Delivery, Status>>;

struct Pending {
    want: Expectation,
    tx: Waiter,
}

/// Recycled payload buffers. A fresh multi-megabyte allocation costs a page fault per 4 KiB
/// (measured here: 94 MB took 77 ms to fault in, four times the copy itself), so buffers are reused.
#[derive(Default)]
pub struct BufferPool(Mutex<Vec<Vec<u8>>>);

impl BufferPool {
    /// Most buffers kept.
    const KEEP: usize = 8;

    /// The smallest kept buffer that holds `len` bytes, else a new empty one.
    pub fn take(&self, len: usize) -> Vec<u8> {
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let best = v.iter().enumerate().filter(|(_, b)| b.capacity() >= len).min_by_key(|(_, b)| b.capacity()).map(|(i, _)| i);
        match best {
            Some(i) => v.swap_remove(i),
            None => Vec::new(),
        }
    }

    pub fn give(&self, mut buf: Vec<u8>) {
        buf.clear();
        let mut v = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if v.len() < Self::KEEP {
            v.push(buf);
        } else if let Some(smallest) = v.iter_mut().min_by_key(|b| b.capacity()) {
            if smallest.capacity() < buf.capacity() {
                *smallest = buf;
            }
        }
    }
}

pub struct KvReceiver {
    pub buffers: BufferPool,
    fingerprint: String,
    layout: KvLayout,
    pending: Mutex<HashMap<u64, Pending>>,
    next_id: AtomicU64,
    /// Benchmark mode: accept any transfer id with a matching model, validate, discard.
    sink: bool,
}

/// An admitted transfer: the receiving half of its delivery. Dropping it withdraws the transfer.
pub struct Ticket {
    pub id: u64,
    pub rx: oneshot::Receiver<Result<Delivery, Status>>,
    owner: Arc<KvReceiver>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.owner.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
    }
}

impl KvReceiver {
    pub fn new(fingerprint: String, layout: KvLayout) -> Arc<Self> {
        Arc::new(Self { buffers: BufferPool::default(), fingerprint, layout, pending: Mutex::default(), next_id: AtomicU64::new(1), sink: false })
    }

    /// A receiver that validates and discards every transfer (for `ferry bench kv`).
    pub fn sink(fingerprint: String, layout: KvLayout) -> Arc<Self> {
        Arc::new(Self { buffers: BufferPool::default(), fingerprint, layout, pending: Mutex::default(), next_id: AtomicU64::new(1), sink: true })
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Admit a transfer of the KV of a `prompt_tokens`-token prompt, to be accepted only from a
    /// sender that presents `token` (the router's, for this request).
    pub fn expect(self: &Arc<Self>, prompt_tokens: usize, token: String) -> Ticket {
        self.expect_from(prompt_tokens, 0, token)
    }

    /// As [`KvReceiver::expect`], when this worker holds the prompt's first `start` tokens (its
    /// cached prefix): the sender ships tokens `start..prompt_tokens` only.
    pub fn expect_from(self: &Arc<Self>, prompt_tokens: usize, start: usize, token: String) -> Ticket {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let want = Expectation { transfer_token: token, fingerprint: self.fingerprint.clone(), layout: self.layout, prompt_tokens, start };
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).insert(id, Pending { want, tx });
        Ticket { id, rx, owner: self.clone() }
    }

    pub fn pending_count(&self) -> usize {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Claim admitted transfer `id` for a sender presenting `token`: what its request expects,
    /// a buffer sized by `header` (when it parsed), and where the payload goes (none in sink
    /// mode). A wrong token leaves the admitted transfer untouched (the caller may not be its
    /// sender).
    pub(crate) fn claim(&self, id: u64, token: &str, header: Option<KvSpan>) -> Result<(Expectation, Vec<u8>, Option<Waiter>)> {
        let buf = || self.buffers.take(header.as_ref().map_or(0, payload_len));
        if self.sink {
            let (start, tokens) = header.map_or((0, 0), |h| (h.start, h.start + h.header.tokens));
            let want = Expectation { transfer_token: token.to_string(), fingerprint: self.fingerprint.clone(), layout: self.layout, prompt_tokens: tokens, start };
            return Ok((want, buf(), None));
        }
        let p = {
            let mut map = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let p = map.get(&id).ok_or(WorkerError::UnknownTransfer(id))?;
            if !super::assembler::tokens_match(&p.want.transfer_token, token) {
                return Err(WorkerError::BadTransferToken(id));
            }
            map.remove(&id).expect("present")
        };
        Ok((p.want, buf(), Some(p.tx)))
    }
}

/// `KvTransfer`: `PushKv` (chunks as a client-streaming gRPC call) and `NcclConnect` (the
/// rendezvous of a device-to-device pipe, see [`super::pipe`]).
pub struct KvTransferService {
    receiver: Arc<KvReceiver>,
    pipes: Option<Arc<dyn super::pipe::PipeConnector>>,
    /// Longest wait for the next chunk (or pipe frame) of a transfer that has begun.
    stall: Duration,
    pipe_slots: super::pipe::PipeSlots,
}

impl KvTransferService {
    pub fn new(receiver: Arc<KvReceiver>, pipes: Option<Arc<dyn super::pipe::PipeConnector>>, stall: Duration) -> Self {
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
            (Some(KvAckFrame { result: Some(kv_ack_frame::Result::Error(e)) }), _) => Err(super::transport::status_of(&e)),
            (_, Err(e)) => Err(e.into()),
            (_, Ok(())) => Err(WorkerError::Internal("the KV stream ended without an answer".into()).into()),
        }
    }

    async fn nccl_connect(&self, req: Request<NcclConnectRequest>) -> std::result::Result<Response<NcclConnectResponse>, Status> {
        let req = req.into_inner();
        let peer = req.peer.clone();
        match super::pipe::accept(self.receiver.clone(), self.pipes.clone(), req, self.stall, &self.pipe_slots).await {
            Ok(device) => {
                metrics::counter!("ferry_kv_nccl_connects_total", "outcome" => "ok").increment(1);
                Ok(Response::new(NcclConnectResponse { device }))
            }
            Err(e) => {
                metrics::counter!("ferry_kv_nccl_connects_total", "outcome" => "error").increment(1);
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

/// How long a new data connection may take to present its hello: one that says nothing is
/// closed, not kept.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Most data connections open at once (each carries one transfer); one more is closed at once
/// and counted in `ferry_connections_refused_total{server="worker_kv_data"}`.
pub const MAX_DATA_CONNECTIONS: usize = 1024;

/// Serve the TCP data path until the listener fails. A connection is served only after its
/// first frame presents the cluster secret (within [`HELLO_TIMEOUT`]), at most
/// [`MAX_DATA_CONNECTIONS`] at once; a transfer whose sender makes no progress for `stall` is
/// failed.
pub async fn serve_tcp(receiver: Arc<KvReceiver>, listener: TcpListener, stall: Duration, cluster: ClusterSecret) {
    let slots = Arc::new(tokio::sync::Semaphore::new(MAX_DATA_CONNECTIONS));
    loop {
        match listener.accept().await {
            Ok((sock, _)) => {
                let Ok(slot) = slots.clone().try_acquire_owned() else {
                    ::metrics::counter!("ferry_connections_refused_total", "server" => "worker_kv_data").increment(1);
                    tracing::debug!("KV data port: {MAX_DATA_CONNECTIONS} connections open, one more refused");
                    continue;
                };
                let r = receiver.clone();
                let cluster = cluster.clone();
                tokio::spawn(async move {
                    let _slot = slot;
                    if let Err(e) = handle_tcp(r, sock, stall, &cluster).await {
                        tracing::debug!("KV data connection: {e}");
                    }
                });
            }
            Err(e) => {
                tracing::warn!("KV data listener: {e}");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            }
        }
    }
}

/// A TCP data connection as a link: one transfer in [`frame`]s, then the reply frame.
struct TcpInbound {
    rd: BufReader<tokio::net::tcp::OwnedReadHalf>,
    wr: BufWriter<tokio::net::tcp::OwnedWriteHalf>,
    stall: Duration,
}

impl InboundLink for TcpInbound {
    async fn next(&mut self, _idle: bool) -> Event {
        let h = match before_stall(self.stall, frame::tcp::read_header(&mut self.rd)).await {
            Ok(Ok(Some(h))) => h,
            Ok(Ok(None)) => return Event::Closed,
            Ok(Err(e)) => return read_failed("reading a frame", e),
            Err(stalled) => return stalled,
        };
        if h.is_chunk() {
            return h.event(&[]);
        }
        match before_stall(self.stall, frame::tcp::read_body(&mut self.rd, &h)).await {
            Ok(Ok(body)) => h.event(&body),
            Ok(Err(e)) => read_failed("reading a frame", e),
            Err(stalled) => stalled,
        }
    }

    async fn take(&mut self, c: Chunk, target: Target<'_>) -> Event {
        let Target::Host(buf) = target else {
            return Event::Broken("a TCP chunk cannot fill a device buffer".into());
        };
        // A chunk is at most 1 MiB: it may take `stall` in all.
        match before_stall(self.stall, frame::tcp::read_appending(&mut self.rd, buf, c.len)).await {
            Ok(Ok(())) => Event::Landed,
            Ok(Err(e)) => read_failed("reading a chunk", e),
            Err(stalled) => stalled,
        }
    }

    async fn skip(&mut self, c: Chunk) -> Event {
        match before_stall(self.stall, frame::tcp::skip(&mut self.rd, c.len)).await {
            Ok(Ok(())) => Event::Landed,
            Ok(Err(e)) => read_failed("skipping a chunk", e),
            Err(stalled) => stalled,
        }
    }

    async fn reply(&mut self, reply: KvAckFrame) -> Result<()> {
        let sent = async {
            self.wr.write_all(&frame::message(Kind::Reply, &reply)).await?;
            self.wr.flush().await
        };
        sent.await.map_err(|e| WorkerError::PeerUnavailable { peer: "KV data connection".into(), what: format!("writing the reply: {e}") })
    }
}

/// A failed read as an event: a frame that does not parse, or a connection that broke.
fn read_failed(what: &str, e: std::io::Error) -> Event {
    match e.kind() {
        std::io::ErrorKind::InvalidData => Event::Malformed(e.to_string()),
        _ => Event::Broken(format!("{what}: {e}")),
    }
}

async fn handle_tcp(receiver: Arc<KvReceiver>, sock: TcpStream, stall: Duration, cluster: &ClusterSecret) -> Result<()> {
    sock.set_nodelay(true).ok();
    let (rd, wr) = sock.into_split();
    let mut link = TcpInbound { rd: BufReader::with_capacity(64 << 10, rd), wr: BufWriter::new(wr), stall };
    if let Err(why) = link.hello(cluster).await {
        crate::metrics::auth_failure("kv_data");
        let error = KvError { code: tonic::Code::Unauthenticated as i32, message: why.clone(), fault: String::new() };
        // Best effort: the sender reads it as the transfer's refusal.
        let _ = link.reply(KvAckFrame { result: Some(kv_ack_frame::Result::Error(error)) }).await;
        return Err(WorkerError::PeerUnavailable { peer: "KV data connection".into(), what: why });
    }
    drive(&mut Session::new(&receiver, Link::Stream), &mut link).await
}

impl TcpInbound {
    /// Reads the connection's first frame, which must be a hello carrying the cluster secret;
    /// Err: why the connection is refused (nothing after the hello is read).
    async fn hello(&mut self, cluster: &ClusterSecret) -> std::result::Result<(), String> {
        let first = async {
            let h = frame::tcp::read_header(&mut self.rd).await?;
            match h {
                Some(h) if h.kind == Kind::Hello => frame::tcp::read_body(&mut self.rd, &h).await.map(Some),
                _ => Ok(None),
            }
        };
        match tokio::time::timeout(HELLO_TIMEOUT, first).await {
            Err(_) => Err(format!("the KV data port refused the connection: no hello within {} s", HELLO_TIMEOUT.as_secs())),
            Ok(Err(e)) => Err(format!("the KV data port refused the connection: {e}")),
            Ok(Ok(None)) => Err("the KV data port refused the connection: its first frame must be the hello".into()),
            Ok(Ok(Some(secret))) if cluster.admits(&secret) => Ok(()),
            Ok(Ok(Some(_))) => Err("the KV data port refused the connection: missing or wrong cluster secret".into()),
        }
    }
}
