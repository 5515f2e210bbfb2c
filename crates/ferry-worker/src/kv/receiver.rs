//! The decode side of a KV transfer: transfers it admitted and waits for, and the two ways chunks
//! arrive (the `KvTransfer.PushKv` gRPC stream, and the TCP data path). Both feed the same
//! [`KvAssembler`]; a finished payload goes to the request that admitted it, which imports it and
//! only then lets the receiver acknowledge (so the prefill side's lease covers the whole handoff).

use super::assembler::{Assembled, Expectation, KvAssembler};
use super::frame;
use crate::{Result, WorkerError};
use ferry_core::KvLayout;
use ferry_proto::v1::{kv_ack_frame, kv_chunk, KvAck, KvAckFrame, KvBegin, KvChunk, KvEnd, KvError};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
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

pub struct KvReceiver {
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
    pub token: String,
    pub rx: oneshot::Receiver<Result<Delivery, Status>>,
    owner: Arc<KvReceiver>,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.owner.pending.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.id);
    }
}

/// A transfer being received: its assembler, and where its result goes.
struct Inbound {
    asm: KvAssembler,
    tx: Option<oneshot::Sender<Result<Delivery, Status>>>,
}

impl Inbound {
    /// Tell the waiting request, and return the error for the sender.
    fn fail(&mut self, e: WorkerError) -> WorkerError {
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Err(Status::new(e.code(), e.to_string())));
        }
        e
    }

    fn check<T>(&mut self, r: Result<T>) -> Result<T> {
        r.map_err(|e| self.fail(e))
    }

    async fn finish(mut self, end: KvEnd) -> Result<KvAck> {
        let asm = std::mem::replace(&mut self.asm, KvAssembler::empty());
        let assembled = self.check(asm.finish(end))?;
        let (bytes, chunks) = (assembled.payload.len() as u64, assembled.chunks);
        let Some(tx) = self.tx.take() else {
            return Ok(KvAck { bytes, chunks }); // sink mode
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
        Arc::new(Self { fingerprint, layout, pending: Mutex::default(), next_id: AtomicU64::new(1), sink: false })
    }

    /// A receiver that validates and discards every transfer (for `ferry bench kv`).
    pub fn sink(fingerprint: String, layout: KvLayout) -> Arc<Self> {
        Arc::new(Self { fingerprint, layout, pending: Mutex::default(), next_id: AtomicU64::new(1), sink: true })
    }

    pub fn layout(&self) -> KvLayout {
        self.layout
    }

    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// Admit a transfer of `prompt_tokens` tokens of KV.
    pub fn expect(self: &Arc<Self>, prompt_tokens: usize) -> Ticket {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let token = format!("{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>());
        let (tx, rx) = oneshot::channel();
        let want = Expectation { transfer_token: token.clone(), fingerprint: self.fingerprint.clone(), layout: self.layout, prompt_tokens };
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).insert(id, Pending { want, tx });
        Ticket { id, token, rx, owner: self.clone() }
    }

    pub fn pending_count(&self) -> usize {
        self.pending.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// Start receiving transfer `id`. A wrong token leaves the admitted transfer untouched (the
    /// caller may not be its sender); anything else wrong fails it.
    fn claim(&self, id: u64, begin: &KvBegin) -> Result<Inbound> {
        if self.sink {
            let tokens = ferry_core::KvPayloadHeader::decode(&begin.header).map(|h| h.tokens).unwrap_or(0);
            let want = Expectation {
                transfer_token: begin.transfer_token.clone(),
                fingerprint: self.fingerprint.clone(),
                layout: self.layout,
                prompt_tokens: tokens,
            };
            return Ok(Inbound { asm: KvAssembler::begin(id, begin, &want)?, tx: None });
        }
        let pending = {
            let mut map = self.pending.lock().unwrap_or_else(|p| p.into_inner());
            let p = map.get(&id).ok_or(WorkerError::UnknownTransfer(id))?;
            if p.want.transfer_token != begin.transfer_token {
                return Err(WorkerError::BadTransferToken(id));
            }
            map.remove(&id).expect("present")
        };
        let mut inbound = Inbound { asm: KvAssembler::empty(), tx: Some(pending.tx) };
        inbound.asm = inbound.check(KvAssembler::begin(id, begin, &pending.want))?;
        Ok(inbound)
    }
}

fn malformed(what: &str) -> WorkerError {
    WorkerError::InvalidRequest(format!("malformed KV transfer: {what}"))
}

/// `KvTransfer.PushKv`: chunks as a client-streaming gRPC call.
pub struct KvTransferService(pub Arc<KvReceiver>);

#[tonic::async_trait]
impl ferry_proto::v1::kv_transfer_server::KvTransfer for KvTransferService {
    async fn push_kv(&self, req: Request<Streaming<KvChunk>>) -> std::result::Result<Response<KvAck>, Status> {
        let mut s = req.into_inner();
        let first = s.message().await?.ok_or_else(|| malformed("empty stream"))?;
        let id = first.transfer_id;
        let Some(kv_chunk::Part::Begin(begin)) = first.part else {
            return Err(malformed("the first chunk must be `begin`").into());
        };
        let mut inbound = self.0.claim(id, &begin)?;
        loop {
            let msg = match s.message().await {
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
}

/// Serve the TCP data path until the listener fails.
pub async fn serve_tcp(receiver: Arc<KvReceiver>, listener: TcpListener) {
    loop {
        match listener.accept().await {
            Ok((sock, _)) => {
                let r = receiver.clone();
                tokio::spawn(async move {
                    if let Err(e) = handle_tcp(r, sock).await {
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

async fn handle_tcp(receiver: Arc<KvReceiver>, sock: TcpStream) -> Result<()> {
    sock.set_nodelay(true).ok();
    let (rd, wr) = sock.into_split();
    let mut rd = BufReader::with_capacity(64 << 10, rd);
    let mut wr = BufWriter::new(wr);
    let result = receive_tcp(&receiver, &mut rd).await;
    let reply = match &result {
        Ok(ack) => KvAckFrame { result: Some(kv_ack_frame::Result::Ack(*ack)) },
        Err(e) => KvAckFrame { result: Some(kv_ack_frame::Result::Error(KvError { code: e.code() as i32, message: e.to_string() })) },
    };
    frame::write_message(&mut wr, frame::REPLY, &reply).await.map_err(|e| frame::io_err("writing the reply", e))?;
    wr.flush().await.map_err(|e| frame::io_err("writing the reply", e))?;
    result.map(|_| ())
}

async fn receive_tcp<R: tokio::io::AsyncRead + Unpin>(receiver: &KvReceiver, rd: &mut R) -> Result<KvAck> {
    let eof = || frame::io_err("reading", std::io::ErrorKind::UnexpectedEof.into());
    let (kind, len) = frame::read_header(rd).await.map_err(|e| frame::io_err("reading", e))?.ok_or_else(eof)?;
    if kind != frame::CONTROL {
        return Err(malformed("the first frame must be `begin`"));
    }
    let first: KvChunk = frame::read_message(rd, len).await?;
    let Some(kv_chunk::Part::Begin(begin)) = first.part else {
        return Err(malformed("the first frame must be `begin`"));
    };
    let mut inbound = receiver.claim(first.transfer_id, &begin)?;
    loop {
        let header = frame::read_header(rd).await.map_err(|e| frame::io_err("reading", e));
        let (kind, len) = inbound.check(header.and_then(|h| h.ok_or_else(eof)))?;
        match kind {
            frame::DATA if len > frame::DATA_HEADER => {
                let (offset, crc) = inbound.check(frame::read_data_header(rd).await)?;
                let n = len - frame::DATA_HEADER;
                let read = match inbound.asm.slot(offset, n) {
                    Ok(slot) => tokio::io::AsyncReadExt::read_exact(rd, slot).await.map(|_| ()).map_err(|e| frame::io_err("reading a chunk", e)),
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
