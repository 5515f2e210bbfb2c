//! Connection hygiene for every server Ferry runs (router HTTP and gRPC, worker gRPC, the
//! `/metrics` servers): a cap on open connections per server, a deadline for a new connection's
//! first bytes, and the metrics and logs that say what was refused.
//!
//! - [`Acceptor`] accepts from a bound listener and hands out [`Conn`]s, each holding one of the
//!   server's `max_connections` slots (a semaphore permit, released on `Drop`). At the cap, the
//!   connection that has been opening longest (no complete request head, HTTP/2 preface or TLS
//!   handshake yet: [`opening`]) is closed to make room, counted in
//!   `ferry_<component>_connections_evicted_total{server}`; when none is opening, the new connection is
//!   closed at once, counted in `ferry_<component>_connections_refused_total{server}`. Both are logged at
//!   most once a second, with how many since. The acceptor is a `Stream`, so tonic's
//!   `serve_with_incoming*` takes it as it is.
//! - gRPC servers ask for [`Acceptor::http2`]: the peer must send the HTTP/2 client preface
//!   (24 bytes), or with TLS finish its handshake and start its first request, within
//!   `header_timeout`, else the connection is closed and counted in
//!   `ferry_<component>_connections_timed_out_total{server}`. After that, HTTP/2 keepalive pings (set on
//!   tonic's builder) find dead peers.
//! - [`serve_http`] serves a tower service (an axum `Router`) over HTTP/1 with hyper's
//!   `header_read_timeout`: a request head, the first or the next on a kept-alive connection,
//!   must arrive complete within `header_timeout` (so it is also the keep-alive idle timeout);
//!   and a request's body whole within `body_timeout` ([`TimedBody`]).
//!
//! The design follows what nginx (`worker_connections`, `client_header_timeout`,
//! `keepalive_timeout`) and Go's `http.Server` (`ReadHeaderTimeout`, `IdleTimeout` defaulting to
//! it) do, built from hyper's and tokio's own pieces rather than protocol code of our own.

mod body;
mod http;
pub mod opening;
mod refusals;
mod server;

use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Sleep;

pub use body::{BodyTimedOut, TimedBody};
pub use http::serve_http;
use opening::{Openings, Phase, Protocol, Slot};
pub use refusals::RefusalLog;
pub use server::{Component, ConnNames, Server};

/// How long a new connection may take to send its first request head (HTTP/1) or the HTTP/2
/// preface (gRPC), and, on HTTP/1, how long a kept-alive connection may wait for its next one.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an HTTP request's body may take to arrive, all of it, once its head is in.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);
/// Open connections per client-facing server (router HTTP, router gRPC).
pub const DEFAULT_MAX_CONNECTIONS: usize = 4096;
/// Open connections on a worker's gRPC server (its callers are routers and peer workers).
pub const DEFAULT_WORKER_MAX_CONNECTIONS: usize = 1024;
/// Open connections on a `/metrics` (and probes) server: scrapers and kubelets.
pub const DEFAULT_METRICS_MAX_CONNECTIONS: usize = 64;
/// HTTP/2 keepalive for gRPC servers that set none of their own: a ping after this much silence…
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// …and the connection closed when its ack has not come within this.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// How long accepting pauses after an error that is not one connection's (out of descriptors).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// One server's connection limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// Connections open at once; one more is closed as soon as it is accepted.
    pub max_connections: usize,
    /// See [`DEFAULT_HEADER_TIMEOUT`].
    pub header_timeout: Duration,
    /// See [`DEFAULT_BODY_TIMEOUT`] (HTTP/1 servers).
    pub body_timeout: Duration,
}

impl ConnLimits {
    /// A client-facing server's defaults.
    pub const fn api() -> ConnLimits {
        ConnLimits { max_connections: DEFAULT_MAX_CONNECTIONS, header_timeout: DEFAULT_HEADER_TIMEOUT, body_timeout: DEFAULT_BODY_TIMEOUT }
    }

    /// A worker gRPC server's defaults.
    pub const fn worker() -> ConnLimits {
        ConnLimits { max_connections: DEFAULT_WORKER_MAX_CONNECTIONS, header_timeout: DEFAULT_HEADER_TIMEOUT, body_timeout: DEFAULT_BODY_TIMEOUT }
    }

    /// A `/metrics` server's defaults, with this server's timeouts.
    pub const fn metrics(of: ConnLimits) -> ConnLimits {
        ConnLimits { max_connections: DEFAULT_METRICS_MAX_CONNECTIONS, ..of }
    }
}

/// Accepts connections for one server, within its [`ConnLimits`]. Accept errors never end it:
/// one connection's (reset before accepted) are skipped, others (out of descriptors) pause
/// accepting for a moment and are logged.
pub struct Acceptor {
    listener: TcpListener,
    slots: Arc<Semaphore>,
    limits: ConnLimits,
    server: Server,
    /// What connections open with (gRPC: the HTTP/2 preface, which must come within
    /// `header_timeout`).
    protocol: Protocol,
    /// Connections in the order admitted, for eviction at the cap.
    openings: Openings,
    refusals: RefusalLog,
    evictions: RefusalLog,
    accept_errors: RefusalLog,
    backoff: Option<Pin<Box<Sleep>>>,
    /// When the refusals held back by `refusals` are to be logged.
    flush: Option<Pin<Box<Sleep>>>,
}

impl Acceptor {
    /// `server` names the server in metrics (its component's families, labelled with it) and
    /// logs.
    pub fn new(listener: TcpListener, server: Server, limits: ConnLimits) -> Acceptor {
        Acceptor {
            listener,
            slots: Arc::new(Semaphore::new(limits.max_connections)),
            limits,
            server,
            protocol: Protocol::Http1,
            openings: Openings::new(limits.max_connections),
            refusals: RefusalLog::default(),
            evictions: RefusalLog::default(),
            accept_errors: RefusalLog::default(),
            backoff: None,
            flush: None,
        }
    }

    /// An HTTP/2 (gRPC) server's acceptor: a connection that has not sent the 24-byte HTTP/2
    /// preface (or, with TLS, finished its handshake and started its first request) within
    /// `header_timeout` is closed.
    pub fn http2(mut self) -> Acceptor {
        self.protocol = Protocol::Http2;
        self
    }

    pub fn limits(&self) -> ConnLimits {
        self.limits
    }

    pub fn server(&self) -> Server {
        self.server
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// The next connection within the cap (Nagle off: small stream messages must not wait for
    /// delayed ACKs).
    pub async fn accept(&mut self) -> Conn {
        std::future::poll_fn(|cx| self.poll_accept(cx)).await
    }

    pub fn poll_accept(&mut self, cx: &mut Context<'_>) -> Poll<Conn> {
        if let Some(f) = &mut self.flush
            && f.as_mut().poll(cx).is_ready()
        {
            self.flush = None;
            if let Some(n) = self.refusals.flush(Instant::now()) {
                self.log_refused(n);
            }
            self.arm_flush(cx);
        }
        loop {
            if let Some(b) = &mut self.backoff {
                ready!(b.as_mut().poll(cx));
                self.backoff = None;
            }
            match ready!(self.listener.poll_accept(cx)) {
                Ok((tcp, peer)) => match self.slots.clone().try_acquire_owned().or_else(|_| self.make_room()) {
                    Ok(slot) => {
                        let _ = tcp.set_nodelay(true);
                        return Poll::Ready(self.admit(tcp, slot));
                    }
                    Err(_) => {
                        drop(tcp);
                        metrics::counter!(self.server.names().refused, "server" => self.server.label()).increment(1);
                        tracing::debug!(server = self.server.label(), %peer, "connection refused at the cap");
                        match self.refusals.note(Instant::now()) {
                            Some(n) => self.log_refused(n),
                            None => self.arm_flush(cx),
                        }
                    }
                },
                Err(e) if one_connections(&e) => {}
                Err(e) => {
                    if let Some(n) = self.accept_errors.note(Instant::now()) {
                        tracing::warn!(server = self.server.label(), errors = n, "accepting connections failed: {e}; pausing {} ms", ACCEPT_BACKOFF.as_millis());
                    }
                    self.backoff = Some(Box::pin(tokio::time::sleep(ACCEPT_BACKOFF)));
                }
            }
        }
    }

    /// At the cap: closes the connection opening longest and takes its place; Err when every
    /// connection has opened.
    fn make_room(&mut self) -> Result<OwnedSemaphorePermit, ()> {
        if !self.openings.evict_oldest() {
            return Err(());
        }
        metrics::counter!(self.server.names().evicted, "server" => self.server.label()).increment(1);
        if let Some(n) = self.evictions.note(Instant::now()) {
            tracing::warn!(
                server = self.server.label(),
                evicted = n,
                max_connections = self.limits.max_connections,
                "closed connections that had sent no complete request yet, to make room at the connection cap (counted in {})",
                self.server.names().evicted
            );
        }
        self.slots.clone().try_acquire_owned().map_err(drop)
    }

    /// Sets the timer that logs the refusals held back, when some are and none is set.
    fn arm_flush(&mut self, cx: &mut Context<'_>) {
        if self.flush.is_none()
            && let Some(due) = self.refusals.due()
        {
            let mut f = Box::pin(tokio::time::sleep_until(due.into()));
            // Polled once to register the waker: the count is logged when due.
            let _ = f.as_mut().poll(cx);
            self.flush = Some(f);
        }
    }

    fn log_refused(&self, n: u64) {
        tracing::warn!(
            server = self.server.label(),
            refused = n,
            max_connections = self.limits.max_connections,
            "connections refused: the server is at its connection cap (counted in {})",
            self.server.names().refused
        );
    }

    fn admit(&mut self, io: TcpStream, permit: OwnedSemaphorePermit) -> Conn {
        metrics::gauge!(self.server.names().open, "server" => self.server.label()).increment(1.0);
        let slot = Slot::new(permit);
        self.openings.push(&slot);
        // HTTP/1's head deadline is hyper's `header_read_timeout`; gRPC's opening is timed here.
        let deadline = (self.protocol == Protocol::Http2).then(|| Box::pin(tokio::time::sleep(self.limits.header_timeout)));
        Conn { slot, io, server: self.server, opening: Some(Opening { phase: Phase::new(self.protocol), deadline }) }
    }
}

/// Errors of one connection (reset or aborted before it was accepted): skip it.
fn one_connections(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::ConnectionAborted | io::ErrorKind::ConnectionReset | io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock
    )
}

impl tokio_stream::Stream for Acceptor {
    type Item = Result<Conn, Infallible>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_accept(cx).map(|c| Some(Ok(c)))
    }
}

/// How far a new connection has opened, and by when it must have.
struct Opening {
    phase: Phase,
    deadline: Option<Pin<Box<Sleep>>>,
}

/// An accepted connection holding one of its server's slots until dropped (or evicted).
pub struct Conn {
    // The slot is released before the socket closes (fields drop in order): a peer that sees the
    // close and connects again finds the slot free.
    slot: Arc<Slot>,
    io: TcpStream,
    server: Server,
    /// `None` once opened.
    opening: Option<Opening>,
}

impl Conn {
    pub fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.io.peer_addr()
    }
}

impl Conn {
    /// The server writes (a TLS handshake's answer, while opening).
    fn wrote(&mut self) {
        if let Some(o) = &mut self.opening {
            o.phase.wrote();
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        metrics::gauge!(self.server.names().open, "server" => self.server.label()).decrement(1.0);
    }
}

impl AsyncRead for Conn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let Some(o) = &mut this.opening else { return Pin::new(&mut this.io).poll_read(cx, buf) };
        if this.slot.is_evicted() {
            return Poll::Ready(Err(io::Error::new(io::ErrorKind::ConnectionAborted, "closed to make room at the connection cap")));
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        match &r {
            Poll::Ready(Ok(())) => {
                o.phase.read(&buf.filled()[before..]);
                if o.phase.is_open() {
                    this.slot.opened();
                    this.opening = None;
                }
            }
            Poll::Ready(Err(_)) => {}
            Poll::Pending => {
                this.slot.park(cx.waker());
                if let Some(d) = &mut o.deadline
                    && d.as_mut().poll(cx).is_ready()
                {
                    metrics::counter!(this.server.names().timed_out, "server" => this.server.label()).increment(1);
                    let owed = o.phase.owed();
                    tracing::debug!(server = this.server.label(), "closing a connection that sent no {owed} in time");
                    return Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, format!("no {owed} within the header timeout"))));
                }
            }
        }
        r
    }
}

impl AsyncWrite for Conn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.wrote();
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        this.wrote();
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = <TcpStream as tonic::transport::server::Connected>::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

#[cfg(test)]
mod tests;
