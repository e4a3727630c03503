#!/usr/bin/env python3
"""kerngen.latent_tail against the unfused path and its torch.compile: the latent-MoE tail of a decode step
(finalize in the latent width, RMSNorm, the up projection, the shared + residual add), CUDA graphs.

    python3 -m tools.bench.latent_tail [--tokens 1,2,4,8,16,32,64] [--shape 16,3584,7168] [--layers 4]
                                       [--chained | --rows-written]
                                       [--rule early_weights=true | split=true | max_tokens=16,...
                                               | variant=norm_gemm,cluster=8,pdl=true [;...]] [--json FILE]

Peers, on the same inputs in the same process: "unfused" is what an engine runs today (kerngen.finalize, torch
RMSNorm in fp32, torch.matmul in bf16, the adds: four launches and more); "compiled" is the same after
finalize under torch.compile (the norm, matmul and adds fused where Inductor can); "all comp" is torch.compile of
the whole unfused tail, the finalize's gather and weighted sum included. Both are compiled afresh at each T.
Each step follows a producer kernel (an elementwise write of 4 MB that does not trigger early) unless --chained; its
time is taken off (--rows-written: the producer then also rewrites gemm2_out, the routed rows, so they are read from
L2 as after the experts' second GEMM in a model; without it they come from DRAM). Consecutive steps use `--layers`
different up_proj copies, as consecutive layers do, so the weights are read from memory and not L2. The floor is the
up projection's weights, L * H * 2 bytes, at the measured copy bandwidth (the streaming-read rate the experts bench
uses); "read" is a kernel that only reads those bytes (the read-bandwidth probe's, on the same cycled copies, after
the same producer): what its launch, ramp-up and drain leave of the floor, and "% read" its time over kerngen's.
Every result is checked against the reference before it is timed. --rule times params beside the tier rule's:
laid over the tier rule's params at each T it serves with the fused kernel (e.g. early_weights=true, or split=true:
the norm kernel and the projection waiting on it); when they name max_tokens, one fused launch shape on its own at
every T <= its max_tokens; when they name a variant (variant=norm_gemm: the norm kernel, torch.mm and the adds),
that variant at every T.
Several rules separated by ';' each get a column ("-" where one times nothing at that T).
"""
from __future__ import annotations

import argparse
import json

import torch

import kerngen
from .lib import copy_bandwidth_tbs, elementwise_producer, require_gpu, stream_reader, timed
from kerngen.ops import latent_tail as lt
from kerngen.plan import spec_for, target_arch
from kerngen.tiers import Rule

BF = torch.bfloat16


def inputs(T, K, L, H, layers, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = T * K
    gemm2 = torch.randn(rows, L, device="cuda", generator=gen).to(BF)
    e2p = torch.randperm(rows, device="cuda", generator=gen).view(T, K).int()
    w = torch.rand(T, K, device="cuda", generator=gen)
    nw = (0.5 + torch.rand(L, device="cuda", generator=gen)).to(BF)
    ups = [torch.empty(H, L, dtype=BF, device="cuda").normal_(0, L ** -0.5, generator=gen) for _ in range(layers)]
    sh = torch.randn(T, H, device="cuda", generator=gen).to(BF)
    res = torch.randn(T, H, device="cuda", generator=gen).to(BF)
    return gemm2, e2p, w, nw, ups, sh, res


def unfused_rest(y, nw, up, sh, res, eps: float = 1e-6):
    """Everything after finalize, in torch: RMSNorm (fp32), bf16 matmul, the adds."""
    yf = y.float()
    n = (yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + eps) * nw.float()).to(BF)
    return (torch.matmul(n, up.T).float() + sh.float() + res.float()).to(BF)


def unfused_all(g, e2p, w, nw, up, sh, res, eps: float = 1e-6):
    """The whole tail in torch, finalize included (the rows gathered, weighted and summed in fp32)."""
    L = nw.shape[0]
    ok = (e2p >= 0) & (e2p < g.shape[0])
    rows = g[torch.where(ok, e2p, 0).long(), :L].float()
    y = (rows * torch.where(ok, w.float(), 0.0).unsqueeze(-1)).sum(1)
    return unfused_rest(y, nw, up, sh, res, eps)



def check(got, ref, what):
    scale = ref.float().pow(2).mean(-1, keepdim=True).sqrt()
    err = ((got.float() - ref.float()).abs() - 2 ** -8 * ref.float().abs()).max().item()
    if not err <= 2e-2 * scale.min().item():
        raise SystemExit(f"{what}: max error {err} against the reference (row RMS {scale.min().item():.3g})")


def parse_rule(text: str) -> dict:
    """"early_weights=true,unroll=4" -> {"early_weights": True, "unroll": 4}; "variant=norm_gemm" stays a name."""
    pairs = (kv.split("=") for kv in text.split(","))
    return {k: (v == "true" if v in ("true", "false") else v if k == "variant" else int(v)) for k, v in pairs}


def parse_rules(text: str | None) -> list[dict]:
    """--rule: rules separated by ';', each parse_rule's."""
    return [parse_rule(r) for r in text.split(";")] if text else []


def rule_params(rule: dict | None, tier, T: int) -> dict | None:
    """The params --rule times at T beside the tier rule's spec `tier` (None: nothing to time at T): a variant
    named (variant=norm_gemm,...) at every T, a whole fused launch shape up to its max_tokens, or fused params laid
    over the tier rule's where it is fused."""
    if not rule:
        return None
    if "variant" in rule:
        return rule
    if "max_tokens" in rule:
        return rule if T <= rule["max_tokens"] else None
    return {**dict(tier.params), **rule} if tier.variant == "fused" else None


def case(T, K, L, H, bw, args):
    gemm2, e2p, w, nw, ups, sh, res = inputs(T, K, L, H, args.layers, seed=T)
    ref = lt.reference(gemm2, e2p, w, nw, ups[0], shared=sh, residual=res)
    producer = elementwise_producer()   # a 4 MB write, no early trigger
    if args.rows_written:   # ... then gemm2_out rewritten, as the experts' second GEMM writes it in a model
        write4 = producer

        def producer():
            write4()
            gemm2.add_(0)
    floor = L * H * 2 / (bw * 1e12) * 1e6
    out = torch.empty(T, H, dtype=BF, device="cuda")
    y = torch.empty(T, L, dtype=BF, device="cuda")
    row = dict(T=T, K=K, L=L, H=H, floor_us=floor)

    def cycle(fn):
        it = iter(range(10 ** 9))
        return lambda: fn(ups[next(it) % len(ups)])

    def ours(up):
        return kerngen.latent_tail(gemm2, e2p, w, nw, up, shared=sh, residual=res, out=out)

    def unfused(up):
        kerngen.finalize(gemm2, e2p, w, out=y)
        return unfused_rest(y, nw, up, sh, res)

    torch._dynamo.reset()   # compiled afresh for each T (no recompile limit reached, no dynamic shapes)
    compiled = torch.compile(unfused_rest, dynamic=False)
    compiled_all = torch.compile(unfused_all, dynamic=False)

    def unfused_compiled(up):
        kerngen.finalize(gemm2, e2p, w, out=y)
        return compiled(y, nw, up, sh, res)

    def all_compiled(up):
        return compiled_all(gemm2, e2p, w, nw, up, sh, res)

    for name, fn in (("kerngen", ours), ("unfused", unfused), ("compiled", unfused_compiled),
                     ("compiled_all", all_compiled)):
        check(fn(ups[0]), ref, f"T={T} {name}")
        row[f"{name}_us"] = timed(cycle(fn), producer, args.chained)
    row["read_us"] = timed(cycle(stream_reader()), producer, args.chained)   # up_proj's bytes, read and nothing else
    row["rule_us"] = []   # one entry a --rule (None where it times nothing at this T)
    for rule in args.rule:
        params = rule_params(rule, lt.spec(L, H, K, "float32", T, target_arch()), T)
        if not params:
            row["rule_us"].append(None)
            continue
        params = dict(params)
        variant = params.pop("variant", "fused")
        s = spec_for(Rule(lt.OP, variant, {}, params), *lt.tag_constants(L, H, K, "float32"), target_arch())
        k = lt.kernel(s, T, torch.cuda.current_device())   # a Launcher, a split build's two, or NormGemm

        def rule_step(up, k=k):
            return lt.run(k, gemm2, e2p, w, nw, up, sh, res, 1e-6, out)
        check(rule_step(ups[0]), ref, f"T={T} rule {params}")
        row["rule_us"].append(timed(cycle(rule_step), producer, args.chained))
    d = lt.dispatch(torch.cuda.current_device(), L=L, H=H, top_k=K, weights_dtype="float32")
    row["variant"] = d.spec(T).variant
    ups = None   # (the copies freed)
    torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,2,4,8,12,16,17,32,64")
    ap.add_argument("--shape", default="16,3584,7168", help="K,L,H (default kimi-k3: H assumed, Kimi K2's)")
    ap.add_argument("--layers", type=int, default=4, help="up_proj copies cycled through (cold weights)")
    ap.add_argument("--chained", action="store_true", help="back to back, no producer kernel between steps")
    ap.add_argument("--rows-written", action="store_true", help="the producer also rewrites the routed rows "
                    "(gemm2_out), so they are in L2 as after the experts' GEMM in a model")
    ap.add_argument("--rule", default=None, help="params to time beside the tier rule's: over its params "
                    "(early_weights=true), a whole launch shape (max_tokens=16,warps=16,unroll=2,cluster=8), or a "
                    "variant (variant=norm_gemm,cluster=1); several separated by ';', a column each")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    args.rule = parse_rules(args.rule)
    if args.rows_written and args.chained:
        ap.error("--rows-written rewrites the rows in the producer step; --chained has none")
    K, L, H = (int(v) for v in args.shape.split(","))
    require_gpu("python3 -m tools.bench.latent_tail")
    bw = copy_bandwidth_tbs()
    print(f"latent_tail K={K} L={L} H={H}; copy bandwidth {bw:.2f} TB/s; "
          f"{'chained' if args.chained else 'after a producer kernel'}"
          f"{' that also rewrites the routed rows' if args.rows_written else ''}"
          "; floor = L*H*2 bytes at that bandwidth"
          + "".join(f"; rule {i + 1}: {r}" for i, r in enumerate(args.rule)))
    print(f"{'T':>4s} {'variant':>9s} {'kerngen':>9s} {'unfused':>9s} {'compiled':>9s} {'all comp':>9s} {'floor':>7s} "
          f"{'% floor':>8s} {'vs best peer':>12s} {'read':>7s} {'% read':>7s}"
          + "".join(f"  rule {i + 1}" for i in range(len(args.rule))))
    rows = []
    for T in (int(t) for t in args.tokens.split(",")):
        r = case(T, K, L, H, bw, args)
        rows.append(r)
        peer = min(r["unfused_us"], r["compiled_us"], r["compiled_all_us"])
        print(f"{T:4d} {r['variant']:>9s} {r['kerngen_us']:9.2f} {r['unfused_us']:9.2f} {r['compiled_us']:9.2f} "
              f"{r['compiled_all_us']:9.2f} "
              f"{r['floor_us']:7.2f} {100 * r['floor_us'] / r['kerngen_us']:7.1f}% {peer / r['kerngen_us']:11.2f}x"
              f" {r['read_us']:7.2f} {100 * r['read_us'] / r['kerngen_us']:6.1f}%"
              + "".join("  -" if us is None else f"  {us:.2f} ({r['kerngen_us'] / us:.2f}x)" for us in r["rule_us"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(bandwidth_tbs=bw, chained=args.chained, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
