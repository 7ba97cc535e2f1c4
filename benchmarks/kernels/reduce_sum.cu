// Grid-stride sum; each block writes its partial (deterministic, no float atomics).
#include "common.cuh"
extern "C" __global__ void reduce_sum_partials_f32(const float *x, float *partials, int n) {
    float s = 0.0f;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) s += x[i];
    s = block_reduce_sum(s);
    if (threadIdx.x == 0) partials[blockIdx.x] = s;
}
