//! The receive loop over real links, without a model: a TCP connection answers its first failure
//! (and the waiting request learns it), and a pipe drains a failed transfer to its `end`, answers
//! it, and takes the next transfer in step.

use crate::kv::frame::{self, FrameHeader, Kind, HEADER_BYTES};
use crate::kv::device::{BytePipe, PipeConnector};
use crate::kv::in_process::InProcessConnector;
use crate::kv::receive::pipe::serve;
use crate::kv::receive::tcp::serve_tcp;
use crate::kv::receive::transfers::{KvReceiver, Ticket};
use ferry_core::{KvDtype, KvLayout, KvPayloadHeader};
use ferry_proto::v1::{kv_ack_frame, kv_chunk, KvAckFrame, KvBegin, KvChunk, KvEnd};
use std::time::{Duration, Instant};
use tokio::io::AsyncWriteExt;

fn layout() -> KvLayout {
    KvLayout { dtype: KvDtype::F32, block_size: 16, n_layers: 1, n_kv_heads: 1, head_dim: 2 }
}

const TOKENS: usize = 2;

fn body() -> Vec<u8> {
    (0..KvPayloadHeader { layout: layout(), tokens: TOKENS }.body_bytes()).map(|i| i as u8).collect()
}

fn begin(t: &Ticket, token: &str) -> Vec<u8> {
    let header = KvPayloadHeader { layout: layout(), tokens: TOKENS }.encode().to_vec();
    let begin = KvBegin { transfer_token: token.into(), fingerprint: "fp".into(), header: header.into(), request_id: "r".into(), ..Default::default() };
    frame::message(Kind::Begin, &KvChunk { transfer_id: t.id, part: Some(kv_chunk::Part::Begin(begin)) })
}

fn end(chunks: u32) -> Vec<u8> {
    frame::message(Kind::End, &KvChunk { transfer_id: 0, part: Some(kv_chunk::Part::End(KvEnd { chunks, ..Default::default() })) })
}

fn data(offset: usize, bytes: &[u8], crc: u32) -> Vec<u8> {
    let mut f = FrameHeader { kind: Kind::Data, len: bytes.len() as u64, offset: offset as u64, crc }.encode().to_vec();
    f.extend_from_slice(bytes);
    f
}

fn error_of(r: &KvAckFrame) -> (i32, &str) {
    match &r.result {
        Some(kv_ack_frame::Result::Error(e)) => (e.code, e.message.as_str()),
        other => panic!("an error reply, not {other:?}"),
    }
}

#[tokio::test]
async fn tcp_answers_a_bad_chunk_and_the_request_learns_it() {
    let r = KvReceiver::new("fp".into(), layout());
    let mut ticket = r.expect(TOKENS, "t".into());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(serve_tcp(r.clone(), l, Duration::from_secs(5), secret()));
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let b = body();
    s.write_all(&[hello(SECRET), begin(&ticket, "t"), data(0, &b, crc32fast::hash(&b) ^ 1)].concat()).await.unwrap();
    let h = frame::tcp::read_header(&mut s).await.unwrap().expect("a reply");
    let reply = frame::reply(&h, &frame::tcp::read_body(&mut s, &h).await.unwrap()).unwrap();
    let (code, msg) = error_of(&reply);
    assert_eq!(tonic::Code::from_i32(code), tonic::Code::DataLoss, "{msg}");
    assert!(msg.contains("CRC-32"), "{msg}");
    let status = (&mut ticket.rx).await.unwrap().err().expect("the request fails too");
    assert_eq!(status.code(), tonic::Code::DataLoss);
    assert_eq!(r.pending_count(), 0);
}

const SECRET: &str = "kv-data-port-secret-0123";

fn secret() -> ferry_proto::ClusterSecret {
    ferry_proto::ClusterSecret::new(SECRET).unwrap()
}

fn hello(secret: &str) -> Vec<u8> {
    [&FrameHeader::control(Kind::Hello, secret.len()).encode()[..], secret.as_bytes()].concat()
}

/// The data port serves only a connection whose first frame presents the cluster secret: a wrong
/// secret, or a transfer sent with no hello, is answered UNAUTHENTICATED and nothing of it lands
/// (the ticket still waits; the right secret then delivers).
#[tokio::test]
async fn tcp_refuses_a_connection_without_the_cluster_secret() {
    let r = KvReceiver::new("fp".into(), layout());
    let mut ticket = r.expect(TOKENS, "t".into());
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(serve_tcp(r.clone(), l, Duration::from_secs(5), secret()));
    let b = body();
    let transfer = [begin(&ticket, "t"), data(0, &b, crc32fast::hash(&b)), end(1)].concat();
    for first in [hello("kv-data-port-secret-0124"), hello(""), Vec::new()] {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(&[first, transfer.clone()].concat()).await.unwrap();
        let h = frame::tcp::read_header(&mut s).await.unwrap().expect("a reply");
        let reply = frame::reply(&h, &frame::tcp::read_body(&mut s, &h).await.unwrap()).unwrap();
        let (code, msg) = error_of(&reply);
        assert_eq!(tonic::Code::from_i32(code), tonic::Code::Unauthenticated, "{msg}");
        assert!(msg.contains("cluster secret") || msg.contains("hello"), "{msg}");
        // The connection is closed after the refusal.
        assert!(frame::tcp::read_header(&mut s).await.map(|h| h.is_none()).unwrap_or(true));
        assert!(matches!(ticket.rx.try_recv(), Err(tokio::sync::oneshot::error::TryRecvError::Empty)), "nothing landed");
    }
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(&[hello(SECRET), transfer].concat()).await.unwrap();
    // The request takes the payload and acknowledges it (as the decode worker does once it has
    // imported the KV); only then does the port answer the sender.
    let delivery = (&mut ticket.rx).await.unwrap().expect("delivered");
    delivery.ack.send(Ok(())).unwrap();
    let h = frame::tcp::read_header(&mut s).await.unwrap().expect("a reply");
    let reply = frame::reply(&h, &frame::tcp::read_body(&mut s, &h).await.unwrap()).unwrap();
    assert!(matches!(reply.result, Some(kv_ack_frame::Result::Ack(_))), "{reply:?}");
}

/// Send one frame on a pipe: header, then body (two messages).
fn send(p: &mut dyn BytePipe, f: &[u8]) {
    let deadline = Instant::now() + Duration::from_secs(5);
    p.send(&f[..HEADER_BYTES], deadline).unwrap();
    if f.len() > HEADER_BYTES {
        p.send(&f[HEADER_BYTES..], deadline).unwrap();
    }
}

fn recv_reply(p: &mut dyn BytePipe) -> KvAckFrame {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut hb = [0u8; HEADER_BYTES];
    p.recv(&mut hb, deadline).unwrap();
    let h = FrameHeader::decode(&hb).unwrap();
    let mut body = vec![0u8; h.len as usize];
    p.recv(&mut body, deadline).unwrap();
    frame::reply(&h, &body).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipe_drains_a_failed_transfer_and_serves_the_next() {
    let r = KvReceiver::new("fp".into(), layout());
    let c = InProcessConnector::new();
    let id = c.new_id().unwrap();
    let (c2, id2) = (c.clone(), id.clone());
    let decode = std::thread::spawn(move || c2.connect(&id2, 1, Duration::from_secs(5)));
    let mut p = c.connect(&id, 0, Duration::from_secs(5)).unwrap();
    let pipe = decode.join().unwrap().unwrap();
    let (rt, r2) = (tokio::runtime::Handle::current(), r.clone());
    let served = std::thread::spawn(move || serve(&r2, pipe, &rt, Duration::from_secs(5)));

    let b = body();
    let (x, y) = b.split_at(8);
    // Out of order: the request fails at once; the rest of the transfer is drained, answered at `end`.
    let mut first = r.expect(TOKENS, "t".into());
    send(p.as_mut(), &begin(&first, "t"));
    send(p.as_mut(), &data(8, y, crc32fast::hash(y)));
    let status = (&mut first.rx).await.unwrap().err().expect("failed before `end`");
    assert_eq!(status.code(), tonic::Code::DataLoss, "{status:?}");
    send(p.as_mut(), &data(0, x, crc32fast::hash(x)));
    send(p.as_mut(), &end(2));
    let reply = tokio::task::block_in_place(|| recv_reply(p.as_mut()));
    assert!(error_of(&reply).1.contains("chunk at offset 8, expected 0"), "{reply:?}");

    // The pipe is in step: the next transfer is delivered, and acknowledged once imported.
    let mut second = r.expect(TOKENS, "u".into());
    send(p.as_mut(), &begin(&second, "u"));
    send(p.as_mut(), &data(0, x, crc32fast::hash(x)));
    send(p.as_mut(), &data(8, y, crc32fast::hash(y)));
    send(p.as_mut(), &end(2));
    let delivery = (&mut second.rx).await.unwrap().expect("delivered");
    assert_eq!(&delivery.assembled.payload[ferry_core::kv_payload::HEADER_BYTES..], &b[..]);
    delivery.ack.send(Ok(())).unwrap();
    let reply = tokio::task::block_in_place(|| recv_reply(p.as_mut()));
    assert!(matches!(reply.result, Some(kv_ack_frame::Result::Ack(a)) if a.chunks == 2), "{reply:?}");

    send(p.as_mut(), &FrameHeader::control(Kind::Close, 0).encode());
    served.join().unwrap().expect("closed cleanly");
}
