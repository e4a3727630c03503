#!/usr/bin/env python3
"""When the split latent tail's two kernels do what: %globaltimer stamps of every CTA of latent_tail_norm and
latent_tail_proj, replayed from a CUDA graph right behind a producer kernel.

    python3 -m tools.diagnose.latent_phases [--tokens 1,8] [--shape 16,3584,7168] [--rule early_weights=true,...]

The split build the tier table picks at each T (or the tier rule with --rule's params laid over it) is rendered with
a stamp by thread 0 of each CTA at each boundary (`instrument`): the norm kernel's entry, the return of its grid
wait, its routing (indices and weights) in shared memory, its rows gathered (sums of squares in shared memory), the
cluster's rstd known, its end; the projection's entry, the end of its first weights' loads and L2 prefetches (weights_first), the
return of its grid wait (n complete), n in shared memory, its end. The graph replays producer (a 4 MB write that
does not trigger early) then the split build; the stamps of the last replay are printed in µs after the first
CTA's entry: per kernel and boundary the least, median and largest over its CTAs. The weight
stream can only hide the norm if the projection's CTAs start (and issue their first loads) long before their wait
returns; the rest of the projection (wait to end) against the floor's L*H*2 bytes shows the stream's own rate.
A stamp costs a few instructions; timings are of the instrumented build. Needs a GPU; `instrument` runs anywhere.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics

from ..bench.lib import require_gpu

MAX_CTAS = 4096
NORM_STAMPS = ("entry", "wait", "routing", "gathered", "rstd", "end")
PROJ_STAMPS = ("entry", "first weights", "wait", "n copied", "end")
# (kernel index, stamp index, anchor, insert after the anchor?)
ANCHORS = [
    (0, 1, "    kg_grid_wait();   // gemm2_out and the routing may come from the kernels just before us; p.n from the "
           "last call\n", True),
    (0, 2, "        w_s[i] = kg_to_float(p.w[t * K + i]);\n    }\n    __syncthreads();\n", True),
    (0, 3, "    if (wid == 0) {   // the fused kernel's order", False),
    (0, 4, ("    if (CLUSTER > 1) kg_cluster_arrive();   // done reading the cluster's shared memory (waited for before "
            "exiting)\n    __syncthreads();\n",
            "        rstd_s = rstd_of(s, p.eps);\n    }\n    __syncthreads();\n"), True),   # (norm_async)
    (1, 1, "    kg_grid_wait();   // n from latent_tail_norm;", False),
    (1, 2, ("    kg_launch_dependents();\n    {   // n into shared memory", "    project(p, p.n"), False),
    (1, 3, ("    __syncthreads();\n    project(p, ns", "    project(p, p.n"), False),
]   # (n_global builds copy nothing: "n copied" and "n in shared memory" stamp where their steps begin)


def _insert(src: str, anchor, text: str, after: bool, start: int = 0) -> str:
    """text inserted before (or after) the first of the anchors (a string, or alternatives) found in src."""
    for a in (anchor,) if isinstance(anchor, str) else anchor:
        i = src.find(a, start)
        if i >= 0:
            anchor = a
            break
    if i < 0:
        raise ValueError(f"latent_phases: the split kernels have no {anchor!r}; update ANCHORS")
    i += len(anchor) if after else 0
    return src[:i] + text + src[i:]


def instrument(source: str) -> str:
    """The split latent-tail source with `kg_ts[kernel][blockIdx.x][i] = %globaltimer` by thread 0 of each CTA at
    each boundary (kernel 0: latent_tail_norm, 1: latent_tail_proj)."""
    decl = (f"__device__ unsigned long long kg_ts[2][{MAX_CTAS}][{max(len(NORM_STAMPS), len(PROJ_STAMPS))}];\n"
            "__device__ __forceinline__ void kg_stamp(int k, int i) {\n"
            "    if (threadIdx.x == 0 && blockIdx.x < " + str(MAX_CTAS) + ") {\n"
            "        unsigned long long t;\n"
            "        asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(t) :: \"memory\");\n"
            "        kg_ts[k][blockIdx.x][i] = t;\n"
            "    }\n"
            "}\n")
    src = _insert(source, "struct Params {", decl, False)
    for name, k in (("latent_tail_norm(const __grid_constant__ Params p) {\n", 0),
                    ("latent_tail_proj(const __grid_constant__ Params p) {\n", 1)):
        src = _insert(src, name, f"    kg_stamp({k}, 0);\n", True)
    for k, i, anchor, after in ANCHORS:
        start = src.index(("latent_tail_norm", "latent_tail_proj")[k] + "(const __grid_constant__ Params p) {")
        src = _insert(src, anchor, f"    kg_stamp({k}, {i});\n", after, start)
    # the ends: the last closing brace of each kernel's body
    for k, name in ((0, "latent_tail_norm(const __grid_constant__ Params p) {"),
                    (1, "latent_tail_proj(const __grid_constant__ Params p) {")):
        a = src.index(name)
        b = src.find("\n}\n", a)
        src = src[:b] + f"\n    kg_stamp({k}, {len(NORM_STAMPS) - 1 if k == 0 else len(PROJ_STAMPS) - 1});" + src[b:]
    return src


def run(T: int, shape: tuple[int, int, int], rule: dict | None) -> str:
    import torch
    from cuda.bindings import driver as drv

    from kerngen import jit, tiers
    from kerngen.ops import latent_tail as lt
    from kerngen.plan import target_arch
    from kerngen.timing import elementwise_producer, graph_time_us
    from ..bench.latent_tail import inputs

    K, L, H = shape
    spec = lt.spec(L, H, K, "float32", T, target_arch())
    if rule:
        spec = lt.rule_spec(tiers.Rule("latent_tail", spec.variant, {}, {**dict(spec.params), **rule}),
                            L, H, K, "float32", target_arch())
    if spec.variant != "fused" or not lt.split(spec):
        return f"T={T}: the rule builds {spec.variant} {dict(spec.params)}, not the split kernels"
    render, resolve, modules = jit.render, lt.resolve, []

    def instrumented(s):
        return instrument(render(s)) if s.op == "latent_tail" else render(s)

    def keep(s):
        m = resolve(s)
        modules.append(m)
        return m

    jit.render, lt.resolve = instrumented, keep
    try:
        g, e2p, w, nw, ups, sh, res = inputs(T, K, L, H, 1)
        produce = elementwise_producer()
        out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
        k = lt.kernel(spec, T, torch.cuda.current_device())
        us = graph_time_us(lambda: (produce(), lt.run(k, g, e2p, w, nw, ups[0], sh, res, 1e-6, out)), calls=20)
        torch.cuda.synchronize()
    finally:
        jit.render, lt.resolve = render, resolve
    if not modules:
        return f"T={T}: no latent_tail module was loaded"
    _, ptr, size = drv.cuLibraryGetGlobal(modules[-1]._library, b"kg_ts")
    raw = (ctypes.c_ulonglong * (size // 8))()
    drv.cuMemcpyDtoH(ctypes.addressof(raw), ptr, size)
    per = size // 8 // 2 // MAX_CTAS
    rows, t0, stamps = [], None, {}
    for k, names in ((0, NORM_STAMPS), (1, PROJ_STAMPS)):
        ctas = [[raw[(k * MAX_CTAS + c) * per + i] for i in range(len(names))] for c in range(MAX_CTAS)]
        ctas = [c for c in ctas if c[0]]
        stamps[k] = ctas
        first = min(c[0] for c in ctas)
        t0 = first if t0 is None else min(t0, first)
    for k, names, what in ((0, NORM_STAMPS, "latent_tail_norm"), (1, PROJ_STAMPS, "latent_tail_proj")):
        ctas = stamps[k]
        cells = []
        for i, name in enumerate(names):
            v = sorted((c[i] - t0) / 1000 for c in ctas if c[i])
            cells.append(f"{name} {v[0]:.2f} / {statistics.median(v):.2f} / {v[-1]:.2f}")
        rows.append(f"  {what} ({len(ctas)} CTAs): " + "; ".join(cells))
    return (f"T={T} {dict(spec.params)}: {us:.2f} µs a step with the producer; µs from the first CTA's entry, "
            "least / median / largest over the CTAs:\n" + "\n".join(rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--shape", default="16,3584,7168", help="K,L,H (kimi-k3's)")
    ap.add_argument("--rule", default=None, help="params laid over the tier rule's, e.g. early_weights=true,unroll=4")
    a = ap.parse_args(argv)
    require_gpu("python3 -m tools.diagnose.latent_phases")
    rule = None
    if a.rule:
        rule = {k: (v == "true" if v in ("true", "false") else int(v))
                for k, v in (kv.split("=") for kv in a.rule.split(","))}
    shape = tuple(int(v) for v in a.shape.split(","))
    for T in (int(t) for t in a.tokens.split(",")):
        print(run(T, shape, rule), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
