#!/usr/bin/env python3
"""Where the fused routing kernel spends its time: clock64 stamps of CTA 0 / thread 0 between its phases.

    python3 -m tools.diagnose.routing_phases [--cases kimi-k3:1,kimi-k3:8,deepseek-v3:8] [--tile 128]

Each case renders the routing kernel its tier picks (fp32 logits and bias, as `python3 -m tools.bench` runs them), inserts
a stamp after every phase (`instrument`), and times it under a CUDA graph like `python3 -m tools.bench`; after the last
replay it prints the graph time per call and the SM cycles from the end of the grid-dependency wait to each
phase boundary, so consecutive differences are the phase costs. Thread 0 routes token 0 (group 0, warp 0,
lane 0), so the top-k phases are that token's. A stamp costs a few cycles; timings are of the instrumented
build, close to but not equal to the shipped kernel's. Needs a GPU; `instrument` runs anywhere.
"""
from __future__ import annotations

import argparse
import ctypes

from ..bench.lib import require_gpu


# (name, anchor in the rendered source, insert the stamp after the anchor?)  Order = kernel order.
PHASES = [
    ("wait", "    if (tile > 0 && cl == 0 && threadIdx.x == NT - 32) old_rows", False),
    ("loads", "    float sv[J];\n", False),
    ("keys", "    unsigned long long c[J], mx = 0;", False),
    ("estimate", "            tau = s.tau;\n        }\n", True),
    ("slots", "        slot = ballot_slots(c, tau, bal, n, s.wcnt);\n    }\n", True),
    ("gather", "    int sl = 0;", False),
    ("rank", "    if (w != 0) return;", False),
    ("picks", "    if (lane < K * PARTS) picked(", False),
    ("weights", "        p.weights[t * K + lane] = wt;\n    }\n", True),
    ("route_loop", "    if (tile <= 0) return;\n    const PermuteOut", False),
    ("one_token_layout", "        if (cl == 0) kg_clear_beyond(o, tiles, old_rows, threadIdx.x, NT);\n        return;", False),
    ("masks", "    // 2. at most tile tokens per expert (tile >= T)", False),
    ("rows", "        // the layout in items (bitmap word wd, part q)", False),
]
# a stamp placed after the wait must not let the compiler start a phase's arithmetic before its loads arrive
DEPENDS = {"loads": 'asm volatile("" :: "f"(kg_to_float(raw[J - 1])));\n',
           "keys": 'asm volatile("" :: "r"(key[J - 1]));\n'}
SLOTS = len(PHASES) + 2   # + entry and end


def instrument(source: str) -> str:
    """The fused routing source with `kg_st[i] = clock64()` by CTA 0 / thread 0 at every phase boundary."""
    decl = (f"__device__ long long kg_st[{SLOTS}];\n"
            "#define KG_STAMP(i) do { if (blockIdx.x == 0 && threadIdx.x == 0) kg_st[i] = clock64(); } while (0)\n")

    def insert(src, anchor, text, after):
        if anchor not in src:
            raise ValueError(f"routing_phases: the fused kernel has no {anchor!r}; update PHASES")
        i = src.index(anchor) + (len(anchor) if after else 0)
        return src[:i] + text + src[i:]

    src = insert(source, "struct Params {", decl, False)
    src = insert(src, "    kg_launch_dependents();\n    if (tile > 0)", "    KG_STAMP(0);\n", False)
    for i, (name, anchor, after) in enumerate(PHASES, start=1):
        src = insert(src, anchor, "    " + DEPENDS.get(name, "") + f"    KG_STAMP({i});\n", after)
    end = src.rindex("}")
    return src[:end] + f"    KG_STAMP({SLOTS - 1});\n" + src[end:]


def run(name: str, T: int, tile: int) -> str:
    import torch
    from cuda.bindings import driver as drv

    from kerngen import tiers
    from kerngen.compile import nvrtc_compile
    from kerngen.launch import Launcher, Module, current_stream
    from kerngen.ops import routing as rt
    from kerngen.plan import target_arch
    from kerngen.render import render
    from kerngen.timing import graph_time_us

    tbl = tiers.load()
    m = tbl.model(name)
    has_bias = m.routing in ("sigmoid_bias", "grouped_sigmoid_bias")
    spec = rt.spec(m.num_experts, m.top_k, m.routing, T, target_arch(), n_group=m.n_group,
                   topk_group=m.topk_group, renormalize=m.renormalize, bdtype="float32" if has_bias else "none",
                   tbl=tbl)
    if spec.variant != "fused":
        return f"{name} T={T}: the tier picks {spec.variant}, not the fused kernel"
    p = dict(spec.params)
    cubin, _ = nvrtc_compile(instrument(render(spec)), "routing_phases", spec.arch, "routing_phases", None)
    mod = Module(cubin, "routing_phases")
    dev = torch.cuda.current_device()
    launch = Launcher(mod, "routing_fused", dev, (p["ctas"] * p["clusters"], 1, 1), (p["warps"] * 32, 1, 1),
                      rt.PARAMS, pdl=True)
    E, K = m.num_experts, m.top_k
    logits = torch.randn(T, E, device="cuda")
    bias = torch.randn(E, device="cuda") * 0.05 if has_bias else None
    ws = rt.RoutingWorkspace(T, E, K, tile)
    call = lambda: launch.launch(current_stream(dev), logits=logits.data_ptr(),   # noqa: E731
                                 bias=0 if bias is None else bias.data_ptr(), ids=ws.ids.data_ptr(),
                                 weights=ws.weights.data_ptr(), counts=ws.counts.data_ptr(),
                                 offsets=ws.offsets.data_ptr(), e2p=ws.e2p.data_ptr(), p2t=ws.p2t.data_ptr(),
                                 t2e=ws.t2e.data_ptr(), num_rows=ws.num_rows.data_ptr(),
                                 rsf=float(m.routed_scaling_factor), tokens=T, ld=logits.stride(0), tile=tile,
                                 local_start=0, num_local=E, max_rows=ws.max_rows)
    us = graph_time_us(call)
    torch.cuda.synchronize()
    err, ptr, _ = drv.cuLibraryGetGlobal(mod._library, b"kg_st")
    stamps = (ctypes.c_longlong * SLOTS)()
    drv.cuMemcpyDtoH(ctypes.addressof(stamps), ptr, SLOTS * 8)
    names = ["entry"] + [n for n, _, _ in PHASES] + ["end"]
    base, prev, parts = stamps[1], stamps[1], []
    for i in range(2, SLOTS):
        if stamps[i] >= prev and stamps[i] - base < 10 ** 7:   # phases a path skips keep an older stamp
            parts.append(f"{names[i]} +{stamps[i] - prev}")
            prev = stamps[i]
    return f"{name} T={T} {p}: {us:.2f} µs per call; cycles after the wait: " + ", ".join(parts) + \
        f" (total {prev - base})"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="kimi-k3:1,kimi-k3:8,deepseek-v3:1,deepseek-v3:8,kimi-k2:1")
    ap.add_argument("--tile", type=int, default=128)
    a = ap.parse_args()
    require_gpu("python3 -m tools.diagnose.routing_phases")
    for case in a.cases.split(","):
        name, T = case.split(":")
        print(run(name, int(T), a.tile), flush=True)


if __name__ == "__main__":
    main()
