"""The disk cache under concurrency, kill -9, corruption, read-only directories and strict mode."""
import json
import os
import signal
import subprocess
import sys
import time
import warnings

import pytest

import kerngen
from kerngen import jit
from kerngen.cache import DiskCache
from kerngen.ops import finalize as fin

SPEC = fin.spec(1024, 8, "bfloat16", "float32", 1, "sm_90a")


def _warm_in_subprocess(root: str, delay: float = 0.0) -> subprocess.Popen:
    code = f"""
import time, kerngen.jit as jit, kerngen.compile as c
from kerngen.cache import DiskCache
from kerngen.ops import finalize as fin
real = c.nvrtc_compile
def slow(*a, **k):
    time.sleep({delay})
    return real(*a, **k)
c.nvrtc_compile = slow
b = jit.build(fin.spec(1024, 8, "bfloat16", "float32", 1, "sm_90a"), store=DiskCache({root!r}), strict=False)
print(b.status)
"""
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_many_processes_compile_one_key_once(tmp_path):
    procs = [_warm_in_subprocess(str(tmp_path), delay=0.5) for _ in range(8)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-500:] for o in outs]
    statuses = sorted(o[0].strip() for o in outs)
    assert statuses.count("compiled") == 1 and statuses.count("cached") == 7
    assert DiskCache(tmp_path).get(jit.key_of(SPEC)) is not None


def test_kill_9_mid_compile_then_rerun_heals(tmp_path):
    p = _warm_in_subprocess(str(tmp_path), delay=30)
    key = jit.key_of(SPEC)
    deadline = time.time() + 30  # wait until it holds the lock and has written the source
    while not (tmp_path / key / "source.cu").exists() and time.time() < deadline:
        time.sleep(0.05)
    assert (tmp_path / key / "source.cu").exists(), p.stderr.read() if p.poll() is not None else "no progress"
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    t0 = time.time()
    b = jit.build(SPEC, store=DiskCache(tmp_path), strict=False)
    assert b.status == "compiled" and time.time() - t0 < 30  # the dead holder's lock did not block us
    assert jit.build(SPEC, store=DiskCache(tmp_path), strict=False).status == "cached"


def test_truncated_artifact_is_detected_and_rebuilt(tmp_path, caplog):
    store = DiskCache(tmp_path)
    key = jit.build(SPEC, store=store).key
    cubin = tmp_path / key / "kernel.cubin"
    good = cubin.read_bytes()
    cubin.write_bytes(good[: len(good) // 2])
    assert jit.build(SPEC, store=DiskCache(tmp_path)).status == "compiled"
    assert "corrupt" in caplog.text
    assert cubin.read_bytes() == good


@pytest.mark.parametrize("damage", ["no_meta", "bad_json", "other_key"])
def test_damaged_metadata_is_rebuilt(tmp_path, damage):
    key = jit.build(SPEC, store=DiskCache(tmp_path)).key
    meta = tmp_path / key / "meta.json"
    if damage == "no_meta":
        meta.unlink()
    elif damage == "bad_json":
        meta.write_text("{ not json")
    else:
        m = json.loads(meta.read_text()); m["key"] = "x"; meta.write_text(json.dumps(m))
    assert jit.build(SPEC, store=DiskCache(tmp_path)).status == "compiled"
    assert jit.build(SPEC, store=DiskCache(tmp_path)).status == "cached"


@pytest.mark.parametrize("where", ["/proc/kerngen-cache", "file"])
def test_unwritable_dir_degrades_to_memory_with_one_warning(tmp_path, where):
    root = "/proc/kerngen-cache" if where == "/proc/kerngen-cache" else str(tmp_path / "f")
    if where == "file":
        (tmp_path / "f").write_text("not a directory")
    store = DiskCache(root)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = jit.build(SPEC, store=store)
        b = jit.build(fin.spec(2048, 8, "bfloat16", "float32", 1, "sm_90a"), store=store)
    assert a.status == b.status == "compiled" and a.files["kernel.cubin"][:4] == b"\x7fELF"
    assert len([x for x in w if "not writable" in str(x.message)]) == 1


def test_read_only_cache_still_serves_its_entries(tmp_path, monkeypatch):
    key = jit.build(SPEC, store=DiskCache(tmp_path)).key
    store = DiskCache(tmp_path)
    monkeypatch.setattr(store, "writable", False)
    assert jit.build(SPEC, store=store).status == "cached" and key


def test_strict_mode_raises_with_key_and_command(tmp_path):
    store = DiskCache(tmp_path)
    kerngen.strict(True)
    try:
        with pytest.raises(kerngen.CacheMissError) as e:
            jit.build(SPEC, store=store)
        assert jit.key_of(SPEC) in str(e.value) and "kerngen warmup" in str(e.value)
        jit.build(SPEC, store=store, strict=False)
        assert jit.build(SPEC, store=store).status == "cached"
    finally:
        kerngen.strict(None)


def test_import_creates_nothing_and_loads_no_cutlass(tmp_path):
    d = tmp_path / "never"
    code = "import sys, kerngen; kerngen.models(); import torch; print('cutlass' in sys.modules, torch.cuda.is_initialized())"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "KERNGEN_CACHE_DIR": str(d)},
                         capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"] and not d.exists()


def test_miss_reasons_are_logged(tmp_path, caplog):
    import logging
    caplog.set_level(logging.INFO, logger="kerngen")
    store = DiskCache(tmp_path)
    key = jit.build(SPEC, store=store).key
    assert f"compiled {key} (absent)" in caplog.text
    (tmp_path / key / "kernel.cubin").write_bytes(b"garbage")
    jit.build(SPEC, store=DiskCache(tmp_path))
    assert f"compiled {key} (corrupt)" in caplog.text
    old = tmp_path / key
    old.rename(tmp_path / (key.rsplit("-", 1)[0] + "-000000000000"))  # as if an older version built it
    jit.build(SPEC, store=DiskCache(tmp_path))
    assert f"compiled {key} (stale)" in caplog.text
