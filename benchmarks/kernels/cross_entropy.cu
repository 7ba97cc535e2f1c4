// Per-row cross-entropy loss: logsumexp(logits) - logits[label]; one block per row.
#include "common.cuh"
extern "C" __global__ void cross_entropy_f32(const float *logits, const int *labels, float *loss, int cols) {
    const float *in = logits + blockIdx.x * cols;
    float m = -3.402823466e38f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, in[c]);
    m = block_reduce_max(m);
    float s = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += expf(in[c] - m);
    s = block_reduce_sum(s);
    if (threadIdx.x == 0) loss[blockIdx.x] = logf(s) + m - in[labels[blockIdx.x]];
}
