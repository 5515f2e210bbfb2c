// The paged KV cache (one f32 array per layer for K and one for V, laid out
// [num_blocks, kv_heads, block_size, head_dim], as ferry_core::KvLayout and the CPU backend):
// - kv_write_f32: store each token row's K and V at its slot (block * block_size + offset).
// - kv_gather_f32: copy a sequence's tokens out of its blocks into a contiguous
//   [tokens, kv_heads, head_dim] buffer: the per-layer section of the KV export payload.
// - kv_scatter_f32: the inverse, for import.
// One thread per element. CPU oracles: CpuBackend::kv_write, kv_export_layer, kv_import_layer.

__device__ __forceinline__ size_t kv_offset(unsigned int block, int head, int within, int kv_heads, int block_size, int head_dim) {
    return (((size_t)block * kv_heads + head) * block_size + within) * head_dim;
}

// k, v: [rows, kv_heads * head_dim]; slots: [rows].
extern "C" __global__ void __launch_bounds__(256)
kv_write_f32(const float* k, const float* v, float* k_cache, float* v_cache, const unsigned int* slots,
             int rows, int kv_heads, int head_dim, int block_size) {
    const size_t row_elems = (size_t)kv_heads * head_dim;
    const size_t total = (size_t)rows * row_elems;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / row_elems;
        const int h = (int)((i % row_elems) / head_dim), d = (int)(i % head_dim);
        const unsigned int slot = slots[r];
        const size_t dst = kv_offset(slot / block_size, h, slot % block_size, kv_heads, block_size, head_dim) + d;
        k_cache[dst] = k[i];
        v_cache[dst] = v[i];
    }
}

// out: [tokens, kv_heads, head_dim]; blocks: the sequence's block table.
extern "C" __global__ void __launch_bounds__(256)
kv_gather_f32(const float* cache, const unsigned int* blocks, float* out, int tokens, int kv_heads, int head_dim, int block_size) {
    const size_t total = (size_t)tokens * kv_heads * head_dim;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const int t = (int)(i / ((size_t)kv_heads * head_dim));
        const int h = (int)((i / head_dim) % kv_heads), d = (int)(i % head_dim);
        out[i] = cache[kv_offset(blocks[t / block_size], h, t % block_size, kv_heads, block_size, head_dim) + d];
    }
}

extern "C" __global__ void __launch_bounds__(256)
kv_scatter_f32(const float* in, const unsigned int* blocks, float* cache, int tokens, int kv_heads, int head_dim, int block_size) {
    const size_t total = (size_t)tokens * kv_heads * head_dim;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const int t = (int)(i / ((size_t)kv_heads * head_dim));
        const int h = (int)((i / head_dim) % kv_heads), d = (int)(i % head_dim);
        cache[kv_offset(blocks[t / block_size], h, t % block_size, kv_heads, block_size, head_dim) + d] = in[i];
    }
}
