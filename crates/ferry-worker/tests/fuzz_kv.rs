//! A seeded fuzzer over the KV frame decoder and the TCP data port (issue 32): streams from the
//! corpus in `tests/fuzz_corpus/kv/` (kept in the repo; `regenerate_the_corpus` rewrites it)
//! have bits flipped, bytes cut, spliced and repeated, and frame lengths replaced, and are sent to
//! a decode worker's data port. No input may panic the receiver (a panic hook counts every panic
//! in this test binary), its listener keeps serving, and the unmutated transfers still land.
//!
//! Bounded: `FERRY_FUZZ_CASES` streams (default 300), seed `FERRY_FUZZ_SEED`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use ferry_core::{KvDtype, KvLayout, KvPayloadHeader};
use ferry_proto::ClusterSecret;
use ferry_proto::v1::{KvBegin, KvChunk, KvEnd, kv_chunk};
use ferry_worker::kv::frame::{self, FrameHeader, Kind};
use ferry_worker::kv::receive::{KvReceiver, serve_tcp};
use ferry_worker::kv::receive::frame_event::FrameEvent;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SECRET: &str = "fuzz-cluster-secret-0123";
const TOKENS: usize = 2;

fn layout() -> KvLayout {
    KvLayout { dtype: KvDtype::F32, block_size: 16, n_layers: 1, n_kv_heads: 1, head_dim: 2 }
}

fn corpus_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz_corpus/kv")
}

fn cases() -> usize {
    std::env::var("FERRY_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(300)
}

fn seed() -> u64 {
    std::env::var("FERRY_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(0x5eed_f0e5)
}

fn hello() -> Vec<u8> {
    [&FrameHeader::control(Kind::Hello, SECRET.len()).encode()[..], SECRET.as_bytes()].concat()
}

/// Frames of the first transfer a fresh receiver admits (id 1, token "t").
fn begin() -> Vec<u8> {
    let header = KvPayloadHeader { layout: layout(), tokens: TOKENS }.encode().to_vec();
    let begin = KvBegin { transfer_token: "t".into(), fingerprint: "fp".into(), header: header.into(), request_id: "r".into(), ..Default::default() };
    frame::message(Kind::Begin, &KvChunk { transfer_id: 1, part: Some(kv_chunk::Part::Begin(begin)) })
}

fn data(offset: usize, bytes: &[u8]) -> Vec<u8> {
    let h = FrameHeader { kind: Kind::Data, len: bytes.len() as u64, offset: offset as u64, crc: crc32fast::hash(bytes) };
    [&h.encode()[..], bytes].concat()
}

fn end(chunks: u32) -> Vec<u8> {
    frame::message(Kind::End, &KvChunk { transfer_id: 1, part: Some(kv_chunk::Part::End(KvEnd { chunks, ..Default::default() })) })
}

fn body() -> Vec<u8> {
    (0..KvPayloadHeader { layout: layout(), tokens: TOKENS }.body_bytes()).map(|i| i as u8).collect()
}

/// The corpus: named streams, each a whole connection's bytes.
fn seeds() -> Vec<(&'static str, Vec<u8>)> {
    let b = body();
    let half = b.len() / 2;
    vec![
        ("ok-one-chunk", [hello(), begin(), data(0, &b), end(1)].concat()),
        ("ok-two-chunks", [hello(), begin(), data(0, &b[..half]), data(half, &b[half..]), end(2)].concat()),
        ("abort", [hello(), begin(), data(0, &b[..half]), FrameHeader::control(Kind::Abort, 0).encode().to_vec()].concat()),
        ("close-after-begin", [hello(), begin(), FrameHeader::control(Kind::Close, 0).encode().to_vec()].concat()),
        ("hello-only", hello()),
        ("no-hello", [begin(), data(0, &b), end(1)].concat()),
    ]
}

/// Rewrites `tests/fuzz_corpus/kv/` from [`seeds`] (after a frame format change).
#[test]
#[ignore]
fn regenerate_the_corpus() {
    std::fs::create_dir_all(corpus_dir()).unwrap();
    for (name, bytes) in seeds() {
        std::fs::write(corpus_dir().join(format!("{name}.bin")), bytes).unwrap();
    }
}

fn corpus() -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<_> = std::fs::read_dir(corpus_dir()).expect("the KV fuzz corpus").map(|e| e.unwrap().path()).collect();
    files.sort();
    files.into_iter().map(|p| (p.file_stem().unwrap().to_string_lossy().into_owned(), std::fs::read(&p).unwrap())).collect()
}

fn mutate(base: &[u8], rng: &mut StdRng) -> Vec<u8> {
    let mut s = base.to_vec();
    for _ in 0..rng.random_range(1..5) {
        if s.is_empty() {
            s.push(rng.random());
            continue;
        }
        let i = rng.random_range(0..s.len());
        match rng.random_range(0..6) {
            0 => s[i] ^= 1 << rng.random_range(0..8),
            1 => s.truncate(i),
            2 => s.splice(i..i, (0..rng.random_range(1..64)).map(|_| rng.random::<u8>())).for_each(drop),
            3 => {
                let j = rng.random_range(i..s.len());
                let copy = s[i..j].to_vec();
                s.splice(j..j, copy).for_each(drop);
            }
            _ => {
                // A frame's length (or offset) replaced with an edge value.
                let magics: Vec<usize> = s.windows(4).enumerate().filter(|(_, w)| *w == b"FKV1").map(|(k, _)| k).collect();
                if let Some(&m) = magics.get(rng.random_range(0..magics.len().max(1))) {
                    let v = [0u64, 1, 1 << 20, (1 << 20) + 1, 64 << 20, 1 << 40, u64::MAX][rng.random_range(0..7)];
                    let at = m + [8, 16][rng.random_range(0..2)];
                    if at + 8 <= s.len() {
                        s[at..at + 8].copy_from_slice(&v.to_le_bytes());
                    }
                }
            }
        }
    }
    s
}

static PANICS: AtomicUsize = AtomicUsize::new(0);

fn count_panics() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        previous(info);
    }));
}

/// One connection's stream to a fresh receiver with one admitted transfer; Some(ok) when the
/// transfer was delivered (true) or failed (false) by the time the port closed the connection.
async fn send(stream: &[u8]) -> Option<bool> {
    let r = KvReceiver::new("fp".into(), layout());
    let mut ticket = r.expect(TOKENS, "t".into());
    // The request's side: takes a delivered payload and acknowledges it, as a decode worker does
    // once the KV is imported.
    let request = tokio::spawn(async move {
        match (&mut ticket.rx).await {
            Ok(Ok(d)) => {
                let _ = d.ack.send(Ok(()));
                Some(true)
            }
            Ok(Err(_)) => Some(false),
            Err(_) => None,
        }
    });
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let server = tokio::spawn(serve_tcp(r.clone(), l, Duration::from_millis(300), ClusterSecret::new(SECRET).unwrap()));
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    // The port may refuse and close before it has read everything.
    let _ = s.write_all(stream).await;
    let _ = s.shutdown().await;
    let mut reply = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut reply)).await;
    assert!(read.is_ok(), "the port neither answered nor closed within 10 s");
    assert!(!server.is_finished(), "the data listener stopped");
    server.abort();
    // A transfer the port gave up on fails its request at once; one it never began waits on.
    tokio::time::timeout(Duration::from_millis(30), request).await.ok().map(|r| r.expect("the request task")).flatten()
}

#[test]
fn frame_headers_of_any_bytes_decode_or_are_refused() {
    let mut rng = StdRng::seed_from_u64(seed());
    for _ in 0..200_000 {
        let mut b = [0u8; frame::HEADER_BYTES];
        rng.fill(&mut b[..]);
        if rng.random_bool(0.5) {
            b[0..4].copy_from_slice(b"FKV1");
            b[4] = rng.random_range(0..10);
        }
        if let Ok(h) = FrameHeader::decode(&b) {
            assert_eq!(FrameHeader::decode(&h.encode()), Ok(h));
            let _ = h.event(&b);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzzed_streams_never_break_the_data_port() {
    count_panics();
    let corpus = corpus();
    let on_disk: Vec<String> = corpus.iter().map(|(n, _)| n.clone()).collect();
    let mut expected: Vec<String> = seeds().iter().map(|(n, _)| n.to_string()).collect();
    expected.sort();
    assert_eq!(on_disk, expected, "the corpus on disk is the seeds' (run regenerate_the_corpus)");
    // Positive controls: the corpus's good transfers land; the rest do not.
    for (name, stream) in &corpus {
        let landed = send(stream).await;
        assert_eq!(landed == Some(true), name.starts_with("ok-"), "{name}: {landed:?}");
    }
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut outcomes = [0usize; 3];
    for case in 0..cases() {
        let (name, base) = &corpus[rng.random_range(0..corpus.len())];
        let stream = mutate(base, &mut rng);
        let outcome = send(&stream).await;
        outcomes[match outcome {
            Some(true) => 0,
            Some(false) => 1,
            None => 2,
        }] += 1;
        assert_eq!(PANICS.load(Ordering::SeqCst), 0, "seed {seed} case {case} (from {name}) panicked: {stream:?}");
    }
    eprintln!("KV fuzz, seed {seed}: delivered {}, failed {}, never delivered {}", outcomes[0], outcomes[1], outcomes[2]);
    assert!(outcomes[1] + outcomes[2] > 0, "no mutation was refused: the fuzzer is not reaching the decoder");
}
