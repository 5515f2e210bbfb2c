// Paged attention over the KV cache (vLLM's PagedAttention, Kwon et al. 2023), causal, with
// grouped-query heads (query head h reads KV head h / (n_heads / kv_heads)). Exact softmax in f32
// with the online (running max) formulation of Milakov & Gimelshein 2018, as FlashAttention does.
//
// One block of ATT_WARPS warps per (query row, query head). Each warp takes every ATT_WARPS-th
// visible key: the lanes split head_dim (lane + 32·j), a warp reduction gives the score, and the
// warp keeps its own running max, denominator and weighted sum of values; the warps' partial
// results are merged through shared memory at the end. head_dim ≤ 32·ATT_DIMS_PER_LANE (256).
//
// K and V are read as the cache stores them (ferry_core::kv_dtype rows): f32, bf16 and f16 values
// are widened to f32 in registers; an int8 row's bytes are products with the row's f32 scale (a
// key's scale multiplies its reduced score, a value's scale its softmax weight). One kernel per
// cache dtype, `<op>_<dtype>`, from one template (DT: 0 f32, 1 bf16, 2 f16, 3 int8).
//
// - paged_attention_prefill_<dtype>: a mixed batch; row r belongs to sequence row_seq[r] and is its
//   (r - q_start)-th new token, so it sees ctx_len - q_len + (r - q_start) + 1 keys (the cached
//   prefix and the chunk up to itself).
// - paged_attention_decode_<dtype>: one new token per sequence (a decode batch with variable lengths):
//   grid.x is the sequence, which sees all ctx_len keys.
// - paged_attention_split_<dtype> + paged_attention_merge_f32: the same decode batch with each
//   sequence's keys split into grid.z parts of part_len keys (flash-decoding, Dao et al. 2023; vLLM's
//   PagedAttention V2): a block per (sequence, head, part) writes its part's max, denominator and
//   unnormalized weighted sum of values, and the merge rescales the parts to their common max. For
//   few sequences over long contexts, where a block per (sequence, head) leaves most SMs idle.
//
// Batch arrays (per sequence): q_start, q_len, ctx_len, and block_start into `blocks`, the
// concatenated block tables; `skip` marks the sequences the prefill kernel leaves alone.
// - causal_softmax_f32: for long prefill chunks the backend attends with tensor-core GEMMs instead
//   (S = scale·Q·Kᵀ over the gathered context, then P·V, as HF's eager attention): this is the
//   softmax between them, row i of a chunk of q_len seeing the first offset + i + 1 keys.
// CPU oracle (of the whole attention, either way): backend/cpu/attention.rs.

#define ATT_WARPS 4
#define ATT_DIMS_PER_LANE 8
#define ATT_NEG_INF __int_as_float(0xff800000) // -inf (NVRTC has no <math.h> INFINITY)

__device__ __forceinline__ float att_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#define KV_F32 0
#define KV_BF16 1
#define KV_F16 2
#define KV_INT8 3

// Bytes of one stored row of head_dim values (ferry_core::KvDtype::row_bytes).
template <int DT>
__device__ __forceinline__ size_t att_row_bytes(int head_dim) {
    return DT == KV_F32 ? 4 * (size_t)head_dim : DT == KV_INT8 ? (size_t)head_dim + 4 : 2 * (size_t)head_dim;
}

// Value d of a stored row, widened (an int8 row's value before its scale).
template <int DT>
__device__ __forceinline__ float att_load(const unsigned char* row, int d) {
    if (DT == KV_F32) return ((const float*)row)[d];
    if (DT == KV_BF16) return __uint_as_float((unsigned int)((const unsigned short*)row)[d] << 16);
    if (DT == KV_F16) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(((const unsigned short*)row)[d]));
        return f;
    }
    return (float)((const signed char*)row)[d];
}

// The factor of a stored row's values: an int8 row's scale (after its head_dim bytes), else 1.
template <int DT>
__device__ __forceinline__ float att_row_scale(const unsigned char* row, int head_dim) {
    return DT == KV_INT8 ? *(const float*)(row + head_dim) : 1.0f;
}

// Attention of one query row (q: head_dim values) over keys [t0, t1) of one KV head. With `part`
// null, out gets the attention's output; else the span's partial result: part[0] its max score,
// part[1] its softmax denominator relative to that max, out its weighted sum of values relative to
// the same max, not divided by the denominator (an empty span: -inf, 0 and zeros).
template <int DT>
__device__ void att_span(const float* q, float* out, float* part, const unsigned char* k_cache, const unsigned char* v_cache,
                         const unsigned int* blocks, int t0, int t1, int kv_head, int kv_heads, int head_dim,
                         int block_size, float scale) {
    __shared__ float sm_max[ATT_WARPS];
    __shared__ float sm_den[ATT_WARPS];
    __shared__ float sm_acc[ATT_WARPS][32 * ATT_DIMS_PER_LANE];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const size_t row_bytes = att_row_bytes<DT>(head_dim);
    float qv[ATT_DIMS_PER_LANE], acc[ATT_DIMS_PER_LANE];
#pragma unroll
    for (int j = 0; j < ATT_DIMS_PER_LANE; j++) {
        const int d = lane + 32 * j;
        qv[j] = d < head_dim ? q[d] * scale : 0.0f;
        acc[j] = 0.0f;
    }
    float run_max = ATT_NEG_INF, den = 0.0f;
    for (int t = t0 + warp; t < t1; t += ATT_WARPS) {
        const size_t base = (((size_t)blocks[t / block_size] * kv_heads + kv_head) * block_size + t % block_size) * row_bytes;
        const unsigned char* krow = k_cache + base;
        const unsigned char* vrow = v_cache + base;
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < ATT_DIMS_PER_LANE; j++) {
            const int d = lane + 32 * j;
            if (d < head_dim) s += qv[j] * att_load<DT>(krow, d);
        }
        s = att_warp_sum(s) * att_row_scale<DT>(krow, head_dim);
        const float new_max = fmaxf(run_max, s);
        const float corr = expf(run_max - new_max);
        const float p = expf(s - new_max);
        den = den * corr + p;
        const float pv = p * att_row_scale<DT>(vrow, head_dim);
#pragma unroll
        for (int j = 0; j < ATT_DIMS_PER_LANE; j++) {
            const int d = lane + 32 * j;
            const float v = d < head_dim ? att_load<DT>(vrow, d) : 0.0f;
            acc[j] = acc[j] * corr + pv * v;
        }
        run_max = new_max;
    }
    if (lane == 0) {
        sm_max[warp] = run_max;
        sm_den[warp] = den;
    }
#pragma unroll
    for (int j = 0; j < ATT_DIMS_PER_LANE; j++) sm_acc[warp][lane + 32 * j] = acc[j];
    __syncthreads();
    float m = ATT_NEG_INF;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) m = fmaxf(m, sm_max[w]);
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < ATT_WARPS; w++) total += sm_max[w] == ATT_NEG_INF ? 0.0f : sm_den[w] * expf(sm_max[w] - m);
    if (part != nullptr && threadIdx.x == 0) {
        part[0] = m;
        part[1] = total;
    }
    const float inv = part != nullptr ? 1.0f : total > 0.0f ? 1.0f / total : 0.0f;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < ATT_WARPS; w++) {
            if (sm_max[w] != ATT_NEG_INF) o += sm_acc[w][d] * expf(sm_max[w] - m);
        }
        out[d] = o * inv;
    }
}

template <int DT>
__device__ __forceinline__ void att_prefill(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* out,
                                            const unsigned int* row_seq, const unsigned int* q_start, const unsigned int* q_len,
                                            const unsigned int* ctx_len, const unsigned int* block_start, const unsigned int* blocks,
                                            const unsigned int* skip, int rows, int n_heads, int kv_heads, int head_dim,
                                            int block_size, float scale) {
    const int row = blockIdx.x, head = blockIdx.y;
    if (row >= rows || head >= n_heads || head_dim > 32 * ATT_DIMS_PER_LANE) return;
    const unsigned int s = row_seq[row];
    if (skip[s]) return; // a long chunk: attended with GEMMs (causal_softmax_f32 below)
    const int visible = (int)(ctx_len[s] - q_len[s]) + (row - (int)q_start[s]) + 1;
    const size_t cols = (size_t)n_heads * head_dim;
    att_span<DT>(q + row * cols + (size_t)head * head_dim, out + row * cols + (size_t)head * head_dim, nullptr, k_cache,
                 v_cache, blocks + block_start[s], 0, visible, head / (n_heads / kv_heads), kv_heads, head_dim, block_size,
                 scale);
}

template <int DT>
__device__ __forceinline__ void att_decode(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* out,
                                           const unsigned int* q_start, const unsigned int* ctx_len, const unsigned int* block_start,
                                           const unsigned int* blocks, int seqs, int n_heads, int kv_heads, int head_dim,
                                           int block_size, float scale) {
    const int s = blockIdx.x, head = blockIdx.y;
    if (s >= seqs || head >= n_heads || head_dim > 32 * ATT_DIMS_PER_LANE) return;
    const size_t row = q_start[s];
    const size_t cols = (size_t)n_heads * head_dim;
    att_span<DT>(q + row * cols + (size_t)head * head_dim, out + row * cols + (size_t)head * head_dim, nullptr, k_cache,
                 v_cache, blocks + block_start[s], 0, (int)ctx_len[s], head / (n_heads / kv_heads), kv_heads, head_dim,
                 block_size, scale);
}

// Part blockIdx.z of a split decode: keys [z·part_len, (z+1)·part_len) ∩ [0, ctx_len). Partials of
// (sequence s, head h, part z) at index i = (s·n_heads + h)·gridDim.z + z: stats[2i] its max,
// stats[2i + 1] its denominator, acc[i·head_dim ..] its unnormalized output.
template <int DT>
__device__ __forceinline__ void att_split(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* acc,
                                          float* stats, const unsigned int* q_start, const unsigned int* ctx_len,
                                          const unsigned int* block_start, const unsigned int* blocks, int seqs, int n_heads,
                                          int kv_heads, int head_dim, int block_size, float scale, int part_len) {
    const int s = blockIdx.x, head = blockIdx.y, z = blockIdx.z;
    if (s >= seqs || head >= n_heads || head_dim > 32 * ATT_DIMS_PER_LANE || part_len <= 0) return;
    const long long ctx = ctx_len[s];
    const int t0 = (int)min(ctx, (long long)z * part_len), t1 = (int)min(ctx, (long long)t0 + part_len);
    const size_t i = ((size_t)s * n_heads + head) * gridDim.z + z;
    const size_t cols = (size_t)n_heads * head_dim;
    att_span<DT>(q + q_start[s] * cols + (size_t)head * head_dim, acc + i * head_dim, stats + 2 * i, k_cache, v_cache,
                 blocks + block_start[s], t0, t1, head / (n_heads / kv_heads), kv_heads, head_dim, block_size, scale);
}

// The kernels, one per cache dtype, written out rather than made by a macro: kernels.rs's test
// reads each name from its `extern "C"` definition.
extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS)
paged_attention_prefill_f32(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* out,
                               const unsigned int* row_seq, const unsigned int* q_start, const unsigned int* q_len,
                               const unsigned int* ctx_len, const unsigned int* block_start, const unsigned int* blocks,
                               const unsigned int* skip, int rows, int n_heads, int kv_heads, int head_dim, int block_size,
                               float scale) {
    att_prefill<KV_F32>(q, k_cache, v_cache, out, row_seq, q_start, q_len, ctx_len, block_start, blocks, skip, rows, n_heads,
                   kv_heads, head_dim, block_size, scale);
}

extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS)
paged_attention_decode_f32(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* out,
                              const unsigned int* q_start, const unsigned int* ctx_len, const unsigned int* block_start,
                              const unsigned int* blocks, int seqs, int n_heads, int kv_heads, int head_dim, int block_size,
                              float scale) {
    att_decode<KV_F32>(q, k_cache, v_cache, out, q_start, ctx_len, block_start, blocks, seqs, n_heads, kv_heads, head_dim,
                  block_size, scale);
}

extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS)
paged_attention_prefill_bf16(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* out,
                                const unsigned int* row_seq, const unsigned int* q_start, const unsigned int* q_len,
                                const unsigned int* ctx_len, const unsigned int* block_start, const unsigned int* blocks,
                                const unsigned int* skip, int rows, int n_heads, int kv_heads, int head_dim, int block_size,
                                float scale) {
    att_prefill<KV_BF16>(q, k_cache, v_cache, out, row_seq, q_start, q_len, ctx_len, block_start, blocks, skip, rows, n_heads,
                    kv_heads, head_dim, block_size, scale);
}

extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS)
paged_attention_decode_bf16(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* out,
                               const unsigned int* q_start, const unsigned int* ctx_len, const unsigned int* block_start,
                               const unsigned int* blocks, int seqs, int n_heads, int kv_heads, int head_dim, int block_size,
                               float scale) {
    att_decode<KV_BF16>(q, k_cache, v_cache, out, q_start, ctx_len, block_start, blocks, seqs, n_heads, kv_heads, head_dim,
                   block_size, scale);
}

extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS)
paged_attention_prefill_f16(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* out,
                               const unsigned int* row_seq, const unsigned int* q_start, const unsigned int* q_len,
                               const unsigned int* ctx_len, const unsigned int* block_start, const unsigned int* blocks,
                               const unsigned int* skip, int rows, int n_heads, int kv_heads, int head_dim, int block_size,
                               float scale) {
    att_prefill<KV_F16>(q, k_cache, v_cache, out, row_seq, q_start, q_len, ctx_len, block_start, blocks, skip, rows, n_heads,
                   kv_heads, head_dim, block_size, scale);
}

extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS)
paged_attention_decode_f16(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* out,
                              const unsigned int* q_start, const unsigned int* ctx_len, const unsigned int* block_start,
                              const unsigned int* blocks, int seqs, int n_heads, int kv_heads, int head_dim, int block_size,
                              float scale) {
    att_decode<KV_F16>(q, k_cache, v_cache, out, q_start, ctx_len, block_start, blocks, seqs, n_heads, kv_heads, head_dim,
                  block_size, scale);
}

extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS)
paged_attention_prefill_int8(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* out,
                                const unsigned int* row_seq, const unsigned int* q_start, const unsigned int* q_len,
                                const unsigned int* ctx_len, const unsigned int* block_start, const unsigned int* blocks,
                                const unsigned int* skip, int rows, int n_heads, int kv_heads, int head_dim, int block_size,
                                float scale) {
    att_prefill<KV_INT8>(q, k_cache, v_cache, out, row_seq, q_start, q_len, ctx_len, block_start, blocks, skip, rows, n_heads,
                    kv_heads, head_dim, block_size, scale);
}

extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS)
paged_attention_decode_int8(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* out,
                               const unsigned int* q_start, const unsigned int* ctx_len, const unsigned int* block_start,
                               const unsigned int* blocks, int seqs, int n_heads, int kv_heads, int head_dim, int block_size,
                               float scale) {
    att_decode<KV_INT8>(q, k_cache, v_cache, out, q_start, ctx_len, block_start, blocks, seqs, n_heads, kv_heads, head_dim,
                   block_size, scale);
}

extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS)
paged_attention_split_f32(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* acc, float* stats,
                          const unsigned int* q_start, const unsigned int* ctx_len, const unsigned int* block_start,
                          const unsigned int* blocks, int seqs, int n_heads, int kv_heads, int head_dim, int block_size, float scale,
                          int part_len) {
    att_split<KV_F32>(q, k_cache, v_cache, acc, stats, q_start, ctx_len, block_start, blocks, seqs, n_heads, kv_heads, head_dim,
                  block_size, scale, part_len);
}

extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS)
paged_attention_split_bf16(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* acc, float* stats,
                           const unsigned int* q_start, const unsigned int* ctx_len, const unsigned int* block_start,
                           const unsigned int* blocks, int seqs, int n_heads, int kv_heads, int head_dim, int block_size, float scale,
                           int part_len) {
    att_split<KV_BF16>(q, k_cache, v_cache, acc, stats, q_start, ctx_len, block_start, blocks, seqs, n_heads, kv_heads, head_dim,
                  block_size, scale, part_len);
}

extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS)
paged_attention_split_f16(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* acc, float* stats,
                          const unsigned int* q_start, const unsigned int* ctx_len, const unsigned int* block_start,
                          const unsigned int* blocks, int seqs, int n_heads, int kv_heads, int head_dim, int block_size, float scale,
                          int part_len) {
    att_split<KV_F16>(q, k_cache, v_cache, acc, stats, q_start, ctx_len, block_start, blocks, seqs, n_heads, kv_heads, head_dim,
                  block_size, scale, part_len);
}

extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS)
paged_attention_split_int8(const float* q, const unsigned char* k_cache, const unsigned char* v_cache, float* acc, float* stats,
                           const unsigned int* q_start, const unsigned int* ctx_len, const unsigned int* block_start,
                           const unsigned int* blocks, int seqs, int n_heads, int kv_heads, int head_dim, int block_size, float scale,
                           int part_len) {
    att_split<KV_INT8>(q, k_cache, v_cache, acc, stats, q_start, ctx_len, block_start, blocks, seqs, n_heads, kv_heads, head_dim,
                  block_size, scale, part_len);
}

// The parts of a split decode (att_split's partials, `parts` per sequence and head) into the
// output row of each sequence: every part rescaled to the largest max, summed, divided by the
// rescaled denominators' sum. Grid (seqs, n_heads); empty parts (max -inf) add nothing.
extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS)
paged_attention_merge_f32(const float* acc, const float* stats, float* out, const unsigned int* q_start, int seqs, int n_heads,
                          int head_dim, int parts) {
    const int s = blockIdx.x, head = blockIdx.y;
    if (s >= seqs || head >= n_heads) return;
    const size_t first = ((size_t)s * n_heads + head) * parts;
    float m = ATT_NEG_INF;
    for (int p = 0; p < parts; p++) m = fmaxf(m, stats[2 * (first + p)]);
    float total = 0.0f;
    for (int p = 0; p < parts; p++) {
        const float mp = stats[2 * (first + p)];
        if (mp != ATT_NEG_INF) total += stats[2 * (first + p) + 1] * expf(mp - m);
    }
    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
    float* o = out + (size_t)q_start[s] * n_heads * head_dim + (size_t)head * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float v = 0.0f;
        for (int p = 0; p < parts; p++) {
            const float mp = stats[2 * (first + p)];
            if (mp != ATT_NEG_INF) v += acc[(first + p) * head_dim + d] * expf(mp - m);
        }
        o[d] = v * inv;
    }
}

// s: `rows` rows of `ctx` scores (row r is chunk row r % q_len of its head); in place: the
// softmax over the first offset + i + 1 entries, zeros after them. One block per row.
extern "C" __global__ void __launch_bounds__(256)
causal_softmax_f32(float* s, int rows, int q_len, int ctx, int offset) {
    __shared__ float red[32];
    const int r = blockIdx.x;
    if (r >= rows) return;
    const int visible = min(ctx, offset + (r % q_len) + 1);
    float* row = s + (size_t)r * ctx;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    float m = ATT_NEG_INF;
    for (int j = threadIdx.x; j < visible; j += blockDim.x) m = fmaxf(m, row[j]);
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = ATT_NEG_INF;
    for (int w = 0; w < warps; w++) m = fmaxf(m, red[w]);
    __syncthreads();
    float sum = 0.0f;
    for (int j = threadIdx.x; j < visible; j += blockDim.x) {
        const float e = expf(row[j] - m);
        row[j] = e;
        sum += e;
    }
    sum = att_warp_sum(sum);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    sum = 0.0f;
    for (int w = 0; w < warps; w++) sum += red[w];
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int j = threadIdx.x; j < ctx; j += blockDim.x) row[j] = j < visible ? row[j] * inv : 0.0f;
}
