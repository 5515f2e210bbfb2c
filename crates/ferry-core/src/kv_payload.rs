//! The exported KV of one sequence: a fixed little-endian header that describes the layout, then,
//! for each layer, K then V as `[tokens, kv_heads, head_dim]` in the header's dtype.
//!
//! Token-contiguous (not block-shaped) so a receiver with another block size or another device can
//! scatter it into its own pages; per-layer sections so a sender can stream layer by layer while
//! later layers are still being computed.

use thiserror::Error;

const MAGIC: &[u8; 8] = b"FERRYKV\x01";
/// Header size in bytes: magic, dtype, block size, layers, kv heads, head dim, tokens.
pub const HEADER_BYTES: usize = 8 + 4 * 6;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum KvDtype {
    F32,
    F16,
    BF16,
}

impl KvDtype {
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::BF16 => 2,
        }
    }
    fn code(self) -> u32 {
        match self {
            KvDtype::F32 => 0,
            KvDtype::F16 => 1,
            KvDtype::BF16 => 2,
        }
    }
    fn from_code(c: u32) -> Option<Self> {
        Some(match c {
            0 => KvDtype::F32,
            1 => KvDtype::F16,
            2 => KvDtype::BF16,
            _ => return None,
        })
    }
}

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
    /// Bytes of K (or V) for one token in one layer.
    pub fn token_bytes(&self) -> usize {
        self.n_kv_heads * self.head_dim * self.dtype.size()
    }
    /// Bytes of one layer's K and V for `tokens` tokens.
    pub fn layer_bytes(&self, tokens: usize) -> usize {
        2 * tokens * self.token_bytes()
    }
    /// Whether KV exported under `self` can be imported into a cache laid out as `other`
    /// (block size may differ: the payload is token-contiguous).
    pub fn compatible(&self, other: &KvLayout) -> bool {
        self.dtype == other.dtype
            && self.n_layers == other.n_layers
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
}

impl KvPayloadHeader {
    /// Bytes of the body (all layers, K and V) this header describes (saturating: a hostile
    /// header cannot overflow it, and no real body is that large).
    pub fn body_bytes(&self) -> usize {
        let l = &self.layout;
        [l.n_layers, 2, self.tokens, l.n_kv_heads, l.head_dim, l.dtype.size()].iter().fold(1usize, |a, &b| a.saturating_mul(b))
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

    /// Parse and sanity-check a header from the front of `bytes`.
    pub fn decode(bytes: &[u8]) -> Result<Self, KvPayloadError> {
        if bytes.len() < HEADER_BYTES {
            return Err(KvPayloadError::Truncated { got: bytes.len(), need: HEADER_BYTES });
        }
        if &bytes[..8] != MAGIC {
            return Err(KvPayloadError::BadMagic);
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

    proptest::proptest! {
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
