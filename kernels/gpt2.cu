// GPT-2-small decoder kernels for the launch-bound workload of issue 11 (examples/gpt2.rs): batch 1, one token
// per step, fp32, KV cache in device memory. Every kernel reads the step's position (and the token) from the
// `state` word in device memory, so one step's launches are the same every step: a graph of them replays
// without parameter updates, as LLM servers use CUDA graphs.
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

extern "C" {

// x = wte[token] + wpe[pos], token = tokens[pos], pos = state[0].
__global__ void gpt2_embed(const int *state, const int *tokens, const float *wte, const float *wpe, float *x,
                           int d) {
    int pos = state[0];
    int tok = tokens[pos];
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < d; i += gridDim.x * blockDim.x)
        x[i] = wte[(size_t)tok * d + i] + wpe[(size_t)pos * d + i];
}

// y = (x - mean) / sqrt(var + 1e-5) * g + b over d elements; one block.
__global__ void gpt2_layernorm(const float *x, const float *g, const float *b, float *y, int d) {
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

// y[r] = W[r, :] . x + bias[r] (bias may be null), W row-major [rows][cols], cols a multiple of 4; one warp a row.
__global__ void gpt2_matvec(const float *W, const float *bias, const float *x, float *y, int cols, int rows) {
    int warps = blockDim.x / WARP;
    int r = blockIdx.x * warps + threadIdx.x / WARP;
    int lane = threadIdx.x % WARP;
    if (r >= rows) return;
    const float4 *w4 = (const float4 *)(W + (size_t)r * cols);
    const float4 *x4 = (const float4 *)x;
    float acc = 0.0f;
    for (int c = lane; c < cols / 4; c += WARP) {
        float4 a = w4[c], b = x4[c];
        acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
    }
    acc = warp_sum(acc);
    if (lane == 0) y[r] = acc + (bias ? bias[r] : 0.0f);
}

// Causal self-attention of the current position over the cache, one block per head. qkv = [q | k | v], each
// heads * hd long; the current k and v go into the layer's cache at `pos` ([head][ctx][hd]); out is heads * hd.
__global__ void gpt2_attention(const float *qkv, float *kcache, float *vcache, float *out, const int *state,
                               int heads, int hd, int ctx) {
    extern __shared__ float smem[];  // scores[ctx], then q[hd], then partial sums [blockDim.x / hd][hd]
    __shared__ float scratch[32];
    int h = blockIdx.x, pos = state[0], d = heads * hd;
    float *scores = smem, *q = smem + ctx, *part = q + hd;
    float *kc = kcache + (size_t)h * ctx * hd, *vc = vcache + (size_t)h * ctx * hd;
    for (int i = threadIdx.x; i < hd; i += blockDim.x) {
        q[i] = qkv[h * hd + i];
        kc[(size_t)pos * hd + i] = qkv[d + h * hd + i];
        vc[(size_t)pos * hd + i] = qkv[2 * d + h * hd + i];
    }
    __syncthreads();
    float scale = rsqrtf((float)hd), m = -INFINITY;
    for (int t = threadIdx.x; t <= pos; t += blockDim.x) {
        float s = 0.0f;
        for (int i = 0; i < hd; i++) s += q[i] * kc[(size_t)t * hd + i];
        s *= scale;
        scores[t] = s;
        m = fmaxf(m, s);
    }
    m = block_max(m, scratch);
    float sum = 0.0f;
    for (int t = threadIdx.x; t <= pos; t += blockDim.x) {
        float e = __expf(scores[t] - m);
        scores[t] = e;
        sum += e;
    }
    sum = block_sum(sum, scratch);  // its barriers also publish scores[]
    int groups = blockDim.x / hd, g = threadIdx.x / hd, i = threadIdx.x % hd;
    if (g < groups) {
        float acc = 0.0f;
        for (int t = g; t <= pos; t += groups) acc += scores[t] * vc[(size_t)t * hd + i];
        part[g * hd + i] = acc;
    }
    __syncthreads();
    if (threadIdx.x < hd) {
        float acc = 0.0f;
        for (int k = 0; k < groups; k++) acc += part[k * hd + threadIdx.x];
        out[h * hd + threadIdx.x] = acc / sum;
    }
}

// GPT-2's tanh approximation of GELU, in place.
__global__ void gpt2_gelu(float *x, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float v = x[i];
        x[i] = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    }
}

// x += y.
__global__ void gpt2_residual(float *x, const float *y, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] += y[i];
}

// The next step's position.
__global__ void gpt2_advance(int *state) {
    if (threadIdx.x == 0 && blockIdx.x == 0) state[0] += 1;
}

}
