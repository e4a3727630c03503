"""Every environment variable kerngen reads, in one place (the README's table mirrors this).

| variable              | meaning                                                         | default |
|-----------------------|-----------------------------------------------------------------|---------|
| KERNGEN_CACHE_DIR     | kernel cache directory (owned by you or root, writable by its owner only: see cache.py) | `<checkout>/cache` in a source checkout, else `$XDG_CACHE_HOME/kerngen` (`~/.cache/kerngen`) |
| KERNGEN_TIERS         | user tiers file layered over the shipped `tiers.toml`           | unset |
| KERNGEN_STRICT        | `1`/`true`/`yes`/`on`: a cache miss raises instead of compiling (serving); `0`/`false`/`no`/`off` | `0` |
| KERNGEN_ARCH          | compile target when no GPU is visible: `sm_<major><minor>`, `a` or `f` optional, e.g. `sm_90a` | `sm_90a` |
| KERNGEN_LOCK_TIMEOUT  | seconds (a number >= 0) to wait for another process compiling the same kernel | `900` |
| CUDA_HOME, CUDA_PATH  | a CUDA toolkit whose headers NVRTC uses when no nvidia-cuda-runtime wheel is installed | `/usr/local/cuda` |

A value that cannot be used raises EnvError naming the variable.
"""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

from .errors import EnvError, InputError

ARCH = re.compile(r"sm_[0-9]{2,3}[af]?")   # an exact target: sm_90a, sm_100a, sm_120
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent   # a source checkout keeps tiers.toml, templates/ and cache/ beside the package


def _in_checkout() -> bool:
    return all((CHECKOUT / name).exists() for name in ("pyproject.toml", "tiers.toml", "templates"))


def data_root() -> Path:
    """Where the shipped tiers.toml and templates/ are: the checkout's own, else the installed copy in the
    package (kerngen/data/, put there by the wheel)."""
    return CHECKOUT if _in_checkout() else PACKAGE / "data"


def _flag(name: str) -> bool:
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value not in _TRUE + _FALSE:
        raise EnvError(name, f"one of {', '.join(_TRUE)} (on) or {', '.join(_FALSE[1:])} (off)", raw)
    return value in _TRUE


def check_arch(text: str, where: str) -> str:
    """`text` as a compile target (e.g. sm_90a); `where` names its source in the error (a variable, a flag)."""
    if not ARCH.fullmatch(text):
        expected = "an exact GPU target like sm_90a (H100/H200), sm_100a (B200) or sm_120a"
        if where.startswith("KERNGEN_"):
            raise EnvError(where, expected, text)
        raise InputError("command line", where, expected, repr(text))
    return text


def cache_dir() -> Path:
    explicit = os.environ.get("KERNGEN_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    if _in_checkout() and (CHECKOUT / "cache").is_dir():
        return CHECKOUT / "cache"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kerngen"


def user_tiers() -> Path | None:
    path = os.environ.get("KERNGEN_TIERS")
    return Path(path).expanduser() if path else None


def strict() -> bool:
    return _flag("KERNGEN_STRICT")


def default_arch() -> str:
    return check_arch(os.environ.get("KERNGEN_ARCH", "sm_90a").strip(), "KERNGEN_ARCH")


def lock_timeout() -> float:
    raw = os.environ.get("KERNGEN_LOCK_TIMEOUT", "900")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not 0 <= seconds < math.inf:
        raise EnvError("KERNGEN_LOCK_TIMEOUT", "a number of seconds >= 0, e.g. 900", raw)
    return seconds


def cuda_homes() -> list[str]:
    """CUDA toolkits to take headers from, in order of preference (after the nvidia-* wheels)."""
    return [h for h in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda") if h]


def shipped_tiers() -> Path:
    return data_root() / "tiers.toml"


def templates_dir() -> Path:
    return data_root() / "templates"
