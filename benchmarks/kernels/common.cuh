// Shared device helpers for the benchmark kernels: warp/block reductions, scans, hashing.
#pragma once

#define FULL_MASK 0xffffffffu
#define WARP_SIZE 32

__device__ __forceinline__ float warp_reduce_sum(float v) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1)
        v += __shfl_xor_sync(FULL_MASK, v, offset);
    return v;
}

__device__ __forceinline__ float warp_reduce_max(float v) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1)
        v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, offset));
    return v;
}

// Warp argmax: the largest value and its lowest index among ties.
__device__ __forceinline__ void warp_argmax(float &v, int &idx) {
#pragma unroll
    for (int offset = WARP_SIZE / 2; offset > 0; offset >>= 1) {
        float ov = __shfl_xor_sync(FULL_MASK, v, offset);
        int oi = __shfl_xor_sync(FULL_MASK, idx, offset);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
}

// Block-wide sum; every thread gets the result. blockDim.x must be a multiple of 32.
__device__ float block_reduce_sum(float v) {
    __shared__ float partial[32];
    int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    v = warp_reduce_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int warps = blockDim.x / WARP_SIZE;
    v = lane < warps ? partial[lane] : 0.0f;
    return warp_reduce_sum(v);
}

__device__ float block_reduce_max(float v) {
    __shared__ float partial[32];
    int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    v = warp_reduce_max(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    int warps = blockDim.x / WARP_SIZE;
    v = lane < warps ? partial[lane] : -3.402823466e38f;
    return warp_reduce_max(v);
}

// Inclusive warp scan with shuffles.
__device__ __forceinline__ int warp_inclusive_scan(int v) {
    int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int offset = 1; offset < WARP_SIZE; offset <<= 1) {
        int n = __shfl_up_sync(FULL_MASK, v, offset);
        if (lane >= offset) v += n;
    }
    return v;
}

// Counter-based hash (deterministic "random" numbers without state).
__device__ __forceinline__ unsigned int hash32(unsigned int x) {
    x ^= x >> 16; x *= 0x7feb352du;
    x ^= x >> 15; x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}
