// Fused bias add + GELU (tanh approximation) over [rows, cols].
#include "activations.cuh"
extern "C" __global__ void gelu_bias_f32(const float *x, const float *bias, float *y, int rows, int cols) {
    int n = rows * cols;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        y[i] = gelu_tanh(x[i] + bias[i % cols]);
}
