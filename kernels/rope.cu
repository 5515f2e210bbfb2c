// Rotary position embedding (RoFormer, arXiv:2104.09864) in HF's rotate-half convention, as the
// CPU backend applies it: in each head, pair i is (x[i], x[i + head_dim/2]). The angles come from
// the host (backend/rope.rs RopeTable: theta, Llama-3 scaling and GGUF frequency factors are all
// applied there): cos/sin are [rows, head_dim/2]. In place; one thread per rotated pair.
// CPU oracle: backend/cpu/mod.rs CpuBackend::rope.

// Rotate pair idx of x ([rows, cols], heads of head_dim): pair i of head h of row r.
__device__ __forceinline__ void rope_pair(float* x, const float* cos_t, const float* sin_t, int cols, int head_dim, size_t idx) {
    const int half = head_dim / 2;
    const int heads = cols / head_dim;
    const int i = (int)(idx % half);
    const int h = (int)((idx / half) % heads);
    const size_t r = idx / ((size_t)half * heads);
    float* p = x + r * cols + (size_t)h * head_dim;
    const float c = cos_t[r * half + i], s = sin_t[r * half + i];
    const float x1 = p[i], x2 = p[i + half];
    p[i] = x1 * c - x2 * s;
    p[i + half] = x2 * c + x1 * s;
}

// A step's queries (q_cols wide) and keys (k_cols wide) in one launch: the pairs of q, then those
// of k; k_cols 0 rotates q alone (k is not touched).
extern "C" __global__ void __launch_bounds__(256)
rope_f32(float* q, float* k, const float* cos_t, const float* sin_t, int rows, int q_cols, int k_cols, int head_dim) {
    const size_t in_q = (size_t)rows * (q_cols / head_dim) * (head_dim / 2);
    const size_t total = in_q + (size_t)rows * (k_cols / head_dim) * (head_dim / 2);
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += (size_t)gridDim.x * blockDim.x) {
        if (idx < in_q) {
            rope_pair(q, cos_t, sin_t, q_cols, head_dim, idx);
        } else {
            rope_pair(k, cos_t, sin_t, k_cols, head_dim, idx - in_q);
        }
    }
}
