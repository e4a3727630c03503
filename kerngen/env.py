"""Every environment variable kerngen reads is read here, and nowhere else; docs/environment.md lists them
with their meaning and default. A value that cannot be used raises EnvError naming the variable.
"""
from __future__ import annotations

import math
import os
import re
from functools import lru_cache
from pathlib import Path

from .errors import EnvError, InputError

ARCH = re.compile(r"sm_[0-9]{2,3}[af]?")   # the form of an exact target: sm_90a, sm_100a, sm_120
# The targets kerngen's kernels are written for (README, "Supported hardware"): they use thread-block clusters
# and the arch-specific ("a") feature sets of these two. `kerngen warmup` / `explain` refuse any other target
# before anything is compiled.
SUPPORTED = {"sm_90a": "H100, H200", "sm_100a": "B200, GB200"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")

PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent   # a source checkout keeps tiers.toml, templates/ and cache/ beside the package


@lru_cache(maxsize=1)
def _in_checkout() -> bool:
    # asked once a process: a checkout does not become an installed copy (or back) while kerngen runs
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


def _optional_flag(name: str) -> bool | None:
    """_flag, or None where the variable is unset or empty (the caller's own default)."""
    if not os.environ.get(name, "").strip():
        return None
    return _flag(name)


def check_arch(text: str, where: str) -> str:
    """`text` as a compile target (e.g. sm_90a); `where` names its source in the error (a variable, a flag)."""
    if not ARCH.fullmatch(text):
        expected = f"an exact GPU target: {supported_list()}"
        if where.startswith("KERNGEN_"):
            raise EnvError(where, expected, text)
        raise InputError("command line", where, expected, repr(text))
    return text


def supported_list() -> str:
    return ", ".join(f"{a} ({gpus})" for a, gpus in SUPPORTED.items())


def check_supported(arch: str, where: str) -> str:
    """`arch` (already of the form ARCH) if kerngen can build its kernels for it; else an error naming `where`
    (a variable or a flag) and the supported targets."""
    if arch in SUPPORTED:
        return arch
    expected = f"a target kerngen builds for: {supported_list()}"
    hint = (f"did you mean {arch}a?" if f"{arch}a" in SUPPORTED
            else "kerngen's kernels use features of those targets that this one lacks")
    if where.startswith("KERNGEN_"):
        raise EnvError(where, f"{expected} ({hint})", arch)
    raise InputError("command line", where, expected, f"{arch!r} ({hint})")


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


def eager_graphs() -> bool | None:
    """KERNGEN_EAGER_GRAPHS: eager calls of kerngen.experts replay repeated launch sequences from CUDA graphs:
    True at every token count, False never, None (unset or empty) at decode token counts only (the op's own
    bound, kerngen.ops.experts.EAGER_GRAPH_TOKENS)."""
    return _optional_flag("KERNGEN_EAGER_GRAPHS")


def block_graphs() -> bool | None:
    """KERNGEN_BLOCK_GRAPHS: transformers MoE blocks that kerngen.integrations.transformers enabled replay their
    eager inference forwards from CUDA graphs: True at every token count, False never, None (unset or empty) at
    decode token counts only (kerngen.integrations.transformers_graphs.GRAPH_TOKENS)."""
    return _optional_flag("KERNGEN_BLOCK_GRAPHS")


def racecheck() -> bool:
    """Build the routing kernels for compute-sanitizer's racecheck (their idle token groups meet their barriers)."""
    return _flag("KERNGEN_RACECHECK")


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
