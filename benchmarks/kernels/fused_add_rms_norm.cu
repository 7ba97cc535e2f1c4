// residual += x; y = rmsnorm(residual) * w, in one pass over the row.
#include "common.cuh"
extern "C" __global__ void fused_add_rms_norm_f32(const float *x, float *residual, const float *w,
                                                  float *y, int cols, float eps) {
    float *res = residual + blockIdx.x * cols;
    const float *in = x + blockIdx.x * cols;
    float ss = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float r = res[c] + in[c];
        res[c] = r;
        ss += r * r;
    }
    float scale = rsqrtf(block_reduce_sum(ss) / cols + eps);
    for (int c = threadIdx.x; c < cols; c += blockDim.x) y[blockIdx.x * cols + c] = res[c] * scale * w[c];
}
