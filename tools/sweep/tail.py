#!/usr/bin/env python3
"""Time the tail kernel over launch parameters (cluster, threads) per token count, to set the tail tiers.

    python3 -m tools.sweep.tail [--tokens 1,8,64,512,4096] [--clusters 1,2,4,8] [--threads 128,256,512] [--max-loads 16,32]
                        [--branch-free 0,1] [--async-reduce 0,1] [--cases k22,kimi-k3] [--producer]

--cases keeps the named shapes of tools.bench.tail's TAIL_CASES; --producer times each call right behind a producer
kernel (tools.bench's: no early start), less the producer's own time.

"""
from __future__ import annotations

import argparse


import torch

from ..bench.tail import TAIL_CASES, tail_inputs
from ..bench.lib import add_tail_config_args, copy_bandwidth_tbs, producer_timer, require_gpu, tail_configs
from kerngen.ops import tail
from kerngen.plan import target_arch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--clusters", default="1,2,4,8")
    ap.add_argument("--cases", default="", help="only these TAIL_CASES names, e.g. k22,kimi-k3")
    ap.add_argument("--producer", action="store_true", help="each call after a producer kernel (its time taken off)")
    add_tail_config_args(ap)
    a = ap.parse_args()
    names = {n for n in a.cases.split(",") if n}
    unknown = names - {n for n, _, _ in TAIL_CASES}
    if unknown:
        raise SystemExit(f"--cases: unknown {sorted(unknown)}; known: {[n for n, _, _ in TAIL_CASES]}")
    require_gpu("python3 -m tools.sweep.tail")
    timer = producer_timer(a.producer)
    bw = copy_bandwidth_tbs()
    print(f"copy bandwidth {bw:.2f} TB/s")
    for name, H, K in TAIL_CASES:
        if names and name not in names:
            continue
        configs = list(tail_configs(H, K, target_arch(), a, clusters=[int(c) for c in a.clusters.split(",")]))
        for T in [int(t) for t in a.tokens.split(",")]:
            g, e2p, w, nw, sh, res = tail_inputs(T, H, K)
            out = torch.empty(T, H, dtype=g.dtype, device="cuda")
            nbytes = T * K * H * 2 + 3 * T * H * 2 + T * K * 8
            line = []
            for label, spec in configs:
                fn = tail.kernel(spec)
                us = timer(lambda: fn(g, e2p, w, sh, res, nw, out, None, None, 1e-6))
                line.append(f"{label} {us:6.2f}")
            best = min(line, key=lambda s: float(s.split()[-1]))
            print(f"{name:12s} T={T:5d} {nbytes / 1e6:8.2f} MB  best {best}  |  " + "  ".join(line), flush=True)


if __name__ == "__main__":
    main()
