"""kerngen tune: time every candidate kernel per token bucket on this GPU and write the winners as tier rules.

The output is a user tiers file (never the shipped tiers.toml) with a [provenance] table naming the GPU,
its SM count and compute capability, the toolchain versions and the date. Loading a file tuned on another
GPU warns. Ops without a candidate list keep their shipped rules.
"""
from __future__ import annotations

import datetime
import functools
import itertools
from pathlib import Path

import torch

from . import env, tiers
from .errors import CompileError, KerngenError, TierError
from .plan import spec_for, target_arch
from .timing import both_settings_us, graph_time_us

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def finalize_candidates():
    for bx, lpg, pdl, stream in itertools.product((8, 16, 32, 64), (2, 4, 8, 32), (True, False), (True, False)):
        yield "small_batch", dict(block_x=bx, loads_per_group=lpg, pdl=pdl, early_read=False,
                                  **({} if stream else {"stream": False}))
    for vpt, unroll in itertools.product((1, 2, 4), (2, 4, 8)):
        yield "large_batch", dict(vectors_per_thread=vpt, unroll=unroll, pdl=True, early_read=False)
    yield from cute_finalize_candidates()


def cute_finalize_candidates():
    """The CuTe DSL finalize (templates/finalize/cute.py): CTAs per token x threads x loads in flight."""
    for ctas, threads, max_loads in itertools.product((1, 4, 16), (128, 256), (8, 16)):
        yield "cute", dict(backend="cute", ctas=ctas, threads=threads, max_loads=max_loads, pdl=True)


def _time_finalize(model: tiers.Model, T: int, variant: str, params: dict) -> float:
    from .launch import current_stream
    from .ops import finalize as fin
    H, K, dev = model.hidden, model.top_k, torch.cuda.current_device()
    if variant == "small_batch" and T > 1024:
        return float("inf")  # one CTA per (token, slice): never competitive there, and slow to time
    rule = tiers.Rule(op="finalize", variant=variant, ranges={}, params=params)
    spec = spec_for(rule, *fin.tag_constants(H, K, model.dtype, model.weights_dtype), target_arch(dev))
    g, e2p, w, out = _moe_inputs(model, T)
    run = fin.bound(fin.kernel(spec, T, dev), g, e2p, w, out, H)
    call = lambda: run(current_stream(dev))
    return _checked_time(call, lambda: torch.equal(out.view(torch.int16), fin.reference(g, e2p, w).view(torch.int16)),
                         f"finalize {variant} {params}", T, both=True)


def _moe_inputs(model: tiers.Model, T: int):
    """Random expert outputs [T*K, H], a permutation [T, K], weights [T, K] and an output [T, H]."""
    H, K, dt = model.hidden, model.top_k, getattr(torch, model.dtype)
    g = torch.randn(T * K, H, device="cuda").to(dt)
    e2p = torch.randperm(T * K, device="cuda").view(T, K).int()
    w = torch.rand(T, K, device="cuda").to(getattr(torch, model.weights_dtype))
    return g, e2p, w, torch.empty(T, H, dtype=dt, device="cuda")


def _checked_time(call, correct, what: str, T: int, both: bool = False) -> float:
    """Run a candidate once, check its result with correct(), then time it: µs per call in a CUDA graph, back to
    back; with `both`, the slower of that and its time behind an elementwise producer (finalize: programmatic
    dependent launch wins back to back and costs behind a producer that does not trigger early)."""
    call()
    torch.cuda.synchronize()
    if not correct():
        raise KerngenError(f"tune: candidate {what} gave a wrong result at T={T}")
    return both_settings_us(call, calls=10, replays=15) if both else graph_time_us(call, calls=10, replays=15)


def tail_candidates():
    """Clusters of 1-8 CTAs a token, 128 or 256 threads, branch-free loads or not, 8 or 32 loads in flight; the
    branch-free clusters also with their sums by st.async (async_reduce)."""
    for cluster, threads, branch_free, max_loads, ar in itertools.product((1, 2, 4, 8), (128, 256), (True, False),
                                                                          (8, 32), (False, True)):
        if ar and (cluster == 1 or not branch_free):   # (the shipped cluster rules load branch-free)
            continue
        yield "tail", dict(backend="cute", threads=threads, cluster=cluster, max_loads=max_loads,
                           branch_free=branch_free, pdl=True, **({"async_reduce": True} if ar else {}))


def _time_tail(model: tiers.Model, T: int, variant: str, params: dict) -> float:
    """The tail as the shipped models call it (shared expert + residual), checked against the reference."""
    from .ops import tail
    H, K = model.hidden, model.top_k
    rule = tiers.Rule(op="tail", variant=variant, ranges={}, params=params)
    spec = tail.rule_spec(rule, H, K, model.dtype, model.weights_dtype, model.dtype, (True, True, False), target_arch())
    g, e2p, w, out = _moe_inputs(model, T)
    dt = out.dtype
    nw, sh, res = torch.rand(H, device="cuda").to(dt), torch.randn(T, H, device="cuda").to(dt), torch.randn(
        T, H, device="cuda").to(dt)
    fn = tail.kernel(spec)
    call = lambda: fn(g, e2p, w, sh, res, nw, out, None, None, 1e-6)
    return _checked_time(call, lambda: torch.allclose(
        out.float(), tail.reference(g, e2p, w, nw, shared=sh, residual=res)[0].float(), rtol=2e-2, atol=2e-2),
        f"tail {params}", T)


ROUTING_TILE = 128   # tools/bench's tile: the permutation is part of the time


def routing_candidates():
    # (32, 4): one CTA holds 8 token groups, so plain CTAs route up to 8 tokens at once with no cluster exchange
    # (slower than 8-CTA clusters on the H200, see docs/benchmarks.md; kept for GPUs where the exchange costs more)
    for warps, wpt in ((16, 2), (16, 4), (16, 8), (16, 16), (8, 8), (8, 4), (4, 4), (32, 4)):
        for clusters in (1, 4, 8):
            yield "fused", dict(warps=warps, warps_per_token=wpt, ctas=8, clusters=clusters, max_tokens=16)
        for clusters in (2, 8):   # plain CTAs: what one token wants (no cluster barriers)
            yield "fused", dict(warps=warps, warps_per_token=wpt, ctas=1, clusters=clusters, max_tokens=16)
    for warps, wpt in ((4, 1), (8, 1), (4, 4), (8, 2), (8, 4), (8, 8)):   # every shape the shipped rules use
        yield "topk", dict(warps=warps, warps_per_token=wpt)


def _time_routing(model: tiers.Model, T: int, variant: str, params: dict, ids_only: bool = False) -> float:
    """route(..., tile=128) with fp32 logits (and an fp32 bias for the bias methods), or with ids_only route()
    without a tile (ids and weights); ids checked exactly."""
    from .launch import current_stream
    from .ops import routing as rt
    from .ops.permute import RoutingWorkspace
    if variant == "fused" and T > params["max_tokens"]:
        return float("inf")
    E, K, dev = model.num_experts, model.top_k, torch.cuda.current_device()
    has_bias = model.routing in ("sigmoid_bias", "grouped_sigmoid_bias")
    tag, consts = rt.tag_constants(E, K, model.routing, model.n_group, model.topk_group, model.renormalize,
                                   "float32", "float32" if has_bias else "none", "float32")
    arch = target_arch(dev)
    spec = spec_for(tiers.Rule(op="routing", variant=variant, ranges={}, params=params), tag, consts, arch)
    r = rt.kernel(spec, T, dev, permute=not ids_only)
    logits = torch.randn(T, E, device="cuda")
    bias = torch.randn(E, device="cuda") * 0.05 if has_bias else None
    tile = None if ids_only else ROUTING_TILE
    ws = RoutingWorkspace(T, E, K, tile)
    rsf = float(model.routed_scaling_factor)
    call = lambda: r.run(current_stream(dev), logits, bias, ws, T, tile, 0, E, rsf)
    ref_ids, _ = rt.reference(logits, K, model.routing, bias=bias, n_group=model.n_group,
                              topk_group=model.topk_group, renormalize=model.renormalize, routed_scaling_factor=rsf)
    return _checked_time(call, lambda: torch.equal(ws.ids[:T].cpu(), ref_ids.int().cpu()),
                         f"routing {variant} {params} (ids{'' if ids_only else ', permuted'})", T)


EXPERTS_MAX_TOKENS = 256   # kerngen.experts' kernels serve decode batches; beyond, torch._grouped_mm (no rule)


def experts_formats(model: tiers.Model) -> tuple[str, ...]:
    """The experts rule formats tuned for `model`: bf16, the format its checkpoints ship in, and w8a8 for fp8."""
    return tuple(dict.fromkeys(("bf16", model.experts_format) + (("w8a8",) if model.experts_format == "fp8" else ())))


def experts_candidates(fmt: str = "bf16"):
    """kerngen.experts' launch shapes for weights in `fmt` (bf16, fp8, mxfp4, or w8a8: fp8 with fp8 activations):
    routing tiles of 8 and 16 rows; fp8 and MXFP4 also with f16x, two m16 tiles an item (mtiles), two weight
    buffers taking turns (pingpong), 8 warps an item, the shapes the shipped rules take with no early weight loads or
    with early_l2, and for 1-2 (or up to 8) tokens x quantized by the first GEMM itself (fused_x, act_f16, stage_act;
    also at 32 warps an SM, 64 registers without prefetch); the K loop's whole steps with no bound checks (lean);
    MXFP4 at 1-2 tokens with each 32-value group's own mma columns (gcol, also with two groups a lane: wide, and
    both GEMMs in one launch); w8a8 with early_l2. bf16 also the shipped rules' shapes as one launch (one_launch),
    tiles of 32 rows (GEMM1 at 5 CTAs an SM, GEMM2 at 8) and items of two m16 tiles of weight rows (mtiles). The
    shipped two-launch shapes of 3-256 tokens also with tickets (items from a counter)."""
    if fmt == "bf16":
        for tile, warps, unroll, bps in itertools.product((8, 16), (4, 8), (2, 4), (2, 4)):
            yield "mma", dict(tile=tile, warps=warps, unroll=unroll, blocks_per_sm=bps, pdl=True)
        yield "mma", dict(tile=8, warps=8, unroll=2, blocks_per_sm=4, one_launch=True)
        yield "mma", dict(tile=16, warps=4, unroll=2, blocks_per_sm=8, pdl=True, one_launch=True)
        yield "mma", dict(tile=32, warps=4, unroll=2, blocks_per_sm=8, gemm1_blocks=5, pdl=True)
        for tile, unroll in ((16, 1), (16, 2), (32, 1)):   # two m16 tiles an item share the activations
            yield "mma", dict(tile=tile, warps=4, unroll=unroll, blocks_per_sm=5 if tile == 16 else 4, mtiles=2,
                              pdl=True)
        # the 17-256-token shape with its CTAs taking items from a counter (tickets), registers bound to 8 CTAs
        yield "mma", dict(tile=16, warps=4, unroll=2, blocks_per_sm=8, min_blocks=8, pdl=True, tickets=True)
        return
    for tile, unroll, bps, px in itertools.product((8, 16), (1, 2), (4, 5, 6), (False, True)):
        base = dict(tile=tile, warps=4, unroll=unroll, blocks_per_sm=bps, pdl=True, prefetch_x=px)
        yield "mma", base
        if fmt in ("fp8", "mxfp4"):
            yield "mma", dict(base, f16x=True)
        if fmt == "w8a8" and tile == 8:
            yield "mma", dict(base, early_l2=True)
    if fmt in ("fp8", "mxfp4"):
        for tile, bps, px, early in itertools.product((8, 16), (3, 4), (False, True), (False, True)):
            yield "mma", dict(tile=tile, warps=4, unroll=1, blocks_per_sm=bps, pdl=True, prefetch_x=px, f16x=True,
                              mtiles=2, **({"early_l2": True} if early else {}))
        for tile, bps in ((8, 4), (16, 3)):   # the 3-256-token shapes with tickets, registers bound to their CTAs
            yield "mma", dict(tile=tile, warps=4, unroll=1, blocks_per_sm=bps, min_blocks=bps, pdl=True,
                              prefetch_x=True, f16x=True, mtiles=2, tickets=True)
        for early in (False, True):   # two steps a batch, no early weight loads, registers bound to 4 CTAs
            yield "mma", dict(tile=8, warps=4, unroll=2, blocks_per_sm=4, min_blocks=4, pdl=True, prefetch=False,
                              prefetch_x=True, f16x=True, **({"early_l2": True} if early else {}))
        for px, pp in itertools.product((False, True), (False, True)):   # 8 warps an item: half the steps a warp
            yield "mma", dict(tile=8, warps=8, unroll=1, blocks_per_sm=3, pdl=True, prefetch_x=px, f16x=True,
                              **({"pingpong": True} if pp else {}))
        for mt, bps, px in itertools.product((1, 2), (4, 6), (False, True)):   # two weight buffers taking turns
            if mt == 1 or bps == 4:
                yield "mma", dict(tile=8, warps=4, unroll=1, blocks_per_sm=bps, pdl=True, prefetch_x=px, f16x=True,
                                  pingpong=True, **({"mtiles": 2, "min_blocks": 4} if mt == 2 else {}))
        for act in ({"act_f16": True}, {"act_f16": False}, {"stage_act": True}):   # 1-2 tokens: x quantized by
            # experts_gemm1 itself; the intermediate as f16, as bf16, or its rows copied into shared memory
            yield "mma", dict(tile=8, warps=4, unroll=1, blocks_per_sm=6, pdl=True, f16x=True, fused_x=2, **act)
            yield "mma", dict(tile=8, warps=4, unroll=2, blocks_per_sm=4, min_blocks=4, pdl=True, prefetch=False,
                              prefetch_x=True, f16x=True, fused_x=2, **act)
        for warps, fx, f16 in itertools.product((4, 8), (2, 8), (True, False)):   # 32 warps an SM at 64 registers:
            if fx == 8 and warps == 4:   # (eight CTAs of eight fused rows: more than an SM's shared memory)
                continue   # one step a warp in flight (no copies between steps), latency hidden by the warps
            yield "mma", dict(tile=8, warps=warps, unroll=1, blocks_per_sm=32 // warps, min_blocks=32 // warps,
                              pdl=True, prefetch=False, f16x=True, fused_x=fx, act_f16=f16)
        # no early weight loads, the whole steps with no bound checks (lean): the 1-2-token shapes at 32 and 16
        # warps an SM, and two m16 tiles an item
        for few in (dict(unroll=1, blocks_per_sm=8, min_blocks=8, fused_x=2, act_f16=False),
                    dict(unroll=2, blocks_per_sm=4, min_blocks=4, fused_x=2, act_f16=False),
                    dict(unroll=2, blocks_per_sm=4, min_blocks=4, prefetch_x=True),
                    dict(unroll=1, blocks_per_sm=4, mtiles=2)):
            yield "mma", dict(tile=8, warps=4, pdl=True, prefetch=False, f16x=True, lean=True, **few)
        if fmt == "mxfp4":   # 1-2 tokens, experts_gemm1's mma columns each one group (gcol): one or two steps a
            # load batch, both GEMMs in one launch (one_launch), a lane reading 32 contiguous bytes of a row a step
            # (wide, at 7 CTAs: 3-6% slower on an H100), two steps a batch in experts_gemm1 alone (gemm1_unroll),
            # and in experts_gemm2 too at 6 CTAs, its own register bound (gemm2_blocks); 11 CTAs of 3 warps (one
            # round of gpt-oss-120b's 1440 experts_gemm1 items at one token)
            for unroll, bps, extra in ((1, 8, {}), (2, 7, {}), (2, 6, {}), (1, 8, {"one_launch": True}),
                                       (1, 7, {"wide": True}), (1, 8, {"gemm1_unroll": 2}),
                                       (2, 8, {"gemm1_unroll": 2, "gemm2_blocks": 6}), (1, 11, {"warps": 3})):
                yield "mma", dict(dict(tile=8, warps=4, unroll=unroll, blocks_per_sm=bps, min_blocks=bps, pdl=True,
                                       prefetch=False, f16x=True, lean=True, fused_x=2, act_f16=False, gcol=True),
                                  **extra)
        # any token count at tiles of 8 rows: 32 warps an SM at 64 registers, activations prefetched (fp8: no spills)
        yield "mma", dict(tile=8, warps=8, unroll=1, blocks_per_sm=4, min_blocks=4, pdl=True, prefetch=False,
                          prefetch_x=True, f16x=True)
        # up to 8 tokens: x in shared memory (and with stage_act the intermediate's rows too); the registers it frees
        # let two weight buffers take turns at 4 CTAs (pingpong)
        for px, stage, pp in itertools.product((False, True), (False, True), (False, True)):
            yield "mma", dict(tile=8, warps=4, unroll=1, blocks_per_sm=4, pdl=True, f16x=True, mtiles=2,
                              prefetch_x=px, fused_x=8, **({"stage_act": True} if stage else {}),
                              **({"pingpong": True, "min_blocks": 4} if pp else {}))


_expert_weights: dict[tuple, tuple] = {}   # (model, format) -> w13, w2, w13_scale, w2_scale (one layer, random)


def random_expert_weights(E: int, N: int, K: int, fmt: str):
    """Random CUDA weights [E, N, K] of one projection in `fmt` and their scales (None for bf16): bf16 N(0, 0.02);
    fp8 every e4m3 code but NaN with block scales below 1e-2 / 448; MXFP4 every byte with scale bytes 118..123."""
    if fmt == "bf16":
        return (torch.randn(E, N, K, device="cuda") * 0.02).to(torch.bfloat16), None
    if fmt == "fp8":
        w = torch.randint(0, 256, (E, N, K), dtype=torch.uint8, device="cuda")
        w[(w & 0x7F) == 0x7F] = 0
        return w.view(torch.float8_e4m3fn), torch.rand(E, N // 128, K // 128, device="cuda") * 1e-2 / 448
    return (torch.randint(0, 256, (E, N, K // 32, 16), dtype=torch.uint8, device="cuda"),
            torch.randint(118, 124, (E, N, K // 32), dtype=torch.uint8, device="cuda"))


def _expert_inputs(model: tiers.Model, wfmt: str):
    """One layer of random expert weights of `model` in `wfmt` (random_expert_weights): w13, w2, their scales, kept
    while one format is tuned."""
    key = (model.name, wfmt)
    if key not in _expert_weights:
        _expert_weights.clear()
        H, I = model.hidden, model.intermediate
        (w13, s13), (w2, s2) = (random_expert_weights(model.num_experts, n, k, wfmt) for n, k in ((2 * I, H), (H, I)))
        _expert_weights[key] = (w13, w2, s13, s2)
    return _expert_weights[key]


def _time_experts(model: tiers.Model, T: int, variant: str, params: dict, fmt: str = "bf16") -> float:
    """kerngen.experts' two GEMMs at this launch shape on one layer of random weights in `fmt`, each (token, k)
    output row checked against the reference within the GPU tests' tolerance."""
    import kerngen
    from .ops import experts as ex
    a8, wfmt = fmt == "w8a8", "fp8" if fmt == "w8a8" else fmt
    H, I, E, K, dev = model.hidden, model.intermediate, model.num_experts, model.top_k, torch.cuda.current_device()
    fused = params.get("fused_x", 0)
    if T > fused > 0:
        return float("inf")   # a build for calls of at most fused_x tokens
    spec = ex.rule_spec(tiers.Rule(op="experts", variant=variant, ranges={"tokens": (1, fused)} if fused else {},
                                   params=params), H, I, model.activation, target_arch(dev), wfmt, "nk", a8)
    k = ex.Kernels(spec, dev)
    w13, w2, s13, s2 = _expert_inputs(model, wfmt)
    g = torch.Generator(device="cuda").manual_seed(T)
    x = (torch.randn(T, H, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
    r = kerngen.route(torch.randn(T, E, device="cuda", generator=g), top_k=K, method="softmax_topk",
                      tile=params["tile"])
    out = torch.zeros(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
    gpt = model.activation == "gpt_oss"
    kw = dict(interleaved=gpt, w13_scale=s13, w2_scale=s2, a0=1.702 if gpt else 1.0, a1=7.0 if gpt else 0.0)
    call = lambda: k(x, r, w13, w2, out, **kw)  # noqa: E731

    def correct() -> bool:
        ref = ex.reference(x, r, w13, w2, activation=model.activation, interleaved=gpt, w13_scale=s13,
                           w2_scale=s2, fp8_activations=a8)
        rows = r.expanded_to_permuted.long().flatten()
        got, want = out[rows].float(), ref[rows].float()
        if a8:   # fp8 activations: norm-wise within 1% (an intermediate may quantize one e4m3 step apart)
            return bool(((got - want).norm() / want.norm()) < 1e-2)
        return bool(((got - want).abs() <= 2e-2 * want.abs() + 2e-2 * want.abs().max()).all())
    return _checked_time(call, correct, f"experts {fmt} {params}", T)


def latent_tail_candidates():
    """The fused kernel (one launch, or split: the norm kernel then the projection; with and without the first weight
    steps in registers before the wait; 2 or 4 steps a load batch) for up to 8 and 16 tokens (split builds reading n
    from global memory: up to 32), the split norm kernel at 2 and 4 CTAs a token with 8 or 16 rows loaded at once,
    the split projection with even shares of the rows (also over a grid that leaves each norm CTA's SM a slot:
    beside_norm), with n read from global memory, with a register bound beside the norm CTA, with less of the first
    item sent toward L2 before the wait, with the norm's sums handed over by st.async (norm_async), with each next
    item's first steps loaded before an item's epilogue (next_early), launched once the norm's routing or rows are
    in (late_launch), and at three CTAs an SM, and norm_gemm (any token count) at each cluster size with 2, 4, 8 or
    16 rows loaded at once (fewer: fewer registers, more norm CTAs an SM), h in fp32 or bf16, with 2 or 4 vectors a
    norm thread, and with norm_async at 2, 4 and 8 CTAs a token."""
    for mt, warps, unroll, bps, split, early in itertools.product((8, 16), (8, 16), (2, 4), (1, 2), (False, True),
                                                                  (False, True)):
        yield "fused", dict(max_tokens=mt, warps=warps, unroll=unroll, cluster=8, blocks_per_sm=bps, pdl=True,
                            **({"split": True} if split else {}), **({"early_weights": True} if early else {}))
    for mt, cluster, loads in itertools.product((8, 16), (2, 4), (8, 16)):   # the split norm kernel's shape
        yield "fused", dict(max_tokens=mt, warps=8, unroll=2, cluster=cluster, blocks_per_sm=2, pdl=True, split=True,
                            early_weights=True, **({"norm_loads": loads} if loads != 16 else {}))
    for mt, unroll, cluster in itertools.product((8, 16), (2, 4), (4, 8)):   # even shares of the rows a CTA
        yield "fused", dict(max_tokens=mt, warps=8, unroll=unroll, cluster=cluster, blocks_per_sm=2, pdl=True,
                            split=True, early_weights=True, even_rows=True)
    for mt, unroll, even in itertools.product((8, 16), (2, 4), (False, True)):   # n read from global memory
        yield "fused", dict(max_tokens=mt, warps=8, unroll=unroll, cluster=8, blocks_per_sm=2, pdl=True, split=True,
                            early_weights=True, n_global=True, **({"even_rows": True} if even else {}))
    for mt, loads in itertools.product((8, 16), (4, 8)):   # a register bound: the norm CTA beside two projections
        yield "fused", dict(max_tokens=mt, warps=8, unroll=4, cluster=8, blocks_per_sm=2, pdl=True, split=True,
                            early_weights=True, n_global=True, proj_registers=112, norm_loads=loads)
    for lines in (0, 8, 16, 24):   # less of the first item toward L2 before the wait, ahead of the norm's loads
        yield "fused", dict(max_tokens=8, warps=8, unroll=4, cluster=8, blocks_per_sm=2, pdl=True, split=True,
                            early_weights=True, n_global=True, l2_lines=lines)
    for lines in (16, None):   # even shares over a grid that leaves each norm CTA's SM a slot
        yield "fused", dict(max_tokens=8, warps=8, unroll=4, cluster=8, blocks_per_sm=2, pdl=True, split=True,
                            early_weights=True, n_global=True, even_rows=True, beside_norm=True,
                            **({"l2_lines": lines} if lines is not None else {}))
    for even in (False, True):   # the norm's sums by st.async (no cluster barrier's GPU-wide fence)
        yield "fused", dict(max_tokens=8, warps=8, unroll=4, cluster=8, blocks_per_sm=2, pdl=True, split=True,
                            early_weights=True, n_global=True, l2_lines=16, norm_async=True,
                            **({"even_rows": True, "beside_norm": True} if even else {}))
    for mt, unroll in itertools.product((8, 16), (2, 4)):   # the next item's first steps before an item's epilogue
        if mt == 16 and unroll == 4:
            continue   # (spills)
        yield "fused", dict(max_tokens=mt, warps=8, unroll=unroll, cluster=8, blocks_per_sm=2, pdl=True, split=True,
                            early_weights=True, n_global=True, l2_lines=16, next_early=True,
                            **({"norm_async": True} if mt == 8 else {}))
    for late, lines in ((1, 16), (2, 16), (2, 32), (2, 40)):   # the projection launched once the norm's routing
        #   (1) or rows (2) are in (late_launch): the shipped 1-8-token rule's shape, with more of the first item toward L2
        yield "fused", dict(max_tokens=8, warps=8, unroll=4, cluster=8, blocks_per_sm=2, pdl=True, split=True,
                            early_weights=True, n_global=True, l2_lines=lines, norm_async=True, next_early=True,
                            late_launch=late)
    for mt, unroll in itertools.product((16, 24, 32), (1, 2)):   # the split rule past 8 tokens (up to 4 n-blocks)
        yield "fused", dict(max_tokens=mt, warps=8, unroll=unroll, cluster=8, blocks_per_sm=2, pdl=True, split=True,
                            early_weights=True, n_global=True, l2_lines=16)
    for unroll in (1, 2):   # three projection CTAs an SM (no shared memory for n with n_global)
        yield "fused", dict(max_tokens=8, warps=8, unroll=unroll, cluster=8, blocks_per_sm=3, pdl=True, split=True,
                            early_weights=True, n_global=True)
    for cluster, loads, b16 in itertools.product((1, 2, 4, 8), (2, 4, 8, 16), (False, True)):
        yield "norm_gemm", dict(cluster=cluster, pdl=True, **({"norm_loads": loads} if loads != 16 else {}),
                                **({"gemm_bf16": True} if b16 else {}))
    for cluster, vectors, loads in itertools.product((1, 2), (2, 4), (4, 8)):   # fewer norm threads a token
        yield "norm_gemm", dict(cluster=cluster, pdl=True, norm_vectors=vectors, norm_loads=loads, gemm_bf16=True)
    for cluster, b16 in itertools.product((2, 4, 8), (False, True)):   # the norm's sums by st.async
        yield "norm_gemm", dict(cluster=cluster, pdl=True, norm_async=True, **({"gemm_bf16": True} if b16 else {}))
    for cluster, loads in itertools.product((1, 2), (2, 8, 16)):   # the adds folded into the GEMM (addmm)
        yield "norm_gemm", dict(cluster=cluster, pdl=True, **({"norm_loads": loads} if loads != 16 else {}),
                                gemm_bf16=True, addmm=True)


def _time_latent_tail(model: tiers.Model, T: int, variant: str, params: dict) -> float:
    """kerngen.latent_tail at this rule (shared and residual given) on random inputs of the model's latent width L
    (`hidden`) and width H (`model_hidden`), checked against the reference within the GPU tests' tolerance."""
    from .ops import latent_tail as lt
    if variant == "fused" and T > params["max_tokens"]:
        return float("inf")
    L, H, K, dev = model.hidden, model.model_hidden, model.top_k, torch.cuda.current_device()
    wd = model.weights_dtype
    spec = lt.rule_spec(tiers.Rule(op="latent_tail", variant=variant, ranges={}, params=params), L, H, K, wd,
                        target_arch(dev))
    k = lt.kernel(spec, T, dev)
    g = torch.Generator(device="cuda").manual_seed(T)
    gemm2 = torch.randn(T * K, L, device="cuda", generator=g).to(torch.bfloat16)
    e2p = torch.randperm(T * K, device="cuda", generator=g).view(T, K).int()
    w = torch.rand(T, K, device="cuda", generator=g).to(getattr(torch, wd))
    nw = (0.5 + torch.rand(L, device="cuda", generator=g)).to(torch.bfloat16)
    up = (torch.randn(H, L, device="cuda", generator=g) * L ** -0.5).to(torch.bfloat16)
    sh, res = (torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16) for _ in range(2))
    out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
    call = lambda: lt.run(k, gemm2, e2p, w, nw, up, sh, res, 1e-6, out)  # noqa: E731

    def correct() -> bool:
        ref = lt.reference(gemm2, e2p, w, nw, up, shared=sh, residual=res).float()
        rms = ref.pow(2).mean(-1, keepdim=True).sqrt()
        return bool(((out.float() - ref).abs() <= 2 ** -8 * ref.abs() + 2e-2 * rms).all())
    return _checked_time(call, correct, f"latent_tail {variant} {params}", T)


TUNERS = {"finalize": (finalize_candidates, _time_finalize), "tail": (tail_candidates, _time_tail),
          "routing": (routing_candidates, _time_routing), "experts": (experts_candidates, _time_experts),
          "latent_tail": (latent_tail_candidates, _time_latent_tail)}


def tune(model_name: str, ops, tokens=DEFAULT_TOKENS, progress: bool = True) -> list[tiers.Rule]:
    """Winning rules for `model_name` on this GPU, merged over consecutive token buckets."""
    tbl = tiers.load()
    model = tbl.model(model_name)
    tokens = [t for t in sorted(tokens) if model.tokens[0] <= t <= model.tokens[1]]
    rules: list[tiers.Rule] = []
    jobs = []   # (op, experts format or None, routing rules' permute or None, candidates, timer, token buckets)
    for op in ops:
        if op not in TUNERS:
            print(f"kerngen tune: no candidates for {op} yet; its shipped rules stay in force")
            continue
        candidates, timer = TUNERS[op]
        if op == "latent_tail" and not model.model_hidden:
            print(f"kerngen tune: {model_name} is not a latent model (no model_hidden); no latent_tail rules")
        elif op == "routing":   # calls without a tile (ids and weights: permute = false rules, tried first), then all
            jobs.append((op, None, False, list(candidates()), functools.partial(timer, ids_only=True), tokens))
            jobs.append((op, None, None, list(candidates()), timer, tokens))
        elif op != "experts":
            jobs.append((op, None, None, list(candidates()), timer, tokens))
        elif not model.intermediate:
            print(f"kerngen tune: {model_name} names no intermediate size; its experts rules stay in force")
        else:   # per format, up to the tokens the experts kernels serve
            for fmt in experts_formats(model):
                jobs.append((op, fmt, None, list(candidates(fmt)), functools.partial(timer, fmt=fmt),
                             [t for t in tokens if t <= EXPERTS_MAX_TOKENS]))
    for op, fmt, permute, cands, timer, tokens in jobs:
        bar = None
        if progress:
            from tqdm import tqdm
            kind = f" {fmt}" if fmt else " without a tile" if permute is False else ""
            bar = tqdm(total=len(cands) * len(tokens), desc=f"tune {model_name} {op}{kind}",
                       unit="run", leave=False, disable=None)   # only on a terminal (a redirected log gets no bar)
        winners, unfit = [], {}
        for T in tokens:
            best = None
            for variant, params in cands:
                try:
                    us = timer(model, T, variant, params)
                except (CompileError, TierError) as e:   # e.g. more token groups than the shared memory of E
                    # experts holds, or a shape this model's sizes refuse (fused rows too large)
                    unfit[(variant, str(params))] = e
                    us = float("inf")
                if best is None or us < best[0]:
                    best = (us, variant, params)
                bar and bar.update()
            if best[0] == float("inf"):
                raise KerngenError(f"tune: no {op} candidate compiles for {model_name}; first error:\n"
                                   f"{next(iter(unfit.values()))}")
            winners.append((T, *best))
        if bar:
            bar.close()
        for (variant, params), e in unfit.items():
            lines = str(e).splitlines()
            reason = next((line.strip() for line in lines if "error" in line), lines[0] if lines else "")
            print(f"kerngen tune: {op} {variant} {params} does not build for {model_name}, skipped ({reason})")
        rules += _merge(op, model, winners, _target(), (fmt,) if fmt else (), permute)
    return rules


def _target() -> str | None:
    """The arch of the GPU being tuned (None where torch sees none: the CPU tests drive tune() with stub timers)."""
    from .plan import target_arch
    return target_arch() if torch.cuda.is_available() else None


def _merge(op: str, model: tiers.Model, winners, arch: str | None = None, formats: tuple = (),
           permute: bool | None = None) -> list[tiers.Rule]:
    """One rule per run of buckets with the same winner; a boundary sits halfway between buckets. The rules
    serve `arch` only (the GPU they were timed on), experts rules the weight `formats` timed, up to the last
    bucket timed (beyond, no experts rule: torch._grouped_mm), routing rules the calls `permute` says."""
    out: list[tiers.Rule] = []
    lo = model.tokens[0]
    top = min(model.tokens[1], winners[-1][0]) if op == "experts" else model.tokens[1]
    for i, (T, us, variant, params) in enumerate(winners):
        last = i == len(winners) - 1
        if not last and (winners[i + 1][2], winners[i + 1][3]) == (variant, params):
            continue
        hi = top if last else (T + winners[i + 1][0]) // 2
        if "max_tokens" in params:   # a fused kernel never serves more tokens than it is sized for
            hi = min(hi, int(params["max_tokens"]))
        if params.get("fused_x"):   # nor an experts build quantizing x itself
            hi = min(hi, int(params["fused_x"]))
        shape = ({"num_experts": (model.num_experts, model.num_experts)} if op == "routing"
                 else {"hidden": (model.hidden, model.hidden)})
        ranges = {**shape, "tokens": (lo, hi)} if op == "experts" else {**shape, "top_k": (model.top_k,) * 2,
                                                                         "tokens": (lo, hi)}
        out.append(tiers.Rule(op=op, variant=variant, params=dict(params), ranges=ranges,
                              source=f"tuned: {us:.2f} us at T={T}", arch=(arch,) if arch else (),
                              formats=tuple(formats), permute=permute))
        lo = hi + 1
    return out


def provenance() -> dict:
    from .compile import nvrtc_version
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"gpu": p.name, "sm_count": p.multi_processor_count, "compute_capability": f"{p.major}.{p.minor}",
            "nvrtc": nvrtc_version(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def _toml(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write(path: Path, model_name: str, rules: list[tiers.Rule]) -> None:
    path = Path(path).resolve()
    if path == env.shipped_tiers().resolve():
        raise KerngenError(f"tune: refusing to overwrite the shipped {path}; write a user tiers file and point "
                           "KERNGEN_TIERS at it")
    lines = ["# Tuned by `kerngen tune`; load with KERNGEN_TIERS=" + str(path), "schema = 1", "",
             "[provenance]"]
    lines += [f"{k} = {_toml(v)}" for k, v in provenance().items()]
    lines.append(f'model = "{model_name}"')
    for r in rules:
        lines += ["", f"# {r.source}", "[[tier]]", f'op = "{r.op}"', f'variant = "{r.variant}"']
        lines += [f"{k} = {_toml(list(v))}" for k, v in r.ranges.items()]
        if r.arch:
            lines.append(f"arch = {_toml(list(r.arch))}")
        if r.formats:
            lines.append(f"formats = {_toml(list(r.formats))}")
        if r.permute is not None:
            lines.append(f"permute = {_toml(r.permute)}")
        lines.append("params = { " + ", ".join(f"{k} = {_toml(v)}" for k, v in r.params.items()) + " }")
    text = "\n".join(lines) + "\n"
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tiers.parse(tmp)  # what we write must load
    tmp.replace(path)
