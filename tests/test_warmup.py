"""kerngen.warmup: the kernels a model needs, and the process pool that compiles them."""
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import pytest

from kerngen import tiers, warmup


@pytest.mark.parametrize("name", sorted(tiers.load().models))
def test_every_kernel_a_model_needs_is_listed_once(name):
    tbl = tiers.load()
    specs = warmup.model_specs(tbl.model(name), tbl, "sm_90a")
    assert len(specs) == len(set(specs)) and specs


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"   # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


def test_pool_workers_die_with_a_killed_warmup(tmp_path):
    if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
        pytest.skip("needs /proc/PID/task/TID/children (Linux)")
    code = f"""
import time, kerngen.compile as c
from kerngen import cli
c.nvrtc_compile = lambda *a, **k: time.sleep(600)   # workers busy until killed
cli.main(["warmup", "--op", "finalize", "--topk", "8", "--hidden", "1024", "--arch", "sm_90a,sm_100a",
          "--jobs", "2", "--quiet"])
"""
    p = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "KERNGEN_CACHE_DIR": str(tmp_path)},
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    workers: list[int] = []
    while time.time() < deadline and len(workers) < 2:
        time.sleep(0.2)
        workers = [c for c in _children(p.pid) if _alive(c)]
    try:
        assert len(workers) >= 2, "the pool did not start"
        p.send_signal(signal.SIGKILL)
        p.wait()
        deadline = time.time() + 10
        while time.time() < deadline and any(_alive(w) for w in workers):
            time.sleep(0.1)
        assert not any(_alive(w) for w in workers)
    finally:
        for w in workers:
            if _alive(w):
                os.kill(w, signal.SIGKILL)


def _one_worker(max_workers, **kw):
    """warmup's pool with a single worker: its kernels are built one after another, in the order given."""
    return ProcessPoolExecutor(1, **kw)


def test_a_process_that_uses_the_gpu_builds_in_spawned_workers(tmp_path, monkeypatch):
    """After CUDA is initialised warmup may not fork (the children would inherit the driver's state): its
    workers are spawned, and there both backends build (an NVRTC kernel and a CuTe DSL one). One worker builds
    both, the NVRTC kernel first, so its CuTe build (the worker's first torch import) always comes after an NVRTC
    build in the same interpreter: with two workers that order depended on which worker took which kernel, and the
    GPU serving test failed in some runs only. Each kernel is the worker's, not built again in this process."""
    monkeypatch.setattr(warmup, "_cuda_initialized", lambda: True)
    monkeypatch.setattr(warmup, "ProcessPoolExecutor", _one_worker)
    tbl = tiers.load()
    specs = warmup.model_specs(tbl.model("mixtral-8x7b"), tbl, "sm_90a")
    picked = [next(s for s in specs if s.backend == "nvrtc"), next(s for s in specs if s.backend == "cute")]
    results = warmup.run(picked, str(tmp_path), jobs=2, progress=False)
    assert [(r.status, r.error, r.note) for r in results] == [("compiled", "", "")] * 2


def _spaces() -> tuple[int, int, int]:
    """This interpreter's shared one-byte b" ", as three ways of making a one-byte bytes hand it out (32 each while
    nothing wrote into it)."""
    return " ".encode()[0], bytes([32])[0], bytes(bytearray(b" "))[0]


def _torch_imported() -> bool:
    return "torch" in sys.modules


def test_a_spawned_worker_keeps_its_interpreter_intact_across_builds(tmp_path):
    """A spawned warmup worker builds an NVRTC kernel (empty log), then a CuTe one, in that order; between them its
    shared b" " is still a space. NVRTC once wrote its empty log (one NUL) into b" " * 1, the interpreter's shared
    one-byte b" ", so the worker's later torch import (the CuTe build's) failed in torch's own schema strings, and
    only in runs where one worker happened to build both kinds."""
    tbl = tiers.load()
    specs = warmup.model_specs(tbl.model("mixtral-8x7b"), tbl, "sm_90a")
    nv, cute = next(s for s in specs if s.backend == "nvrtc"), next(s for s in specs if s.backend == "cute")
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=warmup._die_with_parent,
                             initargs=(os.getpid(),)) as pool:
        assert not pool.submit(_torch_imported).result()   # a fresh interpreter: torch comes with the CuTe build
        first = pool.submit(warmup._build_one, nv, str(tmp_path)).result()
        spaces = pool.submit(_spaces).result()
        second = pool.submit(warmup._build_one, cute, str(tmp_path)).result()
        assert pool.submit(_torch_imported).result()
    assert [(b[1], b[3]) for b in (first, second)] == [("compiled", "")] * 2, (first, second)
    assert spaces == (32, 32, 32)


def _fails_in_workers(spec, root, _parent=os.getpid()):
    """_build_one that fails in every process but the test's (a worker whose imports broke)."""
    if os.getpid() != _parent:
        return "", "failed", 0.0, "RuntimeError: expected ident but found ')' here", False, ""
    return _REAL_BUILD(spec, root)


_REAL_BUILD = warmup._build_one


def test_a_kernel_whose_worker_failed_is_built_in_process(tmp_path, monkeypatch, caplog):
    """Forked workers inherit the patched _build_one and fail; warmup builds those kernels itself, says so in each
    result's note and a warning, and a kernel that fails in this process too keeps its failure."""
    monkeypatch.setattr(warmup, "_cuda_initialized", lambda: False)   # fork: the workers see the patch
    monkeypatch.setattr(warmup, "_build_one", _fails_in_workers)
    tbl = tiers.load()
    specs = [s for s in warmup.model_specs(tbl.model("mixtral-8x7b"), tbl, "sm_90a") if s.backend == "nvrtc"][:2]
    with caplog.at_level("WARNING", logger="kerngen"):
        results = warmup.run(specs, str(tmp_path), jobs=2, progress=False)
    assert [r.status for r in results] == ["compiled", "compiled"] and all(r.stored for r in results)
    assert all(r.note.startswith("built in this process after its worker failed: RuntimeError") for r in results)
    assert sum("after its worker failed" in m for m in caplog.messages) == 2
    bad = warmup.Result(specs[0], "", "failed", 0.0, "worker: ImportError")
    monkeypatch.setattr(warmup, "_build_one", lambda spec, root: ("", "failed", 0.0, "CompileError: x", False, ""))
    again = warmup._in_process(bad, str(tmp_path))
    assert again.status == "failed" and again.error == "CompileError: x" and again.note == ""


def test_the_progress_bar_is_drawn_on_a_terminal_only(tmp_path, monkeypatch):
    import io

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    for stream, drawn in ((io.StringIO(), False), (Terminal(), True)):   # a redirected log, a terminal
        monkeypatch.setattr(sys, "stderr", stream)
        warmup.run([], str(tmp_path), 1)
        assert ("kerngen warmup" in stream.getvalue()) == drawn, stream.getvalue()


def test_every_spec_a_shipped_model_needs_reads_back_from_the_json_a_cache_miss_prints():
    """`kerngen warmup --spec JSON` (the command a strict-mode miss prints for a kernel no model lists) takes back
    every spec: experts builds its rule's tile into the TILE constant, which counts as the tile param."""
    from kerngen import jit
    from kerngen.plan import KernelSpec
    tbl = tiers.load()
    specs = {s for m in tbl.models.values() for s in warmup.model_specs(m, tbl, "sm_90a")}
    assert {s.op for s in specs} >= {"experts", "routing", "finalize", "latent_tail"}
    for s in specs:
        assert KernelSpec.from_json(s.to_json()) == s
        assert s.to_json() in jit.spec_command(s).replace("'", "")
