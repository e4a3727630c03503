"""The files of the kernel cache (docs/cache.md): an entry <root>/<key>/ holds its artifacts and meta.json, written
last with a sha256 of each; <root>/CACHEDIR.TAG marks the root as kerngen's.

Reading serves an entry only from a real directory and regular files that this user or root could have written
(kerngen/trust.py's owner_problem) and that match meta.json's checksums; anything else is a Miss with its reason.
Every file is written atomically (temp file, fsync, rename), 0644 / 0755 less the umask. When each of these runs,
under which lock and what a failure means is the store's (kerngen/cache.py, DiskCache) to decide.
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
from pathlib import Path

from .trust import owner_problem

log = logging.getLogger("kerngen.cache")
META = "meta.json"
MARKER = "CACHEDIR.TAG"   # https://bford.info/cachedir/: backup tools skip the directory too
MARKER_TEXT = ("Signature: 8a477f597d28d172789f06886806bc55\n"
               "# A kerngen kernel cache. `kerngen cache verify|clear` only touch its key-shaped entries.\n")
ARTIFACT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
SHA256 = re.compile(r"[0-9a-f]{64}")
FILE_MODE, DIR_MODE = 0o644, 0o755   # less the umask: readable by everyone, writable by the owner only
BROKEN = ("incomplete", "corrupt")   # misses the lock holder removes and rebuilds (others are left in place)


class Miss(Exception):
    """Why an entry is not served: absent, incomplete, corrupt, untrusted or unreadable, and the detail."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(detail)
        self.reason, self.detail = reason, detail


# ---------------------------------------------------------------------- read
def read_file(path: Path) -> bytes:
    """A regular file's bytes; a symlink, a FIFO or a file another user could have written is refused."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM):
            raise Miss("unreadable", f"{path.name}: {e.strerror}") from None
        raise Miss("corrupt", f"{path.name} is a symbolic link" if e.errno == errno.ELOOP
                   else f"{path.name}: {e.strerror}") from None
    try:
        st = os.fstat(fd)   # before fdopen, which raises IsADirectoryError for a directory
        if not stat.S_ISREG(st.st_mode):
            raise Miss("corrupt", f"{path.name} is a directory" if stat.S_ISDIR(st.st_mode)
                       else f"{path.name} is not a regular file")
        if (problem := owner_problem(st)) is not None:
            raise Miss("untrusted", f"{path.name} {problem}")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read()
        except OSError as e:
            raise Miss("corrupt", f"{path.name}: {e.strerror}") from None


def checksums(meta, key: str, required: tuple[str, ...]) -> dict[str, str]:
    """meta.json's {artifact: sha256}: it names this key, at least one artifact and every required one."""
    if not isinstance(meta, dict) or meta.get("key") != key:
        raise Miss("corrupt", "meta.json names another key")
    sums = meta.get("sha256")
    if not isinstance(sums, dict) or not sums:
        raise Miss("corrupt", f"meta.json lists no artifact checksums (sha256 = {sums!r})")
    for name, digest in sums.items():
        if (not ARTIFACT_NAME.fullmatch(name) or name == META or not isinstance(digest, str)
                or not SHA256.fullmatch(digest)):
            raise Miss("corrupt", f"meta.json has a malformed checksum {name!r}: {digest!r}")
    missing = [n for n in required if n not in sums]
    if missing:
        raise Miss("corrupt", f"meta.json lists no {', '.join(missing)}")
    return sums


def entry_dir(root: Path, key: str) -> Path:
    """The entry's directory: a real directory that only this user or root could have written."""
    entry = root / key
    try:
        st = os.lstat(entry)
    except FileNotFoundError:
        raise Miss("absent") from None
    except OSError as e:
        raise Miss("unreadable", e.strerror) from None
    if not stat.S_ISDIR(st.st_mode):
        raise Miss("corrupt", "a symbolic link, not a directory" if stat.S_ISLNK(st.st_mode)
                   else "not a directory")
    if (problem := owner_problem(st)) is not None:
        raise Miss("untrusted", f"its directory {problem}")
    return entry


def load(root: Path, key: str, artifacts: tuple[str, ...]) -> dict[str, bytes]:
    """The entry's files, each matching its checksum in meta.json (`artifacts` among them), or a Miss."""
    entry = entry_dir(root, key)
    try:
        meta = json.loads(read_file(entry / META))
    except FileNotFoundError:
        raise Miss("incomplete", "no meta.json") from None
    except ValueError as e:
        raise Miss("corrupt", f"meta.json is not JSON ({e})") from None
    files = {}
    for name, digest in checksums(meta, key, artifacts).items():
        try:
            data = read_file(entry / name)
        except FileNotFoundError:
            raise Miss("corrupt", f"{name} is missing") from None
        if hashlib.sha256(data).hexdigest() != digest:
            raise Miss("corrupt", f"checksum mismatch in {name}")
        files[name] = data
    return files


def read_meta(root: Path, key: str) -> dict | None:
    """The entry's meta.json, if it is there and may be read."""
    try:
        meta = json.loads(read_file(entry_dir(root, key) / META))
    except (OSError, ValueError, Miss):
        return None
    return meta if isinstance(meta, dict) else None


def entry_refusal(root: Path, key: str, miss: Miss) -> str:
    """The one warning for an entry that is left in place unread (untrusted or unreadable)."""
    if miss.reason == "untrusted":
        return (f"kerngen: cache entry {root / key} is not loaded: {miss.detail}, so it could be another "
                "user's code. Its kernel is compiled in memory; the entry is left in place (others like it are "
                "refused without a warning).")
    return (f"kerngen: cache entry {root / key} cannot be read ({miss.detail}); its kernel is compiled in "
            f"memory. A cache shared with other users needs files they can read: chmod -R a+rX {root}")


def is_marked(root: Path) -> bool:
    """Whether the root carries kerngen's marker file (only then is anything in it ever removed)."""
    return (root / MARKER).is_file()


# --------------------------------------------------------------------- write
def write_file(path: Path, data: bytes) -> None:
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


def mkdirs(path: Path) -> None:
    """mkdir -p giving every directory it makes mode 0755 less the umask (Path.mkdir leaves parents 0777)."""
    if path.is_dir():
        return
    if path.parent != path:
        mkdirs(path.parent)
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        if not path.is_dir():
            raise


def prepare_root(root: Path) -> None:
    """Create the root and its marker before the first lock or entry (raises OSError)."""
    mkdirs(root)
    if not is_marked(root):
        write_file(root / MARKER, MARKER_TEXT.encode())


def write_problem(root: Path) -> str | None:
    """Why nothing can be stored under `root`, found by creating it (and its marker) and a scratch file in it, or
    None."""
    try:
        prepare_root(root)
        fd, scratch = tempfile.mkstemp(prefix=".write-probe.", dir=root)
        os.close(fd)
        os.unlink(scratch)
    except OSError as e:
        return e.strerror or str(e)
    return None


def own_entry_dir(root: Path, key: str, held: bool) -> Path | None:
    """The entry's directory, made if need be. A file or symlink at its name is replaced by the lock holder (`held`);
    a directory holding anything of another user's is left alone (None: the entry is not stored)."""
    entry = root / key
    try:
        os.mkdir(entry, DIR_MODE)
        return entry
    except FileExistsError:
        pass
    st, uid = os.lstat(entry), os.geteuid()
    if (stat.S_ISDIR(st.st_mode) and st.st_uid == uid and owner_problem(st) is None
            and all(p.lstat().st_uid == uid for p in entry.iterdir())):
        return entry
    if not stat.S_ISDIR(st.st_mode) and held and remove_entry(root, key):
        os.mkdir(entry, DIR_MODE)
        return entry
    log.warning("kerngen cache: %s is not a directory of yours; kernel %s is not stored", entry, key)
    return None


def write_entry(root: Path, key: str, files: dict[str, bytes], meta: dict | None = None, *,
                held: bool = False) -> Path | None:
    """Write `files` into the entry (the root, its marker and the entry's directory made if need be), then, given
    `meta`, meta.json with their checksums, last. The entry's directory, or None when its name is taken (see
    own_entry_dir); raises OSError."""
    prepare_root(root)
    entry = own_entry_dir(root, key, held)
    if entry is None:
        return None
    for name, data in files.items():
        write_file(entry / name, data)
    if meta is not None:
        meta = {**meta, "key": key, "sha256": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}}
        write_file(entry / META, json.dumps(meta, indent=1, sort_keys=True).encode())
    return entry


def remove_entry(root: Path, key: str) -> bool:
    """Delete entry `key` (a directory, or whatever broken thing sits at its name): only under a marked root,
    and only if this user owns it (another user's entry is never removed)."""
    path = root / key
    if not is_marked(root):
        log.warning("kerngen cache: %s has no %s marker, so %s is left in place", root, MARKER, key)
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


# ------------------------------------------------------------ private scratch
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


def private_source(key: str, name: str, text: str) -> str:
    """Write a rendered source into this user's private temp dir (when the cache cannot take it); its path."""
    try:
        base = private_tmp() / key
        base.mkdir(exist_ok=True)
        write_file(base / name, text.encode())
        return str(base / name)
    except OSError:
        return "(could not be written)"
