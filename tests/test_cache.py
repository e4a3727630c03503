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
    said = "is not a directory" if where == "file" else "not writable"
    assert len([x for x in w if said in str(x.message)]) == 1


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


def test_waiting_for_another_build_is_not_called_incomplete(tmp_path, caplog):
    import logging
    caplog.set_level(logging.DEBUG, logger="kerngen")
    p = _warm_in_subprocess(str(tmp_path), delay=3)
    key = jit.key_of(SPEC)
    deadline = time.time() + 30   # it holds the lock and has written the source, not yet meta.json
    while not (tmp_path / key / "source.cu").exists() and time.time() < deadline:
        time.sleep(0.05)
    store = DiskCache(tmp_path)
    assert store.get(key) is None and store.miss_reason[key] == "building"
    b = jit.build(SPEC, store=store)
    assert p.wait(60) == 0 and b.status == "cached"
    assert "incomplete" not in caplog.text and "rebuilding" not in caplog.text


@pytest.mark.parametrize("what", ["file", "symlink to another entry", "symlinked artifact"])
def test_a_file_or_symlink_where_an_entry_belongs_is_replaced(tmp_path, what):
    other = jit.build(fin.spec(2048, 8, "bfloat16", "float32", 1, "sm_90a"), store=DiskCache(tmp_path))
    other_files = {p.name: p.read_bytes() for p in (tmp_path / other.key).iterdir()}
    key = jit.key_of(SPEC)
    if what == "file":
        (tmp_path / key).write_text("not an entry")
    elif what == "symlink to another entry":
        (tmp_path / key).symlink_to(tmp_path / other.key)
    else:
        jit.build(SPEC, store=DiskCache(tmp_path))
        (tmp_path / "a.cubin").write_bytes((tmp_path / key / "kernel.cubin").read_bytes())
        (tmp_path / key / "kernel.cubin").unlink()
        (tmp_path / key / "kernel.cubin").symlink_to(tmp_path / "a.cubin")   # same bytes, read through a link
    assert jit.build(SPEC, store=DiskCache(tmp_path)).status == "compiled"
    assert (tmp_path / key).is_dir() and not (tmp_path / key).is_symlink()
    assert not (tmp_path / key / "kernel.cubin").is_symlink()
    assert jit.build(SPEC, store=DiskCache(tmp_path)).status == "cached"
    assert {p.name: p.read_bytes() for p in (tmp_path / other.key).iterdir()} == other_files


@pytest.mark.parametrize("sha256", [{}, "x", {"kernel.cubin": "0" * 63}, {"../x": "0" * 64}, None])
def test_meta_with_malformed_checksums_is_rebuilt_and_verify_says_so(tmp_path, sha256, monkeypatch, capsys):
    from kerngen import cli
    key = jit.build(SPEC, store=DiskCache(tmp_path)).key
    meta = tmp_path / key / "meta.json"
    m = json.loads(meta.read_text())
    m["sha256"] = sha256
    meta.write_text(json.dumps(m))
    monkeypatch.setenv("KERNGEN_CACHE_DIR", str(tmp_path))
    assert cli.main(["cache", "verify"]) == 1
    assert "0 ok, 1 bad, 1 removed" in capsys.readouterr().out
    meta.parent.mkdir()
    meta.write_text(json.dumps(m))
    assert jit.build(SPEC, store=DiskCache(tmp_path)).status == "compiled"
    assert jit.build(SPEC, store=DiskCache(tmp_path)).files["kernel.cubin"][:4] == b"\x7fELF"


def test_an_entry_without_its_backend_artifact_is_rebuilt(tmp_path):
    key = jit.build(SPEC, store=DiskCache(tmp_path)).key
    meta = tmp_path / key / "meta.json"
    m = json.loads(meta.read_text())
    (tmp_path / key / "source.cu").rename(tmp_path / key / "other")
    m["sha256"] = {"other": __import__("hashlib").sha256((tmp_path / key / "other").read_bytes()).hexdigest()}
    meta.write_text(json.dumps(m))
    assert jit.build(SPEC, store=DiskCache(tmp_path)).status == "compiled"   # not served without kernel.cubin


def test_a_deleted_entry_is_absent_not_stale_beside_same_shape_entries(tmp_path, caplog):
    import logging

    from kerngen import plan, tiers
    caplog.set_level(logging.INFO, logger="kerngen")
    rule = tiers.Rule(op="finalize", variant="small_batch", ranges={},
                      params={"block_x": 32, "loads_per_group": 4, "early_read": False})
    twin = plan.spec_for(rule, SPEC.tag, dict(SPEC.constants), "sm_90a")   # same readable key, other params
    store = DiskCache(tmp_path)
    a, b = jit.build(SPEC, store=store), jit.build(twin, store=store)
    assert a.key.rsplit("-", 1)[0] == b.key.rsplit("-", 1)[0] and a.key != b.key
    import shutil
    shutil.rmtree(tmp_path / a.key)
    jit.build(SPEC, store=DiskCache(tmp_path))
    assert f"compiled {a.key} (absent)" in caplog.text


def test_the_not_writable_warning_comes_once_per_directory(tmp_path):
    root = tmp_path / "f"
    root.write_text("a file, not a directory")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        for h in (1024, 2048, 4096):   # a store per kernel, as warmup makes them
            jit.build(fin.spec(h, 8, "bfloat16", "float32", 1, "sm_90a"), store=DiskCache(root))
    assert len([x for x in w if "is not a directory" in str(x.message)]) == 1


def test_rendered_sources_of_an_unwritable_cache_go_to_a_private_temp_dir(tmp_path, monkeypatch):
    import stat
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    key = jit.key_of(SPEC)
    (tmp_path / "f-is-a-file").write_text("no cache can live here")
    path = DiskCache(tmp_path / "f-is-a-file").source_path(key, "source.cu", "// x")
    mine = tmp_path / f"kerngen-src-{os.geteuid()}"
    assert path == str(mine / key / "source.cu") and stat.S_IMODE(mine.stat().st_mode) == 0o700
    assert not (tmp_path / "kerngen").exists()   # would shadow the package for anyone working in $TMPDIR
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    mine.rename(tmp_path / "old")
    mine.symlink_to(elsewhere)                  # planted: never followed
    path = DiskCache(tmp_path / "f-is-a-file").source_path(key, "source.cu", "// y")
    assert not path.startswith(str(mine) + "/") and open(path).read() == "// y" and not os.listdir(elsewhere)


def test_a_lock_wait_that_times_out_names_the_key_and_the_variable(tmp_path, monkeypatch):
    p = _warm_in_subprocess(str(tmp_path), delay=20)
    key = jit.key_of(SPEC)
    deadline = time.time() + 30
    while not (tmp_path / key / "source.cu").exists() and time.time() < deadline:
        time.sleep(0.05)
    monkeypatch.setenv("KERNGEN_LOCK_TIMEOUT", "0.5")
    try:
        with pytest.raises(kerngen.errors.CacheError) as e:
            jit.build(SPEC, store=DiskCache(tmp_path))
        assert key in str(e.value) and "KERNGEN_LOCK_TIMEOUT (now 0.5 seconds)" in str(e.value)
    finally:
        p.kill()
        p.wait()


def test_keys_are_names_never_paths(tmp_path):
    store = DiskCache(tmp_path)
    for bad in ("../x", "finalize-small_batch-H8-sm_90a-0123456789ab/../../x", "", "."):
        with pytest.raises(kerngen.errors.CacheError):
            store.get(bad)


def test_the_cuda_header_versions_are_in_the_key(monkeypatch):
    from kerngen import compile as nvrtc
    before = jit.key_of(SPEC)
    real = nvrtc.metadata.version
    monkeypatch.setattr(nvrtc.metadata, "version",
                        lambda d: "99.0" if d == "nvidia-cuda-cccl" else real(d))
    nvrtc.headers.cache_clear()
    try:
        assert "nvidia-cuda-cccl==99.0" in nvrtc.toolchain()["headers"]
        assert jit.key_of(SPEC) != before
    finally:
        nvrtc.headers.cache_clear()


def test_a_meta_json_that_is_a_directory_is_a_corrupt_entry(tmp_path, caplog, monkeypatch, capsys):
    from kerngen import cli
    key = jit.build(SPEC, store=DiskCache(tmp_path)).key
    meta = tmp_path / key / "meta.json"
    meta.unlink()
    meta.mkdir()
    monkeypatch.setenv("KERNGEN_CACHE_DIR", str(tmp_path))
    assert cli.main(["cache", "verify"]) == 1   # no IsADirectoryError half-way
    assert f"{key}  corrupt  (removed)" in capsys.readouterr().out and not (tmp_path / key).exists()
    jit.build(SPEC, store=DiskCache(tmp_path))
    meta.unlink()
    meta.mkdir()
    assert jit.build(SPEC, store=DiskCache(tmp_path)).status == "compiled"   # logged, removed under its lock, rebuilt
    assert "meta.json is a directory" in caplog.text and meta.is_file()
    assert jit.build(SPEC, store=DiskCache(tmp_path)).status == "cached"


@pytest.mark.parametrize("below", [False, True])
def test_a_cache_dir_that_is_a_file_or_below_one_is_the_same_case(tmp_path, below):
    (tmp_path / "f").write_text("a file, not a directory")
    root = tmp_path / "f" / "cache" if below else tmp_path / "f"
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        b = jit.build(SPEC, store=DiskCache(root))
    assert b.status == "compiled" and not b.stored
    msgs = [str(x.message) for x in w if "kerngen" in str(x.message)]
    assert msgs == [f"kerngen: cache directory {root} cannot be used: {tmp_path / 'f'} is not a directory. Set "
                    "KERNGEN_CACHE_DIR to a directory (it is created if missing). Kernels are compiled in memory for "
                    "this process."], msgs
