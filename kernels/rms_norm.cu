// RMSNorm, row-wise: out = x / sqrt(mean(x²) + eps) * w (Zhang & Sennrich 2019), and the fused
// residual form x += y; out = rmsnorm(x). One block per row; a row may be normalized in place
// (out == x), which is how per-head (Qwen3 q/k) norms run: rows = tokens·heads, cols = head_dim.
// CPU oracle: backend/cpu/mod.rs rms_norm_row.

#define RMS_BLOCK 256

// Sum of `v` over the block; every thread gets the result. `scratch` holds 32 floats.
__device__ __forceinline__ float rms_block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int nwarps = blockDim.x >> 5;
    v = lane < nwarps ? scratch[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    return v;
}

extern "C" __global__ void __launch_bounds__(RMS_BLOCK)
rms_norm_f32(const float* x, const float* w, float* out, int rows, int cols, float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    const float* xr = x + (size_t)row * cols;
    float* orow = out + (size_t)row * cols;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) ss += xr[i] * xr[i];
    ss = rms_block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) orow[i] = w[i] * (xr[i] * inv);
}

// x += y, then out = rmsnorm(x) * w: the residual add before a layer's norm, in one pass.
extern "C" __global__ void __launch_bounds__(RMS_BLOCK)
add_rms_norm_f32(float* x, const float* y, const float* w, float* out, int rows, int cols, float eps) {
    __shared__ float scratch[32];
    const int row = blockIdx.x;
    if (row >= rows) return;
    float* xr = x + (size_t)row * cols;
    const float* yr = y + (size_t)row * cols;
    float* orow = out + (size_t)row * cols;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = xr[i] + yr[i];
        xr[i] = v;
        ss += v * v;
    }
    ss = rms_block_sum(ss, scratch);
    const float inv = rsqrtf(ss / (float)cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) orow[i] = w[i] * (xr[i] * inv);
}
