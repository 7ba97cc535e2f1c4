// y[M] = A[M,K] @ x[K]: one warp per row.
#include "common.cuh"
extern "C" __global__ void gemv_warp_f32(const float *A, const float *x, float *y, int M, int K) {
    int row = blockIdx.x * (blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    int lane = threadIdx.x % WARP_SIZE;
    if (row >= M) return;
    float acc = 0.0f;
    for (int k = lane; k < K; k += WARP_SIZE) acc = fmaf(A[row * K + k], x[k], acc);
    acc = warp_reduce_sum(acc);
    if (lane == 0) y[row] = acc;
}
