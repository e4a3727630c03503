#!/usr/bin/env python3
"""kerngen benchmark: our kernels vs torch eager and torch.compile, same process, same inputs, CUDA graphs.

    python3 -m tools.bench [--ops finalize,routing,tail] [--tokens 1,8,64,512,4096] [--plot docs/bench.png]
    python3 -m tools.bench --ops finalize,tail --tokens 1,8,64 --producer     # each call after a producer kernel

Calls are timed back to back in a graph (chained: each of ours may start early behind the one before it), or with
--producer each right behind a producer kernel (a 4 MB elementwise write that does not trigger early: no early
start; its own time taken off), as a decode step's finalize follows the expert GEMM. Prints per case: our µs, eager µs, compile µs, speedup over compile, achieved bandwidth, and the floor
(empty kernel in a graph; bytes / measured copy bandwidth).
"""
from __future__ import annotations

import argparse


import torch

import kerngen
from .lib import copy_bandwidth_tbs, empty_kernel_us, graph_time_us, host_us, producer_timer, require_gpu

# (hidden, top_k): the large-K models, a K past the shipped ones, and the small-K models (gpt-oss-120b,
# mixtral-8x7b, llama-4-maverick) whose rows lost to torch.compile
FINALIZE_CASES = [(3584, 16), (7168, 8), (2048, 22), (2880, 4), (4096, 2), (5120, 1)]


def finalize_torch(g, e2p, w):
    """The same math a user would write in torch (vectorized gather + weighted sum in fp32)."""
    valid = e2p >= 0
    x = g[e2p.clamp(min=0).long()].float()
    return (x * (w.float() * valid).unsqueeze(-1)).sum(1).to(g.dtype)


def finalize_inputs(T, H, K, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = T * K
    g = torch.randn(rows, H, device="cuda", generator=gen).to(torch.bfloat16)
    e2p = torch.randperm(rows, device="cuda", generator=gen).view(T, K).int()
    w = torch.rand(T, K, device="cuda", generator=gen)
    return g, e2p, w


def bench_finalize(tokens, bw, rows, timer=graph_time_us):
    compiled = torch.compile(finalize_torch, dynamic=False)
    for H, K in FINALIZE_CASES:
        for T in tokens:
            g, e2p, w = finalize_inputs(T, H, K)
            out = torch.empty(T, H, dtype=g.dtype, device="cuda")
            ours = timer(lambda: kerngen.finalize(g, e2p, w, out=out))
            eager = timer(lambda: finalize_torch(g, e2p, w))
            comp = timer(lambda: compiled(g, e2p, w))
            nbytes = T * K * H * 2 + T * H * 2 + T * K * 8
            rows.append(dict(op="finalize", case=f"H={H} K={K}", T=T, ours=ours, eager=eager, compile=comp,
                             floor_us=nbytes / (bw * 1e12) * 1e6, tbs=nbytes / (ours * 1e-6) / 1e12))


def host_cost():
    g, e2p, w = finalize_inputs(1, 3584, 16)
    out = torch.empty(1, 3584, dtype=g.dtype, device="cuda")
    x = torch.zeros(1, device="cuda")
    ours = host_us(lambda: kerngen.finalize(g, e2p, w, out=out))
    ours_alloc = host_us(lambda: kerngen.finalize(g, e2p, w))
    prepared = kerngen.finalize_prepare(g, e2p, w, out=out)
    ours_prepared = host_us(prepared.run)
    add = host_us(lambda: x.add_(1))
    print(f"\nhost cost per call (no graph): x.add_(1) {add:.2f} µs | finalize(out=) {ours:.2f} µs "
          f"({ours / add:.2f}x) | finalize() allocating {ours_alloc:.2f} µs ({ours_alloc / add:.2f}x) | "
          f"finalize_prepare().run() {ours_prepared:.2f} µs ({ours_prepared / add:.2f}x)")
    return dict(add=add, ours=ours, ours_alloc=ours_alloc, ours_prepared=ours_prepared)


def print_table(rows, empty, bw):
    print(f"\nfloor: empty kernel in a graph {empty:.2f} µs; copy bandwidth {bw:.2f} TB/s "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__})")
    print(f"{'op':9s} {'case':22s} {'T':>5s} {'ours':>8s} {'eager':>8s} {'compile':>8s} {'vs eager':>8s} "
          f"{'vs comp':>8s} {'floor':>7s} {'TB/s':>5s} {'%copy':>5s}")
    for r in rows:
        print(f"{r['op']:9s} {r['case']:22s} {r['T']:5d} {r['ours']:8.2f} {r['eager']:8.2f} {r['compile']:8.2f} "
              f"{r['eager'] / r['ours']:7.1f}x {r['compile'] / r['ours']:7.1f}x {r.get('floor_us', 0):7.2f} "
              f"{r.get('tbs', 0):5.2f} {100 * r.get('tbs', 0) / bw:4.0f}%")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = sorted({(r["op"], r["case"]) for r in rows})
    cols = min(5, len(cases))
    nrows = -(-len(cases) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4 * cols, 3.5 * nrows), squeeze=False)
    for ax in axes.flat[len(cases):]:
        ax.set_visible(False)
    for ax, (op, case) in zip(axes.flat, cases):
        rs = [r for r in rows if (r["op"], r["case"]) == (op, case)]
        for name in ("ours", "eager", "compile"):
            ax.plot([r["T"] for r in rs], [r[name] for r in rs], marker="o", label=name)
        ax.set_xscale("log"); ax.set_yscale("log"); ax.set_title(f"{op} {case}", fontsize=9)
        ax.set_xlabel("tokens"); ax.set_ylabel("µs per call"); ax.legend(fontsize=7)
    fig.tight_layout(); fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="finalize,routing,tail")
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--plot", help="write a PNG chart of time vs tokens")
    ap.add_argument("--producer", action="store_true", help="finalize and tail: each call right behind a producer "
                    "kernel (its time taken off), not back to back")
    args = ap.parse_args()
    require_gpu("python3 -m tools.bench")
    tokens = [int(t) for t in args.tokens.split(",")]
    ops = args.ops.split(",")
    torch.manual_seed(0)
    torch._dynamo.config.recompile_limit = 1024  # one compiled graph per shape, as an engine would have
    torch._dynamo.config.cache_size_limit = 1024
    empty, bw = empty_kernel_us(), copy_bandwidth_tbs()
    rows: list[dict] = []
    timer = producer_timer(args.producer)
    print("finalize and tail: " + ("each call after a producer kernel" if args.producer else "chained"))
    if "finalize" in ops:
        bench_finalize(tokens, bw, rows, timer)
    if "routing" in ops:
        from .routing import bench_routing, default_cases
        cases = default_cases(tokens)   # every shipped model, the three first
        rows += [dict(op="routing", case=f"{r['model']} {r['E']}/{r['K']}", T=r["T"], ours=r["ours_us"],
                      eager=r["eager_us"], compile=r["compile_us"]) for r in bench_routing(cases)]
    if "tail" in ops:
        from .tail import bench_tail
        rows += bench_tail(tokens, bw, timer)
    print_table(rows, empty, bw)
    host_cost()
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
