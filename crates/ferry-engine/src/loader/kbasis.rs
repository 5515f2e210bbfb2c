//! The K basis: an exact per-channel equalization of K, folded into the weights at load time so an
//! int8 KV cache (one scale per token and head) does not spend its 8 bits on K's outlier channels.
//!
//! Llama-family K has a few large channels (the low-frequency RoPE dimensions). KIVI
//! (arXiv:2402.02750, §3) quantizes K per channel for this reason, which needs per-channel scales
//! in the block format. Here instead, as SmoothQuant (arXiv:2211.10438, §4) moves a per-channel
//! scale between two factors of one product, each KV head gets a scale vector `s` (one power of
//! two ≥ 1 per channel, equal on both channels of a RoPE pair `(c, c + head_dim/2)`, Ferry's
//! rotate-half layout): the K projection's rows (and bias) are divided by `s` and the Q projection's
//! rows of every query head of the group multiplied by it. Powers of two scale floats exactly and
//! RoPE rotates a pair by one angle, so `q·k` is bit-for-bit unchanged; only the stored K has its
//! outlier channels shrunk. With QK-norm (Qwen3) the norm would undo a projection scale, so `s`
//! (one per layer there, as the gains are shared by all heads) goes into the q/k norm gains.
//!
//! `s` comes from the weights alone, in scalar Rust with a fixed order of operations, so every
//! worker and backend folds the same basis bit for bit; a hash of it (with [`BASIS_VERSION`]) goes
//! into the model fingerprint, so KV of another basis is never paired, cached or read from disk.
//! A scale that would not be exact on some stored value (an f16 block scale leaving the normal
//! range) is lowered until it is.

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::weights::{HostWeight, Storage, WeightKey, WeightSet};
use ferry_quant::WeightType;
use sha2::{Digest, Sha256};
use std::sync::Arc;

/// Bumped whenever the way `s` is chosen or applied changes: KV of one version is not another's.
pub const BASIS_VERSION: u32 = 1;

/// Largest exponent of a channel scale: `s ≤ 2^MAX_EXP`.
pub const MAX_EXP: u8 = 4;

/// The exponents of `s`, per layer: `n_kv_heads · head_dim` entries (one per K channel), or
/// `head_dim` entries for a QK-norm model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KBasis {
    pub exps: Vec<Vec<u8>>,
}

impl KBasis {
    /// What the fingerprint hashes: the version and every exponent.
    pub fn tag(&self) -> String {
        let mut h = Sha256::new();
        for e in &self.exps {
            h.update(e);
        }
        let d = h.finalize();
        let hex: String = d.iter().take(8).map(|b| format!("{b:02x}")).collect();
        format!("kbasis-v{BASIS_VERSION}:{hex}")
    }
}

/// Choose `s` for every layer from the weights and fold it in. Weights a fold cannot scale
/// (synthetic random tensors) are left alone with `s = 1`.
pub fn fold(c: &ModelConfig, w: &mut WeightSet) -> Result<KBasis> {
    let mut exps = Vec::with_capacity(c.n_layers);
    for l in 0..c.n_layers {
        let mut e = choose(c, w, l)?;
        if let Some(f) = std::env::var_os("FERRY_KBASIS_FILE") {
            // TMP: exponents from a calibration file, lines "layer head pair exp".
            let text = std::fs::read_to_string(&f).map_err(|e| EngineError::io(std::path::PathBuf::from(&f), e))?;
            e.iter_mut().for_each(|x| *x = 0);
            for line in text.lines() {
                let v: Vec<usize> = line.split_whitespace().filter_map(|x| x.parse().ok()).collect();
                if v.len() == 4 && v[0] == l {
                    e[v[1] * c.head_dim + v[2]] = v[3] as u8;
                    e[v[1] * c.head_dim + v[2] + c.head_dim / 2] = v[3] as u8;
                }
            }
        }
        if c.qk_norm {
            fold_norms(c, w, l, &mut e)?;
        } else {
            fold_projections(c, w, l, &mut e)?;
        }
        exps.push(e);
    }
    Ok(KBasis { exps })
}

fn get<'a>(w: &'a WeightSet, key: WeightKey) -> Result<&'a HostWeight> {
    w.get(key).ok_or_else(|| EngineError::MissingTensor { name: format!("{key:?}") })
}

/// Exponent per channel: the channel's size estimate, pair-maxed, over the median pair of its head,
/// rounded down to a power of two and clamped to `[0, MAX_EXP]`.
fn choose(c: &ModelConfig, w: &WeightSet, l: usize) -> Result<Vec<u8>> {
    let (hd, half) = (c.head_dim, c.head_dim / 2);
    let est: Vec<f32> = if c.qk_norm {
        get(w, WeightKey::KNorm(l))?.to_f32().iter().map(|g| g.abs()).collect()
    } else {
        let k = get(w, WeightKey::K(l))?;
        if matches!(k.storage, Storage::Random(_)) {
            return Ok(vec![0; c.kv_dim()]);
        }
        let gain = get(w, WeightKey::AttnNorm(l))?.to_f32();
        let (rows, cols) = (k.rows(), k.cols());
        let kf = k.to_f32();
        (0..rows)
            .map(|r| kf[r * cols..(r + 1) * cols].iter().zip(&gain).map(|(a, g)| (a * g) * (a * g)).sum::<f32>().sqrt())
            .collect()
    };
    if est.len() % hd != 0 {
        return Err(EngineError::TensorShape { name: format!("K estimate of layer {l}"), expected: vec![hd], found: vec![est.len()] });
    }
    let mut exps = vec![0u8; est.len()];
    for (g, (head, e)) in est.chunks(hd).zip(exps.chunks_mut(hd)).enumerate() {
        let pairs: Vec<f32> = (0..half).map(|p| head[p].max(head[p + half])).collect();
        if std::env::var_os("FERRY_KSTATS").is_some() {
            for (p, v) in pairs.iter().enumerate() {
                eprintln!("KEST {l} {g} {p} {v}"); // TMP
            }
        }
        let mut sorted = pairs.clone();
        sorted.sort_by(f32::total_cmp);
        let median = sorted[half / 2];
        if !(median > 0.0 && median.is_finite()) {
            continue;
        }
        for (p, &v) in pairs.iter().enumerate() {
            let mut x = 0u8;
            while x < MAX_EXP && v >= median * (2u32 << x) as f32 {
                x += 1;
            }
            e[p] = x;
            e[p + half] = x;
        }
    }
    Ok(exps)
}

/// Divide K's rows (and bias) by `s`, multiply every grouped query head's Q rows (and bias) by it.
fn fold_projections(c: &ModelConfig, w: &mut WeightSet, l: usize, exps: &mut [u8]) -> Result<()> {
    let (hd, group) = (c.head_dim, c.n_heads / c.n_kv_heads.max(1));
    let keys = [(WeightKey::Q(l), 1i32, group), (WeightKey::QBias(l), 1, group), (WeightKey::K(l), -1, 1), (WeightKey::KBias(l), -1, 1)];
    // Rows of `key` carrying K channel `ch` (of KV head `ch / hd`).
    let rows = |ch: usize, n: usize| (0..n).map(move |j| ((ch / hd) * n + j) * hd + ch % hd);
    let mut tensors: Vec<(WeightKey, i32, usize, HostWeight, Vec<u8>)> = Vec::new();
    for (key, sign, n) in keys {
        if let Some(t) = w.get(key) {
            let bytes = t.bytes().to_vec();
            tensors.push((key, sign, n, t.clone(), bytes));
        }
    }
    for ch in 0..exps.len() {
        // Lower the exponent until every row of this channel scales exactly (both pair halves
        // carry the same exponent, and the pair partner lowers it too when it is visited).
        while exps[ch] > 0 {
            let e = exps[ch] as i32;
            let ok = tensors.iter().all(|(_, sign, n, t, b)| rows(ch, *n).all(|r| scaled_row(t, b, r, sign * e).is_some()));
            if ok {
                break;
            }
            let partner = ch % hd;
            let pair = if partner < hd / 2 { ch + hd / 2 } else { ch - hd / 2 };
            exps[ch] -= 1;
            exps[pair] = exps[ch];
        }
    }
    // Pairs agree after the loop (a later channel may have lowered an earlier partner: redo those).
    for ch in 0..exps.len() {
        let pair = if ch % hd < hd / 2 { ch + hd / 2 } else { ch - hd / 2 };
        let m = exps[ch].min(exps[pair]);
        exps[ch] = m;
        exps[pair] = m;
    }
    for (key, sign, n, t, b) in &mut tensors {
        for (ch, &e) in exps.iter().enumerate() {
            if e == 0 {
                continue;
            }
            for r in rows(ch, *n) {
                let new = scaled_row(t, b, r, *sign * e as i32).ok_or_else(|| inexact(t))?;
                let rb = row_len(t);
                b[r * rb..(r + 1) * rb].copy_from_slice(&new);
            }
        }
        let bytes = std::mem::take(b);
        w.tensors.insert(*key, HostWeight { storage: Storage::Owned(Arc::new(bytes)), x8: None, ..t.clone() });
    }
    Ok(())
}

/// QK-norm: the gains are per channel of every head, so `s` is one vector per layer.
fn fold_norms(c: &ModelConfig, w: &mut WeightSet, l: usize, exps: &mut Vec<u8>) -> Result<()> {
    let hd = c.head_dim;
    exps.truncate(hd);
    let (q, k) = (get(w, WeightKey::QNorm(l))?.clone(), get(w, WeightKey::KNorm(l))?.clone());
    let (mut qb, mut kb) = (q.bytes().to_vec(), k.bytes().to_vec());
    for ch in 0..hd {
        let pair = if ch < hd / 2 { ch + hd / 2 } else { ch - hd / 2 };
        let mut e = exps[ch].min(exps[pair]) as i32;
        while e > 0 && (scaled_row(&q, &qb, ch, e).is_none() || scaled_row(&k, &kb, ch, -e).is_none()) {
            e -= 1;
        }
        exps[ch] = e as u8;
    }
    for ch in 0..hd {
        let pair = if ch < hd / 2 { ch + hd / 2 } else { ch - hd / 2 };
        let e = exps[ch].min(exps[pair]) as i32;
        exps[ch] = e as u8;
        for (t, b, sign) in [(&q, &mut qb, 1), (&k, &mut kb, -1)] {
            let new = scaled_row(t, b, ch, sign * e).ok_or_else(|| inexact(t))?;
            let rb = row_len(t);
            b[ch * rb..(ch + 1) * rb].copy_from_slice(&new);
        }
    }
    w.tensors.insert(WeightKey::QNorm(l), HostWeight { storage: Storage::Owned(Arc::new(qb)), x8: None, ..q });
    w.tensors.insert(WeightKey::KNorm(l), HostWeight { storage: Storage::Owned(Arc::new(kb)), x8: None, ..k });
    Ok(())
}

fn inexact(t: &HostWeight) -> EngineError {
    EngineError::TensorShape { name: format!("{} (K basis fold not exact)", t.name), expected: t.shape.clone(), found: t.shape.clone() }
}

/// Bytes of one "row" of `t` for the fold: a matrix row, or one element of a vector.
fn row_len(t: &HostWeight) -> usize {
    if t.shape.len() == 1 { t.ty.block_bytes() } else { t.row_bytes() }
}

/// Row `r` of `t` (bytes `b`) times `2^e`, or `None` if some value would not scale exactly.
fn scaled_row(t: &HostWeight, b: &[u8], r: usize, e: i32) -> Option<Vec<u8>> {
    let rb = row_len(t);
    let mut row = b.get(r * rb..(r + 1) * rb)?.to_vec();
    let f = 2f32.powi(e);
    let ok = |v: f32, s: f32| s.is_finite() && s * (1.0 / f) == v && (v == 0.0 || s.is_normal());
    let scale16 = |bytes: &mut [u8], at: usize| -> Option<()> {
        let v = half::f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32();
        let s = half::f16::from_f32(v * f);
        (ok(v, s.to_f32()) && (v == 0.0 || s.is_normal())).then(|| bytes[at..at + 2].copy_from_slice(&s.to_le_bytes()))
    };
    let offsets: &[usize] = match t.ty {
        WeightType::F32 => {
            for x in row.chunks_exact_mut(4) {
                let v = f32::from_le_bytes([x[0], x[1], x[2], x[3]]);
                let s = v * f;
                ok(v, s).then(|| x.copy_from_slice(&s.to_le_bytes()))?;
            }
            return Some(row);
        }
        WeightType::BF16 => {
            for x in row.chunks_exact_mut(2) {
                let v = half::bf16::from_le_bytes([x[0], x[1]]).to_f32();
                let s = half::bf16::from_f32(v * f);
                (ok(v, s.to_f32()) && (v == 0.0 || s.is_normal())).then(|| x.copy_from_slice(&s.to_le_bytes()))?;
            }
            return Some(row);
        }
        WeightType::F16 => &[0],
        WeightType::Q8_0 | WeightType::Q4_0 => &[0],
        WeightType::Q4_1 | WeightType::Q4_K => &[0, 2],
        WeightType::Q6_K => &[208],
    };
    let bb = t.ty.block_bytes();
    for block in 0..rb / bb {
        for &o in offsets {
            scale16(&mut row, block * bb + o)?;
        }
    }
    Some(row)
}

#[cfg(test)]
mod tests;
