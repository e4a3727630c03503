#!/usr/bin/env python3
"""kerngen.experts alone, eager, a few calls: the process to put under Nsight Compute, so that the kernel it
profiles is the one under study (tools.bench.experts also runs the bf16 kernels and grouped_mm, whose kernels share
the names experts_gemm1 / experts_gemm2).

    python3 -m tools.diagnose.experts_alone --model gpt-oss-120b --tokens 8 --format mxfp4 [--rule k=v,...] [--calls 3]
    ncu --clock-control none -k regex:experts_gemm1 -c 1 --launch-skip 1 --section WarpStateStats \\
        --section SourceCounters -o prof python3 -m tools.diagnose.experts_alone --model gpt-oss-120b --tokens 8

The tier table's rule for the shape (or --rule's launch params at the routing's tile), random weights in the format
(tools.bench.experts' quantization), one routing; the first call builds the kernels (skip it: --launch-skip 1).
Prints the kernels' params and checks the last call's rows against the reference.
"""
from __future__ import annotations

import argparse

import torch

from ..bench.lib import require_gpu


def rule_spec(rule: dict, tile: int, H: int, I: int, act: str, arch: str, fmt: str):
    """The experts spec of --rule's params at the routing's tile (a fused_x rule serves at most fused_x tokens)."""
    from kerngen import tiers
    from kerngen.ops import experts as ex
    ranges = {"tokens": (1, rule["fused_x"])} if rule.get("fused_x") else {}
    return ex.rule_spec(tiers.Rule("experts", "mma", ranges, {**rule, "tile": tile}), H, I, act, arch, fmt)


def main(argv=None) -> int:
    from ..bench import experts as bench
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-oss-120b", choices=sorted(bench.SHAPES))
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--format", default="mxfp4", choices=bench.FORMATS)
    ap.add_argument("--rule", type=bench.parse_rule, help="launch params instead of the tier rule's, as in "
                    "tools.bench.experts --rule")
    ap.add_argument("--calls", type=int, default=3)
    a = ap.parse_args(argv)
    require_gpu("python3 -m tools.diagnose.experts_alone")
    import kerngen
    from kerngen.ops import experts as ex
    from kerngen.plan import target_arch
    H, I, E, K, act, gpt = bench.SHAPES[a.model]
    gen = torch.Generator(device="cuda").manual_seed(a.tokens)
    w13, w2, b13, b2 = bench.weights(H, I, E, gpt, gen)
    q13, q2, s13, s2 = bench.layer_weights(w13, w2, H, I, E, a.format, 1, gen)[0]
    del w13, w2
    x = torch.randn(a.tokens, H, device="cuda", generator=gen).to(torch.bfloat16)
    tile = bench.tile_at(a.model, a.tokens, a.format)
    r = kerngen.route(torch.randn(a.tokens, E, device="cuda", generator=gen), top_k=K, method="softmax_topk",
                      tile=tile)
    scales = {} if a.format == "bf16" else dict(w13_scale=s13, w2_scale=s2)
    if a.rule:
        spec = rule_spec(a.rule, tile, H, I, act, target_arch(), a.format)
        k = ex.Kernels(spec, torch.cuda.current_device())
        out = torch.zeros(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
        for _ in range(a.calls):
            k(x, r, q13, q2, out, interleaved=gpt, b13=b13, b2=b2,
              a0=1.702 if act == "gpt_oss" else 1.0, a1=7.0 if act == "gpt_oss" else 0.0, **scales)
    else:
        spec = ex.spec(H, I, tile, act, a.tokens, target_arch(), fmt=a.format, experts=E, top_k=K)
        for _ in range(a.calls):
            out = kerngen.experts(x, r, q13, q2, activation=act, interleaved=gpt, b13=b13, b2=b2, **scales)
    torch.cuda.synchronize()
    ref = ex.reference(x, r, q13, q2, activation=act, interleaved=gpt, b13=b13, b2=b2, **scales)
    ok = r.permuted_to_token >= 0
    err = ((out[ok].float() - ref[ok].float()).norm() / ref[ok].float().norm()).item()
    print(f"{a.model} T={a.tokens} {a.format}: {dict(spec.params)}; relative error {err:.2e} against the reference")
    return 0 if err < 1e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
