#!/usr/bin/env python3
"""How fast the decode expert GEMMs' weight-read pattern streams with nothing else in the kernel: the quantized
experts' items and K steps, read only, against the streaming-read floor.

    python3 -m tools.diagnose.read_pattern [--rows 23040] [--row-bytes 1440] [--layers 4]
        [--chunk 16,32,64] [--unroll 1,2,4] [--ctas 4,8] [--warps 4] [--spin 0,128]
        [--bulk 4096,8192 | --row-chunk 256,512] [--stages 4,8]
    python3 -m tools.diagnose.read_pattern --columns 64,128,256 --rows 11520 --row-bytes 11520 --k-rows 2880

A persistent grid (`--ctas` CTAs of `--warps` warps an SM) loops over items of 16 rows (of `--row-bytes` bytes;
`--rows` rows in all: gpt-oss-120b's experts_gemm1 at one token is 4 experts x 5760 rows x 1440 bytes, 1440 items
for 1056 CTAs; 16896 rows would make one item a CTA); a warp takes every `--warps`-th K step of an item, a step
being 16 rows x 4 lanes x `--chunk` bytes (the MXFP4 kernels: 16 bytes a lane and row, 1 KiB a step), `--unroll`
steps' loads issued before any is used, then `--spin` integer instructions a lane and step over the loaded words
(four independent chains: the conversion's issue cost without its arithmetic; 0: none). `--layers` copies are
cycled so nothing comes from L2. Each configuration is timed in a CUDA graph after a producer kernel, as
tools.bench.experts times the GEMMs, and printed as µs and % of the floor (the bytes at tools.bench's streaming-read
bandwidth). It separates what the access pattern, the load depth and the items' rounds over the grid cost from
what the instructions between the loads cost.

`--bulk B` times the other way to keep bytes in flight, registers aside: a producer warp streams a CTA's items (each
16 contiguous rows) in pieces of B bytes by `cp.async.bulk` into a ring of `--stages` shared-memory slots, each
slot's arrival counted by an mbarrier, and `--warps` consumer warps read each slot with 16-byte shared loads (a lane
32 bytes at a time from two 512-byte runs of its warp: no bank conflicts; `--spin` instructions after each such
pair, as above) before releasing it; `--chunk` and `--unroll` do not apply. `--row-chunk C` instead: a slot holds
C bytes of each of an item's 16 rows (the K range a kernel's steps would take next), copied by 16 bulk copies, a
row each, and read as the kernels read a step (a lane 16 bytes of rows g and g + 8).

`--columns C` times the transposed weights' pattern instead (bf16 `[E, K, N]` read in place, as the experts kernels'
`transposed` builds read gpt-oss's and Llama-4's `[E, H, 2I]` / `[E, I, H]`): the `--rows` rows are `--rows /
--k-rows` matrices of `--k-rows` K rows of `--row-bytes` bytes; an item is a strip of C contiguous bytes of every K
row of one matrix (the shipped build: 64); a warp takes every `--warps`-th step of an item, a step being 8 loads a
lane of 16 bytes (C / 16 lanes a K row, so 4 KiB a warp step: 64 K rows at C = 64, 32 at 128, 16 at 256), `--unroll`
steps' loads issued before any is used, `--spin` as above.

In every mode a configuration of which an SM does not hold `--ctas` CTAs (the driver's occupancy query) is
reported, not launched. Needs a GPU; `source(...)` and `bulk_source(...)` render anywhere.
"""
from __future__ import annotations

import argparse
import itertools

from .probe import ints

SRC = r"""
struct P { const unsigned char* w; unsigned* sink; long long rows; int row_bytes; };
constexpr int CHUNK = {{ chunk }}, UNROLL = {{ unroll }}, SPIN = {{ spin }}, WARPS = {{ warps }}, V = CHUNK / 16;
extern "C" __global__ void __launch_bounds__(WARPS * 32) read_pattern(const __grid_constant__ P p) {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, w = threadIdx.x >> 5;
    const int step = 4 * CHUNK, steps = (p.row_bytes + step - 1) / step;
    const long long items = p.rows / 16;
    unsigned acc[4] = {0u, 0u, 0u, 0u};
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const unsigned char* r0 = p.w + (item * 16 + g) * (long long)p.row_bytes;
        const unsigned char* r1 = r0 + 8ll * p.row_bytes;
        for (int s0 = w; s0 < steps; s0 += WARPS * UNROLL) {
            uint4 v[UNROLL][2][V];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                const int o = (s0 + u * WARPS) * step + q * CHUNK;
#pragma unroll
                for (int k = 0; k < V; ++k) {
                    const bool in = s0 + u * WARPS < steps && o + 16 * k < p.row_bytes;
                    v[u][0][k] = in ? __ldcs(reinterpret_cast<const uint4*>(r0 + o) + k) : make_uint4(0, 0, 0, 0);
                    v[u][1][k] = in ? __ldcs(reinterpret_cast<const uint4*>(r1 + o) + k) : make_uint4(0, 0, 0, 0);
                }
            }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int r = 0; r < 2; ++r)
#pragma unroll
                    for (int k = 0; k < V; ++k) {
                        const unsigned x[4] = {v[u][r][k].x, v[u][r][k].y, v[u][r][k].z, v[u][r][k].w};
#pragma unroll
                        for (int i = 0; i < 4; ++i) acc[i] ^= x[i];
#pragma unroll
                        for (int i = 0; i < SPIN / (2 * V); ++i)   // SPIN instructions a step: four chains
                            acc[i & 3] = __funnelshift_l(acc[i & 3], x[(i + 1) & 3], 3) ^ 0x9e3779b9u;
                    }
        }
    }
    if ((acc[0] ^ acc[1] ^ acc[2] ^ acc[3]) == 0x1234567u) p.sink[0] = 1u;   // keeps the loads
}
"""


def source(chunk: int, unroll: int, spin: int, warps: int = 4) -> str:
    """The CUDA C++ of one configuration (`chunk` bytes a lane and row a step, `unroll` steps' loads at once,
    `spin` instructions a lane and step, `warps` warps splitting an item's steps)."""
    import jinja2
    if chunk % 16 or chunk <= 0:
        raise ValueError(f"--chunk: multiples of 16 bytes, got {chunk}")
    return jinja2.Template(SRC).render(chunk=chunk, unroll=unroll, spin=spin, warps=warps)



COLUMNS = r"""
struct P { const unsigned char* w; unsigned* sink; long long rows; int row_bytes; int k_rows; };
constexpr int C = {{ columns }}, UNROLL = {{ unroll }}, SPIN = {{ spin }}, WARPS = {{ warps }};
constexpr int LPR = C / 16, RPL = 32 / LPR, NL = 8, RPS = RPL * NL;   // lanes a K row, K rows a load and a step
extern "C" __global__ void __launch_bounds__(WARPS * 32) read_columns(const __grid_constant__ P p) {
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5, c = (lane % LPR) * 16, r = lane / LPR;
    const int strips = (p.row_bytes + C - 1) / C, steps = (p.k_rows + RPS - 1) / RPS;
    const long long items = p.rows / p.k_rows * strips;
    unsigned acc[4] = {0u, 0u, 0u, 0u};
    for (long long item = blockIdx.x; item < items; item += gridDim.x) {
        const long long m = item / strips;
        const int col = (int)(item % strips) * C + c;
        const unsigned char* base = p.w + m * p.k_rows * (long long)p.row_bytes + col;
        for (int s0 = w; s0 < steps; s0 += WARPS * UNROLL) {
            uint4 v[UNROLL][NL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int l = 0; l < NL; ++l) {
                    const int k = (s0 + u * WARPS) * RPS + l * RPL + r;
                    const bool in = s0 + u * WARPS < steps && k < p.k_rows && col < p.row_bytes;
                    v[u][l] = in ? __ldcs(reinterpret_cast<const uint4*>(base + (long long)k * p.row_bytes))
                                 : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int l = 0; l < NL; ++l) {
                    const unsigned x[4] = {v[u][l].x, v[u][l].y, v[u][l].z, v[u][l].w};
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[i] ^= x[i];
#pragma unroll
                    for (int i = 0; i < SPIN / NL; ++i)   // SPIN instructions a step: four chains
                        acc[i & 3] = __funnelshift_l(acc[i & 3], x[(i + 1) & 3], 3) ^ 0x9e3779b9u;
                }
        }
    }
    if ((acc[0] ^ acc[1] ^ acc[2] ^ acc[3]) == 0x1234567u) p.sink[0] = 1u;   // keeps the loads
}
"""


def columns_source(columns: int, unroll: int, spin: int, warps: int = 4) -> str:
    """The CUDA C++ of one `--columns` configuration (strips of `columns` bytes of every K row, `unroll` steps' loads
    at once, `spin` instructions a lane and step, `warps` warps splitting an item's steps)."""
    import jinja2
    if columns not in (16, 32, 64, 128, 256, 512):
        raise ValueError(f"--columns: 16, 32, 64, 128, 256 or 512 bytes (whole 16-byte lanes dividing a warp), "
                         f"got {columns}")
    return jinja2.Template(COLUMNS).render(columns=columns, unroll=unroll, spin=spin, warps=warps)

BULK = r"""
struct P { const unsigned char* w; unsigned* sink; long long rows; int row_bytes; };
constexpr int STAGES = {{ stages }}, SPIN = {{ spin }}, WARPS = {{ warps }};
{% if row_chunk %}// A piece: K bytes ROWC .. of an item's 16 rows, a bulk copy a row, each row at STRIDE bytes in its slot (STRIDE / 4
// = 16 mod 32 words: the 8 lanes of a quarter warp, rows g and g + 1 at 16-byte columns q, hit 32 distinct banks).
constexpr int ROWC = {{ row_chunk }}, STRIDE = {{ slot // 16 }}, BYTES = 16 * STRIDE;
{% else %}constexpr int BYTES = {{ bulk }};   // a piece: BYTES contiguous bytes of an item, one bulk copy
{% endif %}__device__ __forceinline__ unsigned su(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void wait_phase(unsigned bar, unsigned parity) {
    asm volatile("{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}"
                 :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, int n, unsigned bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 :: "r"(su(dst)), "l"(src), "r"(n), "r"(bar) : "memory");
}
__device__ __forceinline__ void mix(unsigned (&acc)[4], const uint4& a, const uint4& b) {
    const unsigned x[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j & 3] ^= x[j];
#pragma unroll
    for (int j = 0; j < SPIN; ++j)   // SPIN instructions a lane and 32 bytes: four chains
        acc[j & 3] = __funnelshift_l(acc[j & 3], x[(j + 1) & 7], 3) ^ 0x9e3779b9u;
}
// Warp WARPS produces, warps 0 .. WARPS - 1 consume; piece i of the CTA's stream lives in slot i % STAGES.
extern "C" __global__ void __launch_bounds__((WARPS + 1) * 32) read_bulk(const __grid_constant__ P p) {
    extern __shared__ __align__(128) unsigned char ring[];
    __shared__ __align__(8) unsigned long long full[STAGES], empty[STAGES];
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const int item_bytes = 16 * p.row_bytes;
{% if row_chunk %}    const int span = p.row_bytes, step = ROWC;   // a piece's K range
{% else %}    const int span = item_bytes, step = BYTES;
{% endif %}    const long long items = p.rows / 16;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(su(&full[s])));
            asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(su(&empty[s])), "r"(WARPS));
        }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (w == WARPS) {
        int s = 0;
        unsigned parity = 1;   // a fresh empty barrier counts as released
        for (long long item = blockIdx.x; item < items; item += gridDim.x)
            for (int off = 0; off < span; off += step) {
                const int n = min(step, span - off);
                if (lane == 0) {
                    wait_phase(su(&empty[s]), parity);
                    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(su(&full[s])),
{% if row_chunk %}                                 "r"(16 * n) : "memory");
{% else %}                                 "r"(n) : "memory");
{% endif %}                }
                __syncwarp();
{% if row_chunk %}                if (lane < 16)   // row `lane` of the item
                    bulk_copy(ring + s * BYTES + lane * STRIDE, p.w + (item * 16 + lane) * p.row_bytes + off, n,
                              su(&full[s]));
{% else %}                if (lane == 0) bulk_copy(ring + s * BYTES, p.w + item * item_bytes + off, n, su(&full[s]));
{% endif %}                if (++s == STAGES) { s = 0; parity ^= 1; }
            }
        return;
    }
    unsigned acc[4] = {0u, 0u, 0u, 0u};
    int s = 0;
    unsigned parity = 0;
    for (long long item = blockIdx.x; item < items; item += gridDim.x)
        for (int off = 0; off < span; off += step) {
            const int n = min(step, span - off);
            wait_phase(su(&full[s]), parity);
            const unsigned char* slot = ring + s * BYTES;
{% if row_chunk %}            const int g = lane >> 2, q = lane & 3;   // the kernels' 1 KiB warp steps: rows g, g + 8, 16 bytes at q
            for (int o = 64 * w + 16 * q; o < n; o += 64 * WARPS)
                mix(acc, *reinterpret_cast<const uint4*>(slot + g * STRIDE + o),
                    *reinterpret_cast<const uint4*>(slot + (g + 8) * STRIDE + o));
{% else %}            const uint4* v = reinterpret_cast<const uint4*>(slot);
            for (int k = 64 * w + lane; k < n / 16; k += 64 * WARPS)   // a warp's loads 512 contiguous bytes
                mix(acc, v[k], k + 32 < n / 16 ? v[k + 32] : make_uint4(0, 0, 0, 0));
{% endif %}            __syncwarp();
            if (lane == 0) asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(su(&empty[s])) : "memory");
            if (++s == STAGES) { s = 0; parity ^= 1; }
        }
    if ((acc[0] ^ acc[1] ^ acc[2] ^ acc[3]) == 0x1234567u) p.sink[0] = 1u;   // keeps the loads
}
"""


def bulk_source(bulk: int, stages: int, spin: int, warps: int = 4, row_chunk: int = 0) -> str:
    """The CUDA C++ of one `--bulk` configuration (pieces of `bulk` bytes, or with `row_chunk` C pieces of 16 rows x C
    bytes copied a row at a time; a ring of `stages` slots, `spin` instructions a lane and 32 bytes, `warps` consumer
    warps beside the producer warp)."""
    import jinja2
    if row_chunk and (row_chunk % 64 or row_chunk < 0):
        raise ValueError(f"--row-chunk: multiples of 64 bytes (whole warp steps), got {row_chunk}")
    if not row_chunk and (bulk % 16 or bulk <= 0):
        raise ValueError(f"--bulk: multiples of 16 bytes, got {bulk}")
    if stages < 1:
        raise ValueError(f"--stages: at least 1, got {stages}")
    return jinja2.Template(BULK).render(bulk=bulk, stages=stages, spin=spin, warps=warps, row_chunk=row_chunk,
                                        slot=slot_bytes(bulk, row_chunk))


def slot_bytes(bulk: int, row_chunk: int) -> int:
    """A ring slot's bytes: `bulk`, or 16 rows of `row_chunk` bytes at the padded stride bulk_source gives them."""
    return bulk if not row_chunk else 16 * (row_chunk + (16 - row_chunk // 4 % 32 + 32) % 32 * 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4 * 5760, help="rows in all (a multiple of 16)")
    ap.add_argument("--row-bytes", type=int, default=1440)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--chunk", default="16,32,64")
    ap.add_argument("--unroll", default="1,2,4")
    ap.add_argument("--ctas", default="4,8")
    ap.add_argument("--warps", default="4", help="warps a CTA (they split an item's steps)")
    ap.add_argument("--spin", default="0,128")
    ap.add_argument("--bulk", default="", help="bytes a bulk copy (the producer-warp ring instead of register loads)")
    ap.add_argument("--stages", default="4,8", help="slots of the --bulk / --row-chunk ring")
    ap.add_argument("--row-chunk", default="", help="bytes of each of an item's 16 rows a ring slot holds, copied a row "
                    "at a time (the bulk-copy ring with pieces of the rows' K range instead of --bulk)")
    ap.add_argument("--columns", default="", help="bytes of each K row an item takes: the transposed weights' "
                    "pattern (items are column strips of --k-rows K rows) instead of rows")
    ap.add_argument("--k-rows", type=int, default=2880, help="--columns: K rows of a matrix (--rows holds several)")
    a = ap.parse_args(argv)
    if a.columns and (a.k_rows <= 0 or a.rows % a.k_rows):
        ap.error("--k-rows must divide --rows")
    if a.rows % 16 or a.row_bytes % 16:
        ap.error("--rows must be a multiple of 16 and --row-bytes of 16")
    from ..bench.lib import probe_kernel, read_bandwidth_tbs, require_gpu
    require_gpu("python3 -m tools.diagnose.read_pattern")
    import torch

    from kerngen.launch import current_stream, resident
    from kerngen.occupancy import limits
    from kerngen.plan import target_arch
    from kerngen.timing import after_producer_us, elementwise_producer
    dev = torch.cuda.current_device()
    nbytes = a.rows * a.row_bytes
    layers = [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda") for _ in range(a.layers)]
    sink = torch.zeros(1, dtype=torch.int32, device="cuda")
    producer = elementwise_producer()
    tbs = read_bandwidth_tbs()
    floor = nbytes / (tbs * 1e12) * 1e6
    print(f"{a.rows} rows x {a.row_bytes} bytes ({nbytes / 2**20:.1f} MiB), {a.layers} layers cycled; streaming read "
          f"{tbs:.2f} TB/s: floor {floor:.2f} µs")
    def timed(k, tag: str, ctas: int, *extra: int) -> None:
        """k over the layers in turn (captured in turn: the graph cycles them), timed after the producer; one line.
        Not launched where an SM holds fewer than `ctas` of its CTAs (the driver's occupancy query)."""
        fit = resident(k.fn, k.block[0], k.smem)
        if fit < ctas:
            print(f"{tag}: not launched (an SM holds {fit} of these CTAs)")
            return
        turn = [0]

        def step():
            w = layers[turn[0] % len(layers)]
            turn[0] += 1
            k(current_stream(dev), w.data_ptr(), sink.data_ptr(), a.rows, a.row_bytes, *extra)

        us = after_producer_us(step, producer, calls=4 * len(layers))
        print(f"{tag}:  {us:8.2f} µs  {100 * floor / us:5.1f}% of the floor")

    if a.columns:
        for cols, unroll, ctas, spin, warps in itertools.product(ints(a.columns), ints(a.unroll), ints(a.ctas),
                                                                 ints(a.spin), ints(a.warps)):
            k, _ = probe_kernel(columns_source(cols, unroll, spin, warps), "read_columns", ctas, 32 * warps,
                                "QQqii")
            timed(k, f"columns {cols:3d} B  unroll {unroll}  {ctas} CTAs of {warps} warps an SM  spin {spin:4d}",
                  ctas, a.k_rows)
        return 0
    if a.bulk or a.row_chunk:
        pieces = [(0, c) for c in ints(a.row_chunk)] if a.row_chunk else [(b, 0) for b in ints(a.bulk)]
        for (bulk, rc), stages, ctas, spin, warps in itertools.product(pieces, ints(a.stages), ints(a.ctas),
                                                                       ints(a.spin), ints(a.warps)):
            what = f"rows x {rc:4d} B" if rc else f"bulk {bulk:5d} B"
            tag = f"{what} x {stages} stages  {ctas} CTAs of {warps}+1 warps an SM  spin {spin:4d}"
            smem = slot_bytes(bulk, rc) * stages
            if smem > limits(target_arch(dev)).smem_per_cta:
                print(f"{tag}: not built (more shared memory than a CTA may have)")
                continue
            k, _ = probe_kernel(bulk_source(bulk, stages, spin, warps, rc), "read_bulk", ctas, 32 * (warps + 1),
                                "QQqi4x", smem=smem)
            timed(k, tag, ctas)
        return 0
    for chunk, unroll, ctas, spin, warps in itertools.product(ints(a.chunk), ints(a.unroll), ints(a.ctas),
                                                             ints(a.spin), ints(a.warps)):
        k, _ = probe_kernel(source(chunk, unroll, spin, warps), "read_pattern", ctas, 32 * warps, "QQqi4x")
        timed(k, f"chunk {chunk:3d} B  unroll {unroll}  {ctas} CTAs of {warps} warps an SM  spin {spin:4d}", ctas)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
