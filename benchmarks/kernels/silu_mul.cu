// SwiGLU gate: y = silu(gate) * up, with gate and up packed as [rows, 2*cols].
#include "activations.cuh"
extern "C" __global__ void silu_mul_f32(const float *gate_up, float *y, int rows, int cols) {
    int n = rows * cols;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        int r = i / cols, c = i % cols;
        const float *row = gate_up + (long long)r * 2 * cols;
        y[i] = silu(row[c]) * row[cols + c];
    }
}
