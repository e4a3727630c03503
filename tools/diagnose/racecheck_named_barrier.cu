// compute-sanitizer racecheck false positive, reduced from the fused routing kernel (templates/routing/fused.cu.j2):
// warps 0-7 meet on named barrier 1 (256 threads) while warps 8-15 skip it, then a block scan whose store / load
// pair a __syncthreads() orders. No race exists; racecheck reports one whenever nbar > 0. When warps 8-15 meet a
// barrier of their own (bar.sync 2, 256) as many times, it reports nothing: what the routing kernels' idle token
// groups do in their KERNGEN_RACECHECK builds (docs/environment.md; tests/gpu/test_racecheck.py).
//
//   nvcc -arch=sm_90a -lineinfo -o /tmp/nb tools/diagnose/racecheck_named_barrier.cu
//   compute-sanitizer --tool racecheck /tmp/nb
#include <cstdio>
__global__ void k(int* out, int nbar) {
    __shared__ int wtot[17];
    __shared__ int scratch[512];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = threadIdx.x / 256;
    if (g == 0) {
        for (int i = 0; i < nbar; ++i) {
            scratch[threadIdx.x] = i;
            asm volatile("bar.sync 1, 256;" ::: "memory");
            out[threadIdx.x] += scratch[255 - threadIdx.x];
            asm volatile("bar.sync 1, 256;" ::: "memory");
        }
    }
    __syncthreads();
    int inc = threadIdx.x;
    for (int o = 1; o < 32; o <<= 1) { int y = __shfl_up_sync(~0u, inc, o); if (lane >= o) inc += y; }
    if (lane == 31) wtot[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int wv = lane < 16 ? wtot[lane] : 0, wi = wv;
        for (int o = 1; o < 32; o <<= 1) { int y = __shfl_up_sync(~0u, wi, o); if (lane >= o) wi += y; }
        if (lane < 16) wtot[lane] = wi - wv;
        if (lane == 31) wtot[16] = wi;
    }
    __syncthreads();
    out[512 + threadIdx.x] = wtot[warp] + wtot[16];
}
int main() {
    int* d; cudaMalloc(&d, 4096 * 4); cudaMemset(d, 0, 4096 * 4);
    for (int nbar = 0; nbar < 3; ++nbar) { k<<<1, 512>>>(d, nbar); cudaDeviceSynchronize(); printf("nbar=%d done\n", nbar); }
    return 0;
}
