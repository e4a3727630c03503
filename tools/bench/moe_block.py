#!/usr/bin/env python3
"""One transformers 5 MoE block, its experts implementations side by side: "eager" and "grouped_mm"
(transformers' router and experts) against "kerngen" (kerngen.integrations.transformers: kerngen routing and
permutation, kerngen.experts' kernels at decode sizes and torch._grouped_mm beyond, kerngen.finalize), the same
block, weights and inputs, one process.

    python3 -m tools.bench.moe_block [--models kimi-k3,deepseek-v3,qwen3-30b-a3b] [--tokens 1,8,64,512]
                                     [--inter 256|model] [--calls 10]

The block of a model (E, K, H and routing from kerngen's tier table; intermediate size --inter, bf16, random
weights N(0, 1/fan_in), correction bias N(0, 0.05)): sigmoid_bias / grouped_sigmoid_bias -> DeepseekV3MoE (with
its one shared expert), softmax_topk -> Qwen3MoeSparseMoeBlock, topk_softmax -> GptOssMLP, top1_sigmoid ->
Llama4TextMoe (no ExpertsInterface: "eager" is transformers' dense block, "grouped_mm" does not exist).

Timing: µs per block call, a CUDA graph of --calls calls, median of 30 replays (benchlib.graph_time_us). "eager"
is not capturable (its per-expert loop reads on the host which experts were hit), so it is timed on the stream
with CUDA events, and so is any implementation whose capture fails (the row says why). Every implementation is
also timed without a graph (host cost included). Ratios: eager's and grouped_mm's best time over kerngen's.

Check, after timing: each implementation's output (left by a graph replay where it was captured) against
eager's, max |out - eager| / (|eager| + RMS of eager) <= TOL (exit 1 above). eager rounds every weighted
expert row to bf16 and accumulates the K rows in bf16; kerngen and grouped_mm accumulate in fp32: up to a few
bf16 steps (2**-8) apart at K = 8-16. TOL = 2**-5 allows eight; a wrong expert or weight is O(1).
"""
from __future__ import annotations

import argparse
import statistics
import sys


import torch

import kerngen
import kerngen.integrations.transformers as kt
from kerngen.integrations import transformers_experts as kx
from .lib import events_us, graph_time_us, require_gpu

IMPLS = ("eager", "grouped_mm", "kerngen")
TOL = 2 ** -5
NO_GRAPH = {"eager": "its per-expert loop reads which experts were hit on the host (nonzero)"}


def build_block(m, inter: int, device="cuda", dtype=torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    """transformers' MoE block for kerngen model m (a kerngen.tiers.Model), random weights, experts "eager"."""
    E, K, H = m.num_experts, m.top_k, m.hidden
    if m.routing in ("sigmoid_bias", "grouped_sigmoid_bias"):
        from transformers import DeepseekV3Config
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE as cls
        cfg = DeepseekV3Config(hidden_size=H, moe_intermediate_size=inter, n_routed_experts=E, num_experts_per_tok=K,
                               n_group=m.n_group, topk_group=m.topk_group, norm_topk_prob=m.renormalize,
                               routed_scaling_factor=m.routed_scaling_factor, n_shared_experts=1)
    elif m.routing == "softmax_topk":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock as cls
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=inter, num_experts=E, num_experts_per_tok=K,
                             norm_topk_prob=m.renormalize)
    elif m.routing == "topk_softmax":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as cls
        cfg = GptOssConfig(hidden_size=H, intermediate_size=inter, num_local_experts=E, num_experts_per_tok=K)
    else:
        from transformers import Llama4TextConfig
        from transformers.models.llama4.modeling_llama4 import Llama4TextMoe as cls
        cfg = Llama4TextConfig(hidden_size=H, intermediate_size=inter, num_local_experts=E, num_experts_per_tok=K)
    cfg._experts_implementation = "eager"
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):   # built in `dtype` directly: kimi-k3's experts in fp32 would not fit
        block = cls(cfg)
    block = block.to(dtype).to_empty(device=device)
    with torch.no_grad():
        for name, t in [*block.named_parameters(), *block.named_buffers()]:
            # gate_up [E, 2I, H] / down [E, H, I] (gpt-oss and Llama-4 transposed), linears [out, in]
            fan_in = t.shape[-2] if name.startswith("experts.") and kx.transposed(block.experts) else t.shape[-1]
            std = 0.05 if "bias" in name else fan_in ** -0.5
            for part in (t.unsqueeze(0) if t.dim() < 3 else t):   # an expert at a time: no whole-layer temporary
                part.copy_(torch.randn(part.shape, generator=gen, device=device) * std)
    block = block.eval()
    if m.routing in ("sigmoid_bias", "grouped_sigmoid_bias"):
        block.gate.float()   # DeepSeek-V3 keeps its router weight and correction bias in fp32 (_keep_in_fp32_modules)
    return block


def use(block, impl: str) -> bool:
    """Switch block to an experts implementation; False where the block has no such implementation."""
    kt.disable(block)
    if impl == "kerngen":
        kt.enable(block)
    elif kt._dispatches(block.experts):
        block.experts.config._experts_implementation_internal = impl
    else:
        return impl == "eager"   # Llama4TextMoe: transformers' block is the only other implementation
    return True


def call(block, x):
    out = block(x)
    return out[0] if isinstance(out, tuple) else out


def stream_time_us(fn, calls: int = 10, replays: int = 10) -> float:
    """Median µs per call of `fn` launched on the stream (no graph; host cost included when it dominates)."""
    for _ in range(3):
        fn()
    return statistics.median(events_us(fn, calls, warmup=0) for _ in range(replays))


def graphed(fn):
    """fn captured in a CUDA graph after a warm-up call, replayed once: its output as the replay left it."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def rel_err(out, ref) -> float:
    o, r = out.float(), ref.float()
    return ((o - r).abs() / (r.abs() + r.pow(2).mean().sqrt())).max().item()


def check(block, x, graph: bool) -> dict:
    """{impl: output} of every implementation the block has (graph-replay outputs where capturable), and the
    reason a graph was not used."""
    outs, notes = {}, {}
    with torch.no_grad():
        for impl in IMPLS:
            if not use(block, impl):
                continue
            if graph and impl not in NO_GRAPH:
                try:
                    _, outs[impl] = graphed(lambda: call(block, x))
                    continue
                except Exception as e:   # reported in the row, never dropped
                    notes[impl] = f"capture failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            outs[impl] = call(block, x)
    return {"outputs": outs, "notes": notes}


def errors(outs: dict) -> dict:
    return {impl: rel_err(o, outs["eager"]) for impl, o in outs.items()}


def run_case(block, m, T: int, calls: int) -> list[dict]:
    """One (model, T): a row per implementation with µs (graph, stream), the graph note and the error."""
    x = torch.randn(1, T, m.hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(T)).to(
        torch.bfloat16)
    rows = []
    with torch.no_grad():
        for impl in IMPLS:
            if not use(block, impl):
                rows.append(dict(impl=impl, note=f"n/a: {type(block).__name__} has no {impl} experts"))
                continue
            fn = (lambda: call(block, x))   # noqa: E731
            row = dict(impl=impl, stream_us=stream_time_us(fn, calls=calls), graph_us=None, note="")
            if impl in NO_GRAPH:
                row["note"] = f"no graph: {NO_GRAPH[impl]}"
            else:
                try:
                    row["graph_us"] = graph_time_us(fn, calls=calls)
                except Exception as e:
                    row["note"] = f"no graph: capture failed: {type(e).__name__}: {str(e).splitlines()[0][:80]}"
            rows.append(row)
    checked = check(block, x, graph=True)
    errs = errors(checked["outputs"])
    for r in rows:
        r.update(model=m.name, T=T, err=errs.get(r["impl"]))
        if r["impl"] in checked["notes"]:
            r["note"] = (r["note"] + "; " if r["note"] else "") + checked["notes"][r["impl"]]
    return rows


def best(r) -> float | None:
    return r.get("graph_us") or r.get("stream_us")


HEADER = (f"{'model':16s} {'T':>4s} {'impl':10s} {'graph µs':>9s} {'stream µs':>9s} {'vs eager':>8s} "
          f"{'vs grouped':>10s} {'rel err':>8s}  note")


def print_rows(rows: list[dict]) -> None:
    by = {(r["model"], r["T"], r["impl"]): r for r in rows}
    for r in rows:
        k = by.get((r["model"], r["T"], "kerngen"))
        ratio = {}
        for other in ("eager", "grouped_mm"):
            o = by.get((r["model"], r["T"], other))
            ratio[other] = (f"{best(o) / best(k):7.2f}x" if r["impl"] == "kerngen" and o and best(o) and best(k)
                            else "")
        fmt = lambda v: f"{v:9.1f}" if v is not None else f"{'-':>9s}"
        err = f"{r['err']:8.1e}" if r.get("err") is not None else f"{'-':>8s}"
        print(f"{r['model']:16s} {r['T']:4d} {r['impl']:10s} {fmt(r.get('graph_us'))} {fmt(r.get('stream_us'))} "
              f"{ratio['eager']:>8s} {ratio['grouped_mm']:>10s} {err}  {r.get('note', '')}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="kimi-k3,deepseek-v3,qwen3-30b-a3b")
    ap.add_argument("--tokens", default="1,8,64,512")
    ap.add_argument("--inter", default="256", help="intermediate size of each expert, or 'model': the tier "
                    "table's intermediate of each model")
    ap.add_argument("--calls", type=int, default=10, help="block calls per graph / per timed batch")
    a = ap.parse_args(argv)
    require_gpu("python3 -m tools.bench.moe_block")
    known = kerngen.models()
    for name in a.models.split(","):
        if name not in known:
            ap.error(f"unknown model {name!r}; known: {', '.join(sorted(known))}")
    tokens = [int(t) for t in a.tokens.split(",")]
    if a.inter != "model" and not a.inter.isdigit():
        ap.error(f"--inter: a positive integer or 'model', got {a.inter!r}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, inter={a.inter}, bf16, "
          f"tolerance {TOL:.3g}\n\n{HEADER}", flush=True)
    rows, worst = [], 0.0
    for name in a.models.split(","):
        m = known[name]
        inter = m.intermediate if a.inter == "model" else int(a.inter)
        if not inter:
            ap.error(f"--inter model: {name} has no intermediate size in the tier table")
        block = build_block(m, inter)
        for T in tokens:
            case = run_case(block, m, T, a.calls)
            print_rows(case)
            rows += case
            worst = max([worst] + [r["err"] for r in case if r.get("err") is not None])
        del block
        torch.cuda.empty_cache()
    if worst > TOL:
        print(f"FAIL: rel err {worst:.3e} > {TOL}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
