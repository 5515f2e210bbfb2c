//! The sending side of a KV transfer, behind one trait so the transports are interchangeable:
//! gRPC streaming (`KvTransfer.PushKv`) and a framed TCP data path (in [`frame`]'s format, which
//! the NCCL pipe shares). NCCL (device to device)
//! comes with the CUDA backend. [`push`] drives any of them from a request's [`Outbound`] queue.

use super::outbound::{FirstChoice, Outbound};
use crate::kv::chunks::{chunk_ranges, MAX_CHUNK_BYTES};
use crate::kv::frame;
use crate::kv::replies::{ack_of, unavailable};
use crate::error::{Result, WorkerError};
use bytes::Bytes;
use ferry_proto::v1::kv_transfer_client::KvTransferClient;
use ferry_proto::v1::{kv_chunk, FirstToken, KvAck, KvBegin, KvChunk, KvData, KvEnd, KvTarget, KvTransferStats};
use ferry_proto::v1::KvTransport as Kind;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::net::TcpStream;
use tokio::sync::mpsc;
use ferry_proto::tls::ClientTls;
use ferry_proto::ClusterSecret;
use tonic::transport::Channel;

/// One open transfer to a decode worker.
#[tonic::async_trait]
pub trait KvLink: Send {
    /// The transport carrying this transfer.
    fn kind(&self) -> Kind;
    async fn data(&mut self, offset: u64, data: Bytes, crc: u32) -> Result<()>;
    /// Whether [`KvLink::buffer`] sends from a buffer where it is (device to device).
    fn takes_buffers(&self) -> bool {
        false
    }
    /// Send a layer from the buffer holding it, at `offset` of the body; returns the number of
    /// frames it took (each counts as a chunk). Only called when [`KvLink::takes_buffers`].
    async fn buffer(&mut self, offset: u64, buf: ferry_engine::KvBuffer) -> Result<u32> {
        let _ = (offset, buf);
        Err(WorkerError::Internal(format!("the {} link sends no buffers", self.kind())))
    }
    /// Send `end` and wait for the receiver's acknowledgement (sent after it stored the KV).
    async fn end(self: Box<Self>, end: KvEnd) -> Result<KvAck>;
}

#[tonic::async_trait]
pub trait KvTransport: Send + Sync {
    fn kind(&self) -> Kind;
    /// Open a transfer to `target` and send its `begin`.
    async fn open(&self, target: &KvTarget, begin: KvBegin) -> Result<Box<dyn KvLink>>;
}

/// HTTP/2 windows large enough for bulk bytes (engineering notes: 32 MiB).
pub const H2_WINDOW: u32 = 32 << 20;
/// Largest gRPC message either side accepts.
pub const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// gRPC channels to peers (decode workers, the router), one per address, reused across requests;
/// TLS when the worker has a client TLS config (`--tls-ca`).
#[derive(Default)]
pub struct Channels {
    map: Mutex<HashMap<String, PeerChannel>>,
    tls: Option<ClientTls>,
    cluster: ClusterSecret,
}

/// A channel to a cluster member whose every call carries the cluster secret.
pub type PeerChannel = tonic::service::interceptor::InterceptedService<Channel, ferry_proto::Bearer>;

impl Channels {
    /// Channels dialed with `tls` (None: plaintext), every call carrying `cluster`'s secret.
    pub fn new(tls: Option<ClientTls>, cluster: ClusterSecret) -> Channels {
        Channels { map: Mutex::default(), tls, cluster }
    }

    pub fn get(&self, addr: &str) -> Result<PeerChannel> {
        let mut map = self.map.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let ch = ferry_proto::tls::endpoint(addr, self.tls.as_ref())
            .map_err(|e| WorkerError::InvalidRequest(format!("bad peer address {addr:?}: {e}")))?
            .connect_timeout(Duration::from_secs(2))
            .tcp_nodelay(true)
            .initial_stream_window_size(H2_WINDOW)
            .initial_connection_window_size(H2_WINDOW)
            .connect_lazy();
        let ch = PeerChannel::new(ch, self.cluster.bearer());
        map.insert(addr.to_string(), ch.clone());
        Ok(ch)
    }
}

#[derive(Default)]
pub struct GrpcTransport {
    channels: Channels,
}

impl GrpcTransport {
    /// KV pushes over these channels (TLS when they have it).
    pub fn new(channels: Channels) -> GrpcTransport {
        GrpcTransport { channels }
    }
}

type PushCall = tokio::task::JoinHandle<std::result::Result<tonic::Response<KvAck>, tonic::Status>>;

struct GrpcLink {
    id: u64,
    peer: String,
    tx: Option<mpsc::Sender<KvChunk>>,
    call: Option<PushCall>,
}

fn call_failed(peer: &str, status: tonic::Status) -> WorkerError {
    match status.code() {
        tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Cancelled => unavailable(peer, status.message()),
        _ => WorkerError::PeerRefused { peer: peer.to_string(), status },
    }
}

impl GrpcLink {
    async fn send(&mut self, part: kv_chunk::Part) -> Result<()> {
        let chunk = KvChunk { transfer_id: self.id, part: Some(part) };
        match &self.tx {
            Some(tx) if tx.send(chunk).await.is_ok() => Ok(()),
            // The call ended: its status says why.
            _ => Err(match self.finish().await {
                Ok(_) => unavailable(&self.peer, "transfer ended early"),
                Err(e) => e,
            }),
        }
    }

    async fn finish(&mut self) -> Result<KvAck> {
        self.tx = None;
        let call = self.call.take().ok_or_else(|| unavailable(&self.peer, "transfer already closed"))?;
        match call.await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(status)) => Err(call_failed(&self.peer, status)),
            Err(e) => Err(WorkerError::Internal(e.to_string())),
        }
    }
}

#[tonic::async_trait]
impl KvLink for GrpcLink {
    fn kind(&self) -> Kind {
        Kind::Grpc
    }

    async fn data(&mut self, offset: u64, data: Bytes, crc32: u32) -> Result<()> {
        self.send(kv_chunk::Part::Data(KvData { offset, data, crc32 })).await
    }

    async fn end(mut self: Box<Self>, end: KvEnd) -> Result<KvAck> {
        self.send(kv_chunk::Part::End(end)).await?;
        self.finish().await
    }
}

#[tonic::async_trait]
impl KvTransport for GrpcTransport {
    fn kind(&self) -> Kind {
        Kind::Grpc
    }

    async fn open(&self, target: &KvTarget, begin: KvBegin) -> Result<Box<dyn KvLink>> {
        let mut client = KvTransferClient::new(self.channels.get(&target.grpc_addr)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let (tx, rx) = mpsc::channel(8);
        let id = target.transfer_id;
        tx.send(KvChunk { transfer_id: id, part: Some(kv_chunk::Part::Begin(begin)) }).await.map_err(|_| WorkerError::Cancelled)?;
        let call = tokio::spawn(async move { client.push_kv(tokio_stream::wrappers::ReceiverStream::new(rx)).await });
        Ok(Box::new(GrpcLink { id, peer: target.grpc_addr.clone(), tx: Some(tx), call: Some(call) }))
    }
}

/// The framed TCP data path: plaintext, so never used when TLS is configured (a worker with TLS
/// serves no data listener and sends KV over gRPC, inside TLS). Each connection opens with a
/// [`frame::Kind::Hello`] carrying the cluster secret.
pub struct TcpTransport {
    cluster: ClusterSecret,
}

impl TcpTransport {
    pub fn new(cluster: ClusterSecret) -> TcpTransport {
        TcpTransport { cluster }
    }
}

struct TcpLink {
    peer: String,
    id: u64,
    rd: BufReader<tokio::net::tcp::OwnedReadHalf>,
    wr: BufWriter<tokio::net::tcp::OwnedWriteHalf>,
}

impl TcpLink {
    /// The receiver's reply frame (after `end`, or the reason it stopped reading).
    async fn reply(&mut self) -> Result<KvAck> {
        let header = frame::tcp::read_header(&mut self.rd).await.map_err(|e| unavailable(&self.peer, e))?;
        let Some(h) = header else {
            return Err(unavailable(&self.peer, "connection closed without a reply"));
        };
        let body = frame::tcp::read_body(&mut self.rd, &h).await.map_err(|e| unavailable(&self.peer, e))?;
        let reply = frame::reply(&h, &body).map_err(|e| unavailable(&self.peer, e))?;
        ack_of(&self.peer, reply)
    }

    /// Write a control frame carrying `part`.
    async fn control(&mut self, kind: frame::Kind, part: kv_chunk::Part) -> std::io::Result<()> {
        let msg = KvChunk { transfer_id: self.id, part: Some(part) };
        self.wr.write_all(&frame::message(kind, &msg)).await
    }

    async fn on_write_error(&mut self, e: std::io::Error) -> WorkerError {
        match self.reply().await {
            Err(refused @ WorkerError::PeerRefused { .. }) => refused,
            _ => unavailable(&self.peer, e),
        }
    }
}

#[tonic::async_trait]
impl KvLink for TcpLink {
    fn kind(&self) -> Kind {
        Kind::Tcp
    }

    async fn data(&mut self, offset: u64, data: Bytes, crc: u32) -> Result<()> {
        let h = frame::FrameHeader { kind: frame::Kind::Data, len: data.len() as u64, offset, crc };
        if let Err(e) = frame::tcp::write(&mut self.wr, h, &data).await {
            return Err(self.on_write_error(e).await);
        }
        Ok(())
    }

    async fn end(mut self: Box<Self>, end: KvEnd) -> Result<KvAck> {
        let sent = async {
            self.control(frame::Kind::End, kv_chunk::Part::End(end)).await?;
            self.wr.flush().await
        }
        .await;
        if let Err(e) = sent {
            return Err(self.on_write_error(e).await);
        }
        self.reply().await
    }
}

#[tonic::async_trait]
impl KvTransport for TcpTransport {
    fn kind(&self) -> Kind {
        Kind::Tcp
    }

    async fn open(&self, target: &KvTarget, begin: KvBegin) -> Result<Box<dyn KvLink>> {
        let peer = target.data_addr.clone();
        let sock = tokio::time::timeout(Duration::from_secs(2), TcpStream::connect(&peer))
            .await
            .map_err(|_| unavailable(&peer, "connect timed out"))?
            .map_err(|e| unavailable(&peer, e))?;
        sock.set_nodelay(true).ok();
        let (rd, wr) = sock.into_split();
        let mut link = TcpLink { peer, id: target.transfer_id, rd: BufReader::new(rd), wr: BufWriter::with_capacity(64 << 10, wr) };
        let secret = self.cluster.reveal().unwrap_or_default().as_bytes();
        let hello = frame::tcp::write(&mut link.wr, frame::FrameHeader::control(frame::Kind::Hello, secret.len()), secret).await;
        if let Err(e) = hello {
            return Err(link.on_write_error(e).await);
        }
        if let Err(e) = link.control(frame::Kind::Begin, kv_chunk::Part::Begin(begin)).await {
            return Err(link.on_write_error(e).await);
        }
        Ok(Box::new(link))
    }
}

/// What a finished transfer reports.
pub struct Pushed {
    pub first_token: u32,
    pub first_is_stop: bool,
    pub first_logprob: Option<ferry_core::TokenLogprob>,
    pub prompt_logprobs: Vec<ferry_core::TokenLogprob>,
    /// Choices 1 to n - 1's first tokens (`SamplingParams::n` > 1).
    pub more_choices: Vec<ferry_proto::v1::FirstToken>,
    pub queued: Duration,
    pub computed: Duration,
    pub stats: KvTransferStats,
}

/// Bound one step of a transfer by the stall timeout: a peer that makes no progress for `stall`
/// is treated as gone (ABORTED to the router, which checks the peer and retries elsewhere).
async fn within<T>(stall: Duration, peer: &str, what: &str, f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    match tokio::time::timeout(stall, f).await {
        Ok(r) => r,
        Err(_) => {
            metrics::counter!(crate::cluster::metrics::names::KV_STALLS, "side" => "send").increment(1);
            Err(unavailable(peer, format!("stalled: no progress for {} ms {what}", stall.as_millis())))
        }
    }
}

/// Send one request's KV: open the link, forward each layer as the engine produces it (in
/// checksummed chunks of at most [`MAX_CHUNK_BYTES`]), then `end` with the first token, and wait
/// for the acknowledgement. The prefill lease inside `End` is held until this returns. Each
/// step (opening, each chunk, the acknowledgement) may take at most `stall`.
pub async fn push(transport: &dyn KvTransport, target: &KvTarget, begin: KvBegin, rx: &mut mpsc::UnboundedReceiver<Outbound>, stall: Duration) -> Result<Pushed> {
    let peer = target.grpc_addr.as_str();
    let open = || within(stall, peer, "opening the transfer", transport.open(target, begin.clone()));
    let mut link = None;
    let mut started = None;
    let (mut chunks, mut bytes) = (0u32, 0u64);
    while let Some(msg) = rx.recv().await {
        match msg {
            Outbound::Layer { offset, data, crcs } => {
                if link.is_none() {
                    started = Some(Instant::now());
                    link = Some(open().await?);
                }
                let l = link.as_mut().expect("opened above");
                send_chunks(l.as_mut(), peer, stall, offset, data, Some(crcs), &mut chunks, &mut bytes).await?;
            }
            Outbound::Buffer { offset, buf } => {
                if link.is_none() {
                    started = Some(Instant::now());
                    link = Some(open().await?);
                }
                let l = link.as_mut().expect("opened above");
                let len = buf.len() as u64;
                if l.takes_buffers() {
                    chunks += within(stall, peer, "sending a layer from its buffer", l.buffer(offset, buf)).await?;
                    bytes += len;
                } else {
                    // A host transport (NCCL fell back): copy the layer out, off the runtime
                    // (on a GPU this waits for the gather), and send it in checksummed chunks.
                    let data = tokio::task::spawn_blocking(move || buf.to_host(0..buf.len()))
                        .await
                        .map_err(|e| WorkerError::Internal(e.to_string()))?
                        .map_err(|e| WorkerError::Internal(format!("copying a KV layer to the host: {e}")))?;
                    send_chunks(l.as_mut(), peer, stall, offset, Bytes::from(data), None, &mut chunks, &mut bytes).await?;
                }
            }
            Outbound::End { first_token, first_is_stop, first_logprob, prompt_logprobs, sampler_state, more_choices, queued, computed, computed_at, lease } => {
                let l = match link {
                    Some(l) => l,
                    None => {
                        started = Some(Instant::now());
                        open().await?
                    }
                };
                let kind = l.kind();
                let more_choices: Vec<FirstToken> = more_choices.iter().map(FirstChoice::to_wire).collect();
                let ack = within(stall, peer, "waiting for the acknowledgement", l.end(KvEnd { first_token, first_is_stop, sampler_state, chunks, more_choices: more_choices.clone() })).await?;
                drop(lease);
                let started = started.expect("set when the link opened");
                return Ok(Pushed {
                    first_token,
                    first_is_stop,
                    first_logprob,
                    prompt_logprobs,
                    more_choices,
                    queued,
                    computed,
                    stats: KvTransferStats {
                        transport: kind as i32,
                        bytes: ack.bytes.max(bytes),
                        chunks,
                        duration_ms: started.elapsed().as_secs_f64() * 1e3,
                        exposed_ms: computed_at.elapsed().as_secs_f64() * 1e3,
                    },
                });
            }
            Outbound::Failed(e) => return Err(e),
        }
    }
    // Every sender is gone without a word: the engine thread stopped.
    Err(WorkerError::EngineFailed("the prefill engine stopped before this prompt finished".into()))
}

/// Send `data` (at `offset` of the body) in chunks of at most [`MAX_CHUNK_BYTES`], with their
/// CRC-32s (`crcs` when the producer computed them, else here).
#[allow(clippy::too_many_arguments)]
async fn send_chunks(l: &mut dyn KvLink, peer: &str, stall: Duration, offset: u64, data: Bytes, crcs: Option<Vec<u32>>, chunks: &mut u32, bytes: &mut u64) -> Result<()> {
    for (i, r) in chunk_ranges(data.len(), MAX_CHUNK_BYTES).enumerate() {
        let piece = data.slice(r.clone());
        let crc = match &crcs {
            Some(c) => c.get(i).copied().ok_or_else(|| WorkerError::Internal(format!("layer at {offset}: no CRC for chunk {i}")))?,
            None => crc32fast::hash(&piece),
        };
        within(stall, peer, "sending a chunk", l.data(offset + r.start as u64, piece, crc)).await?;
        *chunks += 1;
        *bytes += (r.end - r.start) as u64;
    }
    Ok(())
}

/// Try one transport, and if a transfer cannot be set up on it (NCCL missing on a side, its
/// rendezvous failed or timed out, the pair is backing off after a failure), use another. Only
/// the set-up falls back: once KV bytes went out on a link, a failure fails the transfer (and the
/// router retries the request).
pub struct Fallback {
    pub first: std::sync::Arc<dyn KvTransport>,
    pub then: std::sync::Arc<dyn KvTransport>,
}

#[tonic::async_trait]
impl KvTransport for Fallback {
    fn kind(&self) -> Kind {
        self.first.kind()
    }

    async fn open(&self, target: &KvTarget, begin: KvBegin) -> Result<Box<dyn KvLink>> {
        match self.first.open(target, begin.clone()).await {
            Ok(link) => Ok(link),
            Err(e) => {
                let (from, to) = (self.first.kind().to_string(), self.then.kind().to_string());
                tracing::warn!(peer = %target.grpc_addr, request_id = %begin.request_id, "KV over {from} unavailable, using {to}: {e}");
                metrics::counter!(crate::cluster::metrics::names::KV_TRANSPORT_FALLBACKS, "from" => from, "to" => to).increment(1);
                self.then.open(target, begin).await
            }
        }
    }
}
