"""Precompile every kernel a model needs (no GPU required), in parallel processes."""
from __future__ import annotations

import multiprocessing as mp
import os
import shlex
import signal
import threading
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from . import cache as cache_mod
from . import jit, occupancy
from .errors import KerngenError
from .plan import KernelSpec
from .tiers import Model, Table

from . import ops as registry   # the op registry (registry.OPS, read at each call): each op's module seam
from .ops import op_module


def model_specs(model: Model, tbl: Table, arch: str, ops=None) -> list[KernelSpec]:
    """The distinct kernels `model` can dispatch to, in order, of `ops` (default: every op of the registry)
    (rules that differ only in token range, and op modules that list a kernel twice, give one spec)."""
    specs: dict[KernelSpec, None] = {}
    for op in registry.OPS if ops is None else ops:
        specs.update(dict.fromkeys(op_module(op).model_specs(model, tbl, arch)))
    return list(specs)


def warmup_command(spec: KernelSpec, prefer: str | None = None) -> str:
    """The exact command that builds `spec`: a model's warmup when a shipped/user model needs it (`prefer` first,
    then by name; with the user tiers file the model or its rules come from), else the spec's own."""
    from . import tiers
    try:
        tbl = tiers.load()
        user = "".join(f" --tiers {shlex.quote(f)}" for f in tbl.files[1:])
        for name, model in sorted(tbl.models.items(), key=lambda kv: (kv[0] != prefer, kv[0])):
            if spec in model_specs(model, tbl, spec.arch):
                return f"kerngen warmup --model {shlex.quote(name)} --arch {spec.arch}{user}"
    except Exception:  # a broken tiers file must not hide the miss itself
        pass
    return jit.spec_command(spec)


def usage(spec: KernelSpec, files: dict[str, bytes]) -> list[occupancy.Usage]:
    """Each kernel function of a built spec: registers, shared memory, spills, and for the ops with persistent grids
    (their module's `persistent`) the CTAs an SM holds beside the blocks_per_sm its rule asks for. Needs cuobjdump
    (a KerngenError that says where to get it)."""
    launches = getattr(op_module(spec.op), "persistent", None)
    return occupancy.of_artifact(files, spec.arch, launches(spec) if launches else {})


@dataclass
class Result:
    spec: KernelSpec
    key: str
    status: str      # compiled | cached | failed
    seconds: float
    error: str = ""
    stored: bool = False   # the kernel is in the cache after this run
    note: str = ""         # why a compiled kernel was not stored
    usage: tuple[str, ...] = ()   # one line per kernel function (occupancy.Usage.line)
    usage_error: str = ""         # why there are none (no cuobjdump)


def _build_one(spec: KernelSpec, root: str) -> tuple:
    """Result's fields after the spec, the kernel built (or found) in the cache at `root`."""
    store = cache_mod.DiskCache(root, quiet=True)   # the report says what was not stored, once
    try:
        b = jit.build(spec, store=store, strict=False)
    except Exception as e:  # reported per kernel; the run goes on with the others
        return "", "failed", 0.0, f"{type(e).__name__}: {e}", False, ""
    try:
        lines, why = tuple(u.line() for u in usage(spec, b.files)), ""
    except KerngenError as e:
        lines, why = (), str(e)
    return b.key, b.status, b.seconds, "", b.stored, "" if b.stored else store.write_error or "not stored", lines, why


PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Pool initializer: a worker whose parent dies (even by SIGKILL) dies too, instead of waiting forever on
    the task pipe. Linux: the kernel signals it (prctl); elsewhere a thread watches the parent's pid."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl")
    except (OSError, AttributeError):
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:   # it died before the signal was armed
        os._exit(1)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def run(specs: list[KernelSpec], root: str, jobs: int, progress: bool = True) -> list[Result]:
    results: list[Result] = []
    bar = None
    if progress:
        from tqdm import tqdm
        # disable=None: only on a terminal (a redirected log gets no bar)
        bar = tqdm(total=len(specs), unit="kernel", desc="kerngen warmup", leave=False, disable=None)
    if jobs <= 1 or len(specs) <= 1:
        for s in specs:
            results.append(Result(s, *_build_one(s, root)))
            bar and bar.update()
    else:
        ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() and not _cuda_initialized() else "spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_die_with_parent,
                                 initargs=(os.getpid(),)) as pool:
            futures = {pool.submit(_build_one, s, root): s for s in specs}
            for f in as_completed(futures):
                results.append(Result(futures[f], *f.result()))
                bar and bar.update()
        results = [_in_process(r, root) if r.status == "failed" else r for r in results]
    if bar:
        bar.close()
    order = {s: i for i, s in enumerate(specs)}
    return sorted(results, key=lambda r: order[r.spec])


def _in_process(failed: Result, root: str) -> Result:
    """A kernel a pool worker failed to build, built again in this process: a worker is a fresh interpreter (spawned
    after CUDA init) whose imports can fail where this process's succeeded (seen: torch 2.11 failing to register its
    own custom ops while a spawned worker imports it for the CuTe DSL). A build that fails here too keeps its error."""
    import logging
    r = Result(failed.spec, *_build_one(failed.spec, root))
    if r.status == "failed":
        return r
    first = failed.error.splitlines()[0] if failed.error else "no error text"
    logging.getLogger("kerngen").warning("kerngen warmup: %s built in this process after its worker failed (%s)",
                                         failed.spec.tag, first)
    r.note = f"built in this process after its worker failed: {first}"
    return r


def _cuda_initialized() -> bool:
    import sys
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def timed(fn, *a, **kw):
    t = time.perf_counter()
    out = fn(*a, **kw)
    return out, time.perf_counter() - t


def preload(model: str, *, tiers_file=None, device: int | None = None) -> dict:
    """Load (from the cache, or compile unless strict) every kernel `model` needs on this GPU, now.

    Returns {"kernels", "compiled", "seconds"}; in strict mode a missing kernel raises CacheMissError.
    """
    import logging

    import torch

    from . import tiers
    from .launch import resolve
    from .plan import target_arch
    tbl = tiers.load(tiers_file)
    dev = torch.cuda.current_device() if device is None else device
    t0 = time.perf_counter()
    specs = model_specs(tbl.model(model), tbl, target_arch(dev))
    compiled = 0
    for spec in specs:
        with torch.cuda.device(dev):
            resolve(spec)   # built or fetched, and loaded by its backend's loader
        compiled += jit.last_status.get(spec) == "compiled"
    secs = time.perf_counter() - t0
    logging.getLogger("kerngen").info("kerngen: preloaded %d kernels of %s in %.2fs (%d compiled)",
                                      len(specs), model, secs, compiled)
    return {"kernels": len(specs), "compiled": compiled, "seconds": secs}
