// Embedding lookup: out[t, :] = table[ids[t], :], one block per token.
extern "C" __global__ void embedding_gather_f32(const float *table, const int *ids, float *out,
                                                int vocab, int dim) {
    int id = ids[blockIdx.x];
    if (id < 0 || id >= vocab) id = 0;
    const float *src = table + (long long)id * dim;
    float *dst = out + (long long)blockIdx.x * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) dst[d] = src[d];
}
