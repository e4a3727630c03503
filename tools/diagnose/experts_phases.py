#!/usr/bin/env python3
"""When kerngen.experts' CTAs do what: a %globaltimer stamp at each work item of experts_gemm1 / experts_gemm2 (or
experts_gemm12, one_launch), after a producer kernel, so that the rounds of items, the last round's tail and (one
launch) GEMM2's waits on its tiles can be read off.

    python3 -m tools.diagnose.experts_phases --model gpt-oss-120b --tokens 1 [--format mxfp4] [--rule k=v,...]
    python3 -m tools.diagnose.experts_phases --model gpt-oss-120b --tokens 1 --rule one_launch=true

The tier rule's build for the shape (or the rule with --rule's params laid over it) is rendered with events by thread
0 of each CTA (`instrument`): its kernel's entry and end, each GEMM1 and GEMM2 item's start, and with one_launch the
return of each GEMM2 item's wait on its tile. An item ends where the CTA's next event is. One call (after two that
build and warm up) runs right behind a 4 MB producer kernel, eager; printed in µs from the first entry: per kernel
its entries and ends, per GEMM its items' starts and lengths (least / median / largest), the items still running at
each quarter of the span, and GEMM2's waits. Events cost a few instructions and an atomic each; the timings are of
the instrumented build. Needs a GPU; `instrument` runs anywhere.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics

from ..bench import experts as bench
from ..bench.lib import require_gpu

MAX_EVENTS = 1 << 16
KINDS = {0: "entry", 1: "gemm1 item", 2: "gemm2 item", 3: "gemm2 waited", 4: "end"}
KERNELS = ("experts_gemm1", "experts_gemm2", "experts_gemm12")
# (anchor in the rendered source, the event inserted before it (after it for the waits): kind, its item expression)
ITEM_ANCHORS = [("        const int j = item / S, i = (item % S) * ", 1, False),
                ("        const int j = item / S, h0 = (item % S) * ", 2, False),
                ("        kg_wait_tile(p, j);   // its tile's intermediate is written\n", 3, True)]


def instrument(source: str) -> str:
    """The experts source with `kg_event(kernel, kind, item)` by thread 0 of each CTA at each item (kernel: the index
    in KERNELS of the kernel the event is in; kind: KINDS), appended to kg_ev with the %globaltimer."""
    decl = (f"__device__ unsigned long long kg_ev[{MAX_EVENTS}][2];\n"
            "__device__ unsigned kg_nev;\n"
            "__device__ __forceinline__ void kg_event(int k, int kind, int item) {\n"
            "    if (threadIdx.x == 0) {\n"
            "        unsigned long long t;\n"
            "        asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t) :: \"memory\");\n"
            "        const unsigned n = atomicAdd(&kg_nev, 1u);\n"
            f"        if (n < {MAX_EVENTS}) {{\n"
            "            kg_ev[n][0] = ((unsigned long long)(unsigned)item << 32) | ((unsigned long long)kind << 28)"
            " | ((unsigned long long)k << 24) | blockIdx.x;\n"
            "            kg_ev[n][1] = t;\n"
            "        }\n"
            "    }\n"
            "}\n")
    i = source.find("struct Params {")
    if i < 0:
        raise ValueError("experts_phases: no struct Params in the source")
    src = source[:i] + decl + source[i:]
    heads = [(src.find(f"{name}(const __grid_constant__ Params p) {{\n"), k) for k, name in enumerate(KERNELS)]
    heads = sorted((pos, k) for pos, k in heads if pos >= 0)
    if not heads:
        raise ValueError("experts_phases: no experts GEMM kernel in the source")
    out, last = [], 0
    for pos, k in heads:   # each kernel: entry, its items, end
        body_at = src.index("{\n", pos) + 2
        end = src.find("\n}\n", body_at)
        body = src[body_at:end]
        for anchor, kind, after in ITEM_ANCHORS:
            event = f"        kg_event({k}, {kind}, item);\n"
            body = body.replace(anchor, anchor + event if after else event + anchor)
        out += [src[last:body_at], f"    kg_event({k}, 0, 0);\n", body, f"\n    kg_event({k}, 4, 0);"]
        last = end
    out.append(src[last:])
    src = "".join(out)
    if "kg_event(0, 1, item)" not in src and "kg_event(2, 1, item)" not in src:
        raise ValueError("experts_phases: no GEMM1 item found; update ITEM_ANCHORS")
    return src


def _spread(v: list[float]) -> str:
    v = sorted(v)
    return f"{v[0]:.2f} / {statistics.median(v):.2f} / {v[-1]:.2f}" if v else "-"


def summary(events: list[tuple[int, int, int, int, int]]) -> str:
    """events: (t ns, kernel, kind, item, cta) -> the printed report."""
    if not events:
        return "  no events"
    t0 = min(e[0] for e in events)
    ev = sorted(((t - t0) / 1000, k, kind, item, cta) for t, k, kind, item, cta in events)
    span = max(e[0] for e in ev)
    rows = []
    for k in sorted({e[1] for e in ev}):
        mine = [e for e in ev if e[1] == k]
        ctas = {e[4] for e in mine}
        rows.append(f"  {KERNELS[k]} ({len(ctas)} CTAs): entry {_spread([e[0] for e in mine if e[2] == 0])}; "
                    f"end {_spread([e[0] for e in mine if e[2] == 4])}")
        by_cta: dict[int, list] = {}
        for e in mine:
            by_cta.setdefault(e[4], []).append(e)
        spans = {1: [], 2: []}   # (start, end) of each item: the CTA's next event ends it
        waits = []
        for seq in by_cta.values():
            for i, a in enumerate(seq[:-1]):
                if a[2] in (1, 2):
                    b = seq[i + 1]
                    if b[2] == 3:   # a GEMM2 item's wait: the item ends at the event after it
                        waits.append(b[0] - a[0])
                        b = seq[min(i + 2, len(seq) - 1)]
                    spans[a[2]].append((a[0], b[0]))
        for kind in (1, 2):
            if spans[kind]:
                s = spans[kind]
                live = " ".join(f"{sum(1 for a, b in s if a <= t < b)}" for t in (span * f for f in (0.25, 0.5, 0.75)))
                rows.append(f"    {KINDS[kind]}s: {len(s)}, start {_spread([a for a, _ in s])}, "
                            f"length {_spread([b - a for a, b in s])}; running at 1/4, 1/2, 3/4 of the span: {live}")
        if waits:
            rows.append(f"    gemm2 waits on their tiles: {_spread(waits)} ({sum(w > 0.5 for w in waits)} over 0.5 µs)")
    return f"  span {span:.2f} µs\n" + "\n".join(rows)


def run(model: str, T: int, fmt: str, rule: dict | None) -> str:
    import torch
    from cuda.bindings import driver as drv

    import kerngen
    from kerngen import jit, launch
    from kerngen.ops import experts as ex
    from kerngen.plan import target_arch
    from kerngen.timing import elementwise_producer
    from kerngen.tune import random_expert_weights

    H, I, E, K, act, gpt = bench.SHAPES[model]
    arch = target_arch()
    spec = ex.spec(H, I, None, act, T, arch, fmt=fmt, experts=E, top_k=K)
    if rule:
        p = {**dict(spec.params), **rule}
        spec = bench.launch_spec({k: v for k, v in p.items() if k != "backend"}, ex.tile_of(spec), H, I, act, arch,
                                 fmt, "nk", False)
    render = jit.render
    jit.render = lambda s: instrument(render(s)) if s == spec else render(s)
    launch._resolved.pop(spec, None)
    try:
        k = ex.Kernels(spec, torch.cuda.current_device())   # (its module: the instrumented build)
    finally:
        jit.render = render
        launch._resolved.pop(spec, None)   # (later uses of the spec in this process: the plain build)
    gen = torch.Generator(device="cuda").manual_seed(T)
    (a, s13), (b, s2) = random_expert_weights(E, 2 * I, H, fmt), random_expert_weights(E, H, I, fmt)
    x = (torch.randn(T, H, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    r = kerngen.route(torch.randn(T, E, device="cuda", generator=gen), top_k=K, method="softmax_topk",
                      tile=ex.tile_of(spec))
    out = torch.empty(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
    act_buf = torch.empty(r.tile_to_expert.shape[0] * ex.tile_of(spec), I, dtype=torch.bfloat16, device="cuda")
    kw = dict(interleaved=gpt, a0=1.702 if gpt else 1.0, a1=7.0 if gpt else 0.0)
    if fmt != "bf16":
        kw.update(w13_scale=s13, w2_scale=s2)
    produce = elementwise_producer()
    _, nev, _ = drv.cuLibraryGetGlobal(k._mod._library, b"kg_nev")
    _, evp, size = drv.cuLibraryGetGlobal(k._mod._library, b"kg_ev")
    for _ in range(3):
        torch.cuda.synchronize()
        drv.cuMemsetD32(nev, 0, 1)
        produce()
        k(x, r, a, b, out, act_buf, **kw)
    torch.cuda.synchronize()
    count = ctypes.c_uint(0)
    drv.cuMemcpyDtoH(ctypes.addressof(count), nev, 4)
    raw = (ctypes.c_ulonglong * (size // 8))()
    drv.cuMemcpyDtoH(ctypes.addressof(raw), evp, size)
    events = []
    for n in range(min(count.value, MAX_EVENTS)):
        meta, t = raw[2 * n], raw[2 * n + 1]
        events.append((t, (meta >> 24) & 0xF, (meta >> 28) & 0xF, meta >> 32, meta & 0xFFFFFF))
    return f"{model} T={T} {fmt} {dict(spec.params)}: {count.value} events\n" + summary(events)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-oss-120b")
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--format", default="mxfp4", choices=("bf16", "fp8", "mxfp4"))
    ap.add_argument("--rule", type=lambda t: bench.parse_rule(t, partial=True), default=None,
                    help="params laid over the tier rule's, e.g. one_launch=true")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = parse_args(argv)
    require_gpu("python3 -m tools.diagnose.experts_phases")
    for T in (int(t) for t in a.tokens.split(",")):
        print(run(a.model, T, a.format, a.rule), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
