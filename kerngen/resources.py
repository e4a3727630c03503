"""What a compiled kernel uses — registers, shared memory, spill stack — read from its cubin; no GPU needed.

A CUDA C++ artifact holds its cubin (`kernel.cubin`); a CuTe DSL artifact holds one inside its object file
(`kernel.o`). `cuobjdump -res-usage` reads them, and `cuobjdump -sass` (with nvdisasm) their instructions:
the CUDA toolkit's tools, or the `nvidia-cuda-cuobjdump` / `nvidia-cuda-nvdisasm` wheels' (test dependencies).
A nonzero STACK means register spills: none of these kernels has another use for a stack frame.
"""
from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import tempfile

from .errors import KerngenError

EM_CUDA = 190   # ELF e_machine of a cubin


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    where = _wheel_dir("cuobjdump")
    if where:
        return os.path.join(where, "cuobjdump")
    raise KerngenError("cuobjdump not found: install the CUDA toolkit or `pip install nvidia-cuda-cuobjdump`")


def _wheel_dir(tool: str) -> str | None:
    try:
        import nvidia.cu13
        for root in nvidia.cu13.__path__:
            if os.path.exists(os.path.join(root, "bin", tool)):
                return os.path.join(root, "bin")
    except ImportError:
        pass
    return None


def sass(files: dict[str, bytes]) -> str:
    """The SASS of every kernel of an artifact (`cuobjdump -sass`, which runs nvidia-cuda-nvdisasm's nvdisasm:
    the toolkit's, or the wheel's, a test dependency)."""
    tool, env = cuobjdump(), dict(os.environ)
    if not shutil.which("nvdisasm"):
        where = _wheel_dir("nvdisasm")
        if where is None:
            raise KerngenError("nvdisasm not found: install the CUDA toolkit or `pip install nvidia-cuda-nvdisasm`")
        env["NVDISASM_PATH"] = where
        env["PATH"] = where + os.pathsep + env.get("PATH", "")
    out = []
    for image in cubins(files):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(image)
            f.flush()
            out.append(subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True,
                                      env=env).stdout)
    return "\n".join(out)


def opcodes(files: dict[str, bytes]) -> list[str]:
    """The opcodes of every instruction of an artifact, in order, predicates dropped
    ("/*0a10*/  @P0 STG.E.64 desc[UR6][R2.64], R4 ;" gives "STG.E.64")."""
    ops = []
    for line in sass(files).splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", line)
        if m:
            ops.append(m.group(1))
    return ops


def function_sass(text: str, function: str) -> str:
    """The SASS of kernel `function` in sass()'s `text`."""
    part = next((p for p in text.split("Function : ")[1:] if p.split(None, 1)[0] == function), None)
    if part is None:
        raise KerngenError(f"no function {function} in the SASS")
    return part


def mma_loop(text: str, function: str) -> tuple[int, bool] | None:
    """The innermost loop of `function` in SASS `text` (sass()'s) that holds tensor-core instructions (HMMA, HGMMA,
    QMMA): its instruction count and whether it touches local memory (LDL / STL: spills in the K steps); None where
    no loop holds one."""
    part = function_sass(text, function)
    ins = [(int(m.group(1), 16), m.group(2)) for m in
           (re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", line) for line in part.splitlines()) if m]
    at = {a: i for i, (a, _) in enumerate(ins)}
    loops = []
    for i, (a, text_) in enumerate(ins):
        target = re.search(r"\bBRA\b[^;]*?0x([0-9a-f]+)", text_)
        if target and int(target.group(1), 16) < a and int(target.group(1), 16) in at:
            body = [x for _, x in ins[at[int(target.group(1), 16)]:i + 1]]
            if any(re.search(r"\b[HQ]G?MMA\b", x) for x in body):
                loops.append((len(body), any(re.search(r"\b(LDL|STL)\b", x) for x in body)))
    return min(loops) if loops else None


def cubins(files: dict[str, bytes]) -> list[bytes]:
    """The cubin of a CUDA C++ artifact, or the 64-bit CUDA ELF images embedded in a CuTe DSL object file."""
    if "kernel.cubin" in files:
        return [files["kernel.cubin"]]
    found = []
    for data in files.values():
        i = data.find(b"\x7fELF", 1)
        while i >= 0:
            if data[i + 4] == 2 and struct.unpack_from("<H", data, i + 18)[0] == EM_CUDA:
                phoff, shoff = struct.unpack_from("<QQ", data, i + 0x20)
                phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, i + 0x36)
                found.append(data[i:i + max(phoff + phentsize * phnum, shoff + shentsize * shnum)])
            i = data.find(b"\x7fELF", i + 4)
    return found


def usage(files: dict[str, bytes]) -> list[tuple[str, dict[str, int]]]:
    """(function, {"REG": .., "STACK": .., "SHARED": .., "LOCAL": .., ...}) for every kernel of an artifact."""
    tool, rows = cuobjdump(), []
    for image in cubins(files):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(image)
            f.flush()
            run = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
        if run.returncode:
            raise KerngenError(f"{tool} -res-usage failed: {run.stderr.strip() or run.stdout.strip()}")
        out = run.stdout
        for name, line in re.findall(r"Function (\S+):\s*\n\s*(.+)", out):
            rows.append((name, {k: int(v) for k, v in re.findall(r"(\w+(?:\[\d+\])?):(\d+)", line)}))
    if not rows:
        raise KerngenError(f"no kernel found in the artifact ({', '.join(files)})")
    return rows
