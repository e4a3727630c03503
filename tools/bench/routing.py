"""Routing benchmark: kerngen.route (ids, weights AND the full permutation, tile 128) against torch eager and
torch.compile of the same routing math (ids + weights only), one process, same inputs, CUDA graphs.

    bench_routing([("kimi-k3", 1), ("deepseek-v3", 8)]) -> [{"model": ..., "T": ..., "ours_us": ...}, ...]
    python3 -m tools.bench.routing [--tokens 1,8,64,512,4096] [--models kimi-k3,deepseek-v3] [--align]

--align also times the same call writing moe_align_block_size's layout (layout="align": sorted_token_ids,
expert_ids, num_tokens_post_padded, every row past the used ones rewritten on each call) and prints its cost over
the kerngen layout; its outputs are checked against `align_reference` after timing.
"""
from __future__ import annotations

import sys


import torch

import kerngen
from .lib import graph_time_us, require_gpu

TOKENS = (1, 8, 64, 512, 4096)
FIRST = ("kimi-k3", "deepseek-v3", "kimi-k2")   # the cases the targets name


def default_cases(tokens=TOKENS) -> list[tuple[str, int]]:
    names = list(FIRST) + sorted(set(kerngen.models()) - set(FIRST))
    return [(n, t) for n in names for t in tokens]


def torch_routing(m):
    """The routing math a user writes in torch (the semantics of kerngen/ops/routing.py, with torch.topk), ids + weights."""
    K, G, TG, rsf, renorm = m.top_k, m.n_group, m.topk_group, m.routed_scaling_factor, m.renormalize

    def fn(logits, bias):
        s = logits.float()
        if m.routing == "softmax_topk":
            p = s.softmax(-1)
            w, i = p.topk(K, dim=-1)
            if renorm:
                w = w / w.sum(-1, keepdim=True)
        elif m.routing == "topk_softmax":
            v, i = s.topk(K, dim=-1)
            w = v.softmax(-1)
        elif m.routing == "top1_sigmoid":
            v, i = s.topk(1, dim=-1)
            w = torch.sigmoid(v)
        else:
            g = torch.sigmoid(s)
            b = g + bias.float()
            if m.routing == "grouped_sigmoid_bias":
                T, E = b.shape
                gs = b.view(T, G, E // G).topk(2, dim=-1).values.sum(-1)
                gi = gs.topk(TG, dim=-1).indices
                keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, gi, True)
                b = b.masked_fill(~keep.repeat_interleave(E // G, dim=1), float("-inf"))
            i = b.topk(K, dim=-1).indices
            w = g.gather(-1, i)
            w = w * rsf / (w.sum(-1, keepdim=True) + 1e-20)
        return i.to(torch.int32), w

    return fn


def bench_routing(cases=None, *, tile: int = 128, calls: int = 50, replays: int = 30,
                  peers: bool = True, align: bool = False) -> list[dict]:
    """Median µs per call (CUDA graph of `calls` calls, median over `replays` replays) for each (model, T)."""
    cases = cases or default_cases()
    tbl = kerngen.models()
    compiled = {}
    # every model's torch_routing closure shares one code object: each (model, T) is a recompile of it
    for knob in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 4 * len(cases) + 8))
    out = []
    for name, T in cases:
        m = tbl[name]
        E = m.num_experts
        gen = torch.Generator(device="cuda").manual_seed(T)
        logits = torch.randn(T, E, device="cuda", generator=gen)
        bias = (torch.randn(E, device="cuda", generator=gen) * 0.05) if "sigmoid_bias" in m.routing else None
        ws = kerngen.RoutingWorkspace(T, E, m.top_k, tile)
        ours = graph_time_us(lambda: kerngen.route(logits, bias=bias, model=name, tile=tile, workspace=ws),
                             calls=calls, replays=replays)
        row = {"op": "routing", "model": name, "E": E, "K": m.top_k, "method": m.routing, "T": T, "tile": tile,
               "ours_us": round(ours, 2)}
        if align:
            row.update(align_cost(name, logits, bias, tile, ours, calls, replays))
        if peers:
            eager = torch_routing(m)
            bias_arg = bias if bias is not None else torch.zeros(E, device="cuda")
            row["eager_us"] = round(graph_time_us(lambda: eager(logits, bias_arg), calls=calls, replays=replays), 2)
            if name not in compiled:
                compiled[name] = torch.compile(torch_routing(m), dynamic=False, fullgraph=True)
            fn = compiled[name]
            row["compile_us"] = round(graph_time_us(lambda: fn(logits, bias_arg), calls=calls, replays=replays), 2)
            row["speedup_vs_compile"] = round(row["compile_us"] / ours, 2)
        out.append(row)
    return out


def align_cost(name, logits, bias, tile: int, ours_us: float, calls: int, replays: int) -> dict:
    """µs of the same route writing the align layout, its cost over the kerngen layout, and the check of its
    outputs against align_reference (after timing)."""
    from kerngen.ops.permute import align_reference
    m = kerngen.models()[name]
    T, E = logits.shape
    ws = kerngen.RoutingWorkspace(T, E, m.top_k, tile, layout="align")
    step = lambda: kerngen.route(logits, bias=bias, model=name, tile=tile, workspace=ws, layout="align")  # noqa: E731
    us = graph_time_us(step, calls=calls, replays=replays)
    r = step()
    torch.cuda.synchronize()
    want = align_reference(r.topk_ids, tile, E)
    ok = all(torch.equal(got.cpu(), exp.cpu()) for got, exp in
             zip((r.sorted_token_ids, r.expert_ids, r.num_tokens_post_padded.view(-1)), want))
    if not ok:
        raise SystemExit(f"{name} T={T}: the align layout differs from align_reference")
    return {"align_us": round(us, 2), "align_cost_us": round(us - ours_us, 2)}


def kernel_breakdown(cases, *, tile: int = 128, iters: int = 50) -> list[dict]:
    """Per-kernel device µs of route (torch.profiler / CUPTI), for tile=None and tile=`tile`."""
    from torch.profiler import ProfilerActivity, profile
    tbl = kerngen.models()
    out = []
    for name, T in cases:
        m = tbl[name]
        E = m.num_experts
        logits = torch.randn(T, E, device="cuda")
        bias = torch.randn(E, device="cuda") * 0.05 if "sigmoid_bias" in m.routing else None
        for t in (None, tile):
            ws = kerngen.RoutingWorkspace(T, E, m.top_k, t)
            kerngen.route(logits, bias=bias, model=name, tile=t, workspace=ws)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(iters):
                    kerngen.route(logits, bias=bias, model=name, tile=t, workspace=ws)
                torch.cuda.synchronize()
            kernels = {e.key: round(e.device_time_total / e.count, 2) for e in prof.key_averages() if e.count}
            out.append({"model": name, "T": T, "tile": t, "kernels_us": kernels})
    return out


def main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--models", default="")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--breakdown", action="store_true", help="per-kernel device time instead")
    ap.add_argument("--align", action="store_true", help="also the align layout's cost (moe_align_block_size's)")
    a = ap.parse_args(argv)
    require_gpu("python3 -m tools.bench.routing")
    tokens = [int(t) for t in a.tokens.split(",")]
    cases = ([(n, t) for n in a.models.split(",") for t in tokens] if a.models else default_cases(tokens))
    if a.breakdown:
        for r in kernel_breakdown(cases):
            print(r, flush=True)
        return 0
    for r in bench_routing(cases, peers=not a.no_peers, align=a.align):
        print("  ".join(f"{k}={v}" for k, v in r.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
