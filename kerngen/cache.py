"""On-disk kernel store, safe under many processes.

Layout: <root>/CACHEDIR.TAG, <root>/<key>/<artifact files>, <root>/<key>/meta.json, <root>/.locks/<key>.lock.
The marker file is written with the first lock or entry; nothing is ever removed from a root without it, and
only key-shaped names are read or removed (a cache directory may hold the user's own files too).
Every file is written to a temp name and os.replace'd; meta.json is written last and carries the sha256 of
each artifact, so an entry without a valid meta.json is incomplete and one whose checksum fails is corrupt:
both are logged, removed and rebuilt. Locks are fcntl locks (filelock): the kernel releases them when the
holder dies, so a kill -9 mid-compile never hangs anyone. A directory that cannot be written degrades to
in-memory operation with one warning.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path

import filelock

from . import env
from .errors import CacheError

log = logging.getLogger("kerngen.cache")
META = "meta.json"
MARKER = "CACHEDIR.TAG"   # https://bford.info/cachedir/: backup tools skip the directory too
MARKER_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
               "# A kerngen kernel cache. `kerngen cache verify|clear` only touch its key-shaped entries.\n")
# op-variant-tag-arch-hash12, e.g. finalize-small_batch-H3584-K16-bf16-wf32-sm_90a-1dc3cd5d6ff2
KEY = re.compile(r"[a-z][a-z0-9_]*-[a-z][a-z0-9_]*-[A-Za-z0-9_.-]+-sm_[0-9]+[a-z]?-[0-9a-f]{12}")


def is_key(name: str) -> bool:
    return KEY.fullmatch(name) is not None


def check_key(key: str) -> str:
    """A key names a directory under the root: anything else (a path, '..') is refused."""
    if not is_key(key):
        raise CacheError(f"'{key}' is not a kernel cache key (op-variant-shape-arch-hash)")
    return key


class DiskCache:
    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.writable = True
        self._warned = False
        self.miss_reason: dict[str, str] = {}  # key -> why the last get() missed

    # ------------------------------------------------------------------ read
    def get(self, key: str) -> dict[str, bytes] | None:
        """The entry's files, or None if absent, incomplete or corrupt (the latter two are removed)."""
        entry = self.root / check_key(key)
        meta_path = entry / META
        if not meta_path.is_file():
            if entry.is_dir():
                self._discard(key, "incomplete (no meta.json)")
                self.miss_reason[key] = "incomplete"
            else:
                self.miss_reason[key] = self._absent_reason(key)
            return None
        try:
            meta = json.loads(meta_path.read_text())
            files = {}
            for name, digest in meta["sha256"].items():
                data = (entry / name).read_bytes()
                if hashlib.sha256(data).hexdigest() != digest:
                    raise ValueError(f"checksum mismatch in {name}")
                files[name] = data
            if meta.get("key") != key:
                raise ValueError("meta.json names another key")
        except (OSError, ValueError, KeyError, TypeError) as e:
            self._discard(key, f"corrupt ({e})")
            self.miss_reason[key] = "corrupt"
            return None
        return files

    def _absent_reason(self, key: str) -> str:
        """'stale' when an entry of the same op/variant/shape/arch but another hash exists (an older toolchain,
        template or kerngen version built it), else 'absent'."""
        prefix = key.rsplit("-", 1)[0] + "-"
        try:
            return "stale" if any(p.name.startswith(prefix) for p in self.root.iterdir()) else "absent"
        except OSError:
            return "absent"

    def meta(self, key: str) -> dict | None:
        try:
            return json.loads((self.root / key / META).read_text())
        except (OSError, ValueError):
            return None

    def keys(self) -> list[str]:
        """The key-shaped names under the root (entries, whole or broken); other names are not kerngen's."""
        try:
            return sorted(n for n in os.listdir(self.root) if is_key(n))
        except OSError:
            return []

    def is_marked(self) -> bool:
        """Whether the root carries kerngen's marker file (only then is anything in it ever removed)."""
        return (self.root / MARKER).is_file()

    # ----------------------------------------------------------------- write
    def put(self, key: str, files: dict[str, bytes], meta: dict, extra: dict[str, bytes] | None = None) -> bool:
        """Store artifact `files` (checksummed) and `extra` files (e.g. the source); meta.json last."""
        if not self.writable:
            return False
        entry = self.root / check_key(key)
        try:
            self._prepare_root()
            entry.mkdir(exist_ok=True)
            for name, data in {**(extra or {}), **files}.items():
                self._atomic_write(entry / name, data)
            meta = {**meta, "key": key, "sha256": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}}
            self._atomic_write(entry / META, json.dumps(meta, indent=1, sort_keys=True).encode())
            return True
        except OSError as e:
            self._degrade(e)
            return False

    def source_path(self, key: str, name: str, text: str) -> str:
        """Write a rendered source beside its entry (or into a temp dir) so errors can point at it."""
        for base in ((self.root / key) if self.writable else None, Path(tempfile.gettempdir()) / "kerngen" / key):
            if base is None:
                continue
            try:
                base.mkdir(parents=True, exist_ok=True)
                self._atomic_write(base / name, text.encode())
                return str(base / name)
            except OSError:
                continue
        return "(could not be written)"

    def remove(self, key: str) -> bool:
        """Delete entry `key` (a directory, or whatever broken thing sits at its name); only under a marked root."""
        path = self.root / check_key(key)
        if not self.is_marked():
            log.warning("kerngen cache: %s has no %s marker, so %s is left in place", self.root, MARKER, key)
            return False
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("kerngen cache: could not remove %s (%s)", path, e.strerror or e)
            return False
        return True

    def _prepare_root(self) -> None:
        """Create the root and its marker before the first lock or entry (raises OSError)."""
        self.root.mkdir(parents=True, exist_ok=True)
        if not self.is_marked():
            self._atomic_write(self.root / MARKER, MARKER_TEXT.encode())

    @contextmanager
    def lock(self, key: str, timeout: float | None = None):
        """Exclusive per-key lock across processes; a no-op when the directory is not writable."""
        if self.writable:
            try:
                self._prepare_root()
                (self.root / ".locks").mkdir(exist_ok=True)
                lk = filelock.FileLock(str(self.root / ".locks" / f"{key}.lock"),
                                       timeout=env.lock_timeout() if timeout is None else timeout)
            except OSError as e:
                self._degrade(e)
            else:
                with lk:
                    yield
                return
        yield

    # --------------------------------------------------------------- helpers
    def _atomic_write(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

    def _discard(self, key: str, why: str) -> None:
        log.warning("kerngen cache: entry %s is %s; rebuilding it", key, why)
        if self.writable and self.is_marked():
            # Only a lock holder may delete: another process may be writing this very entry right now.
            try:
                with self.lock(key, timeout=0):
                    if not (self.root / key / META).is_file() or why.startswith("corrupt"):
                        self.remove(key)
            except filelock.Timeout:
                pass

    def _degrade(self, err: OSError) -> None:
        self.writable = False
        if not self._warned:
            self._warned = True
            warnings.warn(f"kerngen: cache directory {self.root} is not writable ({err.strerror or err}); "
                          "kernels will be compiled in memory for this process only. Set KERNGEN_CACHE_DIR "
                          "to a writable directory to keep them.", RuntimeWarning, stacklevel=3)


_default: DiskCache | None = None


def default() -> DiskCache:
    """The process-wide cache at KERNGEN_CACHE_DIR (created lazily, on first write)."""
    global _default
    if _default is None or _default.root != env.cache_dir():
        _default = DiskCache(env.cache_dir())
    return _default
