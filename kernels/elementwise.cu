// Elementwise ops on dense f32 activations: SwiGLU's silu(gate)·up, residual add, bias add, row
// gather, and the f32 → bf16 / f16 casts that feed cuBLAS half-precision GEMMs. Grid-stride loops.
// CPU oracles: CpuBackend::silu_mul, CpuBackend::add, the bias add in backend/cpu/matmul.rs,
// CpuBackend::gather_rows, half::bf16::from_f32 and half::f16::from_f32 (round to nearest even).

// gate = gate / (1 + e^-gate) * up
extern "C" __global__ void __launch_bounds__(256)
silu_mul_f32(float* gate, const float* up, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float g = gate[i];
        gate[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// x += y
extern "C" __global__ void __launch_bounds__(256)
add_f32(float* x, const float* y, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        x[i] += y[i];
    }
}

// out[r, c] += bias[c] for a [rows, cols] matrix.
extern "C" __global__ void __launch_bounds__(256)
add_bias_f32(float* out, const float* bias, int rows, int cols) {
    const size_t n = (size_t)rows * cols;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] += bias[i % cols];
    }
}

// f32 → bf16 bits, round to nearest even; NaN stays a (quiet) NaN.
__device__ __forceinline__ unsigned short f32_to_bf16_bits(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

extern "C" __global__ void __launch_bounds__(256)
to_bf16_f32(const float* x, unsigned short* out, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = f32_to_bf16_bits(x[i]);
    }
}

// f32 → IEEE half bits, round to nearest even (for f16 weights' GEMMs).
extern "C" __global__ void __launch_bounds__(256)
to_f16_f32(const float* x, unsigned short* out, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x[i]));
        out[i] = h;
    }
}

// out[i, :] = x[rows[i], :] (the rows whose logits a step returns).
extern "C" __global__ void __launch_bounds__(256)
gather_rows_f32(const float* x, const unsigned int* rows, float* out, int n, int cols) {
    const size_t total = (size_t)n * cols;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        out[i] = x[(size_t)rows[i / cols] * cols + i % cols];
    }
}

// fill_random_bf16: a synthetic model's weights, made on the device: value i is
// scale * (2u - 1) rounded to bf16, u in [0, 1) the top 24 bits of a hash of (seed, i)
// (SplitMix64's finalizer). CPU oracle: ferry_engine::weights::random_bf16.
extern "C" __global__ void __launch_bounds__(256)
fill_random_bf16(unsigned short* out, unsigned long long n, unsigned int seed, float scale) {
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x) {
        unsigned long long z = i ^ ((unsigned long long)seed << 32) ^ 0x9E3779B97F4A7C15ull;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        const float u = (float)(unsigned int)(z >> 40) * (1.0f / 16777216.0f);
        out[i] = f32_to_bf16_bits(__fmul_rn(scale, 2.0f * u - 1.0f));
    }
}
