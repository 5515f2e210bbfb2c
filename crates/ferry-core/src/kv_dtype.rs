//! The element types a KV cache stores, and the one layout every backend, payload and transport
//! shares: a cache is made of *rows*, one per (token, KV head), of `head_dim` values.
//!
//! - `f32`, `f16`, `bf16`: the values, little-endian, `head_dim × size` bytes.
//! - `int8`: `head_dim` signed bytes, then the row's scale as a little-endian f32 (`head_dim + 4`
//!   bytes). Symmetric, one scale per token, KV head and K/V: `scale = max|x| / 127`,
//!   `q = round(x / scale)`, `x ≈ q · scale`. A row is written once, when its token is computed,
//!   and never again: a block that fills up keeps its earlier rows as they were (a per-block scale
//!   would have to re-quantize them whenever a larger value arrives), so exported, cached and
//!   shipped bytes of a token never change. The scale costs 4 bytes per 64-value row (6%).
//!
//! The functions here are the scalar definitions: the CPU backend's SIMD kernels and the CUDA
//! kernels are tested against them, and a receiver whose cache stores another type than the
//! payload converts rows with [`convert_rows`].

use half::{bf16, f16};
use std::fmt;
use std::str::FromStr;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    #[default]
    F32,
    F16,
    BF16,
    Int8,
}

/// Bytes of an int8 row's scale.
pub const INT8_SCALE_BYTES: usize = 4;

impl KvDtype {
    pub const ALL: [KvDtype; 4] = [KvDtype::F32, KvDtype::BF16, KvDtype::F16, KvDtype::Int8];

    /// Bytes of one stored row of `head_dim` values (the int8 scale included).
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            KvDtype::F32 => 4 * head_dim,
            KvDtype::F16 | KvDtype::BF16 => 2 * head_dim,
            KvDtype::Int8 => head_dim + INT8_SCALE_BYTES,
        }
    }

    /// The name the flags and the API use.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::BF16 => "bf16",
            KvDtype::Int8 => "int8",
        }
    }

    /// The code in a KV payload header.
    pub(crate) fn code(self) -> u32 {
        match self {
            KvDtype::F32 => 0,
            KvDtype::F16 => 1,
            KvDtype::BF16 => 2,
            KvDtype::Int8 => 3,
        }
    }

    pub(crate) fn from_code(c: u32) -> Option<Self> {
        Some(match c {
            0 => KvDtype::F32,
            1 => KvDtype::F16,
            2 => KvDtype::BF16,
            3 => KvDtype::Int8,
            _ => return None,
        })
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(KvDtype::F32),
            "f16" | "float16" | "fp16" => Ok(KvDtype::F16),
            "bf16" | "bfloat16" => Ok(KvDtype::BF16),
            "int8" | "i8" | "q8" => Ok(KvDtype::Int8),
            _ => Err(format!("unknown KV dtype {s:?}: expected f32, bf16, f16 or int8")),
        }
    }
}

/// Store `x` (one row) as `dtype` into `out` (`dtype.row_bytes(x.len())` bytes).
pub fn encode_row(dtype: KvDtype, x: &[f32], out: &mut [u8]) {
    let hd = x.len();
    assert_eq!(out.len(), dtype.row_bytes(hd), "encode_row: {} bytes for a {dtype} row of {hd}", out.len());
    match dtype {
        KvDtype::F32 => out.chunks_exact_mut(4).zip(x).for_each(|(o, v)| o.copy_from_slice(&v.to_le_bytes())),
        // Saturated: a value past f16's range is stored as its largest finite value, never inf.
        KvDtype::F16 => out.chunks_exact_mut(2).zip(x).for_each(|(o, v)| o.copy_from_slice(&f16::from_f32(v.clamp(-65504.0, 65504.0)).to_le_bytes())),
        KvDtype::BF16 => out.chunks_exact_mut(2).zip(x).for_each(|(o, v)| o.copy_from_slice(&bf16::from_f32(*v).to_le_bytes())),
        KvDtype::Int8 => {
            let (scale, inv) = int8_scale(x);
            for (o, v) in out[..hd].iter_mut().zip(x) {
                *o = (v * inv).round().clamp(-127.0, 127.0) as i8 as u8;
            }
            out[hd..].copy_from_slice(&scale.to_le_bytes());
        }
    }
}

/// The scale of an int8 row and its inverse (both 0 for a row of zeros).
pub fn int8_scale(x: &[f32]) -> (f32, f32) {
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if max > 0.0 && max.is_finite() { (max / 127.0, 127.0 / max) } else { (0.0, 0.0) }
}

/// Read one stored row of `out.len()` values.
pub fn decode_row(dtype: KvDtype, row: &[u8], out: &mut [f32]) {
    let hd = out.len();
    assert_eq!(row.len(), dtype.row_bytes(hd), "decode_row: {} bytes for a {dtype} row of {hd}", row.len());
    match dtype {
        KvDtype::F32 => out.iter_mut().zip(row.chunks_exact(4)).for_each(|(o, b)| *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        KvDtype::F16 => out.iter_mut().zip(row.chunks_exact(2)).for_each(|(o, b)| *o = f16::from_le_bytes([b[0], b[1]]).to_f32()),
        KvDtype::BF16 => out.iter_mut().zip(row.chunks_exact(2)).for_each(|(o, b)| *o = bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        KvDtype::Int8 => {
            let scale = int8_row_scale(row);
            out.iter_mut().zip(&row[..hd]).for_each(|(o, &q)| *o = q as i8 as f32 * scale);
        }
    }
}

/// The scale stored at the end of an int8 row.
#[inline]
pub fn int8_row_scale(row: &[u8]) -> f32 {
    let s = &row[row.len() - INT8_SCALE_BYTES..];
    f32::from_le_bytes([s[0], s[1], s[2], s[3]])
}

/// Re-encode rows of `head_dim` values stored as `from` into `to` (the receiver of a payload in
/// another type: one pass over the bytes, through f32). Errors when `src` is not whole rows.
pub fn convert_rows(from: KvDtype, to: KvDtype, head_dim: usize, src: &[u8]) -> Result<Vec<u8>, String> {
    let (rf, rt) = (from.row_bytes(head_dim), to.row_bytes(head_dim));
    if rf == 0 || !src.len().is_multiple_of(rf) {
        return Err(format!("{} bytes are not whole {from} rows of {head_dim} values ({rf} bytes each)", src.len()));
    }
    if from == to {
        return Ok(src.to_vec());
    }
    let rows = src.len() / rf;
    let mut out = vec![0u8; rows * rt];
    let mut tmp = vec![0f32; head_dim];
    for (s, d) in src.chunks_exact(rf).zip(out.chunks_exact_mut(rt)) {
        decode_row(from, s, &mut tmp);
        encode_row(to, &tmp, d);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(hd: usize, seed: u32) -> Vec<f32> {
        (0..hd).map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 2001) as f32 / 1000.0 - 1.0).collect()
    }

    #[test]
    fn names_round_trip_and_unknown_names_are_refused() {
        for d in KvDtype::ALL {
            assert_eq!(d.name().parse::<KvDtype>().unwrap(), d);
            assert_eq!(KvDtype::from_code(d.code()), Some(d));
        }
        let e = "fp8".parse::<KvDtype>().unwrap_err();
        assert!(e.contains("fp8") && e.contains("int8"), "{e}");
    }

    #[test]
    fn rows_round_trip_within_each_types_precision() {
        let x = row(64, 7);
        let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (d, bound) in [(KvDtype::F32, 0.0), (KvDtype::F16, 1e-3), (KvDtype::BF16, 8e-3), (KvDtype::Int8, max / 127.0 * 0.5 + 1e-6)] {
            let mut bytes = vec![0u8; d.row_bytes(64)];
            encode_row(d, &x, &mut bytes);
            let mut back = vec![0f32; 64];
            decode_row(d, &bytes, &mut back);
            let err = x.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err <= bound, "{d}: max error {err} > {bound}");
        }
    }

    #[test]
    fn f16_rows_saturate_instead_of_overflowing() {
        let mut bytes = vec![0u8; KvDtype::F16.row_bytes(2)];
        encode_row(KvDtype::F16, &[1e6, -1e6], &mut bytes);
        let mut back = [0f32; 2];
        decode_row(KvDtype::F16, &bytes, &mut back);
        assert_eq!(back, [65504.0, -65504.0]);
    }

    #[test]
    fn int8_rows_use_the_whole_range_and_zero_rows_stay_zero() {
        let x = row(64, 3);
        let mut bytes = vec![0u8; KvDtype::Int8.row_bytes(64)];
        encode_row(KvDtype::Int8, &x, &mut bytes);
        assert!(bytes[..64].iter().any(|&b| b as i8 == 127 || b as i8 == -127));
        encode_row(KvDtype::Int8, &[0.0; 64], &mut bytes);
        assert!(bytes.iter().all(|&b| b == 0));
    }

    #[test]
    fn conversion_goes_through_f32_and_refuses_partial_rows() {
        let x: Vec<f32> = (0..4).flat_map(|s| row(8, s)).collect();
        let mut f32_bytes = vec![0u8; 4 * KvDtype::F32.row_bytes(8)];
        for (r, o) in x.chunks(8).zip(f32_bytes.chunks_mut(32)) {
            encode_row(KvDtype::F32, r, o);
        }
        let i8_bytes = convert_rows(KvDtype::F32, KvDtype::Int8, 8, &f32_bytes).unwrap();
        assert_eq!(i8_bytes.len(), 4 * 12);
        let back = convert_rows(KvDtype::Int8, KvDtype::F32, 8, &i8_bytes).unwrap();
        let back: Vec<f32> = back.chunks(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        assert!(x.iter().zip(&back).all(|(a, b)| (a - b).abs() < 0.01));
        assert!(convert_rows(KvDtype::F32, KvDtype::BF16, 8, &f32_bytes[..31]).unwrap_err().contains("31 bytes"));
    }
}
