//! The TCP data path's framing. gRPC stays the control plane (admission hands out the data
//! address); bulk KV bytes go over a plain TCP connection per transfer, read straight into the
//! assembly buffer with no intermediate copy.
//!
//! Every frame is `kind: u8, len: u32 LE, len bytes`:
//! - `CONTROL`: a protobuf `KvChunk` (`begin` or `end`), sender to receiver;
//! - `DATA`: `offset: u64 LE, crc32: u32 LE`, then the chunk's bytes;
//! - `REPLY`: a protobuf `KvAckFrame`, receiver to sender, once, after `end` or on error.

use crate::{Result, WorkerError};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

pub const CONTROL: u8 = 1;
pub const DATA: u8 = 2;
pub const REPLY: u8 = 3;
/// Bytes before a data chunk's payload: offset and checksum.
pub const DATA_HEADER: usize = 12;
/// Control and reply frames are small; anything larger is a broken or hostile peer.
pub const MAX_CONTROL_BYTES: usize = 1 << 20;

pub fn frame_header(kind: u8, len: usize) -> [u8; 5] {
    let mut h = [0u8; 5];
    h[0] = kind;
    h[1..].copy_from_slice(&(len as u32).to_le_bytes());
    h
}

pub async fn write_message<W: AsyncWrite + Unpin, M: prost::Message>(w: &mut W, kind: u8, msg: &M) -> std::io::Result<()> {
    let body = msg.encode_to_vec();
    w.write_all(&frame_header(kind, body.len())).await?;
    w.write_all(&body).await
}

pub async fn write_data<W: AsyncWrite + Unpin>(w: &mut W, offset: u64, crc: u32, data: &[u8]) -> std::io::Result<()> {
    let mut h = [0u8; 5 + DATA_HEADER];
    h[..5].copy_from_slice(&frame_header(DATA, DATA_HEADER + data.len()));
    h[5..13].copy_from_slice(&offset.to_le_bytes());
    h[13..17].copy_from_slice(&crc.to_le_bytes());
    w.write_all(&h).await?;
    w.write_all(data).await
}

/// Read a frame's kind and length (None at a clean end of stream).
pub async fn read_header<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Option<(u8, usize)>> {
    let mut h = [0u8; 5];
    match r.read_exact(&mut h[..1]).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    r.read_exact(&mut h[1..]).await?;
    Ok(Some((h[0], u32::from_le_bytes([h[1], h[2], h[3], h[4]]) as usize)))
}

pub async fn read_message<R: AsyncRead + Unpin, M: prost::Message + Default>(r: &mut R, len: usize) -> Result<M> {
    if len > MAX_CONTROL_BYTES {
        return Err(WorkerError::InvalidRequest(format!("control frame of {len} bytes exceeds {MAX_CONTROL_BYTES}")));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf).await.map_err(|e| io_err("reading a frame", e))?;
    M::decode(&buf[..]).map_err(|e| WorkerError::InvalidRequest(format!("undecodable frame: {e}")))
}

pub async fn read_data_header<R: AsyncRead + Unpin>(r: &mut R) -> Result<(u64, u32)> {
    let mut h = [0u8; DATA_HEADER];
    r.read_exact(&mut h).await.map_err(|e| io_err("reading a data frame", e))?;
    Ok((u64::from_le_bytes(h[..8].try_into().expect("8 bytes")), u32::from_le_bytes(h[8..].try_into().expect("4 bytes"))))
}

pub fn io_err(what: &str, e: std::io::Error) -> WorkerError {
    WorkerError::PeerUnavailable { peer: "KV data connection".into(), what: format!("{what}: {e}") }
}
