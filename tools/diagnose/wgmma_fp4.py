#!/usr/bin/env python3
"""MXFP4 weights on fp8 wgmma: how fast a decode GEMM streams them when the tensor cores take the weights as e4m3
placed in registers (no widening to f16, no per-pair group factor), against the streaming-read floor.

    python3 -m tools.diagnose.wgmma_fp4 [--rows 23040] [--k 2880] [--tokens 1,4] [--layers 4]
        [--unroll 2,4] [--ctas 4,6] [--loads 32,64]

The experts kernels' MXFP4 step (templates/experts/mma.cu.j2) widens every e2m1 pair to f16 and multiplies it by
its group's factor before an f16 mma.sync: about 6.8 instructions a weight pair, which bounds them near half of
the H200's floor. Here a warpgroup of 4 warps takes an item of 64 weight rows: each thread places its e2m1 bits as
e4m3 bytes (sign and magnitude moved by shifts: 5 integer instructions for 8 values, the values times 2^-6), and
`wgmma.mma_async.m64n8k32.f32.e4m3.e4m3` with A from those registers computes one 32-value group a wgmma into a
fresh accumulator, which one FFMA a value adds to the item's sum times the group's scale (2^(s - 127): one shift;
the 2^6 goes with the token's scale). The activations are B, in shared memory: each token as two e4m3 terms (hi =
e4m3(x / s_t), lo = e4m3(x / s_t - hi), s_t = max|x_t| / 448), a column each, so 4 tokens fill an n8 tile and 8 an
n16 one; inside each group the K order is permuted the same way for A and B (thread q holds bytes 4q .. 4q + 3 of a
group's 16, as values 2p and 2p + 1 at the fragment's k = p and 16 + p). `--loads 32`: each thread loads its 4 bytes of a group and row (LDG.32); `--loads 64`: 8 bytes
(half a group) and one shuffle with the lane beside it gives each its 4 bytes of two groups; `--loads 128`: each warp
copies its rows' steps by 16-byte cp.async into a ring of `--unroll` slots in shared memory (no registers held by
the bytes in flight), ldmatrix hands each thread its words of two groups and two rows at once, and the item's
scales come into shared memory once an item.

Each configuration is checked against an fp32 reference that dequantizes the weights itself (relative error
printed), then timed in a CUDA graph after a producer kernel with `--layers` copies cycled, and printed as µs and %
of the floor (weight + scale bytes at tools.bench's streaming-read bandwidth). Needs a GPU with sm_90a (Hopper);
`source(...)` renders anywhere and compiles with NVRTC on a machine without one.
"""
from __future__ import annotations

import argparse
import itertools

from .probe import floor_us, ints, measure, start, two_terms

SRC = r"""
struct P {
    const unsigned* w;          // [rows, KB] e2m1 pairs, as words
    const unsigned char* s;     // [rows, G] e8m0 group scales
    const unsigned char* b;     // B: [2G core matrices][8 columns][16 bytes] e4m3 (the activation terms)
    const float* xs;            // [8] token scales s_t, times 2^6 (the placed weights' factor)
    float* y;                   // [tokens, rows]
    long long rows;
    int tokens;
};
constexpr int KB = {{ k_bytes }};          // bytes a weight row (K / 2)
constexpr int G = KB / 16;                 // groups a row
constexpr int KW = KB / 4;                 // words a row
constexpr int GPS = {{ gps }};             // groups a step
constexpr int UNROLL = {{ unroll }};       // steps whose loads are in flight
constexpr int LOADW = {{ loads }};         // bits a weight load (32 or 64)
constexpr int SPLIT = {{ split }};         // warpgroups sharing an item (1: an item each)
constexpr int NCOL = {{ ncol }};           // B's columns: two terms a token (8: up to 4 tokens, 16: up to 8)
constexpr int ND = NCOL / 2;               // a thread's sums of an m64nNCOL tile
constexpr int GB = NCOL * 32;              // B's bytes a group (2 core matrices along K, NCOL / 8 along N)
static_assert(NCOL == 8 || NCOL == 16, "B's columns: 8 or 16");
constexpr int STEPS = G / GPS;
static_assert(G % GPS == 0, "groups a step: a divisor of the groups a row");
static_assert(GPS % 2 == 0 || LOADW == 32, "64- and 128-bit loads: an even number of groups a step");
constexpr int STAGE = 16 * GPS * 16;       // LOADW 128: a warp's ring slot, [GPS groups][16 rows][16 bytes]

__device__ __forceinline__ void wgmma_fresh(float d[ND], const unsigned a[4], unsigned desc_lo, unsigned desc_hi) {
#if {{ ncol }} == 8
    asm volatile("{\n.reg .pred p;\n.reg .b64 desc;\nsetp.ne.b32 p, 0, 0;\nmov.b64 desc, {%8, %9};\n"
                 "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0, %1, %2, %3}, {%4, %5, %6, %7}, desc, p, 1, 1;\n}\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(desc_lo), "r"(desc_hi));
#else
    asm volatile("{\n.reg .pred p;\n.reg .b64 desc;\nsetp.ne.b32 p, 0, 0;\nmov.b64 desc, {%12, %13};\n"
                 "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, "
                 "{%8, %9, %10, %11}, desc, p, 1, 1;\n}\n"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3]), "=f"(d[4]), "=f"(d[5]), "=f"(d[6]), "=f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(desc_lo), "r"(desc_hi));
#endif
}

__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// e2m1 pairs (a word: bytes b0..b3, each low nibble first) -> e4m3 bytes (value x 2^-6): lo = the low nibbles,
// hi = the high ones, byte b of each from byte b of the word.
__device__ __forceinline__ void place(unsigned w, unsigned& lo, unsigned& hi) {
    lo = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu);
    hi = (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu);
}

struct Step { unsigned w[2][GPS]; unsigned s[2][GPS]; };

// Step `step`'s loads (the caller clamps a step past its last to the last: those registers go unused). LOADW 128:
// the warp's 16 rows x GPS groups into ring slot `slot` by 16-byte cp.async, one commit group a step (none copied
// where `copy` is false: a step past the last), rows from `wrows` (the warp's first row).
__device__ __forceinline__ void load_step(const unsigned* r0, const unsigned* r1, const unsigned char* s0,
                                          const unsigned char* s1, int step, Step& st, const unsigned char* wrows,
                                          unsigned slot, bool copy) {
    const int lane = threadIdx.x & 31, q = lane & 3;
    const int g0 = step * GPS;
    if (LOADW == 128) {
#pragma unroll
        for (int i = 0; i < GPS / 2; ++i) {   // chunk c = lane + 32 i: row c / GPS, group c % GPS of the step
            const int c = lane + 32 * i, r = c / GPS, jj = c % GPS;
            const unsigned char* src = wrows + (long long)r * KB + (g0 + jj) * 16;
            const unsigned dst = slot + (jj * 16 + r) * 16;
            if (copy) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    }
#pragma unroll
    for (int j = 0; j < GPS; ++j) {
        if (LOADW == 128) {
        } else if (LOADW == 32) {
            st.w[0][j] = __ldcs(r0 + (g0 + j) * 4 + q);
            st.w[1][j] = __ldcs(r1 + (g0 + j) * 4 + q);
        } else if (j % 2 == 0) {
            // lane q loads words 2 (q >> 1), +1 of group g0 + j + (q & 1); use_step swaps one with lane q ^ 1
            const int o = (g0 + j + (q & 1)) * 4 + 2 * (q >> 1);
            const uint2 v0 = __ldcs(reinterpret_cast<const uint2*>(r0 + o));
            const uint2 v1 = __ldcs(reinterpret_cast<const uint2*>(r1 + o));
            st.w[0][j] = v0.x; st.w[0][j + 1] = v0.y;
            st.w[1][j] = v1.x; st.w[1][j + 1] = v1.y;
        }
        if (LOADW != 128) {   // (LOADW 128: the item's scales are in shared memory)
            st.s[0][j] = __ldcs(s0 + g0 + j);
            st.s[1][j] = __ldcs(s1 + g0 + j);
        }
    }
}

struct Pend { float d[GPS][ND]; float sc[2][GPS]; };   // a step's wgmmas in flight and its scales

// Place step `step`'s weights, issue its GPS wgmmas (a fresh sum a group) and commit them as one group.
__device__ __forceinline__ void issue_step(const Step& st, int step, unsigned desc_lo, unsigned desc_hi, Pend& pd,
                                           unsigned slot, const unsigned char* scs) {
    const int lane = threadIdx.x & 31, q = lane & 3;
    unsigned a[GPS][4];
    unsigned wd[2][GPS];   // word q of each group of the step, rows g and g + 8
    if (LOADW == 128) {    // this step's slot complete (UNROLL - 1 newer copies may fly), seen by the whole warp
        asm volatile("cp.async.wait_group %0;" :: "n"(UNROLL - 1) : "memory");
        __syncwarp();
    }
#pragma unroll
    for (int j = 0; j < GPS; ++j) {
        if (LOADW == 128) {
            if (j % 2 == 0) {   // matrices (rows 0-7, j), (8-15, j), (0-7, j + 1), (8-15, j + 1): lane (g, q) gets
                                // bytes 4q .. 4q + 3 of its row of each, word q of the groups
                const int m = lane >> 3, row = (m & 1) * 8 + (lane & 7), jj = j + (m >> 1);
                const unsigned addr = slot + (jj * 16 + row) * 16;
                asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                             : "=r"(wd[0][j]), "=r"(wd[1][j]), "=r"(wd[0][j + 1]), "=r"(wd[1][j + 1]) : "r"(addr)
                             : "memory");
            }
        } else if (LOADW == 32) {
            wd[0][j] = st.w[0][j];
            wd[1][j] = st.w[1][j];
        } else if (j % 2 == 0) {
            // an even lane holds (word q of group j, word q + 1 of it), an odd one (word q - 1, word q) of group
            // j + 1: each sends the word the other wants
            const bool even = (q & 1) == 0;
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const unsigned got = __shfl_xor_sync(~0u, even ? st.w[r][j + 1] : st.w[r][j], 1);
                wd[r][j] = even ? st.w[r][j] : got;
                wd[r][j + 1] = even ? got : st.w[r][j + 1];
            }
        }
    }
#pragma unroll
    for (int j = 0; j < GPS; ++j) {
        place(wd[0][j], a[j][0], a[j][2]);
        place(wd[1][j], a[j][1], a[j][3]);
        // 2^(s - 127) (the placement's 2^6: in xs); LOADW 128: the scale bytes of rows g and g + 8 of this warp's 16
        // from the item's scales in shared memory
        const unsigned s0 = LOADW == 128 ? scs[((threadIdx.x >> 5 & 3) * 16 + (lane >> 2)) * G + step * GPS + j]
                                         : st.s[0][j];
        const unsigned s1 = LOADW == 128 ? scs[((threadIdx.x >> 5 & 3) * 16 + (lane >> 2) + 8) * G + step * GPS + j]
                                         : st.s[1][j];
        pd.sc[0][j] = __uint_as_float(s0 << 23);
        pd.sc[1][j] = __uint_as_float(s1 << 23);
    }
    if (LOADW == 128) __syncwarp();   // every lane's reads of the slot done before it is filled again
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int j = 0; j < GPS; ++j)   // group step * GPS + j: its core matrices at GB (j + step GPS) bytes
        wgmma_fresh(pd.d[j], a[j], desc_lo + (unsigned)((step * GPS + j) * (GB / 16)), desc_hi);
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// A step whose wgmmas are complete: its sums times their scales into acc.
__device__ __forceinline__ void finish_step(Pend& pd, float acc[ND]) {
#pragma unroll
    for (int j = 0; j < GPS; ++j) {
#pragma unroll
        for (int i = 0; i < ND; ++i) {   // d[4c + i]: row g (i < 2) or g + 8, column 8c + 2q + (i & 1)
            fence_operand(pd.d[j][i]);
            acc[i] = fmaf(pd.d[j][i], pd.sc[(i >> 1) & 1][j], acc[i]);
        }
    }
}

__device__ __forceinline__ void wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

extern "C" __global__ void __launch_bounds__({{ 128 * wg }}) wgmma_fp4(const __grid_constant__ P p) {
    extern __shared__ __align__(128) unsigned char smem[];   // B of each warpgroup: 2G core matrices of 8 x 16 bytes
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, w = (threadIdx.x >> 5) & 3;
    const int wg = threadIdx.x >> 7, wgs = blockDim.x >> 7;
    const long long items = p.rows / 64;
    // B's descriptor (no swizzle): start address / 16; K-adjacent core matrices NCOL * 16 bytes apart (the leading
    // offset), N-adjacent ones 128 (the stride offset): a group's B is [2 along K][NCOL / 8 along N][8][16 bytes]
    unsigned char* bs = smem + wg * (G * GB);
    const unsigned ring_s = (unsigned)__cvta_generic_to_shared(smem + (blockDim.x >> 7) * (G * GB))
                          + (threadIdx.x >> 5) * (UNROLL * STAGE);   // LOADW 128: this warp's ring
    unsigned char* scs = smem + (blockDim.x >> 7) * (G * GB + 4 * UNROLL * STAGE) + wg * (64 * G);   // its scales
    const unsigned desc_lo = (((unsigned)__cvta_generic_to_shared(bs) >> 4) & 0x3FFF) | ((NCOL * 16 >> 4) << 16);
    const unsigned desc_hi = 128 >> 4;
    // SPLIT: the CTA's warpgroups share an item, each a contiguous share of its steps (else an item each)
    const int k0 = SPLIT > 1 ? wg * STEPS / SPLIT : 0, k1 = SPLIT > 1 ? (wg + 1) * STEPS / SPLIT : STEPS;
    const int n = k1 - k0;
    bool staged = false;   // this warpgroup's B (its steps' groups) copied into its shared memory
    const long long first = SPLIT > 1 ? blockIdx.x : (long long)blockIdx.x * wgs + wg;
    const long long stride = SPLIT > 1 ? gridDim.x : (long long)gridDim.x * wgs;
    for (long long item = first; item < items; item += stride) {
        const long long row0 = item * 64 + w * 16 + g, row1 = row0 + 8;
        const unsigned* r0 = p.w + row0 * KW;
        const unsigned* r1 = p.w + row1 * KW;
        const unsigned char* s0 = p.s + row0 * G;
        const unsigned char* s1 = p.s + row1 * G;
        const unsigned char* wrows = reinterpret_cast<const unsigned char*>(p.w) + (item * 64 + w * 16) * KB;
        float acc[ND];
#pragma unroll
        for (int i = 0; i < ND; ++i) acc[i] = 0.f;
        Step ring[UNROLL];
        Pend pend;   // (a step's sums taken while the next step's wgmmas run: ptxas serializes the wgmmas, C7513/C7514)
        if (LOADW == 128) {   // the item's 64 x G scale bytes (contiguous) into this warpgroup's, one commit group
            const unsigned dst = (unsigned)__cvta_generic_to_shared(scs);
            for (int i = threadIdx.x & 127; i < 64 * G / 16; i += 128)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                             :: "r"(dst + i * 16), "l"(p.s + item * 64 * G + i * 16) : "memory");
            asm volatile("cp.async.commit_group;" ::: "memory");
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            load_step(r0, r1, s0, s1, k0 + min(u, n - 1), ring[u], wrows, ring_s + u * STAGE, u < n);
        if (!staged) {   // B once, after the first weight loads are on their way; a barrier of the warpgroup
            for (int i = (threadIdx.x & 127) + k0 * GPS * (GB / 16); i < k1 * GPS * (GB / 16); i += 128)
                reinterpret_cast<uint4*>(bs)[i] = reinterpret_cast<const uint4*>(p.b)[i];
            asm volatile("bar.sync %0, 128;" :: "r"(1 + wg) : "memory");
            staged = true;
        }
        if (LOADW == 128) {   // the scales' group (the oldest) complete, every warp's copies seen
            asm volatile("cp.async.wait_group %0;" :: "n"(UNROLL) : "memory");
            asm volatile("bar.sync %0, 128;" :: "r"(1 + wg) : "memory");
        }
        for (int s = 0; s < n; s += UNROLL) {
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                if (s + u < n) {   // (uniform over the warpgroup)
                    issue_step(ring[u], k0 + s + u, desc_lo, desc_hi, pend, ring_s + u * STAGE, scs);
                    wait_all();
                    finish_step(pend, acc);
                }
                load_step(r0, r1, s0, s1, k0 + min(s + u + UNROLL, n - 1), ring[u], wrows, ring_s + u * STAGE,
                          s + u + UNROLL < n);
            }
        }
        if (LOADW == 128)   // every warp done with the item's scales before the next item's replace them
            asm volatile("bar.sync %0, 128;" :: "r"(1 + wg) : "memory");
        if (SPLIT > 1) {   // the other warpgroups' sums into warpgroup 0's
            __shared__ float red[SPLIT > 1 ? SPLIT - 1 : 1][128][ND];
            if (wg > 0)
#pragma unroll
                for (int i = 0; i < ND; ++i) red[wg - 1][threadIdx.x & 127][i] = acc[i];
            __syncthreads();
            if (wg == 0)
#pragma unroll
                for (int c = 0; c < SPLIT - 1; ++c)
#pragma unroll
                    for (int i = 0; i < ND; ++i) acc[i] += red[c][threadIdx.x][i];
            __syncthreads();
        }
        if (wg == 0 || SPLIT == 1) {
#pragma unroll
            for (int c = 0; c < NCOL / 8; ++c) {   // columns 8c + 2q, +1: token 4c + q's two terms
                const int t = 4 * c + q;
                if (t < p.tokens) {
                    const float f = p.xs[t];
                    p.y[(long long)t * p.rows + row0] = (acc[4 * c] + acc[4 * c + 1]) * f;
                    p.y[(long long)t * p.rows + row1] = (acc[4 * c + 2] + acc[4 * c + 3]) * f;
                }
            }
        }
    }
}
"""


def source(k_bytes: int, unroll: int, loads: int, gps: int = 4, wg: int = 1, split: bool = False,
           ncol: int = 8) -> str:
    """The CUDA C++ of one configuration: rows of `k_bytes` bytes (K / 2), `unroll` steps of `gps` groups in flight,
    `loads` bits a weight load, `wg` warpgroups a CTA (`split`: sharing each item's steps), B of `ncol` columns
    (8: up to 4 tokens, 16: up to 8)."""
    if k_bytes % 16:
        raise ValueError(f"K / 2 = {k_bytes}: a whole number of 32-value groups (16 bytes) expected")
    if loads not in (32, 64, 128):
        raise ValueError(f"--loads: 32, 64 or 128, got {loads}")
    out = SRC
    for name, value in (("k_bytes", k_bytes), ("unroll", unroll), ("loads", loads), ("gps", gps),
                        ("128 * wg", 128 * wg), ("split", wg if split else 1), ("ncol", ncol)):
        out = out.replace("{{ %s }}" % name, str(value))
    return out


def columns(tokens: int) -> int:
    """B's columns for `tokens` tokens (two terms each): 8 up to 4 tokens, 16 up to 8."""
    if not 1 <= tokens <= 8:
        raise ValueError(f"tokens: 1 to 8 (two terms a token in an n16 tile at most), got {tokens}")
    return 8 if tokens <= 4 else 16


def b_operand(x, torch):
    """x [T <= 8, K] bf16 -> (B bytes in the kernel's shared-memory layout for columns(T) columns, s_t [8] fp32
    times 2^6, the terms' value)."""
    t, k = x.shape
    hi, lo, s = two_terms(x, torch)
    n = columns(t)
    cols = torch.zeros(n, k, dtype=torch.uint8, device=x.device)
    cols[0:2 * t:2] = hi.view(torch.uint8)
    cols[1:2 * t:2] = lo.view(torch.uint8)
    # inside each group of 32: fragment k = p holds value 2p (p < 16) or 2 (p - 16) + 1
    p = torch.arange(32, device=x.device)
    src = torch.where(p < 16, 2 * p, 2 * (p - 16) + 1)
    perm = (torch.arange(k // 32, device=x.device)[:, None] * 32 + src[None, :]).reshape(-1)
    cols = cols[:, perm]
    # a group's bytes: [2 core matrices along K][n / 8 along N][8 columns][16 bytes]
    b = cols.reshape(n // 8, 8, k // 16, 16).permute(2, 0, 1, 3).contiguous().reshape(-1)
    xs = torch.zeros(8, dtype=torch.float32, device=x.device)
    xs[:t] = s * 64.0   # (the placed e4m3 weights are the e2m1 values times 2^-6)
    approx = (hi.float() + lo.float()) * s[:, None]
    return b, xs, approx


def dequant(w, s, torch):
    """e2m1 pairs [rows, K / 2] (low nibble first) and e8m0 scales [rows, K / 32] -> fp32 [rows, K]."""
    lut = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       device=w.device)
    v = torch.stack([lut[(w & 15).long()], lut[(w >> 4).long()]], dim=-1).reshape(w.shape[0], -1)
    return v * torch.exp2(s.float() - 127).repeat_interleave(32, dim=1)


def emulate(w, s, x, torch):
    """The kernel's arithmetic on the CPU, from its own layouts: each group's words placed as e4m3 by the kernel's bit
    operations and set at the fragment's k positions, B read back from b_operand()'s shared-memory bytes, a fresh
    fp32 sum a group times its scale, the two terms added and times the token's scale. w [rows, K / 2] uint8, s [rows,
    K / 32] uint8, x [T, K] bf16 -> [T, rows] fp32."""
    rows, kb = w.shape
    groups = kb // 16
    words = w.contiguous().view(torch.int32).long() & 0xFFFFFFFF            # [rows, KB / 4], little-endian
    lo = ((words << 4) & 0x80808080) | ((words << 2) & 0x1C1C1C1C)
    hi = (words & 0x80808080) | ((words >> 2) & 0x1C1C1C1C)

    def e4m3(v):   # [..., n] words -> [..., 4n] e4m3 values (byte 0 first)
        b = torch.stack([(v >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)
        return b.view(torch.float8_e4m3fn).float().reshape(*v.shape[:-1], -1)

    lo_v = e4m3(lo.reshape(rows, groups, 4, 1)).reshape(rows, groups, 4, 4)   # [row, group, q, byte]
    hi_v = e4m3(hi.reshape(rows, groups, 4, 1)).reshape(rows, groups, 4, 4)
    a = torch.cat([lo_v.reshape(rows, groups, 16), hi_v.reshape(rows, groups, 16)], dim=2)   # k = 4q + b, 16 + 4q + b
    b, xs, _ = b_operand(x, torch)
    n = columns(x.shape[0])
    bm = b.reshape(groups, 2, n // 8, 8, 16).view(torch.float8_e4m3fn).float()            # [group, k core, n core, col, byte]
    bm = bm.permute(2, 3, 0, 1, 4).reshape(n, groups, 32)                                 # [col, group, k]
    d = torch.einsum("rgk,cgk->rcg", a, bm)                                                # fresh sums a group
    acc = (d * torch.exp2(s.float() - 127)[:, None, :]).sum(dim=2)                         # [rows, col]
    t = x.shape[0]
    return ((acc[:, 0:2 * t:2] + acc[:, 1:2 * t:2]) * xs[:t]).T



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4 * 5760, help="weight rows in all (a multiple of 64)")
    ap.add_argument("--k", type=int, default=2880, help="K, values a row (a multiple of 32)")
    ap.add_argument("--tokens", default="1,4")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--unroll", default="2,4")
    ap.add_argument("--ctas", default="4,6", help="CTAs an SM")
    ap.add_argument("--loads", default="32,64")
    ap.add_argument("--gps", default="6", help="groups a step: divisors of the K / 32 groups a row (2880: 2, 6, 10)")
    ap.add_argument("--wg", default="1", help="warpgroups a CTA")
    ap.add_argument("--split", default="0", help="1: a CTA's warpgroups share each item's steps (0: an item each)")
    a = ap.parse_args(argv)
    if a.rows % 64 or a.k % 32:
        ap.error("--rows must be a multiple of 64 and --k of 32")
    if any(a.k // 32 % gps for gps in ints(a.gps)):
        ap.error(f"--gps: divisors of the {a.k // 32} groups a row of --k {a.k}")
    torch, producer, g = start("python3 -m tools.diagnose.wgmma_fp4")
    kb = a.k // 2
    layers = [(torch.randint(0, 256, (a.rows, kb), dtype=torch.uint8, device="cuda", generator=g),
               torch.randint(118, 128, (a.rows, a.k // 32), dtype=torch.uint8, device="cuda", generator=g))
              for _ in range(a.layers)]
    nbytes = a.rows * (kb + a.k // 32)
    floor = floor_us("MXFP4", a.rows, a.k, nbytes, a.layers)
    ref_w = dequant(layers[0][0], layers[0][1], torch)
    for tokens in ints(a.tokens):
        if not 1 <= tokens <= 8:
            ap.error("--tokens: 1 to 8 (two terms a token: an n8 tile to 4 tokens, n16 to 8)")
        x = torch.randn(tokens, a.k, device="cuda", generator=g).to(torch.bfloat16)
        b, xs, approx = b_operand(x, torch)
        ref = x.float() @ ref_w.T
        y = torch.zeros(8, a.rows, dtype=torch.float32, device="cuda")
        ncol = columns(tokens)
        for unroll, ctas, loads, gps, wg, split in itertools.product(
                ints(a.unroll), ints(a.ctas), ints(a.loads), ints(a.gps), ints(a.wg), ints(a.split)):
            if split and wg == 1:
                continue
            tag = (f"T {tokens}  unroll {unroll}  {ctas} CTAs of {wg} warpgroups an SM{' (split)' if split else ''}"
                   f"  loads {loads}  gps {gps}")
            smem = wg * (kb // 16 * 32 * ncol)   # B; with 128-bit loads each warp's ring and the item's scales
            if loads == 128:
                smem += wg * (4 * unroll * 256 * gps + 64 * (kb // 16))
            measure(tag, source(kb, unroll, loads, gps, wg, bool(split), ncol), "wgmma_fp4", ctas, 128 * wg, smem,
                    layers, b, xs, y, tokens, ref, floor, producer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
