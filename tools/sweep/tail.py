#!/usr/bin/env python3
"""Time the tail kernel over launch parameters (cluster, threads) per token count, to set the tail tiers.

    python3 -m tools.sweep.tail [--tokens 1,8,64,512,4096] [--clusters 1,2,4,8] [--threads 128,256,512] [--max-loads 16,32]
                        [--branch-free 0,1]

"""
from __future__ import annotations

import argparse


import torch

from ..bench.tail import TAIL_CASES, tail_inputs
from ..bench.lib import add_tail_config_args, copy_bandwidth_tbs, graph_time_us, require_gpu, tail_configs
from kerngen.ops import tail
from kerngen.plan import target_arch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--clusters", default="1,2,4,8")
    add_tail_config_args(ap)
    a = ap.parse_args()
    require_gpu("python3 -m tools.sweep.tail")
    bw = copy_bandwidth_tbs()
    print(f"copy bandwidth {bw:.2f} TB/s")
    for name, H, K in TAIL_CASES:
        configs = list(tail_configs(H, K, target_arch(), a, clusters=[int(c) for c in a.clusters.split(",")]))
        for T in [int(t) for t in a.tokens.split(",")]:
            g, e2p, w, nw, sh, res = tail_inputs(T, H, K)
            out = torch.empty(T, H, dtype=g.dtype, device="cuda")
            nbytes = T * K * H * 2 + 3 * T * H * 2 + T * K * 8
            line = []
            for label, spec in configs:
                fn = tail.kernel(spec)
                us = graph_time_us(lambda: fn(g, e2p, w, sh, res, nw, out, None, None, 1e-6))
                line.append(f"{label} {us:6.2f}")
            best = min(line, key=lambda s: float(s.split()[-1]))
            print(f"{name:12s} T={T:5d} {nbytes / 1e6:8.2f} MB  best {best}  |  " + "  ".join(line), flush=True)


if __name__ == "__main__":
    main()
