//! The inbound state machine's transitions, from a table: each row feeds a script of events (the
//! helper answers claims, allocations and takes the way a driver would) and lists the actions
//! that must come out, with what each error names.

use super::*;
use ferry_core::{KvDtype, KvLayout, KvPayloadHeader};

fn layout() -> KvLayout {
    KvLayout { dtype: KvDtype::F32, block_size: 16, n_layers: 2, n_kv_heads: 1, head_dim: 2 }
}

fn head() -> KvPayloadHeader {
    KvPayloadHeader { layout: layout(), tokens: 3 }
}

/// The body bytes at `range`.
fn body(range: std::ops::Range<usize>) -> Vec<u8> {
    range.map(|i| (i * 31) as u8).collect()
}

const BODY: usize = 96; // 2 layers × K and V × 3 tokens × 2 floats × 4 bytes

/// A step of a script: what the sender does.
#[derive(Clone)]
enum S {
    Begin,
    /// Begin with this token (the admitted one is "t").
    BeginToken(&'static str),
    BeginFingerprint(&'static str),
    BeginHeader(Vec<u8>),
    /// A host chunk at `offset` of `len` bytes with its right CRC.
    Data(usize, usize),
    BadCrc(usize, usize),
    /// A buffer frame with its right word checksum.
    Buf(usize, usize),
    End(u32),
    Abort,
    Close,
    Closed,
    Stall,
    Malformed,
    /// The allocation of the body buffer fails.
    NoMemory,
}

fn crc(b: &[u8]) -> u32 {
    crc32fast::hash(b)
}

/// Feed `script` to a machine on `link`, answering its requests; one line per action.
fn run(link: Link, script: &[S]) -> Vec<String> {
    let mut m = Inbound::new(link);
    let mut out = Vec::new();
    let mut no_memory = false;
    for step in script {
        let (id, mut begin) = (5, KvBegin { transfer_token: "t".into(), fingerprint: "fp".into(), header: head().encode().to_vec().into(), request_id: "r".into(), ..Default::default() });
        let ev = match step.clone() {
            S::Begin => Event::Begin { id, begin },
            S::BeginToken(t) => {
                begin.transfer_token = t.into();
                Event::Begin { id, begin }
            }
            S::BeginFingerprint(f) => {
                begin.fingerprint = f.into();
                Event::Begin { id, begin }
            }
            S::BeginHeader(h) => {
                begin.header = h.into();
                Event::Begin { id, begin }
            }
            S::Data(o, n) => Event::Chunk(Chunk { offset: o as u64, len: n, crc: crc(&body(o..o + n)), buffer: false }),
            S::BadCrc(o, n) => Event::Chunk(Chunk { offset: o as u64, len: n, crc: crc(&body(o..o + n)) ^ 1, buffer: false }),
            S::Buf(o, n) => Event::Chunk(Chunk { offset: o as u64, len: n, crc: ferry_core::kv_payload::word_checksum(&body(o..o + n)), buffer: true }),
            S::End(chunks) => Event::End(KvEnd { chunks, ..Default::default() }),
            S::Abort => Event::Abort,
            S::Close => Event::Close,
            S::Closed => Event::Closed,
            S::Stall => Event::Stalled(Duration::from_millis(250)),
            S::Malformed => Event::Malformed("undecodable end frame".into()),
            S::NoMemory => {
                no_memory = true;
                continue;
            }
        };
        let mut action = m.on(ev);
        loop {
            let (line, next) = match action {
                Action::Next => ("next".to_string(), None),
                // The receiver's claim: the token decides (it leaves the admitted transfer alone).
                Action::Claim { id, token, header } => {
                    assert!(header.is_none() || header == Some(ferry_core::KvSpan { header: head(), start: 0 }), "the header decoded once, as sent");
                    let ev = if token == "t" {
                        let want = Expectation { transfer_token: "t".into(), fingerprint: "fp".into(), layout: layout(), prompt_tokens: 3, start: 0 };
                        Event::Admitted { want, buf: Vec::new() }
                    } else {
                        Event::Refused(WorkerError::BadTransferToken(id))
                    };
                    ("claim".into(), Some(ev))
                }
                Action::Allocate(n) => {
                    let buf = if no_memory { Err("out of device memory".into()) } else { Ok(KvBuffer::Host(vec![0; n])) };
                    (format!("allocate {n}"), Some(Event::Allocated(buf)))
                }
                Action::Take(c) => {
                    let o = c.offset as usize;
                    match m.target().expect("a target while taking") {
                        Target::Host(v) => v.extend_from_slice(&body(o..o + c.len)),
                        Target::Buffer(b, r) => b.write(r.start, &body(o..o + c.len)).unwrap(),
                    }
                    (format!("take {o}+{}", c.len), Some(Event::Landed))
                }
                Action::Skip(c) => (format!("skip {}+{}", c.offset, c.len), Some(Event::Landed)),
                Action::Deliver(a) => {
                    let got = match &a.device {
                        Some(d) => d.as_host().unwrap().to_vec(),
                        None => a.payload[ferry_core::kv_payload::HEADER_BYTES..].to_vec(),
                    };
                    assert_eq!(got, body(0..BODY), "the body as sent");
                    (format!("deliver {} chunks", a.chunks), None)
                }
                // The driver drops a refused chunk's bytes, then says so.
                Action::Fail { error, then } => {
                    let next = matches!(then, After::Skip(_)).then_some(Event::Landed);
                    (format!("fail {then:?}: {error}"), next)
                }
                Action::Reply(e) => (format!("reply: {}", e.message), None),
                Action::Stop => ("stop".into(), None),
            };
            out.push(line);
            match next {
                Some(ev) => action = m.on(ev),
                None => break,
            }
        }
    }
    out
}

#[test]
fn transitions() {
    use Link::{Pipe, Stream};
    use S::*;
    let whole = [Begin, Data(0, 40), Data(40, 56), End(2)];
    let cases: Vec<(&str, Link, Vec<S>, Vec<&str>)> = vec![
        ("a whole transfer", Stream, whole.to_vec(), vec!["claim", "next", "take 0+40", "next", "take 40+56", "next", "deliver 2 chunks"]),
        ("buffer frames", Pipe, vec![Begin, Buf(0, 48), Buf(48, 48), End(2)], vec!["claim", "next", "allocate 96", "take 0+48", "next", "take 48+48", "next", "deliver 2 chunks"]),
        ("a pipe takes the next transfer", Pipe, [&whole[..], &whole[..]].concat(), [&["claim", "next", "take 0+40", "next", "take 40+56", "next", "deliver 2 chunks"][..]; 2].concat()),
        ("a pipe retired between transfers", Pipe, vec![Close], vec!["stop"]),
        ("out-of-order data", Stream, vec![Begin, Data(40, 56)], vec!["claim", "next", "fail Reply: KV transfer 5: chunk at offset 40, expected 0"]),
        ("out-of-order data on a pipe drains to the end", Pipe, vec![Begin, Data(40, 56), Data(0, 40), End(1)], vec!["claim", "next", "fail Skip(Chunk { offset: 40", "next", "skip 0+40", "next", "reply: KV transfer 5: chunk at offset 40, expected 0"]),
        ("data before begin", Stream, vec![Data(0, 40)], vec!["fail Reply: invalid request: malformed KV transfer: data before `begin`"]),
        ("data before begin on a pipe", Pipe, vec![Data(0, 40)], vec!["fail Stop: invalid request: malformed KV transfer: data before `begin`"]),
        ("duplicate begin", Stream, vec![Begin, Begin], vec!["claim", "next", "fail Reply: invalid request: malformed KV transfer: a second `begin` inside a transfer"]),
        ("end before all bytes", Stream, vec![Begin, Data(0, 40), End(1)], vec!["claim", "next", "take 0+40", "next", "fail Reply: KV transfer 5: ended after 40 of 96 body bytes"]),
        ("end before all bytes on a pipe answers at once", Pipe, vec![Begin, End(0), Begin], vec!["claim", "next", "fail Reply: ended after 0 of 96 body bytes", "claim", "next"]),
        ("end before begin", Pipe, vec![End(0)], vec!["fail Reply: malformed KV transfer: `end` before `begin`"]),
        ("a wrong chunk count", Stream, vec![Begin, Data(0, 96), End(3)], vec!["claim", "next", "take 0+96", "next", "fail Reply: sender counted 3 chunks, 1 arrived"]),
        ("bad crc", Stream, vec![Begin, BadCrc(0, 40)], vec!["claim", "next", "take 0+40", "fail Reply: KV transfer 5: chunk at offset 0: CRC-32"]),
        ("bad crc on a pipe", Pipe, vec![Begin, BadCrc(0, 40), Data(40, 56), End(2)], vec!["claim", "next", "take 0+40", "fail Next: KV transfer 5: chunk at offset 0: CRC-32", "skip 40+56", "next", "reply: chunk at offset 0: CRC-32"]),
        ("wrong token", Stream, vec![BeginToken("x")], vec!["claim", "fail Reply: KV transfer 5: wrong transfer token"]),
        ("wrong fingerprint", Stream, vec![BeginFingerprint("other")], vec!["claim", "fail Reply: KV transfer 5: model fingerprint other differs from this worker's fp"]),
        ("a short header", Stream, vec![BeginHeader(vec![0; 8])], vec!["claim", "fail Reply: KV transfer 5: header is 8 bytes, expected 32"]),
        ("a garbage header", Pipe, vec![BeginHeader(vec![0; 32]), Data(0, 40), End(1)], vec!["claim", "fail Next: KV transfer 5: not a Ferry KV payload", "skip 0+40", "next", "reply: not a Ferry KV payload"]),
        ("close mid-transfer", Stream, vec![Begin, Data(0, 40), Closed], vec!["claim", "next", "take 0+40", "next", "fail Reply: peer prefill worker unavailable: the sender closed the link before `end`"]),
        ("close mid-transfer on a pipe", Pipe, vec![Begin, Closed], vec!["claim", "next", "fail Stop: the sender closed the link before `end`"]),
        ("close before begin", Stream, vec![Closed], vec!["fail Reply: the sender closed the link before `begin`"]),
        ("a stall", Stream, vec![Begin, Stall], vec!["claim", "next", "fail Reply: peer prefill worker unavailable: stalled: no chunk for 250 ms"]),
        ("a stall on a pipe", Pipe, vec![Begin, Data(0, 40), Stall], vec!["claim", "next", "take 0+40", "next", "fail Stop: stalled: no chunk for 250 ms"]),
        ("the sender aborts", Pipe, vec![Begin, Data(0, 40), Abort, Begin], vec!["claim", "next", "take 0+40", "next", "fail Next: the sender abandoned the transfer", "claim", "next"]),
        ("the sender aborts a stream", Stream, vec![Begin, Abort], vec!["claim", "next", "fail Stop: the sender abandoned the transfer"]),
        ("a malformed frame", Stream, vec![Begin, Malformed], vec!["claim", "next", "fail Reply: invalid request: malformed KV transfer: undecodable end frame"]),
        ("a malformed frame on a pipe", Pipe, vec![Begin, Malformed, End(0)], vec!["claim", "next", "fail Next: undecodable end frame", "reply: undecodable end frame"]),
        ("a host chunk after buffer frames", Pipe, vec![Begin, Buf(0, 48), Data(48, 48), End(2)], vec!["claim", "next", "allocate 96", "take 0+48", "next", "fail Skip(Chunk { offset: 48", "next", "reply: a host chunk after buffer frames"]),
        ("no memory for the body", Pipe, vec![NoMemory, Begin, Buf(0, 48), End(1)], vec!["claim", "next", "allocate 96", "fail Skip(Chunk { offset: 0, len: 48", "next", "reply: no room: transfer 5: cannot allocate its 96-byte KV body: out of device memory"]),
        ("close inside a transfer", Pipe, vec![Begin, Close], vec!["claim", "next", "fail Stop: malformed KV transfer: `close` inside a transfer"]),
        ("nothing after a stream's answer", Stream, vec![Begin, Begin, Data(0, 40)], vec!["claim", "next", "fail Reply: a second `begin`", "stop"]),
    ];
    for (name, link, script, want) in cases {
        let got = run(link, &script);
        assert_eq!(got.len(), want.len(), "{name}: {got:#?}");
        // "what: detail" wants a line that starts with `what` and says `detail`.
        for (g, w) in got.iter().zip(&want) {
            let (what, detail) = w.split_once(": ").unwrap_or((w, ""));
            assert!(g.starts_with(what) && g.contains(detail), "{name}: {g:?} does not say {w:?}\n{got:#?}");
        }
    }
}

#[test]
fn the_body_size_is_the_headers() {
    // A larger header sizes a larger body: nothing assumes the body starts at token 0 of a
    // fixed-size prompt; the header's `body_bytes` decides.
    let mut m = Inbound::new(Link::Stream);
    let h = KvPayloadHeader { layout: layout(), tokens: 7 };
    let begin = KvBegin { transfer_token: "t".into(), fingerprint: "fp".into(), header: h.encode().to_vec().into(), request_id: "r".into(), ..Default::default() };
    assert!(matches!(m.on(Event::Begin { id: 1, begin }), Action::Claim { header: Some(got), .. } if got.header == h && got.start == 0));
    let want = Expectation { transfer_token: "t".into(), fingerprint: "fp".into(), layout: layout(), prompt_tokens: 7, start: 0 };
    assert!(matches!(m.on(Event::Admitted { want, buf: Vec::new() }), Action::Next));
    let c = Chunk { offset: 0, len: h.body_bytes() + 1, crc: 0, buffer: false };
    assert!(matches!(m.on(Event::Chunk(c)), Action::Fail { error: WorkerError::Corrupt { what, .. }, .. } if what.contains(&format!("outside the {}-byte body", h.body_bytes()))));
}

#[test]
fn a_driver_mistake_is_internal() {
    let mut m = Inbound::new(Link::Pipe);
    assert!(matches!(m.on(Event::Landed), Action::Fail { error: WorkerError::Internal(m), then: After::Stop } if m.contains("a landed chunk out of order")));
    assert!(Inbound::new(Link::Stream).target().is_err());
}
