// RMSNorm (LLaMA style): y = x / sqrt(mean(x^2) + eps) * w; one block per row.
#include "common.cuh"
extern "C" __global__ void rms_norm_f32(const float *x, const float *w, float *y, int cols, float eps) {
    const float *in = x + blockIdx.x * cols;
    float *out = y + blockIdx.x * cols;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) ss += in[c] * in[c];
    float scale = rsqrtf(block_reduce_sum(ss) / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[c] = in[c] * scale * w[c];
}
