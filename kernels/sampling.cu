// Sampling on the device, one block of SAMPLE_BLOCK threads per row of logits [rows, vocab]:
// - argmax_f32: greedy; the first index of the maximum on ties (as torch.argmax and the engine's
//   sampler::argmax).
// - sample_top_p_f32: temperature softmax, then the nucleus (Holtzman et al. 2019) without a sort:
//   the threshold T is the largest probability value such that the tokens with p ≥ T hold at least
//   top_p of the mass, found by bisection over the float bit patterns (exact, 32 steps of a block
//   reduction); then one draw `u·mass` (u uniform in [0, 1) from the host, one per row) walks the
//   kept tokens in index order. Differs from the host sampler in the walk order (index, not
//   probability) and in keeping every token tied at T; top-k is not applied here.
// CPU oracle: the same algorithm in the tests (and sampler::argmax for greedy).

#define SAMPLE_BLOCK 1024
#define SMP_NEG_INF __int_as_float(0xff800000) // -inf (NVRTC has no <math.h> INFINITY)

__device__ __forceinline__ float smp_block_max(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? scratch[lane] : SMP_NEG_INF;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    return v;
}

__device__ __forceinline__ float smp_block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? scratch[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    return v;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_BLOCK)
argmax_f32(const float* logits, int vocab, unsigned int* out) {
    __shared__ float s_val[32];
    __shared__ unsigned int s_idx[32];
    const float* l = logits + (size_t)blockIdx.x * vocab;
    float best = SMP_NEG_INF;
    unsigned int bi = 0xffffffffu;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = l[i];
        if (v > best || bi == 0xffffffffu) { best = v; bi = (unsigned int)i; }
    }
    // (value, index) max with the smaller index on ties.
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const unsigned int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { s_val[warp] = best; s_idx[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        const int nwarps = blockDim.x >> 5;
        best = lane < nwarps ? s_val[lane] : SMP_NEG_INF;
        bi = lane < nwarps ? s_idx[lane] : 0xffffffffu;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const unsigned int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
        }
        if (lane == 0) out[blockIdx.x] = bi == 0xffffffffu ? 0u : bi;
    }
}

__device__ __forceinline__ float smp_prob(const float* l, int i, float max, float inv_temp, float inv_total) {
    return expf((l[i] - max) * inv_temp) * inv_total;
}

extern "C" __global__ void __launch_bounds__(SAMPLE_BLOCK)
sample_top_p_f32(const float* logits, int vocab, float temperature, float top_p, const float* uniforms, unsigned int* out) {
    __shared__ float scratch[32];
    __shared__ float s_prefix[SAMPLE_BLOCK];
    const float* l = logits + (size_t)blockIdx.x * vocab;
    const float inv_temp = 1.0f / temperature;
    float m = SMP_NEG_INF;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) m = fmaxf(m, l[i]);
    m = smp_block_max(m, scratch);
    float total = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) total += expf((l[i] - m) * inv_temp);
    total = smp_block_sum(total, scratch);
    const float inv_total = 1.0f / total;
    // Largest bit pattern T (a non-negative float) with mass(p >= T) >= top_p; mass(0) = 1.
    unsigned int lo = 0u, hi = __float_as_uint(inv_total); // the largest probability is 1/total
    while (lo < hi) {
        const unsigned int mid = lo + (hi - lo + 1u) / 2u;
        const float t = __uint_as_float(mid);
        float mass = 0.0f;
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
            const float p = smp_prob(l, i, m, inv_temp, inv_total);
            if (p >= t) mass += p;
        }
        mass = smp_block_sum(mass, scratch);
        if (mass >= top_p) lo = mid; else hi = mid - 1u;
    }
    const float thr = __uint_as_float(lo);
    // Each thread owns a contiguous chunk; an exclusive scan of the chunks' kept mass places the draw.
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int begin = threadIdx.x * chunk, end = min(vocab, begin + chunk);
    float own = 0.0f;
    int last_kept = -1;
    for (int i = begin; i < end; i++) {
        const float p = smp_prob(l, i, m, inv_temp, inv_total);
        if (p >= thr) { own += p; last_kept = i; }
    }
    s_prefix[threadIdx.x] = own;
    __syncthreads();
    for (int o = 1; o < (int)blockDim.x; o <<= 1) { // Hillis-Steele inclusive scan
        const float add = threadIdx.x >= (unsigned int)o ? s_prefix[threadIdx.x - o] : 0.0f;
        __syncthreads();
        s_prefix[threadIdx.x] += add;
        __syncthreads();
    }
    const float kept = s_prefix[blockDim.x - 1];
    const float before = s_prefix[threadIdx.x] - own;
    const float target = uniforms[blockIdx.x] * kept;
    __shared__ unsigned int s_pick;
    __shared__ int s_last;
    if (threadIdx.x == 0) { s_pick = 0xffffffffu; s_last = -1; }
    __syncthreads();
    if (last_kept >= 0) atomicMax(&s_last, last_kept);
    if (own > 0.0f && target >= before && target < before + own) {
        float u = target - before;
        int pick = last_kept;
        for (int i = begin; i < end; i++) {
            const float p = smp_prob(l, i, m, inv_temp, inv_total);
            if (p >= thr) {
                if (u < p) { pick = i; break; }
                u -= p;
            }
        }
        atomicMin(&s_pick, (unsigned int)pick);
    }
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = s_pick != 0xffffffffu ? s_pick : (unsigned int)max(s_last, 0);
}
