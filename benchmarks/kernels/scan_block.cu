// Block-wide inclusive prefix sum (Hillis-Steele, double-buffered shared memory), one tile per block.
#define SCAN_TILE 256
extern "C" __global__ void scan_inclusive_block_i32(const int *in, int *out, int n) {
    __shared__ int buf[2][SCAN_TILE];
    int i = blockIdx.x * SCAN_TILE + threadIdx.x;
    int cur = 0;
    buf[cur][threadIdx.x] = i < n ? in[i] : 0;
    __syncthreads();
    for (int offset = 1; offset < SCAN_TILE; offset <<= 1) {
        int v = buf[cur][threadIdx.x];
        if (threadIdx.x >= offset) v += buf[cur][threadIdx.x - offset];
        buf[cur ^ 1][threadIdx.x] = v;
        cur ^= 1;
        __syncthreads();
    }
    if (i < n) out[i] = buf[cur][threadIdx.x];
}
