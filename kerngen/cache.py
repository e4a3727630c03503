"""On-disk kernel store, safe under many processes, shareable read-only between users.

docs/cache.md states the contract this module keeps: the layout (<root>/CACHEDIR.TAG, <root>/<key>/ with its
artifacts and meta.json written last, <root>/.locks/<key>.lock), one compile per key under a file lock the OS
releases when its holder dies, broken entries removed and rebuilt by the lock holder, and what a directory that
cannot be written or used still does. Whom a directory, an entry or a file is trusted from is kerngen/trust.py's
to say (owner_problem, root_problem); this module applies it to everything it reads.
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import stat
import tempfile
import warnings
from contextlib import contextmanager
from pathlib import Path

import filelock

from . import env
from .errors import CacheError
from .trust import owner_problem, refusal, root_problem

log = logging.getLogger("kerngen.cache")
META = "meta.json"
LOCKS = ".locks"
MARKER = "CACHEDIR.TAG"   # https://bford.info/cachedir/: backup tools skip the directory too
MARKER_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
               "# A kerngen kernel cache. `kerngen cache verify|clear` only touch its key-shaped entries.\n")
# op-variant-tag-arch-hash12, e.g. finalize-small_batch-H3584-K16-bf16-wf32-sm_90a-1dc3cd5d6ff2
KEY = re.compile(r"[a-z][a-z0-9_]*-[a-z][a-z0-9_]*-[A-Za-z0-9_.-]+-sm_[0-9]+[a-z]?-[0-9a-f]{12}")
ARTIFACT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
SHA256 = re.compile(r"[0-9a-f]{64}")
FILE_MODE, DIR_MODE = 0o644, 0o755   # less the umask: readable by everyone, writable by the owner only
_warned: set[tuple[str, str]] = set()   # (root, kind) warned about in this process: each warning once


def is_key(name: str) -> bool:
    return KEY.fullmatch(name) is not None


def check_key(key: str) -> str:
    """A key names a directory under the root: anything else (a path, '..') is refused."""
    if not isinstance(key, str) or not is_key(key):
        raise CacheError(f"{key!r} is not a kernel cache key (op-variant-shape-arch-hash)")
    return key


class _Miss(Exception):
    """Why an entry is not served: absent, incomplete, corrupt, untrusted or unreadable, and the detail."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


def _read(path: Path) -> bytes:
    """A regular file's bytes; a symlink, a FIFO or a file another user could have written is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            raise _Miss("unreadable", f"{path.name}: {e.strerror}") from None
        raise _Miss("corrupt", f"{path.name} is a symbolic link" if e.errno == errno.ELOOP
                    else f"{path.name}: {e.strerror}") from None
    try:
        st = os.fstat(fd)   # before fdopen, which raises IsADirectoryError for a directory
        if not stat.S_ISREG(st.st_mode):
            raise _Miss("corrupt", f"{path.name} is a directory" if stat.S_ISDIR(st.st_mode)
                        else f"{path.name} is not a regular file")
        if (problem := owner_problem(st)) is not None:
            raise _Miss("untrusted", f"{path.name} {problem}")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read()
        except OSError as e:
            raise _Miss("corrupt", f"{path.name}: {e.strerror}") from None


def _checksums(meta, key: str, required: tuple[str, ...]) -> dict[str, str]:
    """meta.json's {artifact: sha256}: it names this key, at least one artifact and every required one."""
    if not isinstance(meta, dict) or meta.get("key") != key:
        raise _Miss("corrupt", "meta.json names another key")
    sums = meta.get("sha256")
    if not isinstance(sums, dict) or not sums:
        raise _Miss("corrupt", f"meta.json lists no artifact checksums (sha256 = {sums!r})")
    for name, digest in sums.items():
        if (not ARTIFACT_NAME.fullmatch(name) or name == META or not isinstance(digest, str)
                or not SHA256.fullmatch(digest)):
            raise _Miss("corrupt", f"meta.json has a malformed checksum {name!r}: {digest!r}")
    missing = [n for n in required if n not in sums]
    if missing:
        raise _Miss("corrupt", f"meta.json lists no {', '.join(missing)}")
    return sums


def _write(path: Path, data: bytes) -> None:
    """Write `path` atomically (temp file, fsync, rename), mode 0644 less the umask."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
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


def _mkdirs(path: Path) -> None:
    """mkdir -p giving every directory it makes mode 0755 less the umask (Path.mkdir leaves parents 0777)."""
    if path.is_dir():
        return
    if path.parent != path:
        _mkdirs(path.parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not path.is_dir():
            raise


def private_tmp() -> Path:
    """A scratch directory only this user can enter: $TMPDIR/kerngen-src-<uid> (0700), or a fresh mkdtemp when
    that name is taken by something else. Never $TMPDIR/kerngen, which would shadow the package there."""
    uid = os.geteuid()
    d = Path(tempfile.gettempdir()) / f"kerngen-src-{uid}"
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
        return d
    return Path(tempfile.mkdtemp(prefix=f"kerngen-src-{uid}-"))


class DiskCache:
    """One cache directory: get / put entries by key, and a lock per key (jit.build holds the contract)."""

    def __init__(self, root: Path | str, *, quiet: bool = False):
        self.root = Path(root)
        self.quiet = quiet                     # no warnings (warmup workers: their parent reports)
        self.writable = True                   # False after the first failed write: memory from then on
        self.write_error = ""                  # why writes stopped
        self.miss_reason: dict[str, str] = {}  # key -> why the last get() missed
        self._distrust: str | None = None
        self.refusal_reason = ""              # "unusable" or "untrusted" once distrust() found a problem
        self._trust_checked = False
        self._held: set[str] = set()           # keys whose lock this object holds

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
        if self.distrust():
            return self.write_error
        try:
            self._prepare_root()
            fd, scratch = tempfile.mkstemp(prefix=".write-probe.", dir=self.root)
            os.close(fd)
            os.unlink(scratch)
        except OSError as e:
            return e.strerror or str(e)
        return None

    def get(self, key: str, artifacts: tuple[str, ...] = ()) -> dict[str, bytes] | None:
        """The entry's files (`artifacts` among them), or None with the reason in miss_reason[key]: absent,
        building (another process holds its lock), incomplete, corrupt (both removed by the lock holder),
        untrusted or unreadable (both left in place)."""
        check_key(key)
        if self.distrust():
            return self._miss(key, self.refusal_reason)
        try:
            return self._load(key, artifacts)
        except _Miss as m:
            miss = m
        if miss.reason in ("incomplete", "corrupt"):
            return self._heal(key, miss, artifacts)
        if miss.reason in ("untrusted", "unreadable"):
            log.info("kerngen cache: entry %s is %s (%s)", key, miss.reason, miss.detail)
            self._warn(f"entry-{miss.reason}", self._refusal(key, miss))
        return self._miss(key, miss.reason)

    def check(self, key: str, artifacts: tuple[str, ...] = ()) -> str | None:
        """Why entry `key` would not be served, as "reason (detail)" (e.g. "corrupt (checksum mismatch in
        kernel.cubin)"), or None when its files match meta.json's checksums. Reads only: removes nothing."""
        check_key(key)
        if self.distrust():
            return self.refusal_reason
        try:
            self._load(key, artifacts)
        except _Miss as m:
            return f"{m.reason} ({m.detail})" if m.detail else m.reason
        return None

    def _refusal(self, key: str, miss: _Miss) -> str:
        if miss.reason == "untrusted":
            return (f"kerngen: cache entry {self.root / key} is not loaded: {miss.detail}, so it could be another "
                    "user's code. Its kernel is compiled in memory; the entry is left in place (others like it are "
                    "refused without a warning).")
        return (f"kerngen: cache entry {self.root / key} cannot be read ({miss.detail}); its kernel is compiled in "
                f"memory. A cache shared with other users needs files they can read: chmod -R a+rX {self.root}")

    def _entry(self, key: str) -> Path:
        """The entry's directory: a real directory that only this user or root could have written."""
        entry = self.root / key
        try:
            st = os.lstat(entry)
        except FileNotFoundError:
            raise _Miss("absent") from None
        except OSError as e:
            raise _Miss("unreadable", e.strerror) from None
        if not stat.S_ISDIR(st.st_mode):
            raise _Miss("corrupt", "a symbolic link, not a directory" if stat.S_ISLNK(st.st_mode)
                        else "not a directory")
        if (problem := owner_problem(st)) is not None:
            raise _Miss("untrusted", f"its directory {problem}")
        return entry

    def _load(self, key: str, artifacts: tuple[str, ...]) -> dict[str, bytes]:
        entry = self._entry(key)
        try:
            meta = json.loads(_read(entry / META))
        except FileNotFoundError:
            raise _Miss("incomplete", "no meta.json") from None
        except ValueError as e:
            raise _Miss("corrupt", f"meta.json is not JSON ({e})") from None
        files = {}
        for name, digest in _checksums(meta, key, artifacts).items():
            try:
                data = _read(entry / name)
            except FileNotFoundError:
                raise _Miss("corrupt", f"{name} is missing") from None
            if hashlib.sha256(data).hexdigest() != digest:
                raise _Miss("corrupt", f"checksum mismatch in {name}")
            files[name] = data
        return files

    def _heal(self, key: str, miss: _Miss, artifacts: tuple[str, ...]) -> dict[str, bytes] | None:
        """A broken entry is removed under its lock. While another process holds the lock it is being built:
        a quiet miss (the caller waits for that lock)."""
        if key in self._held:
            return self._discard(key, miss)
        lk = self._try_lock(key)
        if lk is None:
            log.debug("kerngen cache: entry %s is being built by another process", key)
            return self._miss(key, "building")
        if lk is False:   # no lock to be had here (read-only, not yet marked): leave it, build in memory
            log.warning("kerngen cache: entry %s is %s (%s); left in place (its lock cannot be taken here)", key,
                        miss.reason, miss.detail)
            return self._miss(key, miss.reason)
        try:
            try:
                return self._load(key, artifacts)   # finished by its builder just before we locked
            except _Miss as again:
                if again.reason not in ("incomplete", "corrupt"):
                    return self._miss(key, again.reason)
                return self._discard(key, again)
        finally:
            lk.release()

    def _discard(self, key: str, miss: _Miss) -> None:
        removed = self.remove(key)
        log.warning("kerngen cache: entry %s is %s (%s); %s", key, miss.reason, miss.detail,
                    "removed" if removed else "left in place")
        return self._miss(key, miss.reason)

    def _miss(self, key: str, reason: str) -> None:
        self.miss_reason[key] = reason
        return None

    def meta(self, key: str) -> dict | None:
        """The entry's meta.json, if it is there and may be read."""
        try:
            meta = json.loads(_read(self._entry(check_key(key)) / META))
        except (OSError, ValueError, _Miss):
            return None
        return meta if isinstance(meta, dict) else None

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
        return (self.root / MARKER).is_file()

    # ----------------------------------------------------------------- write
    def put(self, key: str, files: dict[str, bytes], meta: dict) -> bool:
        """Store artifact `files` (checksummed), meta.json last. False when nothing was stored: the directory is
        not written to (write_error says why) or the name is taken."""
        check_key(key)
        if not self.writable or self.distrust():
            return False
        try:
            self._prepare_root()
            entry = self._entry_dir(key)
            if entry is None:
                return False
            for name, data in files.items():
                _write(entry / name, data)
            meta = {**meta, "key": key, "sha256": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}}
            _write(entry / META, json.dumps(meta, indent=1, sort_keys=True).encode())
            return True
        except OSError as e:
            self._stop_writing(e)
            if key in self._held:
                self.remove(key)   # no partial entry left to fill the disk
            return False

    def source_path(self, key: str, name: str, text: str) -> str:
        """Write a rendered source beside its entry (or into a private temp dir) so errors can point at it."""
        check_key(key)
        if self.writable and not self.distrust():
            try:
                self._prepare_root()
                entry = self._entry_dir(key)
                if entry is not None:
                    _write(entry / name, text.encode())
                    return str(entry / name)
            except OSError as e:
                self._stop_writing(e)
                if key in self._held:
                    self.remove(key)
        try:
            base = private_tmp() / key
            base.mkdir(exist_ok=True)
            _write(base / name, text.encode())
            return str(base / name)
        except OSError:
            return "(could not be written)"

    def remove(self, key: str) -> bool:
        """Delete entry `key` (a directory, or whatever broken thing sits at its name): only under a marked root,
        and only if this user owns it (another user's entry is never removed)."""
        path = self.root / check_key(key)
        if not self.is_marked():
            log.warning("kerngen cache: %s has no %s marker, so %s is left in place", self.root, MARKER, key)
            return False
        try:
            st = os.lstat(path)
            if st.st_uid != os.geteuid():
                log.warning("kerngen cache: %s belongs to uid %d; left in place", path, st.st_uid)
                return False
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(path)
            else:
                path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("kerngen cache: could not remove %s (%s)", path, e.strerror or e)
            return False
        return True

    @contextmanager
    def lock(self, key: str, timeout: float | None = None):
        """Exclusive per-key lock across processes (it creates and marks the root). A no-op where this
        directory is not written to: each process then compiles the kernel in memory."""
        check_key(key)
        lk = self._acquire(key, env.lock_timeout() if timeout is None else timeout)
        if lk is not None:
            self._held.add(key)
        try:
            yield
        finally:
            if lk is not None:
                self._held.discard(key)
                lk.release()

    # --------------------------------------------------------------- helpers
    def _acquire(self, key: str, timeout: float):
        if not self.writable or self.distrust():
            return None
        path = self.root / LOCKS / f"{key}.lock"
        try:
            self._prepare_root()
            _mkdirs(path.parent)
            lk = filelock.FileLock(str(path), timeout=timeout, mode=FILE_MODE)
            lk.acquire()
        except filelock.Timeout:   # before OSError: Timeout is a TimeoutError
            raise CacheError(f"kernel {key}: waited {timeout:g}s for its lock {path}, which another process holds "
                             f"(compiling it, or stuck). Retry, find the holder (fuser {path}), or raise "
                             f"KERNGEN_LOCK_TIMEOUT (now {timeout:g} seconds)") from None
        except OSError as e:
            self._stop_writing(e)
            return None
        return lk

    def _try_lock(self, key: str):
        """The key's lock if it is free now; None if another process holds it; False if it cannot be taken here
        (the root is not marked as kerngen's, or not writable)."""
        path = self.root / LOCKS / f"{key}.lock"
        if not self.writable or not self.is_marked():
            return False
        lk = filelock.FileLock(str(path), timeout=0, mode=FILE_MODE)
        try:
            _mkdirs(path.parent)   # a marked root is kerngen's to write in
            lk.acquire()
        except filelock.Timeout:
            return None
        except OSError:
            return False
        return lk

    def _prepare_root(self) -> None:
        """Create the root and its marker before the first lock or entry (raises OSError)."""
        _mkdirs(self.root)
        if not self.is_marked():
            _write(self.root / MARKER, MARKER_TEXT.encode())

    def _entry_dir(self, key: str) -> Path | None:
        """The entry's directory, made if need be. A file or symlink at its name is replaced by the lock holder;
        a directory holding anything of another user's is left alone (None: the entry is not stored)."""
        entry = self.root / key
        try:
            os.mkdir(entry, DIR_MODE)
            return entry
        except FileExistsError:
            pass
        st, uid = os.lstat(entry), os.geteuid()
        if (stat.S_ISDIR(st.st_mode) and st.st_uid == uid and owner_problem(st) is None
                and all(p.lstat().st_uid == uid for p in entry.iterdir())):
            return entry
        if not stat.S_ISDIR(st.st_mode) and key in self._held and self.remove(key):
            os.mkdir(entry, DIR_MODE)
            return entry
        log.warning("kerngen cache: %s is not a directory of yours; kernel %s is not stored", entry, key)
        return None

    def _stop_writing(self, err: OSError) -> None:
        """A write failed: from now on serve what the directory holds and compile the rest in memory."""
        self.writable, self.write_error = False, err.strerror or str(err)
        self._warn("write", f"kerngen: cache directory {self.root} is not writable ({self.write_error}); the "
                   "kernels it holds are still used, the others are compiled in memory for this process only. Set "
                   "KERNGEN_CACHE_DIR to a writable directory to keep them.")

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
