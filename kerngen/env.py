"""Every environment variable kerngen reads, in one place (the README's table mirrors this).

| variable              | meaning                                                         | default |
|-----------------------|-----------------------------------------------------------------|---------|
| KERNGEN_CACHE_DIR     | kernel cache directory                                          | `<checkout>/cache` in a source checkout, else `$XDG_CACHE_HOME/kerngen` (`~/.cache/kerngen`) |
| KERNGEN_TIERS         | user tiers file layered over the shipped `tiers.toml`           | unset |
| KERNGEN_STRICT        | `1`: a cache miss raises instead of compiling (serving)         | `0` |
| KERNGEN_ARCH          | compile target when no GPU is visible, e.g. `sm_90a`            | `sm_90a` |
| KERNGEN_LOCK_TIMEOUT  | seconds to wait for another process compiling the same kernel   | `900` |
"""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
CHECKOUT = PACKAGE.parent   # a source checkout keeps tiers.toml, templates/ and cache/ beside the package


def _in_checkout() -> bool:
    return all((CHECKOUT / name).exists() for name in ("pyproject.toml", "tiers.toml", "templates"))


def data_root() -> Path:
    """Where the shipped tiers.toml and templates/ are: the checkout's own, else the installed copy in the
    package (kerngen/data/, put there by the wheel)."""
    return CHECKOUT if _in_checkout() else PACKAGE / "data"


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


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
    return os.environ.get("KERNGEN_ARCH", "sm_90a")


def lock_timeout() -> float:
    return float(os.environ.get("KERNGEN_LOCK_TIMEOUT", "900"))


def shipped_tiers() -> Path:
    return data_root() / "tiers.toml"


def templates_dir() -> Path:
    return data_root() / "templates"
