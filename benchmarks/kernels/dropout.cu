// Inverted dropout with a counter-based hash: the mask depends only on (seed, index).
#include "common.cuh"
extern "C" __global__ void dropout_hash_f32(const float *x, float *y, unsigned char *mask, int n,
                                            float p, unsigned int seed) {
    float keep_scale = 1.0f / (1.0f - p);
    unsigned int threshold = (unsigned int)(p * 4294967295.0f);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        bool keep = hash32(seed ^ hash32((unsigned int)i)) >= threshold;
        mask[i] = keep;
        y[i] = keep ? x[i] * keep_scale : 0.0f;
    }
}
