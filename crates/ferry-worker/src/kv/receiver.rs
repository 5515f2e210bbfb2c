//! The decode side of a KV transfer: transfers it admitted and waits for, and the two ways chunks
//! arrive (the `KvTransfer.PushKv` gRPC stream, and the TCP data path). Both feed the same
//! [`KvAssembler`]; a finished payload goes to the request that admitted it, which imports it and
//! only then lets the receiver acknowledge (so the prefill side's lease covers the whole handoff).

use super::assembler::{Assembled, Expectation, KvAssembler};
use super::frame;
use crate::{Result, WorkerError};
use ferry_core::KvLayout;
use ferry_proto::v1::{kv_ack_frame, kv_chunk, KvAck, KvAckFrame, KvBegin, KvChunk, KvEnd, NcclConnectRequest, NcclConnectResponse};
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

struct Pending {
    want: Expectation,
    tx: oneshot::Sender<Result<Delivery, Status>>,
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

/// A transfer being received: its assembler, and where its result goes.
pub(crate) struct Inbound<'a> {
    pool: &'a BufferPool,
    pub(crate) asm: KvAssembler,
    tx: Option<oneshot::Sender<Result<Delivery, Status>>>,
}

impl Inbound<'_> {
    /// Tell the waiting request, and return the error for the sender.
    pub(crate) fn fail(&mut self, e: WorkerError) -> WorkerError {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Err(e.status()));
        }
        e
    }

    pub(crate) fn check<T>(&mut self, r: Result<T>) -> Result<T> {
        r.map_err(|e| self.fail(e))
    }

    pub(crate) async fn finish(mut self, end: KvEnd) -> Result<KvAck> {
        let asm = std::mem::replace(&mut self.asm, KvAssembler::empty());
        let assembled = self.check(asm.finish(end))?;
        let (bytes, chunks) = (assembled.payload.len() as u64, assembled.chunks);
        let Some(tx) = self.tx.take() else {
            self.pool.give(assembled.payload); // sink mode
            return Ok(KvAck { bytes, chunks });
        };
        let (ack_tx, ack_rx) = oneshot::channel();
        tx.send(Ok(Delivery { assembled, ack: ack_tx })).map_err(|_| WorkerError::Cancelled)?;
        match ack_rx.await {
            Ok(Ok(())) => Ok(KvAck { bytes, chunks }),
            Ok(Err(status)) => Err(WorkerError::PeerRefused { peer: "decode engine".into(), status }),
            Err(_) => Err(WorkerError::Cancelled),
        }
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

    /// Admit a transfer of `prompt_tokens` tokens of KV, to be accepted only from a sender that
    /// presents `token` (the router's, for this request).
    pub fn expect(self: &Arc<Self>, prompt_tokens: usize, token: String) -> Ticket {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        let want = Expectation { transfer_token: token, fingerprint: self.fingerprint.clone(), layout: self.layout, prompt_tokens };
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).insert(id, Pending { want, tx });
        Ticket { id, rx, owner: self.clone() }
    }

    pub fn pending_count(&self) -> usize {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Start receiving transfer `id`. A wrong token leaves the admitted transfer untouched (the
    /// caller may not be its sender); anything else wrong fails it.
    pub(crate) fn claim(&self, id: u64, begin: &KvBegin) -> Result<Inbound<'_>> {
        if self.sink {
            let tokens = ferry_core::KvPayloadHeader::decode(&begin.header).map(|h| h.tokens).unwrap_or(0);
            let want = Expectation {
                transfer_token: begin.transfer_token.clone(),
                fingerprint: self.fingerprint.clone(),
                layout: self.layout,
                prompt_tokens: tokens,
            };
            let buf = self.buffers.take(ferry_core::kv_payload::HEADER_BYTES + want_bytes(&begin.header));
            return Ok(Inbound { pool: &self.buffers, asm: KvAssembler::begin(id, begin, &want, buf)?, tx: None });
        }
        let pending = {
            let mut map = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let p = map.get(&id).ok_or(WorkerError::UnknownTransfer(id))?;
            if !super::assembler::tokens_match(&p.want.transfer_token, &begin.transfer_token) {
                return Err(WorkerError::BadTransferToken(id));
            }
            map.remove(&id).expect("present")
        };
        let mut inbound = Inbound { pool: &self.buffers, asm: KvAssembler::empty(), tx: Some(pending.tx) };
        let buf = self.buffers.take(ferry_core::kv_payload::HEADER_BYTES + want_bytes(&begin.header));
        inbound.asm = inbound.check(KvAssembler::begin(id, begin, &pending.want, buf))?;
        Ok(inbound)
    }
}

/// Body size a header announces (0 if it does not parse; the assembler reports that).
fn want_bytes(header: &[u8]) -> usize {
    ferry_core::KvPayloadHeader::decode(header).map(|h| h.body_bytes()).unwrap_or(0)
}

fn malformed(what: &str) -> WorkerError {
    WorkerError::InvalidRequest(format!("malformed KV transfer: {what}"))
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

/// `f`, unless the sender makes no progress for `stall`: then an error that fails the transfer
/// (its buffer goes back to the pool).
async fn before_stall<T>(stall: Duration, f: impl std::future::Future<Output = T>) -> Result<T> {
    tokio::time::timeout(stall, f).await.map_err(|_| {
        metrics::counter!("ferry_kv_stalls_total", "side" => "receive").increment(1);
        WorkerError::PeerUnavailable { peer: "prefill worker".into(), what: format!("stalled: no chunk for {} ms", stall.as_millis()) }
    })
}

#[tonic::async_trait]
impl ferry_proto::v1::kv_transfer_server::KvTransfer for KvTransferService {
    async fn push_kv(&self, req: Request<Streaming<KvChunk>>) -> std::result::Result<Response<KvAck>, Status> {
        let mut s = req.into_inner();
        let first = s.message().await?.ok_or_else(|| malformed("empty stream"))?;
        let id = first.transfer_id;
        let Some(kv_chunk::Part::Begin(begin)) = first.part else {
            return Err(malformed("the first chunk must be `begin`").into());
        };
        let mut inbound = self.receiver.claim(id, &begin)?;
        loop {
            let next = match before_stall(self.stall, s.message()).await {
                Ok(r) => r,
                Err(e) => return Err(inbound.fail(e).into()),
            };
            let msg = match next {
                Ok(Some(m)) => m,
                Ok(None) => return Err(inbound.fail(malformed("stream ended before `end`")).into()),
                Err(e) => {
                    return Err(inbound.fail(WorkerError::PeerUnavailable { peer: "prefill worker".into(), what: e.to_string() }).into());
                }
            };
            if msg.transfer_id != id {
                return Err(inbound.fail(malformed("chunk for another transfer")).into());
            }
            match msg.part {
                Some(kv_chunk::Part::Data(d)) => {
                    let r = inbound.asm.data(d.offset, &d.data, d.crc32);
                    inbound.check(r)?;
                }
                Some(kv_chunk::Part::End(end)) => return Ok(Response::new(inbound.finish(end).await?)),
                Some(kv_chunk::Part::Begin(_)) | None => return Err(inbound.fail(malformed("unexpected chunk")).into()),
            }
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

/// Serve the TCP data path until the listener fails. A transfer whose sender makes no progress
/// for `stall` is failed.
pub async fn serve_tcp(receiver: Arc<KvReceiver>, listener: TcpListener, stall: Duration) {
    loop {
        match listener.accept().await {
            Ok((sock, _)) => {
                let r = receiver.clone();
                tokio::spawn(async move {
                    if let Err(e) = handle_tcp(r, sock, stall).await {
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

async fn handle_tcp(receiver: Arc<KvReceiver>, sock: TcpStream, stall: Duration) -> Result<()> {
    sock.set_nodelay(true).ok();
    let (rd, wr) = sock.into_split();
    let mut rd = BufReader::with_capacity(64 << 10, rd);
    let mut wr = BufWriter::new(wr);
    let result = receive_tcp(&receiver, &mut rd, stall).await;
    let reply = match &result {
        Ok(ack) => KvAckFrame { result: Some(kv_ack_frame::Result::Ack(*ack)) },
        Err(e) => KvAckFrame { result: Some(kv_ack_frame::Result::Error(super::transport::kv_error(e))) },
    };
    frame::write_message(&mut wr, frame::REPLY, &reply).await.map_err(|e| frame::io_err("writing the reply", e))?;
    wr.flush().await.map_err(|e| frame::io_err("writing the reply", e))?;
    result.map(|_| ())
}

async fn receive_tcp<R: tokio::io::AsyncRead + Unpin>(receiver: &KvReceiver, rd: &mut R, stall: Duration) -> Result<KvAck> {
    let eof = || frame::io_err("reading", std::io::ErrorKind::UnexpectedEof.into());
    let (kind, len) = before_stall(stall, frame::read_header(rd)).await?.map_err(|e| frame::io_err("reading", e))?.ok_or_else(eof)?;
    if kind != frame::CONTROL {
        return Err(malformed("the first frame must be `begin`"));
    }
    let first: KvChunk = frame::read_message(rd, len).await?;
    let Some(kv_chunk::Part::Begin(begin)) = first.part else {
        return Err(malformed("the first frame must be `begin`"));
    };
    let mut inbound = receiver.claim(first.transfer_id, &begin)?;
    loop {
        let header = before_stall(stall, frame::read_header(rd)).await.and_then(|h| h.map_err(|e| frame::io_err("reading", e)));
        let (kind, len) = inbound.check(header.and_then(|h| h.ok_or_else(eof)))?;
        match kind {
            frame::DATA if len > frame::DATA_HEADER => {
                let (offset, crc) = inbound.check(frame::read_data_header(rd).await)?;
                let n = len - frame::DATA_HEADER;
                let read = match inbound.asm.append_target(offset, n) {
                    // A chunk is at most 1 MiB: it may take `stall` in all.
                    Ok(buf) => before_stall(stall, read_appending(rd, buf, n)).await.and_then(|r| r),
                    Err(e) => Err(e),
                };
                inbound.check(read)?;
                let r = inbound.asm.commit(offset, n, crc);
                inbound.check(r)?;
            }
            frame::CONTROL => {
                let msg: Result<KvChunk> = frame::read_message(rd, len).await;
                match inbound.check(msg)?.part {
                    Some(kv_chunk::Part::End(end)) => return inbound.finish(end).await,
                    _ => return Err(inbound.fail(malformed("unexpected control frame"))),
                }
            }
            _ => return Err(inbound.fail(malformed("unknown frame"))),
        }
    }
}

/// Append exactly `n` bytes from `rd` to `buf`, straight into its spare capacity.
async fn read_appending<R: tokio::io::AsyncRead + Unpin>(rd: &mut R, buf: &mut Vec<u8>, n: usize) -> Result<()> {
    use bytes::BufMut;
    let mut left = n;
    while left > 0 {
        let mut limited = (&mut *buf).limit(left);
        let got = tokio::io::AsyncReadExt::read_buf(rd, &mut limited).await.map_err(|e| frame::io_err("reading a chunk", e))?;
        if got == 0 {
            return Err(frame::io_err("reading a chunk", std::io::ErrorKind::UnexpectedEof.into()));
        }
        left -= got;
    }
    Ok(())
}
