#!/usr/bin/env python3
"""Host cost of kerngen's public ops and of the transformers integration's MoE block, eager (no graph), against
`x.add_(1)` on a small tensor in the same process.

    python3 -m tools.bench.host_cost [--n 2000] [--repeats 3] [--no-blocks] [--no-graph]

Host µs: the least of --repeats runs of `host_us` (tools/bench/lib.py: --n calls back to back, wall clock, the
GPU idle-fast: each call's GPU work is a few µs, so the GPU keeps up and the host is what is measured). Ops
(kerngen's public API only: route, permute, experts, finalize, finalize_prepare, moe_tail, RoutingWorkspace) at
T = 1: route at kimi-k3's routing (E 896, K 16, sigmoid + fp32 bias, tile 128) by model name, and at
qwen3-30b-a3b's (E 128, K 8, softmax_topk) by explicit arguments, with and without `workspace=`, and without a
tile; permute of 8 ids over 128 experts; experts / finalize / moe_tail at qwen3-30b-a3b's dimensions (H 2048,
I 768, E 128, K 8, tile 8; experts also at H 256, I 128, whose GPU time is below the host's: at qwen3-30b-a3b's
dimensions the experts' ~26 µs of GPU work a call bound the back-to-back loop; these rows follow the environment's
KERNGEN_EAGER_GRAPHS, unset: repeated calls of at most 4 tokens replay from a CUDA graph, and the "=0" row is the
same call with its kernels launched one by one). Blocks: transformers' Qwen3MoeSparseMoeBlock (qwen3-30b-a3b) and DeepseekV3MoE
(deepseek-v3, one shared expert), built as tools/bench/moe_block.py builds them at the tier table's intermediate
size, one token, transformers' "grouped_mm" experts and routers against kerngen
(kerngen.integrations.transformers.enable).

Columns: host µs and its ratio to x.add_(1); stream µs (CUDA events around --n/10 back-to-back calls: the larger
of host and GPU time per call); GPU µs (the same calls replayed from a CUDA graph: the GPU's own time, "-" where
capture fails). host ≈ stream ≫ GPU: host-bound.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

import torch

NO_GPU = "host_cost: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing was measured."


class _Rows(dict):
    """name -> callable; a setup step that raises leaves name -> the exception (a failed row), the rest go on."""

    @contextlib.contextmanager
    def setup(self, name: str):
        try:
            yield
        except Exception as e:   # reported in the table, never dropped
            self[name] = e


def eager_graphs(call, value: str):
    """`call` with its shape's kernels built under KERNGEN_EAGER_GRAPHS=value (three calls: with graphs on, met,
    captured, replayed)."""
    before = os.environ.get("KERNGEN_EAGER_GRAPHS")
    os.environ["KERNGEN_EAGER_GRAPHS"] = value
    try:
        for _ in range(3):
            call()
    finally:
        if before is None:
            os.environ.pop("KERNGEN_EAGER_GRAPHS", None)
        else:
            os.environ["KERNGEN_EAGER_GRAPHS"] = before
    return call


def op_rows(dev) -> dict:
    """name -> zero-argument callable (or the exception its setup raised): the public ops at T = 1."""
    import kerngen
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = _Rows()
    x = torch.zeros(1, device=dev)
    rows["x.add_(1)"] = lambda: x.add_(1)
    rows["torch.empty(1, 2048) bf16"] = lambda: torch.empty((1, 2048), dtype=torch.bfloat16, device=dev)
    try:   # the floor of any ctypes launch: a driver call that does nothing
        import ctypes
        nolaunch = ctypes.CDLL("libcuda.so.1").cuDriverGetVersion
        nolaunch.argtypes = [ctypes.c_void_p]
        ver = ctypes.c_int()
        ver_p = ctypes.addressof(ver)
        rows["ctypes no-op driver call"] = lambda: nolaunch(ver_p)
    except OSError:
        pass

    # route: kimi-k3 by model name (tile 128), with and without a workspace
    with rows.setup("route(model='kimi-k3', ...)"):
        km = kerngen.models()["kimi-k3"]
        E3, K3 = km.num_experts, km.top_k
        lk = torch.randn(1, E3, device=dev, generator=gen)
        bk = torch.randn(E3, device=dev, generator=gen) * 0.05
        wsk = kerngen.RoutingWorkspace(1, E3, K3, 128, device=dev)
        rows["route(model='kimi-k3', tile=128, workspace=ws)"] = (
            lambda: kerngen.route(lk, bias=bk, model="kimi-k3", tile=128, workspace=wsk))
        rows["route(model='kimi-k3', tile=128)"] = lambda: kerngen.route(lk, bias=bk, model="kimi-k3", tile=128)

    # route: explicit arguments at qwen3-30b-a3b's routing
    H, I, E, K = 2048, 768, 128, 8
    lq = torch.randn(1, E, device=dev, generator=gen)
    kw = dict(top_k=K, method="softmax_topk", renormalize=True)
    with rows.setup("route(top_k=8, softmax_topk, ...)"):
        ws8 = kerngen.RoutingWorkspace(1, E, K, 8, device=dev)
        rows["route(top_k=8, softmax_topk, tile=8, workspace=ws)"] = (
            lambda: kerngen.route(lq, tile=8, workspace=ws8, **kw))
        rows["route(top_k=8, softmax_topk, tile=8)"] = lambda: kerngen.route(lq, tile=8, **kw)
        rows["route(top_k=8, softmax_topk) no tile"] = lambda: kerngen.route(lq, **kw)

    r = None
    with rows.setup("permute / experts / finalize / moe_tail (setup: route(top_k=8, tile=8))"):
        r = kerngen.route(lq, tile=8, **kw)           # its own buffers: nothing below writes them
    if r is not None:
        with rows.setup("permute(ids, num_experts=128, tile=8, ...)"):
            ids = r.topk_ids.clone()
            wsp = kerngen.RoutingWorkspace(1, E, K, 8, device=dev)
            rows["permute(ids, num_experts=128, tile=8, workspace=ws)"] = (
                lambda: kerngen.permute(ids, num_experts=E, tile=8, workspace=wsp))
            rows["permute(ids, num_experts=128, tile=8)"] = lambda: kerngen.permute(ids, num_experts=E, tile=8)

        # experts, finalize, moe_tail at qwen3-30b-a3b's dimensions
        with rows.setup("experts / finalize / moe_tail (setup: experts(x, r, w13, w2))"):
            xs = torch.randn(1, H, device=dev, generator=gen).to(torch.bfloat16)
            w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=dev).normal_(0, H ** -0.5, generator=gen)
            w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=dev).normal_(0, I ** -0.5, generator=gen)
            out_e = torch.empty(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device=dev)
            rows["experts(x, r, w13, w2, out=out)"] = lambda: kerngen.experts(xs, r, w13, w2, out=out_e)
            rows["experts(x, r, w13, w2)"] = lambda: kerngen.experts(xs, r, w13, w2)
            # the same calls at H 256, I 128: their GPU work (~4 µs) no longer hides the host's
            hs, is_ = 256, 128
            xs_s = torch.randn(1, hs, device=dev, generator=gen).to(torch.bfloat16)
            w13_s = torch.empty(E, 2 * is_, hs, dtype=torch.bfloat16, device=dev).normal_(0, hs ** -0.5, generator=gen)
            w2_s = torch.empty(E, hs, is_, dtype=torch.bfloat16, device=dev).normal_(0, is_ ** -0.5, generator=gen)
            out_s = torch.empty(r.permuted_to_token.shape[0], hs, dtype=torch.bfloat16, device=dev)
            rows["experts(x, r, w13, w2, out=out) at H 256, I 128"] = (
                lambda: kerngen.experts(xs_s, r, w13_s, w2_s, out=out_s))
            rows["experts(x, r, w13, w2) at H 256, I 128"] = lambda: kerngen.experts(xs_s, r, w13_s, w2_s)
            out_g = torch.empty_like(out_s)   # (gelu: a shape of its own, built with the flag set)
            rows["experts(..., out=out) at H 256, I 128, KERNGEN_EAGER_GRAPHS=0"] = eager_graphs(
                lambda: kerngen.experts(xs_s, r, w13_s, w2_s, activation="gelu", out=out_g), "0")
            g = kerngen.experts(xs, r, w13, w2)
            e2p, w = r.expanded_to_permuted, r.topk_weights
            out_f = torch.empty(1, H, dtype=torch.bfloat16, device=dev)
            rows["finalize(g, e2p, w, out=out)"] = lambda: kerngen.finalize(g, e2p, w, out=out_f)
            rows["finalize(g, e2p, w)"] = lambda: kerngen.finalize(g, e2p, w)
            if hasattr(kerngen, "finalize_prepare"):
                with rows.setup("finalize_prepare(...).run()"):
                    rows["finalize_prepare(...).run()"] = kerngen.finalize_prepare(g, e2p, w, out=out_f).run
            nw = torch.ones(H, dtype=torch.bfloat16, device=dev)
            out_t = torch.empty(1, H, dtype=torch.bfloat16, device=dev)
            rows["moe_tail(g, e2p, w, norm, out=out)"] = lambda: kerngen.moe_tail(g, e2p, w, nw, out=out_t)
            rows["moe_tail(g, e2p, w, norm)"] = lambda: kerngen.moe_tail(g, e2p, w, nw)
    return rows


def _switch(block, impl: str) -> None:
    import kerngen.integrations.transformers as kt
    kt.disable(block)
    if impl.startswith("kerngen"):   # kerngen (block graphs, the default) or kerngen-eager (graphs=False)
        if not kt.enable(block, graphs=None if impl == "kerngen" else False):
            raise RuntimeError("kerngen.integrations.transformers.enable patched nothing")
    else:
        block.experts.config._experts_implementation_internal = impl


def block_rows(dev, models=("qwen3-30b-a3b", "deepseek-v3")):
    """Yields (name, call, switch) per (model, impl): switch() sets the block to impl, call() runs it once."""
    import kerngen
    from .moe_block import build_block
    for name in models:
        m = kerngen.models()[name]
        block = build_block(m, m.intermediate, device=dev)
        x = torch.randn(1, 1, m.hidden, device=dev, generator=torch.Generator(device=dev).manual_seed(1)).to(
            torch.bfloat16)
        for impl in ("grouped_mm", "kerngen", "kerngen-eager"):
            def call(block=block, x=x):
                out = block(x)
                return out[0] if isinstance(out, tuple) else out
            yield f"{type(block).__name__} ({name}) T=1 {impl}", call, (lambda b=block, i=impl: _switch(b, i))


def measure(name, fn, a, base) -> dict:
    from .lib import best_host_us, events_us, graph_time_us
    row = dict(name=name, host=best_host_us(fn, a.repeats, a.n), stream=None, gpu=None, note="")
    row["stream"] = events_us(fn, max(a.n // 10, 20))
    if not a.no_graph:
        try:
            row["gpu"] = graph_time_us(fn, calls=10, replays=10)
        except Exception as e:   # reported in the row, never dropped
            row["note"] = f"no graph: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:60]}"
            torch.cuda.synchronize()
    row["ratio"] = row["host"] / (base or row["host"])
    return row


def fmt(row) -> str:
    v = lambda x: "-" if x is None else f"{x:.1f}"
    return (f"| {row['name']} | {row['host']:.1f} | {row['ratio']:.2f} | {v(row['stream'])} | {v(row['gpu'])} "
            f"| {row['note']} |")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000, help="calls per host timing (blocks: a tenth)")
    ap.add_argument("--repeats", type=int, default=3, help="host timings per row (the least is kept)")
    ap.add_argument("--no-blocks", action="store_true", help="skip the transformers MoE blocks")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph (GPU µs) column")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(NO_GPU, file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, host µs per call (least of {a.repeats} x "
          f"{a.n} calls), T = 1\n")
    print("| call | host µs | × x.add_(1) | stream µs | GPU µs (graph) | note |\n|---|---|---|---|---|---|",
          flush=True)
    base, failed = None, False
    with torch.no_grad():
        for name, fn in op_rows(dev).items():
            try:
                if isinstance(fn, Exception):
                    raise fn
                row = measure(name, fn, a, base)
            except Exception as e:
                failed = True
                print(f"| {name} | - | - | - | - | failed: {type(e).__name__}: {str(e)[:100]} |", flush=True)
                continue
            base = base or row["host"]
            print(fmt(row), flush=True)
        if a.no_blocks:
            return int(failed)
        try:
            import transformers  # noqa: F401
            blocks = list(block_rows(dev))
        except ImportError as e:
            print(f"\n(blocks skipped: {e})")
            return int(failed)
        except Exception as e:   # a block that cannot be built: reported, the ops' rows stand
            print(f"| transformers MoE blocks | - | - | - | - | failed: {type(e).__name__}: {str(e)[:100]} |")
            return 1
        nb = argparse.Namespace(**{**vars(a), "n": max(a.n // 10, 50)})
        done = {}
        for name, fn, switch in blocks:
            try:
                switch()
                row = measure(name, fn, nb, base)
            except Exception as e:
                failed = True
                print(f"| {name} | - | - | - | - | failed: {type(e).__name__}: {str(e)[:100]} |", flush=True)
                continue
            done[name] = row
            other = done.get(name.replace(" kerngen", " grouped_mm")) if name.endswith(" kerngen") else None
            if other:   # > 1: kerngen's block is faster
                ratio = lambda k: "-" if not (other[k] and row[k]) else f"{other[k] / row[k]:.2f}x"
                row["note"] = "; ".join([n for n in (row["note"],) if n] + [
                    f"grouped_mm / kerngen: host {ratio('host')}, stream {ratio('stream')}, GPU {ratio('gpu')}"])
            print(fmt(row), flush=True)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main())
