//! The TCP data path on a decode worker: one transfer per connection in [`frame`]s, after a
//! hello that presents the cluster secret; one [`InboundLink`] under the receive loop.

use super::assembler::Target;
use super::drive::{before_stall, drive, InboundLink, Session};
use super::frame_event::FrameEvent;
use super::inbound::{Event, Link};
use super::transfers::KvReceiver;
use crate::error::{Result, WorkerError};
use crate::kv::chunks::Chunk;
use crate::kv::frame::{self, Kind};
use ferry_proto::ClusterSecret;
use ferry_proto::v1::{kv_ack_frame, KvAckFrame, KvError};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};

/// How long a new data connection may take to present its hello: one that says nothing is
/// closed, not kept.
pub const HELLO_TIMEOUT: Duration = Duration::from_secs(5);

/// Most data connections open at once (each carries one transfer); one more is closed at once
/// and counted in `ferry_worker_connections_refused_total{server="worker_kv_data"}`.
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
                    ::metrics::counter!(ferry_proto::conn::Server::WorkerKvData.names().refused, "server" => ferry_proto::conn::Server::WorkerKvData.label()).increment(1);
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
        crate::cluster::metrics::auth_failure("kv_data");
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
