#!/usr/bin/env python3
"""kerngen.experts alone, eager, a few calls: the process to put under Nsight Compute, so that the kernel it
profiles is the one under study (tools.bench.experts also runs the bf16 kernels and grouped_mm, whose kernels share
the names experts_gemm1 / experts_gemm2).

    python3 -m tools.diagnose.experts_alone --model gpt-oss-120b --tokens 8 --format mxfp4 [--rule k=v,...] [--calls 3]
    ncu --clock-control none -k regex:experts_gemm1 -c 1 --launch-skip 1 --section WarpStateStats \\
        --section SourceCounters -o prof python3 -m tools.diagnose.experts_alone --model gpt-oss-120b --tokens 8

The tier table's rule for the shape (or --rule's launch params, at the routing's tile or the one the rule names), random weights in the format
(tools.bench.experts' quantization), one routing; the first call builds the kernels (skip it: --launch-skip 1).
Prints the kernels' params and checks the last call's rows against the reference.

With --peer DIR (bf16): the Triton peer's two GEMMs instead (kernel moe_gemm, GEMM1 then GEMM2 each call) at
--peer-configs, the configs tools.bench.experts --peer prints in its row (its sweep's best for the shape):

    ncu --clock-control none -k regex:moe_gemm -c 2 --launch-skip 2 --section SpeedOfLight \
        python3 -m tools.diagnose.experts_alone --model qwen3-30b-a3b --tokens 128 --format bf16 --peer DIR \
        --peer-configs "16,64,128,4,4;16,64,128,4,4"
"""
from __future__ import annotations

import argparse

import torch

from ..bench.lib import require_gpu


def peer_configs(text: str) -> list[tuple[int, ...]]:
    """"BM,BN,BK,warps,stages;BM,BN,BK,warps,stages": GEMM1's config, then GEMM2's."""
    try:
        cfgs = [tuple(int(v) for v in part.split(",")) for part in text.split(";")]
    except ValueError:
        cfgs = []
    if len(cfgs) != 2 or any(len(c) != 5 for c in cfgs):
        raise argparse.ArgumentTypeError(f"two configs of 5 integers, BM,BN,BK,warps,stages;..., got {text!r}")
    return cfgs


def run_peer(a, x, r, w13, w2, b13, b2, H: int, I: int, E: int, K: int, act: str, gpt: bool) -> int:
    """The Triton peer's two bf16 GEMMs --calls times (its activation in torch between them), then its rows checked
    against kerngen's reference, as tools.bench.experts checks them."""
    from kerngen.ops import experts as ex
    from ..bench import experts as bench
    peer = bench._peer(a.peer)
    cfg1, cfg2 = a.peer_configs
    T = x.shape[0]
    al1, al2 = peer.align(r.topk_ids, E, cfg1[0]), peer.align(r.topk_ids, E, cfg2[0])
    c1 = torch.empty(T * K, 2 * I, dtype=torch.bfloat16, device="cuda")
    a1 = torch.empty(T * K, I, dtype=torch.bfloat16, device="cuda")
    c2 = torch.empty(T * K, H, dtype=torch.bfloat16, device="cuda")
    ids = r.topk_ids.long().flatten()
    for _ in range(a.calls):
        peer.gemm(x, w13, c1, al1, K, cfg1)
        h = c1.float() if b13 is None else c1.float() + b13[ids].float()
        a1.copy_(ex.activate(h, I, act, gpt, 1.702, 7.0, 1.0, 0.0).to(torch.bfloat16))
        peer.gemm(a1, w2, c2, al2, 1, cfg2)
    torch.cuda.synchronize()
    y = (c2 if b2 is None else c2 + b2[ids]).float()
    ref = ex.reference(x, r, w13, w2, activation=act, interleaved=gpt, b13=b13, b2=b2)
    want = ref[r.expanded_to_permuted.flatten().long()].float()
    err = ((y - want).norm() / want.norm()).item()
    print(f"{a.model} T={T} bf16 Triton peer, configs {cfg1} / {cfg2}: relative error {err:.2e} against the reference")
    return 0 if err < 1e-2 else 1


def main(argv=None) -> int:
    from ..bench import experts as bench
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-oss-120b", choices=sorted(bench.SHAPES))
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--format", default="mxfp4", choices=bench.FORMATS)
    ap.add_argument("--rule", type=bench.parse_rule, help="launch params instead of the tier rule's, as in "
                    "tools.bench.experts --rule")
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--peer", help="folder of triton_fused_moe.py: run the Triton peer's bf16 GEMMs instead")
    ap.add_argument("--peer-configs", type=peer_configs, default=peer_configs("16,64,128,4,4;16,64,128,4,4"),
                    help="GEMM1's and GEMM2's configs, BLOCK_M,BLOCK_N,BLOCK_K,warps,stages;... (as tools.bench.experts "
                    "--peer prints them)")
    a = ap.parse_args(argv)
    if a.peer and a.format != "bf16":
        ap.error("--peer: the bf16 peer (--format bf16)")
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
    tile = (a.rule or {}).get("tile") or bench.tile_at(a.model, a.tokens, a.format)   # --rule's own tile, if named
    r = kerngen.route(torch.randn(a.tokens, E, device="cuda", generator=gen), top_k=K, method="softmax_topk",
                      tile=tile)
    scales = {} if a.format == "bf16" else dict(w13_scale=s13, w2_scale=s2)
    if a.peer:
        return run_peer(a, x, r, q13, q2, b13, b2, H, I, E, K, act, gpt)
    if a.rule:
        spec = bench.launch_spec(a.rule, tile, H, I, act, target_arch(), a.format)
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
