//! One disk block's file: what it holds and how a reader tells a whole, right file from a torn,
//! corrupt or foreign one.
//!
//! ```text
//! magic "FERRYKVB" | version u32 | hash u64 | parent u64 | tokens u32 | token ids u32 × tokens
//! | payload bytes u64 | payload | CRC-32 u32 of everything before it
//! ```
//!
//! Little-endian throughout. `parent` is the hash the block's chain continues from (the chain's
//! root for a first block), so a block read back is verified against the chain that asked for it,
//! not only against its own name. The payload is the block's KV, layer by layer as the backend
//! exports it, in the cache's stored dtype. A file is written whole under a temporary name and
//! renamed, so a crash leaves no half file under a block's name; the CRC catches the rest (a
//! disk that returns other bytes, a file cut short by hand).

use ferry_core::BlockHash;
use thiserror::Error;

const MAGIC: &[u8; 8] = b"FERRYKVB";
const VERSION: u32 = 1;
/// magic, version, hash, parent, token count.
const FIXED: usize = 8 + 4 + 8 + 8 + 4;

/// Why a block file was not served.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum FormatError {
    #[error("not a Ferry KV block file (bad magic)")]
    Magic,
    #[error("block file version {0}, this ferry reads version {VERSION}")]
    Version(u32),
    #[error("truncated: {have} bytes, {want} expected")]
    Truncated { have: usize, want: usize },
    #[error("checksum mismatch")]
    Checksum,
    #[error("the file holds block {found:016x}, not {want:016x}")]
    WrongBlock { want: u64, found: u64 },
    #[error("the block's parent or tokens differ from the chain that asked for it")]
    WrongChain,
    #[error("a payload of {have} bytes, {want} expected")]
    PayloadSize { have: usize, want: usize },
}

/// What a block file says about itself, without its payload.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    pub hash: BlockHash,
    pub parent: BlockHash,
    pub tokens: Vec<u32>,
    pub payload_bytes: usize,
}

impl Header {
    /// The whole file's length.
    pub fn file_bytes(&self) -> usize {
        FIXED + 4 * self.tokens.len() + 8 + self.payload_bytes + 4
    }
}

/// The bytes of a block's file.
pub fn encode(hash: BlockHash, parent: BlockHash, tokens: &[u32], payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(FIXED + 4 * tokens.len() + 8 + payload.len() + 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&hash.0.to_le_bytes());
    out.extend_from_slice(&parent.0.to_le_bytes());
    out.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(payload);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(x)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(x)
}

/// The header at the start of a file (`head`: at least its first bytes; the payload is not
/// checked here). `max_tokens` bounds the token count a header may claim.
pub fn decode_header(head: &[u8], max_tokens: usize) -> Result<Header, FormatError> {
    if head.len() < FIXED {
        return Err(FormatError::Truncated { have: head.len(), want: FIXED });
    }
    if &head[..8] != MAGIC {
        return Err(FormatError::Magic);
    }
    let version = u32_at(head, 8);
    if version != VERSION {
        return Err(FormatError::Version(version));
    }
    let n = u32_at(head, FIXED - 4) as usize;
    if n > max_tokens {
        return Err(FormatError::WrongChain);
    }
    let want = FIXED + 4 * n + 8;
    if head.len() < want {
        return Err(FormatError::Truncated { have: head.len(), want });
    }
    let tokens = (0..n).map(|i| u32_at(head, FIXED + 4 * i)).collect();
    let payload_bytes = u64_at(head, FIXED + 4 * n) as usize;
    Ok(Header { hash: BlockHash(u64_at(head, 12)), parent: BlockHash(u64_at(head, 20)), tokens, payload_bytes })
}

/// The payload of a whole file, checked: its checksum, that it is block `hash` continuing
/// `parent` with `tokens`, and that the payload has `payload_bytes` bytes.
pub fn decode<'a>(file: &'a [u8], hash: BlockHash, parent: BlockHash, tokens: &[u32], payload_bytes: usize) -> Result<&'a [u8], FormatError> {
    let h = decode_header(file, tokens.len())?;
    if file.len() != h.file_bytes() {
        return Err(FormatError::Truncated { have: file.len(), want: h.file_bytes() });
    }
    let (body, crc) = file.split_at(file.len() - 4);
    if crc32fast::hash(body) != u32_at(crc, 0) {
        return Err(FormatError::Checksum);
    }
    if h.hash != hash {
        return Err(FormatError::WrongBlock { want: hash.0, found: h.hash.0 });
    }
    if h.parent != parent || h.tokens != tokens {
        return Err(FormatError::WrongChain);
    }
    if h.payload_bytes != payload_bytes {
        return Err(FormatError::PayloadSize { have: h.payload_bytes, want: payload_bytes });
    }
    Ok(&body[body.len() - payload_bytes..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> (BlockHash, BlockHash, Vec<u32>, Vec<u8>) {
        (BlockHash(0xfeed), BlockHash(0xbeef), vec![5, 6, 7, 8], (0..64u8).collect())
    }

    #[test]
    fn a_block_reads_back_as_written() {
        let (h, p, t, payload) = sample();
        let file = encode(h, p, &t, &payload);
        assert_eq!(decode(&file, h, p, &t, 64), Ok(&payload[..]));
        let header = decode_header(&file, 16).unwrap();
        assert_eq!(header, Header { hash: h, parent: p, tokens: t, payload_bytes: 64 });
        assert_eq!(header.file_bytes(), file.len());
    }

    #[test]
    fn every_damage_is_caught() {
        let (h, p, t, payload) = sample();
        let file = encode(h, p, &t, &payload);
        // Any one byte flipped anywhere: caught (checksum, or the header's own checks first).
        for i in 0..file.len() {
            let mut bad = file.clone();
            bad[i] ^= 0x40;
            assert!(decode(&bad, h, p, &t, 64).is_err(), "byte {i} flipped and served");
        }
        // Cut short anywhere, or grown.
        for len in 0..file.len() {
            assert!(decode(&file[..len], h, p, &t, 64).is_err(), "cut to {len} and served");
        }
        let mut long = file.clone();
        long.push(0);
        assert!(matches!(decode(&long, h, p, &t, 64), Err(FormatError::Truncated { .. })));
        // A whole, valid file asked for under another chain, name or size.
        assert_eq!(decode(&file, BlockHash(1), p, &t, 64), Err(FormatError::WrongBlock { want: 1, found: 0xfeed }));
        assert_eq!(decode(&file, h, BlockHash(2), &t, 64), Err(FormatError::WrongChain));
        assert_eq!(decode(&file, h, p, &[5, 6, 7, 9], 64), Err(FormatError::WrongChain));
        assert_eq!(decode(&file, h, p, &t, 63), Err(FormatError::PayloadSize { have: 64, want: 63 }));
        assert_eq!(decode(b"not a block file at all, no......", h, p, &t, 64), Err(FormatError::Magic));
    }
}
