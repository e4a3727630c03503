#!/usr/bin/env python3
"""kerngen.experts against torch._grouped_mm: the two expert projections of a decode step, CUDA graphs.

    python3 -m tools.bench.experts [--models qwen3-30b-a3b,...] [--tokens 1,8,64] [--format bf16|fp8|mxfp4]
                                   [--layout nk|kn] [--layers 4] [--peer DIR] [--sweep | --rule k=v,...] [--json FILE]
    python3 -m tools.bench.experts --format fp8 --models deepseek-v3,kimi-k2 --tokens 1,8,64 --peer .peer
                                   [--fp8-activations]
    python3 -m tools.bench.experts --format mxfp4 --models gpt-oss-120b,kimi-k3 --tokens 1,8,64 [--sweep]

Both run on the same inputs in the same process: one graph captures `calls` steps, each with its own routing
(random logits), so consecutive steps read different experts, as the layers of a model do. Each step follows a
producer kernel (an elementwise write of 4 MB, as an attention output projection leaves, that does not
trigger early) unless --chained; its time is taken off. The floor is the step's active expert weight bytes at the
streaming-read bandwidth (a kernel that only reads, lib.read_bandwidth_tbs); "read" is that kernel launched twice a
step after the same producer, over as many bytes of w13 and of w2 as the floor counts (the first experts' storage,
the layers in turn): what two launches' ramp-up and drain leave of the floor. Every result is checked against
kerngen's torch reference before it is timed. --sweep times every candidate launch shape of the format
(CANDIDATES) at each case and prints the best (for the tier table); --rule times one launch shape at every T (past
the rules too) beside the tier table's rule, on the same inputs.

--format fp8 / mxfp4 quantizes the weights (fp8: e4m3 with a scale per 128 x 128 block; mxfp4: e2m1 with an e8m0
scale per 32 values) and runs kerngen.experts' builds for them at the format's tile; the floor is then the quantized
weight bytes plus the scale bytes of the active experts. Beside them, on the same weights dequantized to bf16 (each
layer's), kerngen.experts' bf16 kernels (the tier table's bf16 rule at that T, `bf16_us`) and torch._grouped_mm.
With --peer DIR (a folder holding triton_fused_moe.py: vLLM's Triton fused-MoE GEMM, re-typed to need only torch and
triton) the Triton GEMMs vLLM runs time beside them: its bf16 fused_moe_kernel (the best of its decode config sweep
for each GEMM, blocks of 32 and 64 rows too from 8 routed rows an expert, the activation kernel between them not
timed) or, for fp8, its block-scaled w8a8 GEMMs (the best of
18 configs for each GEMM, activation quantization and the activation not timed); both are checked after timing, and
the configs chosen are in the row (`peer_cfg`).
--fp8-activations (fp8) also times kerngen.experts(..., fp8_activations=True), checked against the reference that
quantizes the activations the same way (`a8_us`); its two quantizing launches are timed with it.
--layout kn feeds kerngen.experts the weights as transposed views of [E, H, 2I] / [E, I, H] (transformers' gpt-oss
and Llama-4 layout; bf16). --layers L cycles the weights of L layers (fewer where they would not fit, the bf16
copies of quantized ones included) so no step finds its experts in L2.
"""
from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import os
from concurrent.futures import ProcessPoolExecutor


import torch

import kerngen
from .lib import elementwise_producer, graph_time_us, read_bandwidth_tbs, require_gpu, stream_reader, timed
from kerngen import jit
from kerngen.errors import TierError
from kerngen.ops import experts as ex
from kerngen.plan import target_arch
from kerngen.tiers import Rule, check_params

# name: (H, I, E, K, activation, interleaved gate/up and biases) at each model's intermediate size
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, "silu", False),
    "qwen3-235b-a22b": (4096, 1536, 128, 8, "silu", False),
    "gpt-oss-120b": (2880, 2880, 128, 4, "gpt_oss", True),
    "deepseek-v3": (7168, 2048, 256, 8, "silu", False),
    "kimi-k2": (7168, 2048, 384, 8, "silu", False),   # fp8 checkpoints: run it by name
    "kimi-k3": (3584, 2048, 896, 16, "situglu", False),
    "llama-4-maverick": (5120, 8192, 128, 1, "silu", False),   # 32 GB a layer: run it by name
}
DEFAULT = ("qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3", "kimi-k3")
FORMATS = ("bf16", "fp8", "mxfp4")
BYTES_PER_WEIGHT = {"bf16": 2.0, "fp8": 1.0 + 4 / 128 ** 2, "mxfp4": 0.5 + 1 / 32}   # scales included


def _candidates(fmt: str) -> list[dict]:
    """The launch shapes --sweep times for weights in `fmt`. Quantized builds take a 128-wide K step a warp: unroll is
    the K steps whose weight loads a lane issues before converting them; min_blocks (absent: no bound) is the
    __launch_bounds__ minimum of CTAs an SM, a register bound, tried at blocks_per_sm."""
    if fmt == "bf16":   # (and items of two m16 tiles of weight rows: mtiles)
        return [dict(warps=w, unroll=u, blocks_per_sm=b, pdl=d) for w, u, b, d in
                itertools.product((4, 8), (2, 4), (4, 8), (False, True))] + \
               [dict(warps=4, unroll=u, blocks_per_sm=b, mtiles=2, pdl=True) for u, b in itertools.product((1, 2), (4, 5))]
    unrolls = {"fp8": (1, 2, 4), "mxfp4": (2, 4, 8)}[fmt]
    return [dict(warps=w, unroll=u, blocks_per_sm=b, **({"min_blocks": b} if bound else {}), pdl=True)
            for w, u, b, bound in itertools.product((4, 8), unrolls, (2, 3, 4), (False, True))]


CANDIDATES = {fmt: _candidates(fmt) for fmt in FORMATS}
# The Triton fp8 GEMMs' configs, tried for each GEMM
PEER_FP8_CONFIGS = [dict(block_n=n, stages=s, warps=w)
                    for n, s, w in itertools.product((32, 64, 128), (3, 4, 5), (4, 8))]
# The Triton fp8 peer's check: max |error| <= PEER_FP8_TOL * max |reference|. It quantizes x and the intermediate to
# e4m3 per group of 128 (3 mantissa bits: ~2.5% rms each), so its output is off by ~4.4% rms of the output's rms; in
# 560 CPU simulations of its arithmetic at these shapes (8-64 rows) max |error| / max |reference| was 0.039-0.063
# (mean 0.044), so 6e-2 would now and then stop a run on a correct peer. A wrong scale, expert or row is off by O(1).
PEER_FP8_TOL = 1e-1


def floor_us(active: float, H: int, I: int, fmt: str, bw_tbs: float) -> float:
    """µs to read `active` experts' weights (3·H·I each in `fmt`, their scales included) at bw_tbs TB/s."""
    return active * 3 * H * I * BYTES_PER_WEIGHT[fmt] / (bw_tbs * 1e12) * 1e6


def prefix(w: torch.Tensor, nbytes: float) -> torch.Tensor:
    """The first `nbytes` (at most all of them, whole 16-byte vectors) of a weight tensor's storage, as bytes (a
    transposed view's contiguous storage read as it lies)."""
    t = w if w.is_contiguous() else w.transpose(1, 2)
    flat = t.reshape(-1).view(torch.uint8)
    return flat[: min(int(nbytes), flat.numel()) // 16 * 16]


def layer_bytes(H: int, I: int, E: int, fmt: str) -> float:
    """Device bytes a layer's weights take here: as kerngen.experts reads them, and for a quantized format their bf16
    copies too (kerngen's bf16 kernels and torch._grouped_mm read those)."""
    return 3 * E * H * I * (BYTES_PER_WEIGHT[fmt] + (2.0 if fmt != "bf16" else 0.0))


def fit_layers(want: int, free: int, H: int, I: int, E: int, fmt: str) -> int:
    """The layers of weights cycled: `want`, or as many as half of `free` bytes hold (at least one)."""
    return max(1, min(want, int(0.5 * free // layer_bytes(H, I, E, fmt))))


def tile_at(name: str, T: int, fmt: str) -> int:
    """The routing tile of kerngen.experts' rule for `fmt` weights at T (16 past the rules)."""
    H, I, E, K, act, _ = SHAPES[name]
    return ex.tile_for(H, I, act, T, 0, fmt, experts=E, top_k=K) or 16


def _build(spec):
    jit.build(spec)
    return spec.tag


def weights(H, I, E, bias, gen):
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="cuda").normal_(0, H ** -0.5, generator=gen)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device="cuda").normal_(0, I ** -0.5, generator=gen)
    b13 = torch.randn(E, 2 * I, device="cuda", generator=gen).to(torch.bfloat16) * 0.1 if bias else None
    b2 = torch.randn(E, H, device="cuda", generator=gen).to(torch.bfloat16) * 0.1 if bias else None
    return w13, w2, b13, b2


def layer_weights(w13, w2, H, I, E, fmt, layers, gen) -> list[tuple]:
    """`layers` layers' weights as kerngen.experts reads them in `fmt`, (w13, w2, w13_scale, w2_scale) each: the first
    layer's from w13, w2, the others' drawn from `gen` (each one's bf16 weights dropped once quantized)."""
    quant = []
    for layer in range(layers):
        if layer:
            w13, w2 = weights(H, I, E, False, gen)[:2]
        (q13, s13), (q2, s2) = quantize(w13, fmt), quantize(w2, fmt)
        quant.append((q13, q2, s13, s2))
    return quant


def quantize(w: torch.Tensor, fmt: str, chunk: int = 8):
    """bf16 weights [E, N, K] as kerngen.experts takes them in `fmt`: (weights, scales), or (w, None) for bf16.
    Quantized `chunk` experts at a time (the fp32 temporaries of a whole layer would not fit beside the weights)."""
    if fmt == "bf16":
        return w, None
    parts = [_quantize(w[e:e + chunk], fmt) for e in range(0, w.shape[0], chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def dequantize(w: torch.Tensor, scale: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """kerngen's dequantized weights in bf16, `chunk` experts at a time (its fp32 result would not fit), written into
    one tensor (chunks and their concatenation would hold the layer twice)."""
    out = None
    for e in range(0, w.shape[0], chunk):
        d = ex.dequantize(w[e:e + chunk], scale[e:e + chunk])
        if out is None:
            out = torch.empty((w.shape[0], *d.shape[1:]), dtype=torch.bfloat16, device=w.device)
        out[e:e + chunk] = d   # rounded to bf16 as .to(torch.bfloat16) rounds
    return out


def _quantize(w: torch.Tensor, fmt: str):
    E, N, K = w.shape
    if fmt == "fp8":
        b = w.float().view(E, N // 128, 128, K // 128, 128)
        sc = b.abs().amax(dim=(2, 4)).clamp_min(1e-12) / 448.0
        return (b / sc[:, :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(E, N, K), sc.contiguous()
    g = w.float().view(E, N, K // 32, 32)   # mxfp4: the scale is the power of two that brings the group under 6
    e = torch.ceil(torch.log2(g.abs().amax(-1).clamp_min(2.0 ** -100) / 6.0)).clamp(-125, 125)
    v = g / torch.exp2(e)[..., None]
    lut = torch.tensor(ex.E2M1[:8], device=w.device)
    code = (v.abs()[..., None] - lut).abs().argmin(-1) | ((v < 0).long() << 3)
    code = code.view(E, N, K // 32, 16, 2).to(torch.uint8)
    return (code[..., 0] | (code[..., 1] << 4)).contiguous(), (e + 127).to(torch.uint8).contiguous()


def grouped_step(x, r, w13, w2, b13, b2, act):
    """What a client writes with torch._grouped_mm (tile-1 routing: no padding rows)."""
    xs = x[r.permuted_to_token]
    h = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=r.expert_offsets[1:])
    e = r.tile_to_expert.long()
    if b13 is not None:
        h = h + b13[e]
    a = act(h.float()).to(torch.bfloat16)
    y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=r.expert_offsets[1:])
    return y if b2 is None else y + b2[e]



def case(name, T, bw, args, kernels_of, bf16_kernel):
    gc.collect()   # (a peer config the compiler refused leaves its traceback's frames, and their tensors, in a cycle)
    torch.cuda.empty_cache()   # the last case's weights go back to the driver before its free memory is read
    H, I, E, K, act_name, gpt = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(T)
    w13, w2, b13, b2 = weights(H, I, E, gpt, gen)
    fmt = args.format
    free = torch.cuda.mem_get_info()[0]
    layers = fit_layers(args.layers, free, H, I, E, fmt)
    quant = layer_weights(w13, w2, H, I, E, fmt, layers, gen)   # (w13, w2, w13_scale, w2_scale) a layer
    bf = None   # quantized formats: each layer's weights as kerngen reads them, dequantized to bf16
    if fmt != "bf16":   # kerngen's bf16 kernels read them; the grouped GEMM and the check layer 0's
        del w13, w2
        bf = [(dequantize(q[0], q[2]), dequantize(q[1], q[3])) for q in quant]
        w13, w2 = bf[0]
    if args.layout == "kn":   # the same values stored [E, H, 2I] / [E, I, H], handed over as transposed views
        quant = [(transposed(q[0]), transposed(q[1]), *q[2:]) for q in quant]
    calls = 20
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    logits = [torch.randn(T, E, device="cuda", generator=gen) for _ in range(calls)]
    tile = tile_at(name, T, fmt)
    rt = [kerngen.route(lg, top_k=K, method="softmax_topk", tile=tile) for lg in logits]
    r1 = [kerngen.route(lg, top_k=K, method="softmax_topk", tile=1) for lg in logits]
    kw = dict(activation=act_name, interleaved=gpt, b13=b13, b2=b2)
    a0, a1 = (1.702, 7.0) if act_name == "gpt_oss" else (1.0, 0.0)
    act = lambda h: ex.activate(h, I, act_name, gpt, 1.702, 7.0, 1.0, 0.0)  # noqa: E731
    active = sum(int(torch.unique(r.topk_ids).numel()) for r in r1) / calls
    floor = floor_us(active, H, I, fmt, bw)
    producer = elementwise_producer()   # a 4 MB write, no early trigger

    sets = {}

    def routed(t):
        """The routings of the steps' logits at tile t, their output and intermediate buffers, routing 0's
        reference rows and which rows hold one (kept per tile)."""
        if t not in sets:
            r = rt if t == tile else [kerngen.route(lg, top_k=K, method="softmax_topk", tile=t) for lg in logits]
            sets[t] = (r, [torch.zeros(q.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda") for q in r],
                       [torch.empty(q.tile_to_expert.shape[0] * t, I, dtype=torch.bfloat16, device="cuda") for q in r],
                       ex.reference(x, r[0], w13, w2, **kw), r[0].permuted_to_token >= 0)
        return sets[t]

    ref = routed(tile)[3]
    ref_tk = ref[rt[0].expanded_to_permuted.flatten().long()]   # the reference rows in (token, slot) order

    def check(got, what, r0, want, ok):
        err = (got[ok].float() - want[ok].float()).abs().max().item()
        scale = want[ok].float().abs().max().item()
        if not err <= 2e-2 * max(scale, 1.0):
            raise SystemExit(f"{name} T={T} {what}: max error {err} against the reference (scale {scale})")

    def check_a8(got, what, r0, _want, ok):   # fp8 activations: against the reference quantizing them the same way
        want = ex.reference(x, r0, quant[0][0], quant[0][1], w13_scale=quant[0][2], w2_scale=quant[0][3],
                            fp8_activations=True, **kw)[ok].float()
        g = got[ok].float()
        rel, worst = ((g - want).norm() / want.norm()).item(), ((g - want).abs().max() / want.abs().max()).item()
        if not (rel < 1e-2 and worst < 5e-2):
            raise SystemExit(f"{name} T={T} {what}: error {rel} (norm), {worst} (max) against the fp8 reference")

    def kerngen_us(label, k, ws, checker=check, t=tile):
        """kerngen.experts' kernels `k` (built for routing tile t) checked on layer 0, routing 0, then timed over
        the layers' weights ws ((w13, w2, scale keywords) a layer) and the routings, each step on the next of both."""
        rts, outs, acts, want, ok = routed(t)
        outs[0].zero_()
        k(x, rts[0], ws[0][0], ws[0][1], outs[0], acts[0], interleaved=gpt, b13=b13, b2=b2, a0=a0, a1=a1, **ws[0][2])
        torch.cuda.synchronize()
        checker(outs[0], label, rts[0], want, ok)
        it = iter(range(10 ** 9))

        def step():
            n = next(it)
            i, (a, b, skw) = n % calls, ws[n % len(ws)]
            k(x, rts[i], a, b, outs[i], acts[i], interleaved=gpt, b13=b13, b2=b2, a0=a0, a1=a1, **skw)
        return timed(step, producer, args.chained)

    g0 = grouped_step(x, r1[0], w13, w2, b13, b2, act)
    # the grouped step's rows are in tile-1 permuted order: compare through expanded_to_permuted
    e1 = r1[0].expanded_to_permuted.flatten().long()
    gerr = (g0[e1].float() - ref_tk.float()).abs().max().item()
    assert gerr <= 2e-2 * max(ref.float().abs().max().item(), 1.0), f"{name} T={T} grouped_mm error {gerr}"
    it = iter(range(10 ** 9))
    gstep = lambda: grouped_step(x, r1[next(it) % calls], w13, w2, b13, b2, act)  # noqa: E731
    grouped_us = timed(gstep, producer, args.chained)
    # "read": two launches of a kernel that only reads (the read-bandwidth probe's), w13's and w2's first bytes, as
    # many as the floor counts (the active experts' weights and scales), the layers in turn
    read, per = stream_reader(), active * H * I * BYTES_PER_WEIGHT[fmt]
    spans = [(prefix(q[0], 2 * per), prefix(q[1], per)) for q in quant]
    steps = iter(range(10 ** 9))

    def read_step():
        a, b = spans[next(steps) % len(spans)]
        read(a)
        read(b)
    read_us = timed(read_step, producer, args.chained)
    bf16_us = None
    if bf is not None and (k16 := bf16_kernel(H, I, tile, act_name, T, E, K)) is not None:
        bf16_us = kerngen_us("bf16 " + k16[0], k16[1], [(a, b, {}) for a, b in bf])
    peer = (peer_fp8 if fmt == "fp8" else peer_bf16)(args, x, r1, quant, K, act, producer, calls, b13, b2, ref_tk)
    peer_us, peer_cfg = peer or (None, None)
    ws = [(q[0], q[1], dict(w13_scale=q[2], w2_scale=q[3]) if fmt != "bf16" else {}) for q in quant]
    a8_us = None
    if fmt == "fp8" and args.fp8_activations:   # the w8a8 rule, at the routing's tile
        s8 = ex.spec(H, I, tile, act_name, T, target_arch(0), fmt="fp8", a8=True, experts=E, top_k=K)
        a8_us = kerngen_us("w8a8", ex.Kernels(s8, 0), ws, check_a8)
    rows = []
    for label, k in kernels_of(H, I, tile, act_name, T, E, K):
        rows.append(dict(model=name, T=T, tile=k.tile, kernel=label, us=kerngen_us(label, k, ws, t=k.tile),
                         grouped_us=grouped_us,
                         floor_us=floor, read_us=read_us, active=active, format=fmt, layers=layers,
                         layout=args.layout,
                         peer_us=peer_us, bf16_us=bf16_us, peer_cfg=peer_cfg, a8_us=a8_us))
    return rows


def transposed(w: torch.Tensor) -> torch.Tensor:
    """The same values stored [E, K, N], as its transposed view [E, N, K] (transformers' gpt-oss / Llama-4)."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


@functools.lru_cache(maxsize=None)
def _peer(folder: str):
    import importlib.util
    spec = importlib.util.spec_from_file_location("triton_fused_moe", os.path.join(folder, "triton_fused_moe.py"))
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return peer


def _best_config(run, configs):
    """The config under which run(n, cfg) (the graph's n-th call) is fastest, timed alone; those the compiler
    refuses are skipped."""
    res, why = [], None
    for cfg in configs:
        it = iter(range(10 ** 9))
        try:
            res.append((graph_time_us(lambda: run(next(it), cfg), calls=10, replays=10), cfg))
        except Exception as e:   # a config the compiler refuses
            why = e
    if not res:
        raise SystemExit(f"the Triton peer: every config failed, the last with {type(why).__name__}: {why}")
    return min(res, key=lambda r: r[0])[1]


def peer_bf16_configs(decode, T: int, K: int, E: int) -> list[tuple[int, ...]]:
    """The Triton bf16 peer's (block_m, block_n, block_k, warps, stages) sweep: vLLM's decode sweep `decode` (block_m
    16) and, from 8 routed rows an expert on average (T K >= 8 E), blocks of 32 and 64 rows at 4 or 8 warps too, the
    sizes vLLM's tuned configs take at larger batches (fewer blocks re-reading an expert's weights)."""
    wider = [(bm, bn, bk, w, st) for bm in (32, 64) for bn in (64, 128) for bk in (64, 128) for w in (4, 8)
             for st in (3, 4)] if T * K >= 8 * E else []
    return list(decode) + wider


def peer_bf16(args, x, r1, quant, K, act, producer, calls, b13, b2, ref_tk):
    """vLLM's Triton bf16 fused-MoE GEMMs (fused_moe_kernel over its moe_align_block_size layout at the config's
    block_m): the best config of each GEMM from `peer_bf16_configs` (its own sweep, each timed alone), then both
    GEMMs timed as one step (the activation between them not counted). Checked after timing, with the activation and
    biases, against the reference rows. (µs, [GEMM1's config, GEMM2's]); None without --peer or for another format.
    """
    if not args.peer or args.format != "bf16":
        return None
    peer = _peer(args.peer)
    T, H = x.shape
    w13s = [q[0].contiguous() if args.layout == "kn" else q[0] for q in quant]   # the peer reads [E, N, K]
    w2s = [q[1].contiguous() if args.layout == "kn" else q[1] for q in quant]
    E, I = w13s[0].shape[0], w2s[0].shape[2]
    configs = peer_bf16_configs(peer.CONFIGS, T, K, E)
    aligned = {bm: [peer.align(r.topk_ids, E, bm) for r in r1] for bm in sorted({c[0] for c in configs})}
    c1 = torch.empty(T * K, 2 * I, dtype=torch.bfloat16, device="cuda")
    a1 = torch.empty(T * K, I, dtype=torch.bfloat16, device="cuda")
    c2 = torch.empty(T * K, H, dtype=torch.bfloat16, device="cuda")
    ids = [r.topk_ids.long() for r in r1]
    cfg1 = _best_config(lambda n, cfg: peer.gemm(x, w13s[n % len(w13s)], c1, aligned[cfg[0]][n % calls], K, cfg),
                        configs)
    cfg2 = _best_config(lambda n, cfg: peer.gemm(a1, w2s[n % len(w2s)], c2, aligned[cfg[0]][n % calls], 1, cfg),
                        configs)
    al1, al2 = aligned[cfg1[0]], aligned[cfg2[0]]   # (each GEMM its own block size, to the peer's advantage)
    it = iter(range(10 ** 9))

    def step():   # the two GEMMs only: its activation kernel (and biases) not counted, to the peer's advantage
        n = next(it)
        i = n % calls
        peer.gemm(x, w13s[n % len(w13s)], c1, al1[i], K, cfg1)
        peer.gemm(a1, w2s[n % len(w2s)], c2, al2[i], 1, cfg2)
    us = timed(step, producer, args.chained)
    peer.gemm(x, w13s[0], c1, al1[0], K, cfg1)   # layer 0, routing 0: the rows the reference has
    h = c1.float() if b13 is None else c1.float() + b13[ids[0].flatten()].float()
    a1.copy_(act(h).to(torch.bfloat16))
    peer.gemm(a1, w2s[0], c2, al2[0], 1, cfg2)
    y = (c2 if b2 is None else c2 + b2[ids[0].flatten()]).float()
    err = (y - ref_tk.float()).abs().max().item()
    if not err <= 2e-2 * max(ref_tk.float().abs().max().item(), 1.0):
        raise SystemExit(f"the Triton peer: max error {err} against the reference")
    return us, [cfg1, cfg2]


def peer_fp8(args, x, r1, quant, K, act, producer, calls, b13, b2, ref_tk):
    """vLLM's Triton fp8 block-scaled GEMMs (w8a8: e4m3 weights with a scale per 128 x 128 block, activations
    quantized to e4m3 per token group of 128; block_m 16): the best of PEER_FP8_CONFIGS for each GEMM, each timed
    alone on inputs quantized beforehand (GEMM2's: GEMM1's rows of layer 0, routing 0, activated and quantized), then
    both GEMMs timed as one step at those configs. Not timed, to the peer's advantage: the quantization of x and of
    the intermediate, and the activation between the GEMMs (kerngen's kernels do all three inside theirs). Checked
    after timing: GEMM2's rows of layer 0, routing 0 (the activation and biases added as peer_bf16 adds them) against
    the reference's, within PEER_FP8_TOL of its largest value (w8a8 rounding). (µs, [GEMM1's config, GEMM2's]);
    None without --peer or for another format."""
    if not args.peer or args.format != "fp8":
        return None
    peer = _peer(args.peer)
    T, H = x.shape
    E, I = quant[0][0].shape[0], quant[0][1].shape[2]
    aligned = [peer.align(r.topk_ids, E, 16) for r in r1]
    ids0 = r1[0].topk_ids.flatten().long()
    c1 = torch.empty(T * K, 2 * I, dtype=torch.bfloat16, device="cuda")
    c2 = torch.empty(T * K, H, dtype=torch.bfloat16, device="cuda")
    xq, xs = peer.quant_fp8_groups(x)

    def gemm1(n, cfg):
        q = quant[n % len(quant)]
        peer.gemm_fp8_block(xq, xs, q[0], q[2], c1, aligned[n % calls], K, **cfg)

    def gemm2(n, cfg):
        q = quant[n % len(quant)]
        peer.gemm_fp8_block(hq, hs, q[1], q[3], c2, aligned[n % calls], 1, **cfg)

    def intermediate(cfg):   # GEMM2's input: GEMM1's rows of layer 0, routing 0, activated and quantized as vLLM does
        gemm1(0, cfg)
        h = c1.float() if b13 is None else c1.float() + b13[ids0].float()
        return peer.quant_fp8_groups(act(h).to(torch.bfloat16))

    cfg1 = _best_config(gemm1, PEER_FP8_CONFIGS)
    hq, hs = intermediate(cfg1)
    cfg2 = _best_config(gemm2, PEER_FP8_CONFIGS)
    it = iter(range(10 ** 9))

    def step():   # the two GEMMs only
        n = next(it)
        gemm1(n, cfg1)
        gemm2(n, cfg2)
    us = timed(step, producer, args.chained)
    hq, hs = intermediate(cfg1)   # layer 0, routing 0 again: the rows the reference has
    gemm2(0, cfg2)
    y = (c2 if b2 is None else c2 + b2[ids0]).float()
    err, scale = (y - ref_tk.float()).abs().max().item(), ref_tk.float().abs().max().item()
    if not err <= PEER_FP8_TOL * scale:
        raise SystemExit(f"the Triton fp8 peer: max error {err} against the reference (largest value {scale}, "
                         f"tolerance {PEER_FP8_TOL} of it)")
    return us, [cfg1, cfg2]


def launch_spec(params: dict, tile: int, H: int, I: int, act: str, arch: str, fmt: str = "bf16", layout: str = "nk",
                a8: bool = False):
    """The experts spec of launch params `params` for routings of tile `tile` (params naming a tile: that one),
    through kerngen's rule_spec and its checks; a fused_x rule serves at most fused_x tokens."""
    p = dict(params)
    t = p.pop("tile", tile)
    ranges = {"tokens": (1, p["fused_x"])} if p.get("fused_x") else {}
    return ex.rule_spec(Rule("experts", "mma", ranges, {**p, "tile": t}), H, I, act, arch, fmt, layout, a8)


def parse_rule(text: str, partial: bool = False) -> dict:
    """--rule's launch params, e.g. "warps=4,unroll=2,blocks_per_sm=4,min_blocks=4,pdl=true", checked against the
    experts mma params (the tile is the routing's, from the tier table, unless the rule names one: then its kernels
    read routings of the same logits at that tile). ValueError or TierError if they do not fit. `partial`: params
    laid over a tier rule's (checked once merged), so none is required here."""
    try:
        rule = {k: (v == "true" if v in ("true", "false") else int(v))
                for k, v in (kv.split("=") for kv in text.split(","))}
    except ValueError:
        raise ValueError(f"--rule {text!r}: expected comma-separated name=integer or name=true|false") from None
    if not partial:
        check_params("--rule", "experts", "mma", {"tile": 16, **rule})
    return rule


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; models and tokens as lists, --rule as a dict of params."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT))
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--sweep", action="store_true", help="time every candidate of the format, not only the tier "
                                                         "table's rule")
    ap.add_argument("--rule", default=None, help="time these params at every T, e.g. warps=4,unroll=2,blocks_per_sm=8 "
                                                 "(quantized builds also min_blocks=N; tile=N: routings of that tile)")
    ap.add_argument("--chained", action="store_true", help="back to back, no producer kernel between steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--format", default="bf16", choices=FORMATS, help="the expert weights' format")
    ap.add_argument("--layers", type=int, default=4, help="layers of weights cycled (fewer where they do not fit)")
    ap.add_argument("--peer", default=None, help="folder of triton_fused_moe.py: time the Triton peer too")
    ap.add_argument("--fp8-activations", action="store_true",
                    help="fp8: also time kerngen.experts(..., fp8_activations=True) (the w8a8 rules)")
    ap.add_argument("--layout", default="nk", choices=("nk", "kn"),
                    help="kn: the weights as transposed views of [E, H, 2I] / [E, I, H] (bf16)")
    args = ap.parse_args(argv)
    args.models = args.models.split(",")
    if unknown := [m for m in args.models if m not in SHAPES]:
        ap.error(f"--models: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    try:
        args.tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens {args.tokens!r}: expected comma-separated integers")
    if min(args.tokens) < 1:
        ap.error("--tokens: each at least 1")
    if args.rule:
        try:
            args.rule = parse_rule(args.rule)
        except (ValueError, TierError) as e:
            ap.error(str(e))
    if args.layout == "kn" and args.format != "bf16":
        ap.error("--layout kn: bf16 weights only (quantized checkpoints are stored [E, N, K])")
    return args


def peer_configs(cfgs) -> str:
    """The bf16 peer's configs, GEMM1's then GEMM2's, as tools.diagnose.experts_alone --peer-configs takes them."""
    return ";".join(",".join(map(str, c)) for c in cfgs)


def summary(b: dict) -> str:
    """The printed line of a case (its fastest row `b`): the floor, the read kernel's time (its % of the floor),
    kerngen (% of the floor, and of the read kernel's speed where the row has it); quantized formats then kerngen's
    bf16 kernels on the same weights dequantized (kerngen's speedup over them), Triton (% of the floor, kerngen's
    speedup over it, its configs), grouped_mm."""
    read = (f" read {b['read_us']:7.1f} ({100 * b['floor_us'] / b['read_us']:3.0f}%)" if b.get("read_us") else "")
    of_read = f", {100 * b['read_us'] / b['us']:3.0f}% of read" if b.get("read_us") else ""
    head = (f"{b['model']:16s} T={b['T']:3d} tile={b['tile']:2d} active={b['active']:6.1f} floor "
            f"{b['floor_us']:7.1f} µs{read} | kerngen {b['us']:7.1f} ({100 * b['floor_us'] / b['us']:4.0f}%{of_read}) "
            f"[{b['kernel']}] | ")
    tail = f"{b['format']} {b['layout']} x{b['layers']} layers"
    if b["format"] == "bf16":
        return (head + f"grouped_mm {b['grouped_us']:7.1f} ({100 * b['floor_us'] / b['grouped_us']:4.0f}%) | "
                f"{b['grouped_us'] / b['us']:.2f}x | " + tail
                + (f" | triton {b['peer_us']:7.1f} ({100 * b['floor_us'] / b['peer_us']:4.0f}%, "
                   f"{b['peer_us'] / b['us']:.2f}x) [{peer_configs(b['peer_cfg'])}]" if b["peer_us"] else ""))
    bf16 = "-" if b["bf16_us"] is None else f"{b['bf16_us']:7.1f} ({b['bf16_us'] / b['us']:.2f}x)"
    if b.get("a8_us"):
        a8 = b["a8_us"]
        head += (f"kerngen w8a8 {a8:7.1f} ({100 * b['floor_us'] / a8:4.0f}%"
                 + (f", {b['peer_us'] / a8:.2f}x triton" if b["peer_us"] else "") + ") | ")
    peer = ""
    if b["peer_us"]:
        cfgs = ", ".join(f"{c['block_n']}/{c['stages']}/{c['warps']}" for c in b["peer_cfg"])
        peer = (f"triton {b['format']} {b['peer_us']:7.1f} ({100 * b['floor_us'] / b['peer_us']:4.0f}%, "
                f"{b['peer_us'] / b['us']:.2f}x) [block_n/stages/warps {cfgs}] | ")
    return head + f"kerngen bf16 {bf16} | " + peer + f"grouped_mm {b['grouped_us']:7.1f} | " + tail


def main(argv=None) -> int:
    args = parse_args(argv)
    require_gpu("python3 -m tools.bench.experts")
    dev = torch.cuda.current_device()
    arch = target_arch(dev)
    models, tokens = args.models, args.tokens

    def cand_specs(H, I, tile, act):
        """(label, spec) of each candidate at the routing's tile (a --rule naming its own tile: at that one)."""
        return [(",".join(f"{k}={x}" for k, x in c.items()),
                 launch_spec(c, tile, H, I, act, arch, args.format, args.layout))
                for c in (CANDIDATES[args.format] if args.sweep else [args.rule])]

    if args.sweep:   # compile every candidate first, in parallel
        specs = [s for m in models for T in tokens for _, s in
                 cand_specs(SHAPES[m][0], SHAPES[m][1], tile_at(m, T, args.format), SHAPES[m][4])]
        with ProcessPoolExecutor(max(1, (os.cpu_count() or 2) - 1)) as pool:
            list(pool.map(_build, list(dict.fromkeys(specs))))

    def kernels_of(H, I, tile, act, T, E, K):
        if not args.sweep:   # the tier table's rule (beside --rule's params: the same inputs, the same process)
            try:
                s = ex.spec(H, I, tile, act, T, arch, fmt=args.format, layout=args.layout, experts=E, top_k=K)
            except TierError:
                if not args.rule:
                    raise
            else:
                yield "tiers.toml: " + ",".join(f"{k}={v}" for k, v in s.params), ex.Kernels(s, dev)
        if args.sweep or args.rule:
            for label, s in cand_specs(H, I, tile, act):
                yield label, ex.Kernels(s, dev)

    def bf16_kernel(H, I, tile, act, T, E, K):
        """(label, kernels) of the tier table's bf16 rule at T, built for `tile`; None where no bf16 rule serves T."""
        try:
            s = ex.spec(H, I, tile, act, T, arch, fmt="bf16", experts=E, top_k=K)
        except TierError:
            return None
        return "tiers.toml: " + ",".join(f"{k}={v}" for k, v in s.params), ex.Kernels(s, dev)

    bw = read_bandwidth_tbs()
    print(f"streaming-read bandwidth {bw:.2f} TB/s; {'chained' if args.chained else 'after a producer kernel'}; "
          f"layout {args.layout}")
    allrows = []
    for m in models:
        for T in tokens:
            rows = case(m, T, bw, args, kernels_of, bf16_kernel)
            allrows += rows
            rows.sort(key=lambda r: r["us"])
            print(summary(rows[0]), flush=True)
            for r in rows[1:4] if args.sweep or args.rule else ():   # (its case, and its time over the fastest's)
                print(f"{m:16s} T={T:3d} {'':5s} {r['us']:7.1f} ({r['us'] / rows[0]['us']:.3f}x) [{r['kernel']}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(allrows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
