"""Who may put code in the cache, and caches that cannot be written: file modes that let other users read a
cache, refusal of what another user could have written, read-only mounts, full disks, another user's cache.

Tests that need another user (setpriv to uid 65534) or a mount skip where that is not permitted."""
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest

from kerngen import cli, jit
from kerngen.cache import DiskCache
from kerngen.ops import finalize as fin

NOBODY = 65534
SPEC, OTHER, THIRD = (fin.spec(h, 8, "bfloat16", "float32", 1, "sm_90a") for h in (1024, 2048, 4096))


def needs_root():
    if os.geteuid() != 0:
        pytest.skip("needs root (to act as another user, chown or mount)")


def kerngen_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("kerngen")]


def run_kerngen(*args, cache, user=None):
    prefix = []
    if user is not None:
        needs_root()
        if shutil.which("setpriv") is None:
            pytest.skip("setpriv is not installed")
        prefix = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]
        probe = subprocess.run([*prefix, sys.executable, "-c", "import kerngen"], capture_output=True, text=True,
                               cwd="/")
        if probe.returncode:   # e.g. a virtualenv inside a directory private to root
            pytest.skip(f"user {user} cannot import kerngen from this Python ({probe.stderr.strip()[-120:]})")
    return subprocess.run([*prefix, sys.executable, *args], capture_output=True, text=True, cwd="/",
                          env={**os.environ, "KERNGEN_CACHE_DIR": str(cache)})


@pytest.fixture
def shared():
    """A directory every user can enter (pytest's tmp_path is private to root)."""
    d = Path(tempfile.mkdtemp(prefix="kerngen-shared-", dir="/tmp"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@contextmanager
def mounted(*mount_args):
    """A fresh mount point with `mount *mount_args <point>` on it; skips where mounting is not permitted."""
    needs_root()
    point = Path(tempfile.mkdtemp(prefix="kerngen-mnt-"))
    r = subprocess.run(["mount", *mount_args, str(point)], capture_output=True, text=True)
    if r.returncode:
        point.rmdir()
        pytest.skip(f"mount {' '.join(mount_args)} is not permitted here: {r.stderr.strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], capture_output=True)
        point.rmdir()


@contextmanager
def read_only_view(src: Path):
    with mounted("--bind", "-o", "ro", str(src)) as point:
        if os.access(point, os.W_OK):   # older kernels ignore ro on the first bind
            if subprocess.run(["mount", "-o", "remount,ro,bind", str(point)], capture_output=True).returncode:
                pytest.skip("a read-only bind remount is not permitted here")
        yield point


def test_files_are_readable_by_everyone_and_writable_by_their_owner_only(tmp_path):
    root = tmp_path / "c"
    old = os.umask(0o002)   # a group-writable umask must not make the cache group-writable
    try:
        jit.build(SPEC, store=DiskCache(root))
    finally:
        os.umask(old)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in (root, *root.rglob("*"))}
    assert {m for p, m in modes.items() if (tmp_path / p).is_dir()} == {0o755}, modes
    assert {m for p, m in modes.items() if not (tmp_path / p).is_dir()} == {0o644}, modes
    assert (root / "CACHEDIR.TAG").is_file()


@pytest.mark.parametrize("mode, group, who", [(0o777, None, "everyone"), (0o775, NOBODY, "its group (gid 65534)")])
def test_a_cache_others_can_write_is_not_used(tmp_path, mode, group, who):
    root = tmp_path / "c"
    key = jit.build(SPEC, store=DiskCache(root)).key
    before = {p: p.read_bytes() for p in (root / key).iterdir()}
    if group is not None:
        needs_root()
        os.chown(root, -1, group)   # a group others are in
    root.chmod(mode)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        store = DiskCache(root)
        a, b = jit.build(SPEC, store=store), jit.build(OTHER, store=store)
    assert (a.status, a.stored, b.status, b.stored) == ("compiled", False, "compiled", False)
    msgs = kerngen_warnings(w)
    assert len(msgs) == 1 and f"{root} is writable by {who}" in msgs[0] and "not used" in msgs[0]
    assert {p: p.read_bytes() for p in (root / key).iterdir()} == before
    assert sorted(os.listdir(root)) == sorted([".locks", "CACHEDIR.TAG", key])   # nothing written, nothing removed


def test_a_group_of_the_owner_alone_may_write(tmp_path):
    from kerngen.trust import _private_group
    if not _private_group(os.getegid(), os.geteuid()):
        pytest.skip("this user's group is not a private group")
    root = tmp_path / "c"
    jit.build(SPEC, store=DiskCache(root))
    for p in (root, *root.rglob("*")):   # as a checkout or cache made with umask 002 is
        p.chmod(p.stat().st_mode | stat.S_IWGRP)
    assert jit.build(SPEC, store=DiskCache(root)).status == "cached"


@pytest.mark.parametrize("planted", ["entry", "artifact"])
def test_an_entry_another_user_could_have_written_is_refused_and_left_in_place(tmp_path, planted, capsys,
                                                                                monkeypatch):
    needs_root()
    root = tmp_path / "c"
    key = jit.build(SPEC, store=DiskCache(root)).key
    entry = root / key
    for p in ([entry, *entry.iterdir()] if planted == "entry" else [entry / "kernel.cubin"]):
        os.chown(p, NOBODY, NOBODY)   # its checksums still match: only the owner gives it away
    before = {p: (p.read_bytes(), p.stat().st_uid) for p in entry.iterdir()}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        store = DiskCache(root)
        b = jit.build(SPEC, store=store)
        assert jit.build(SPEC, store=store).status == "compiled"   # refused again, quietly
    assert b.status == "compiled" and not b.stored
    msgs = kerngen_warnings(w)
    assert len(msgs) == 1 and "is owned by uid 65534, not by you or root" in msgs[0] and "left in place" in msgs[0]
    monkeypatch.setenv("KERNGEN_CACHE_DIR", str(root))
    assert cli.main(["cache", "verify"]) == 1
    assert f"{key}  untrusted" in capsys.readouterr().out
    assert {p: (p.read_bytes(), p.stat().st_uid) for p in entry.iterdir()} == before


def test_an_entry_that_is_a_symlink_elsewhere_is_never_read(tmp_path):
    root = tmp_path / "c"
    key = jit.build(SPEC, store=DiskCache(root)).key
    elsewhere = tmp_path / "elsewhere"
    (root / key).rename(elsewhere)
    (root / key).symlink_to(elsewhere)
    (root / key / "kernel.cubin")  # reachable through the link, but not served from it
    b = jit.build(SPEC, store=DiskCache(root))
    assert b.status == "compiled" and b.stored and not (root / key).is_symlink()
    assert sorted(os.listdir(elsewhere)) == ["kernel.cubin", "meta.json", "source.cu"]   # untouched


def test_another_user_is_served_a_cache_warmed_for_them(shared):
    needs_root()
    root = shared / "c"
    key = jit.build(SPEC, store=DiskCache(root)).key
    code = f"""
import json, warnings
from kerngen import jit
from kerngen.cache import DiskCache
from kerngen.ops import finalize as fin
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    store = DiskCache({str(root)!r})
    built = [jit.build(fin.spec(h, 8, "bfloat16", "float32", 1, "sm_90a"), store=store) for h in (1024, 2048, 4096)]
print(json.dumps([[b.status, b.stored] for b in built] + [str(x.message) for x in w]))
"""
    r = run_kerngen("-c", code, cache=root, user=NOBODY)
    assert r.returncode == 0, r.stderr[-2000:]
    *built, = json.loads(r.stdout.splitlines()[-1])
    assert built[:3] == [["cached", True], ["compiled", False], ["compiled", False]]
    assert len(built[3:]) == 1 and "is not writable (Permission denied)" in built[3], built[3:]
    r = run_kerngen("-m", "kerngen", "cache", "verify", cache=root, user=NOBODY)
    assert r.returncode == 0 and "1 ok, 0 bad" in r.stdout, r.stdout + r.stderr
    r = run_kerngen("-m", "kerngen", "warmup", "--op", "finalize", "--topk", "8", "--hidden", "1024",
                    "--arch", "sm_90a,sm_100a", "--jobs", "2", "--quiet", cache=root, user=NOBODY)
    assert r.returncode == 1 and "1 compiled (0 stored), 1 cached" in r.stdout, r.stdout + r.stderr
    assert "could not be stored" in r.stderr and "Permission denied" in r.stderr and "Traceback" not in r.stderr
    assert sorted(os.listdir(root)) == [".locks", "CACHEDIR.TAG", key]
    assert DiskCache(root).get(key) is not None


def test_a_read_only_mount_serves_what_it_holds_and_compiles_the_rest_in_memory(tmp_path):
    src = tmp_path / "c"
    key = jit.build(SPEC, store=DiskCache(src)).key
    with read_only_view(src) as ro:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            store = DiskCache(ro)
            a, b = jit.build(SPEC, store=store), jit.build(OTHER, store=store)
            c = jit.build(THIRD, store=DiskCache(ro))   # a second store of the same directory: no second warning
        assert (a.status, b.status, b.stored, c.status, c.stored) == ("cached", "compiled", False, "compiled", False)
        msgs = kerngen_warnings(w)
        assert len(msgs) == 1 and "Read-only file system" in msgs[0], msgs
        r = run_kerngen("-m", "kerngen", "warmup", "--op", "finalize", "--topk", "8", "--hidden", "1024",
                        "--arch", "sm_90a,sm_100a", "--jobs", "2", "--quiet", cache=ro)
        assert r.returncode == 1 and "1 compiled (0 stored), 1 cached" in r.stdout, r.stdout + r.stderr
        assert "Read-only file system" in r.stderr and "Traceback" not in r.stderr
        r = run_kerngen("-m", "kerngen", "warmup", "--op", "finalize", "--topk", "8", "--hidden", "1024",
                        "--quiet", cache=ro)
        assert r.returncode == 0 and "0 compiled (0 stored), 1 cached" in r.stdout   # it has all that was asked
    assert sorted(os.listdir(src)) == [".locks", "CACHEDIR.TAG", key]


def test_warmup_onto_a_full_disk_says_what_was_stored(tmp_path):
    with mounted("-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs") as disk:
        args = ("-m", "kerngen", "warmup", "--op", "finalize", "--topk", "8", "--hidden", "1024", "--arch",
                "sm_90a,sm_100a", "--quiet")   # about 32 KiB an entry: one fits
        r = run_kerngen(*args, cache=disk)
        stored = [k for k in os.listdir(disk) if k.startswith("finalize-")]
        assert r.returncode == 1 and f"2 compiled ({len(stored)} stored)" in r.stdout and len(stored) < 2, r.stdout
        assert f"{2 - len(stored)} of 2 compiled kernel" in r.stderr
        assert "No space left on device" in r.stderr and "Traceback" not in r.stderr
        verify = run_kerngen("-m", "kerngen", "cache", "verify", cache=disk)
        assert f"{len(stored)} ok, 0 bad" in verify.stdout   # no partial entry left behind


def test_the_trust_policy_is_one_module_the_store_applies(tmp_path):
    """kerngen.trust says whom a cache directory, an entry or a file is trusted from; kerngen.cache stores and
    applies it without a policy of its own."""
    from kerngen import cache, trust
    for name in ("owner_problem", "path_problem", "not_a_directory", "root_problem", "refusal"):
        assert getattr(trust, name).__module__ == "kerngen.trust"
        assert getattr(cache, name, None) in (None, getattr(trust, name)), f"cache.{name} is a second policy"
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o755)
    assert trust.root_problem(mine / "cache") is None and trust.owner_problem(os.stat(mine)) is None
    (tmp_path / "file").write_text("")
    reason, detail = trust.root_problem(tmp_path / "file" / "cache")
    assert (reason, detail) == ("unusable", f"{tmp_path / 'file'} is not a directory")
    assert "cannot be used" in trust.refusal(tmp_path / "file" / "cache", reason, detail)
    mine.chmod(0o777)
    reason, detail = trust.root_problem(mine / "cache")
    assert reason == "untrusted" and detail == f"{mine} is writable by everyone"
    assert "another user's code" in trust.refusal(mine / "cache", reason, detail)
