//! Loopback tests of the acceptor and the HTTP server: the cap refuses at once, a half-sent
//! preface or request head is closed after the header timeout, and after that a normal request is
//! served. Each waits on the event (a close, an answer), bounded by a timeout that fails the test.

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

#[tokio::test]
async fn over_the_cap_a_connection_is_closed_at_once() {
    let (l, addr) = bound().await;
    let limits = ConnLimits { max_connections: 2, header_timeout: Duration::from_secs(30) };
    let mut acceptor = Acceptor::new(l, "test", limits);
    let (held_tx, mut held_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let c = acceptor.accept().await;
            let _ = held_tx.send(c);
        }
    });
    let mut a = TcpStream::connect(addr).await.unwrap();
    let _b = TcpStream::connect(addr).await.unwrap();
    let held: Vec<Conn> = vec![held_rx.recv().await.unwrap(), held_rx.recv().await.unwrap()];
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

#[tokio::test]
async fn a_half_sent_http2_preface_is_closed_after_the_header_timeout() {
    let (l, addr) = bound().await;
    let timeout = Duration::from_secs(1);
    let mut acceptor = Acceptor::new(l, "test", ConnLimits { max_connections: 8, header_timeout: timeout }).http2();
    // The server side reads until its connection fails, as hyper would, then drops it.
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

impl tower_service::Service<hyper::Request<hyper::body::Incoming>> for Ok200 {
    type Response = hyper::Response<String>;
    type Error = Infallible;
    type Future = Ready<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, _: hyper::Request<hyper::body::Incoming>) -> Self::Future {
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
async fn half_sent_heads_fill_the_cap_then_time_out_and_a_request_is_served() {
    let (l, addr) = bound().await;
    let timeout = Duration::from_secs(1);
    let acceptor = Acceptor::new(l, "test", ConnLimits { max_connections: 2, header_timeout: timeout });
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
    // The cap is full of half-sent heads: one more is closed at once, without an answer.
    let mut over = TcpStream::connect(addr).await.unwrap();
    let _ = over.write_all(b"GET / HTTP/1.1\r\nhost: t\r\n\r\n").await;
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(BOUND, over.read_to_end(&mut answer)).await.expect("the refused connection stayed open");
    assert!(answer.is_empty(), "a connection over the cap was answered: {:?}", String::from_utf8_lossy(&answer));
    // The half-sent heads are closed by the header timeout…
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
