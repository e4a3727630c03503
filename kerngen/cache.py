"""On-disk kernel store, safe under many processes, shareable read-only between users.

docs/cache.md states the contract this module keeps: the layout (<root>/CACHEDIR.TAG, <root>/<key>/ with its
artifacts and meta.json written last, <root>/.locks/<key>.lock), one compile per key under a file lock the OS
releases when its holder dies, broken entries removed and rebuilt by the lock holder, and what a directory that
cannot be written or used still does. Whom a directory, an entry or a file is trusted from is kerngen/trust.py's
to say (owner_problem, root_problem); this module applies it to everything it reads. An entry's files (reading and
checking them, atomic writes, removal) are kerngen/cache_entry.py's; DiskCache decides when, under which lock, and
what a failure means.
"""
from __future__ import annotations

import logging
import os
import re
import warnings
from contextlib import contextmanager
from pathlib import Path

import filelock

from . import env
# the layout's names stay kerngen.cache's too (cli reads cache.MARKER): hence the noqa
from .cache_entry import (ARTIFACT_NAME, BROKEN, DIR_MODE, FILE_MODE, MARKER, MARKER_TEXT, META,  # noqa: F401
                          SHA256, Miss, entry_refusal, is_marked, load, mkdirs, prepare_root, private_source,
                          private_tmp, read_meta, remove_entry, write_entry, write_problem)
from .errors import CacheError
from .trust import refusal, root_problem

log = logging.getLogger("kerngen.cache")
LOCKS = ".locks"
# op-variant-tag-arch-hash12, e.g. finalize-small_batch-H3584-K16-bf16-wf32-sm_90a-1dc3cd5d6ff2
KEY = re.compile(r"[a-z][a-z0-9_]*-[a-z][a-z0-9_]*-[A-Za-z0-9_.-]+-sm_[0-9]+[a-z]?-[0-9a-f]{12}")
_warned: set[tuple[str, str]] = set()   # (root, kind) warned about in this process: each warning once


def is_key(name: str) -> bool:
    return KEY.fullmatch(name) is not None


def check_key(key: str) -> str:
    """A key names a directory under the root: anything else (a path, '..') is refused."""
    if not isinstance(key, str) or not is_key(key):
        raise CacheError(f"{key!r} is not a kernel cache key (op-variant-shape-arch-hash)")
    return key


class KeyLocks:
    """The per-key file locks of one root, <root>/.locks/<key>.lock (the OS releases one whose holder died, even
    by kill -9), and the keys this process holds."""

    def __init__(self, root: Path):
        self.root = root
        self.held: set[str] = set()

    def path(self, key: str) -> Path:
        return self.root / LOCKS / f"{key}.lock"

    def take(self, key: str, timeout: float) -> filelock.FileLock:
        """The key's lock, waited for up to `timeout` seconds: a CacheError past it, OSError where it cannot be
        made."""
        path = self.path(key)
        try:
            mkdirs(path.parent)
            lk = filelock.FileLock(str(path), timeout=timeout, mode=FILE_MODE)
            lk.acquire()
        except filelock.Timeout:   # a TimeoutError: never the OSError the caller takes for an unwritable root
            raise CacheError(f"kernel {key}: waited {timeout:g}s for its lock {path}, which another process holds "
                             f"(compiling it, or stuck). Retry, find the holder (fuser {path}), or raise "
                             f"KERNGEN_LOCK_TIMEOUT (now {timeout:g} seconds)") from None
        return lk

    def try_take(self, key: str):
        """The key's lock if it is free now; None if another process holds it; False if it cannot be taken."""
        path = self.path(key)
        lk = filelock.FileLock(str(path), timeout=0, mode=FILE_MODE)
        try:
            mkdirs(path.parent)   # the caller checked that the root is marked: kerngen's to write in
            lk.acquire()
        except filelock.Timeout:
            return None
        except OSError:
            return False
        return lk

    @contextmanager
    def holding(self, key: str, lk: filelock.FileLock | None):
        """`key` counts as held while the block runs, then its lock `lk` is released (None: no lock, no-op)."""
        if lk is not None:
            self.held.add(key)
        try:
            yield
        finally:
            if lk is not None:
                self.held.discard(key)
                lk.release()


def heal(locks: KeyLocks, key: str, miss: Miss, artifacts: tuple[str, ...],
         writable: bool) -> tuple[dict[str, bytes] | None, str]:
    """A broken (incomplete or corrupt) entry is removed under its lock: (its files, "") when its builder finished
    it just before we locked, else (None, why it missed). While another process holds the lock it is being built:
    "building", a quiet miss (the caller waits for that lock). Where no lock can be taken (not `writable`, root
    not marked) it is left in place."""
    root = locks.root
    if key in locks.held:
        return None, _discard(root, key, miss)
    lk = locks.try_take(key) if writable and is_marked(root) else False
    if lk is None:
        log.debug("kerngen cache: entry %s is being built by another process", key)
        return None, "building"
    if lk is False:   # no lock to be had here (read-only, not yet marked): leave it, build in memory
        log.warning("kerngen cache: entry %s is %s (%s); left in place (its lock cannot be taken here)", key,
                    miss.reason, miss.detail)
        return None, miss.reason
    try:
        return load(root, key, artifacts), ""   # finished by its builder just before we locked
    except Miss as again:
        return None, _discard(root, key, again) if again.reason in BROKEN else again.reason
    finally:
        lk.release()


def _discard(root: Path, key: str, miss: Miss) -> str:
    removed = remove_entry(root, key)
    log.warning("kerngen cache: entry %s is %s (%s); %s", key, miss.reason, miss.detail,
                "removed" if removed else "left in place")
    return miss.reason


class DiskCache:
    """One cache directory: get / put entries by key, and a lock per key (jit.build holds the contract). It
    decides whom to trust and when to write, heal or stop writing; the files are kerngen/cache_entry.py's."""

    def __init__(self, root: Path | str, *, quiet: bool = False):
        self.root = Path(root)
        self.quiet = quiet                     # no warnings (warmup workers: their parent reports)
        self.writable = True                   # False after the first failed write: memory from then on
        self.write_error = ""                  # why writes stopped
        self.miss_reason: dict[str, str] = {}  # key -> why the last get() missed
        self._distrust: str | None = None
        self.refusal_reason = ""              # "unusable" or "untrusted" once distrust() found a problem
        self._trust_checked = False
        self._locks = KeyLocks(self.root)      # per-key file locks, and the keys this object holds

    # ------------------------------------------------------------------ read
    def distrust(self) -> str | None:
        """Why this directory is not used at all (checked once), or None: it or a directory above it is a file
        (refusal_reason "unusable"), or it could hold another user's code ("untrusted"). See root_problem."""
        if not self._trust_checked:
            self._trust_checked = True
            if (found := root_problem(self.root)) is not None:
                reason, detail = found
                self.refusal_reason, self._distrust, self.writable = reason, detail, False
                self.write_error = f"not trusted: {detail}" if reason == "untrusted" else detail
                self._warn(reason, f"kerngen: {refusal(self.root, reason, detail)}. Kernels are compiled in memory "
                           "for this process.")
        return self._distrust

    def write_problem(self) -> str | None:
        """Why nothing can be stored here, found by creating the root (and its marker) and a scratch file in it
        before any kernel is compiled, or None. Writes are not stopped by this probe."""
        return self.write_error if self.distrust() else write_problem(self.root)

    def get(self, key: str, artifacts: tuple[str, ...] = ()) -> dict[str, bytes] | None:
        """The entry's files (`artifacts` among them), or None with the reason in miss_reason[key]: absent,
        building (another process holds its lock), incomplete, corrupt (both removed by the lock holder),
        untrusted or unreadable (both left in place)."""
        check_key(key)
        if self.distrust():
            return self._miss(key, self.refusal_reason)
        try:
            return load(self.root, key, artifacts)
        except Miss as m:
            miss = m
        if miss.reason in BROKEN:
            files, reason = heal(self._locks, key, miss, artifacts, self.writable)
            return files if files is not None else self._miss(key, reason)
        if miss.reason in ("untrusted", "unreadable"):
            log.info("kerngen cache: entry %s is %s (%s)", key, miss.reason, miss.detail)
            self._warn(f"entry-{miss.reason}", entry_refusal(self.root, key, miss))
        return self._miss(key, miss.reason)

    def check(self, key: str, artifacts: tuple[str, ...] = ()) -> str | None:
        """Why entry `key` would not be served, as "reason (detail)" (e.g. "corrupt (checksum mismatch in
        kernel.cubin)"), or None when its files match meta.json's checksums. Reads only: removes nothing."""
        check_key(key)
        if self.distrust():
            return self.refusal_reason
        try:
            load(self.root, key, artifacts)
        except Miss as m:
            return f"{m.reason} ({m.detail})" if m.detail else m.reason
        return None

    def _miss(self, key: str, reason: str) -> None:
        self.miss_reason[key] = reason
        return None

    def meta(self, key: str) -> dict | None:
        """The entry's meta.json, if it is there and may be read."""
        return read_meta(self.root, check_key(key))

    def siblings(self, key: str) -> list[dict]:
        """meta.json of the other entries with this key's readable part (op, variant, shape and arch)."""
        prefix = check_key(key).rsplit("-", 1)[0]
        return [m for k in self.keys() if k != key and k.rsplit("-", 1)[0] == prefix and (m := self.meta(k))]

    def keys(self) -> list[str]:
        """The key-shaped names under the root (entries, whole or broken); other names are not kerngen's."""
        try:
            return sorted(n for n in os.listdir(self.root) if is_key(n))
        except OSError:
            return []

    def is_marked(self) -> bool:
        """Whether the root carries kerngen's marker file (only then is anything in it ever removed)."""
        return is_marked(self.root)

    # ----------------------------------------------------------------- write
    def put(self, key: str, files: dict[str, bytes], meta: dict) -> bool:
        """Store artifact `files` (checksummed), meta.json last. False when nothing was stored: the directory is
        not written to (write_error says why) or the name is taken."""
        check_key(key)
        if not self.writable or self.distrust():
            return False
        try:
            return write_entry(self.root, key, files, meta, held=key in self._locks.held) is not None
        except OSError as e:
            self._stop_writing(e, key)
            return False

    def source_path(self, key: str, name: str, text: str) -> str:
        """Write a rendered source beside its entry (or into a private temp dir) so errors can point at it."""
        check_key(key)
        if self.writable and not self.distrust():
            try:
                entry = write_entry(self.root, key, {name: text.encode()}, held=key in self._locks.held)
                if entry is not None:
                    return str(entry / name)
            except OSError as e:
                self._stop_writing(e, key)
        return private_source(key, name, text)

    def remove(self, key: str) -> bool:
        """Delete entry `key` (a directory, or whatever broken thing sits at its name): only under a marked root,
        and only if this user owns it (another user's entry is never removed)."""
        return remove_entry(self.root, check_key(key))

    @contextmanager
    def lock(self, key: str, timeout: float | None = None):
        """Exclusive per-key lock across processes (it creates and marks the root). A no-op where this
        directory is not written to: each process then compiles the kernel in memory."""
        check_key(key)
        with self._locks.holding(key, self._acquire(key, env.lock_timeout() if timeout is None else timeout)):
            yield

    # --------------------------------------------------------------- helpers
    def _acquire(self, key: str, timeout: float) -> filelock.FileLock | None:
        if not self.writable or self.distrust():
            return None
        try:
            self._prepare_root()
            return self._locks.take(key, timeout)
        except OSError as e:
            self._stop_writing(e)
            return None

    def _prepare_root(self) -> None:
        """Create the root and its marker before the first lock or entry (raises OSError)."""
        prepare_root(self.root)

    def _stop_writing(self, err: OSError, key: str | None = None) -> None:
        """A write failed: from now on serve what the directory holds and compile the rest in memory. The partial
        entry `key`, if this object holds its lock, is removed (none left to fill the disk)."""
        self.writable, self.write_error = False, err.strerror or str(err)
        self._warn("write", f"kerngen: cache directory {self.root} is not writable ({self.write_error}); the "
                   "kernels it holds are still used, the others are compiled in memory for this process only. Set "
                   "KERNGEN_CACHE_DIR to a writable directory to keep them.")
        if key in self._locks.held:
            self.remove(key)

    def _warn(self, kind: str, text: str) -> None:
        if self.quiet or (str(self.root), kind) in _warned:
            return
        _warned.add((str(self.root), kind))
        warnings.warn(text, RuntimeWarning, stacklevel=4)


_default: DiskCache | None = None


def default() -> DiskCache:
    """The process-wide cache at KERNGEN_CACHE_DIR (created lazily, on first write)."""
    global _default
    root = env.cache_dir()
    if _default is None or _default.root != root:
        _default = DiskCache(root)
    return _default
