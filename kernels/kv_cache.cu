// The paged KV cache (per layer one buffer for K and one for V, laid out [num_blocks, kv_heads,
// block_size] rows, as ferry_core::KvLayout and the CPU backend). A row holds one token's values
// of one KV head in the cache's dtype (ferry_core::kv_dtype): f32, bf16 or f16 values, or int8:
// head_dim signed bytes then the row's f32 scale (max|y| / 127), of the row turned by the
// normalized Walsh-Hadamard transform (y = H·x / sqrt(n), ferry_core::kv_dtype::hadamard).
// - kv_write_<dtype>: store each token row's K and V at its slot (block * block_size + offset),
//   converted from f32. int8: one warp per row turns it in shared memory, finds its absmax (a
//   warp reduction) and quantizes.
// - hadamard_rows_f32: turn rows of head_dim values in place by the same transform (its own
//   inverse): attention over an int8 cache turns (a copy of) the query before and its output after.
// - kv_gather_u32: copy a sequence's rows out of its blocks into a contiguous [tokens, kv_heads]
//   rows buffer: the per-layer section of the KV export payload. Rows move as 32-bit words
//   (row_words = row_bytes / 4; the backend refuses a layout whose rows are not whole words),
//   so one kernel serves every dtype; for f32 (row_words = head_dim) it is also the dense gather.
// - kv_scatter_u32: the inverse, for import.
// - kv_widen_<dtype>: gather as kv_gather_u32 does, widened to f32 [tokens, kv_heads, head_dim]
//   (the long-prefill GEMM path reads dense f32 K and V; int8 rows stay turned, as the query is).
// CPU oracles: ferry_core::kv_dtype::encode_row / stored_values / hadamard, CpuBackend::kv_write,
// kv_export_layer, kv_import_layer.

// Index of row (block, head, within) of a layer's cache, in rows.
__device__ __forceinline__ size_t kv_row(unsigned int block, int head, int within, int kv_heads, int block_size) {
    return ((size_t)block * kv_heads + head) * block_size + within;
}

// f32 → bf16 bits, round to nearest even; NaN stays a (quiet) NaN (as half::bf16::from_f32).
__device__ __forceinline__ unsigned short kv_f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// f32 → IEEE half bits, round to nearest even, saturating at ±65504 (as ferry_core's
// encode_row: a KV value past f16's range is stored as its largest finite value, never inf).
__device__ __forceinline__ unsigned short kv_f32_to_f16(float f) {
    f = fminf(fmaxf(f, -65504.0f), 65504.0f);
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float kv_f16_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Store value x at index i of a row buffer of DT (0 f32, 1 bf16, 2 f16) values.
template <int DT>
__device__ __forceinline__ void kv_store(unsigned char* cache, size_t i, float x) {
    if (DT == 0) ((float*)cache)[i] = x;
    else ((unsigned short*)cache)[i] = DT == 2 ? kv_f32_to_f16(x) : kv_f32_to_bf16(x);
}

// k, v: [rows, kv_heads * head_dim]; slots: [rows]. One thread per value.
template <int DT>
__device__ void kv_write_values(const float* k, const float* v, unsigned char* k_cache, unsigned char* v_cache,
                                const unsigned int* slots, int rows, int kv_heads, int head_dim, int block_size) {
    const size_t row_elems = (size_t)kv_heads * head_dim;
    const size_t total = (size_t)rows * row_elems;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / row_elems;
        const int h = (int)((i % row_elems) / head_dim), d = (int)(i % head_dim);
        const unsigned int slot = slots[r];
        const size_t dst = kv_row(slot / block_size, h, slot % block_size, kv_heads, block_size) * head_dim + d;
        kv_store<DT>(k_cache, dst, k[i]);
        kv_store<DT>(v_cache, dst, v[i]);
    }
}

extern "C" __global__ void __launch_bounds__(256)
kv_write_f32(const float* k, const float* v, unsigned char* k_cache, unsigned char* v_cache, const unsigned int* slots,
             int rows, int kv_heads, int head_dim, int block_size) {
    kv_write_values<0>(k, v, k_cache, v_cache, slots, rows, kv_heads, head_dim, block_size);
}

extern "C" __global__ void __launch_bounds__(256)
kv_write_bf16(const float* k, const float* v, unsigned char* k_cache, unsigned char* v_cache, const unsigned int* slots,
              int rows, int kv_heads, int head_dim, int block_size) {
    kv_write_values<1>(k, v, k_cache, v_cache, slots, rows, kv_heads, head_dim, block_size);
}

extern "C" __global__ void __launch_bounds__(256)
kv_write_f16(const float* k, const float* v, unsigned char* k_cache, unsigned char* v_cache, const unsigned int* slots,
             int rows, int kv_heads, int head_dim, int block_size) {
    kv_write_values<2>(k, v, k_cache, v_cache, slots, rows, kv_heads, head_dim, block_size);
}

// Quantize one row of head_dim values (x) into dst (head_dim bytes, then the f32 scale at byte
// head_dim: 4-aligned, as head_dim % 4 == 0). One warp. The same arithmetic as encode_row:
// scale = max / 127, inv = 127 / max (IEEE divisions: NVRTC's default -prec-div=true),
// q = clamp(roundf(x · inv), ±127) (roundf: half away from zero, as Rust's f32::round); a row of
// zeros (or one with an infinite value) gets scale 0 and all-zero bytes.
__device__ __forceinline__ void kv_quantize_row(const float* x, unsigned char* dst, int head_dim, int lane) {
    float m = 0.0f;
    for (int d = lane; d < head_dim; d += 32) m = fmaxf(m, fabsf(x[d]));
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    const bool ok = m > 0.0f && m <= 3.402823466e38f; // finite and non-zero (fmaxf drops NaN)
    const float scale = ok ? m / 127.0f : 0.0f, inv = ok ? 127.0f / m : 0.0f;
    for (int d = lane; d < head_dim; d += 32) {
        const float r = roundf(x[d] * inv);
        const float q = r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r); // NaN stays NaN...
        dst[d] = (unsigned char)(signed char)(q == q ? (int)q : 0);         // ...and is stored as 0 (Rust's `as i8`)
    }
    if (lane == 0) *(float*)(dst + head_dim) = scale;
}

// The longest row the turning kernels hold in shared memory (the attention kernels' limit too),
// and the warps of their 256-thread blocks.
#define KV_TURN_MAX 256
#define KV_TURN_WARPS 8

// Turn one row of head_dim values (s: the warp's own shared-memory row), in place, by the
// normalized Walsh-Hadamard transform over segments of n values, n the largest power of two
// dividing head_dim: stage h = 1, 2, 4, ... pairs (i, i + h) as (a + b, a - b), then a product by
// 1 / sqrt(n): the operations of ferry_core::kv_dtype::hadamard in its order, so the rows match
// the CPU's bit for bit (IEEE sqrt and division: NVRTC's default -prec-sqrt / -prec-div).
__device__ __forceinline__ void kv_hadamard(float* s, int head_dim, int lane) {
    const int n = head_dim & -head_dim;
    __syncwarp();
    if (n < 2) return;
    const int half = n / 2;
    for (int h = 1; h < n; h <<= 1) {
        for (int b = lane; b < head_dim / 2; b += 32) {
            const int seg = b / half, w = b % half;
            const int i = seg * n + (w / h) * 2 * h + w % h;
            const float a = s[i], c = s[i + h];
            s[i] = a + c;
            s[i + h] = a - c;
        }
        __syncwarp();
    }
    const float norm = 1.0f / sqrtf((float)n);
    for (int d = lane; d < head_dim; d += 32) s[d] *= norm;
    __syncwarp();
}

// Copy a row into the warp's shared row and turn it there.
__device__ __forceinline__ float* kv_turned(const float* x, int head_dim, int lane) {
    __shared__ float rows[KV_TURN_WARPS][KV_TURN_MAX];
    float* s = rows[threadIdx.x >> 5];
    __syncwarp();
    for (int d = lane; d < head_dim; d += 32) s[d] = x[d];
    kv_hadamard(s, head_dim, lane);
    return s;
}

// k, v: [rows, kv_heads * head_dim]; one warp per (row, KV head), K then V; head_dim <=
// KV_TURN_MAX (the backend refuses longer int8 rows).
extern "C" __global__ void __launch_bounds__(256)
kv_write_int8(const float* k, const float* v, unsigned char* k_cache, unsigned char* v_cache, const unsigned int* slots,
              int rows, int kv_heads, int head_dim, int block_size) {
    const int lane = threadIdx.x & 31;
    const size_t warps = (size_t)gridDim.x * (blockDim.x >> 5);
    const size_t total = (size_t)rows * kv_heads;
    const size_t row_bytes = (size_t)head_dim + 4;
    for (size_t w = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < total; w += warps) {
        const size_t r = w / kv_heads;
        const int h = (int)(w % kv_heads);
        const unsigned int slot = slots[r];
        const size_t dst = kv_row(slot / block_size, h, slot % block_size, kv_heads, block_size) * row_bytes;
        const size_t src = w * head_dim;
        kv_quantize_row(kv_turned(k + src, head_dim, lane), k_cache + dst, head_dim, lane);
        kv_quantize_row(kv_turned(v + src, head_dim, lane), v_cache + dst, head_dim, lane);
    }
}

// Turn n_rows rows of head_dim values in place (a warp reads its whole row into shared memory
// before writing it back). One warp per row; head_dim <= KV_TURN_MAX.
extern "C" __global__ void __launch_bounds__(256)
hadamard_rows_f32(float* x, int n_rows, int head_dim) {
    const int lane = threadIdx.x & 31;
    const size_t warps = (size_t)gridDim.x * (blockDim.x >> 5);
    for (size_t w = (size_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); w < (size_t)n_rows; w += warps) {
        const float* s = kv_turned(x + w * head_dim, head_dim, lane);
        for (int d = lane; d < head_dim; d += 32) x[w * head_dim + d] = s[d];
    }
}

// out: [tokens, kv_heads] rows of row_words words; blocks: the sequence's block table.
extern "C" __global__ void __launch_bounds__(256)
kv_gather_u32(const unsigned int* cache, const unsigned int* blocks, unsigned int* out, int tokens, int kv_heads, int row_words, int block_size) {
    const size_t total = (size_t)tokens * kv_heads * row_words;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const int t = (int)(i / ((size_t)kv_heads * row_words));
        const int h = (int)((i / row_words) % kv_heads), d = (int)(i % row_words);
        out[i] = cache[kv_row(blocks[t / block_size], h, t % block_size, kv_heads, block_size) * row_words + d];
    }
}

extern "C" __global__ void __launch_bounds__(256)
kv_scatter_u32(const unsigned int* in, const unsigned int* blocks, unsigned int* cache, int tokens, int kv_heads, int row_words, int block_size) {
    const size_t total = (size_t)tokens * kv_heads * row_words;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const int t = (int)(i / ((size_t)kv_heads * row_words));
        const int h = (int)((i / row_words) % kv_heads), d = (int)(i % row_words);
        cache[kv_row(blocks[t / block_size], h, t % block_size, kv_heads, block_size) * row_words + d] = in[i];
    }
}

// The widening gathers: out [tokens, kv_heads, head_dim] f32 from rows of the cache's dtype
// (DT: 1 bf16, 2 f16, 3 int8), one thread per value.
template <int DT>
__device__ void kv_widen(const unsigned char* cache, const unsigned int* blocks, float* out, int tokens, int kv_heads, int head_dim, int block_size) {
    const size_t row_bytes = DT == 3 ? (size_t)head_dim + 4 : 2 * (size_t)head_dim;
    const size_t total = (size_t)tokens * kv_heads * head_dim;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const int t = (int)(i / ((size_t)kv_heads * head_dim));
        const int h = (int)((i / head_dim) % kv_heads), d = (int)(i % head_dim);
        const unsigned char* row = cache + kv_row(blocks[t / block_size], h, t % block_size, kv_heads, block_size) * row_bytes;
        float x;
        if (DT == 3) x = (float)((const signed char*)row)[d] * *(const float*)(row + head_dim);
        else if (DT == 2) x = kv_f16_to_f32(((const unsigned short*)row)[d]);
        else x = __uint_as_float((unsigned int)((const unsigned short*)row)[d] << 16);
        out[i] = x;
    }
}

extern "C" __global__ void __launch_bounds__(256)
kv_widen_bf16(const unsigned char* cache, const unsigned int* blocks, float* out, int tokens, int kv_heads, int head_dim, int block_size) {
    kv_widen<1>(cache, blocks, out, tokens, kv_heads, head_dim, block_size);
}

extern "C" __global__ void __launch_bounds__(256)
kv_widen_f16(const unsigned char* cache, const unsigned int* blocks, float* out, int tokens, int kv_heads, int head_dim, int block_size) {
    kv_widen<2>(cache, blocks, out, tokens, kv_heads, head_dim, block_size);
}

extern "C" __global__ void __launch_bounds__(256)
kv_widen_int8(const unsigned char* cache, const unsigned int* blocks, float* out, int tokens, int kv_heads, int head_dim, int block_size) {
    kv_widen<3>(cache, blocks, out, tokens, kv_heads, head_dim, block_size);
}
