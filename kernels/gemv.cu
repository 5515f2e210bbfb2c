// Skinny GEMM for decode: out[r, j] = Σ_c x[r, c] · w[j, c] for the few rows of a decode step
// (m ≤ GEMV_MAX_ROWS), each w an [n, k] row-major bf16 / f16 matrix, x the step's f32 activations
// [m, k], out [m, n] f32. Up to three matrices that read the same x in one launch (a layer's q, k
// and v projections; gate and up), their columns laid end to end over the grid.
//
// x is rounded to the weights' 16-bit type in registers exactly as to_bf16_f32 / to_f16_f32 round
// it for cuBLAS (nearest even), and products are accumulated in f32 (as CUBLAS_COMPUTE_32F), in
// another order: the result matches the cuBLAS path to rounding, with no cast kernel and no
// 16-bit copy of x. Memory-bound: each weight row is read once, 16 bytes (8 values) per lane per
// load, and every row of x is applied to a load while it is in registers.
//
// A warp per output column: its lanes stride over the row's 8-value chunks, then a warp reduction
// per row of x; GEMV_WARPS columns per block. Needs k % 8 == 0 (whole chunks; rows 16-byte
// aligned in aligned allocations); the host checks it and uses cuBLAS otherwise.
// CPU oracle: CpuBackend::matmul (tests/cuda_kernels.rs).

#define GEMV_MAX_ROWS 8
#define GEMV_WARPS 8

// f32 → the nearest bf16, as a float (to_bf16_f32's rounding; NaN stays NaN).
__device__ __forceinline__ float gemv_round_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return f;
    u += 0x7fffu + ((u >> 16) & 1u);
    return __uint_as_float(u & 0xffff0000u);
}

// f32 → the nearest f16, as a float (to_f16_f32's rounding).
__device__ __forceinline__ float gemv_round_f16(float f) {
    float r;
    asm("{ .reg .b16 h; cvt.rn.f16.f32 h, %1; cvt.f32.f16 %0, h; }" : "=f"(r) : "f"(f));
    return r;
}

// The 8 values of a 16-byte chunk of weights, widened to f32.
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
__device__ __forceinline__ void gemv(const float* x, int m, int k, const unsigned short* w0, float* out0, int n0,
                                     const unsigned short* w1, float* out1, int n1, const unsigned short* w2, float* out2,
                                     int n2) {
    const int lane = threadIdx.x & 31;
    int j = blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (m < 1 || m > GEMV_MAX_ROWS || (k & 7) != 0 || j >= n0 + n1 + n2) return;
    // Which matrix column j belongs to.
    const unsigned short* w = w0;
    float* out = out0;
    int n = n0;
    if (j >= n0) {
        j -= n0;
        w = w1;
        out = out1;
        n = n1;
        if (j >= n1) {
            j -= n1;
            w = w2;
            out = out2;
            n = n2;
        }
    }
    const int chunks = k >> 3;
    const uint4* wr = (const uint4*)(w + (size_t)j * k);
    const float4* xr = (const float4*)x;
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
                const float4 a = __ldg(xr + ((size_t)r * chunks + c) * 2);
                const float4 b = __ldg(xr + ((size_t)r * chunks + c) * 2 + 1);
                const float xf[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
                for (int i = 0; i < 8; i++) acc[r] = fmaf(wf[i], BF16 ? gemv_round_bf16(xf[i]) : gemv_round_f16(xf[i]), acc[r]);
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
gemv_bf16(const float* x, int m, int k, const unsigned short* w0, float* out0, int n0, const unsigned short* w1, float* out1,
          int n1, const unsigned short* w2, float* out2, int n2) {
    gemv<true>(x, m, k, w0, out0, n0, w1, out1, n1, w2, out2, n2);
}

extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS)
gemv_f16(const float* x, int m, int k, const unsigned short* w0, float* out0, int n0, const unsigned short* w1, float* out1,
         int n1, const unsigned short* w2, float* out2, int n2) {
    gemv<false>(x, m, k, w0, out0, n0, w1, out1, n1, w2, out2, n2);
}
