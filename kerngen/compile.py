"""Source → artifact. CUDA C++ goes through NVRTC to a SASS cubin for one exact arch.

SASS, not PTX: a cubin built by a newer NVRTC loads on an older driver, newer PTX does not JIT there.
Compiling needs no GPU, so a cache can be built on a CPU machine and shipped.
"""
from __future__ import annotations

import re
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from . import env
from .errors import CompileError

OPTIONS = ("-std=c++17", "-default-device", "-lineinfo", "-DKERNGEN_NVRTC=1")
# the wheels whose headers NVRTC reads (CUDA 13 names, then CUDA 12's)
HEADER_WHEELS = ("nvidia-cuda-runtime", "nvidia-cuda-cccl", "nvidia-cuda-runtime-cu12", "nvidia-cuda-cccl-cu12")


@lru_cache(maxsize=1)
def nvrtc_version() -> str:
    from cuda.bindings import nvrtc
    _, major, minor = nvrtc.nvrtcVersion()
    return f"{major}.{minor}"


@lru_cache(maxsize=1)
def include_dirs() -> tuple[str, ...]:
    """CUDA headers: the nvidia-cuda-runtime / nvidia-cuda-cccl wheels, else a local toolkit."""
    dirs: list[str] = []
    try:
        import nvidia
        for base in nvidia.__path__:
            for sub in ("cu13/include", "cuda_runtime/include", "cu12/include"):
                d = Path(base) / sub
                if (d / "cuda_bf16.h").is_file():
                    dirs.append(str(d))
    except ImportError:
        pass
    for home in env.cuda_homes():
        if (Path(home) / "include" / "cuda_bf16.h").is_file():
            dirs.append(str(Path(home) / "include"))
    return tuple(dirs[:1])  # one header set: mixing toolkit versions breaks builds


@lru_cache(maxsize=1)
def headers() -> str:
    """What identifies the CUDA headers a build reads: the versions of the wheels that ship them, or the
    toolkit's CUDA_VERSION (never a path: a cache built elsewhere must keep its keys)."""
    dirs = include_dirs()
    if not dirs:
        return "none"
    if "nvidia" in Path(dirs[0]).parts:
        found = []
        for dist in HEADER_WHEELS:
            try:
                found.append(f"{dist}=={metadata.version(dist)}")
            except metadata.PackageNotFoundError:
                pass
        return f"{Path(dirs[0]).parent.name}: " + ", ".join(found)
    try:
        m = re.search(r"#define\s+CUDA_VERSION\s+(\d+)", (Path(dirs[0]) / "cuda.h").read_text(errors="replace"))
    except OSError:
        m = None
    return f"toolkit CUDA_VERSION {m.group(1) if m else 'unknown'}"


def toolchain() -> dict[str, str]:
    """Everything besides the source that an NVRTC build depends on: NVRTC, the headers and the options."""
    return {"nvrtc": nvrtc_version(), "headers": headers(), "options": " ".join(OPTIONS)}


def _check(result, what: str):
    from cuda.bindings import nvrtc
    err = result[0]
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")
    return result[1:] if len(result) > 2 else (result[1] if len(result) == 2 else None)


def nvrtc_compile(source: str, name: str, arch: str, key: str, source_path: str | None) -> tuple[bytes, str]:
    """Compile to a cubin for `arch` (e.g. "sm_90a"). Returns (cubin, log); raises CompileError with the log."""
    from cuda.bindings import nvrtc
    prog = _check(nvrtc.nvrtcCreateProgram(source.encode(), f"{name}.cu".encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", *OPTIONS, *[f"-I{d}" for d in include_dirs()]]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        # NVRTC writes into the buffers it is given: a fresh bytearray each (an empty log is 1 byte, and b" " * 1
        # is the interpreter's shared one-byte b" ", which it would overwrite for the whole process)
        size = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = bytearray(size)
        nvrtc.nvrtcGetProgramLog(prog, buf)
        log = bytes(buf).rstrip(b"\x00 ").decode(errors="replace")
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise CompileError(key, log or nvrtc.nvrtcGetErrorString(err)[1].decode(), source_path)
        size = _check(nvrtc.nvrtcGetCUBINSize(prog), "nvrtcGetCUBINSize")
        cubin = bytearray(size)
        _check((nvrtc.nvrtcGetCUBIN(prog, cubin)[0], None), "nvrtcGetCUBIN")
        return bytes(cubin), log
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_spec(spec, source: str, key: str, source_path: str | None) -> dict[str, bytes]:
    """The NVRTC build of a rendered spec: {"kernel.cubin": cubin} (the backend table's compile entry)."""
    cubin, _ = nvrtc_compile(source, f"{spec.op}_{spec.variant}", spec.arch, key, source_path)
    return {"kernel.cubin": cubin}
