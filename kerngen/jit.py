"""build_and_load: memory → disk → (lock → disk again → compile → store). One process compiles a key.

Strict mode (KERNGEN_STRICT=1 or kerngen.strict()) turns a disk miss into CacheMissError.
"""
from __future__ import annotations

import json
import logging
import shlex
import time
from dataclasses import dataclass
from importlib import import_module

from . import cache as cache_mod
from . import env
from .errors import CacheMissError
from .plan import KernelSpec
from .render import render
from .tiers import BACKENDS

log = logging.getLogger("kerngen")
_strict_override: bool | None = None
last_status: dict[KernelSpec, str] = {}  # how each spec was last obtained in this process


def set_strict(on: bool | None) -> None:
    """Force strict mode on/off for this process (None: follow KERNGEN_STRICT)."""
    global _strict_override
    _strict_override = on


def is_strict() -> bool:
    return env.strict() if _strict_override is None else _strict_override


@dataclass
class Built:
    spec: KernelSpec
    key: str
    files: dict[str, bytes]       # artifact name -> bytes
    status: str                   # "cached" | "compiled"
    seconds: float = 0.0
    stored: bool = True           # on disk (False: compiled in memory only, see the store's write_error)


def _compiler(backend: str):
    """The backend's compile module (kerngen.compile or kerngen.cute_backend), imported on first use."""
    return import_module(f".{BACKENDS[backend].compiler}", __package__)


def toolchain(backend: str) -> dict[str, str]:
    return _compiler(backend).toolchain()


def _prepared(spec: KernelSpec) -> tuple[str, str]:
    source = render(spec)
    return source, spec.key(source, toolchain(spec.backend))


def spec_command(spec: KernelSpec) -> str:
    """The exact command that builds `spec` alone."""
    return f"kerngen warmup --spec {shlex.quote(spec.to_json())}"


_miss_command = spec_command


def set_miss_command(fn) -> None:
    """How a strict-mode miss words its fix: fn(spec) -> command. The package sets warmup's model-aware one
    (kerngen/__init__.py), so this module never imports the layers above it."""
    global _miss_command
    _miss_command = fn


def _compile(spec: KernelSpec, source: str, key: str, store: cache_mod.DiskCache) -> dict[str, bytes]:
    src_path = store.source_path(key, BACKENDS[spec.backend].source, source)
    return _compiler(spec.backend).compile_spec(spec, source, key, src_path)


def _miss_reason(store: cache_mod.DiskCache, spec: KernelSpec, key: str) -> str:
    """Why `key` missed; 'stale' when an entry of this very spec exists under another hash (an older template,
    toolchain or kerngen built it), which entries of the same shape with other params are not."""
    reason = store.miss_reason.pop(key, "absent")
    this = json.loads(spec.to_json())
    if reason == "absent" and any(all(m.get(k) == v for k, v in this.items()) for m in store.siblings(key)):
        return "stale"
    return reason


def build(spec: KernelSpec, store: cache_mod.DiskCache | None = None, strict: bool | None = None,
          command: str | None = None) -> Built:
    """Return the artifact of `spec`, from disk or freshly compiled (and stored)."""
    store = store or cache_mod.default()
    source, key = _prepared(spec)
    need = (BACKENDS[spec.backend].artifact,)
    files = store.get(key, need)
    if files is not None:
        last_status[spec] = "cached"
        return Built(spec, key, files, "cached")
    reason = _miss_reason(store, spec, key)
    if is_strict() if strict is None else strict:
        log.warning("kerngen: strict mode, kernel %s is not cached (%s)", key, reason)
        raise CacheMissError(key, command or _miss_command(spec))
    t0 = time.perf_counter()
    with store.lock(key):
        waited = time.perf_counter() - t0
        files = store.get(key, need)  # another process may have built it while we waited
        if files is not None:
            log.info("kerngen: %s built by another process (waited %.2fs)", key, waited)
            return Built(spec, key, files, "cached", waited)
        t1 = time.perf_counter()
        files = _compile(spec, source, key, store)
        secs = time.perf_counter() - t1
        stored = store.put(key, files, {"op": spec.op, "variant": spec.variant, "tag": spec.tag, "arch": spec.arch,
                                        "backend": spec.backend, "params": dict(spec.params),
                                        "constants": dict(spec.constants), "compile_seconds": round(secs, 3),
                                        "toolchain": toolchain(spec.backend)})
        log.info("kerngen: compiled %s (%s) in %.2fs, lock wait %.2fs%s", key, reason, secs, waited,
                 "" if stored else f", in memory only ({store.write_error or 'not stored'})")
        last_status[spec] = "compiled"
        return Built(spec, key, files, "compiled", secs, stored)


def key_of(spec: KernelSpec) -> str:
    return _prepared(spec)[1]
