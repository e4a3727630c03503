#!/usr/bin/env python3
"""One decode step of a real-shaped MoE layer, kerngen against plain torch (random weights, CUDA graphs).

    python3 -m tools.bench.moe_layer_demo [--models kimi-k3,deepseek-v3] [--tokens 1,8,64] [--inter 256] [--tile 16]
                                    [--compile] [--schedule one,three] [--pre-tokens 8] [--experts kerngen]

The layer, for hidden states x [T, H] bf16 and a residual [T, H] bf16 (E, K, H and routing from tiers.toml):
    logits   = x.float() @ router.T                               fp32 [T, E]; router [E, H] fp32
    ids, w   = top-k routing of the model's method                ids [T, K] int32, w [T, K] fp32
    expert_e = down_e(silu(gate_e(x)) * up_e(x))                  bf16 weights, intermediate size I
    y        = sum_k w[t, k] * expert_{ids[t, k]}(x[t]) + shared(x) + residual            fp32
    out      = y * rsqrt(mean(y^2) + eps) * norm_weight           bf16
A latent model (`model_hidden` in tiers.toml: kimi-k3) has hidden states of the model's width Hm and experts in the
latent width L = `hidden`: the experts read x_lat = x @ down.T (down [L, Hm]); the tail is the latent one
(kerngen.latent_tail):
    y        = sum_k w[t, k] * expert_{ids[t, k]}(x_lat[t])      fp32 [T, L]
    out      = (rmsnorm(y) * norm_weight) @ up.T + shared(x) + residual   bf16 [T, Hm]; up [Hm, L], norm [L]
kerngen path: kerngen.route (ids, weights and the permutation) -> the experts over the permuted rows
(kerngen.experts, or with --experts torch one batched matmul per tile over gathered weights) ->
kerngen.moe_tail (finalize + shared + residual + RMSNorm), or kerngen.latent_tail in a latent layer. torch
path: the routing math of tools/bench/routing.py, each (token, slot) gathers its expert's weights, fp32 weighted
sum, RMSNorm. Neither path reads a device value on the host, so both run inside CUDA graphs.

Schedules of the kerngen path (--schedule): `one`, everything on one stream in the order above; `three`, the
pre-routing pattern of TensorRT-LLM's Kimi K3 decode: the router GEMM and kerngen.PreRouting's launch on a
router stream, the shared expert on a shared stream, the routed experts (after PreRouting.take, which joins the
router stream) and moe_tail (after joining the shared stream) on the main stream. Both streams fork from the
main stream at the start of each layer, as capture requires. Token counts above --pre-tokens (PreRouting's
max_tokens, default 8) route on the main stream; the router GEMM and the shared expert still overlap. With both
schedules the table adds the three-stream µs, what it saves per layer, and whether its outputs and ids are
bitwise those of the one-stream schedule.

Prints one Markdown row per (model, T) for docs/benchmarks.md: µs per layer of each path (CUDA graph of 10
layers, median of 20 replays), kerngen's speedup, the output error of kerngen against torch, and the fraction
of equal expert ids (each token's K ids sorted). Outputs are compared as left by a graph replay.

Tolerance (exit code 1 above it): max |kerngen - torch| / (|torch| + RMS of the torch row) <= TOL = 2e-2.
Both paths round the same intermediates to bf16 (expert GEMM outputs, activations) but with GEMMs of different
shapes, hence different fp32 sum orders, so an intermediate may differ by one bf16 step (2**-8 relative). After
RMSNorm (row RMS ~1) that is a few 1e-3 of the RMS, and the final roundings may differ by one bf16 step, under
2**-7 = 0.8% of |out|. 2e-2 leaves room for ~2.5 such steps; a wrong expert, weight or row moves outputs by
O(RMS), far above it. kerngen.experts keeps gate and up in fp32 into the activation (one rounding fewer than
both stand-ins), which moves an expert row by about one more bf16 step.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass


import torch
import torch.nn.functional as F

import kerngen
from .routing import torch_routing
from .lib import graph_time_us, require_gpu

TOL = 2e-2
EPS = 1e-6
BF16 = torch.bfloat16


@dataclass
class Weights:
    """One MoE layer: router [E, Hm] fp32, correction bias [E] fp32 (None unless a sigmoid_bias method); bf16
    experts w1 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], shared expert shared1 [2I, Hm] and
    shared2 [Hm, I], RMSNorm weight norm [H]. Hm = H, except in a latent layer (H = L): down [L, Hm] and up
    [Hm, L] project to and from the experts' width (None otherwise)."""
    router: torch.Tensor
    bias: torch.Tensor | None
    w1: torch.Tensor
    w2: torch.Tensor
    shared1: torch.Tensor
    shared2: torch.Tensor
    norm: torch.Tensor
    down: torch.Tensor | None = None
    up: torch.Tensor | None = None


def model_width(m) -> int:
    """The width of the layer's hidden states: the model's (model_hidden) for a latent model, else `hidden`."""
    return m.model_hidden or m.hidden


def make_weights(m, inter: int, device="cuda", seed: int = 0) -> Weights:
    """Random weights for model m (a kerngen.tiers.Model), scaled so logits and activations are O(1)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    E, H, Hm, Inter = m.num_experts, m.hidden, model_width(m), inter

    def randn(*shape, scale, dtype=BF16):
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype).mul_(scale)

    latent = {} if not m.model_hidden else dict(down=randn(H, Hm, scale=Hm ** -0.5), up=randn(Hm, H, scale=H ** -0.5))
    return Weights(router=randn(E, Hm, scale=Hm ** -0.5, dtype=torch.float32),
                   bias=randn(E, scale=0.05, dtype=torch.float32) if "sigmoid_bias" in m.routing else None,
                   w1=randn(E, 2 * Inter, H, scale=H ** -0.5), w2=randn(E, H, Inter, scale=Inter ** -0.5),
                   shared1=randn(2 * Inter, Hm, scale=Hm ** -0.5), shared2=randn(Hm, Inter, scale=Inter ** -0.5),
                   norm=randn(H, scale=0.1).add_(1.0), **latent)


def make_inputs(tokens: int, hidden: int, device="cuda", seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states and residual, [T, H] bf16."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen, device=device, dtype=BF16)
    residual = torch.randn(tokens, hidden, generator=gen, device=device, dtype=BF16)
    return x, residual


def mlp(x, w1, w2):
    """SiLU-gated MLP batched over leading dims: x [..., n, H], w1 [..., 2I, H], w2 [..., H, I] -> [..., n, H]."""
    gate, up = (x @ w1.transpose(-1, -2)).float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype) @ w2.transpose(-1, -2)


def rmsnorm(y, weight):
    """fp32 y [T, H] -> weight's dtype, as kerngen.ops.tail.reference."""
    return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()).to(weight.dtype)


def torch_layer(m, w: Weights):
    """The layer in plain torch: fn(x, residual) -> (out [T, H] bf16, topk_ids [T, K] int32)."""
    route = torch_routing(m)
    bias = w.bias if w.bias is not None else torch.zeros(m.num_experts, device=w.router.device)

    def fn(x, residual):
        ids, weights = route(x.float() @ w.router.T, bias)
        xe = experts_input(x, w)
        T, H = xe.shape
        e = ids.flatten().long()
        xk = xe.unsqueeze(1).expand(T, m.top_k, H).reshape(T * m.top_k, 1, H)   # one row per (token, slot)
        if m.weight_on_input:   # Llama-4: the router weight scales the expert's input, outputs add up as they are
            xk = xk * weights.reshape(T * m.top_k, 1, 1).to(x.dtype)
        ye = mlp(xk, w.w1[e], w.w2[e]).view(T, m.top_k, H)
        yw = ye.float() if m.weight_on_input else ye.float() * weights.unsqueeze(-1)
        if w.up is not None:   # the latent tail: norm in L, then up to the model's width, the adds
            n = rmsnorm(yw.sum(1), w.norm)
            return ((n @ w.up.T).float() + mlp(x, w.shared1, w.shared2).float() + residual.float()).to(x.dtype), ids
        y = yw.sum(1) + mlp(x, w.shared1, w.shared2).float() + residual.float()
        return rmsnorm(y, w.norm), ids

    return fn


def permuted_rows_bound(tokens: int, top_k: int, num_experts: int, tile: int) -> int:
    """A bound on num_permuted_rows fixed by the token count, in whole tiles (so no host sync is needed).

    An expert with c > 0 rows takes ceil(c / tile) * tile <= c + tile - 1 rows, the counts sum to T*K and at most
    min(E, T*K) experts have any. num_permuted_rows is a multiple of tile, so round down. It is reached when
    T*K <= E experts get one row each; it never exceeds kerngen.ops.routing.max_rows (every expert padded),
    and is far below it at decode sizes (kimi-k3, T=8, tile 16: 2048 rows instead of 13568).
    """
    n = tokens * top_k
    return (n + min(num_experts, n) * (tile - 1)) // tile * tile


def permuted_experts(x, permuted_to_token, tile_to_expert, w: Weights, tile: int, rows: int, input_weights=None):
    """gemm2_out [rows, H]: the experts over the first `rows` permuted rows, one batched matmul per tile.

    rows = permuted_rows_bound(...). Padding rows (token -1) compute token 0 and tiles past num_permuted_rows
    (expert -1) use expert 0; finalize never reads those rows. input_weights [T] (top_k = 1 models whose router
    weight scales the input, Llama-4) multiplies each gathered row by its token's weight.
    """
    n = rows // tile
    tok = permuted_to_token[:rows].clamp(min=0).long()
    a = x[tok] if input_weights is None else x[tok] * input_weights[tok, None].to(x.dtype)
    a = a.view(n, tile, -1)
    e = tile_to_expert[:n].clamp(min=0).long()
    return mlp(a, w.w1[e], w.w2[e]).view(rows, -1)


def expert_rows(experts: str, x, r, w: Weights, tile: int, rows: int, input_weights=None):
    """gemm2_out of the routed experts: kerngen.experts ("kerngen") or the batched-matmul stand-in ("torch")."""
    if experts == "kerngen":
        return kerngen.experts(x, r, w.w1, w.w2, input_weights=input_weights)
    return permuted_experts(x, r.permuted_to_token, r.tile_to_expert, w, tile, rows, input_weights)


def experts_input(x, w: Weights):
    """The routed experts' input rows: x, or in a latent layer x @ down.T."""
    return x if w.down is None else x @ w.down.T


def tail(m, w: Weights, g, r, ones, shared, residual):
    """kerngen's tail of the layer: kerngen.moe_tail (finalize + shared + residual + RMSNorm), or in a latent layer
    kerngen.latent_tail (finalize and RMSNorm in L, the up projection, shared + residual)."""
    if w.up is not None:
        return kerngen.latent_tail(g, r.expanded_to_permuted, r.topk_weights, w.norm, w.up, shared=shared,
                                   residual=residual, eps=EPS)
    weights = ones[:r.topk_weights.shape[0]] if m.weight_on_input else r.topk_weights
    return kerngen.moe_tail(g, r.expanded_to_permuted, weights, w.norm, shared=shared, residual=residual, eps=EPS)


def kerngen_layer(m, w: Weights, tokens: int, tile: int, experts: str = "kerngen"):
    """The layer on kerngen's routing and tail: fn(x, residual) -> (out [T, H] bf16, topk_ids [T, K] int32)."""
    ws = kerngen.RoutingWorkspace(tokens, m.num_experts, m.top_k, tile)
    rows = permuted_rows_bound(tokens, m.top_k, m.num_experts, tile)
    ones = torch.ones(tokens, m.top_k, device=w.router.device)   # weights already applied to the input

    def fn(x, residual):
        r = kerngen.route(x.float() @ w.router.T, bias=w.bias, model=m.name, tile=tile, workspace=ws)
        on_input = r.topk_weights[:, 0] if m.weight_on_input else None
        g = expert_rows(experts, experts_input(x, w), r, w, tile, rows, on_input)
        return tail(m, w, g, r, ones, mlp(x, w.shared1, w.shared2), residual), r.topk_ids

    return fn


def three_stream_layer(m, w: Weights, tokens: int, tile: int, max_tokens: int = 8, experts: str = "kerngen"):
    """The kerngen layer on three streams (router, shared, main; see the module doc): fn(x, residual) ->
    (out [T, H] bf16, topk_ids [T, K] int32). The first call of a token count routes on the main stream (take);
    later ones are pre-routed on the router stream when T <= max_tokens."""
    pre = kerngen.PreRouting(model=m.name, tile=tile, max_tokens=max_tokens)
    router, side = torch.cuda.Stream(), torch.cuda.Stream()
    rows = permuted_rows_bound(tokens, m.top_k, m.num_experts, tile)
    ones = torch.ones(tokens, m.top_k, device=w.router.device)

    def fn(x, residual):
        main = torch.cuda.current_stream()
        router.wait_stream(main)   # fork: x is ready and the last layer's reads of pre.workspace come first
        side.wait_stream(main)
        with torch.cuda.stream(router):
            logits = x.float() @ w.router.T
            pre.launch(logits, w.bias)
        with torch.cuda.stream(side):
            shared = mlp(x, w.shared1, w.shared2)
        r = pre.take(logits, w.bias)   # joins the router stream
        on_input = r.topk_weights[:, 0] if m.weight_on_input else None
        g = expert_rows(experts, experts_input(x, w), r, w, tile, rows, on_input)
        main.wait_stream(side)         # joins the shared stream
        return tail(m, w, g, r, ones, shared, residual), r.topk_ids

    return fn


SCHEDULES = ("one", "three")
US = {"one": "kerngen_us", "three": "three_us"}          # run_case's key of each schedule's µs
COLUMN = {"one": "kerngen µs", "three": "kerngen 3-stream µs"}


def output_error(out, ref) -> tuple[float, float]:
    """(max |out - ref|, max |out - ref| / (|ref| + RMS of ref's row)), the second the one TOL bounds."""
    o, r = out.float(), ref.float()
    d = (o - r).abs()
    return d.max().item(), (d / (r.abs() + r.pow(2).mean(-1, keepdim=True).sqrt())).max().item()


def ids_agreement(ids, ref_ids) -> float:
    """Fraction of equal expert ids, each token's K sorted (order inside a top-k does not change the layer)."""
    return (ids.sort(-1).values == ref_ids.sort(-1).values).float().mean().item()


def graphed(fn, *args):
    """fn(*args) captured in a CUDA graph after one warm-up call, replayed once: (graph, its outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    return graph, outs


def run_case(m, w: Weights, tokens: int, tile: int = 16, compiled=None, timed: bool = True,
             schedules=("one",), pre_tokens: int = 8, experts: str = "kerngen") -> dict:
    """One (model, T): errors and id agreement of each kerngen schedule against torch (the worst of them), and
    µs per layer when timed; with both schedules, `same_bits`: three-stream outputs and ids equal one-stream's."""
    x, residual = make_inputs(tokens, model_width(m))
    ref = torch_layer(m, w)
    g_ref, (ref_out, ref_ids) = graphed(ref, x, residual)
    H = m.hidden if not m.model_hidden else f"{m.model_hidden} (L {m.hidden})"
    row = {"model": m.name, "E": m.num_experts, "K": m.top_k, "H": H, "I": w.w2.shape[-1], "T": tokens,
           "tile": tile, "schedules": tuple(schedules), "max_abs": 0.0, "max_rel": 0.0, "ids_equal": 1.0}
    layers, outs = {}, {}
    for s in schedules:
        fn = (kerngen_layer(m, w, tokens, tile, experts) if s == "one"
              else three_stream_layer(m, w, tokens, tile, pre_tokens, experts))
        g, (out, ids) = graphed(fn, x, residual)
        max_abs, max_rel = output_error(out, ref_out)
        row["max_abs"], row["max_rel"] = max(row["max_abs"], max_abs), max(row["max_rel"], max_rel)
        row["ids_equal"] = min(row["ids_equal"], ids_agreement(ids, ref_ids))
        layers[s], outs[s] = fn, (out.clone(), ids.clone())
        del g, out, ids
    if len(outs) == 2:
        row["same_bits"] = all(torch.equal(a, b) for a, b in zip(outs["one"], outs["three"]))
    del g_ref, ref_out, ref_ids, outs
    if timed:
        def us(fn):
            return graph_time_us(lambda: fn(x, residual), calls=10, replays=20)
        for s in schedules:
            row[US[s]] = us(layers[s])
        row["torch_us"] = us(ref)
        row["compile_us"] = us(compiled) if compiled is not None else None
    return row


def header(schedules=("one",)) -> str:
    """The table's header for these schedules (with one alone, the table docs/benchmarks.md has)."""
    both = len(schedules) == 2
    cols = ["model", "E/K", "H", "I", "T", *[COLUMN[s] for s in schedules], *(["3-stream saves µs"] if both else []),
            "torch µs", "torch.compile µs", "vs torch", "vs compile", "max abs err", "max rel err", "equal ids",
            *(["3-stream bits = 1-stream"] if both else [])]
    return "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols)


HEADER = header()


def markdown_row(r: dict) -> str:
    """One row of header(r["schedules"]); the speedups are those of the first schedule."""
    schedules = r.get("schedules", ("one",))
    both = len(schedules) == 2
    ours, comp = r[US[schedules[0]]], r["compile_us"]
    cells = [r["model"], f"{r['E']}/{r['K']}", r["H"], r["I"], r["T"], *[f"**{r[US[s]]:.1f}**" for s in schedules],
             *([f"{r['kerngen_us'] - r['three_us']:.1f}"] if both else []), f"{r['torch_us']:.1f}",
             "" if comp is None else f"{comp:.1f}", f"{r['torch_us'] / ours:.2f}x",
             "" if comp is None else f"{comp / ours:.2f}x", f"{r['max_abs']:.2e}", f"{r['max_rel']:.2e}",
             f"{r['ids_equal']:.4f}", *(["yes" if r["same_bits"] else "no"] if both else [])]
    return "| " + " | ".join(map(str, cells)) + " |"


def parse_schedules(text: str) -> tuple[str, ...]:
    """--schedule: a comma list of one and three, each once (ValueError naming the bad one)."""
    names = tuple(text.split(","))
    for s in names:
        if s not in SCHEDULES:
            raise ValueError(f"unknown schedule {s!r}; known: {', '.join(SCHEDULES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"schedule given twice in {text!r}")
    return names


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="kimi-k3,deepseek-v3")
    ap.add_argument("--tokens", default="8", help="comma-separated token counts T")
    ap.add_argument("--inter", type=int, default=256, help="intermediate size I of each expert")
    ap.add_argument("--tile", type=int, default=16, help="rows per tile of the permutation")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile of the torch layer")
    ap.add_argument("--schedule", default="one", help="comma-separated kerngen schedules: one (one stream), "
                    "three (router and shared streams, kerngen.PreRouting)")
    ap.add_argument("--pre-tokens", type=int, default=8, help="PreRouting's max_tokens in the three-stream schedule")
    ap.add_argument("--experts", default="kerngen", choices=("kerngen", "torch"),
                    help="the routed experts of the kerngen path: kerngen.experts, or the batched-matmul stand-in")
    a = ap.parse_args(argv)
    require_gpu("python3 -m tools.bench.moe_layer_demo")
    try:
        schedules = parse_schedules(a.schedule)
    except ValueError as e:
        ap.error(str(e))
    known = kerngen.models()
    names = a.models.split(",")
    for name in names:
        if name not in known:
            ap.error(f"unknown model {name!r}; known: {', '.join(sorted(known))}")
    tokens = [int(t) for t in a.tokens.split(",")]
    pre = f" pre-tokens={a.pre_tokens}" if "three" in schedules else ""
    print(f"inter={a.inter} tile={a.tile}{pre} experts={a.experts} tolerance: max rel err <= {TOL}\n\n"
          f"{header(schedules)}", flush=True)
    worst = 0.0
    for name in names:
        m = known[name]
        w = make_weights(m, a.inter)
        compiled = torch.compile(torch_layer(m, w), dynamic=False) if a.compile else None
        for T in tokens:
            r = run_case(m, w, T, a.tile, compiled, schedules=schedules, pre_tokens=a.pre_tokens, experts=a.experts)
            worst = max(worst, r["max_rel"])
            print(markdown_row(r), flush=True)
        del w, compiled
        torch.cuda.empty_cache()
    if worst > TOL:
        print(f"FAIL: max rel err {worst:.3e} > {TOL}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
