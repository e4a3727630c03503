#!/usr/bin/env python3
"""Tensor-parallel tail benchmark, under torchrun (rank 0 prints):

    torchrun --nproc-per-node 2 -m tools.bench.tail_tp [--tokens 1,8,64,512]

fused   = kerngen.moe_tail(..., group=WORLD): our finalize, one all-reduce of routed + shared partials, our
          fused residual + RMSNorm kernel;
unfused = kerngen.finalize -> + shared -> NCCL all-reduce -> torch residual add + RMSNorm (eager),
both in CUDA graphs on the same inputs; µs per call, median over replays.
"""
from __future__ import annotations

import argparse
import os


os.environ.setdefault("NCCL_NVLS_ENABLE", "0")              # never NVLink multicast on shared machines
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch
import torch.distributed as dist

import kerngen
from kerngen.timing import graph_time_us
from .lib import require_gpu

CASES = (("kimi-k3", 3584, 16), ("deepseek-v3", 7168, 8))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8,64,512")
    args = ap.parse_args()
    require_gpu("tools.bench.tail_tp")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    if rank == 0:
        print(f"TP={world} on {torch.cuda.get_device_name()}\n| case | T | fused µs | unfused µs | unfused / fused |\n"
              "|---|---|---|---|---|")
    for name, H, K in CASES:
        for T in [int(t) for t in args.tokens.split(",")]:
            gen = torch.Generator(device="cuda").manual_seed(rank)
            g = torch.randn(T * K, H, device="cuda", generator=gen).to(torch.bfloat16)
            e2p = torch.randperm(T * K, device="cuda", generator=gen).view(T, K).int()
            w = torch.rand(T, K, device="cuda", generator=gen)
            shared = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
            res = torch.randn(T, H, device="cuda").to(torch.bfloat16)
            nw = torch.rand(H, device="cuda").to(torch.bfloat16)
            out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
            part = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")

            def fused():
                kerngen.moe_tail(g, e2p, w, nw, shared=shared, residual=res, out=out, group=group)

            def unfused():
                kerngen.finalize(g, e2p, w, out=part)
                part.add_(shared)
                dist.all_reduce(part, group=group)
                y = part.float() + res.float()
                out.copy_((y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float()).to(out.dtype))

            tf, tu = graph_time_us(fused, calls=10), graph_time_us(unfused, calls=10)
            if rank == 0:
                print(f"| {name} H={H} K={K} | {T} | **{tf:.2f}** | {tu:.2f} | {tu / tf:.2f}x |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
