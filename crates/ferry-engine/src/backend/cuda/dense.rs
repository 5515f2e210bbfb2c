//! cuBLAS GEMMs as plain data ([`Gemm`]: the one description the backend's GEMM calls are made
//! from), and the ones that attend a long prefill chunk on the GPU (`CudaBackend::dense_attention`):
//! which matrices, strides and transposes cuBLAS gets for one KV head's group of query heads.
//! Present in every build, so a CPU test runs the same descriptions through a reference
//! column-major GEMM and compares the attention with the CPU backend's.

/// One `cublasGemmStridedBatchedEx` call in cuBLAS's column-major terms: for each `i < batch`,
/// `C_i = alpha · op(A_i) · op(B_i)` (beta = 0), `op(A_i)` m×k, `op(B_i)` k×n, `C_i` m×n, with
/// `X_i` starting `x_off + i·stride_x` elements into its buffer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Gemm {
    pub trans_a: bool,
    pub trans_b: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub alpha: f32,
    pub a_off: usize,
    pub lda: usize,
    pub stride_a: usize,
    pub b_off: usize,
    pub ldb: usize,
    pub stride_b: usize,
    pub c_off: usize,
    pub ldc: usize,
    pub stride_c: usize,
    pub batch: usize,
}

impl Gemm {
    /// One product (no batch), `alpha` 1, every operand at its buffer's start.
    #[allow(clippy::too_many_arguments)]
    pub fn single(trans_a: bool, trans_b: bool, m: usize, n: usize, k: usize, lda: usize, ldb: usize, ldc: usize) -> Gemm {
        Gemm { trans_a, trans_b, m, n, k, alpha: 1.0, a_off: 0, lda, stride_a: 0, b_off: 0, ldb, stride_b: 0, c_off: 0, ldc, stride_c: 0, batch: 1 }
    }
}

/// A chunk of `q_len` rows starting at row `q_start` of the step's Q/output (each row
/// `n_heads·head_dim` wide), over `ctx_len` tokens of context gathered as K and V
/// (`[ctx_len, kv_heads·head_dim]`).
#[derive(Clone, Copy, Debug)]
pub struct Chunk {
    pub q_start: usize,
    pub q_len: usize,
    pub ctx_len: usize,
    pub n_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl Chunk {
    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.n_heads / self.kv_heads
    }

    /// Scores of KV head `g`'s query heads: row-major `S[h][i][j] = scale·Q_h[i]·K[j]`, into a
    /// `[group, q_len, ctx]` buffer. Column-major, `Sᵀ = K·Q_hᵀ`: A is K (transposed; every head
    /// of the group reads the same K, stride 0), B is Q_h (heads `head_dim` apart).
    pub fn scores(&self, g: usize) -> Gemm {
        let (hd, cols, kv_cols) = (self.head_dim, self.n_heads * self.head_dim, self.kv_heads * self.head_dim);
        Gemm {
            trans_a: true,
            trans_b: false,
            m: self.ctx_len,
            n: self.q_len,
            k: hd,
            alpha: 1.0 / (hd as f32).sqrt(),
            a_off: g * hd,
            lda: kv_cols,
            stride_a: 0,
            b_off: self.q_start * cols + g * self.group() * hd,
            ldb: cols,
            stride_b: hd,
            c_off: 0,
            ldc: self.ctx_len,
            stride_c: self.q_len * self.ctx_len,
            batch: self.group(),
        }
    }

    /// The output of KV head `g`'s query heads: row-major `O_h[i] = Σ_j P_h[i][j]·V[j]`, into the
    /// chunk's rows of the output. Column-major, `O_hᵀ = Vᵀ·P_hᵀ`: A is V (stride 0), B is P_h.
    pub fn values(&self, g: usize) -> Gemm {
        let (hd, cols, kv_cols) = (self.head_dim, self.n_heads * self.head_dim, self.kv_heads * self.head_dim);
        Gemm {
            trans_a: false,
            trans_b: false,
            m: hd,
            n: self.q_len,
            k: self.ctx_len,
            alpha: 1.0,
            a_off: g * hd,
            lda: kv_cols,
            stride_a: 0,
            b_off: 0,
            ldb: self.ctx_len,
            stride_b: self.q_len * self.ctx_len,
            c_off: self.q_start * cols + g * self.group() * hd,
            ldc: cols,
            stride_c: hd,
            batch: self.group(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuTensor;
    use crate::backend::{Backend, BatchPlan, SeqPlan};
    use ferry_core::{KvDtype, KvLayout};

    /// Reference column-major strided-batched GEMM (what cuBLAS computes for `g`), f64 accumulation.
    fn reference_gemm(g: &Gemm, a: &[f32], b: &[f32], c: &mut [f32]) {
        for i in 0..g.batch {
            let (ao, bo, co) = (g.a_off + i * g.stride_a, g.b_off + i * g.stride_b, g.c_off + i * g.stride_c);
            for col in 0..g.n {
                for row in 0..g.m {
                    let mut acc = 0f64;
                    for l in 0..g.k {
                        // op(A)[row][l], op(B)[l][col] in column-major storage.
                        let av = if g.trans_a { a[ao + l + row * g.lda] } else { a[ao + row + l * g.lda] };
                        let bv = if g.trans_b { b[bo + col + l * g.ldb] } else { b[bo + l + col * g.ldb] };
                        acc += av as f64 * bv as f64;
                    }
                    c[co + row + col * g.ldc] = g.alpha * acc as f32;
                }
            }
        }
    }

    /// Reference of `causal_softmax_f32` (kernels/attention.cu): rows of `ctx` scores, row r being
    /// row `r % q_len` of the chunk, which sees the first `offset + r % q_len + 1` keys.
    fn reference_causal_softmax(s: &mut [f32], q_len: usize, ctx: usize, offset: usize) {
        for (r, row) in s.chunks_mut(ctx).enumerate() {
            let visible = (offset + r % q_len + 1).min(ctx);
            let m = row[..visible].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let sum: f32 = row[..visible].iter_mut().map(|x| {
                *x = (*x - m).exp();
                *x
            }).sum();
            for (j, x) in row.iter_mut().enumerate() {
                *x = if j < visible { *x / sum } else { 0.0 };
            }
        }
    }

    /// The GEMM descriptions, executed by the reference GEMM and softmax, attend exactly as the
    /// CPU backend does: a chunk after a cached prefix, GQA, inside a larger step.
    #[test]
    fn dense_attention_gemms_match_the_cpu_attention() {
        let (n_heads, kv_heads, hd, bs) = (6, 2, 8, 4);
        let (prefix, q_len, other_rows) = (5, 7, 3);
        let ctx = prefix + q_len;
        let cpu = crate::backend::cpu::CpuBackend::new(1).unwrap();
        let layout = KvLayout { dtype: KvDtype::F32, block_size: bs, n_layers: 1, n_kv_heads: kv_heads, head_dim: hd };
        let mut kv = cpu.kv_alloc(&layout, 8).unwrap();
        let blocks = vec![5u32, 1, 6];
        let val = |i: usize, salt: usize| (((i * 7919 + salt * 104_729) % 1000) as f32 / 500.0) - 1.0;
        let k: Vec<f32> = (0..ctx * kv_heads * hd).map(|i| val(i, 1)).collect();
        let v: Vec<f32> = (0..ctx * kv_heads * hd).map(|i| val(i, 2)).collect();
        let cols = n_heads * hd;
        let rows = other_rows + q_len;
        let q: Vec<f32> = (0..rows * cols).map(|i| val(i, 3)).collect();
        // Write the whole context's K/V, then attend the chunk (rows other_rows..) as the CPU does.
        let rope = crate::backend::RopeTable::new(
            &crate::config::RopeConfig { theta: 10000.0, llama3: None, freq_factors: None, freq_dtype: crate::config::FreqDtype::F32 },
            hd,
        );
        let write = BatchPlan {
            positions: (0..ctx as u32).collect(),
            slots: (0..ctx).map(|p| blocks[p / bs] * bs as u32 + (p % bs) as u32).collect(),
            seqs: vec![SeqPlan { q_start: 0, q_len: ctx, ctx_len: ctx, blocks: blocks.clone() }],
        };
        let wb = cpu.prepare(&write, &rope);
        cpu.kv_write(&mut kv, 0, &CpuTensor::from_data(ctx, kv_heads * hd, k.clone()), &CpuTensor::from_data(ctx, kv_heads * hd, v.clone()), &wb);
        let chunk_rows: Vec<usize> = (other_rows..rows).collect();
        let plan = BatchPlan {
            positions: (prefix as u32..ctx as u32).collect(),
            slots: vec![0; q_len],
            seqs: vec![SeqPlan { q_start: 0, q_len, ctx_len: ctx, blocks }],
        };
        let qt = cpu.gather_rows(&CpuTensor::from_data(rows, cols, q.clone()), &chunk_rows);
        let mut want = cpu.tensor(q_len, cols);
        cpu.attention(&qt, &kv, 0, &cpu.prepare(&plan, &rope), &mut want);
        let want = cpu.to_host(&want);

        // The GEMM path over the full step's Q (the chunk at row other_rows), K and V gathered.
        let c = Chunk { q_start: other_rows, q_len, ctx_len: ctx, n_heads, kv_heads, head_dim: hd };
        let mut out = vec![f32::NAN; rows * cols];
        for g in 0..kv_heads {
            let mut s = vec![f32::NAN; c.group() * q_len * ctx];
            reference_gemm(&c.scores(g), &k, &q, &mut s);
            reference_causal_softmax(&mut s, q_len, ctx, ctx - q_len);
            reference_gemm(&c.values(g), &v, &s, &mut out);
        }
        let got = &out[other_rows * cols..];
        let d = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        assert!(d < 1e-5, "max |Δ| {d}");
        assert!(out[..other_rows * cols].iter().all(|x| x.is_nan()), "rows outside the chunk are untouched");
    }
}
