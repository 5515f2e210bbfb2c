// Token embedding lookup: out[i, :] = table[ids[i], :], for an f32, f16 or bf16 table (quantized
// GGUF tables are dequantized to bf16 at load). An id outside the vocabulary writes zeros (the
// engine rejects such ids before a step; this only keeps the kernel in bounds).
// CPU oracle: CpuBackend::embed (ferry_quant::dequantize of the row).

extern "C" __global__ void __launch_bounds__(256)
embedding_f32(const float* table, const unsigned int* ids, float* out, int n, int cols, int vocab) {
    const size_t total = (size_t)n * cols;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / cols, c = i % cols;
        const unsigned int id = ids[r];
        out[i] = id < (unsigned int)vocab ? table[(size_t)id * cols + c] : 0.0f;
    }
}

extern "C" __global__ void __launch_bounds__(256)
embedding_bf16(const unsigned short* table, const unsigned int* ids, float* out, int n, int cols, int vocab) {
    const size_t total = (size_t)n * cols;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / cols, c = i % cols;
        const unsigned int id = ids[r];
        out[i] = id < (unsigned int)vocab ? __uint_as_float((unsigned int)table[(size_t)id * cols + c] << 16) : 0.0f;
    }
}

extern "C" __global__ void __launch_bounds__(256)
embedding_f16(const unsigned short* table, const unsigned int* ids, float* out, int n, int cols, int vocab) {
    const size_t total = (size_t)n * cols;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (size_t)gridDim.x * blockDim.x) {
        const size_t r = i / cols, c = i % cols;
        const unsigned int id = ids[r];
        float f = 0.0f;
        if (id < (unsigned int)vocab) {
            const unsigned short h = table[(size_t)id * cols + c];
            asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        }
        out[i] = f;
    }
}
