#!/usr/bin/env python3
"""fp8 block-scaled weights on shared-memory wgmma: how fast a decode GEMM streams them when neither operand passes
through registers (the weights e4m3 as they are stored, by cp.async into a ring of shared-memory slots), against the
streaming-read floor, for 1 to 32 tokens on one weight matrix (one expert's rows, as a tile of tokens sees them).

    python3 -m tools.diagnose.wgmma_fp8 [--rows 4096] [--k 7168] [--tokens 1,8,16,32] [--layers 4]
        [--stages 3,4,6] [--ctas 1,2]

The experts kernels' fp8 step (templates/experts/mma.cu.j2) widens each weight pair to f16 for mma.sync, with up to 16
tokens a tile: more tokens an expert read its weights again. Here a warpgroup takes an item of 64 weight rows; each
128-wide K block of them (8 KiB, one scale of the checkpoint's 128 x 128 blocks) and of the activations goes by
16-byte cp.async into one of `--stages` slots, and `wgmma.mma_async.m64nNk32.f32.e4m3.e4m3` reads both from shared
memory (no swizzle: core matrices of 8 rows x 16 bytes) into a fresh sum a block, which one FFMA a value adds times
the block's scale. The activations are two e4m3 terms a token (hi = e4m3(x / s_t), lo = e4m3(x / s_t - hi), s_t =
max|x_t| / 448), a column each: N = 2T rounded up to 8 (at most 64). Each configuration is checked against an fp32
reference that dequantizes the weights itself (relative error printed), then timed in a CUDA graph after a producer
kernel with `--layers` copies cycled, as µs and % of the floor (weight + scale bytes at tools.bench's streaming-read
bandwidth). Needs a GPU with sm_90a; `source(...)` renders and compiles with NVRTC anywhere.
"""
from __future__ import annotations

import argparse
import itertools

from .probe import floor_us, ints, measure, start, two_terms

SRC = r"""
struct P {
    const unsigned char* w;     // [rows, K] e4m3
    const float* ws;            // [rows / 128, K / 128] block scales
    const unsigned char* b;     // B: [K / 128 blocks][8 chunks][NCOL columns][16 bytes] e4m3 (the activation terms)
    const float* xs;            // [NCOL / 2] token scales s_t
    float* y;                   // [tokens, rows]
    long long rows;
    int tokens;
};
constexpr int K = $K;                      // values a row (a multiple of 128)
constexpr int KB = K / 128;                // scale blocks along K
constexpr int NCOL = $NCOL;                // B's columns (two terms a token)
constexpr int ND = NCOL / 2;               // a thread's sums of an m64nNCOL tile
constexpr int STAGES = $STAGES;            // ring slots (K blocks in flight)
constexpr int A_BYTES = 64 * 128;          // a slot's weights: [8 chunks][64 rows][16 bytes]
constexpr int B_BYTES = NCOL * 128;        // a slot's activations: [8 chunks][NCOL][16 bytes]
constexpr int SLOT = A_BYTES + B_BYTES;
static_assert(K % 128 == 0, "K: a multiple of 128");
static_assert(NCOL % 8 == 0 && NCOL >= 8 && NCOL <= 64, "B's columns: 8 to 64, a multiple of 8");
static_assert(STAGES >= 2, "at least two slots");

__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// A K-major, no-swizzle operand at shared address `a`: core matrices 16 bytes apart along K by `lbo`, 8 rows apart
// by `sbo`.
__device__ __forceinline__ unsigned long long desc(unsigned a, unsigned lbo, unsigned sbo) {
    if ($SWAP) { const unsigned t = lbo; lbo = sbo; sbo = t; }   // --swap: the two offsets' fields exchanged
    return (unsigned long long)((a >> 4) & 0x3FFF) | (unsigned long long)((lbo >> 4) & 0x3FFF) << 16
         | (unsigned long long)((sbo >> 4) & 0x3FFF) << 32;
}

// d = A B (a fresh sum: d is written only)
__device__ __forceinline__ void wgmma_fresh(float d[ND], unsigned long long da, unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n$NCOLk32.f32.e4m3.e4m3 {$DREGS}, %$DA, %$DB, p, 1, 1;\n}\n"
                 : $DOUTS
                 : "l"(da), "l"(db));
}

// d += A B (d read and written)
__device__ __forceinline__ void wgmma_acc(float d[ND], unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n$NCOLk32.f32.e4m3.e4m3 {$DREGS}, %$DA, %$DB, 1, 1, 1;\n"
                 : $DINOUTS
                 : "l"(da), "l"(db));
}

__device__ __forceinline__ void cp16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}

// K block `kb` of the item's 64 rows and of B into slot `s` (one commit group; none copied past the last block).
__device__ __forceinline__ void load_block(const P& p, const unsigned char* rows, unsigned s, int kb) {
    const int t = threadIdx.x & 127;
    if (kb < KB) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {   // chunk c of row r: consecutive threads, consecutive rows of one chunk
            const int c = 2 * j + (t >> 6), r = t & 63;
            cp16(s + c * 1024 + r * 16, rows + (long long)r * K + kb * 128 + c * 16);
        }
        for (int i = t; i < 8 * NCOL; i += 128)
            cp16(s + A_BYTES + i * 16, p.b + ((long long)kb * 8 * NCOL + i) * 16);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

extern "C" __global__ void __launch_bounds__(128) wgmma_fp8(const __grid_constant__ P p) {
    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned ring = (unsigned)__cvta_generic_to_shared(smem);
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, w = threadIdx.x >> 5;
    const long long items = p.rows / 64;
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const unsigned char* rows = p.w + item * 64 * K;
        const float* ws = p.ws + (item * 64 / 128) * KB;
        float acc[ND];
#pragma unroll
        for (int i = 0; i < ND; ++i) acc[i] = 0.f;
#pragma unroll
        for (int kb = 0; kb < STAGES - 1; ++kb) load_block(p, rows, ring + kb * SLOT, kb);
        for (int kb = 0; kb < KB; ++kb) {
            asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2) : "memory");
            __syncthreads();   // block kb in every thread's view; every warp done with block kb - 1's slot
            load_block(p, rows, ring + ((kb + STAGES - 1) % STAGES) * SLOT, kb + STAGES - 1);
            const unsigned s = ring + (kb % STAGES) * SLOT;
            const float f = __ldg(ws + kb);
            float d[ND];
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {   // k32 kk: chunks 2kk, 2kk + 1
                const unsigned long long da = desc(s + 2 * kk * 1024, 1024, 128);
                const unsigned long long db = desc(s + A_BYTES + 2 * kk * NCOL * 16, NCOL * 16, 128);
                if (kk == 0) wgmma_fresh(d, da, db);
                else wgmma_acc(d, da, db);
            }
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
            for (int i = 0; i < ND; ++i) {
                fence_operand(d[i]);
                acc[i] = fmaf(d[i], f, acc[i]);
            }
        }
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();   // the ring free for the next item
        const long long row0 = item * 64 + w * 16 + g, row1 = row0 + 8;
#pragma unroll
        for (int c = 0; c < NCOL / 8; ++c) {   // d[4c + i]: columns 8c + 2q, +1 (token 4c + q's two terms)
            const int t = 4 * c + q;
            if (t < p.tokens) {
                const float s_t = p.xs[t];
                p.y[(long long)t * p.rows + row0] = (acc[4 * c] + acc[4 * c + 1]) * s_t;
                p.y[(long long)t * p.rows + row1] = (acc[4 * c + 2] + acc[4 * c + 3]) * s_t;
            }
        }
    }
}
"""


def columns(tokens: int) -> int:
    """B's columns for `tokens` tokens (two terms each), a multiple of 8, at most 64."""
    if not 1 <= tokens <= 32:
        raise ValueError(f"tokens: 1 to 32 (two terms a token in an n64 tile at most), got {tokens}")
    return -(-2 * tokens // 8) * 8


def source(k: int, ncol: int, stages: int, swap: bool = False) -> str:
    """The CUDA C++ of one configuration: rows of `k` e4m3 values, B of `ncol` columns, `stages` ring slots (`swap`:
    the descriptors' leading and stride offsets exchanged, a check of their reading)."""
    if k % 128:
        raise ValueError(f"K = {k}: a whole number of 128-wide scale blocks expected")
    if ncol % 8 or not 8 <= ncol <= 64:
        raise ValueError(f"B's columns: 8 to 64, a multiple of 8, got {ncol}")
    nd = ncol // 2
    out = SRC
    for name, value in (("$DREGS", ", ".join(f"%{i}" for i in range(nd))),
                        ("$DOUTS", ", ".join(f'"=f"(d[{i}])' for i in range(nd))),
                        ("$DINOUTS", ", ".join(f'"+f"(d[{i}])' for i in range(nd))),
                        ("$DA", str(nd)), ("$DB", str(nd + 1)),
                        ("$NCOL", str(ncol)), ("$K", str(k)), ("$STAGES", str(stages)),
                        ("$SWAP", str(int(swap)))):
        out = out.replace(name, value)
    return out


def b_operand(x, torch):
    """x [T, K] bf16 -> (B bytes in the kernel's layout, s_t [NCOL / 2] fp32, the terms' value)."""
    t, k = x.shape
    n = columns(t)
    hi, lo, s = two_terms(x, torch)
    cols = torch.zeros(n, k, dtype=torch.uint8, device=x.device)
    cols[0:2 * t:2] = hi.view(torch.uint8)
    cols[1:2 * t:2] = lo.view(torch.uint8)
    b = cols.reshape(n, k // 16, 16).permute(1, 0, 2).contiguous().reshape(-1)   # [chunk][column][16]
    xs = torch.zeros(n // 2, dtype=torch.float32, device=x.device)
    xs[:t] = s
    return b, xs, (hi.float() + lo.float()) * s[:, None]


def dequant(w, ws, torch):
    """e4m3 weights [rows, K] (as uint8) and block scales [rows / 128, K / 128] -> fp32 [rows, K]."""
    return w.view(torch.float8_e4m3fn).float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)


def emulate(w, ws, x, torch):
    """The kernel's arithmetic on the CPU from its layouts: B read back from b_operand()'s bytes, a fresh fp32 sum a
    K block times its scale, the two terms added and times the token's scale. -> [T, rows] fp32."""
    rows, k = w.shape
    b, xs, _ = b_operand(x, torch)
    n = columns(x.shape[0])
    bm = b.reshape(k // 16, n, 16).view(torch.float8_e4m3fn).float().permute(1, 0, 2).reshape(n, k)
    a = w.view(torch.float8_e4m3fn).float()
    d = torch.einsum("rbk,cbk->rcb", a.reshape(rows, k // 128, 128), bm.reshape(n, k // 128, 128))
    acc = (d * ws.repeat_interleave(128, 0)[:, None, :]).sum(dim=2)
    t = x.shape[0]
    return ((acc[:, 0:2 * t:2] + acc[:, 1:2 * t:2]) * xs[:t]).T



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096, help="weight rows (a multiple of 128)")
    ap.add_argument("--k", type=int, default=7168, help="K, values a row (a multiple of 128)")
    ap.add_argument("--tokens", default="1,8,16,32")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--stages", default="3,4,6")
    ap.add_argument("--ctas", default="1,2", help="CTAs (warpgroups) an SM")
    ap.add_argument("--swap", default="0", help="1: the descriptors' two offsets exchanged (0,1: both)")
    a = ap.parse_args(argv)
    if a.rows % 128 or a.k % 128:
        ap.error("--rows and --k must be multiples of 128")
    torch, _, _, producer, g = start("python3 -m tools.diagnose.wgmma_fp8")
    layers = []
    for _ in range(a.layers):
        w = (torch.randn(a.rows, a.k, device="cuda", generator=g) * 64).to(torch.float8_e4m3fn).view(torch.uint8)
        ws = torch.rand(a.rows // 128, a.k // 128, device="cuda", generator=g) * 1e-3 + 1e-4
        layers.append((w, ws))
    nbytes = a.rows * a.k + layers[0][1].numel() * 4
    floor = floor_us("e4m3", a.rows, a.k, nbytes, a.layers)
    ref_w = dequant(layers[0][0], layers[0][1], torch)
    for tokens in ints(a.tokens):
        ncol = columns(tokens)
        x = torch.randn(tokens, a.k, device="cuda", generator=g).to(torch.bfloat16)
        b, xs, _ = b_operand(x, torch)
        ref = x.float() @ ref_w.T
        y = torch.zeros(tokens, a.rows, dtype=torch.float32, device="cuda")
        for stages, ctas, swap in itertools.product(ints(a.stages), ints(a.ctas), ints(a.swap)):
            tag = f"T {tokens:2d} (n{ncol})  {stages} stages  {ctas} CTAs an SM{'  swapped offsets' if swap else ''}"
            measure(tag, source(a.k, ncol, stages, bool(swap)), "wgmma_fp8", ctas, 128,
                    stages * (64 * 128 + ncol * 128), layers, b, xs, y, tokens, ref, floor, producer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
