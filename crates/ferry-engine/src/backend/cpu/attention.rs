//! Causal attention over the paged KV cache for a mixed batch (prefill chunks and decode tokens),
//! with grouped-query heads (GQA/MQA). Exact softmax in f32, two passes per query row.

use super::simd::{axpy, dot};
use super::{CpuBackend, CpuKv, CpuTensor, SyncPtr};
use crate::backend::BatchPlan;
use rayon::prelude::*;

/// Query rows per parallel task.
const ROWS_PER_TASK: usize = 16;

pub(crate) fn attention(be: &CpuBackend, q: &CpuTensor, kv: &CpuKv, layer: usize, plan: &BatchPlan, out: &mut CpuTensor) {
    let l = kv.layout;
    let (hd, bs) = (l.head_dim, l.block_size);
    let n_heads = q.cols / hd;
    let group = n_heads / l.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let (kc, vc) = (&kv.k[layer], &kv.v[layer]);
    // (sequence, head, first row) work items.
    let mut items = Vec::new();
    for (s, sp) in plan.seqs.iter().enumerate() {
        for h in 0..n_heads {
            for r0 in (0..sp.q_len).step_by(ROWS_PER_TASK) {
                items.push((s, h, r0));
            }
        }
    }
    let out_ptr = SyncPtr(out.data.as_mut_ptr());
    let out_cols = out.cols;
    be.install(|| {
        items.par_iter().for_each_init(Vec::new, |scores: &mut Vec<f32>, &(s, h, r0)| {
            let sp = &plan.seqs[s];
            let g = h / group;
            let first_pos = sp.ctx_len - sp.q_len;
            for r in r0..(r0 + ROWS_PER_TASK).min(sp.q_len) {
                let row = sp.q_start + r;
                let n_ctx = first_pos + r + 1;
                let qv = &q.data[row * q.cols + h * hd..row * q.cols + (h + 1) * hd];
                scores.clear();
                let mut max = f32::NEG_INFINITY;
                for t in 0..n_ctx {
                    let o = kv.offset(sp.blocks[t / bs], g, t % bs);
                    let sc = dot(qv, &kc[o..o + hd]) * scale;
                    max = max.max(sc);
                    scores.push(sc);
                }
                let mut sum = 0f32;
                for sc in scores.iter_mut() {
                    *sc = (*sc - max).exp();
                    sum += *sc;
                }
                // SAFETY: each (row, head) pair belongs to exactly one work item, so this
                // head_dim-long slice of the output is written by this task alone.
                let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(row * out_cols + h * hd), hd) };
                dst.fill(0.0);
                let inv = 1.0 / sum;
                for (t, p) in scores.iter().enumerate() {
                    let o = kv.offset(sp.blocks[t / bs], g, t % bs);
                    axpy(dst, p * inv, &vc[o..o + hd]);
                }
            }
        });
    });
}
