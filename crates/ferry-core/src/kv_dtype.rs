//! The element types a KV cache stores, and the one layout every backend, payload and transport
//! shares: a cache is made of *rows*, one per (token, KV head), of `head_dim` values.
//!
//! - `f32`, `f16`, `bf16`: the values, little-endian, `head_dim × size` bytes.
//! - `int8`: `head_dim` signed bytes, then the row's scale as a little-endian f32 (`head_dim + 4`
//!   bytes). The row is first turned by the normalized Walsh-Hadamard transform ([`hadamard`]:
//!   `y = H·x / √n`, over segments of [`hadamard_width`] values, the whole row for a power-of-two
//!   `head_dim`), then quantized symmetrically with one scale per token, KV head and K/V:
//!   `scale = max|y| / 127`, `q = round(y / scale)`, `x ≈ H·(q · scale) / √n` (the transform is
//!   its own inverse). The turn spreads a row's few large channels over all of them, so one
//!   scale per row spends its 8 bits on the row's typical values rather than on its outliers
//!   (QuaRot, arXiv:2404.00456, rotates KV for the same reason); it costs no bytes, and since
//!   the transform is orthogonal, attention runs in the turned basis: `q·k = (Hq)·(Hk)`, and a
//!   sum of turned values is the turned sum. Measured on SmolLM2 (docs/benchmarks.md), greedy
//!   continuations identical to f32's went from 33% to 53% of 60 prompts. A row is written
//!   once, when its token is computed, and never again: a block that fills up keeps its earlier
//!   rows as they were (a per-block scale would have to re-quantize them whenever a larger value
//!   arrives), so exported, cached and shipped bytes of a token never change. The scale costs 4
//!   bytes per 64-value row (6%).
//!
//! The functions here are the scalar definitions: the CPU backend's SIMD kernels and the CUDA
//! kernels are tested against them, and a receiver whose cache stores another type than the
//! payload converts rows with [`convert_rows`]. [`decode_row`] gives a row's values;
//! [`stored_values`] the values as the row holds them (an int8 row's turned values), which is
//! what attention's kernels read, against a query turned the same way ([`KvDtype::turned`]).

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

    /// Whether a row holds its values turned by [`hadamard`] (int8): attention over such rows
    /// turns the query the same way and its output back.
    pub fn turned(self) -> bool {
        self == KvDtype::Int8
    }

    /// The name of what a stored row's bytes mean, for content addresses: it changes whenever
    /// the bytes of a type change meaning, so blocks cached (or written to disk) by an earlier
    /// layout are never read as this one's.
    pub fn layout_name(self) -> &'static str {
        match self {
            KvDtype::Int8 => "int8-hadamard",
            d => d.name(),
        }
    }

    /// The dtype whose [`KvDtype::layout_name`] is `name` (what workers register), or why not:
    /// `int8` names the layout of workers from before int8 rows were turned, whose KV this
    /// version cannot read, so such a worker is refused rather than paired.
    pub fn from_layout_name(name: &str) -> Result<KvDtype, String> {
        if name == "int8" {
            return Err("\"int8\" is int8 KV without the Hadamard turn (a worker from before 2026-12-07), which this version cannot read: upgrade the worker".into());
        }
        KvDtype::ALL.into_iter().find(|d| d.layout_name() == name).ok_or_else(|| format!("unknown KV layout {name:?}: expected f32, bf16, f16 or int8-hadamard"))
    }

    /// The code in a KV payload header. 3 was int8 without the Hadamard turn (before
    /// 2026-12-07): a payload with it is refused as an unknown dtype, never misread.
    pub(crate) fn code(self) -> u32 {
        match self {
            KvDtype::F32 => 0,
            KvDtype::F16 => 1,
            KvDtype::BF16 => 2,
            KvDtype::Int8 => 4,
        }
    }

    pub(crate) fn from_code(c: u32) -> Option<Self> {
        Some(match c {
            0 => KvDtype::F32,
            1 => KvDtype::F16,
            2 => KvDtype::BF16,
            4 => KvDtype::Int8,
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
            let (mut stack, mut heap) = ([0f32; 256], Vec::new());
            let y: &mut [f32] = if hd <= stack.len() {
                &mut stack[..hd]
            } else {
                heap.resize(hd, 0.0);
                &mut heap
            };
            y.copy_from_slice(x);
            hadamard(y);
            let (scale, inv) = int8_scale(y);
            for (o, v) in out[..hd].iter_mut().zip(y.iter()) {
                *o = (v * inv).round().clamp(-127.0, 127.0) as i8 as u8;
            }
            out[hd..].copy_from_slice(&scale.to_le_bytes());
        }
    }
}

/// The length of the segments [`hadamard`] turns in a row of `len` values: the largest power of
/// two dividing `len` (the whole row when `len` is a power of two: 64 for SmolLM2, 128 for
/// Llama 3). 1 (no turn) for an odd length.
pub fn hadamard_width(len: usize) -> usize {
    len & len.wrapping_neg()
}

/// Turn `x` by the normalized Walsh-Hadamard transform, `H·x / √n`, in place, over each segment
/// of `n = hadamard_width(x.len())` values: log2(n) butterfly stages, stride 1 first, each
/// `(a, b) → (a + b, a − b)`, then one product by `1/√n`. Orthogonal and symmetric, so it is its
/// own inverse (to f32 rounding); the CUDA kernels do the same operations in the same order.
pub fn hadamard(x: &mut [f32]) {
    let n = hadamard_width(x.len());
    if n < 2 {
        return;
    }
    let norm = 1.0 / (n as f32).sqrt();
    for seg in x.chunks_exact_mut(n) {
        let mut h = 1;
        while h < n {
            for pair in seg.chunks_exact_mut(2 * h) {
                let (a, b) = pair.split_at_mut(h);
                for (a, b) in a.iter_mut().zip(b) {
                    (*a, *b) = (*a + *b, *a - *b);
                }
            }
            h *= 2;
        }
        seg.iter_mut().for_each(|v| *v *= norm);
    }
}

/// The scale of an int8 row and its inverse (both 0 for a row of zeros).
pub fn int8_scale(x: &[f32]) -> (f32, f32) {
    let max = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    if max > 0.0 && max.is_finite() { (max / 127.0, 127.0 / max) } else { (0.0, 0.0) }
}

/// Read one stored row of `out.len()` values (an int8 row turned back).
pub fn decode_row(dtype: KvDtype, row: &[u8], out: &mut [f32]) {
    stored_values(dtype, row, out);
    if dtype.turned() {
        hadamard(out);
    }
}

/// The values one stored row of `out.len()` holds, as it holds them: an int8 row's turned values
/// (`q · scale`), the others' values. Attention reads rows this way (see [`KvDtype::turned`]).
pub fn stored_values(dtype: KvDtype, row: &[u8], out: &mut [f32]) {
    let hd = out.len();
    assert_eq!(row.len(), dtype.row_bytes(hd), "stored_values: {} bytes for a {dtype} row of {hd}", row.len());
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
        for (d, bound) in [(KvDtype::F32, 0.0), (KvDtype::F16, 1e-3), (KvDtype::BF16, 8e-3)] {
            let mut bytes = vec![0u8; d.row_bytes(64)];
            encode_row(d, &x, &mut bytes);
            let mut back = vec![0f32; 64];
            decode_row(d, &bytes, &mut back);
            let err = x.iter().zip(&back).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err <= bound, "{d}: max error {err} > {bound}");
        }
        // int8: each turned value is within half a step (scale / 2) of the stored one, and the
        // turn is orthogonal, so the row's error has at most the norm of those half steps.
        let mut bytes = vec![0u8; KvDtype::Int8.row_bytes(64)];
        encode_row(KvDtype::Int8, &x, &mut bytes);
        let mut back = vec![0f32; 64];
        decode_row(KvDtype::Int8, &bytes, &mut back);
        let err = norm(&x.iter().zip(&back).map(|(a, b)| a - b).collect::<Vec<_>>());
        let bound = int8_row_scale(&bytes) * 0.5 * 8.0 + 1e-5;
        assert!(err <= bound, "int8: error norm {err} > {bound}");
    }

    fn norm(x: &[f32]) -> f32 {
        x.iter().map(|v| v * v).sum::<f32>().sqrt()
    }

    /// The Hadamard matrix by its definition (Sylvester's): `H[i][j] = (-1)^popcount(i & j)`.
    fn sylvester(x: &[f32]) -> Vec<f32> {
        let n = x.len();
        (0..n).map(|i| (0..n).map(|j| if (i & j).count_ones() % 2 == 0 { x[j] } else { -x[j] }).sum::<f32>() / (n as f32).sqrt()).collect()
    }

    #[test]
    fn the_turn_is_the_normalized_hadamard_transform_and_its_own_inverse() {
        assert_eq!([64, 128, 96, 6, 7, 1, 0].map(hadamard_width), [64, 128, 32, 2, 1, 1, 0]);
        for n in [2, 8, 64, 128] {
            let x = row(n, 11);
            let mut y = x.clone();
            hadamard(&mut y);
            let want = sylvester(&x);
            assert!(y.iter().zip(&want).all(|(a, b)| (a - b).abs() < 1e-5), "n = {n}: {y:?} vs {want:?}");
            assert!((norm(&y) - norm(&x)).abs() < 1e-5 * norm(&x), "n = {n}: the norm is kept");
            hadamard(&mut y);
            assert!(y.iter().zip(&x).all(|(a, b)| (a - b).abs() < 1e-6), "n = {n}: turned twice is the row");
        }
        // 96 values: three segments of 32, each turned alone.
        let x = row(96, 5);
        let mut y = x.clone();
        hadamard(&mut y);
        for (seg, got) in x.chunks(32).zip(y.chunks(32)) {
            assert!(sylvester(seg).iter().zip(got).all(|(a, b)| (a - b).abs() < 1e-5));
        }
        // An odd row is left as it is.
        let mut odd = [1.0, 2.0, 3.0];
        hadamard(&mut odd);
        assert_eq!(odd, [1.0, 2.0, 3.0]);
    }

    #[test]
    fn the_turn_spends_int8s_steps_on_a_rows_typical_values_not_its_outlier() {
        // A row of small values with one channel 40x larger (K's outlier channels): one scale
        // per row without the turn rounds the small values to a step of 40/127 (most to 0).
        let mut x = row(64, 9).iter().map(|v| v * 0.5).collect::<Vec<_>>();
        x[5] = 20.0;
        let mut bytes = vec![0u8; KvDtype::Int8.row_bytes(64)];
        encode_row(KvDtype::Int8, &x, &mut bytes);
        let mut back = vec![0f32; 64];
        decode_row(KvDtype::Int8, &bytes, &mut back);
        let turned = norm(&x.iter().zip(&back).map(|(a, b)| a - b).collect::<Vec<_>>());
        let (scale, inv) = int8_scale(&x);
        let plain = norm(&x.iter().map(|v| v - (v * inv).round() * scale).collect::<Vec<_>>());
        assert!(turned < plain / 3.0, "error norm with the turn {turned}, without {plain}");
        // Stored as turned: stored_values is the transform of the row, within the rounding.
        let mut stored = vec![0f32; 64];
        stored_values(KvDtype::Int8, &bytes, &mut stored);
        let mut y = x.clone();
        hadamard(&mut y);
        assert!(stored.iter().zip(&y).all(|(a, b)| (a - b).abs() <= int8_row_scale(&bytes) * 0.5 + 1e-6));
    }

    #[test]
    fn int8s_address_and_payload_code_name_the_turned_layout() {
        assert_eq!(KvDtype::Int8.layout_name(), "int8-hadamard");
        assert_eq!(KvDtype::BF16.layout_name(), "bf16");
        // Code 3 was the layout without the turn: refused, never read as this one.
        assert_eq!(KvDtype::from_code(3), None);
        for d in KvDtype::ALL {
            assert_eq!(KvDtype::from_layout_name(d.layout_name()), Ok(d));
        }
        let e = KvDtype::from_layout_name("int8").unwrap_err();
        assert!(e.contains("Hadamard") && e.contains("upgrade"), "{e}");
        assert!(KvDtype::from_layout_name("fp4").unwrap_err().contains("fp4"));
        assert!(KvDtype::ALL.iter().all(|d| d.turned() == (*d == KvDtype::Int8)));
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
