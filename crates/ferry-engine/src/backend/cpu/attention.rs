//! Causal attention over the paged KV cache for a mixed batch (prefill chunks and decode tokens),
//! with grouped-query heads (GQA/MQA). Exact softmax in f32; keys and values are read in the
//! cache's stored type and widened in registers (`kv_rows`). An int8 cache stores its rows turned
//! by the Hadamard transform (`ferry_core::kv_dtype`): the query is turned the same way and the
//! output turned back, around the same kernels.
//!
//! Decode rows (few per sequence) take a direct path: dot each cached key, softmax, accumulate
//! values, with each KV block read and widened to f32 once for all of a sequence's rows and its
//! KV head's query group (grouped-query heads share it; speculative verification brings several
//! rows), the next block fetched meanwhile. Prefill
//! chunks gather a tile's keys and values from their pages into contiguous f32 scratch (widened
//! as they are copied) and use two f32 GEMMs per head (S = Q·Kᵀ, O = P·V), the causal mask
//! applied between.

use super::kv_rows::{KEYS, accumulate, dots, widen};
use super::simd::{hadamard_rows, softmax_scaled};
use super::{CpuBackend, CpuKv, CpuTensor, SyncPtr};
use crate::backend::BatchPlan;
use rayon::prelude::*;

/// Sequences with more query rows than this use the GEMM path.
const GEMM_MIN_ROWS: usize = 8;
/// Query rows per GEMM tile (keys needed grow with the tile's last row, so tiles cut causal waste).
const GEMM_TILE_ROWS: usize = 64;

/// out (row stride `dst_rs`) = a (m×k, row stride `a_rs`) · b, where b's element (kk, j) is at
/// `b[kk*b_rs + j*b_cs]`.
///
/// # Safety
/// All pointers must cover the strided extents implied by m, n, k and the strides.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_f32(m: usize, n: usize, k: usize, dst: *mut f32, dst_rs: usize, a: *const f32, a_rs: usize, b: *const f32, b_rs: usize, b_cs: usize) {
    // SAFETY: forwarded from the caller's contract.
    unsafe {
        gemm::gemm(m, n, k, dst, 1, dst_rs as isize, false, a, 1, a_rs as isize, b, b_cs as isize, b_rs as isize, 0.0, 1.0, false, false, false, gemm::Parallelism::None);
    }
}

struct Tile {
    seq: usize,
    kv_head: usize,
    r0: usize,
    r1: usize,
}

/// GEMM-path attention for one (sequence, KV head, row tile): all query heads of the group.
fn attention_tile(q: &CpuTensor, kv: &CpuKv, layer: usize, plan: &BatchPlan, t: &Tile, out: SyncPtr, out_cols: usize, group: usize, scr: &mut Scratch) {
    let l = kv.layout;
    let (hd, bs) = (l.head_dim, l.block_size);
    let sp = &plan.seqs[t.seq];
    let first_pos = sp.ctx_len - sp.q_len;
    let n_ctx = first_pos + t.r1; // keys visible to the tile's last row
    let m = t.r1 - t.r0;
    scr.k.resize(n_ctx * hd, 0.0);
    scr.v.resize(n_ctx * hd, 0.0);
    let (dt, rb) = (l.dtype, l.row_bytes());
    for (b, &block) in sp.blocks.iter().enumerate().take(n_ctx.div_ceil(bs)) {
        let n = bs.min(n_ctx - b * bs);
        let o = kv.offset(block, t.kv_head, 0);
        widen(dt, hd, &kv.k(layer)[o..o + n * rb], &mut scr.k[b * bs * hd..(b * bs + n) * hd]);
        widen(dt, hd, &kv.v(layer)[o..o + n * rb], &mut scr.v[b * bs * hd..(b * bs + n) * hd]);
    }
    // All query heads of the group as one matrix: rows (head, row) of head_dim, so each tile
    // costs two GEMMs of group·m rows instead of 2·group small ones.
    let heads = t.kv_head * group..(t.kv_head + 1) * group;
    let gm = group * m;
    scr.q.resize(gm * hd, 0.0);
    for (gi, h) in heads.clone().enumerate() {
        for i in 0..m {
            let src = (sp.q_start + t.r0 + i) * q.cols + h * hd;
            scr.q[(gi * m + i) * hd..(gi * m + i + 1) * hd].copy_from_slice(&q.data[src..src + hd]);
        }
    }
    scr.s.resize(gm * n_ctx, 0.0);
    // SAFETY: scr.q holds gm rows of hd; scr.k holds n_ctx rows of hd; scr.s holds gm×n_ctx.
    unsafe { gemm_f32(gm, n_ctx, hd, scr.s.as_mut_ptr(), n_ctx, scr.q.as_ptr(), hd, scr.k.as_ptr(), 1, hd) };
    let scale = 1.0 / (hd as f32).sqrt();
    for (r, row) in scr.s.chunks_mut(n_ctx).enumerate() {
        let visible = first_pos + t.r0 + r % m + 1;
        softmax_scaled(&mut row[..visible], scale);
        row[visible..].fill(0.0);
    }
    scr.o.resize(gm * hd, 0.0);
    // SAFETY: P is gm×n_ctx, V is n_ctx×hd, scr.o holds gm×hd.
    unsafe { gemm_f32(gm, hd, n_ctx, scr.o.as_mut_ptr(), hd, scr.s.as_ptr(), n_ctx, scr.v.as_ptr(), hd, 1) };
    for (gi, h) in heads.enumerate() {
        for i in 0..m {
            // SAFETY: this tile alone writes output rows q_start+r0..q_start+r1, columns of the
            // heads of its KV head (one tile per (sequence, KV head, rows)).
            let dst = unsafe { std::slice::from_raw_parts_mut(out.get().add((sp.q_start + t.r0 + i) * out_cols + h * hd), hd) };
            dst.copy_from_slice(&scr.o[(gi * m + i) * hd..(gi * m + i + 1) * hd]);
        }
    }
}

#[derive(Default)]
struct Scratch {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    s: Vec<f32>,
    o: Vec<f32>,
}

/// A direct-path work item: the decode rows of one sequence for query heads `h0..h1`, all of
/// one KV head's group.
struct Item {
    seq: usize,
    h0: usize,
    h1: usize,
}

/// The direct path's per-thread scratch: the item's score rows, and one KV block widened to f32.
#[derive(Default)]
struct RowScratch {
    scores: Vec<f32>,
    block: Vec<f32>,
    dots: Vec<f32>,
}

/// Direct-path attention for one item: each KV block is widened once to f32 for all the item's
/// query rows (its heads × the sequence's rows), which use it from L1; the next block is fetched
/// meanwhile. Every query row's arithmetic (its dot per key, its softmax, its value sum block by
/// block) is the same whatever else the item holds, so a row's output does not depend on the
/// batch or on how items are cut.
#[allow(clippy::too_many_arguments)]
fn attention_rows(q: &CpuTensor, kv: &CpuKv, layer: usize, plan: &BatchPlan, it: &Item, out: SyncPtr, out_cols: usize, group: usize, scr: &mut RowScratch) {
    let l = kv.layout;
    let (hd, bs) = (l.head_dim, l.block_size);
    let (kc, vc) = (kv.k(layer), kv.v(layer));
    let (dt, rb) = (l.dtype, l.row_bytes());
    let sp = &plan.seqs[it.seq];
    let g = it.h0 / group;
    let first_pos = sp.ctx_len - sp.q_len;
    let n_last = sp.ctx_len; // keys visible to the last row
    let n_blocks = n_last.div_ceil(bs);
    // Query (head, row) pairs in order; each owns a score row of n_last.
    let queries = || (it.h0..it.h1).flat_map(|h| (0..sp.q_len).map(move |r| (h, r)));
    let n_q = (it.h1 - it.h0) * sp.q_len;
    let padded = bs.next_multiple_of(KEYS);
    scr.scores.resize(n_q * n_last, 0.0);
    scr.block.resize(padded * hd, 0.0);
    scr.dots.resize(padded, 0.0);
    let q_of = |h: usize, r: usize| {
        let row = sp.q_start + r;
        &q.data[row * q.cols + h * hd..row * q.cols + (h + 1) * hd]
    };
    // The keys a block holds for this item (the last block: those of the last row).
    let keys_in = |b: usize| bs.min(n_last - b * bs);
    let span = |b: usize| {
        let o = kv.offset(sp.blocks[b], g, 0);
        o..o + keys_in(b) * rb
    };
    let fetch_next = |cache: &[u8], b: usize| {
        if b + 1 < n_blocks {
            prefetch(&cache[span(b + 1)]);
        }
    };
    // Keys block by block, every query of the item per block; row r sees first_pos + r + 1 keys.
    for b in 0..n_blocks {
        fetch_next(kc, b);
        widen(dt, hd, &kc[span(b)], &mut scr.block[..keys_in(b) * hd]);
        for (i, (h, r)) in queries().enumerate() {
            let (lo, hi) = (b * bs, (b * bs + bs).min(first_pos + r + 1));
            let row = &mut scr.scores[i * n_last + lo.min(hi)..i * n_last + hi];
            if row.len() == padded {
                dots(q_of(h, r), &scr.block, row);
            } else if !row.is_empty() {
                // A last block the row sees part of: the block's dots, the visible ones kept.
                dots(q_of(h, r), &scr.block, &mut scr.dots);
                row.copy_from_slice(&scr.dots[..row.len()]);
            }
        }
    }
    let scale = 1.0 / (hd as f32).sqrt();
    for (i, (_, r)) in queries().enumerate() {
        softmax_scaled(&mut scr.scores[i * n_last..i * n_last + first_pos + r + 1], scale);
    }
    let dst = |h: usize, r: usize| {
        // SAFETY: each (row, head) pair belongs to exactly one item, so this head_dim-long slice
        // of the output is written by this item alone.
        unsafe { std::slice::from_raw_parts_mut(out.get().add((sp.q_start + r) * out_cols + h * hd), hd) }
    };
    for (h, r) in queries() {
        dst(h, r).fill(0.0);
    }
    for b in 0..n_blocks {
        fetch_next(vc, b);
        widen(dt, hd, &vc[span(b)], &mut scr.block[..keys_in(b) * hd]);
        for (i, (h, r)) in queries().enumerate() {
            let (lo, hi) = (b * bs, (b * bs + bs).min(first_pos + r + 1));
            if lo < hi {
                accumulate(dst(h, r), &scr.scores[i * n_last + lo..i * n_last + hi], &scr.block[..(hi - lo) * hd]);
            }
        }
    }
}

/// Ask for `bytes` to be brought into the cache (a KV block of the next step of the loop: the
/// paged blocks are scattered, which the hardware prefetcher does not follow).
#[inline]
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..bytes.len()).step_by(64) {
        // SAFETY: off < bytes.len(); a prefetch has no architectural effect.
        unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(bytes.as_ptr().add(off).cast()) };
    }
}

pub(crate) fn attention(be: &CpuBackend, q: &CpuTensor, kv: &CpuKv, layer: usize, plan: &BatchPlan, out: &mut CpuTensor) {
    if !kv.layout.dtype.turned() {
        return attention_as_stored(be, q, kv, layer, plan, out);
    }
    // The cache holds each row turned by the Hadamard transform (int8): attend in that basis
    // (q·k = Hq·Hk) and turn the weighted sums of turned values back.
    let hd = kv.layout.head_dim;
    let mut turned = CpuTensor { rows: q.rows, cols: q.cols, data: q.data.clone() };
    hadamard_rows(&mut turned.data, hd);
    attention_as_stored(be, &turned, kv, layer, plan, out);
    hadamard_rows(&mut out.data, hd);
}

/// Attention over the cache's rows as stored, with `q` in the rows' basis.
fn attention_as_stored(be: &CpuBackend, q: &CpuTensor, kv: &CpuKv, layer: usize, plan: &BatchPlan, out: &mut CpuTensor) {
    let l = kv.layout;
    let hd = l.head_dim;
    let n_heads = q.cols / hd;
    let group = n_heads / l.n_kv_heads;
    let out_ptr = SyncPtr(out.data.as_mut_ptr());
    let out_cols = out.cols;
    be.install(|| {
        // Tiles for the GEMM path; the direct path's items serve a KV head's whole query group
        // (one read of its blocks), or single heads where there would be too few items to keep
        // every thread busy (the rows' results are the same either way).
        let mut tiles = Vec::new();
        let mut direct = Vec::new();
        for (s, sp) in plan.seqs.iter().enumerate() {
            if sp.q_len > GEMM_MIN_ROWS {
                for g in 0..l.n_kv_heads {
                    for r0 in (0..sp.q_len).step_by(GEMM_TILE_ROWS) {
                        tiles.push(Tile { seq: s, kv_head: g, r0, r1: (r0 + GEMM_TILE_ROWS).min(sp.q_len) });
                    }
                }
            } else if sp.q_len > 0 {
                direct.push(s);
            }
        }
        let per = if direct.len() * l.n_kv_heads >= 2 * rayon::current_num_threads() { group } else { 1 };
        let items: Vec<Item> = direct.iter().flat_map(|&seq| (0..n_heads).step_by(per).map(move |h0| Item { seq, h0, h1: h0 + per })).collect();
        // Largest tiles (most keys) first, for balance.
        tiles.sort_by_key(|t| std::cmp::Reverse(plan.seqs[t.seq].ctx_len - plan.seqs[t.seq].q_len + t.r1));
        tiles.par_iter().for_each_init(Scratch::default, |scr, t| attention_tile(q, kv, layer, plan, t, out_ptr, out_cols, group, scr));
        items.par_iter().for_each_init(RowScratch::default, |scr, it| attention_rows(q, kv, layer, plan, it, out_ptr, out_cols, group, scr));
    });
}
