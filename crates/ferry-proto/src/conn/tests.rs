//! Loopback tests of the acceptor and the HTTP server: at the cap the connection opening longest
//! makes room, or the new one is refused at once when all have opened; a half-sent preface,
//! TLS handshake or request head is closed after the header timeout, a trickled body after the
//! body timeout; and after that a normal request is served. Each waits on the event (a close, an
//! answer), bounded by a timeout that fails the test.

use std::convert::Infallible;
use std::future::Ready;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// Longest any awaited event may take before the test fails.
const BOUND: Duration = Duration::from_secs(10);

async fn bound() -> (TcpListener, SocketAddr) {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind port 0");
    let addr = l.local_addr().expect("addr");
    (l, addr)
}

/// Reads until the peer closes (EOF or reset), failing the test past [`BOUND`].
async fn closed(s: &mut TcpStream) -> Duration {
    let t0 = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(BOUND, s.read(&mut buf)).await.expect("the server never closed the connection") {
            Ok(0) | Err(_) => return t0.elapsed(),
            Ok(_) => {}
        }
    }
}

fn limits(max_connections: usize, header_timeout: Duration) -> ConnLimits {
    ConnLimits { max_connections, header_timeout, body_timeout: DEFAULT_BODY_TIMEOUT }
}

/// Reads `c` until it has `n` bytes (its request head), as a server would.
async fn read_head(c: &mut Conn, n: usize) {
    let mut got = vec![0u8; n];
    tokio::time::timeout(BOUND, c.read_exact(&mut got)).await.expect("the head never came").unwrap();
}

const HEAD: &[u8] = b"GET / HTTP/1.1\r\nhost: t\r\n\r\n";

#[tokio::test]
async fn over_the_cap_of_opened_connections_a_new_one_is_closed_at_once() {
    let (l, addr) = bound().await;
    let mut acceptor = Acceptor::new(l, Server::WorkerGrpc, limits(2, Duration::from_secs(30)));
    let (held_tx, mut held_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let c = acceptor.accept().await;
            let _ = held_tx.send(c);
        }
    });
    let mut a = TcpStream::connect(addr).await.unwrap();
    let mut b = TcpStream::connect(addr).await.unwrap();
    let mut held: Vec<Conn> = vec![held_rx.recv().await.unwrap(), held_rx.recv().await.unwrap()];
    // Both send a whole head, so neither is a candidate to make room.
    a.write_all(HEAD).await.unwrap();
    b.write_all(HEAD).await.unwrap();
    for c in &mut held {
        read_head(c, HEAD.len()).await;
    }
    let mut c = TcpStream::connect(addr).await.unwrap();
    let waited = closed(&mut c).await;
    assert!(waited < Duration::from_secs(2), "the third connection waited {waited:?} to be refused");
    // The two within the cap stay open; closing one frees a slot for the next.
    a.write_all(b"x").await.unwrap();
    drop(held);
    let mut d = TcpStream::connect(addr).await.unwrap();
    let admitted = tokio::time::timeout(BOUND, held_rx.recv()).await.expect("a freed slot admits the next connection");
    assert!(admitted.is_some());
    d.write_all(b"y").await.unwrap();
}

/// Accepts on `acceptor` forever, each connection read until it fails or ends (as hyper would),
/// then dropped.
fn serve_reads(mut acceptor: Acceptor) {
    tokio::spawn(async move {
        loop {
            let mut c = acceptor.accept().await;
            tokio::spawn(async move {
                let mut buf = [0u8; 64];
                while let Ok(n) = c.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                }
            });
        }
    });
}

/// Whether `s` stays open (no EOF, no reset) for `d`.
async fn stays_open(s: &mut TcpStream, d: Duration) -> bool {
    let mut buf = [0u8; 8];
    tokio::time::timeout(d, s.read(&mut buf)).await.is_err()
}

#[tokio::test]
async fn at_the_cap_the_connection_opening_longest_makes_room() {
    let (l, addr) = bound().await;
    serve_reads(Acceptor::new(l, Server::WorkerGrpc, limits(3, Duration::from_secs(30))));
    let mut slow = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nx-half: ").await.unwrap();
        slow.push(s);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut done = TcpStream::connect(addr).await.unwrap();
    done.write_all(HEAD).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The cap (3) is full: the next connection closes the oldest half-sent head, not the one
    // that sent its whole head, and not the younger half-sent one.
    let t0 = Instant::now();
    let mut new = TcpStream::connect(addr).await.unwrap();
    let waited = closed(&mut slow[0]).await;
    assert!(waited < Duration::from_secs(2), "the oldest opening connection closed after {waited:?}");
    assert!(stays_open(&mut slow[1], Duration::from_millis(300)).await, "the younger opening connection was closed too");
    assert!(stays_open(&mut done, Duration::from_millis(100)).await, "a connection that had sent its head was closed");
    new.write_all(HEAD).await.unwrap();
    assert!(stays_open(&mut new, Duration::from_millis(100)).await, "the new connection was not admitted");
    assert!(t0.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn a_stalled_tls_handshake_is_closed_after_the_header_timeout() {
    let (l, addr) = bound().await;
    let timeout = Duration::from_secs(1);
    serve_reads(Acceptor::new(l, Server::WorkerGrpc, limits(8, timeout)).http2());
    // A TLS record header and 40 bytes of a ClientHello: more than the HTTP/2 preface's 24, but
    // the handshake never finishes.
    let mut hello = vec![0x16, 0x03, 0x01, 0x02, 0x00];
    hello.extend([0u8; 40]);
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(&hello).await.unwrap();
    let waited = closed(&mut s).await;
    assert!(waited >= timeout - Duration::from_millis(100), "closed after {waited:?}, before the timeout");
}

#[tokio::test]
async fn a_half_sent_http2_preface_is_closed_after_the_header_timeout() {
    let (l, addr) = bound().await;
    let timeout = Duration::from_secs(1);
    serve_reads(Acceptor::new(l, Server::WorkerGrpc, limits(8, timeout)).http2());
    let mut half = TcpStream::connect(addr).await.unwrap();
    half.write_all(b"PRI * HTTP/2.0\r\n").await.unwrap();
    let mut whole = TcpStream::connect(addr).await.unwrap();
    whole.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
    let waited = closed(&mut half).await;
    assert!(waited >= timeout - Duration::from_millis(100), "closed after {waited:?}, before the timeout");
    // The one that sent its preface is still open past the deadline.
    let mut buf = [0u8; 8];
    let still = tokio::time::timeout(Duration::from_millis(500), whole.read(&mut buf)).await;
    assert!(still.is_err(), "a connection that sent the preface was closed: {still:?}");
}

/// A tower service answering every request `200 ok`.
#[derive(Clone)]
struct Ok200;

impl tower_service::Service<hyper::Request<TimedBody>> for Ok200 {
    type Response = hyper::Response<String>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: hyper::Request<TimedBody>) -> Self::Future {
        std::future::ready(Ok(hyper::Response::new("ok".to_string())))
    }
}

async fn get_ok(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"GET / HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n").await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(BOUND, s.read_to_string(&mut answer)).await.expect("no answer").unwrap();
    answer
}

#[tokio::test]
async fn at_a_cap_full_of_half_sent_heads_a_request_is_served_and_the_rest_time_out() {
    let (l, addr) = bound().await;
    let timeout = Duration::from_secs(1);
    let acceptor = Acceptor::new(l, Server::WorkerGrpc, limits(2, timeout));
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_http(acceptor, Ok200, async move {
        let _ = stop_rx.await;
    }));
    assert!(get_ok(addr).await.starts_with("HTTP/1.1 200"), "a normal request is served");

    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nhost: t\r\nx-half: ").await.unwrap();
        held.push(s);
    }
    // The cap is full of half-sent heads: a normal request takes the oldest one's place and is
    // served at once…
    let t0 = Instant::now();
    assert!(get_ok(addr).await.starts_with("HTTP/1.1 200"), "a normal request at a cap full of half-sent heads");
    assert!(t0.elapsed() < timeout / 2, "served after {:?}", t0.elapsed());
    // …and the half-sent heads are closed, the oldest to make room, the other by the timeout.
    for s in &mut held {
        let waited = closed(s).await;
        assert!(waited < timeout + Duration::from_secs(3), "closed after {waited:?}");
    }
    // …and their slots serve again.
    let answer = get_ok(addr).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "not served after the timeout: {answer:?}");
    let _ = stop_tx.send(());
    tokio::time::timeout(BOUND, server).await.expect("graceful shutdown").unwrap();
}

/// A tower service that reads the whole body and answers `200 <bytes read>`, or `408` when the
/// body timed out.
#[derive(Clone)]
struct ReadsBody;

impl tower_service::Service<hyper::Request<TimedBody>> for ReadsBody {
    type Response = hyper::Response<String>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: hyper::Request<TimedBody>) -> Self::Future {
        Box::pin(async move {
            use hyper::body::Body;
            let mut body = req.into_body();
            let mut n = 0;
            while let Some(f) = std::future::poll_fn(|cx| Pin::new(&mut body).poll_frame(cx)).await {
                match f {
                    Ok(f) => n += f.data_ref().map_or(0, |d| d.len()),
                    Err(e) => {
                        assert!(e.downcast_ref::<BodyTimedOut>().is_some(), "{e}");
                        let mut r = hyper::Response::new(e.to_string());
                        *r.status_mut() = hyper::StatusCode::REQUEST_TIMEOUT;
                        return Ok(r);
                    }
                }
            }
            Ok(hyper::Response::new(format!("{n}")))
        })
    }
}

#[tokio::test]
async fn a_trickled_body_is_cut_at_the_body_timeout_and_a_whole_one_is_read() {
    let (l, addr) = bound().await;
    let limits = ConnLimits { max_connections: 4, header_timeout: Duration::from_secs(5), body_timeout: Duration::from_secs(1) };
    tokio::spawn(serve_http(Acceptor::new(l, Server::WorkerGrpc, limits), ReadsBody, std::future::pending()));
    // Whole: read and counted.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 5\r\nconnection: close\r\n\r\nhello").await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(BOUND, s.read_to_string(&mut answer)).await.expect("no answer").unwrap();
    assert!(answer.starts_with("HTTP/1.1 200") && answer.ends_with("\r\n5"), "{answer:?}");
    // Trickled: a byte every 300 ms of a 1000-byte body, which would take 5 minutes.
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"POST / HTTP/1.1\r\nhost: t\r\ncontent-length: 1000\r\n\r\n").await.unwrap();
    let t0 = Instant::now();
    let trickle = async {
        loop {
            if s.write_all(b"x").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    };
    let _ = tokio::time::timeout(Duration::from_millis(1500), trickle).await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(BOUND, s.read_to_end(&mut answer)).await.expect("the trickling connection stayed open");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer:?}");
    assert!(answer.contains("did not arrive within 1000 ms"), "{answer:?}");
    assert!(t0.elapsed() < Duration::from_secs(4), "answered after {:?}", t0.elapsed());
}
