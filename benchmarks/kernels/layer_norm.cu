// LayerNorm over the last dimension with affine weight and bias; one block per row.
#include "common.cuh"
extern "C" __global__ void layer_norm_f32(const float *x, const float *w, const float *b, float *y,
                                          int cols, float eps) {
    const float *in = x + blockIdx.x * cols;
    float *out = y + blockIdx.x * cols;
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += in[c];
    float mean = block_reduce_sum(s) / cols;
    float v = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) { float d = in[c] - mean; v += d * d; }
    float rstd = rsqrtf(block_reduce_sum(v) / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[c] = (in[c] - mean) * rstd * w[c] + b[c];
}
