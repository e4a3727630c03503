#!/usr/bin/env python3
"""Time the tail kernel over launch parameters (cluster, threads) per token count, to set the tail tiers.

    tools/sweep_tail.py [--tokens 1,8,64,512,4096] [--clusters 1,2,4,8] [--threads 128,256,512] [--max-loads 16,32]
                        [--branch-free 0,1] [--split-k 1,2]

split_k > 1 runs with one CTA per token only (cluster 1) and where it divides K; other combinations are left out.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_tail import TAIL_CASES, tail_inputs  # noqa: E402
from benchlib import copy_bandwidth_tbs, graph_time_us  # noqa: E402
from kerngen.ops import tail  # noqa: E402
from kerngen.plan import KernelSpec, target_arch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--clusters", default="1,2,4,8")
    ap.add_argument("--threads", default="128,256,512")
    ap.add_argument("--max-loads", default="32")
    ap.add_argument("--branch-free", default="0,1")
    ap.add_argument("--split-k", default="1")
    a = ap.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]
    bw = copy_bandwidth_tbs()
    print(f"copy bandwidth {bw:.2f} TB/s")
    for name, H, K in TAIL_CASES:
        consts = tail._constants(H, K, "bfloat16", "float32", "bfloat16", (True, True, False))
        for T in [int(t) for t in a.tokens.split(",")]:
            g, e2p, w, nw, sh, res = tail_inputs(T, H, K)
            out = torch.empty(T, H, dtype=g.dtype, device="cuda")
            nbytes = T * K * H * 2 + 3 * T * H * 2 + T * K * 8
            line = []
            for c, nt, ml, bf, sk in itertools.product(ints(a.clusters), ints(a.threads), ints(a.max_loads),
                                                      ints(a.branch_free), ints(a.split_k)):
                if sk > 1 and (c > 1 or K % sk):
                    continue
                params = (("branch_free", bool(bf)), ("cluster", c), ("max_loads", ml), ("pdl", True), ("threads", nt))
                params += (("split_k", sk),) if sk > 1 else ()
                name_ = f"c{c}/t{nt}/l{ml}/bf{bf}" + (f"/s{sk}" if sk > 1 else "")
                spec = KernelSpec(op="tail", variant="tail", backend="cute", tag="sweep-" + name_.replace("/", "-"),
                                  constants=tuple(sorted(consts.items())), params=params, arch=target_arch())
                fn = tail._function(spec)
                us = graph_time_us(lambda: fn(g, e2p, w, sh, res, nw, out, None, None, 1e-6))
                line.append(f"{name_} {us:6.2f}")
            best = min(line, key=lambda s: float(s.split()[-1]))
            print(f"{name:12s} T={T:5d} {nbytes / 1e6:8.2f} MB  best {best}  |  " + "  ".join(line), flush=True)


if __name__ == "__main__":
    main()
