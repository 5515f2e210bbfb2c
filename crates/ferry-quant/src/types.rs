//! Weight storage types and their block layouts.
//!
//! The block formats are GGML's (llama.cpp `ggml-common.h`), as stored in GGUF files. Every block is
//! little-endian and packed (no padding); a row of `k` elements is `k / block_elems` blocks back to
//! back. Layouts, with byte offsets inside one block:
//!
//! | type | elems | bytes | layout |
//! |---|---|---|---|
//! | `Q8_0` | 32 | 34 | `f16 d` @0, `i8 qs[32]` @2; `w[j] = d * qs[j]` |
//! | `Q4_0` | 32 | 18 | `f16 d` @0, `u8 qs[16]` @2; `w[j] = d * (lo(qs[j]) - 8)`, `w[j+16] = d * (hi(qs[j]) - 8)` |
//! | `Q4_1` | 32 | 20 | `f16 d` @0, `f16 m` @2, `u8 qs[16]` @4; `w[j] = d * lo(qs[j]) + m`, `w[j+16] = d * hi(qs[j]) + m` |
//! | `Q4_K` | 256 | 144 | `f16 d` @0, `f16 dmin` @2, `u8 scales[12]` @4, `u8 qs[128]` @16 |
//! | `Q6_K` | 256 | 210 | `u8 ql[128]` @0, `u8 qh[64]` @128, `i8 scales[16]` @192, `f16 d` @208 |
//!
//! The K-quant element formulas are in [`crate::scalar`], next to their reference dequantizers.

use std::fmt;

/// Elements in one block of `Q8_0`, `Q4_0` and `Q4_1`.
pub(crate) const QK: usize = 32;
/// Elements in one K-quant super-block.
pub(crate) const QK_K: usize = 256;

/// A weight storage type. Row-major rows of `k` elements; every row is a whole number of blocks.
#[allow(non_camel_case_types)] // GGML's names: Q4_K reads better than Q4K next to Q4_0 and Q4_1.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightType {
    /// Dense little-endian `f32`.
    F32,
    /// Dense little-endian IEEE half precision.
    F16,
    /// Dense little-endian bfloat16.
    BF16,
    /// 32 elements: one `f16` scale and 32 `i8`.
    Q8_0,
    /// 32 elements: one `f16` scale and 32 nibbles offset by 8.
    Q4_0,
    /// 32 elements: `f16` scale and `f16` minimum, 32 nibbles.
    Q4_1,
    /// 256 elements: 8 sub-blocks of 32 with 6-bit scales and mins, 4-bit quants.
    Q4_K,
    /// 256 elements: 16 sub-blocks of 16 with 8-bit scales, 6-bit quants.
    Q6_K,
}

impl WeightType {
    /// Every type, in declaration order (for tests and benchmarks).
    pub const ALL: [WeightType; 8] = [
        WeightType::F32,
        WeightType::F16,
        WeightType::BF16,
        WeightType::Q8_0,
        WeightType::Q4_0,
        WeightType::Q4_1,
        WeightType::Q4_K,
        WeightType::Q6_K,
    ];

    /// Elements per block: 1 for dense types, 32 for `Q8_0`/`Q4_0`/`Q4_1`, 256 for K-quants.
    pub fn block_elems(self) -> usize {
        match self {
            WeightType::F32 | WeightType::F16 | WeightType::BF16 => 1,
            WeightType::Q8_0 | WeightType::Q4_0 | WeightType::Q4_1 => QK,
            WeightType::Q4_K | WeightType::Q6_K => QK_K,
        }
    }

    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            WeightType::F32 => 4,
            WeightType::F16 | WeightType::BF16 => 2,
            WeightType::Q8_0 => 34,
            WeightType::Q4_0 => 18,
            WeightType::Q4_1 => 20,
            WeightType::Q4_K => 144,
            WeightType::Q6_K => 210,
        }
    }

    /// Bytes of one row of `k` elements, or `None` if `k` is not a multiple of
    /// [`block_elems`](Self::block_elems) (or the size overflows `usize`).
    pub fn row_bytes(self, k: usize) -> Option<usize> {
        // Block sizes are powers of two: mask and shift instead of dividing (this runs once per
        // `dot_rows` call, i.e. once per weight row).
        let be = self.block_elems();
        if k & (be - 1) != 0 {
            return None;
        }
        (k >> be.trailing_zeros()).checked_mul(self.block_bytes())
    }

    /// Lower-case name as llama.cpp prints it: "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k".
    pub fn name(self) -> &'static str {
        match self {
            WeightType::F32 => "f32",
            WeightType::F16 => "f16",
            WeightType::BF16 => "bf16",
            WeightType::Q8_0 => "q8_0",
            WeightType::Q4_0 => "q4_0",
            WeightType::Q4_1 => "q4_1",
            WeightType::Q4_K => "q4_k",
            WeightType::Q6_K => "q6_k",
        }
    }
}

impl fmt::Display for WeightType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Little-endian `u16` at byte `i` (panics if out of bounds; callers pass whole blocks).
#[inline(always)]
pub(crate) fn le_u16(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

/// IEEE half bits to `f32` (exact; NaNs come out quiet, as F16C makes them). The software
/// conversion: `half`'s `to_f32` checks for F16C on every call, ten times slower in a loop.
#[inline(always)]
pub(crate) fn f16_to_f32(bits: u16) -> f32 {
    half::f16::from_bits(bits).to_f32_const()
}

/// bfloat16 bits to `f32` (exact: the upper half of an `f32`).
#[inline(always)]
pub(crate) fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// Scale and minimum (6 bits each) of sub-block `j` (0..8) of a `Q4_K` block, from its 12 packed
/// bytes: sub-blocks 0..4 keep theirs in the low 6 bits of bytes `j` and `j + 4`; sub-blocks 4..8
/// have their low 4 bits in the nibbles of byte `j + 4` and their top 2 bits in the spare top bits
/// of bytes `j - 4` (scale) and `j` (min). Same packing as llama.cpp's `get_scale_min_k4`.
#[inline(always)]
pub(crate) fn q4k_scale_min(j: usize, s: &[u8]) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        ((s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let (got, want) = (f16_to_f32(bits), half::f16::from_bits(bits).to_f32());
            assert!(got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()), "{bits:#06x}");
            if !got.is_nan() {
                assert_eq!(f64::from(got), half::f16::from_bits(bits).to_f64(), "{bits:#06x}");
            }
        }
    }

    #[test]
    fn q4k_scale_min_unpacks_both_halves() {
        // Sub-block 5: scale low 4 bits in byte 9's low nibble, top 2 bits in byte 1's top bits;
        // min low 4 bits in byte 9's high nibble, top 2 bits in byte 5's top bits.
        let mut s = [0u8; 12];
        s[9] = 0xA7;
        s[1] = 0b10 << 6;
        s[5] = 0b01 << 6;
        assert_eq!(q4k_scale_min(5, &s), (0x27, 0x1A));
        s[2] = 45;
        s[6] = 0xC0 | 9;
        assert_eq!(q4k_scale_min(2, &s), (45, 9));
    }
}
