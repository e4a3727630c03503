#!/usr/bin/env python3
"""Registers, shared memory and spills of every kernel a model needs, read from the compiled cubins: no GPU.

    python3 -m tools.diagnose.kernel_resources --model kimi-k3 [--arch sm_90a] [--ops routing,finalize,tail]
    python3 -m tools.diagnose.kernel_resources --tail H,K --threads 128,256,512 --max-loads 16,32 [--branch-free 0,1]

Kernels are built into the cache first when missing (as `kerngen warmup` would), then read by
`kerngen.resources` (cuobjdump). STACK > 0 means register spills; K-STEP: the instructions of a tensor-core kernel's
innermost loop over K (LOCAL where it touches local memory). With R registers a CTA of N threads fits about
65536 // (N * R) times on an sm_90 SM. The second form times nothing: it lists what tail configurations of
`kerngen tune` cost in registers and spills before any of them runs on a GPU.
"""
from __future__ import annotations

import argparse
import os


from ..bench.lib import add_tail_config_args, tail_configs
from kerngen import jit, ops as registry, resources, tiers
from kerngen.plan import KernelSpec
from kerngen.warmup import model_specs


def short(function: str) -> str:
    """CuTe DSL function names carry the whole specialization; the kernel's own name is enough here."""
    return function if len(function) < 48 else function[:45] + "..."


def report(spec: KernelSpec) -> None:
    built = jit.build(spec)
    sass = resources.sass(built.files) if spec.backend == "nvrtc" else ""
    for function, r in resources.usage(built.files):
        params = ", ".join(f"{k}={v}" for k, v in spec.params)
        loop = resources.mma_loop(sass, function) if sass else None   # (tensor-core kernels: the K-step loop)
        steps = f"  K-STEP {loop[0]:4d}{' LOCAL' if loop[1] else ''}" if loop else ""
        print(f"{spec.op:9s} {spec.variant:12s} {short(function):48s} REG {r.get('REG', 0):3d}  "
              f"SHARED {r.get('SHARED', 0):6d}  STACK {r.get('STACK', 0):4d}{steps}  {params}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--ops", default=",".join(registry.OPS))
    ap.add_argument("--tail", help="H,K: list tail configurations instead of a model's kernels")
    add_tail_config_args(ap, max_loads="16,32", branch_free="0")
    ap.add_argument("--arch", default="sm_90a")
    a = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", a.arch)
    if a.tail:
        hidden, top_k = (int(x) for x in a.tail.split(","))
        specs = [spec for _, spec in tail_configs(hidden, top_k, a.arch, a)]
    elif a.model:
        tbl = tiers.load()
        specs = model_specs(tbl.model(a.model), tbl, a.arch, tuple(a.ops.split(",")))
    else:
        ap.error("--model or --tail")
    for spec in specs:
        report(spec)


if __name__ == "__main__":
    main()
