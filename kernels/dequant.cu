// Dequantization of GGUF block formats to bf16 at load, so quantized weights feed cuBLAS bf16
// GEMMs: Q8_0, Q4_0 and Q4_1 (32 elements per block; layouts in ferry-quant's types.rs). One
// thread per block. Each element is computed with the same IEEE operations as the host
// dequantizer (no FMA contraction: __fmul_rn/__fadd_rn), then rounded to nearest even bf16, so the
// result equals half::bf16::from_f32(ferry_quant::dequantize(..)) bit for bit.
// The K-quants (Q4_K, Q6_K) are dequantized on the host (ferry_quant) and converted there.
// CPU oracle: ferry_quant::dequantize (scalar.rs).

__device__ __forceinline__ float dq_f16(const unsigned char* p) {
    const unsigned short h = (unsigned short)(p[0] | (p[1] << 8));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short dq_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// Q8_0: 34 bytes = f16 scale d, 32 × i8 q; x = d·q.
extern "C" __global__ void __launch_bounds__(256)
dequant_q8_0_bf16(const unsigned char* src, unsigned short* dst, size_t n_blocks) {
    for (size_t b = (size_t)blockIdx.x * blockDim.x + threadIdx.x; b < n_blocks; b += (size_t)gridDim.x * blockDim.x) {
        const unsigned char* p = src + b * 34;
        const float d = dq_f16(p);
        unsigned short* y = dst + b * 32;
        for (int i = 0; i < 32; i++) y[i] = dq_bf16(__fmul_rn(d, (float)(signed char)p[2 + i]));
    }
}

// Q4_0: 18 bytes = f16 d, 16 bytes of nibbles; element i < 16 is the low nibble of byte i,
// element 16 + i the high nibble; x = d·(q − 8).
extern "C" __global__ void __launch_bounds__(256)
dequant_q4_0_bf16(const unsigned char* src, unsigned short* dst, size_t n_blocks) {
    for (size_t b = (size_t)blockIdx.x * blockDim.x + threadIdx.x; b < n_blocks; b += (size_t)gridDim.x * blockDim.x) {
        const unsigned char* p = src + b * 18;
        const float d = dq_f16(p);
        unsigned short* y = dst + b * 32;
        for (int i = 0; i < 16; i++) {
            const unsigned char q = p[2 + i];
            y[i] = dq_bf16(__fmul_rn(d, (float)((int)(q & 0x0F) - 8)));
            y[16 + i] = dq_bf16(__fmul_rn(d, (float)((int)(q >> 4) - 8)));
        }
    }
}

// Q4_1: 20 bytes = f16 d, f16 m, 16 bytes of nibbles; x = d·q + m.
extern "C" __global__ void __launch_bounds__(256)
dequant_q4_1_bf16(const unsigned char* src, unsigned short* dst, size_t n_blocks) {
    for (size_t b = (size_t)blockIdx.x * blockDim.x + threadIdx.x; b < n_blocks; b += (size_t)gridDim.x * blockDim.x) {
        const unsigned char* p = src + b * 20;
        const float d = dq_f16(p), m = dq_f16(p + 2);
        unsigned short* y = dst + b * 32;
        for (int i = 0; i < 16; i++) {
            const unsigned char q = p[4 + i];
            y[i] = dq_bf16(__fadd_rn(__fmul_rn(d, (float)(q & 0x0F)), m));
            y[16 + i] = dq_bf16(__fadd_rn(__fmul_rn(d, (float)(q >> 4)), m));
        }
    }
}
