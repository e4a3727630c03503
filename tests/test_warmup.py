"""kerngen.warmup: the kernels a model needs, and the process pool that compiles them."""
import os
import signal
import subprocess
import sys
import time

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


def test_a_process_that_uses_the_gpu_builds_in_spawned_workers(tmp_path, monkeypatch):
    """After CUDA is initialised warmup may not fork (the children would inherit the driver's state): its
    workers are spawned, and there both backends build (an NVRTC kernel and a CuTe DSL one)."""
    monkeypatch.setattr(warmup, "_cuda_initialized", lambda: True)
    tbl = tiers.load()
    specs = warmup.model_specs(tbl.model("mixtral-8x7b"), tbl, "sm_90a")
    picked = [next(s for s in specs if s.backend == "nvrtc"), next(s for s in specs if s.backend == "cute")]
    results = warmup.run(picked, str(tmp_path), jobs=2, progress=False)
    assert [(r.status, r.error) for r in results] == [("compiled", "")] * 2
