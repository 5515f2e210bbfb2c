//! The one frame format of the KV data path, shared by the TCP connection and the device pipe
//! (NCCL). gRPC `PushKv` keeps protobuf messages as its framing; what a frame means is decided by
//! the same [`crate::kv::receive::inbound`] state machine either way
//! ([`crate::kv::receive::frame_event`] reads a frame as its event).
//!
//! Every frame is a fixed [`HEADER_BYTES`]-byte header, then `len` bytes of body:
//!
//! | bytes  | field                                         |
//! |--------|-----------------------------------------------|
//! | 0..4   | magic `FKV1`                                  |
//! | 4      | [`Kind`]                                      |
//! | 8..16  | `len: u64 LE`, the body's length              |
//! | 16..24 | `offset: u64 LE` into the payload body (data) |
//! | 24..28 | `crc: u32 LE` (data: CRC-32; buffer: word checksum) |
//!
//! A fixed header is what a pipe needs (NCCL receives a message only with the size it was sent
//! with), and it keeps a data chunk's body free of anything but KV bytes, so a socket reads it
//! straight into the payload and a pipe moves it device to device. Only pure byte functions live
//! here; [`tcp`] has the async reader and writer, the pipe its blocking ones.

use crate::kv::chunks::{Chunk, MAX_CHUNK_BYTES};
use ferry_proto::v1::KvAckFrame;
use prost::Message;

/// Frame kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// `KvChunk` with `begin` (protobuf).
    Begin = 1,
    /// A chunk of the payload body, at `offset`, with its CRC-32.
    Data = 2,
    /// `KvChunk` with `end` (protobuf); the receiver answers with `Reply`.
    End = 3,
    /// The sender gave up on the transfer (no reply follows); a pipe stays usable.
    Abort = 4,
    /// `KvAckFrame` (protobuf): the receiver's acknowledgement or error.
    Reply = 5,
    /// The sender retires the pipe.
    Close = 6,
    /// A piece of the payload body at `offset`, sent from a buffer where it lives (device to
    /// device under NCCL); `crc` holds its `ferry_core::kv_payload::word_checksum`, computed on
    /// the device on both sides. The receiver takes it into the body buffer it allocated.
    Buffer = 7,
    /// The first frame on a TCP data connection: the cluster secret (empty when the cluster is
    /// open). The receiver reads nothing else from a connection whose hello it refuses.
    Hello = 8,
}

impl Kind {
    fn from_u8(k: u8) -> Option<Kind> {
        Some(match k {
            1 => Kind::Begin,
            2 => Kind::Data,
            3 => Kind::End,
            4 => Kind::Abort,
            5 => Kind::Reply,
            6 => Kind::Close,
            7 => Kind::Buffer,
            8 => Kind::Hello,
            _ => return None,
        })
    }

    /// The largest body a frame of this kind may announce.
    fn max_len(self) -> usize {
        match self {
            Kind::Data => MAX_CHUNK_BYTES,
            Kind::Buffer => MAX_BUFFER_FRAME,
            Kind::Begin | Kind::End | Kind::Reply | Kind::Abort => MAX_CONTROL_BYTES,
            Kind::Close => 0,
            Kind::Hello => ferry_proto::cluster::MAX_LEN,
        }
    }
}

/// Largest [`Kind::Buffer`] frame: a bigger layer goes as several (each bounds the receiver's
/// drain of a frame it refuses, and one NCCL operation).
pub const MAX_BUFFER_FRAME: usize = 64 << 20;
/// Control and reply bodies are small (a few hundred bytes); anything larger is a broken or
/// hostile peer.
pub const MAX_CONTROL_BYTES: usize = 1 << 20;
pub const HEADER_BYTES: usize = 32;
const MAGIC: u32 = u32::from_le_bytes(*b"FKV1");

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub kind: Kind,
    pub len: u64,
    pub offset: u64,
    pub crc: u32,
}

impl FrameHeader {
    /// A frame with no offset or checksum (control, reply, abort, close).
    pub fn control(kind: Kind, len: usize) -> Self {
        FrameHeader { kind, len: len as u64, offset: 0, crc: 0 }
    }

    /// The header of a data or buffer frame.
    pub fn chunk(kind: Kind, c: Chunk) -> Self {
        FrameHeader { kind, len: c.len as u64, offset: c.offset, crc: c.crc }
    }

    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind as u8;
        b[8..16].copy_from_slice(&self.len.to_le_bytes());
        b[16..24].copy_from_slice(&self.offset.to_le_bytes());
        b[24..28].copy_from_slice(&self.crc.to_le_bytes());
        b
    }

    /// Parse and bound a header: the body it announces must fit what its kind may carry.
    pub fn decode(b: &[u8; HEADER_BYTES]) -> std::result::Result<Self, String> {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let magic = u32::from_le_bytes(b[0..4].try_into().expect("4 bytes"));
        if magic != MAGIC {
            return Err(format!("bad frame magic {magic:08x}"));
        }
        let kind = Kind::from_u8(b[4]).ok_or_else(|| format!("unknown frame kind {}", b[4]))?;
        let h = FrameHeader { kind, len: u64_at(8), offset: u64_at(16), crc: u32::from_le_bytes(b[24..28].try_into().expect("4 bytes")) };
        let max = kind.max_len();
        if h.len > max as u64 || (h.is_chunk() && h.len == 0) {
            return Err(format!("a {kind:?} frame announces {} bytes (at most {max})", h.len));
        }
        if kind == Kind::Buffer && (h.len % 4 != 0 || h.offset % 4 != 0) {
            return Err(format!("a buffer frame of {} bytes at offset {}: not whole 32-bit words", h.len, h.offset));
        }
        Ok(h)
    }

    /// Whether the body is payload bytes (read where they belong), not a control message.
    pub fn is_chunk(&self) -> bool {
        matches!(self.kind, Kind::Data | Kind::Buffer)
    }

    /// For a data or buffer frame: the chunk it announces.
    pub fn as_chunk(&self) -> Chunk {
        Chunk { offset: self.offset, len: self.len as usize, crc: self.crc, buffer: self.kind == Kind::Buffer }
    }
}

/// A control frame (header and body) carrying `msg`.
pub fn message(kind: Kind, msg: &impl Message) -> Vec<u8> {
    let len = msg.encoded_len();
    let mut out = Vec::with_capacity(HEADER_BYTES + len);
    out.extend_from_slice(&FrameHeader::control(kind, len).encode());
    msg.encode(&mut out).expect("a Vec grows");
    out
}

/// A reply frame's body as the acknowledgement it carries.
pub fn reply(h: &FrameHeader, body: &[u8]) -> std::result::Result<KvAckFrame, String> {
    if h.kind != Kind::Reply {
        return Err(format!("expected a reply frame, got {:?}", h.kind));
    }
    KvAckFrame::decode(body).map_err(|e| format!("undecodable reply: {e}"))
}

/// The frames over a tokio stream (the TCP data path). A header that does not parse is an
/// `InvalidData` error.
pub mod tcp {
    use crate::kv::frame::{FrameHeader, HEADER_BYTES};
    use std::io::{Error, ErrorKind, Result};
    use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

    /// Write a frame: its header, then `body`.
    pub async fn write<W: AsyncWrite + Unpin>(w: &mut W, h: FrameHeader, body: &[u8]) -> Result<()> {
        w.write_all(&h.encode()).await?;
        w.write_all(body).await
    }

    /// Read a frame's header (None at a clean end of stream, before its first byte).
    pub async fn read_header<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<FrameHeader>> {
        let mut h = [0u8; HEADER_BYTES];
        match r.read_exact(&mut h[..1]).await {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        r.read_exact(&mut h[1..]).await?;
        FrameHeader::decode(&h).map(Some).map_err(|e| Error::new(ErrorKind::InvalidData, e))
    }

    /// Read a control frame's body (its length bounded by the header's decode).
    pub async fn read_body<R: AsyncRead + Unpin>(r: &mut R, h: &FrameHeader) -> Result<Vec<u8>> {
        let mut buf = vec![0u8; h.len as usize];
        r.read_exact(&mut buf).await?;
        Ok(buf)
    }

    /// Append exactly `n` bytes from `r` to `buf`, straight into its spare capacity.
    pub async fn read_appending<R: AsyncRead + Unpin>(r: &mut R, buf: &mut Vec<u8>, n: usize) -> Result<()> {
        use bytes::BufMut;
        let mut left = n;
        while left > 0 {
            let mut limited = (&mut *buf).limit(left);
            let got = r.read_buf(&mut limited).await?;
            if got == 0 {
                return Err(ErrorKind::UnexpectedEof.into());
            }
            left -= got;
        }
        Ok(())
    }

    /// Read and drop `n` bytes.
    pub async fn skip<R: AsyncRead + Unpin>(r: &mut R, n: usize) -> Result<()> {
        let copied = tokio::io::copy(&mut r.take(n as u64), &mut tokio::io::sink()).await?;
        if copied != n as u64 {
            return Err(ErrorKind::UnexpectedEof.into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_and_are_bounded() {
        let h = FrameHeader { kind: Kind::Data, len: 1000, offset: 1 << 40, crc: 0xdead_beef };
        assert_eq!(FrameHeader::decode(&h.encode()).unwrap(), h);
        let mut bad = h.encode();
        bad[0] ^= 1;
        let err = |b: &[u8; HEADER_BYTES]| FrameHeader::decode(b).unwrap_err();
        assert!(err(&bad).contains("magic"));
        assert!(err(&FrameHeader { len: MAX_CHUNK_BYTES as u64 + 1, ..h }.encode()).contains("announces"));
        assert!(err(&FrameHeader { len: 0, ..h }.encode()).contains("announces"), "empty data frame");
        let mut unknown = h.encode();
        unknown[4] = 99;
        assert!(err(&unknown).contains("unknown frame kind 99"));
        assert!(FrameHeader::decode(&FrameHeader::control(Kind::Close, 1).encode()).is_err(), "close carries no body");
        let odd = FrameHeader { kind: Kind::Buffer, len: 6, offset: 0, crc: 0 };
        assert!(err(&odd.encode()).contains("32-bit words"));
    }

    #[test]
    fn a_reply_frame_is_a_reply() {
        let data = FrameHeader { kind: Kind::Buffer, len: 8, offset: 4, crc: 9 };
        assert!(reply(&data, &[]).unwrap_err().contains("expected a reply"));
    }
}
