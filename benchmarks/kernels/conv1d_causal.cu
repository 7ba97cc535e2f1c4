// Depthwise causal conv1d (Mamba-style short conv) over [channels, length], kernel width W.
#define W 4
extern "C" __global__ void conv1d_causal_depthwise_f32(const float *x, const float *weight,
                                                       const float *bias, float *y, int channels,
                                                       int length) {
    int ch = blockIdx.y;
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= channels || t >= length) return;
    const float *in = x + (long long)ch * length;
    float acc = bias[ch];
#pragma unroll
    for (int k = 0; k < W; ++k) {
        int src = t - (W - 1) + k;
        if (src >= 0) acc = fmaf(weight[ch * W + k], in[src], acc);
    }
    y[(long long)ch * length + t] = acc;
}
