"""CuTe DSL templates → relocatable object (`kernel.o`) → TVM-FFI function.

A CuTe template is a Python module under templates/<op>/ exposing `compile_kernel(**spec.values())`, which
returns the `cute.compile` result (TVM-FFI, stream = torch's current stream). Compiling needs no GPU:
CUTE_DSL_ARCH is set from the spec's arch before cutlass is first imported (and the DSL's arch is set again
per compile, so one process can build several arches). The object embeds the SASS cubin and host launcher;
loading JIT-links it in-process (cute.runtime.load_module), so no C compiler is needed anywhere.

cutlass is imported only here, and only when a CuTe kernel is compiled, loaded or keyed.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
import tempfile
import threading
import traceback
from functools import lru_cache
from importlib import metadata

from . import env
from .errors import CompileError, DeviceError
from .plan import KernelSpec

ARTIFACT = "kernel.o"
_loaded: dict[str, object] = {}
_mutex = threading.Lock()


def _import_cutlass(arch: str | None = None):
    if "cutlass" not in sys.modules:
        os.environ.setdefault("CUTE_DSL_ARCH", arch or env.default_arch())
        # torch first: imported from inside the DSL's import (through tvm-ffi), as in a fresh warmup worker, torch
        # fails to register its own custom ops (seen with torch 2.11 and cutlass-dsl 4.8)
        import torch  # noqa: F401
    import cutlass
    import cutlass.cute  # noqa: F401
    return cutlass


@lru_cache(maxsize=1)
def toolchain() -> dict[str, str]:
    """Versions that change a CuTe artifact: cutlass-dsl, tvm-ffi, torch, and the CUDA flavor the DSL
    compiles with (cu12 / cu13 ELF ABI and runtime library; picked at import by the driver, cu13 without one)."""
    _import_cutlass()
    from cutlass.base_dsl.version_info import CUDA_VERSION

    def ver(dist):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "absent"

    return {"cutlass-dsl": ver("nvidia-cutlass-dsl"), "tvm-ffi": ver("apache-tvm-ffi"), "torch": ver("torch"),
            "cuda": f"{CUDA_VERSION.major}.{CUDA_VERSION.minor}"}


def function_name(key: str) -> str:
    """The exported symbol of a key (C identifier)."""
    return "kerngen_" + re.sub(r"\W", "_", key)


def _set_arch(arch: str) -> None:
    from cutlass.cutlass_dsl import CuTeDSL
    CuTeDSL._get_dsl().envar.arch = arch


def _template_module(source: str, key: str, src_path: str | None):
    name = f"kerngen_template_{function_name(key)}"
    spec = importlib.util.spec_from_loader(name, loader=None, origin=src_path)
    mod = importlib.util.module_from_spec(spec)
    mod.__file__ = src_path if src_path and os.path.isfile(src_path) else f"<{key}>"
    code = compile(source, mod.__file__, "exec")
    exec(code, mod.__dict__)
    return mod


def compile_spec(spec: KernelSpec, source: str, key: str, src_path: str | None) -> dict[str, bytes]:
    """Compile a CuTe template for spec.arch and export it; returns {"kernel.o": bytes}."""
    _import_cutlass(spec.arch)
    _set_arch(spec.arch)
    try:
        mod = _template_module(source, key, src_path)
        fn = mod.compile_kernel(**spec.values())
        with tempfile.TemporaryDirectory(prefix="kerngen-cute-") as tmp:
            path = os.path.join(tmp, ARTIFACT)
            fn.export_to_c(path, function_name=function_name(key))
            with open(path, "rb") as f:
                return {ARTIFACT: f.read()}
    except Exception as e:  # the DSL reports IR/PTX errors as exceptions with its log in the message
        log = f"{type(e).__name__}: {e}\n\n" + "".join(traceback.format_exception(e)[-12:])
        raise CompileError(key, log, src_path) from e


def load(files: dict[str, bytes], key: str):
    """The TVM-FFI function of a built artifact, loaded once per process and key."""
    fn = _loaded.get(key)
    if fn is not None:
        return fn
    with _mutex:
        fn = _loaded.get(key)
        if fn is None:
            fn = _load(files[ARTIFACT], key)
            _loaded[key] = fn
    return fn


def _load(obj: bytes, key: str):
    cute = _import_cutlass().cute
    digest = hashlib.sha256(obj).hexdigest()[:16]
    # load_module reads the object into memory and JIT-links it there; the file only has to outlive the call
    with tempfile.TemporaryDirectory(prefix="kerngen-cute-") as tmp:
        path = os.path.join(tmp, f"{digest}.o")
        with open(path, "wb") as f:
            f.write(obj)
        try:
            module = cute.runtime.load_module(path, enable_tvm_ffi=True)
            fn = getattr(module, function_name(key))
        except Exception as e:
            raise DeviceError(f"loading CuTe kernel {key} failed: {type(e).__name__}: {e}") from e
    _modules.append(module)  # the JIT engine owns the code: keep it alive
    return fn


_modules: list = []
