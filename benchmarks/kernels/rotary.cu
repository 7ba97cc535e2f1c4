// Rotary position embedding (NeoX half-split layout) applied in place to q[tokens, heads, dim].
extern "C" __global__ void rotary_embedding_f32(float *q, const int *positions, int heads, int dim,
                                                float theta) {
    int token = blockIdx.x, head = blockIdx.y, half = dim / 2;
    float pos = (float)positions[token];
    float *v = q + ((long long)token * heads + head) * dim;
    for (int i = threadIdx.x; i < half; i += blockDim.x) {
        float freq = powf(theta, -2.0f * i / dim);
        float s, c;
        sincosf(pos * freq, &s, &c);
        float a = v[i], b = v[i + half];
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
    }
}
