#!/usr/bin/env python3
"""Time every finalize variant/param candidate (CUDA C++ small/large batch and the CuTe DSL variant) per (H, K, T)
under CUDA graphs, each checked bitwise against the reference; print the best per case.

    python3 -m tools.sweep.finalize [--cases 3584x16,7168x8,2048x22] [--tokens 1,8,32,64,128,512,4096]
    python3 -m tools.sweep.finalize --cases 2880x4,5120x1 --tokens 1,8,64 --variants small_batch --producer
    python3 -m tools.sweep.finalize --cases 2880x4 --tokens 1 --variants small_batch --where block_x=16|64,loads_per_group=2|32
    python3 -m tools.sweep.finalize --cases 5120x1,3584x16 --tokens 1,8 --variants small_batch --where "stream=false|true" --producer

--producer times each call right behind a producer kernel (tools.bench's: no early start), less the producer's own
time, and torch.compile of the plain torch finalize beside the candidates; --variants and --where (params, values
separated by |) narrow the candidates.
"""
from __future__ import annotations

import argparse
import itertools


import torch

from ..bench.__main__ import finalize_torch
from ..bench.lib import graph_time_us, producer_timer, require_gpu
from kerngen.errors import InputError
from kerngen.launch import current_stream
from kerngen.ops import finalize as fin
from kerngen.plan import spec_for, target_arch
from kerngen.tiers import Rule
from kerngen.tune import cute_finalize_candidates


def candidates():
    for bx, lpg, pdl, early, stream in itertools.product((4, 8, 16, 32, 64, 128, 256), (1, 2, 4, 8, 32), (False, True),
                                                         (False, True), (True, False)):
        if early and not pdl:
            continue
        yield "small_batch", dict(block_x=bx, loads_per_group=lpg, pdl=pdl, early_read=early, stream=stream)
    for vpt, unroll, pdl in itertools.product((1, 2, 4), (2, 4, 8), (False, True)):
        yield "large_batch", dict(vectors_per_thread=vpt, unroll=unroll, pdl=pdl, early_read=False)
    yield from cute_finalize_candidates()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="3584x16,7168x8,2048x22")
    ap.add_argument("--tokens", default="1,8,32,64,128,256,512,4096")
    ap.add_argument("--variants", default="small_batch,large_batch,cute")
    ap.add_argument("--where", default="", help="only candidates with these params, e.g. block_x=16|64,pdl=false")
    ap.add_argument("--producer", action="store_true", help="each call after a producer kernel (its time taken off)")
    args = ap.parse_args()
    require_gpu("python3 -m tools.sweep.finalize")
    timer = producer_timer(args.producer)
    compiled = torch.compile(finalize_torch, dynamic=False)
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.cache_size_limit = 1024
    dev = torch.cuda.current_device()
    arch = target_arch(dev)
    for case in args.cases.split(","):
        H, K = map(int, case.split("x"))
        for T in map(int, args.tokens.split(",")):
            g = torch.randn(T * K, H, device="cuda").to(torch.bfloat16)
            e2p = torch.randperm(T * K, device="cuda").view(T, K).int()
            w = torch.rand(T, K, device="cuda")
            out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
            ref = fin.reference(g, e2p, w)
            res = []
            where = dict(kv.split("=") for kv in args.where.split(",") if kv)
            for variant, params in candidates():
                if variant not in args.variants.split(","):
                    continue
                if any(k in params and str(params[k]).lower() not in v.lower().split("|") for k, v in where.items()):
                    continue
                if variant == "small_batch" and T > 512:
                    continue
                rule = Rule(op="finalize", variant=variant, ranges={}, params=params)
                spec = spec_for(rule, *fin.tag_constants(H, K, "bfloat16", "float32"), arch)
                try:
                    kern = fin.kernel(spec, T, dev)
                except InputError:   # a shape finalize refuses (e.g. a block of more than 1024 threads): not timed
                    continue
                run = fin.bound(kern, g, e2p, w, out, H)
                call = lambda: run(current_stream(dev))
                out.fill_(float("nan")); call(); torch.cuda.synchronize()
                assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), (variant, params)
                res.append((timer(call), variant, params))
            res.sort(key=lambda r: r[0])
            best = res[0]
            comp = timer(lambda: compiled(g, e2p, w))
            print(f"H={H} K={K} T={T}: best {best[0]:.2f} µs {best[1]} {best[2]} (torch.compile {comp:.2f} µs)")
            for r in res[1:4]:
                print(f"      {r[0]:.2f} µs {r[1]} {r[2]}")
            for name in ("small_batch", "large_batch", "cute"):
                for pdl in (False, True):
                    sub = [r for r in res if r[1] == name and r[2]["pdl"] == pdl and not r[2].get("early_read")]
                    if sub:
                        print(f"      best {name} pdl={pdl}: {sub[0][0]:.2f} µs {sub[0][2]}")


if __name__ == "__main__":
    main()
