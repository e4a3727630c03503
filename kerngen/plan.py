"""Shape → tier rule → KernelSpec: the complete description of one kernel to build.

A spec is a hashable value; the cache key adds what the spec renders to and the toolchain that builds it.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from . import env, ops
from .env import ARCH
from .errors import InputError, TierError
from .tiers import BACKENDS, NAME, SCHEMA, Rule, Table, check_rule

TAG = re.compile(r"[A-Za-z0-9_.-]+")

VERSION = "0.1.0"


@dataclass(frozen=True)
class KernelSpec:
    op: str                                   # routing | permute | finalize | tail | experts | latent_tail
    variant: str                              # template file name under templates/<op>/
    backend: str                              # "nvrtc" (CUDA C++ .cu.j2) or "cute" (CuTe DSL .py)
    tag: str                                  # readable part of the key, e.g. "H3584-K16-bf16-wf32"
    constants: tuple[tuple[str, Any], ...]    # compile-time shape and dtype constants
    params: tuple[tuple[str, Any], ...]       # launch parameters from the tier rule
    arch: str                                 # exact target, e.g. "sm_90a"

    def __post_init__(self):
        # the key built from these names a directory and the template a file: names only, never paths
        for field_, pattern, what in (("op", NAME, "a name"), ("variant", NAME, "a name"),
                                      ("tag", TAG, "letters, digits, '_', '.', '-'"), ("arch", ARCH, "like sm_90a")):
            value = getattr(self, field_)
            if not isinstance(value, str) or not pattern.fullmatch(value):
                raise InputError("kernel spec", field_, what, repr(value))
        if self.backend not in BACKENDS:
            raise InputError("kernel spec", "backend", " or ".join(BACKENDS), repr(self.backend))

    @property
    def template(self) -> str:
        return f"{self.op}/{self.variant}{BACKENDS[self.backend].template}"

    def values(self) -> dict[str, Any]:
        return {**dict(self.constants), **dict(self.params), "ARCH": self.arch}

    def key(self, source: str, toolchain: dict[str, str]) -> str:
        """Readable prefix + hash of everything that can change the artifact (never a timestamp)."""
        blob = json.dumps({"source": source, "spec": [self.op, self.variant, self.backend, self.constants,
                                                      self.params, self.arch],
                           "toolchain": toolchain, "kerngen": VERSION, "schema": SCHEMA},
                          sort_keys=True, default=str)
        digest = hashlib.sha256(blob.encode()).hexdigest()[:12]
        return f"{self.op}-{self.variant}-{self.tag}-{self.arch}-{digest}"


    def to_json(self) -> str:
        return json.dumps({"op": self.op, "variant": self.variant, "backend": self.backend, "tag": self.tag,
                           "constants": dict(self.constants), "params": dict(self.params), "arch": self.arch},
                          sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "KernelSpec":
        """The spec `to_json` wrote (e.g. in a strict-mode miss); its variant must be one that exists."""
        try:
            d = json.loads(text)
            spec = KernelSpec(op=d["op"], variant=d["variant"], backend=d["backend"], tag=d["tag"],
                              constants=tuple(sorted(d["constants"].items())),
                              params=tuple(sorted(d["params"].items())), arch=d["arch"])
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise InputError("kernel spec", "JSON", "the object a strict-mode miss prints (op, variant, backend, "
                             "tag, constants, params, arch)", f"{text[:200]!r} ({type(e).__name__}: {e})") from None
        # a rule param an op builds into a constant (experts: tile, the TILE constant) counts as given
        schema = ops.params(spec.op, spec.variant) or {}
        folded = {k: d["constants"][k.upper()] for k, p in schema.items()
                  if p.required and k not in d["params"] and k.upper() in d["constants"]}
        try:
            check_rule("kernel spec", spec.op, spec.variant, {**dict(spec.params), **folded, "backend": spec.backend})
        except TierError as e:
            raise InputError("kernel spec", "variant and params", "those of a variant that exists", str(e)) from None
        return spec


def spec_for(rule: Rule, tag: str, constants: dict[str, Any], arch: str) -> KernelSpec:
    backend = str(rule.params.get("backend", "nvrtc"))
    params = tuple(sorted((k, v) for k, v in rule.params.items() if k != "backend"))
    return KernelSpec(op=rule.op, variant=rule.variant, backend=backend, tag=tag,
                      constants=tuple(sorted(constants.items())), params=params, arch=arch)


def plan(table: Table, op: str, shape: dict[str, int], tag: str, constants: dict[str, Any],
         arch: str | None = None) -> KernelSpec:
    arch = arch or target_arch()
    return spec_for(table.rule(op, {**shape, "arch": arch, **visible_sm_count(arch)}), tag, constants, arch)


def visible_sm_count(arch: str, device: int | None = None) -> dict:
    """{"sm_count": n} of the visible GPU (`device`, else the current one) when the target is its arch (for
    rules with an sm_count range), else {}."""
    import torch
    if not torch.cuda.is_available():
        return {}
    index = torch.cuda.current_device() if device is None or device < 0 else device
    if _arch_of_device(index) != arch:
        return {}
    return {"sm_count": sm_count(index)}


@lru_cache(maxsize=None)
def sm_count(device: int) -> int:
    """The streaming multiprocessors of CUDA device `device`: the one place kerngen asks the driver (persistent
    grids and sm_count tier ranges read it here). Without a GPU, tiers.SMS stands in."""
    import torch
    return torch.cuda.get_device_properties(device).multi_processor_count


@lru_cache(maxsize=None)
def _arch_of_device(index: int) -> str:
    import torch
    major, minor = torch.cuda.get_device_capability(index)
    suffix = "a" if major >= 9 else ""  # arch-specific features (sm_90a, sm_100a); the cubin runs on that CC only
    return f"sm_{major}{minor}{suffix}"


def target_arch(device_index: int | None = None) -> str:
    """The GPU's own arch when one is visible, else KERNGEN_ARCH (default sm_90a)."""
    import torch
    if torch.cuda.is_available():
        return _arch_of_device(torch.cuda.current_device() if device_index is None else device_index)
    return env.default_arch()
