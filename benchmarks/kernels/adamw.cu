// Fused AdamW optimizer step over a flat parameter buffer.
extern "C" __global__ void adamw_step_f32(float *param, const float *grad, float *m, float *v, int n,
                                          float lr, float beta1, float beta2, float eps,
                                          float weight_decay, int step) {
    float bc1 = 1.0f - powf(beta1, (float)step), bc2 = 1.0f - powf(beta2, (float)step);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        float g = grad[i];
        float mi = beta1 * m[i] + (1.0f - beta1) * g;
        float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
        m[i] = mi;
        v[i] = vi;
        float p = param[i] * (1.0f - lr * weight_decay);
        param[i] = p - lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
    }
}
