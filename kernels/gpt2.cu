// GPT-2-small decoder kernels for the launch-bound workload of issue 11 (examples/gpt2.rs): batch 1, one token
// per step, fp32, KV cache in device memory. Every kernel reads the step's position (and the token) from the
// `state` word in device memory, so one step's launches are the same every step: a graph of them replays
// without parameter updates, as LLM servers use CUDA graphs. Each kernel starts with griddepcontrol.wait, so it
// may also run as a programmatic dependent launch.
//
// Built by kernels/build.sh into gpt2.sm_90.cubin: nvcc -cubin -arch=sm_90 -O3.
#include <stdint.h>

#define WARP 32

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = WARP / 2; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = WARP / 2; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
__device__ float block_sum(float v, float *scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

__device__ float block_max(float v, float *scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : -INFINITY;
    return warp_max(t);
}

// Programmatic dependent launch: wait until the grids this one depends on have completed and their writes are
// visible, then let the next grid be scheduled (its own wait holds it until this one completes). Both are no-ops
// when the launch has no programmatic dependency, so the kernels run unchanged in ordinary launches.
__device__ __forceinline__ void pdl_begin() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

extern "C" {

// x = wte[token] + wpe[pos], token = tokens[pos], pos = state[0].
__global__ void gpt2_embed(const int *state, const int *tokens, const float *wte, const float *wpe, float *x,
                           int d) {
    pdl_begin();
    int pos = state[0];
    int tok = tokens[pos];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < d; i += gridDim.x * blockDim.x)
        x[i] = wte[(size_t)tok * d + i] + wpe[(size_t)pos * d + i];
}

// y = (x - mean) / sqrt(var + 1e-5) * g + b over d elements; one block.
__global__ void gpt2_layernorm(const float *x, const float *g, const float *b, float *y, int d) {
    pdl_begin();
    __shared__ float scratch[32];
    float s = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) s += x[i];
    float mean = block_sum(s, scratch) / d;
    float v = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
        float c = x[i] - mean;
        v += c * c;
    }
    float rstd = rsqrtf(block_sum(v, scratch) / d + 1e-5f);
    for (int i = threadIdx.x; i < d; i += blockDim.x) y[i] = (x[i] - mean) * rstd * g[i] + b[i];
}

// y[r] = W[r, :] . x + bias[r] (bias may be null), W row-major [rows][cols], cols a multiple of 4; one warp a row,
// loads unrolled so each lane keeps several 16-byte loads in flight (the step is memory-bound).
__global__ void gpt2_matvec(const float *__restrict__ W, const float *__restrict__ bias,
                            const float *__restrict__ x, float *__restrict__ y, int cols, int rows) {
    pdl_begin();
    int warps = blockDim.x / WARP;
    int r = blockIdx.x * warps + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (r >= rows) return;
    const float4 *w4 = (const float4 *)(W + (size_t)r * cols);
    const float4 *x4 = (const float4 *)x;
    float acc = 0.0f;
    int n4 = cols / 4;
#pragma unroll 8
    for (int c = lane; c < n4; c += WARP) {
        float4 a = __ldg(w4 + c), b = __ldg(x4 + c);
        acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
    }
    acc = warp_sum(acc);
    if (lane == 0) y[r] = acc + (bias ? bias[r] : 0.0f);
}

// Split attention (flash decoding) of the current position over the KV cache: block (head h, split s) covers
// positions [s * chunk, (s + 1) * chunk) up to `pos`, and leaves its running max, sum of exponentials and
// weighted sum of values in `part` ([heads][splits][2 + hd]); gpt2_attention_combine merges the splits. The block
// whose range holds `pos` also stores the current key and value in the layer's cache ([head][ctx][hd]); every
// block reads them from `qkv`, so no block waits for another. hd must be 64; 128 threads.
__global__ void gpt2_attention(const float *__restrict__ qkv, float *kcache, float *vcache, float *part,
                               const int *state, int heads, int ctx) {
    pdl_begin();
    const int hd = 64;
    __shared__ float q[64], scores[64], vsum[64];
    __shared__ float scratch[32];
    int h = blockIdx.x, split = blockIdx.y, splits = gridDim.y, pos = state[0], d = heads * hd;
    int chunk = ctx / splits, t0 = split * chunk;
    float *out = part + ((size_t)h * splits + split) * (2 + hd);
    float *kc = kcache + (size_t)h * ctx * hd, *vc = vcache + (size_t)h * ctx * hd;
    const float *kq = qkv + d + h * hd, *vq = qkv + 2 * d + h * hd;
    if (threadIdx.x < hd) {
        q[threadIdx.x] = qkv[h * hd + threadIdx.x];
        if (pos >= t0 && pos < t0 + chunk) {
            kc[(size_t)pos * hd + threadIdx.x] = kq[threadIdx.x];
            vc[(size_t)pos * hd + threadIdx.x] = vq[threadIdx.x];
        }
    }
    __syncthreads();
    int n = min(chunk, pos - t0 + 1);  // positions of this split (none when it starts after pos)
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    // A warp per position: lanes over the head's 64 dimensions, two each.
    for (int j = warp; j < n; j += warps) {
        int t = t0 + j;
        const float *k = t == pos ? kq : kc + (size_t)t * hd;
        float sdot = q[lane] * k[lane] + q[lane + 32] * k[lane + 32];
        sdot = warp_sum(sdot);
        if (lane == 0) scores[j] = sdot * 0.125f;  // 1 / sqrt(64)
    }
    __syncthreads();
    float m = -INFINITY;
    for (int j = threadIdx.x; j < n; j += blockDim.x) m = fmaxf(m, scores[j]);
    m = block_max(m, scratch);
    float l = 0.0f;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float e = n > 0 ? __expf(scores[j] - m) : 0.0f;
        scores[j] = e;
        l += e;
    }
    l = block_sum(l, scratch);  // its barriers also publish scores[]
    // Two halves of the block over the positions, threads over dimensions.
    int i = threadIdx.x % hd, half = threadIdx.x / hd;
    float acc = 0.0f;
    for (int j = half; j < n; j += 2) {
        int t = t0 + j;
        acc += scores[j] * (t == pos ? vq[i] : vc[(size_t)t * hd + i]);
    }
    if (half == 1) vsum[i] = acc;
    __syncthreads();
    if (half == 0) {
        out[2 + i] = acc + vsum[i];
        if (i == 0) {
            out[0] = n > 0 ? m : -INFINITY;
            out[1] = l;
        }
    }
}

// out[h * 64 + i] = sum_s e^(m_s - M) acc_s[i] / sum_s e^(m_s - M) l_s over the splits of gpt2_attention; one
// block of 64 threads per head.
__global__ void gpt2_attention_combine(const float *__restrict__ part, float *out, int splits) {
    pdl_begin();
    const int hd = 64;
    int h = blockIdx.x, i = threadIdx.x;
    const float *p = part + (size_t)h * splits * (2 + hd);
    float M = -INFINITY;
    for (int s = 0; s < splits; s++) M = fmaxf(M, p[s * (2 + hd)]);
    float num = 0.0f, den = 0.0f;
    for (int s = 0; s < splits; s++) {
        float ms = p[s * (2 + hd)];
        if (ms == -INFINITY) continue;
        float w = __expf(ms - M);
        num += w * p[s * (2 + hd) + 2 + i];
        den += w * p[s * (2 + hd) + 1];
    }
    out[h * hd + i] = num / den;
}

// GPT-2's tanh approximation of GELU, in place.
__global__ void gpt2_gelu(float *x, int n) {
    pdl_begin();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float v = x[i];
        x[i] = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    }
}

// x += y.
__global__ void gpt2_residual(float *x, const float *y, int n) {
    pdl_begin();
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] += y[i];
}

// The next step's position.
__global__ void gpt2_advance(int *state) {
    pdl_begin();
    if (threadIdx.x == 0 && blockIdx.x == 0) state[0] += 1;
}

}
