// Row softmax, one block per row, numerically stable (subtract the row max).
#include "common.cuh"
extern "C" __global__ void softmax_rows_f32(const float *x, float *y, int cols) {
    const float *in = x + blockIdx.x * cols;
    float *out = y + blockIdx.x * cols;
    float m = -3.402823466e38f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, in[c]);
    m = block_reduce_max(m);
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += __expf(in[c] - m);
    s = block_reduce_sum(s);
    float inv = 1.0f / s;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) out[c] = __expf(in[c] - m) * inv;
}
