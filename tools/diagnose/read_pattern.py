#!/usr/bin/env python3
"""How fast the decode expert GEMMs' weight-read pattern streams with nothing else in the kernel: the quantized
experts' items and K steps, read only, against the streaming-read floor.

    python3 -m tools.diagnose.read_pattern [--rows 23040] [--row-bytes 1440] [--layers 4]
        [--chunk 16,32,64] [--unroll 1,2,4] [--ctas 4,8] [--warps 4] [--spin 0,128]

A persistent grid (`--ctas` CTAs of `--warps` warps an SM) loops over items of 16 rows (of `--row-bytes` bytes;
`--rows` rows in all: gpt-oss-120b's experts_gemm1 at one token is 4 experts x 5760 rows x 1440 bytes, 1440 items
for 1056 CTAs; 16896 rows would make one item a CTA); a warp takes every `--warps`-th K step of an item, a step
being 16 rows x 4 lanes x `--chunk` bytes (the MXFP4 kernels: 16 bytes a lane and row, 1 KiB a step), `--unroll`
steps' loads issued before any is used, then `--spin` integer instructions a lane and step over the loaded words
(four independent chains: the conversion's issue cost without its arithmetic; 0: none). `--layers` copies are
cycled so nothing comes from L2. Each configuration is timed in a CUDA graph after a producer kernel, as
tools.bench.experts times the GEMMs, and printed as µs and % of the floor (the bytes at tools.bench's streaming-read
bandwidth). It separates what the access pattern, the load depth and the items' rounds over the grid cost from
what the instructions between the loads cost. Needs a GPU; `source(...)` renders anywhere.
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
    a = ap.parse_args(argv)
    if a.rows % 16 or a.row_bytes % 16:
        ap.error("--rows must be a multiple of 16 and --row-bytes of 16")
    from ..bench.lib import probe_kernel, read_bandwidth_tbs, require_gpu
    require_gpu("python3 -m tools.diagnose.read_pattern")
    import torch

    from kerngen.launch import current_stream
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
    for chunk, unroll, ctas, spin, warps in itertools.product(ints(a.chunk), ints(a.unroll), ints(a.ctas),
                                                             ints(a.spin), ints(a.warps)):
        k, _ = probe_kernel(source(chunk, unroll, spin, warps), "read_pattern", ctas, 32 * warps, "QQqi4x")
        turn = [0]

        def step():   # the next layer's copy (captured in turn: the graph cycles them)
            w = layers[turn[0] % len(layers)]
            turn[0] += 1
            k(current_stream(dev), w.data_ptr(), sink.data_ptr(), a.rows, a.row_bytes)

        us = after_producer_us(step, producer, calls=4 * len(layers))
        print(f"chunk {chunk:3d} B  unroll {unroll}  {ctas} CTAs of {warps} warps an SM  spin {spin:4d}:  "
              f"{us:8.2f} µs  {100 * floor / us:5.1f}% of the floor")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
