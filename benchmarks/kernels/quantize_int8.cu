// Per-row symmetric int8 quantization: scale = absmax / 127, q = round(x / scale).
#include "common.cuh"
extern "C" __global__ void quantize_rows_int8(const float *x, signed char *q, float *scales, int cols) {
    const float *in = x + blockIdx.x * cols;
    float amax = 0.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) amax = fmaxf(amax, fabsf(in[c]));
    amax = block_reduce_max(amax);
    float scale = amax > 0.0f ? amax / 127.0f : 1.0f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x)
        q[blockIdx.x * cols + c] = (signed char)max(-127, min(127, __float2int_rn(in[c] / scale)));
    if (threadIdx.x == 0) scales[blockIdx.x] = scale;
}
