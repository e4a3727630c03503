"""Who may have written a kernel cache: the trust policy the store (kerngen/cache.py) applies to the cache
directory, the directories above it, each entry and each file before anything in them is loaded.

An entry is code that runs in the process, so it is trusted as ssh trusts ~/.ssh: owned by this user or root
and writable by no one else (a sticky parent such as /tmp, and a group that holds its owner alone, are fine).
A cache directory that is a file, or lies below one, cannot be used at all. docs/cache.md states the policy.
"""
from __future__ import annotations

import grp
import os
import pwd
import stat
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=64)
def _private_group(gid: int, uid: int) -> bool:
    """Whether `gid` is the user private group of `uid` (its own name, no other members), as a umask of 002
    leaves behind: its write bit lets no one else in (the exception Debian's OpenSSH makes too)."""
    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(uid)
    except KeyError:
        return False
    return user.pw_gid == gid and group.gr_name == user.pw_name and set(group.gr_mem) <= {user.pw_name}


def owner_problem(st: os.stat_result) -> str | None:
    """Why a file or directory with this status could hold another user's code, or None."""
    uid = os.geteuid()
    if st.st_uid not in (uid, 0):
        return f"is owned by uid {st.st_uid}, not by you or root"
    if st.st_mode & stat.S_IWOTH:
        return "is writable by everyone"
    if st.st_mode & stat.S_IWGRP and not _private_group(st.st_gid, st.st_uid):
        return f"is writable by its group (gid {st.st_gid})"
    return None


def path_problem(root: Path) -> str | None:
    """Why entries under `root` could have been put there by another user: the root, or a directory above it,
    is theirs or writable by them. A sticky parent (e.g. /tmp) lets no one replace what is yours in it."""
    try:
        path = root.resolve()
    except (OSError, RuntimeError) as e:
        return f"{root} cannot be resolved ({e})"
    for p in (path, *path.parents):
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue   # made by this process, 0755
        except OSError as e:
            return f"{p} cannot be examined ({e.strerror})"
        problem = owner_problem(st)
        sticky_parent = p != path and st.st_mode & stat.S_ISVTX and st.st_uid in (os.geteuid(), 0)
        if problem and not sticky_parent:
            return f"{p} {problem}"
    return None


def not_a_directory(root: Path) -> str | None:
    """Why `root` cannot be a cache directory because it, or a directory above it, exists and is not a
    directory (a file), or None. A cache directory that is a file and one below a file are the same mistake."""
    path = Path(os.path.abspath(root))
    for p in (path, *path.parents):
        try:
            st = os.stat(p)
        except (FileNotFoundError, NotADirectoryError):
            continue   # not there (made on first write), or below a file: the file is found further up
        except OSError:
            return None   # path_problem says why it cannot be examined
        if not stat.S_ISDIR(st.st_mode):
            return f"{p} is not a directory"
    return None


def root_problem(root: Path) -> tuple[str, str] | None:
    """Why the directory `root` is not used at all, as (reason, detail): "unusable" (it or a directory above
    it is a file) or "untrusted" (path_problem), or None."""
    if (problem := not_a_directory(root)) is not None:
        return "unusable", problem
    if (problem := path_problem(root)) is not None:
        return "untrusted", problem
    return None


def refusal(root: Path, reason: str, detail: str) -> str:
    """The one message for a cache directory that is not used (reason and detail from root_problem)."""
    if reason == "unusable":
        return (f"cache directory {root} cannot be used: {detail}. Set KERNGEN_CACHE_DIR to a directory (it is "
                "created if missing)")
    return (f"cache directory {root} is not used: {detail}, so its entries could be another user's code. Use a "
            "directory owned by you (or root) that only its owner can write (chmod go-w), or set "
            "KERNGEN_CACHE_DIR to one")
