// Exclusive prefix sum per block built from warp shuffle scans (stream compaction offsets).
#include "common.cuh"
extern "C" __global__ void scan_exclusive_warp_i32(const int *in, int *out, int *block_totals, int n) {
    __shared__ int warp_sums[32];
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    int v = i < n ? in[i] : 0;
    int inclusive = warp_inclusive_scan(v);
    if (lane == WARP_SIZE - 1) warp_sums[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        int s = lane < blockDim.x / WARP_SIZE ? warp_sums[lane] : 0;
        warp_sums[lane] = warp_inclusive_scan(s);
    }
    __syncthreads();
    int base = warp > 0 ? warp_sums[warp - 1] : 0;
    if (i < n) out[i] = base + inclusive - v;
    if (threadIdx.x == blockDim.x - 1) block_totals[blockIdx.x] = base + inclusive;
}
