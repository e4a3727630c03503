#!/usr/bin/env python3
"""Registers, shared memory and spills of every kernel a model needs, read from the compiled cubins: no GPU.

    tools/kernel_resources.py --model kimi-k3 [--arch sm_90a] [--ops routing,finalize,tail]
    tools/kernel_resources.py --tail H,K --threads 128,256,512 --max-loads 16,32 [--branch-free 0,1] [--split-k 1,2]

Kernels are built into the cache first when missing (as `kerngen warmup` would). CUDA C++ artifacts hold a
cubin; a CuTe DSL artifact holds one inside its object file. Both go through `cuobjdump -res-usage` (the CUDA
toolkit's, or the `nvidia-cuda-cuobjdump` wheel's). STACK > 0 means register spills (a stack frame in local
memory; no kernel here has another use for one). With R registers a CTA of N threads fits about
65536 // (N * R) times on an sm_90 SM. The second form times nothing: it lists what tail configurations of
`kerngen tune` cost in registers and spills before any of them runs on a GPU.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchlib import add_tail_config_args, tail_configs  # noqa: E402
from kerngen import jit, tiers  # noqa: E402
from kerngen.plan import KernelSpec  # noqa: E402
from kerngen.warmup import OPS, model_specs  # noqa: E402

EM_CUDA = 190


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia.cu13
        wheel = os.path.join(list(nvidia.cu13.__path__)[0], "bin", "cuobjdump")
        if os.path.exists(wheel):
            return wheel
    except ImportError:
        pass
    sys.exit("kernel_resources: cuobjdump not found: install the CUDA toolkit or `pip install nvidia-cuda-cuobjdump`")


def cubins(files: dict[str, bytes]) -> list[bytes]:
    """The cubin of a CUDA C++ artifact, or the CUDA ELF images embedded in a CuTe DSL object file."""
    if "kernel.cubin" in files:
        return [files["kernel.cubin"]]
    found = []
    for data in files.values():
        i = data.find(b"\x7fELF", 1)
        while i >= 0:
            if data[i + 4] == 2 and struct.unpack_from("<H", data, i + 18)[0] == EM_CUDA:   # 64-bit, EM_CUDA
                phoff, shoff = struct.unpack_from("<QQ", data, i + 0x20)
                phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, i + 0x36)
                found.append(data[i:i + max(phoff + phentsize * phnum, shoff + shentsize * shnum)])
            i = data.find(b"\x7fELF", i + 4)
    return found


def resources(files: dict[str, bytes], tool: str) -> list[tuple[str, dict[str, int]]]:
    """(function, {REG, STACK, SHARED, LOCAL, ...}) for every function of the artifact."""
    rows = []
    for image in cubins(files):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(image)
            f.flush()
            out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        for name, usage in re.findall(r"Function (\S+):\s*\n\s*(.+)", out):
            rows.append((name, {k: int(v) for k, v in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", usage)}))
    return rows


def short(function: str) -> str:
    """CuTe DSL function names carry the whole specialization; the kernel's own name is enough here."""
    return function if len(function) < 48 else function[:45] + "..."


def report(spec: KernelSpec, tool: str) -> None:
    built = jit.build(spec)
    for function, r in resources(built.files, tool):
        params = ", ".join(f"{k}={v}" for k, v in spec.params)
        print(f"{spec.op:9s} {spec.variant:12s} {short(function):48s} REG {r.get('REG', 0):3d}  "
              f"SHARED {r.get('SHARED', 0):6d}  STACK {r.get('STACK', 0):4d}  {params}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--tail", help="H,K: list tail configurations instead of a model's kernels")
    add_tail_config_args(ap, max_loads="16,32", branch_free="0")
    ap.add_argument("--arch", default="sm_90a")
    a = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", a.arch)
    tool = cuobjdump()
    if a.tail:
        hidden, top_k = (int(x) for x in a.tail.split(","))
        specs = [spec for _, spec in tail_configs(hidden, top_k, a.arch, a)]
    elif a.model:
        tbl = tiers.load()
        specs = model_specs(tbl.model(a.model), tbl, a.arch, tuple(a.ops.split(",")))
    else:
        ap.error("--model or --tail")
    for spec in specs:
        report(spec, tool)


if __name__ == "__main__":
    main()
