"""Parse and validate tier tables (schema v1) and answer: which rule serves this shape?

A table has `schema = 1`, `[models.NAME]` entries and `[[tier]]` rules (see the comments in tiers.toml).
A user file is layered over the shipped one: its models replace or add models by name, and its rules are
tried before the shipped rules.
"""
from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from . import env
from .errors import TierError

SCHEMA = 1
OPS = ("routing", "finalize", "tail", "permute", "tail_tp")
METHODS = ("softmax_topk", "topk_softmax", "sigmoid_bias", "grouped_sigmoid_bias", "top1_sigmoid")
DTYPES = ("bfloat16", "float16")
ROUTER_WEIGHT = ("output", "input")
RANGE_KEYS = ("num_experts", "top_k", "hidden", "tokens", "world_size")
MAX_EXPERTS, MAX_TOPK = 2048, 32


@dataclass(frozen=True)
class Model:
    name: str
    num_experts: int
    top_k: int
    hidden: int
    routing: str
    tokens: tuple[int, int]
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    renormalize: bool = True
    dtype: str = "bfloat16"
    weights_dtype: str = "float32"
    tile: int = 128
    router_weight: str = "output"   # "input": the expert's input is scaled by w (Llama-4), outputs summed as is
    source: str = ""

    @property
    def weight_on_input(self) -> bool:
        return self.router_weight == "input"


@dataclass(frozen=True)
class Rule:
    op: str
    variant: str
    ranges: dict[str, tuple[int, int]]
    params: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    def matches(self, shape: dict[str, int]) -> bool:
        return all(lo <= shape[k] <= hi for k, (lo, hi) in self.ranges.items() if k in shape)

    def overlaps(self, shape: dict[str, int], tokens: tuple[int, int]) -> bool:
        """Could this rule serve `shape` for some token count in `tokens`?"""
        lo, hi = self.ranges.get("tokens", (tokens[0], tokens[1]))
        fixed = {k: v for k, v in shape.items() if k != "tokens"}
        return self.matches(fixed) and lo <= tokens[1] and tokens[0] <= hi


@dataclass(frozen=True)
class Table:
    models: dict[str, Model]
    rules: tuple[Rule, ...]
    files: tuple[str, ...]

    def model(self, name: str) -> Model:
        if name not in self.models:
            known = ", ".join(sorted(self.models))
            raise TierError(f"unknown model '{name}'; known models: {known}. Add it as [models.{name}] to tiers.toml "
                            "or to a file named by KERNGEN_TIERS")
        return self.models[name]

    def rule(self, op: str, shape: dict[str, int]) -> Rule:
        for r in self.rules:
            if r.op == op and r.matches(shape):
                return r
        desc = " ".join(f"{k}={v}" for k, v in shape.items())
        raise TierError(f"no tier matches {op} {desc}; add a [[tier]] rule with op = \"{op}\" to tiers.toml "
                        "or to a file named by KERNGEN_TIERS")

    def rules_for(self, op: str, shape: dict[str, int], tokens: tuple[int, int]) -> list[Rule]:
        """The distinct rules that serve `op` at `shape` over a token range, in the order dispatch tries them."""
        out: list[Rule] = []
        for t_lo, t_hi in _token_pieces(self.rules, op, tokens):
            r = self.rule(op, {**shape, "tokens": t_lo})
            if r not in out:
                out.append(r)
        return out


def _token_pieces(rules, op, tokens):
    """Split a token range at every rule boundary so each piece is served by one rule."""
    cuts = {tokens[0], tokens[1] + 1}
    for r in rules:
        if r.op == op and "tokens" in r.ranges:
            lo, hi = r.ranges["tokens"]
            cuts.update(c for c in (lo, hi + 1) if tokens[0] < c <= tokens[1])
    edges = sorted(cuts)
    return [(a, b - 1) for a, b in zip(edges, edges[1:])]


def _fail(where: str, msg: str):
    raise TierError(f"{where}: {msg}")


def _int(where, d, key, lo=1, hi=None, default=None):
    v = d.get(key, default)
    if v is None:
        _fail(where, f"missing required field '{key}'")
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        _fail(where, f"field '{key}' must be an integer in [{lo}, {hi if hi is not None else 'inf'}], got {v!r}")
    return v


def _range(where, d, key):
    v = d[key]
    if (not isinstance(v, list) or len(v) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            or v[0] > v[1] or v[0] < 0):
        _fail(where, f"field '{key}' must be an inclusive range [lo, hi] of integers with 0 <= lo <= hi, got {v!r}")
    return (v[0], v[1])


def _parse_model(where: str, name: str, d: dict) -> Model:
    known = {f for f in Model.__dataclass_fields__} - {"name", "source"}
    for k in d:
        if k not in known:
            _fail(where, f"unknown field '{k}' (known: {', '.join(sorted(known))})")
    E = _int(where, d, "num_experts", 1, MAX_EXPERTS)
    K = _int(where, d, "top_k", 1, min(MAX_TOPK, E))
    H = _int(where, d, "hidden", 8)
    if H % 8:
        _fail(where, f"field 'hidden' must be a multiple of 8 (16-byte vectors of 16-bit values), got {H}")
    method = d.get("routing")
    if method not in METHODS:
        _fail(where, f"field 'routing' must be one of {', '.join(METHODS)}, got {method!r}")
    G = _int(where, d, "n_group", 1, E, default=1)
    if E % G:
        _fail(where, f"field 'n_group' ({G}) must divide num_experts ({E})")
    TG = _int(where, d, "topk_group", 1, G, default=1)
    if method == "grouped_sigmoid_bias" and K > TG * (E // G):
        _fail(where, f"top_k ({K}) exceeds the experts of topk_group groups ({TG * (E // G)})")
    if method == "top1_sigmoid" and K != 1:
        _fail(where, f"routing 'top1_sigmoid' needs top_k = 1, got {K}")
    rsf = d.get("routed_scaling_factor", 1.0)
    if not isinstance(rsf, (int, float)) or isinstance(rsf, bool) or not rsf > 0:
        _fail(where, f"field 'routed_scaling_factor' must be a positive number, got {rsf!r}")
    for key, allowed in (("dtype", DTYPES), ("weights_dtype", ("float32", "bfloat16"))):
        if d.get(key, allowed[0]) not in allowed:
            _fail(where, f"field '{key}' must be one of {', '.join(allowed)}, got {d[key]!r}")
    if not isinstance(d.get("renormalize", True), bool):
        _fail(where, "field 'renormalize' must be true or false")
    if "tokens" not in d:
        _fail(where, "missing required field 'tokens' (the token range to serve, e.g. [1, 8192])")
    tokens = _range(where, d, "tokens")
    if tokens[0] < 1:
        _fail(where, "field 'tokens' must start at 1 or more")
    tile = _int(where, d, "tile", 1, 1024, default=128)
    if d.get("router_weight", "output") not in ROUTER_WEIGHT:
        _fail(where, f"field 'router_weight' must be one of {', '.join(ROUTER_WEIGHT)} (where the router weight "
              f"multiplies: the expert's output, or its input as Llama-4 does), got {d['router_weight']!r}")
    if d.get("router_weight") == "input" and K != 1:
        _fail(where, f"router_weight = \"input\" needs top_k = 1 (the outputs are summed unweighted), got {K}")
    return Model(name=name, num_experts=E, top_k=K, hidden=H, routing=method, tokens=tokens, n_group=G,
                 topk_group=TG, routed_scaling_factor=float(rsf), renormalize=d.get("renormalize", True),
                 dtype=d.get("dtype", "bfloat16"), weights_dtype=d.get("weights_dtype", "float32"), tile=tile,
                 router_weight=d.get("router_weight", "output"), source=where)


def _parse_rule(where: str, d: dict) -> Rule:
    for k in d:
        if k not in ("op", "variant", "params", *RANGE_KEYS):
            _fail(where, f"unknown field '{k}' (known: op, variant, params, {', '.join(RANGE_KEYS)})")
    if d.get("op") not in OPS:
        _fail(where, f"field 'op' must be one of {', '.join(OPS)}, got {d.get('op')!r}")
    if not isinstance(d.get("variant"), str) or not d["variant"]:
        _fail(where, "missing required field 'variant' (a template name under templates/<op>/)")
    params = d.get("params", {})
    if not isinstance(params, dict) or not all(isinstance(v, (bool, int, float, str)) for v in params.values()):
        _fail(where, "field 'params' must be a table of scalars")
    ranges = {k: _range(where, d, k) for k in RANGE_KEYS if k in d}
    return Rule(op=d["op"], variant=d["variant"], ranges=ranges, params=dict(params), source=where)


def parse(path: Path) -> tuple[dict[str, Model], list[Rule]]:
    """Read and validate one tier file; every error names the file, the table and the field."""
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise TierError(f"tier file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise TierError(f"{path}: not valid TOML: {e}") from None
    for k in doc:
        if k not in ("schema", "models", "tier", "provenance"):
            _fail(str(path), f"unknown top-level key '{k}' (known: schema, models, tier, provenance)")
    if doc.get("schema") != SCHEMA:
        _fail(str(path), f"field 'schema' must be {SCHEMA}, got {doc.get('schema')!r}")
    models = {}
    for name, d in doc.get("models", {}).items():
        where = f"{path} [models.{name}]"
        if not isinstance(d, dict):
            _fail(where, "must be a table")
        models[name] = _parse_model(where, name, d)
    tiers = doc.get("tier", [])
    if not isinstance(tiers, list):
        _fail(str(path), "'tier' must be an array of tables: write [[tier]]")
    rules = [_parse_rule(f"{path} [[tier]] #{i + 1}", d) for i, d in enumerate(tiers)]
    _check_provenance(path, doc.get("provenance"))
    return models, rules


def _check_provenance(path: Path, prov) -> None:
    """A file tuned on another GPU still loads, with a warning: its rules may not be the fastest here."""
    if not isinstance(prov, dict) or "gpu" not in prov:
        return
    import sys
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return
    here = torch.cuda.get_device_properties(torch.cuda.current_device())
    if prov.get("gpu") != here.name or prov.get("sm_count", here.multi_processor_count) != here.multi_processor_count:
        import warnings
        warnings.warn(f"kerngen: {path} was tuned on {prov.get('gpu')} ({prov.get('sm_count')} SMs), this is "
                      f"{here.name} ({here.multi_processor_count} SMs); run `kerngen tune` here for rules that fit",
                      RuntimeWarning, stacklevel=2)


@lru_cache(maxsize=8)
def _load(files: tuple[str, ...]) -> Table:
    models: dict[str, Model] = {}
    rules: list[Rule] = []
    for f in files:  # shipped first; each later file overrides models and puts its rules in front
        m, r = parse(Path(f))
        models.update(m)
        rules[:0] = r
    return Table(models=models, rules=tuple(rules), files=files)


def load(user: Path | str | None = None) -> Table:
    """The active table: shipped tiers.toml, then `user` or KERNGEN_TIERS layered over it."""
    files = [str(env.shipped_tiers())]
    extra = user if user is not None else env.user_tiers()
    if extra is not None:
        files.append(str(Path(extra).resolve()))
    return _load(tuple(files))


def reload() -> None:
    _load.cache_clear()
