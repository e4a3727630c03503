"""Benchmark rows for the fused tail (picked up by tools/bench): ours vs torch eager, torch.compile of the same
function, and the unfused path (kerngen.finalize + torch RMSNorm). Shared expert + residual, no residual_out."""
from __future__ import annotations

import torch

import kerngen
from .lib import graph_time_us

TAIL_CASES = [("kimi-k3", 3584, 16), ("deepseek-v3", 7168, 8), ("gpt-oss-120b", 2880, 4), ("mixtral-8x7b", 4096, 2),
              ("k22", 2048, 22),
              ("llama-4-maverick", 5120, 1)]
EPS = 1e-6


def tail_torch(g, e2p, w, nw, sh, res):
    """The reference math as a user would write it in torch (fp32)."""
    valid = e2p >= 0
    x = g[e2p.clamp(min=0).long()].float()
    y = (x * (w.float() * valid).unsqueeze(-1)).sum(1) + sh.float() + res.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()).to(g.dtype)


def unfused(g, e2p, w, nw, sh, res, fin):
    kerngen.finalize(g, e2p, w, out=fin)
    y = fin.float() + sh.float() + res.float()
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS) * nw.float()).to(g.dtype)


def tail_inputs(T, H, K, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = T * K
    g = torch.randn(rows, H, device="cuda", generator=gen).to(torch.bfloat16)
    e2p = torch.randperm(rows, device="cuda", generator=gen).view(T, K).int()
    w = torch.rand(T, K, device="cuda", generator=gen)
    nw = torch.rand(H, device="cuda", generator=gen).to(torch.bfloat16)
    sh = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    res = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    return g, e2p, w, nw, sh, res


def bench_tail(tokens, bw, timer=graph_time_us) -> list[dict]:
    compiled = torch.compile(tail_torch, dynamic=False)
    rows = []
    for name, H, K in TAIL_CASES:
        for T in tokens:
            args = tail_inputs(T, H, K)
            g, e2p, w, nw, sh, res = args
            out = torch.empty(T, H, dtype=g.dtype, device="cuda")
            fin = torch.empty(T, H, dtype=g.dtype, device="cuda")
            ours = timer(lambda: kerngen.moe_tail(g, e2p, w, nw, shared=sh, residual=res, out=out))
            eager = timer(lambda: tail_torch(*args))
            comp = timer(lambda: compiled(*args))
            unf = timer(lambda: unfused(*args, fin))
            nbytes = T * K * H * 2 + 3 * T * H * 2 + T * K * 8 + H * 2
            rows.append(dict(op="tail", case=f"{name} H={H} K={K}", T=T, ours=ours, eager=eager, compile=comp,
                             unfused=unf, floor_us=nbytes / (bw * 1e12) * 1e6, tbs=nbytes / (ours * 1e-6) / 1e12))
    print(f"\n{'tail case':26s} {'T':>5s} {'ours':>8s} {'unfused':>8s} {'compile':>8s}  (unfused = kerngen.finalize "
          "+ torch RMSNorm)")
    for r in rows:
        print(f"{r['case']:26s} {r['T']:5d} {r['ours']:8.2f} {r['unfused']:8.2f} {r['compile']:8.2f}")
    return rows


if __name__ == "__main__":
    raise SystemExit("tools/bench/tail.py holds the tail rows of the benchmark: run them with "
                     "`python3 -m tools.bench --ops tail` (and --tokens, --producer)")
