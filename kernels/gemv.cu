// Skinny GEMM for decode: out[r, j] = Σ_c x[r, c] · w[j, c] for the few rows of a decode step
// (m ≤ GEMV_MAX_ROWS), w an [n, k] row-major bf16 / f16 matrix, x the step's activations already
// cast to the same 16-bit type ([m, k], what cuBLAS would read), out [m, n] f32. Memory-bound: the
// weights are read once, 16 bytes per lane per load, and every row of x is applied to each load
// while it is in registers; products are accumulated in f32 (as cuBLAS's CUBLAS_COMPUTE_32F), in
// another order, so the result matches cuBLAS's to rounding.
//
// A warp per output column j: its lanes stride over the row's 16-byte chunks (8 values), then a
// warp reduction per row of x; GEMV_WARPS columns per block. Needs k % 8 == 0 (whole chunks, and
// 16-byte aligned rows from aligned allocations); the host checks it and uses cuBLAS otherwise.
// CPU oracle: CpuBackend::matmul (tests/cuda_kernels.rs, against the activations rounded the same).

#define GEMV_MAX_ROWS 8
#define GEMV_WARPS 8

// The 8 values of a 16-byte chunk, widened to f32.
template <bool BF16>
__device__ __forceinline__ void gemv_widen(uint4 v, float f[8]) {
    const unsigned int words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const unsigned int u = words[i];
        if (BF16) {
            f[2 * i] = __uint_as_float(u << 16);
            f[2 * i + 1] = __uint_as_float(u & 0xffff0000u);
        } else {
            float lo, hi;
            asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }" : "=f"(lo), "=f"(hi) : "r"(u));
            f[2 * i] = lo;
            f[2 * i + 1] = hi;
        }
    }
}

template <bool BF16>
__device__ __forceinline__ void gemv(const unsigned short* w, const unsigned short* x, float* out, int m, int n, int k) {
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (j >= n || m < 1 || m > GEMV_MAX_ROWS || (k & 7) != 0) return;
    const int chunks = k >> 3;
    const uint4* wr = (const uint4*)(w + (size_t)j * k);
    const uint4* xr = (const uint4*)x;
    float acc[GEMV_MAX_ROWS];
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) acc[r] = 0.0f;
#pragma unroll 2
    for (int c = lane; c < chunks; c += 32) {
        float wf[8];
        gemv_widen<BF16>(__ldg(wr + c), wf);
#pragma unroll
        for (int r = 0; r < GEMV_MAX_ROWS; r++) {
            if (r < m) {
                float xf[8];
                gemv_widen<BF16>(__ldg(xr + (size_t)r * chunks + c), xf);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[r] = fmaf(wf[i], xf[i], acc[r]);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; r++) {
        if (r < m) {
            float v = acc[r];
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) out[(size_t)r * n + j] = v;
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)
gemv_bf16(const unsigned short* w, const unsigned short* x, float* out, int m, int n, int k) {
    gemv<true>(w, x, out, m, n, k);
}

extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)
gemv_f16(const unsigned short* w, const unsigned short* x, float* out, int m, int n, int k) {
    gemv<false>(w, x, out, m, n, k);
}
