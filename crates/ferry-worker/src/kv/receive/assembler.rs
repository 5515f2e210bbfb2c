//! Validating and assembling the chunks of one transfer into a KV payload. Every check that
//! protects the decode worker's cache is here, shared by all transports through the
//! [`super::inbound`] state machine: transfer token, model fingerprint, KV layout and size,
//! per-chunk checksum, in-order and in-bounds data. Pure: no I/O (the driver reads a chunk's bytes
//! into [`KvAssembler::target`]).

use crate::error::{Result, WorkerError};
use crate::kv::chunks::Chunk;
use ferry_core::kv_payload::{HEADER_BYTES, SPAN_HEADER_BYTES};
use ferry_core::{KvLayout, KvSpan};
use ferry_engine::KvBuffer;
use ferry_proto::v1::{KvBegin, KvEnd};
use std::ops::Range;

/// What the receiving worker expects of a transfer it admitted.
#[derive(Clone, Debug)]
pub struct Expectation {
    pub transfer_token: String,
    pub fingerprint: String,
    pub layout: KvLayout,
    pub prompt_tokens: usize,
    /// The prompt's leading tokens the receiver holds already (its cached prefix, whole blocks):
    /// the payload must be the span of tokens `start..prompt_tokens`.
    pub start: usize,
}

pub struct KvAssembler {
    id: u64,
    /// Header, then the body received so far (it grows in order; never zero-filled). With a
    /// `device` body, the header alone.
    payload: Vec<u8>,
    /// The body, when it arrives in buffer frames (device to device): allocated at the first
    /// one, where the pipe delivers. A transfer's body is all in `payload` or all here.
    device: Option<KvBuffer>,
    /// Bytes of the payload header (v1, or a v2 span's).
    hdr: usize,
    body: usize,
    /// Body bytes received so far (data arrives in order).
    next: usize,
    pub chunks: u32,
    traceparent: String,
}

/// A complete, validated payload.
pub struct Assembled {
    /// The header and body; only the header when the body is in `device`.
    pub payload: Vec<u8>,
    /// The body, when it came in buffer frames (on the GPU, under NCCL).
    pub device: Option<KvBuffer>,
    pub end: KvEnd,
    pub chunks: u32,
    /// The sender's span (`KvBegin.traceparent`), unchecked: [`ferry_proto::trace::Parent`] parses it.
    pub traceparent: String,
}

/// Compare transfer tokens in time independent of where they differ (only the length can leak,
/// and every router-minted token has the same length).
pub(crate) fn tokens_match(want: &str, got: &str) -> bool {
    want.len() == got.len() && want.bytes().zip(got.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// Where a chunk's bytes go, for the driver to read them into.
pub enum Target<'a> {
    /// Append to the payload (the chunk's length, no more: [`KvAssembler::commit`] checks).
    Host(&'a mut Vec<u8>),
    /// Write bytes `range` of the body buffer.
    Buffer(&'a mut KvBuffer, Range<usize>),
}

/// The payload length (header and body) a header announces: the body size is the header's own
/// word ([`ferry_core::KvPayloadHeader::body_bytes`]), so a span that carries only part of a
/// sequence's KV (from a block offset on) sizes its transfer the same way.
pub fn payload_len(h: &KvSpan) -> usize {
    h.header_bytes().saturating_add(h.header.body_bytes())
}

/// The payload header a `begin` carries (a whole sequence's, or a span's from a block offset),
/// checked: its fields, then that its size is exactly the header's.
pub fn header(id: u64, begin: &KvBegin) -> Result<KvSpan> {
    let n = begin.header.len();
    if n != HEADER_BYTES && n != SPAN_HEADER_BYTES {
        return Err(WorkerError::Corrupt { id, what: format!("header is {n} bytes, expected {HEADER_BYTES} ({SPAN_HEADER_BYTES} for a span)") });
    }
    let span = KvSpan::decode(&begin.header).map_err(|e| WorkerError::Corrupt { id, what: e.to_string() })?;
    if begin.header.len() != span.header_bytes() {
        return Err(WorkerError::Corrupt { id, what: format!("header is {} bytes, expected {}", begin.header.len(), span.header_bytes()) });
    }
    Ok(span)
}

impl KvAssembler {
    /// Start assembling the payload `h` describes (decoded once, by [`header`]) into `buf` (a
    /// recycled buffer, or a new one).
    pub fn begin(id: u64, begin: &KvBegin, span: &KvSpan, want: &Expectation, mut buf: Vec<u8>) -> Result<Self> {
        let h = &span.header;
        if !tokens_match(&want.transfer_token, &begin.transfer_token) {
            return Err(WorkerError::BadTransferToken(id));
        }
        if begin.fingerprint != want.fingerprint {
            return Err(WorkerError::Incompatible {
                id,
                what: format!("model fingerprint {} differs from this worker's {}", begin.fingerprint, want.fingerprint),
            });
        }
        if !h.layout.compatible(&want.layout) {
            return Err(WorkerError::Incompatible {
                id,
                what: format!("KV layout {:?} does not match this worker's {:?}", h.layout, want.layout),
            });
        }
        if span.start != want.start {
            return Err(WorkerError::Corrupt {
                id,
                what: format!("the KV starts at token {} but this worker holds the first {} of the prompt", span.start, want.start),
            });
        }
        if span.start + h.tokens != want.prompt_tokens {
            return Err(WorkerError::Corrupt {
                id,
                what: format!(
                    "header says tokens {}..{} but the request admitted a prompt of {}",
                    span.start,
                    span.start + h.tokens,
                    want.prompt_tokens
                ),
            });
        }
        buf.clear();
        buf.reserve_exact(payload_len(span));
        // The header as sent ([`header`] checked its size and fields).
        buf.extend_from_slice(&begin.header);
        // A `traceparent` is 55 characters (version 00); anything much longer is not kept.
        let traceparent = if begin.traceparent.len() <= 128 { begin.traceparent.clone() } else { String::new() };
        Ok(Self { id, payload: buf, device: None, hdr: span.header_bytes(), body: h.body_bytes(), next: 0, chunks: 0, traceparent })
    }

    pub fn id(&self) -> u64 {
        self.id
    }

    /// Bytes of the body (what the header announced).
    pub fn body_len(&self) -> usize {
        self.body
    }

    fn check_range(&self, c: &Chunk) -> Result<usize> {
        let (offset, len) = (c.offset, c.len);
        let off = usize::try_from(offset).map_err(|_| self.corrupt(format!("offset {offset} out of range")))?;
        if off != self.next {
            return Err(self.corrupt(format!("chunk at offset {off}, expected {}", self.next)));
        }
        if len == 0 || off.checked_add(len).is_none_or(|end| end > self.body) {
            return Err(self.corrupt(format!("chunk {off}..+{len} outside the {}-byte body", self.body)));
        }
        Ok(off)
    }

    fn corrupt(&self, what: String) -> WorkerError {
        WorkerError::Corrupt { id: self.id, what }
    }

    /// Whether chunk `c` may come next: in order, inside the body, and of the body's kind (a
    /// host chunk is refused once the body went to a buffer, and the other way round).
    pub fn accept(&self, c: &Chunk) -> Result<()> {
        match (c.buffer, self.device.is_some()) {
            (false, true) => return Err(self.corrupt("a host chunk after buffer frames".into())),
            (true, false) if self.next > 0 => return Err(self.corrupt("a buffer frame after host chunks".into())),
            _ => {}
        }
        self.check_range(c).map(|_| ())
    }

    /// Whether buffer chunk `c` needs the body buffer allocated first ([`KvAssembler::set_buffer`]).
    pub fn needs_buffer(&self, c: &Chunk) -> bool {
        c.buffer && self.device.is_none()
    }

    /// The body buffer, allocated where the pipe delivers; it must hold the whole body.
    pub fn set_buffer(&mut self, buf: KvBuffer) -> Result<()> {
        if buf.len() != self.body {
            return Err(WorkerError::Internal(format!("a {}-byte buffer allocated for a {}-byte body", buf.len(), self.body)));
        }
        self.device = Some(buf);
        Ok(())
    }

    /// Where an accepted chunk's bytes go; then [`KvAssembler::commit`].
    pub fn target(&mut self, c: &Chunk) -> Result<Target<'_>> {
        let off = self.check_range(c)?;
        match (c.buffer, self.device.as_mut()) {
            (false, _) => Ok(Target::Host(&mut self.payload)),
            (true, Some(buf)) => Ok(Target::Buffer(buf, off..off + c.len)),
            (true, None) => Err(WorkerError::Internal("a buffer frame before its body buffer existed".into())),
        }
    }

    /// Chunk `c` arrived where [`KvAssembler::target`] said: check that exactly its length
    /// arrived, and its checksum (CRC-32 on the host; the word checksum where a buffer lives).
    pub fn commit(&mut self, c: &Chunk) -> Result<()> {
        let off = self.check_range(c)?;
        let len = c.len;
        let (got, what, sum) = if c.buffer {
            let buf = self.device.as_ref().ok_or_else(|| self.corrupt("a buffer frame committed before its buffer existed".into()))?;
            let _t = ferry_core::phase_clock::span("receive: checksum of a landed frame");
            (buf.checksum(off..off + len).map_err(|e| WorkerError::Internal(format!("checksum of a received KV frame: {e}")))?, "buffer frame", "checksum")
        } else {
            let at = self.hdr + off;
            if self.payload.len() != at + len {
                let got = self.payload.len().saturating_sub(at);
                self.payload.truncate(at);
                return Err(self.corrupt(format!("chunk at offset {off}: {got} bytes arrived, {len} announced")));
            }
            (crc32fast::hash(&self.payload[at..]), "chunk", "CRC-32")
        };
        if got != c.crc {
            if !c.buffer {
                self.payload.truncate(self.hdr + off);
            }
            return Err(self.corrupt(format!("{what} at offset {off}: {sum} {got:08x}, sender said {:08x}", c.crc)));
        }
        self.next += len;
        self.chunks += 1;
        Ok(())
    }

    pub fn finish(self, end: KvEnd) -> Result<Assembled> {
        if self.next != self.body {
            return Err(self.corrupt(format!("ended after {} of {} body bytes", self.next, self.body)));
        }
        if end.chunks != self.chunks {
            return Err(self.corrupt(format!("sender counted {} chunks, {} arrived", end.chunks, self.chunks)));
        }
        Ok(Assembled { payload: self.payload, device: self.device, end, chunks: self.chunks, traceparent: self.traceparent })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::KvPayloadHeader;
    use ferry_core::KvDtype;

    fn layout() -> KvLayout {
        KvLayout { dtype: KvDtype::F32, block_size: 16, n_layers: 2, n_kv_heads: 1, head_dim: 4 }
    }

    fn want() -> Expectation {
        Expectation { transfer_token: "t".into(), fingerprint: "fp".into(), layout: layout(), prompt_tokens: 3, start: 0 }
    }

    fn begin() -> KvBegin {
        let h = KvPayloadHeader { layout: layout(), tokens: 3 };
        KvBegin { transfer_token: "t".into(), fingerprint: "fp".into(), header: h.encode().to_vec().into(), request_id: "r".into(), ..Default::default() }
    }

    fn start(id: u64, b: &KvBegin, w: &Expectation) -> Result<KvAssembler> {
        KvAssembler::begin(id, b, &header(id, b)?, w, Vec::new())
    }

    fn host(offset: u64, data: &[u8], crc: u32) -> Chunk {
        Chunk { offset, len: data.len(), crc, buffer: false }
    }

    /// Accept `c`, append `data` where it goes, and commit.
    fn put(a: &mut KvAssembler, c: Chunk, data: &[u8]) -> Result<()> {
        a.accept(&c)?;
        match a.target(&c)? {
            Target::Host(v) => v.extend_from_slice(data),
            Target::Buffer(b, r) => b.write(r.start, data).unwrap(),
        }
        a.commit(&c)
    }

    #[test]
    fn assembles_in_order_and_checks_everything() {
        let body: Vec<u8> = (0..KvPayloadHeader { layout: layout(), tokens: 3 }.body_bytes()).map(|i| i as u8).collect();
        let mut a = start(1, &begin(), &want()).unwrap();
        assert_eq!(a.body_len(), body.len(), "the body size is the header's");
        let (x, y) = body.split_at(40);
        assert!(matches!(a.accept(&host(40, y, crc32fast::hash(y))), Err(WorkerError::Corrupt { .. })), "out of order");
        let e = put(&mut a, host(0, x, 7), x).unwrap_err();
        assert!(e.to_string().contains("CRC-32"), "bad crc: {e}");
        put(&mut a, host(0, x, crc32fast::hash(x)), x).unwrap();
        // Fewer bytes than announced.
        let c = host(40, y, crc32fast::hash(y));
        assert!(put(&mut a, c, &y[1..]).unwrap_err().to_string().contains("arrived"));
        put(&mut a, c, y).unwrap();
        let done = a.finish(KvEnd { chunks: 2, ..Default::default() }).unwrap();
        assert_eq!(&done.payload[HEADER_BYTES..], &body[..]);
        assert_eq!(&done.payload[..HEADER_BYTES], &begin().header[..]);
    }

    #[test]
    fn refuses_wrong_peers_and_sizes() {
        let mut b = begin();
        b.transfer_token = "x".into();
        assert!(matches!(start(1, &b, &want()), Err(WorkerError::BadTransferToken(1))));
        let mut b = begin();
        b.fingerprint = "other".into();
        assert!(matches!(start(1, &b, &want()), Err(WorkerError::Incompatible { .. })));
        let mut b = begin();
        b.header = b.header.slice(1..);
        assert!(matches!(header(1, &b), Err(WorkerError::Corrupt { what, .. }) if what.contains("header is")));
        let mut w = want();
        w.layout.head_dim = 8;
        assert!(matches!(start(1, &begin(), &w), Err(WorkerError::Incompatible { .. })));
        let mut w = want();
        w.prompt_tokens = 4;
        assert!(matches!(start(1, &begin(), &w), Err(WorkerError::Corrupt { .. })));
        let a = start(1, &begin(), &want()).unwrap();
        assert!(matches!(a.accept(&host(0, &vec![0; 10_000], 0)), Err(WorkerError::Corrupt { .. })), "oversize chunk");
        assert!(matches!(a.finish(KvEnd::default()), Err(WorkerError::Corrupt { .. })), "short body");
    }

    #[test]
    fn assembles_buffer_frames_and_checks_them() {
        let body: Vec<u8> = (0..KvPayloadHeader { layout: layout(), tokens: 3 }.body_bytes()).map(|i| (i * 7) as u8).collect();
        let sum = |b: &[u8]| ferry_core::kv_payload::word_checksum(b);
        let chunk = |offset: u64, b: &[u8], crc: u32| Chunk { offset, len: b.len(), crc, buffer: true };
        let (x, y) = body.split_at(40);
        let mut a = start(1, &begin(), &want()).unwrap();
        assert!(a.needs_buffer(&chunk(0, x, 0)));
        a.set_buffer(KvBuffer::Host(vec![0; body.len()])).unwrap();
        assert!(!a.needs_buffer(&chunk(0, x, 0)), "allocated once");
        assert!(matches!(put(&mut a, chunk(0, x, sum(x) ^ 1), x), Err(WorkerError::Corrupt { .. })), "bad checksum");
        put(&mut a, chunk(0, x, sum(x)), x).unwrap();
        assert!(matches!(a.accept(&host(40, y, crc32fast::hash(y))), Err(WorkerError::Corrupt { .. })), "a host chunk after buffer frames");
        assert!(a.accept(&chunk(44, y, sum(y))).is_err(), "out of order");
        put(&mut a, chunk(40, y, sum(y)), y).unwrap();
        let done = a.finish(KvEnd { chunks: 2, ..Default::default() }).unwrap();
        assert_eq!(done.payload.len(), HEADER_BYTES, "the header alone");
        assert_eq!(done.device.unwrap().as_host().unwrap(), &body[..]);

        // Buffer frames after host chunks; a wrong-sized buffer.
        let mut a = start(2, &begin(), &want()).unwrap();
        put(&mut a, host(0, x, crc32fast::hash(x)), x).unwrap();
        assert!(matches!(a.accept(&chunk(40, y, 0)), Err(WorkerError::Corrupt { .. })));
        let mut a = start(3, &begin(), &want()).unwrap();
        assert!(matches!(a.set_buffer(KvBuffer::Host(vec![0; 8])), Err(WorkerError::Internal(_))));
    }

    #[test]
    fn a_span_must_start_where_the_receiver_holds_and_end_at_the_prompt() {
        // The receiver holds the first block (16 tokens) of a 19-token prompt: it takes 16..19.
        let span = |start: usize, tokens: usize| {
            let h = KvSpan { header: KvPayloadHeader { layout: layout(), tokens }, start };
            KvBegin { transfer_token: "t".into(), fingerprint: "fp".into(), header: h.encode().into(), request_id: "r".into(), ..Default::default() }
        };
        let w = Expectation { prompt_tokens: 19, start: 16, ..want() };
        let b = span(16, 3);
        assert_eq!(header(1, &b).unwrap().start, 16);
        let mut a = start(1, &b, &w).unwrap();
        let body: Vec<u8> = (0..KvPayloadHeader { layout: layout(), tokens: 3 }.body_bytes()).map(|i| i as u8).collect();
        put(&mut a, host(0, &body, crc32fast::hash(&body)), &body).unwrap();
        let done = a.finish(KvEnd { chunks: 1, ..Default::default() }).unwrap();
        assert_eq!(done.payload.len(), SPAN_HEADER_BYTES + body.len(), "the span's header, then its body");
        assert_eq!(KvSpan::decode(&done.payload).unwrap().start, 16);
        // A whole payload where a span is expected, a span from elsewhere, or the wrong length.
        for (b, why) in [(span(0, 19), "starts at token 0"), (span(32, 3), "starts at token 32"), (span(16, 4), "tokens 16..20")] {
            assert!(matches!(start(1, &b, &w), Err(WorkerError::Corrupt { what, .. }) if what.contains(why)), "{why}");
        }
        // A span where the whole prompt is expected.
        assert!(matches!(start(1, &span(16, 3), &Expectation { prompt_tokens: 19, ..want() }), Err(WorkerError::Corrupt { .. })));
    }
}
