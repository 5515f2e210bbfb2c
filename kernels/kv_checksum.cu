// kv_checksum_f32: the checksum of KV moved device to device (NCCL frames), over n 32-bit words
// (the f32 bit patterns): sum over i of mix(word[i], i) modulo 2^32, with
// mix(w, i) = fmix32(w ^ fmix32(i * 0x9E3779B9 + 0x7F4A7C15)) (MurmurHash3's finalizer).
// The terms add in any order, so each thread sums a grid-stride share, a block reduces with warp
// shuffles and adds its total to *out with one atomicAdd (unsigned adds wrap, as the oracle's).
// *out must be zero before the launch. CPU oracle: ferry_core::kv_payload::word_checksum.

__device__ __forceinline__ unsigned int ck_fmix32(unsigned int h) {
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    return h ^ (h >> 16);
}

extern "C" __global__ void __launch_bounds__(256)
kv_checksum_f32(const unsigned int* words, unsigned long long n, unsigned int* out) {
    __shared__ unsigned int s_part[8];
    unsigned int sum = 0;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (unsigned long long)gridDim.x * blockDim.x) {
        const unsigned int idx = (unsigned int)i; // the oracle's `i as u32`
        sum += ck_fmix32(words[i] ^ ck_fmix32(idx * 0x9E3779B9u + 0x7F4A7C15u));
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) s_part[warp] = sum;
    __syncthreads();
    if (warp == 0) {
        sum = lane < (int)(blockDim.x >> 5) ? s_part[lane] : 0u;
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        if (lane == 0) atomicAdd(out, sum);
    }
}
