// kerngen device helpers shared by the CUDA C++ templates (inlined into each rendered source).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

// Programmatic dependent launch (sm_90+). Without the launch attribute both are no-ops.
__device__ __forceinline__ void kg_grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void kg_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// 8 x 16-bit values <-> 8 floats, through one 16-byte vector.
__device__ __forceinline__ void kg_unpack8(const uint4 v, float f[8], __nv_bfloat16) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 t = __bfloat1622float2(h[i]); f[2 * i] = t.x; f[2 * i + 1] = t.y; }
}
__device__ __forceinline__ void kg_unpack8(const uint4 v, float f[8], __half) {
    const __half2* h = reinterpret_cast<const __half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) { float2 t = __half22float2(h[i]); f[2 * i] = t.x; f[2 * i + 1] = t.y; }
}
__device__ __forceinline__ uint4 kg_pack8(const float f[8], __nv_bfloat16) {
    uint4 v; __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    return v;
}
__device__ __forceinline__ uint4 kg_pack8(const float f[8], __half) {
    uint4 v; __half2* h = reinterpret_cast<__half2*>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = __floats2half2_rn(f[2 * i], f[2 * i + 1]);
    return v;
}
// Two 16-bit values <-> two floats (one 32-bit word).
__device__ __forceinline__ float2 kg_unpack2(unsigned u, __nv_bfloat16) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u));
}
__device__ __forceinline__ float2 kg_unpack2(unsigned u, __half) {
    return __half22float2(*reinterpret_cast<const __half2*>(&u));
}
__device__ __forceinline__ unsigned kg_pack2(float a, float b, __nv_bfloat16) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&h);
}
__device__ __forceinline__ unsigned kg_pack2(float a, float b, __half) {
    const __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<const unsigned*>(&h);
}
__device__ __forceinline__ float kg_to_float(float x) { return x; }
__device__ __forceinline__ float kg_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float kg_to_float(__half x) { return __half2float(x); }

// Streaming 16-byte load: expert rows are read once, keep them out of L1.
// A 128-byte line toward L2 (no register, no wait; an asm statement: it stays where it is written).
__device__ __forceinline__ void kg_prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}
__device__ __forceinline__ uint4 kg_ldg_stream(const void* p) {
    return __ldcs(reinterpret_cast<const uint4*>(p));
}

// A read-only load issued where it is written, as a float (an asm statement: the compiler neither sinks it toward
// its use nor into a branch, so it does not wait behind loads issued after it).
__device__ __forceinline__ float kg_ld_now(const float* p) {
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
}
__device__ __forceinline__ float kg_ld_now(const __nv_bfloat16* p) {
    unsigned short v;
    asm volatile("ld.global.nc.b16 %0, [%1];" : "=h"(v) : "l"(p));
    return __uint_as_float((unsigned)v << 16);
}
__device__ __forceinline__ float kg_ld_now(const __half* p) {
    unsigned short v;
    asm volatile("ld.global.nc.b16 %0, [%1];" : "=h"(v) : "l"(p));
    return __half2float(__ushort_as_half(v));
}

// acc += w * x, rounded as a separate multiply and add (no FMA): bitwise equal to an fp32 torch loop.
__device__ __forceinline__ void kg_axpy8(float acc[8], float w, const float x[8]) {
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(w, x[i]));
}

// Thread-block clusters (sm_90+): the CTA's rank in its cluster, a cluster-wide barrier split into its arrive
// and wait halves (release / acquire: shared-memory stores before the arrive are visible after the wait).
__device__ __forceinline__ unsigned kg_cluster_rank() {
    unsigned r = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
#endif
    return r;
}
__device__ __forceinline__ void kg_cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release;" ::: "memory");
#endif
}
__device__ __forceinline__ void kg_cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
#endif
}
// Shared-memory address of the same variable in CTA `cta` of the cluster.
__device__ __forceinline__ unsigned kg_cluster_addr(const void* local, unsigned cta) {
    unsigned remote = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const unsigned mine = (unsigned)__cvta_generic_to_shared(local);
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(mine), "r"(cta));
#endif
    return remote;
}
// *local |= v in the shared memory of CTA `cta` of the cluster (this CTA's own included).
__device__ __forceinline__ void kg_or_remote(unsigned* local, unsigned cta, unsigned v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.shared::cluster.or.b32 [%0], %1;" :: "r"(kg_cluster_addr(local, cta)), "r"(v) : "memory");
#endif
}
// 64 bits as two 32-bit ORs (on the H200 a 64-bit red.shared::cluster.or was seen to lose bits)
__device__ __forceinline__ void kg_or_remote(unsigned long long* local, unsigned cta, unsigned long long v) {
    unsigned* w = reinterpret_cast<unsigned*>(local);
    if ((unsigned)v) kg_or_remote(w, cta, (unsigned)v);
    if ((unsigned)(v >> 32)) kg_or_remote(w + 1, cta, (unsigned)(v >> 32));
}

// Sum of v over lanes 0..lane of the warp (all 32 lanes call it).
__device__ __forceinline__ int kg_warp_inclusive_sum(int v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(~0u, v, o);
        if (lane >= o) v += y;
    }
    return v;
}

// Split-K partial sums of W warps: each warp's R accumulator rows (4 values a lane) added into warp 0's, through
// shared memory; true in warp 0's lanes (which then hold the sums and write the item). Two barriers: the buffer is
// free again when it returns.
template <int W, int R>
__device__ __forceinline__ bool kg_reduce_warps(float (&acc)[R][4]) {
    if (W == 1) return true;
    __shared__ float red[W > 1 ? W - 1 : 1][R][4][32];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (w > 0) {
#pragma unroll
        for (int n = 0; n < R; ++n)
#pragma unroll
            for (int i = 0; i < 4; ++i) red[w - 1][n][i][lane] = acc[n][i];
    }
    __syncthreads();
    if (w == 0) {
#pragma unroll
        for (int v = 0; v < W - 1; ++v)
#pragma unroll
            for (int n = 0; n < R; ++n)
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[n][i] += red[v][n][i][lane];
    }
    __syncthreads();
    return w == 0;
}
