#!/usr/bin/env python3
"""Weights on shared-memory wgmma: how fast a decode GEMM streams fp8 block-scaled or bf16 weights when neither
operand passes through registers (the weights as they are stored, by cp.async into a ring of shared-memory slots),
against the streaming-read floor, for 1 to 64 tokens on one weight matrix (one expert's rows, as a tile of tokens
sees them).

    python3 -m tools.diagnose.wgmma_smem [--dtype e4m3,bf16,bf16t] [--rows 4096] [--k 7168] [--tokens 1,8,16,32]
        [--layers 4] [--stages 3,4,6] [--ctas 1,2]

The experts kernels (templates/experts/mma.cu.j2) hold each lane's weights in registers for mma.sync (fp8 widened to
f16 a pair), with up to 16 tokens a tile: more tokens an expert read its weights again. Here a warpgroup takes an
item of 64 weight rows; each 128-byte K block of them (8 KiB: 128 e4m3 values, one scale of the checkpoint's 128 x
128 blocks, or 64 bf16 values) and of the activations goes by 16-byte cp.async into one of `--stages` slots (a
CTA's items one stream of blocks: the next item's first blocks load while an item ends), and
`wgmma.mma_async` (m64nNk32 e4m3 or m64nNk16 bf16) reads both from shared memory (no swizzle: core matrices of 8
rows x 16 bytes): e4m3 into a fresh sum a block, which one FFMA a value adds times the block's scale; bf16 into one
running sum, a block's wgmmas running while the next block's are issued. bf16t: the bf16 weights stored transposed
([K, rows], as transformers keeps gpt-oss's and Llama-4's experts), their 64-row item read M-major (wgmma's
transposed A). e4m3: the activations are two e4m3 terms a token (hi = e4m3(x / s_t), lo = e4m3(x / s_t - hi), s_t =
max|x_t| / 448), a column each, N = 2T rounded up to 8 (at most 64); bf16: the activations as they are, N = T
rounded up to 8. Each configuration is checked against an fp32 reference that dequantizes the
weights itself (relative error printed), then timed in a CUDA graph after a producer kernel with `--layers` copies
cycled, as µs and % of the floor (weight + scale bytes at tools.bench's streaming-read bandwidth). Needs a GPU with
sm_90a; `source(...)` renders and compiles with NVRTC anywhere.
"""
from __future__ import annotations

import argparse
import itertools

from .probe import floor_us, ints, measure, start, two_terms

SRC = r"""
struct P {
    const unsigned char* w;     // [rows, RB bytes] e4m3 or bf16
    const float* ws;            // [rows / 128, RB / 128] block scales (bf16: ones)
    const unsigned char* b;     // B: [RB / 128 blocks][8 chunks][NCOL columns][16 bytes] (the activation columns)
    const float* xs;            // [NCOL / TERMS] token scales s_t (bf16: ones)
    float* y;                   // [tokens, rows]
    long long rows;
    int tokens;
};
constexpr int RB = $RB;                    // bytes a weight row (a multiple of 128)
constexpr int KB = RB / 128;               // 128-byte blocks along K (e4m3: the scale blocks)
constexpr int NCOL = $NCOL;                // B's columns
constexpr int TERMS = $TERMS;              // B's columns a token (e4m3: hi and lo; bf16: the row as it is)
constexpr int MN = $MN;                    // 1: the weights stored transposed, [K][rows] (bf16t), A read M-major
constexpr int SCALED = $SCALED;            // 1 (e4m3): a fresh sum a block times its scale; 0: one running sum
constexpr int ND = NCOL / 2;               // a thread's sums of an m64nNCOL tile
constexpr int STAGES = $STAGES;            // ring slots (K blocks in flight)
constexpr int A_BYTES = 64 * 128;          // a slot's weights: [8 chunks][64 rows][16 bytes]
constexpr int B_BYTES = NCOL * 128;        // a slot's activations: [8 chunks][NCOL][16 bytes]
constexpr int SLOT = A_BYTES + B_BYTES;
static_assert(RB % 128 == 0, "a row: a multiple of 128 bytes");
static_assert(NCOL % 8 == 0 && NCOL >= 8 && NCOL <= 64, "B's columns: 8 to 64, a multiple of 8");
static_assert(STAGES >= 3 || (SCALED && STAGES >= 2), "at least two slots (three for one running sum)");

__device__ __forceinline__ void fence_operand(float& r) { asm volatile("" : "+f"(r)::"memory"); }

// A no-swizzle operand at shared address `a`: adjacent core matrices `lbo` bytes apart along K (the leading
// dimension byte offset) and `sbo` bytes apart along M or N (the stride dimension byte offset), K-major or M-major
// alike (the K-major reading measured right: the exchanged one faults).
__device__ __forceinline__ unsigned long long desc(unsigned a, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((a >> 4) & 0x3FFF) | (unsigned long long)((lbo >> 4) & 0x3FFF) << 16
         | (unsigned long long)((sbo >> 4) & 0x3FFF) << 32;
}

// d = A B (a fresh sum: d is written only)
__device__ __forceinline__ void wgmma_fresh(float d[ND], unsigned long long da, unsigned long long db) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 0, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n$NCOL$KSHAPE {$DREGS}, %$DA, %$DB, p, 1, 1$TRANS;\n}\n"
                 : $DOUTS
                 : "l"(da), "l"(db));
}

// d += A B (d read and written)
__device__ __forceinline__ void wgmma_acc(float d[ND], unsigned long long da, unsigned long long db) {
    asm volatile("wgmma.mma_async.sync.aligned.m64n$NCOL$KSHAPE {$DREGS}, %$DA, %$DB, 1, 1, 1$TRANS;\n"
                 : $DINOUTS
                 : "l"(da), "l"(db));
}

__device__ __forceinline__ void cp16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}

// K block `kb` of the item's 64 rows and of B into slot `s` (one commit group; none copied past the last block).
__device__ __forceinline__ void load_block(const P& p, long long item, unsigned s, int kb) {
    const int t = threadIdx.x & 127;
    if (kb < KB) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            if (MN) {   // k-row k of the block, its 16 bytes mc of the item's 128: core matrix (k / 8, mc), row k % 8
                const int i = t + 128 * j, k = i >> 3, mc = i & 7;
                cp16(s + ((k >> 3) * 8 + mc) * 128 + (k & 7) * 16,
                     p.w + (long long)(kb * 64 + k) * (p.rows * 2) + item * 128 + mc * 16);
            } else {    // chunk c of row r: a warp takes chunks 4h .. 4h + 3 (64 bytes, two whole sectors) of 8
                        // consecutive rows, so every global sector is read whole by one instruction and each
                        // 128-byte wavefront of shared-memory writes (one chunk of the 8 rows) meets no conflict
                const int i = t + 128 * j, c = (i >> 8) * 4 + (i & 3), r = (i >> 2) & 63;
                cp16(s + c * 1024 + r * 16, p.w + (item * 64 + r) * RB + kb * 128 + c * 16);
            }
        }
        for (int i = t; i < 8 * NCOL; i += 128)
            cp16(s + A_BYTES + i * 16, p.b + ((long long)kb * 8 * NCOL + i) * 16);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
}

// The four wgmmas of the K block in slot `s` (32 bytes of K each: k32 e4m3, k16 bf16; chunks 2kk, 2kk + 1) into d,
// the first a fresh sum where `fresh`, then committed as one group.
__device__ __forceinline__ void block_wgmmas(unsigned s, float d[ND], bool fresh) {
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        // (core matrices 1024 bytes apart along K, 128 along M, in both layouts: K-major, 8 rows of 16 bytes of K;
        // M-major, 8 K rows of 16 bytes of M; --swap: A's two offsets exchanged)
        const unsigned long long da = $SWAP ? desc(s + 2 * kk * 1024, 128, 1024) : desc(s + 2 * kk * 1024, 1024, 128);
        const unsigned long long db = desc(s + A_BYTES + 2 * kk * NCOL * 16, NCOL * 16, 128);
        if (kk == 0 && fresh) wgmma_fresh(d, da, db);
        else wgmma_acc(d, da, db);
    }
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}

// The item's sums into y (d[4c + i]: columns 8c + 2q, +1 of rows row0, row1).
__device__ __forceinline__ void store_item(const P& p, long long item, const float acc[ND]) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, w = threadIdx.x >> 5;
    const long long row0 = item * 64 + w * 16 + g, row1 = row0 + 8;
#pragma unroll
    for (int c = 0; c < NCOL / 8; ++c) {
        if (TERMS == 2) {                  // token 4c + q's two terms
            const int t = 4 * c + q;
            if (t < p.tokens) {
                const float s_t = p.xs[t];
                p.y[(long long)t * p.rows + row0] = (acc[4 * c] + acc[4 * c + 1]) * s_t;
                p.y[(long long)t * p.rows + row1] = (acc[4 * c + 2] + acc[4 * c + 3]) * s_t;
            }
        } else {
#pragma unroll
            for (int i = 0; i < 2; ++i) {  // tokens 8c + 2q + i
                const int t = 8 * c + 2 * q + i;
                if (t < p.tokens) {
                    p.y[(long long)t * p.rows + row0] = acc[4 * c + i] * p.xs[t];
                    p.y[(long long)t * p.rows + row1] = acc[4 * c + 2 + i] * p.xs[t];
                }
            }
        }
    }
}

// The CTA's items (blockIdx.x, + gridDim.x, ...) as one stream of K blocks, block n = item (n / KB)'s block n % KB
// in ring slot n % STAGES, so the next item's first blocks are in flight while an item ends (no drain between items).
extern "C" __global__ void __launch_bounds__(128) wgmma_smem(const __grid_constant__ P p) {
    extern __shared__ __align__(128) unsigned char smem[];
    const unsigned ring = (unsigned)__cvta_generic_to_shared(smem);
    const long long items = p.rows / 64;
    const long long mine = blockIdx.x < items ? (items - 1 - blockIdx.x) / gridDim.x + 1 : 0;
    const long long blocks = mine * KB;
    auto item_of = [&](long long n) { return (long long)blockIdx.x + (n / KB) * gridDim.x; };
    auto load = [&](long long n) {   // stream block n into its slot (past the last: an empty commit group)
        load_block(p, n < blocks ? item_of(n) : 0, ring + (unsigned)(n % STAGES) * SLOT, n < blocks ? (int)(n % KB) : KB);
    };
    float acc[ND];
    if (SCALED) {   // block n's wgmmas waited for in its own iteration: its slot refilled at the next
#pragma unroll
        for (int n = 0; n < STAGES - 1; ++n) load(n);
        for (long long n = 0; n < blocks; ++n) {
            const int kb = (int)(n % KB);
            const long long item = item_of(n);
            if (kb == 0) {
#pragma unroll
                for (int i = 0; i < ND; ++i) acc[i] = 0.f;
            }
            asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2) : "memory");
            __syncthreads();   // block n in every thread's view; every warp done with block n - 1's slot
            load(n + STAGES - 1);
            const float f = __ldg(p.ws + (item * 64 / 128) * KB + kb);
            float d[ND];
            block_wgmmas(ring + (unsigned)(n % STAGES) * SLOT, d, true);
            asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
            for (int i = 0; i < ND; ++i) {
                fence_operand(d[i]);
                acc[i] = fmaf(d[i], f, acc[i]);
            }
            if (kb == KB - 1) store_item(p, item, acc);
        }
    } else {        // one running sum in the wgmmas' accumulators: block n's wgmmas run while block n + 1's are
                    // issued; a slot is refilled once the wgmmas of two blocks back are done
#pragma unroll
        for (int n = 0; n < STAGES - 2; ++n) load(n);
#pragma unroll
        for (int i = 0; i < ND; ++i) acc[i] = 0.f;
        for (long long n = 0; n < blocks; ++n) {
            const int kb = (int)(n % KB);
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 3 > 0 ? STAGES - 3 : 0) : "memory");
            __syncthreads();   // block n in every thread's view; every warp done with block n - 2's slot
            load(n + STAGES - 2);
            block_wgmmas(ring + (unsigned)(n % STAGES) * SLOT, acc, kb == 0);
            if (kb == KB - 1) {   // the item's sums complete: stored before the next item's first (fresh) wgmmas
                asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
                for (int i = 0; i < ND; ++i) fence_operand(acc[i]);
                store_item(p, item_of(n), acc);
            }
        }
    }
    asm volatile("cp.async.wait_group 0;" ::: "memory");
}
"""


DTYPES = {"e4m3": (1, 2, "k32.f32.e4m3.e4m3", ""), "bf16": (2, 1, "k16.f32.bf16.bf16", ", 0, 0"),
          "bf16t": (2, 1, "k16.f32.bf16.bf16", ", 1, 0")}   # bytes a value, columns a token, shape, transposes


def columns(tokens: int, dtype: str = "e4m3") -> int:
    """B's columns for `tokens` tokens (e4m3: two terms each), a multiple of 8, at most 64."""
    terms = DTYPES[dtype][1]
    if not 1 <= tokens <= 64 // terms:
        raise ValueError(f"tokens: 1 to {64 // terms} for {dtype} (B of 64 columns at most), got {tokens}")
    return -(-terms * tokens // 8) * 8


def source(k: int, ncol: int, stages: int, swap: bool = False, dtype: str = "e4m3") -> str:
    """The CUDA C++ of one configuration: rows of `k` values of `dtype` (e4m3 or bf16), B of `ncol` columns, `stages`
    ring slots (`swap`: A's leading and stride offsets exchanged, a check of their reading)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype: one of {sorted(DTYPES)}, got {dtype!r}")
    size, terms, shape, trans = DTYPES[dtype]
    if k * size % 128 or (dtype == "e4m3" and k % 128):
        raise ValueError(f"K = {k}: whole 128-byte blocks (e4m3: whole 128-wide scale blocks) expected")
    if ncol % 8 or not 8 <= ncol <= 64:
        raise ValueError(f"B's columns: 8 to 64, a multiple of 8, got {ncol}")
    nd = ncol // 2
    out = SRC
    for name, value in (("$DREGS", ", ".join(f"%{i}" for i in range(nd))),
                        ("$DOUTS", ", ".join(f'"=f"(d[{i}])' for i in range(nd))),
                        ("$DINOUTS", ", ".join(f'"+f"(d[{i}])' for i in range(nd))),
                        ("$DA", str(nd)), ("$DB", str(nd + 1)), ("$KSHAPE", shape), ("$TRANS", trans),
                        ("$NCOL", str(ncol)), ("$RB", str(k * size)), ("$STAGES", str(stages)),
                        ("$TERMS", str(terms)), ("$SWAP", str(int(swap))), ("$MN", str(int(dtype == "bf16t"))),
                        ("$SCALED", str(int(dtype == "e4m3")))):
        out = out.replace(name, value)
    return out


def b_operand(x, torch, dtype: str = "e4m3"):
    """x [T, K] bf16 -> (B bytes in the kernel's layout, s_t [NCOL / TERMS] fp32, the columns' value)."""
    t, k = x.shape
    n, terms = columns(t, dtype), DTYPES[dtype][1]
    if dtype != "e4m3":
        cols = torch.zeros(n, k, dtype=torch.bfloat16, device=x.device)
        cols[:t] = x
        s, approx = torch.ones(t, device=x.device), x.float()
    else:
        hi, lo, s = two_terms(x, torch)
        cols = torch.zeros(n, k, dtype=torch.float8_e4m3fn, device=x.device)
        cols[0:2 * t:2], cols[1:2 * t:2] = hi, lo
        approx = (hi.float() + lo.float()) * s[:, None]
    raw = cols.view(torch.uint8)                                                   # [n, row bytes]
    b = raw.reshape(n, -1, 16).permute(1, 0, 2).contiguous().reshape(-1)         # [chunk][column][16]
    xs = torch.zeros(n // terms, dtype=torch.float32, device=x.device)
    xs[:t] = s
    return b, xs, approx


def weights(rows: int, k: int, dtype: str, torch, device="cpu", generator=None):
    """Random weights as the kernel reads them: (bytes [rows, row bytes] or, bf16t, [K, rows * 2], block scales
    [rows / 128, row bytes / 128]: e4m3 scaled per 128 x 128 block, bf16 with scales of 1)."""
    if dtype != "e4m3":
        w = (torch.randn(rows, k, device=device, generator=generator) / k ** 0.5).to(torch.bfloat16)
        if dtype == "bf16t":
            w = w.T.contiguous()   # as transformers keeps gpt-oss's and Llama-4's experts: [K, rows]
        return w.view(torch.uint8), torch.ones(rows // 128, k * 2 // 128, device=device)
    w = (torch.randn(rows, k, device=device, generator=generator) * 64).to(torch.float8_e4m3fn)
    return w.view(torch.uint8), torch.rand(rows // 128, k // 128, device=device, generator=generator) * 1e-3 + 1e-4


def dequant(w, ws, torch, dtype: str = "e4m3"):
    """weights() -> fp32 [rows, K]: e4m3 values times their block's scale, or the bf16 values."""
    if dtype != "e4m3":
        v = w.view(torch.bfloat16).float()
        return v.T if dtype == "bf16t" else v
    return w.view(torch.float8_e4m3fn).float() * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)


def emulate(w, ws, x, torch, dtype: str = "e4m3"):
    """The kernel's arithmetic on the CPU from its layouts: B read back from b_operand()'s bytes, a fresh fp32 sum a
    128-byte K block times its scale, the columns of a token added and times its scale. -> [T, rows] fp32."""
    if dtype == "bf16t":   # (the same sums: the transposed storage only changes where the kernel reads A)
        w, dtype = w.view(torch.bfloat16).T.contiguous().view(torch.uint8), "bf16"
    rows, rb = w.shape
    b, xs, _ = b_operand(x, torch, dtype)
    n, terms = columns(x.shape[0], dtype), DTYPES[dtype][1]
    view = torch.bfloat16 if dtype == "bf16" else torch.float8_e4m3fn
    bm = b.reshape(rb // 16, n, 16).permute(1, 0, 2).contiguous().reshape(n, rb).view(view).float()   # [col, K]
    a = w.view(view).float()
    per = a.shape[1] // (rb // 128)                                                   # values a 128-byte block
    d = torch.einsum("rbk,cbk->rcb", a.reshape(rows, rb // 128, per), bm.reshape(n, rb // 128, per))
    acc = (d * ws.repeat_interleave(128, 0)[:, None, :]).sum(dim=2)
    t = x.shape[0]
    y = acc[:, 0:terms * t:terms] + (acc[:, 1:2 * t:2] if terms == 2 else 0)
    return (y * xs[:t]).T


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="e4m3", help="e4m3 (block-scaled, two-term activations), bf16, bf16t (bf16 "
                    "stored transposed, [K, rows]), or several")
    ap.add_argument("--rows", type=int, default=4096, help="weight rows (a multiple of 128)")
    ap.add_argument("--k", type=int, default=7168, help="K, values a row (a multiple of 128)")
    ap.add_argument("--tokens", default="1,8,16,32")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--stages", default="3,4,6")
    ap.add_argument("--ctas", default="1,2", help="CTAs (warpgroups) an SM")
    ap.add_argument("--swap", default="0", help="1: A's descriptor offsets exchanged (0,1: both; a wrong reading "
                    "may fault: one process each)")
    a = ap.parse_args(argv)
    if a.rows % 128 or a.k % 128:
        ap.error("--rows and --k must be multiples of 128")
    dtypes = a.dtype.split(",")
    if not set(dtypes) <= set(DTYPES):
        ap.error(f"--dtype: {', '.join(sorted(DTYPES))}")
    torch, producer, g = start("python3 -m tools.diagnose.wgmma_smem")
    for dtype in dtypes:
        layers = [weights(a.rows, a.k, dtype, torch, "cuda", g) for _ in range(a.layers)]
        nbytes = layers[0][0].numel() + (layers[0][1].numel() * 4 if dtype == "e4m3" else 0)
        floor = floor_us(dtype, a.rows, a.k, nbytes, a.layers)
        ref_w = dequant(*layers[0], torch, dtype)
        for tokens in ints(a.tokens):
            try:
                ncol = columns(tokens, dtype)
            except ValueError as e:
                print(f"{dtype} T {tokens}: {e}")
                continue
            x = torch.randn(tokens, a.k, device="cuda", generator=g).to(torch.bfloat16)
            b, xs, _ = b_operand(x, torch, dtype)
            ref = x.float() @ ref_w.T
            y = torch.zeros(tokens, a.rows, dtype=torch.float32, device="cuda")
            for stages, ctas, swap in itertools.product(ints(a.stages), ints(a.ctas), ints(a.swap)):
                tag = (f"{dtype} T {tokens:2d} (n{ncol})  {stages} stages  {ctas} CTAs an SM"
                       f"{'  swapped offsets' if swap else ''}")
                measure(tag, source(a.k, ncol, stages, bool(swap), dtype), "wgmma_smem", ctas, 128,
                        stages * (64 * 128 + ncol * 128), layers, b, xs, y, tokens, ref, floor, producer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
