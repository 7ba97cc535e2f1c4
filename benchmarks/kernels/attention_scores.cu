// S = (Q @ K^T) * scale with a causal mask, per head; one thread per score.
extern "C" __global__ void attention_scores_causal_f32(const float *Q, const float *K, float *S,
                                                       int seq, int dim, float scale) {
    int head = blockIdx.z;
    int i = blockIdx.y * blockDim.y + threadIdx.y, j = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= seq || j >= seq) return;
    const float *q = Q + ((long long)head * seq + i) * dim;
    const float *k = K + ((long long)head * seq + j) * dim;
    float acc = 0.0f;
    for (int d = 0; d < dim; ++d) acc = fmaf(q[d], k[d], acc);
    S[((long long)head * seq + i) * seq + j] = j <= i ? acc * scale : -__int_as_float(0x7f800000);
}
