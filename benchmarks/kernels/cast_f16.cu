// float -> half (IEEE binary16 bits) with round-to-nearest-even through inline PTX cvt.
extern "C" __global__ void cast_f32_to_f16(const float *x, unsigned short *y, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x[i]));
        y[i] = h;
    }
}
