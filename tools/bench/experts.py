#!/usr/bin/env python3
"""kerngen.experts against torch._grouped_mm: the two expert projections of a decode step, CUDA graphs.

    python3 -m tools.bench.experts [--models qwen3-30b-a3b,...] [--tokens 1,8,64] [--format bf16|fp8|mxfp4]
                                   [--layout nk|kn] [--layers 4] [--peer DIR] [--sweep] [--json FILE]

Both run on the same inputs in the same process: one graph captures `calls` steps, each with its own routing
(random logits), so consecutive steps read different experts, as the layers of a model do. Each step follows a
producer kernel (an elementwise write of 4 MB, as an attention output projection leaves, that does not
trigger early) unless --chained; its time is taken off. The floor is the step's active expert weight bytes at the
streaming-read bandwidth (a kernel that only reads, lib.read_bandwidth_tbs). Every result is checked against
kerngen's torch reference before it is timed. --sweep times every candidate launch shape at
each case and prints the best (for the tier table); --rule times one launch shape at every T (past the rules too).

--format fp8 / mxfp4 quantizes the weights (fp8: e4m3 with a scale per 128 x 128 block; mxfp4: e2m1 with an e8m0
scale per 32 values) and runs kerngen.experts' builds for them; the floor is then the quantized weight bytes plus
the scale bytes of the active experts, torch._grouped_mm runs on the dequantized bf16 weights. With --peer DIR
(a folder holding triton_fused_moe.py) the Triton GEMMs vLLM runs time beside them: its bf16 fused_moe_kernel (the
best of its decode config sweep for each GEMM, the activation kernel between them) or, for fp8, its block-scaled
GEMMs (best of a small config sweep). --layout kn feeds kerngen.experts the weights as transposed views of
[E, H, 2I] / [E, I, H] (transformers' gpt-oss and Llama-4 layout; bf16). --layers L cycles the weights of L layers
(fewer where they would not fit) so no step finds its experts in L2.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
from concurrent.futures import ProcessPoolExecutor


import torch

import kerngen
from .lib import graph_time_us, read_bandwidth_tbs
from kerngen import jit
from kerngen.ops import experts as ex
from kerngen.plan import spec_for, target_arch
from kerngen.tiers import Rule

# name: (H, I, E, K, activation, interleaved gate/up and biases) at each model's intermediate size
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8, "silu", False),
    "qwen3-235b-a22b": (4096, 1536, 128, 8, "silu", False),
    "gpt-oss-120b": (2880, 2880, 128, 4, "gpt_oss", True),
    "deepseek-v3": (7168, 2048, 256, 8, "silu", False),
    "kimi-k3": (3584, 2048, 896, 16, "situglu", False),
    "llama-4-maverick": (5120, 8192, 128, 1, "silu", False),   # 32 GB a layer: run it by name
}
DEFAULT = ("qwen3-30b-a3b", "qwen3-235b-a22b", "gpt-oss-120b", "deepseek-v3", "kimi-k3")
CANDIDATES = [dict(warps=w, unroll=u, blocks_per_sm=b, pdl=d) for w, u, b, d in
              itertools.product((4, 8), (2, 4), (4, 8), (False, True))]


def _build(spec):
    jit.build(spec)
    return spec.tag


def weights(H, I, E, bias, gen):
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device="cuda").normal_(0, H ** -0.5, generator=gen)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device="cuda").normal_(0, I ** -0.5, generator=gen)
    b13 = torch.randn(E, 2 * I, device="cuda", generator=gen).to(torch.bfloat16) * 0.1 if bias else None
    b2 = torch.randn(E, H, device="cuda", generator=gen).to(torch.bfloat16) * 0.1 if bias else None
    return w13, w2, b13, b2


def quantize(w: torch.Tensor, fmt: str, chunk: int = 8):
    """bf16 weights [E, N, K] as kerngen.experts takes them in `fmt`: (weights, scales), or (w, None) for bf16.
    Quantized `chunk` experts at a time (the fp32 temporaries of a whole layer would not fit beside the weights)."""
    if fmt == "bf16":
        return w, None
    parts = [_quantize(w[e:e + chunk], fmt) for e in range(0, w.shape[0], chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def dequantize(w: torch.Tensor, scale: torch.Tensor, chunk: int = 8) -> torch.Tensor:
    """kerngen's dequantized weights in bf16, `chunk` experts at a time (its fp32 result would not fit)."""
    return torch.cat([ex.dequantize(w[e:e + chunk], scale[e:e + chunk]).to(torch.bfloat16)
                      for e in range(0, w.shape[0], chunk)])


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


def timed(step, producer, chained: bool) -> float:
    if chained:
        return graph_time_us(step, calls=20)
    both = graph_time_us(lambda: (producer(), step()), calls=20)
    return both - graph_time_us(producer, calls=20)


def case(name, T, bw, args, kernels_of):
    H, I, E, K, act_name, gpt = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(T)
    w13, w2, b13, b2 = weights(H, I, E, gpt, gen)
    fmt = args.format
    per_weight = {"bf16": 2.0, "fp8": 1.0 + 4 / 128 ** 2, "mxfp4": 0.5 + 1 / 32}[fmt]   # bytes per weight, scales too
    free = torch.cuda.mem_get_info()[0]
    layers = max(1, min(args.layers, int(0.5 * free // (3 * E * H * I * per_weight))))
    quant = []   # the weights kerngen.experts reads, layer by layer: (w13, w2, w13_scale, w2_scale)
    for layer in range(layers):
        a, b = (w13, w2) if layer == 0 else weights(H, I, E, False, gen)[:2]
        (q13, s13), (q2, s2) = quantize(a, fmt), quantize(b, fmt)
        quant.append((q13, q2, s13, s2))
    if fmt != "bf16":   # the grouped GEMM (and the check) on layer 0's weights as kerngen reads them
        w13, w2 = dequantize(quant[0][0], quant[0][2]), dequantize(quant[0][1], quant[0][3])
    if args.layout == "kn":   # the same values stored [E, H, 2I] / [E, I, H], handed over as transposed views
        quant = [(transposed(q[0]), transposed(q[1]), *q[2:]) for q in quant]
    calls = 20
    x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
    logits = [torch.randn(T, E, device="cuda", generator=gen) for _ in range(calls)]
    tile = ex.tile_for(H, I, act_name, T, 0) or 16
    rt = [kerngen.route(lg, top_k=K, method="softmax_topk", tile=tile) for lg in logits]
    r1 = [kerngen.route(lg, top_k=K, method="softmax_topk", tile=1) for lg in logits]
    kw = dict(activation=act_name, interleaved=gpt, b13=b13, b2=b2)
    a0, a1 = (1.702, 7.0) if act_name == "gpt_oss" else (1.0, 0.0)
    act = lambda h: ex.activate(h, I, act_name, gpt, 1.702, 7.0, 1.0, 0.0)  # noqa: E731
    active = sum(int(torch.unique(r.topk_ids).numel()) for r in r1) / calls
    floor = active * 3 * H * I * per_weight / (bw * 1e12) * 1e6
    producer_buf = torch.empty(2 << 20, dtype=torch.bfloat16, device="cuda")
    producer = lambda: producer_buf.mul_(1.0)  # noqa: E731   a 4 MB write, no early trigger

    ref = ex.reference(x, rt[0], w13, w2, **kw)
    qkw = [dict(w13_scale=q[2], w2_scale=q[3]) if fmt != "bf16" else {} for q in quant]
    ok_rows = rt[0].permuted_to_token >= 0
    outs = [torch.zeros(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda") for r in rt]
    acts = [torch.empty(r.tile_to_expert.shape[0] * tile, I, dtype=torch.bfloat16, device="cuda") for r in rt]

    def check(got, what):
        err = (got[ok_rows].float() - ref[ok_rows].float()).abs().max().item()
        scale = ref[ok_rows].float().abs().max().item()
        if not err <= 2e-2 * max(scale, 1.0):
            raise SystemExit(f"{name} T={T} {what}: max error {err} against the reference (scale {scale})")

    rows = []
    g0 = grouped_step(x, r1[0], w13, w2, b13, b2, act)
    # the grouped step's rows are in tile-1 permuted order: compare through expanded_to_permuted
    e1, et = r1[0].expanded_to_permuted.flatten().long(), rt[0].expanded_to_permuted.flatten().long()
    gerr = (g0[e1].float() - ref[et].float()).abs().max().item()
    assert gerr <= 2e-2 * max(ref.float().abs().max().item(), 1.0), f"{name} T={T} grouped_mm error {gerr}"
    it = iter(range(10 ** 9))
    gstep = lambda: grouped_step(x, r1[next(it) % calls], w13, w2, b13, b2, act)  # noqa: E731
    grouped_us = timed(gstep, producer, args.chained)
    for label, k in kernels_of(H, I, tile, act_name, T, rt[0].tile_to_expert.shape[0]):
        outs[0].zero_()
        k(x, rt[0], quant[0][0], quant[0][1], outs[0], acts[0], interleaved=gpt, b13=b13, b2=b2, a0=a0, a1=a1,
          **qkw[0])
        torch.cuda.synchronize()
        check(outs[0], label)
        it2 = iter(range(10 ** 9))

        def step():
            n = next(it2)
            i, q = n % calls, quant[n % layers]
            k(x, rt[i], q[0], q[1], outs[i], acts[i], interleaved=gpt, b13=b13, b2=b2, a0=a0, a1=a1,
              **qkw[n % layers])
        us = timed(step, producer, args.chained)
        rows.append(dict(model=name, T=T, tile=tile, kernel=label, us=us, grouped_us=grouped_us, floor_us=floor,
                         active=active, format=fmt, layers=layers, layout=args.layout,
                         peer_us=peer_fp8(args, x, rt, r1, quant, K, I, act, producer, calls)
                         if fmt == "fp8" else peer_bf16(args, x, r1, quant, K, act, producer, calls, b13, b2,
                                                        ref[rt[0].expanded_to_permuted.flatten().long()])))
    del w13, w2, quant
    torch.cuda.empty_cache()
    return rows


def transposed(w: torch.Tensor) -> torch.Tensor:
    """The same values stored [E, K, N], as its transposed view [E, N, K] (transformers' gpt-oss / Llama-4)."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


def _peer(args):
    import importlib.util
    spec = importlib.util.spec_from_file_location("triton_fused_moe", os.path.join(args.peer, "triton_fused_moe.py"))
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    return peer


def peer_bf16(args, x, r1, quant, K, act, producer, calls, b13, b2, ref_tk):
    """vLLM's Triton bf16 fused-MoE GEMMs (fused_moe_kernel over its moe_align_block_size layout, block_m 16): the
    best decode config of each GEMM (its own sweep, each timed alone), then both GEMMs timed as one step (the
    activation between them not counted). Checked after timing, with the activation and biases, against the
    reference rows. None without --peer or for another format."""
    if not args.peer or args.format != "bf16":
        return None
    peer = _peer(args)
    T, H = x.shape
    w13s = [q[0].contiguous() if args.layout == "kn" else q[0] for q in quant]   # the peer reads [E, N, K]
    w2s = [q[1].contiguous() if args.layout == "kn" else q[1] for q in quant]
    E, I = w13s[0].shape[0], w2s[0].shape[2]
    aligned = [peer.align(r.topk_ids, E, 16) for r in r1]
    c1 = torch.empty(T * K, 2 * I, dtype=torch.bfloat16, device="cuda")
    a1 = torch.empty(T * K, I, dtype=torch.bfloat16, device="cuda")
    c2 = torch.empty(T * K, H, dtype=torch.bfloat16, device="cuda")

    def best(run):
        res = []
        for cfg in peer.CONFIGS:
            it = iter(range(10 ** 9))
            try:
                res.append((graph_time_us(lambda: run(next(it), cfg), calls=10, replays=10), cfg))
            except Exception:   # a config the compiler refuses
                continue
        return min(res)[1]
    ids = [r.topk_ids.long() for r in r1]
    cfg1 = best(lambda n, cfg: peer.gemm(x, w13s[n % len(w13s)], c1, aligned[n % calls], K, cfg))
    cfg2 = best(lambda n, cfg: peer.gemm(a1, w2s[n % len(w2s)], c2, aligned[n % calls], 1, cfg))
    it = iter(range(10 ** 9))

    def step():   # the two GEMMs only: its activation kernel (and biases) not counted, to the peer's advantage
        n = next(it)
        i = n % calls
        peer.gemm(x, w13s[n % len(w13s)], c1, aligned[i], K, cfg1)
        peer.gemm(a1, w2s[n % len(w2s)], c2, aligned[i], 1, cfg2)
    us = timed(step, producer, args.chained)
    peer.gemm(x, w13s[0], c1, aligned[0], K, cfg1)   # layer 0, routing 0: the rows the reference has
    h = c1.float() if b13 is None else c1.float() + b13[ids[0].flatten()].float()
    a1.copy_(act(h).to(torch.bfloat16))
    peer.gemm(a1, w2s[0], c2, aligned[0], 1, cfg2)
    y = (c2 if b2 is None else c2 + b2[ids[0].flatten()]).float()
    err = (y - ref_tk.float()).abs().max().item()
    if not err <= 2e-2 * max(ref_tk.float().abs().max().item(), 1.0):
        raise SystemExit(f"the Triton peer: max error {err} against the reference")
    return us


def peer_fp8(args, x, rt, r1, quant, K, I, act, producer, calls):
    """The Triton fp8 block-scaled GEMMs (w8a8: activations quantized per token group of 128) vLLM runs, both
    projections and the activation between them, best of a small config sweep; None without --peer or for
    another format."""
    if not args.peer or args.format != "fp8":
        return None
    peer = _peer(args)
    T, H = x.shape
    aligned = [peer.align(r.topk_ids, quant[0][0].shape[0], 16) for r in r1]
    c1 = torch.empty(T * K, 2 * I, dtype=torch.bfloat16, device="cuda")
    c2 = torch.empty(T * K, H, dtype=torch.bfloat16, device="cuda")
    best = None
    for bn, warps, stages in ((64, 4, 3), (128, 4, 3), (64, 4, 4), (32, 4, 4)):
        it = iter(range(10 ** 9))

        def step():
            n = next(it)
            q, al = quant[n % len(quant)], aligned[n % calls]
            aq, s_ = peer.quant_fp8_groups(x)
            peer.gemm_fp8_block(aq, s_, q[0], q[2], c1, al, K, block_n=bn, warps=warps, stages=stages)
            hq, hs = peer.quant_fp8_groups(act(c1.float()).to(torch.bfloat16))
            peer.gemm_fp8_block(hq, hs, q[1], q[3], c2, al, 1, block_n=bn, warps=warps, stages=stages)
        try:
            us = timed(step, producer, args.chained)
        except Exception as e:   # a config the compiler refuses
            print(f"  peer config {bn},{warps},{stages}: {type(e).__name__}: {e}")
            continue
        best = us if best is None else min(best, us)
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(DEFAULT))
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--sweep", action="store_true", help="time every candidate, not only the tier table's rule")
    ap.add_argument("--rule", default=None, help="time these params at every T, e.g. warps=4,unroll=2,blocks_per_sm=8")
    ap.add_argument("--chained", action="store_true", help="back to back, no producer kernel between steps")
    ap.add_argument("--json", default=None)
    ap.add_argument("--format", default="bf16", choices=("bf16", "fp8", "mxfp4"), help="the expert weights' format")
    ap.add_argument("--layers", type=int, default=4, help="layers of weights cycled (fewer where they do not fit)")
    ap.add_argument("--peer", default=None, help="folder of triton_fused_moe.py: time the Triton peer too")
    ap.add_argument("--layout", default="nk", choices=("nk", "kn"),
                    help="kn: the weights as transposed views of [E, H, 2I] / [E, I, H] (bf16)")
    args = ap.parse_args(argv)
    if args.rule:
        args.rule = {k: (v == "true" if v in ("true", "false") else int(v))
                     for k, v in (kv.split("=") for kv in args.rule.split(","))}
    dev = torch.cuda.current_device()
    arch = target_arch(dev)
    models, tokens = args.models.split(","), [int(t) for t in args.tokens.split(",")]

    def cand_specs(H, I, tile, act):
        tag, consts = ex.tag_constants(H, I, tile, act, args.format, args.layout)
        cands = CANDIDATES if args.sweep else [args.rule]
        return [(",".join(f"{k}={x}" for k, x in c.items()),
                 spec_for(Rule(op="experts", variant="mma", ranges={}, params=c), tag, consts, arch)) for c in cands]

    if args.sweep:   # compile every candidate first, in parallel
        specs = [s for m in models for T in tokens for _, s in
                 cand_specs(SHAPES[m][0], SHAPES[m][1], ex.tile_for(SHAPES[m][0], SHAPES[m][1], SHAPES[m][4], T, 0) or 16,
                            SHAPES[m][4])]
        with ProcessPoolExecutor(max(1, (os.cpu_count() or 2) - 1)) as pool:
            list(pool.map(_build, list(dict.fromkeys(specs))))

    def kernels_of(H, I, tile, act, T, tiles):
        if args.sweep or args.rule:
            for label, s in cand_specs(H, I, tile, act):
                yield label, ex.Kernels(s, dev)
        else:
            s = ex.spec(H, I, tile, act, T, arch, fmt=args.format, layout=args.layout)
            yield "tiers.toml: " + ",".join(f"{k}={v}" for k, v in s.params), ex.Kernels(s, dev)

    if args.layout == "kn" and args.format != "bf16":
        raise SystemExit("--layout kn: bf16 weights only (quantized checkpoints are stored [E, N, K])")
    bw = read_bandwidth_tbs()
    print(f"streaming-read bandwidth {bw:.2f} TB/s; {'chained' if args.chained else 'after a producer kernel'}; "
          f"layout {args.layout}")
    allrows = []
    for m in models:
        for T in tokens:
            rows = case(m, T, bw, args, kernels_of)
            allrows += rows
            rows.sort(key=lambda r: r["us"])
            b = rows[0]
            print(f"{m:16s} T={T:3d} tile={b['tile']:2d} active={b['active']:6.1f} floor {b['floor_us']:7.1f} µs | "
                  f"kerngen {b['us']:7.1f} ({100 * b['floor_us'] / b['us']:4.0f}%) [{b['kernel']}] | grouped_mm "
                  f"{b['grouped_us']:7.1f} ({100 * b['floor_us'] / b['grouped_us']:4.0f}%) | "
                  f"{b['grouped_us'] / b['us']:.2f}x | {b['format']} {b['layout']} x{b['layers']} layers"
                  + (f" | triton {b['peer_us']:7.1f} ({100 * b['floor_us'] / b['peer_us']:4.0f}%, "
                     f"{b['peer_us'] / b['us']:.2f}x)" if b["peer_us"] else ""),
                  flush=True)
            for r in rows[1:4] if args.sweep else ():
                print(f"{'':24s} {r['us']:7.1f} [{r['kernel']}]")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(allrows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
