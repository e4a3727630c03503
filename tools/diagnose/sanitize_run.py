#!/usr/bin/env python3
"""Run every kernel family once, small, for compute-sanitizer (racecheck, synccheck, memcheck):

    compute-sanitizer --tool racecheck python3 -m tools.diagnose.sanitize_run

Covers the fused routing kernel (group barriers, shared-memory counts) at T=1, 8 and 40, the top-k + one-pass
permutation (T=40 at kimi-k3; ids that repeat an expert) and the top-k + histogram one (T=2000), finalize
small/large batch chained back to back with programmatic dependent launch (PDL) after the routing that produces
their indices, the fused tail, the vLLM/SGLang align layout (fused, one-pass and histogram builds), pre-routing
on a router stream, and kerngen.experts' two launches (T = 1, 8, 40; both tiles; an expert-parallel range).
--routing runs only the routing and permutation cases. KERNGEN_RACECHECK is set (unless given): the routing kernels
are the builds whose idle token groups meet their barriers, so racecheck reports nothing. Exits non-zero on a wrong
result.
"""
import argparse
import os
import sys


import torch

import kerngen
from kerngen import adapters
from kerngen.ops import experts as ex
from kerngen.ops import finalize as fin
from kerngen.ops import permute as pm
from kerngen.ops import routing as rt
from kerngen.ops import tail
from ..bench.lib import require_gpu


def newer_kernels(bad: list) -> None:
    """The align layout, pre-routing and the expert GEMMs (each checked against its torch reference)."""
    for T in (1, 40, 2000):   # fused, one-pass and histogram align builds
        ids = torch.stack([torch.randperm(64, device="cuda")[:8] for _ in range(T)]).int()
        got = adapters.moe_align_block_size(ids, 16, 64)
        want = pm.align_reference(ids, 16, 64)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            bad.append(f"moe_align_block_size T={T}")
    m = kerngen.models()["deepseek-v3"]
    pre = kerngen.PreRouting(model=m.name, tile=16, max_tokens=8)
    bias = torch.randn(m.num_experts, device="cuda") * 0.05
    for T in (1, 8):
        logits = torch.randn(T, m.num_experts, device="cuda")
        pre.take(logits, bias)                        # the first call of a shape builds and routes in place
        router = torch.cuda.Stream()
        router.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(router):
            pre.launch(logits, bias)
        r = pre.take(logits, bias)
        if not torch.equal(r.topk_ids, kerngen.route(logits, bias=bias, model=m.name, tile=16).topk_ids):
            bad.append(f"PreRouting T={T}")
    E, K, H, I = 64, 4, 1024, 256
    w13 = (torch.randn(E, 2 * I, H, device="cuda") / 32).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda") / 16).to(torch.bfloat16)
    for T, local in ((1, None), (8, None), (40, None), (8, (16, 32))):
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        logits = torch.randn(T, E, device="cuda")
        r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=ex.tile_for(H, I, "silu", T, 0) or 1,
                          local_experts=local)
        a, b = (0, E) if local is None else local
        got = kerngen.experts(x, r, w13[a:a + b].contiguous(), w2[a:a + b].contiguous())
        want = ex.reference(x, r, w13[a:a + b].contiguous(), w2[a:a + b].contiguous())
        rows = r.permuted_to_token >= 0
        if not torch.allclose(got[rows].float(), want[rows].float(), rtol=2e-2, atol=2e-2):
            bad.append(f"experts T={T} local={local}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routing", action="store_true",
                    help="only the routing and permutation cases (their group barriers: racecheck in about a minute)")
    args = ap.parse_args(argv)
    os.environ.setdefault("KERNGEN_RACECHECK", "1")   # the routing kernels' racecheck builds (docs/environment.md)
    require_gpu("python3 -m tools.diagnose.sanitize_run")
    torch.manual_seed(0)
    bad = []
    for name, T in (("kimi-k3", 1), ("kimi-k3", 8), ("deepseek-v3", 8), ("llama-4-maverick", 40), ("kimi-k3", 40),
                    ("deepseek-v3", 2000)):
        m = kerngen.models()[name]
        logits = torch.randn(T, m.num_experts, device="cuda")
        bias = torch.randn(m.num_experts, device="cuda") * 0.05 if "sigmoid_bias" in m.routing else None
        r = kerngen.route(logits, bias=bias, model=name, tile=16)
        ids, _ = rt.reference(logits, m.top_k, m.routing, bias=bias, n_group=m.n_group, topk_group=m.topk_group,
                              routed_scaling_factor=m.routed_scaling_factor)
        if not torch.equal(r.topk_ids, ids.int()):
            bad.append(f"route {name} T={T}")
        want = pm.permute_reference(ids.int(), m.num_experts, 16)
        if not all(torch.equal(getattr(r, f), v) for f, v in want.items()):
            bad.append(f"permutation {name} T={T}")
        if args.routing:
            continue
        # finalize right after the routing that wrote its indices (PDL: finalize waits on the grid before it)
        rows = int(r.num_permuted_rows)
        g = torch.randn(max(rows, 1), m.hidden, device="cuda").to(torch.bfloat16)
        out = kerngen.finalize(g, r.expanded_to_permuted, r.topk_weights)
        out2 = kerngen.finalize(g, r.expanded_to_permuted, r.topk_weights)   # back to back, PDL chain
        ref = fin.reference(g, r.expanded_to_permuted, r.topk_weights)
        if not (torch.equal(out.view(torch.int16), ref.view(torch.int16)) and torch.equal(out, out2)):
            bad.append(f"finalize {name} T={T}")
        nw = torch.rand(m.hidden, device="cuda").to(torch.bfloat16)
        res = torch.randn(T, m.hidden, device="cuda").to(torch.bfloat16)
        y = kerngen.moe_tail(g, r.expanded_to_permuted, r.topk_weights, nw, residual=res)
        yr, _ = tail.reference(g, r.expanded_to_permuted, r.topk_weights, nw, residual=res)
        if not torch.allclose(y.float(), yr.float(), rtol=2e-2, atol=2e-2):
            bad.append(f"moe_tail {name} T={T}")
    ids = torch.randint(0, 64, (300, 8), device="cuda", dtype=torch.int32)   # repeats: one-pass fallback (--routing too)
    r = kerngen.permute(ids, num_experts=64, tile=8)
    if not all(torch.equal(getattr(r, f), v) for f, v in pm.permute_reference(ids, 64, 8).items()):
        bad.append("permute with repeated ids")
    if args.routing:
        torch.cuda.synchronize()
        print("sanitize_run --routing:", "wrong results: " + ", ".join(bad) if bad else "all results correct")
        return 1 if bad else 0
    g = torch.randn(512 * 8, 7168, device="cuda").to(torch.bfloat16)   # large-batch finalize
    e2p = torch.randperm(512 * 8, device="cuda").view(512, 8).int()
    w = torch.rand(512, 8, device="cuda")
    if not torch.equal(kerngen.finalize(g, e2p, w).view(torch.int16), fin.reference(g, e2p, w).view(torch.int16)):
        bad.append("finalize large batch")
    newer_kernels(bad)
    torch.cuda.synchronize()
    print("sanitize_run:", "wrong results: " + ", ".join(bad) if bad else "all results correct")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
