//! The exported KV of one sequence: a fixed little-endian header that describes the layout, then,
//! for each layer, K then V as `[tokens, kv_heads]` rows in the header's dtype (see [`crate::kv_dtype`]).
//!
//! Token-contiguous (not block-shaped) so a receiver with another block size or another device can
//! scatter it into its own pages; per-layer sections so a sender can stream layer by layer while
//! later layers are still being computed.
//!
//! Two header versions: v1 ([`KvPayloadHeader`], [`HEADER_BYTES`]) holds a sequence's KV from
//! token 0; v2 ([`KvSpan`], [`SPAN_HEADER_BYTES`]) adds the position of its first token, for a
//! receiver that already holds the leading blocks (a prefix cache hit) and needs only the rest.
//! A span starting at 0 is encoded as v1, so every payload that existed before v2 is unchanged;
//! [`KvPayloadHeader::decode`] refuses a v2 header rather than read it as starting at 0.

pub use crate::kv_dtype::KvDtype;
use thiserror::Error;

const MAGIC: &[u8; 8] = b"FERRYKV\x01";
const MAGIC_V2: &[u8; 8] = b"FERRYKV\x02";
/// Header size in bytes: magic, dtype, block size, layers, kv heads, head dim, tokens.
pub const HEADER_BYTES: usize = 8 + 4 * 6;
/// A v2 (span) header: the v1 fields, then the first token's position.
pub const SPAN_HEADER_BYTES: usize = HEADER_BYTES + 4;

/// The shape of a KV cache: what two engines must agree on to exchange KV.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct KvLayout {
    pub dtype: KvDtype,
    pub block_size: usize,
    pub n_layers: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// Bytes of one stored (token, KV head) row of K or V.
    pub fn row_bytes(&self) -> usize {
        self.dtype.row_bytes(self.head_dim)
    }
    /// Bytes of K (or V) for one token in one layer.
    pub fn token_bytes(&self) -> usize {
        self.n_kv_heads * self.row_bytes()
    }
    /// Bytes of K and V of one token in all layers: what a cache holds, and a payload ships, per token.
    pub fn bytes_per_token(&self) -> usize {
        self.n_layers * self.layer_bytes(1)
    }
    /// Bytes of one layer's K and V for `tokens` tokens.
    pub fn layer_bytes(&self, tokens: usize) -> usize {
        2 * tokens * self.token_bytes()
    }
    /// Whether KV exported under `self` can be imported into a cache laid out as `other`
    /// (block size may differ: the payload is token-contiguous; so may the dtype: the receiver
    /// converts on import).
    pub fn compatible(&self, other: &KvLayout) -> bool {
        self.n_layers == other.n_layers
            && self.n_kv_heads == other.n_kv_heads
            && self.head_dim == other.head_dim
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvPayloadHeader {
    pub layout: KvLayout,
    pub tokens: usize,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum KvPayloadError {
    #[error("KV payload too short: {got} bytes, need {need}")]
    Truncated { got: usize, need: usize },
    #[error("not a Ferry KV payload (bad magic)")]
    BadMagic,
    #[error("KV payload has unknown dtype code {0}")]
    UnknownDtype(u32),
    #[error("KV payload layout {got:?} does not match this cache's {want:?}")]
    LayoutMismatch { got: KvLayout, want: KvLayout },
    #[error("KV payload body is {got} bytes, the header implies {want}")]
    SizeMismatch { got: usize, want: usize },
    #[error("KV payload field {field} = {value} is out of range")]
    FieldOutOfRange { field: &'static str, value: u64 },
    /// A v2 payload read by a reader of whole sequences: it needs the first `start` tokens' KV
    /// already in place ([`KvSpan::decode`]).
    #[error("KV payload starts at token {start}, not 0: it continues a sequence the receiver must already hold")]
    StartsMidSequence { start: usize },
    #[error("KV payload starts at token {start}, not a multiple of the block size {block_size}")]
    StartNotBlockAligned { start: usize, block_size: usize },
    /// A span imported onto a sequence that holds another number of tokens than where it starts.
    #[error("KV payload starts at token {start} but the receiving sequence holds {holds} tokens")]
    SpanMismatch { start: usize, holds: usize },
    #[error("KV payload holds {payload} tokens but {given} token ids came with it")]
    TokenCount { payload: usize, given: usize },
}

impl KvPayloadHeader {
    /// Bytes of the body (all layers, K and V) this header describes (saturating: a hostile
    /// header cannot overflow it, and no real body is that large).
    pub fn body_bytes(&self) -> usize {
        let l = &self.layout;
        [l.n_layers, 2, self.tokens, l.n_kv_heads, l.row_bytes()].iter().fold(1usize, |a, &b| a.saturating_mul(b))
    }

    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut out = [0u8; HEADER_BYTES];
        out[..8].copy_from_slice(MAGIC);
        let l = &self.layout;
        let fields = [
            l.dtype.code(),
            l.block_size as u32,
            l.n_layers as u32,
            l.n_kv_heads as u32,
            l.head_dim as u32,
            self.tokens as u32,
        ];
        for (i, f) in fields.iter().enumerate() {
            out[8 + 4 * i..12 + 4 * i].copy_from_slice(&f.to_le_bytes());
        }
        out
    }

    /// Parse and sanity-check a v1 header from the front of `bytes` (a v2 span header is refused
    /// with [`KvPayloadError::StartsMidSequence`] unless it starts at 0).
    pub fn decode(bytes: &[u8]) -> Result<Self, KvPayloadError> {
        let span = KvSpan::decode(bytes)?;
        if span.start != 0 {
            return Err(KvPayloadError::StartsMidSequence { start: span.start });
        }
        Ok(span.header)
    }

    /// The v1 fields, after the magic (checked by the caller).
    fn decode_fields(bytes: &[u8]) -> Result<Self, KvPayloadError> {
        if bytes.len() < HEADER_BYTES {
            return Err(KvPayloadError::Truncated { got: bytes.len(), need: HEADER_BYTES });
        }
        let f = |i: usize| u32::from_le_bytes([bytes[8 + 4 * i], bytes[9 + 4 * i], bytes[10 + 4 * i], bytes[11 + 4 * i]]);
        let dtype = KvDtype::from_code(f(0)).ok_or(KvPayloadError::UnknownDtype(f(0)))?;
        // Bounds that no real model exceeds; they keep size arithmetic far from overflow.
        let check = |field: &'static str, v: u32, max: u32| {
            if v == 0 && field != "tokens" || v > max {
                Err(KvPayloadError::FieldOutOfRange { field, value: v as u64 })
            } else {
                Ok(v as usize)
            }
        };
        let layout = KvLayout {
            dtype,
            block_size: check("block_size", f(1), 1 << 16)?,
            n_layers: check("n_layers", f(2), 1 << 12)?,
            n_kv_heads: check("n_kv_heads", f(3), 1 << 12)?,
            head_dim: check("head_dim", f(4), 1 << 12)?,
        };
        let tokens = check("tokens", f(5), 1 << 24)?;
        Ok(Self { layout, tokens })
    }

    /// Decode a whole payload and check it against the receiving cache's layout and its own size.
    pub fn decode_checked(bytes: &[u8], want: &KvLayout) -> Result<Self, KvPayloadError> {
        let h = Self::decode(bytes)?;
        if !h.layout.compatible(want) {
            return Err(KvPayloadError::LayoutMismatch { got: h.layout, want: *want });
        }
        let body = bytes.len() - HEADER_BYTES;
        if body != h.body_bytes() {
            return Err(KvPayloadError::SizeMismatch { got: body, want: h.body_bytes() });
        }
        Ok(h)
    }
}

/// A payload of tokens `start..start + header.tokens` of a sequence (v2 when `start > 0`).
/// `start` is a multiple of the sender's block size: whole blocks are what a receiver caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSpan {
    pub header: KvPayloadHeader,
    pub start: usize,
}

impl KvSpan {
    /// Bytes of the encoded header.
    pub fn header_bytes(&self) -> usize {
        if self.start == 0 { HEADER_BYTES } else { SPAN_HEADER_BYTES }
    }

    /// v1 bytes when `start` is 0 (what every reader understands), else v2.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = self.header.encode().to_vec();
        if self.start != 0 {
            out[..8].copy_from_slice(MAGIC_V2);
            out.extend_from_slice(&(self.start as u32).to_le_bytes());
        }
        out
    }

    /// Parse and sanity-check a v1 or v2 header from the front of `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<Self, KvPayloadError> {
        if bytes.len() < 8 {
            return Err(KvPayloadError::Truncated { got: bytes.len(), need: HEADER_BYTES });
        }
        let v2 = match &bytes[..8] {
            m if m == MAGIC => false,
            m if m == MAGIC_V2 => true,
            _ => return Err(KvPayloadError::BadMagic),
        };
        let header = KvPayloadHeader::decode_fields(bytes)?;
        if !v2 {
            return Ok(Self { header, start: 0 });
        }
        if bytes.len() < SPAN_HEADER_BYTES {
            return Err(KvPayloadError::Truncated { got: bytes.len(), need: SPAN_HEADER_BYTES });
        }
        let start = u32::from_le_bytes([bytes[32], bytes[33], bytes[34], bytes[35]]);
        if start == 0 || start > 1 << 24 {
            return Err(KvPayloadError::FieldOutOfRange { field: "start", value: start as u64 });
        }
        let (start, block_size) = (start as usize, header.layout.block_size);
        if !start.is_multiple_of(block_size) {
            return Err(KvPayloadError::StartNotBlockAligned { start, block_size });
        }
        Ok(Self { header, start })
    }

    /// Decode a whole payload and check it against the receiving cache's layout and its own size.
    pub fn decode_checked(bytes: &[u8], want: &KvLayout) -> Result<Self, KvPayloadError> {
        let s = Self::decode(bytes)?;
        let h = &s.header;
        if !h.layout.compatible(want) {
            return Err(KvPayloadError::LayoutMismatch { got: h.layout, want: *want });
        }
        let body = bytes.len() - s.header_bytes();
        if body != h.body_bytes() {
            return Err(KvPayloadError::SizeMismatch { got: body, want: h.body_bytes() });
        }
        Ok(s)
    }
}

/// The checksum of KV moved between device buffers (the NCCL path's frames), where CRC-32's
/// serial pass over the bytes would need a copy to the host: the bytes as little-endian 32-bit
/// words (a short tail zero-padded), each mixed with its index, summed modulo 2³². The sum's
/// order does not matter, so a GPU computes it in one parallel reduction (`kernels/kv_checksum.cu`;
/// this function is its oracle). The mix is a bijection of the word for each index, so a changed
/// word always changes the sum, and two words that trade places almost always do.
pub fn word_checksum(bytes: &[u8]) -> u32 {
    bytes.chunks(4).enumerate().fold(0u32, |sum, (i, c)| {
        let mut w = [0u8; 4];
        w[..c.len()].copy_from_slice(c);
        sum.wrapping_add(mix_word(u32::from_le_bytes(w), i as u32))
    })
}

/// One word's term of [`word_checksum`]: `fmix32(w ^ fmix32(i·φ + c))` (MurmurHash3's finalizer).
pub fn mix_word(w: u32, i: u32) -> u32 {
    fmix32(w ^ fmix32(i.wrapping_mul(0x9E37_79B9).wrapping_add(0x7F4A_7C15)))
}

fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85EB_CA6B);
    h ^= h >> 13;
    h = h.wrapping_mul(0xC2B2_AE35);
    h ^ (h >> 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout { dtype: KvDtype::F32, block_size: 16, n_layers: 2, n_kv_heads: 3, head_dim: 4 }
    }

    #[test]
    fn header_roundtrip_and_checks() {
        let h = KvPayloadHeader { layout: layout(), tokens: 5 };
        let mut bytes = h.encode().to_vec();
        bytes.resize(HEADER_BYTES + h.body_bytes(), 0);
        assert_eq!(h.body_bytes(), 2 * 2 * 5 * 3 * 4 * 4);
        assert_eq!(KvPayloadHeader::decode_checked(&bytes, &layout()), Ok(h));
        // another block size is fine
        let other_bs = KvLayout { block_size: 32, ..layout() };
        assert!(KvPayloadHeader::decode_checked(&bytes, &other_bs).is_ok());
        let other_heads = KvLayout { n_kv_heads: 2, ..layout() };
        assert!(matches!(
            KvPayloadHeader::decode_checked(&bytes, &other_heads),
            Err(KvPayloadError::LayoutMismatch { .. })
        ));
        bytes.pop();
        assert!(matches!(KvPayloadHeader::decode_checked(&bytes, &layout()), Err(KvPayloadError::SizeMismatch { .. })));
        assert_eq!(KvPayloadHeader::decode(&bytes[..10]), Err(KvPayloadError::Truncated { got: 10, need: HEADER_BYTES }));
        let mut bad = bytes.clone();
        bad[0] = b'X';
        assert_eq!(KvPayloadHeader::decode(&bad), Err(KvPayloadError::BadMagic));
        let mut bad = bytes.clone();
        bad[8] = 9;
        assert_eq!(KvPayloadHeader::decode(&bad), Err(KvPayloadError::UnknownDtype(9)));
        let mut bad = bytes;
        bad[16..20].copy_from_slice(&0u32.to_le_bytes());
        assert!(matches!(KvPayloadHeader::decode(&bad), Err(KvPayloadError::FieldOutOfRange { field: "n_layers", .. })));
    }

    #[test]
    fn hostile_sizes_do_not_overflow() {
        let mut bytes = KvPayloadHeader { layout: layout(), tokens: 1 }.encode().to_vec();
        for (i, v) in [(1, 1u32 << 16), (2, 1 << 12), (3, 1 << 12), (4, 1 << 12), (5, 1 << 24)] {
            bytes[8 + 4 * i..12 + 4 * i].copy_from_slice(&v.to_le_bytes());
        }
        let h = KvPayloadHeader::decode(&bytes).unwrap();
        assert_eq!(h.body_bytes(), (1usize << 12).pow(3) * 2 * (1 << 24) * 4);
        assert!(KvPayloadHeader::decode_checked(&bytes, &layout()).is_err());
    }

    #[test]
    fn span_header_roundtrip_and_checks() {
        let h = KvPayloadHeader { layout: layout(), tokens: 5 };
        // start 0 is v1, byte for byte.
        let v1 = KvSpan { header: h, start: 0 };
        assert_eq!(v1.encode(), h.encode().to_vec());
        let mut bytes = v1.encode();
        bytes.resize(HEADER_BYTES + h.body_bytes(), 0);
        assert_eq!(KvSpan::decode_checked(&bytes, &layout()), Ok(v1));
        // start 32: v2, four bytes longer; a whole-sequence reader refuses it.
        let v2 = KvSpan { header: h, start: 32 };
        let mut bytes = v2.encode();
        assert_eq!(bytes.len(), SPAN_HEADER_BYTES);
        assert_eq!(v2.header_bytes(), SPAN_HEADER_BYTES);
        bytes.resize(SPAN_HEADER_BYTES + h.body_bytes(), 0);
        assert_eq!(KvSpan::decode_checked(&bytes, &layout()), Ok(v2));
        assert_eq!(KvPayloadHeader::decode(&bytes), Err(KvPayloadError::StartsMidSequence { start: 32 }));
        assert!(KvPayloadHeader::decode_checked(&bytes, &layout()).is_err());
        bytes.pop();
        assert!(matches!(KvSpan::decode_checked(&bytes, &layout()), Err(KvPayloadError::SizeMismatch { .. })));
        assert_eq!(KvSpan::decode(&bytes[..HEADER_BYTES]), Err(KvPayloadError::Truncated { got: HEADER_BYTES, need: SPAN_HEADER_BYTES }));
        // A start inside a block, or an encoded 0, is refused.
        let mut bad = KvSpan { header: h, start: 32 }.encode();
        bad[32..36].copy_from_slice(&8u32.to_le_bytes());
        assert_eq!(KvSpan::decode(&bad), Err(KvPayloadError::StartNotBlockAligned { start: 8, block_size: 16 }));
        bad[32..36].copy_from_slice(&0u32.to_le_bytes());
        assert!(matches!(KvSpan::decode(&bad), Err(KvPayloadError::FieldOutOfRange { field: "start", .. })));
    }

    proptest::proptest! {
        #[test]
        fn span_decode_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            let _ = KvSpan::decode_checked(&bytes, &layout());
            let mut v2 = b"FERRYKV\x02".to_vec();
            v2.extend_from_slice(&bytes);
            let _ = KvSpan::decode_checked(&v2, &layout());
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..64)) {
            let _ = KvPayloadHeader::decode_checked(&bytes, &layout());
        }
    }

    #[test]
    fn word_checksum_sees_changed_and_swapped_words() {
        let data: Vec<u8> = (0..4096u32).flat_map(|i| (i.wrapping_mul(2_654_435_761) >> 7).to_le_bytes()).collect();
        let sum = word_checksum(&data);
        // Known value: the CUDA kernel is checked against this function, this pins the function.
        assert_eq!(word_checksum(&[1, 0, 0, 0, 2]), mix_word(1, 0).wrapping_add(mix_word(2, 1)));
        assert_eq!(word_checksum(&[]), 0);
        for i in [0, 1, 17, 4095] {
            let mut d = data.clone();
            d[4 * i + 2] ^= 0x10;
            assert_ne!(word_checksum(&d), sum, "flipped a bit of word {i}");
            let mut d = data.clone();
            d.swap(4 * i, 4 * ((i + 1) % 4096));
            d.swap(4 * i + 1, 4 * ((i + 1) % 4096) + 1);
            d.swap(4 * i + 2, 4 * ((i + 1) % 4096) + 2);
            d.swap(4 * i + 3, 4 * ((i + 1) % 4096) + 3);
            assert_ne!(word_checksum(&d), sum, "swapped words {i} and {}", (i + 1) % 4096);
        }
        // Zero words still count (a zero-filled frame is not a zero checksum).
        assert_ne!(word_checksum(&[0; 64]), 0);
        assert_ne!(word_checksum(&[0; 64]), word_checksum(&[0; 68]));
    }
}
