// Greedy decoding: argmax over each row of logits, one warp per row.
#include "common.cuh"
extern "C" __global__ void row_argmax_f32(const float *logits, int *out, int rows, int cols) {
    int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= rows) return;
    float best = -3.402823466e38f;
    int idx = 0x7fffffff;
    for (int c = lane; c < cols; c += WARP_SIZE) {
        float v = logits[row * cols + c];
        if (v > best) { best = v; idx = c; }
    }
    warp_argmax(best, idx);
    if (lane == 0) out[row] = idx;
}
