//! Portable reference code: exact dequantization of every type, and the scalar `dot_rows`.
//!
//! The dequantizers are the oracle the SIMD kernels are tested against. They follow llama.cpp's
//! `dequantize_row_*` (ggml-quants.c) operation by operation, so every element is the same `f32`:
//! each `*`, `+`, `-` is one IEEE operation in source order and nothing is fused (Rust never
//! contracts `a * b + c` into an FMA). K-quant formulas, per 256-element super-block:
//!
//! - `Q4_K`: for group `g` in 0..4 (64 elements), sub-blocks `2g` and `2g + 1` with 6-bit
//!   `(sc, mn)` from [`q4k_scale_min`]; `d1 = d * sc`, `m1 = dmin * mn`; element `64g + l` is
//!   `d1 * lo(qs[32g + l]) - m1` and element `64g + 32 + l` uses the high nibble and sub-block `2g + 1`.
//! - `Q6_K`: for half `h` in 0..2 (128 elements) and `l` in 0..32, four 6-bit quants built from
//!   `ql[64h + l]`, `ql[64h + 32 + l]` (low nibbles, then high nibbles) and 2-bit fields of
//!   `qh[32h + l]`, each minus 32; element `128h + 32t + l` is `(d * scales[8h + l/16 + 2t]) * q_t`.

use crate::types::{QK, QK_K, WeightType, bf16_to_f32, f16_to_f32, le_u16, q4k_scale_min};

/// Exact dequantization. Precondition (checked by the public wrapper):
/// `src.len() == ty.row_bytes(dst.len())`.
pub(crate) fn dequantize(ty: WeightType, src: &[u8], dst: &mut [f32]) {
    match ty {
        WeightType::F32 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        WeightType::F16 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        WeightType::BF16 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        WeightType::Q8_0 => blocks(src, dst, 34, QK, deq_q8_0),
        WeightType::Q4_0 => blocks(src, dst, 18, QK, deq_q4_0),
        WeightType::Q4_1 => blocks(src, dst, 20, QK, deq_q4_1),
        WeightType::Q4_K => blocks(src, dst, 144, QK_K, deq_q4_k),
        WeightType::Q6_K => blocks(src, dst, 210, QK_K, deq_q6_k),
    }
}

#[inline(always)]
fn blocks(src: &[u8], dst: &mut [f32], bb: usize, be: usize, f: fn(&[u8], &mut [f32])) {
    for (b, y) in src.chunks_exact(bb).zip(dst.chunks_exact_mut(be)) {
        f(b, y);
    }
}

fn deq_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_to_f32(le_u16(b, 0));
    for (y, &q) in y[..QK].iter_mut().zip(&b[2..2 + QK]) {
        *y = d * f32::from(q as i8);
    }
}

fn deq_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_to_f32(le_u16(b, 0));
    let (lo, hi) = y[..QK].split_at_mut(QK / 2);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..2 + QK / 2]) {
        *l = d * f32::from(i16::from(q & 0x0F) - 8);
        *h = d * f32::from(i16::from(q >> 4) - 8);
    }
}

fn deq_q4_1(b: &[u8], y: &mut [f32]) {
    let d = f16_to_f32(le_u16(b, 0));
    let m = f16_to_f32(le_u16(b, 2));
    let (lo, hi) = y[..QK].split_at_mut(QK / 2);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[4..4 + QK / 2]) {
        *l = d * f32::from(q & 0x0F) + m;
        *h = d * f32::from(q >> 4) + m;
    }
}

fn deq_q4_k(b: &[u8], y: &mut [f32]) {
    let d = f16_to_f32(le_u16(b, 0));
    let dmin = f16_to_f32(le_u16(b, 2));
    let scales = &b[4..16];
    for g in 0..4 {
        let (sc1, mn1) = q4k_scale_min(2 * g, scales);
        let (sc2, mn2) = q4k_scale_min(2 * g + 1, scales);
        let (d1, m1) = (d * f32::from(sc1), dmin * f32::from(mn1));
        let (d2, m2) = (d * f32::from(sc2), dmin * f32::from(mn2));
        let qs = &b[16 + 32 * g..16 + 32 * g + 32];
        let (lo, hi) = y[64 * g..64 * g + 64].split_at_mut(32);
        for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(qs) {
            *l = d1 * f32::from(q & 0x0F) - m1;
            *h = d2 * f32::from(q >> 4) - m2;
        }
    }
}

fn deq_q6_k(b: &[u8], y: &mut [f32]) {
    let d = f16_to_f32(le_u16(b, 208));
    for h in 0..2 {
        let ql = &b[64 * h..64 * h + 64];
        let qh = &b[128 + 32 * h..128 + 32 * h + 32];
        let sc = &b[192 + 8 * h..192 + 8 * h + 8];
        let y = &mut y[128 * h..128 * h + 128];
        for l in 0..32 {
            let is = l / 16;
            let q = [
                (ql[l] & 0x0F) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (t, &q) in q.iter().enumerate() {
                let s = f32::from(sc[is + 2 * t] as i8);
                y[32 * t + l] = d * s * f32::from(i16::from(q) - 32);
            }
        }
    }
}

/// Elements dequantized at a time by the scalar `dot_rows` (a multiple of every block size).
const CHUNK: usize = 256;
/// Activation rows sharing one dequantized chunk.
const GROUP: usize = 16;

/// Scalar `dot_rows`: dequantizes `CHUNK` weights at a time (exactly) into a stack buffer and
/// dots it with up to `GROUP` activation rows, eight partial sums per row.
/// Preconditions (checked by the public wrapper): `out.len() > 0`, `x.len() == out.len() * k`,
/// `w.len() == ty.row_bytes(k)`.
pub(crate) fn dot_rows(ty: WeightType, w: &[u8], x: &[f32], out: &mut [f32]) {
    let k = x.len() / out.len();
    let (be, bb) = (ty.block_elems(), ty.block_bytes());
    let mut buf = [0f32; CHUNK];
    for (g, outs) in out.chunks_mut(GROUP).enumerate() {
        let mut acc = [[0f32; 8]; GROUP];
        let mut start = 0;
        while start < k {
            let len = CHUNK.min(k - start);
            let src = &w[start / be * bb..(start + len) / be * bb];
            let buf = &mut buf[..len];
            dequantize(ty, src, buf);
            for (r, acc) in acc.iter_mut().enumerate().take(outs.len()) {
                let row = g * GROUP + r;
                let xs = &x[row * k + start..row * k + start + len];
                dot_acc(buf, xs, acc);
            }
            start += len;
        }
        for (o, acc) in outs.iter_mut().zip(&acc) {
            *o = sum8(acc);
        }
    }
}

/// `acc[i % 8] += w[i] * x[i]`.
#[inline(always)]
fn dot_acc(w: &[f32], x: &[f32], acc: &mut [f32; 8]) {
    let (wc, wt) = w.as_chunks::<8>();
    let (xc, xt) = x.as_chunks::<8>();
    for (wv, xv) in wc.iter().zip(xc) {
        for i in 0..8 {
            acc[i] += wv[i] * xv[i];
        }
    }
    for (i, (a, b)) in wt.iter().zip(xt).enumerate() {
        acc[i] += a * b;
    }
}

/// Pairwise sum of eight lanes.
#[inline(always)]
pub(crate) fn sum8(a: &[f32; 8]) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}
