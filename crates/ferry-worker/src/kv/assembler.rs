//! Validating and assembling the chunks of one transfer into a KV payload. Every check that
//! protects the decode worker's cache is here, shared by all transports: transfer token, model
//! fingerprint, KV layout and size, per-chunk CRC-32, in-order and in-bounds data.

use crate::{Result, WorkerError};
use ferry_core::kv_payload::HEADER_BYTES;
use ferry_core::{KvLayout, KvPayloadHeader};
use ferry_engine::KvBuffer;
use ferry_proto::v1::{KvBegin, KvEnd};

/// What the receiving worker expects of a transfer it admitted.
#[derive(Clone, Debug)]
pub struct Expectation {
    pub transfer_token: String,
    pub fingerprint: String,
    pub layout: KvLayout,
    pub prompt_tokens: usize,
}

pub struct KvAssembler {
    id: u64,
    /// Header, then the body received so far (it grows in order; never zero-filled). With a
    /// `device` body, the header alone.
    payload: Vec<u8>,
    /// The body, when it arrives in buffer frames (device to device): allocated at the first
    /// one, where the pipe delivers. A transfer's body is all in `payload` or all here.
    device: Option<KvBuffer>,
    body: usize,
    /// Body bytes received so far (data arrives in order).
    next: usize,
    pub chunks: u32,
}

/// A complete, validated payload.
pub struct Assembled {
    /// The header and body; only the header when the body is in `device`.
    pub payload: Vec<u8>,
    /// The body, when it came in buffer frames (on the GPU, under NCCL).
    pub device: Option<KvBuffer>,
    pub end: KvEnd,
    pub chunks: u32,
}

/// Compare transfer tokens in time independent of where they differ (only the length can leak,
/// and every router-minted token has the same length).
pub(crate) fn tokens_match(want: &str, got: &str) -> bool {
    want.len() == got.len() && want.bytes().zip(got.bytes()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

impl KvAssembler {
    /// Start assembling into `buf` (a recycled buffer, or a new one).
    pub fn begin(id: u64, begin: &KvBegin, want: &Expectation, mut buf: Vec<u8>) -> Result<Self> {
        if !tokens_match(&want.transfer_token, &begin.transfer_token) {
            return Err(WorkerError::BadTransferToken(id));
        }
        if begin.fingerprint != want.fingerprint {
            return Err(WorkerError::Incompatible {
                id,
                what: format!("model fingerprint {} differs from this worker's {}", begin.fingerprint, want.fingerprint),
            });
        }
        if begin.header.len() != HEADER_BYTES {
            return Err(WorkerError::Corrupt { id, what: format!("header is {} bytes, expected {HEADER_BYTES}", begin.header.len()) });
        }
        let h = KvPayloadHeader::decode(&begin.header).map_err(|e| WorkerError::Corrupt { id, what: e.to_string() })?;
        if !h.layout.compatible(&want.layout) {
            return Err(WorkerError::Incompatible {
                id,
                what: format!("KV layout {:?} does not match this worker's {:?}", h.layout, want.layout),
            });
        }
        if h.tokens != want.prompt_tokens {
            return Err(WorkerError::Corrupt {
                id,
                what: format!("header says {} tokens but the request admitted {}", h.tokens, want.prompt_tokens),
            });
        }
        buf.clear();
        buf.reserve_exact(HEADER_BYTES + h.body_bytes());
        buf.extend_from_slice(&begin.header[..HEADER_BYTES]);
        Ok(Self { id, payload: buf, device: None, body: h.body_bytes(), next: 0, chunks: 0 })
    }

    /// A placeholder holding nothing (what is left after `finish` took the payload).
    pub(crate) fn empty() -> Self {
        Self { id: 0, payload: Vec::new(), device: None, body: 0, next: 0, chunks: 0 }
    }

    fn body_len(&self) -> usize {
        self.body
    }

    /// Give the buffer back (for recycling) when a transfer is abandoned.
    pub fn into_buffer(self) -> Vec<u8> {
        self.payload
    }

    fn check_range(&self, offset: u64, len: usize) -> Result<usize> {
        let off = usize::try_from(offset).map_err(|_| self.corrupt(format!("offset {offset} out of range")))?;
        if off != self.next {
            return Err(self.corrupt(format!("chunk at offset {off}, expected {}", self.next)));
        }
        if len == 0 || off.checked_add(len).is_none_or(|end| end > self.body_len()) {
            return Err(self.corrupt(format!("chunk {off}..+{len} outside the {}-byte body", self.body_len())));
        }
        Ok(off)
    }

    fn corrupt(&self, what: String) -> WorkerError {
        WorkerError::Corrupt { id: self.id, what }
    }

    /// A host chunk is refused once the body went to a buffer (and the other way round).
    fn check_kind(&self, buffer: bool) -> Result<()> {
        match (buffer, self.device.is_some()) {
            (false, true) => Err(self.corrupt("a host chunk after buffer frames".into())),
            (true, false) if self.next > 0 => Err(self.corrupt("a buffer frame after host chunks".into())),
            _ => Ok(()),
        }
    }

    /// Take a chunk already in memory.
    pub fn data(&mut self, offset: u64, data: &[u8], crc: u32) -> Result<()> {
        self.check_kind(false)?;
        let off = self.check_range(offset, data.len())?;
        let got = crc32fast::hash(data);
        if got != crc {
            return Err(self.corrupt(format!("chunk at offset {off}: CRC-32 {got:08x}, sender said {crc:08x}")));
        }
        self.payload.extend_from_slice(data);
        self.next += data.len();
        self.chunks += 1;
        Ok(())
    }

    /// The buffer a chunk of `len` bytes at `offset` is appended to, to read it from a socket in
    /// place; then [`KvAssembler::commit`] checks that exactly `len` bytes arrived, and the CRC.
    pub fn append_target(&mut self, offset: u64, len: usize) -> Result<&mut Vec<u8>> {
        self.check_kind(false)?;
        self.check_range(offset, len)?;
        Ok(&mut self.payload)
    }

    pub fn commit(&mut self, offset: u64, len: usize, crc: u32) -> Result<()> {
        let off = self.check_range(offset, len)?;
        if self.payload.len() != HEADER_BYTES + off + len {
            let got = self.payload.len() - HEADER_BYTES - off;
            self.payload.truncate(HEADER_BYTES + off);
            return Err(self.corrupt(format!("chunk at offset {off}: {got} bytes arrived, {len} announced")));
        }
        let got = crc32fast::hash(&self.payload[HEADER_BYTES + off..]);
        if got != crc {
            return Err(self.corrupt(format!("chunk at offset {off}: CRC-32 {got:08x}, sender said {crc:08x}")));
        }
        self.next += len;
        self.chunks += 1;
        Ok(())
    }

    /// Where a buffer frame of `len` bytes at `offset` goes: the body buffer (made with `alloc`
    /// at the first frame) and the byte range in it. Then [`KvAssembler::commit_buffer`].
    pub fn buffer_target(&mut self, offset: u64, len: usize, alloc: impl FnOnce(usize) -> std::result::Result<KvBuffer, String>) -> Result<(&mut KvBuffer, std::ops::Range<usize>)> {
        self.check_kind(true)?;
        let off = self.check_range(offset, len)?;
        if self.device.is_none() {
            let body = self.body;
            let buf = alloc(body).map_err(|e| WorkerError::Exhausted(format!("transfer {}: cannot allocate its {body}-byte KV body: {e}", self.id)))?;
            if buf.len() != body {
                return Err(WorkerError::Internal(format!("a {}-byte buffer allocated for a {body}-byte body", buf.len())));
            }
            self.device = Some(buf);
        }
        Ok((self.device.as_mut().expect("allocated above"), off..off + len))
    }

    /// The frame of [`KvAssembler::buffer_target`] arrived: check its word checksum where it is.
    pub fn commit_buffer(&mut self, offset: u64, len: usize, checksum: u32) -> Result<()> {
        let off = self.check_range(offset, len)?;
        let buf = self.device.as_ref().ok_or_else(|| self.corrupt("a buffer frame committed before its buffer existed".into()))?;
        let got = buf.checksum(off..off + len).map_err(|e| WorkerError::Internal(format!("checksum of a received KV frame: {e}")))?;
        if got != checksum {
            return Err(self.corrupt(format!("buffer frame at offset {off}: checksum {got:08x}, sender said {checksum:08x}")));
        }
        self.next += len;
        self.chunks += 1;
        Ok(())
    }

    pub fn finish(self, end: KvEnd) -> Result<Assembled> {
        if self.next != self.body_len() {
            return Err(self.corrupt(format!("ended after {} of {} body bytes", self.next, self.body_len())));
        }
        if end.chunks != self.chunks {
            return Err(self.corrupt(format!("sender counted {} chunks, {} arrived", end.chunks, self.chunks)));
        }
        Ok(Assembled { payload: self.payload, device: self.device, end, chunks: self.chunks })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferry_core::KvDtype;

    fn layout() -> KvLayout {
        KvLayout { dtype: KvDtype::F32, block_size: 16, n_layers: 2, n_kv_heads: 1, head_dim: 4 }
    }

    fn want() -> Expectation {
        Expectation { transfer_token: "t".into(), fingerprint: "fp".into(), layout: layout(), prompt_tokens: 3 }
    }

    fn begin() -> KvBegin {
        let h = KvPayloadHeader { layout: layout(), tokens: 3 };
        KvBegin { transfer_token: "t".into(), fingerprint: "fp".into(), header: h.encode().to_vec().into(), request_id: "r".into() }
    }

    #[test]
    fn assembles_in_order_and_checks_everything() {
        let body: Vec<u8> = (0..KvPayloadHeader { layout: layout(), tokens: 3 }.body_bytes()).map(|i| i as u8).collect();
        let mut a = KvAssembler::begin(1, &begin(), &want(), Vec::new()).unwrap();
        let (x, y) = body.split_at(40);
        assert!(matches!(a.data(40, y, crc32fast::hash(y)), Err(WorkerError::Corrupt { .. })), "out of order");
        assert!(matches!(a.data(0, x, 7), Err(WorkerError::Corrupt { .. })), "bad crc");
        a.data(0, x, crc32fast::hash(x)).unwrap();
        a.append_target(40, y.len()).unwrap().extend_from_slice(y);
        a.commit(40, y.len(), crc32fast::hash(y)).unwrap();
        let done = a.finish(KvEnd { chunks: 2, ..Default::default() }).unwrap();
        assert_eq!(&done.payload[HEADER_BYTES..], &body[..]);
    }

    #[test]
    fn refuses_wrong_peers_and_sizes() {
        let mut b = begin();
        b.transfer_token = "x".into();
        assert!(matches!(KvAssembler::begin(1, &b, &want(), Vec::new()), Err(WorkerError::BadTransferToken(1))));
        let mut b = begin();
        b.fingerprint = "other".into();
        assert!(matches!(KvAssembler::begin(1, &b, &want(), Vec::new()), Err(WorkerError::Incompatible { .. })));
        let mut w = want();
        w.layout.head_dim = 8;
        assert!(matches!(KvAssembler::begin(1, &begin(), &w, Vec::new()), Err(WorkerError::Incompatible { .. })));
        let mut w = want();
        w.prompt_tokens = 4;
        assert!(matches!(KvAssembler::begin(1, &begin(), &w, Vec::new()), Err(WorkerError::Corrupt { .. })));
        let mut a = KvAssembler::begin(1, &begin(), &want(), Vec::new()).unwrap();
        assert!(matches!(a.data(0, &vec![0; 10_000], 0), Err(WorkerError::Corrupt { .. })), "oversize chunk");
        assert!(matches!(a.finish(KvEnd::default()), Err(WorkerError::Corrupt { .. })), "short body");
    }

    #[test]
    fn assembles_buffer_frames_and_checks_them() {
        let body: Vec<u8> = (0..KvPayloadHeader { layout: layout(), tokens: 3 }.body_bytes()).map(|i| (i * 7) as u8).collect();
        let sum = |b: &[u8]| ferry_core::kv_payload::word_checksum(b);
        let (x, y) = body.split_at(40);
        let mut a = KvAssembler::begin(1, &begin(), &want(), Vec::new()).unwrap();
        let alloc = |n: usize| Ok(KvBuffer::Host(vec![0; n]));
        let (buf, r) = a.buffer_target(0, x.len(), alloc).unwrap();
        buf.write(r.start, x).unwrap();
        assert!(matches!(a.commit_buffer(0, x.len(), sum(x) ^ 1), Err(WorkerError::Corrupt { .. })), "bad checksum");
        a.commit_buffer(0, x.len(), sum(x)).unwrap();
        assert!(matches!(a.data(40, y, crc32fast::hash(y)), Err(WorkerError::Corrupt { .. })), "a host chunk after buffer frames");
        assert!(a.buffer_target(44, y.len(), alloc).is_err(), "out of order");
        let (buf, r) = a.buffer_target(40, y.len(), |_| panic!("allocated once")).unwrap();
        buf.write(r.start, y).unwrap();
        a.commit_buffer(40, y.len(), sum(y)).unwrap();
        let done = a.finish(KvEnd { chunks: 2, ..Default::default() }).unwrap();
        assert_eq!(done.payload.len(), HEADER_BYTES, "the header alone");
        assert_eq!(done.device.unwrap().as_host().unwrap(), &body[..]);

        // Buffer frames after host chunks; an allocation that fails; a wrong-sized buffer.
        let mut a = KvAssembler::begin(2, &begin(), &want(), Vec::new()).unwrap();
        a.data(0, x, crc32fast::hash(x)).unwrap();
        assert!(matches!(a.buffer_target(40, y.len(), alloc), Err(WorkerError::Corrupt { .. })));
        let mut a = KvAssembler::begin(3, &begin(), &want(), Vec::new()).unwrap();
        assert!(matches!(a.buffer_target(0, 8, |_| Err("out of device memory".into())), Err(WorkerError::Exhausted(m)) if m.contains("out of device memory")));
        assert!(a.buffer_target(0, 8, |_| Ok(KvBuffer::Host(vec![0; 8]))).is_err());
    }
}
