// Top-4 per row (sampling candidates): four rounds of warp argmax, masking each winner.
#include "common.cuh"
#define TOPK 4
#define MAX_COLS 1024
extern "C" __global__ void topk4_rows_f32(const float *x, float *values, int *indices, int cols) {
    __shared__ float row[MAX_COLS];
    const float *in = x + blockIdx.x * cols;
    for (int c = threadIdx.x; c < cols; c += WARP_SIZE) row[c] = in[c];
    __syncwarp();
    for (int k = 0; k < TOPK; ++k) {
        float best = -3.402823466e38f;
        int idx = 0x7fffffff;
        for (int c = threadIdx.x; c < cols; c += WARP_SIZE)
            if (row[c] > best || (row[c] == best && c < idx)) { best = row[c]; idx = c; }
        warp_argmax(best, idx);
        if (threadIdx.x == 0) {
            values[blockIdx.x * TOPK + k] = best;
            indices[blockIdx.x * TOPK + k] = idx;
            row[idx] = -3.402823466e38f;
        }
        __syncwarp();
    }
}
