#!/usr/bin/env python3
"""kerngen.experts' quantized builds (fp8, MXFP4) over launch shapes, for their tier rules (GPU).

    python3 -m tools.sweep.experts FORMAT MODELS TOKENS [sweep|deep] (FORMAT fp8, mxfp4, fp8-a8: fp8_activations,
                                                                      fp8-x16 / mxfp4-x16: f16x launch shapes)
    python3 -m tools.sweep.experts fp8 deepseek-v3,kimi-k2 1,8,64 sweep
    python3 -m tools.sweep.experts mxfp4-x16 gpt-oss-120b,kimi-k3 1,8,64 sweep
    python3 -m tools.sweep.experts mxfp4-x16 gpt-oss-120b,kimi-k3 1,2 deep     # deeper load batches only
    python3 -m tools.sweep.experts fp8-x16 deepseek-v3,kimi-k2 1,2 fused       # 32 warps an SM, x quantized in gemm1

Random quantized weights (kerngen.tune.random_expert_weights: every code but NaN; scale bytes 118..123 for MXFP4) of
up to 4 layers cycled, a routing per call, CUDA graphs, each step after a 4 MB producer kernel (its time taken off);
the floor is the active experts' quantized weight and scale bytes at the streaming-read bandwidth. Prints the tier
rule's time, its variant without prefetch and that with lean (whole K steps with no bound checks), and with `sweep` the six fastest of 4 warps x unroll x blocks_per_sm x
prefetch_x (for -x16 formats also two m16 tiles an item, two weight buffers taking turns, 8 warps an item, no early
weight loads, early_l2: the first weights toward L2 before the wait, beside the rule as "rule-early", and tickets:
items from a counter); `deep`
times instead only the f16x shapes of 3-6 steps a load batch: more weight bytes in flight a warp at few tokens;
`fused` only the 1-2-token shapes of fused_x = 2 at 6-8 CTAs of 4 warps, one or two steps a load batch, with and
without lean and act_f16, MXFP4 with gcol too (and one_launch, two steps a batch in experts_gemm1 alone:
gemm1_unroll, or in both with experts_gemm2 at 6 CTAs: gemm2_blocks), and with lean at 5 and 6 warps an item), each
launch at most as many CTAs an SM as the driver's occupancy query allows it (a shape asking for more is skipped). A
-x16 format times the rule with f16x (activations carried as f16) beside it, and sweeps the f16x shapes. Every
candidate is built first by a pool of processes. Correctness is the GPU tests' job
(tests/gpu/test_experts_quantized.py): the weights here are random bytes.
"""
import itertools
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import torch
import kerngen
from kerngen.launch import resident
from kerngen.ops import experts as ex
from kerngen.plan import target_arch
from kerngen.tune import random_expert_weights
from tools.bench.experts import launch_spec
from tools.bench.lib import elementwise_producer, read_bandwidth_tbs, require_gpu, timed

SHAPES = {"deepseek-v3": (7168, 2048, 256, 8, "silu", False), "kimi-k2": (7168, 2048, 384, 8, "silu", False),
          "gpt-oss-120b": (2880, 2880, 128, 4, "gpt_oss", True), "kimi-k3": (3584, 2048, 896, 16, "situglu", False)}

GRID_PARAMS = ("blocks_per_sm", "gemm1_blocks", "gemm2_blocks")   # the CTAs an SM the launches ask for


def ctas_per_sm(k) -> dict[str, tuple[int, int]]:
    """Each launch's (CTAs an SM it asks for: gemm1_blocks, gemm2_blocks, else blocks_per_sm; CTAs an SM its
    kernel's registers and shared memory hold, its dynamic shared memory counted, as the ops cap their grids)."""
    asked = ex.Kernels.persistent(k.spec)
    return {L.name: (asked[L.name].per_sm, resident(L.fn, L.block[0], L.smem)) for L in k.launchers(1)}

def spills(spec) -> bool:
    """Whether a built spec's kernels spill registers (a stack of more than 16 bytes, or local memory)."""
    from kerngen import jit, resources
    return any(u.get("STACK", 0) > 16 or u.get("LOCAL", 0) for _, u in resources.usage(jit.build(spec).files))


def prebuild(specs):
    """Build the specs into the kernel cache, several at a time (each compile is one NVRTC process's work)."""
    from kerngen import jit
    with ProcessPoolExecutor(max(1, min(len(specs), (os.cpu_count() or 2) - 1))) as pool:
        list(pool.map(jit.build, specs))


def main():
    if len(sys.argv) < 4 or sys.argv[1] in ("-h", "--help"):
        print("\n\n".join(__doc__.strip().split("\n\n")[:2]), file=sys.stderr)
        raise SystemExit(0 if len(sys.argv) > 1 and sys.argv[1] in ("-h", "--help") else 2)
    require_gpu("python3 -m tools.sweep.experts")
    fmt, models, tokens = sys.argv[1], sys.argv[2].split(","), [int(t) for t in sys.argv[3].split(",")]
    a8 = fmt == "fp8-a8"   # fp8 weights with fp8 activations (experts(..., fp8_activations=True))
    x16 = fmt.endswith("-x16")   # the f16x launch shapes
    fmt = "fp8" if a8 else fmt.removesuffix("-x16")
    sweep = len(sys.argv) > 4 and sys.argv[4] in ("sweep", "deep", "fused")
    deep, fused = sweep and sys.argv[4] == "deep", sweep and sys.argv[4] == "fused"
    bw = read_bandwidth_tbs()
    dev, arch = 0, target_arch(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    per_weight = {"fp8": 1.0 + 4 / 128 ** 2, "mxfp4": 0.5 + 1 / 32}[fmt]
    print(f"read bw {bw:.2f} TB/s", flush=True)
    for m in models:
        H, I, E, K, act, gpt = SHAPES[m]
        layers = max(1, min(4, int(60e9 // (3 * E * H * I * per_weight))))
        W = [(random_expert_weights(E, 2 * I, H, fmt), random_expert_weights(E, H, I, fmt)) for _ in range(layers)]
        for T in tokens:
            calls = 20
            gen = torch.Generator(device="cuda").manual_seed(T)
            x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16) * 0.1
            tile = ex.tile_for(H, I, act, T, dev, fmt, experts=E, top_k=K)
            rt = [kerngen.route(torch.randn(T, E, device="cuda", generator=gen), top_k=K, method="softmax_topk",
                                tile=tile) for _ in range(calls)]
            active = sum(int(torch.unique(r.topk_ids).numel()) for r in rt) / calls
            floor = active * 3 * H * I * per_weight / (bw * 1e12) * 1e6
            outs = [torch.empty(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda") for r in rt]
            acts = [torch.empty(r.tile_to_expert.shape[0] * tile, I, dtype=torch.bfloat16, device="cuda") for r in rt]
            prod = elementwise_producer()
            rule = ex.spec(H, I, tile, act, T, arch, fmt=fmt, a8=a8, experts=E, top_k=K)
            build = lambda p: launch_spec(p, tile, H, I, act, arch, fmt, "nk", a8)  # noqa: E731
            cands = [("rule", rule)]
            if a8:   # the weight-only rule beside it
                cands.append(("bf16-act", ex.spec(H, I, tile, act, T, arch, fmt=fmt)))
            if x16:
                cands.append(("rule-x16", build({**dict(rule.params), "f16x": True})))
            cands.append(("rule-nopf", build({**dict(rule.params), "prefetch": False})))
            if not a8:   # without early weight loads, the whole K steps with no bound checks
                cands.append(("nopf-lean", build({**dict(rule.params), "prefetch": False, "lean": True})))
            if (a8 or x16 or dict(rule.params).get("f16x")) and not dict(rule.params).get("one_launch"):
                # the rule with its first weights to L2 before the wait (one_launch has no wait between its GEMMs;
                # early_l2 takes no tickets: a tickets rule's grid stride)
                cands.append(("rule-early", build({**{k: v for k, v in dict(rule.params).items() if k != "tickets"},
                                                   "early_l2": True, **({} if a8 else {"f16x": True})})))
            if deep:   # 3-6 steps a load batch (with and without the next batch's loads issued first)
                for u, b, pf, mt in itertools.product((3, 4, 6), (3, 4), (False, True), (1, 2)):
                    cands.append((f"w4 u{u} b{b} t{mt}" + " nopf" * (not pf) + " h deep",
                                  build(dict(warps=4, unroll=u, blocks_per_sm=b, pdl=True, prefetch=pf,
                                             prefetch_x=True, f16x=True, **({"mtiles": 2} if mt == 2 else {}),
                                             **({"min_blocks": b} if b <= 4 else {})))))
            if fused:   # x quantized into shared memory by experts_gemm1, no prefetch copies: 24-32 warps an SM,
                #         one or two steps a load batch (two: 72-80 registers)
                for b, u, lean, a16 in itertools.product((6, 7, 8), (1, 2), (False, True), (False, True)):
                    cands.append((f"w4 u{u} b{b} fx2" + " lean" * lean + " a16" * a16,
                                  build(dict(warps=4, unroll=u, blocks_per_sm=b, min_blocks=b, pdl=True,
                                             prefetch=False, f16x=True, fused_x=2, act_f16=a16, lean=lean))))
                for b, u in itertools.product((6, 7, 8), (1, 2)):   # experts_gemm2's first weights toward L2 early
                    cands.append((f"w4 u{u} b{b} fx2 lean early",
                                  build(dict(warps=4, unroll=u, blocks_per_sm=b, min_blocks=b, pdl=True,
                                             prefetch=False, f16x=True, fused_x=2, act_f16=False, lean=True,
                                             early_l2=True))))
                if fmt == "mxfp4":   # experts_gemm1's mma columns each one 32-value group (gcol), with both GEMMs
                    #                  in one launch too (one_launch)
                    for b, u, extra in itertools.product((6, 7, 8), (1, 2), ({}, {"early_l2": True},
                                                                             {"one_launch": True})):
                        cands.append((f"w4 u{u} b{b} fx2 lean gcol" + "".join(f" {k}" for k in extra),
                                      build(dict(warps=4, unroll=u, blocks_per_sm=b, min_blocks=b, pdl=True,
                                                 prefetch=False, f16x=True, fused_x=2, act_f16=False, lean=True,
                                                 gcol=True, **extra))))
                    cands.append(("w3 u1 b11 fx2 lean gcol",   # 1452 CTAs: one round of gpt-oss-120b's 1440 items
                                  build(dict(warps=3, unroll=1, blocks_per_sm=11, min_blocks=11, pdl=True,
                                             prefetch=False, f16x=True, fused_x=2, act_f16=False, lean=True,
                                             gcol=True))))
                    for b, u, b2 in ((7, 1, None), (8, 1, None), (8, 2, 6)):   # two steps a load batch in
                        # experts_gemm1 alone (its registers allow them), and in experts_gemm2 at 6 CTAs (gemm2_blocks)
                        own = {"gemm2_blocks": b2} if b2 else {}
                        cands.append((f"w4 u{u} g1u2 b{b}" + f" g2b{b2}" * bool(b2) + " fx2 lean gcol",
                                      build(dict(warps=4, unroll=u, gemm1_unroll=2, blocks_per_sm=b, min_blocks=b,
                                                 pdl=True, prefetch=False, f16x=True, fused_x=2, act_f16=False,
                                                 lean=True, gcol=True, **own))))
                    for b, early in itertools.product((6, 7), (False, True)):   # 32 bytes of a row a lane (wide)
                        cands.append((f"w4 u1 b{b} fx2 lean gcol wide" + " early" * early,
                                      build(dict(warps=4, unroll=1, blocks_per_sm=b, min_blocks=b, pdl=True,
                                                 prefetch=False, f16x=True, fused_x=2, act_f16=False, lean=True,
                                                 gcol=True, wide=True, **({"early_l2": True} if early else {})))))
                # an item's K split 5 or 6 ways (at 64 registers an SM holds 32 warps: 6 CTAs of 5, 5 of 6)
                for (w, b), a16 in itertools.product(((5, 6), (6, 5)), (False, True)):
                    cands.append((f"w{w} u1 b{b} fx2 lean" + " a16" * a16,
                                  build(dict(warps=w, unroll=1, blocks_per_sm=b, min_blocks=b, pdl=True,
                                             prefetch=False, f16x=True, fused_x=2, act_f16=a16, lean=True))))
            if sweep and not deep and not fused:
                for w, u, b, px in itertools.product((4,), (1, 2), (4, 5, 6, 8), (False, True)):
                    cands.append((f"w{w} u{u} b{b}" + " x" * px + " h" * x16,
                                  build(dict(warps=w, unroll=u, blocks_per_sm=b, pdl=True, prefetch_x=px,
                                             **({"f16x": True} if x16 else {})))))
                if x16:   # two tiles of weight rows an item
                    for u, b, px in itertools.product((1,), (3, 4), (False, True)):
                        cands.append((f"w4 u{u} b{b} t2" + " x" * px + " h",
                                      build(dict(warps=4, unroll=u, blocks_per_sm=b, pdl=True, prefetch_x=px,
                                                 f16x=True, mtiles=2))))
                if x16:   # the shapes the rules take, with early_l2
                    for u, b, mt, pf, px in ((1, 4, 2, True, True), (1, 4, 2, True, False), (2, 4, 1, False, True),
                                             (1, 5, 1, True, True), (1, 3, 2, True, True)):
                        cands.append((f"w4 u{u} b{b} t{mt}" + " nopf" * (not pf) + " x" * px + " h early",
                                      build(dict(warps=4, unroll=u, blocks_per_sm=b, pdl=True, prefetch=pf,
                                                 prefetch_x=px, f16x=True, early_l2=True,
                                                 **({"mtiles": 2} if mt == 2 else {}),
                                                 **({"min_blocks": 4} if u == 2 else {})))))
                if x16:   # the same shapes with their CTAs taking items from a counter (tickets; the fp8 rule of
                    #     8-128 tokens), and two steps a batch without early weight loads (116 registers at fp8)
                    for u, pf in ((1, True), (2, False)):
                        cands.append((f"w4 u{u} b4 t2" + " nopf" * (not pf) + " x h tk",
                                      build(dict(warps=4, unroll=u, blocks_per_sm=4, pdl=True, prefetch=pf,
                                                 prefetch_x=True, f16x=True, mtiles=2, tickets=True))))
                if x16:   # no early weight loads (prefetch = false), a register bound from 6 CTAs
                    for u, b, mt in itertools.product((1, 2), (4, 6, 8), (1, 2)):
                        cands.append((f"w4 u{u} b{b} t{mt} nopf h",
                                      build(dict(warps=4, unroll=u, blocks_per_sm=b, pdl=True, prefetch=False,
                                                 prefetch_x=True, f16x=True, **({"mtiles": 2} if mt == 2 else {}),
                                                 **({"min_blocks": b} if b > 4 else {})))))
                if x16:   # two weight buffers taking turns (no copies between steps)
                    for mt, b, px in ((1, 6, False), (1, 6, True), (2, 4, True), (2, 3, True)):
                        cands.append((f"w4 u1 b{b} t{mt} pp" + " x" * px + " h",
                                      build(dict(warps=4, unroll=1, blocks_per_sm=b, pdl=True, prefetch_x=px,
                                                 f16x=True, pingpong=True,
                                                 **({"mtiles": 2} if mt == 2 else {}),
                                                 **({"min_blocks": 4} if (mt, b) == (2, 4) else {})))))
                if x16:   # 8 warps an item (half the steps a warp: a shorter chain of loads at few tokens)
                    for b, px, pp in ((3, False, False), (3, True, False), (3, True, True), (2, True, False)):
                        cands.append((f"w8 u1 b{b} t1" + " x" * px + " pp" * pp + " h",
                                      build(dict(warps=8, unroll=1, blocks_per_sm=b, pdl=True, prefetch_x=px,
                                                 f16x=True, **({"pingpong": True} if pp else {})))))
                if a8 or x16:   # register bounds
                    for b, px in itertools.product((6, 8), (False, True)):
                        cands.append((f"w4 u1 b{b} m{b}" + " x" * px + " h" * x16,
                                      build(dict(warps=4, unroll=1, blocks_per_sm=b, pdl=True, prefetch_x=px,
                                                 min_blocks=b, **({"f16x": True} if x16 else {})))))
            prebuild([s for _, s in cands])
            if deep:   # shapes that spill are not timed
                cands = [(label, s) for label, s in cands if label == "rule" or not spills(s)]
            res, seen = [], set()
            for label, s in cands:
                k = ex.Kernels(s, dev)
                ctas = ctas_per_sm(k)
                if label != "rule" and any(asked > held for asked, held in ctas.values()):
                    continue
                # (the grids launched: the rule's capped where it asks for more than fits)
                key = (tuple(sorted((a, b) for a, b in s.params if a not in GRID_PARAMS)),
                       tuple(sorted((n, min(asked, held)) for n, (asked, held) in ctas.items())))
                if key in seen and label != "rule":
                    continue
                seen.add(key)
                occ = "/".join(str(min(asked, held)) for asked, held in ctas.values())   # the CTAs an SM launched
                it = iter(range(10 ** 9))
                def step():
                    n = next(it); i = n % calls; (w13, s13), (w2, s2) = W[n % layers]
                    k(x, rt[i], w13, w2, outs[i], acts[i], interleaved=gpt, w13_scale=s13, w2_scale=s2,
                      a0=1.702 if gpt else 1.0, a1=7.0 if gpt else 0.0)
                us = timed(step, prod)
                res.append((us, label, occ, dict(s.params)))
            res.sort()
            rr = next(r for r in res if r[1] == "rule")
            print(f"{fmt}{'-a8' if a8 else ''} {m:13s} T={T:3d} tile {tile:2d} floor {floor:7.1f} | rule {rr[0]:7.1f} ({100*floor/rr[0]:3.0f}%) occ {rr[2]} {rr[3]}", flush=True)
            for us, label, occ, p in res[:6] if sweep else [r for r in res if r[1] in ("bf16-act", "rule-x16", "rule-early",
                                                                            "rule-nopf", "nopf-lean")]:
                print(f"      {us:7.1f} ({100*floor/us:3.0f}%) {label:12s} occ {occ} {p}", flush=True)
        W = None   # (this model's weights freed before the next)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
