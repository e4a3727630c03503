"""Parse and validate tier tables (schema v1) and answer: which rule serves this shape?

A table has `schema = 1`, `[models.NAME]` entries and `[[tier]]` rules (see the comments in tiers.toml).
A user file is layered over the shipped one: its models replace or add models by name, and its rules are
tried before the shipped rules. A rule names an op of the op registry (kerngen.ops) and gives its variant the params
the op declares.
"""
from __future__ import annotations

import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from . import env, ops
from .errors import TierError
from .ops import INT32_MAX, SMS  # noqa: F401  (SMS: the ops read it here too)

SCHEMA = 1
METHODS = ("softmax_topk", "topk_softmax", "sigmoid_bias", "grouped_sigmoid_bias", "top1_sigmoid")
DTYPES = ("bfloat16", "float16")
ROUTER_WEIGHT = ("output", "input")
EXPERT_ACTIVATIONS = ("silu", "gelu", "gpt_oss", "situglu")   # kerngen.experts' gates
EXPERT_FORMATS = ("bf16", "fp8", "mxfp4")   # kerngen.experts' weight formats (fp8: e4m3 with 128 x 128 block
#                                            scales; mxfp4: e2m1 pairs with an e8m0 scale per 32 values)
RULE_FORMATS = (*EXPERT_FORMATS, "w8a8")   # an experts rule's `formats`: the weight formats, and w8a8 (fp8 weights
#                                            with fp8 activations: kerngen.experts(..., fp8_activations=True))
EXPERT_LAYOUTS = ("nk", "kn")   # how a model's bf16 expert weights lie: [E, 2I, H] / [E, H, I], or transposed
RANGE_KEYS = ("num_experts", "top_k", "hidden", "tokens", "world_size", "sm_count")
MAX_EXPERTS, MAX_TOPK = 2048, 32
NAME = re.compile(r"[a-z][a-z0-9_]*")                 # an op or variant: a file name, never a path


@dataclass(frozen=True)
class Backend:
    """How one backend's kernels are written, built and loaded: the one table render, jit and the ops read."""
    template: str   # template suffix under templates/<op>/
    jinja: bool     # rendered with Jinja; else a CuTe DSL module read as it is and specialized when compiled
    source: str     # the rendered source's file name beside its cache entry
    artifact: str   # the built file its loader needs
    compiler: str   # kerngen module with toolchain() and compile_spec(spec, source, key, source_path) -> files
    loader: str     # kerngen module with load(files, key) -> the loaded kernel


BACKENDS = {"nvrtc": Backend(".cu.j2", True, "source.cu", "kernel.cubin", "compile", "launch"),
            "cute": Backend(".py", False, "source.py", "kernel.o", "cute_backend", "cute_backend")}


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
    router_weight: str = "output"   # "input": the expert's input is scaled by w (Llama-4), outputs summed as is
    intermediate: int = 0           # the routed experts' intermediate size (0: kerngen.experts not warmed up)
    activation: str = "silu"        # the experts' gate (kerngen.experts' activation names)
    model_hidden: int = 0           # the model's hidden size when `hidden` is the experts' latent width (0: not latent)
    experts_format: str = "bf16"    # the format its checkpoints ship the expert weights in (warmup adds bf16)
    experts_layout: str = "nk"      # "kn": its bf16 weights are stored transposed ([E, H, 2I], [E, I, H])
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
    arch: tuple[str, ...] = ()   # the targets it serves (sm_90a, sm_100a, ...); empty: any
    formats: tuple[str, ...] = ()   # experts rules: the weight formats it serves (EXPERT_FORMATS); empty: any
    permute: bool | None = None   # routing rules: only calls with a tile (True) or without one (False); None: both

    def matches(self, shape: dict) -> bool:
        """Every range given holds for the shape's value (a range the shape has no value for holds), the
        shape's target ("arch", else KERNGEN_ARCH's default) is one the rule serves, and so are its weight format
        ("format", else bf16) and, for routing, whether the call permutes ("permute", else True)."""
        if self.arch and shape.get("arch", env.default_arch()) not in self.arch:
            return False
        if self.formats and shape.get("format", "bf16") not in self.formats:
            return False
        if self.permute is not None and bool(shape.get("permute", True)) is not self.permute:
            return False
        return all(lo <= shape[k] <= hi for k, (lo, hi) in self.ranges.items() if k in shape)


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
        for t_lo, t_hi in token_pieces(self.rules, op, tokens):
            r = self.rule(op, {**shape, "tokens": t_lo})
            if r not in out:
                out.append(r)
        return out


def token_pieces(rules, op, tokens):
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


def _int(where, d, key, lo=1, hi=INT32_MAX, default=None):
    v = d.get(key, default)
    if v is None:
        _fail(where, f"missing required field '{key}'")
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or v > hi:
        _fail(where, f"field '{key}' must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _range(where, d, key):
    v = d[key]
    if (not isinstance(v, list) or len(v) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in v)
            or not 0 <= v[0] <= v[1] <= INT32_MAX):
        _fail(where, f"field '{key}' must be an inclusive range [lo, hi] of integers with 0 <= lo <= hi <= "
                     f"{INT32_MAX}, got {v!r}")
    return (v[0], v[1])


def _positive_number(where, d, key, default):
    v = d.get(key, default)
    try:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < float(v) < math.inf
    except OverflowError:   # an integer too large for a float
        ok = False
    if not ok:
        _fail(where, f"field '{key}' must be a positive finite number, got {v!r}")
    return float(v)


def _parse_model(where: str, name: str, d: dict) -> Model:
    known = {f for f in Model.__dataclass_fields__} - {"name", "source"}
    if "tile" in d:   # a model field nothing read: the tile is a call's argument and the experts rules' param
        _fail(where, "field 'tile' is not a model field: give the permutation's tile to the call (route / permute "
              "tile=), and kerngen.experts' tile is its tier rules' `tile` param")
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
    rsf = _positive_number(where, d, "routed_scaling_factor", 1.0)
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
    if d.get("router_weight", "output") not in ROUTER_WEIGHT:
        _fail(where, f"field 'router_weight' must be one of {', '.join(ROUTER_WEIGHT)} (where the router weight "
              f"multiplies: the expert's output, or its input as Llama-4 does), got {d['router_weight']!r}")
    if d.get("router_weight") == "input" and K != 1:
        _fail(where, f"router_weight = \"input\" needs top_k = 1 (the outputs are summed unweighted), got {K}")
    inter = _int(where, d, "intermediate", 0, default=0)
    model_hidden = _int(where, d, "model_hidden", 0, default=0)
    if model_hidden % 8:
        _fail(where, f"field 'model_hidden' must be a multiple of 8 (16-byte vectors), got {model_hidden}")
    if inter % 8:
        _fail(where, f"field 'intermediate' must be a multiple of 8 (16-byte vectors), got {inter}")
    if d.get("activation", "silu") not in EXPERT_ACTIVATIONS:
        _fail(where, f"field 'activation' must be one of {', '.join(EXPERT_ACTIVATIONS)}, got {d['activation']!r}")
    if d.get("experts_format", "bf16") not in EXPERT_FORMATS:
        _fail(where, f"field 'experts_format' must be one of {', '.join(EXPERT_FORMATS)}, got {d['experts_format']!r}")
    if d.get("experts_layout", "nk") not in EXPERT_LAYOUTS:
        _fail(where, f"field 'experts_layout' must be one of {', '.join(EXPERT_LAYOUTS)} (\"kn\": bf16 weights stored "
              f"[E, H, 2I] and [E, I, H], as transformers' gpt-oss and Llama-4 keep them), got {d['experts_layout']!r}")
    return Model(name=name, num_experts=E, top_k=K, hidden=H, routing=method, tokens=tokens, n_group=G,
                 topk_group=TG, routed_scaling_factor=rsf, renormalize=d.get("renormalize", True),
                 dtype=d.get("dtype", "bfloat16"), weights_dtype=d.get("weights_dtype", "float32"),
                 router_weight=d.get("router_weight", "output"), intermediate=inter, model_hidden=model_hidden,
                 activation=d.get("activation", "silu"), experts_format=d.get("experts_format", "bf16"),
                 experts_layout=d.get("experts_layout", "nk"), source=where)


def _declared(op: str) -> ops.Op:
    """The registry's declaration of `op`; one nobody registered (a kernel spec may name any op) declares nothing."""
    return next((o for o in ops.registered() if o.name == op), ops.Op(op, {}))


def template_path(op: str, variant: str, backend: str) -> Path:
    return env.templates_dir() / op / f"{variant}{BACKENDS[backend].template}"


def variants(op: str) -> list[str]:
    """The variants of `op` that exist: its templates (files starting with '_' are shared parts), or host code."""
    declared = _declared(op)
    if not declared.kernels:
        return list(declared.host)
    try:
        names = [p.name for p in (env.templates_dir() / op).iterdir() if not p.name.startswith("_")]
    except OSError:
        names = []
    return sorted({n[: -len(ext)] for n in names for ext in (b.template for b in BACKENDS.values())
                   if n.endswith(ext)} | set(declared.host))


def _known(op: str) -> str:
    return ", ".join(variants(op)) or "none"


def check_variant(where: str, op: str, variant, backend) -> None:
    """`variant` names a kernel of `op` that exists for `backend`: a name, never a path."""
    if not isinstance(variant, str) or not NAME.fullmatch(variant):
        _fail(where, f"field 'variant' must be the name of a variant of {op} (known: {_known(op)}), got {variant!r}")
    declared = _declared(op)
    if not declared.kernels:
        if variant not in declared.host:
            _fail(where, f"unknown variant '{variant}' of {op} (known: {_known(op)})")
        return
    if variant in declared.host:
        return
    if backend not in BACKENDS:
        _fail(where, f"param 'backend' must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if not template_path(op, variant, backend).is_file():
        other = [b for b in BACKENDS if b != backend and template_path(op, variant, b).is_file()]
        if other:
            _fail(where, f"variant '{variant}' of {op} is built by backend '{other[0]}' "
                         f"({op}/{variant}{BACKENDS[other[0]].template}), not '{backend}': set params.backend = "
                         f"\"{other[0]}\"")
        _fail(where, f"unknown variant '{variant}' of {op} for backend '{backend}': no template "
                     f"{op}/{variant}{BACKENDS[backend].template} under {env.templates_dir()} (known: {_known(op)})")


def check_params(where: str, op: str, variant: str, params: dict) -> None:
    """`params` (backend included) are the launch params of `op` `variant`: known names, types and bounds."""
    schema = ops.params(op, variant)
    if schema is None:
        _fail(where, f"variant '{variant}' of {op} has a template but no list of params: add it to the params of "
                     f"Op(\"{op}\") in kerngen/ops/__init__.py")
    for k in params:
        if k not in schema:
            _fail(where, f"unknown param '{k}' of {op} variant '{variant}' (known: {', '.join(schema)})")
    for k, p in schema.items():
        if k not in params:
            if p.required:
                needed = ", ".join(n for n, q in schema.items() if q.required)
                _fail(where, f"missing param '{k}' ({op} variant '{variant}' needs {needed})")
        elif (why := p.problem(params[k])) is not None:
            _fail(where, f"param '{k}' of {op} variant '{variant}' must be {why}, got {params[k]!r}")
    between = ops.declared(op).between
    if between and (why := between(variant, params)) is not None:
        _fail(where, why)


def check_rule(where: str, op: str, variant, params: dict) -> None:
    check_variant(where, op, variant, params.get("backend", "nvrtc"))
    check_params(where, op, variant, params)


def _parse_rule(where: str, d: dict) -> Rule:
    for k in d:
        if k not in ("op", "variant", "params", "arch", "formats", "permute", *RANGE_KEYS):
            _fail(where, f"unknown field '{k}' (known: op, variant, params, arch, formats, permute, "
                         f"{', '.join(RANGE_KEYS)})")
    names = [o.name for o in ops.registered()]
    if d.get("op") not in names:
        _fail(where, f"field 'op' must be one of {', '.join(names)}, got {d.get('op')!r}")
    if not isinstance(d.get("variant"), str) or not d["variant"]:
        _fail(where, "missing required field 'variant' (a template name under templates/<op>/)")
    params = d.get("params", {})
    if not isinstance(params, dict) or not all(isinstance(v, (bool, int, float, str)) for v in params.values()):
        _fail(where, "field 'params' must be a table of scalars")
    ranges = {k: _range(where, d, k) for k in RANGE_KEYS if k in d}
    check_rule(where, d["op"], d["variant"], params)
    return Rule(op=d["op"], variant=d["variant"], ranges=ranges, params=dict(params), source=where,
                arch=_arches(where, d.get("arch")), formats=_formats(where, d["op"], d.get("formats")),
                permute=_permute(where, d["op"], d.get("permute")))


def _permute(where: str, op: str, v) -> bool | None:
    """A routing rule's `permute`: true for calls with a tile (the permutation too), false for calls without one
    (ids and weights only); left out: both."""
    if v is None:
        return None
    if op != "routing":
        _fail(where, f"field 'permute' applies to op = \"routing\" rules only, not {op}")
    if not isinstance(v, bool):
        _fail(where, f"field 'permute' must be true or false, got {v!r}")
    return v


def _formats(where: str, op: str, v) -> tuple[str, ...]:
    """An experts rule's `formats`: a non-empty list of the formats it serves (RULE_FORMATS; left out: every one)."""
    if v is None:
        return ()
    if op != "experts":
        _fail(where, f"field 'formats' (weight formats) applies to op = \"experts\" rules only, not {op}")
    if not isinstance(v, list) or not v or not all(isinstance(f, str) and f in RULE_FORMATS for f in v):
        _fail(where, f"field 'formats' must be a non-empty list of {', '.join(map(repr, RULE_FORMATS))}, got {v!r}")
    return tuple(v)


def _arches(where: str, v) -> tuple[str, ...]:
    """A rule's `arch`: a non-empty list of exact targets such as "sm_90a" (left out: every target)."""
    if v is None:
        return ()
    if (not isinstance(v, list) or not v or not all(isinstance(a, str) and env.ARCH.fullmatch(a) for a in v)):
        _fail(where, f"field 'arch' must be a non-empty list of targets such as [\"sm_90a\", \"sm_100a\"], "
              f"got {v!r}")
    return tuple(v)


def _read(path: Path) -> dict:
    """The TOML document at `path`; any way it cannot be read is a TierError naming it."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise TierError(f"tier file {path} does not exist") from None
    except IsADirectoryError:
        raise TierError(f"tier file {path} is a directory; give the path of a .toml file") from None
    except OSError as e:
        raise TierError(f"tier file {path} cannot be read ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise TierError(f"{path}: not UTF-8 text (byte {e.start}); TOML files are UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise TierError(f"{path}: not valid TOML: {e}") from None
    except RecursionError:
        raise TierError(f"{path}: not valid TOML: arrays or tables nested too deeply") from None


def parse(path: Path) -> tuple[dict[str, Model], list[Rule]]:
    """Read and validate one tier file; every error names the file, the table and the field."""
    doc = _read(path)
    for k in doc:
        if k not in ("schema", "models", "tier", "provenance"):
            _fail(str(path), f"unknown top-level key '{k}' (known: schema, models, tier, provenance)")
    if "schema" not in doc:
        _fail(str(path), f"missing required field 'schema': a tiers file starts with `schema = {SCHEMA}` (the table "
                         "format it is written in), as the shipped tiers.toml does")
    schema = doc.get("schema")
    if not isinstance(schema, int) or isinstance(schema, bool) or schema != SCHEMA:
        _fail(str(path), f"field 'schema' must be {SCHEMA}, got {schema!r}")
    entries = doc.get("models", {})
    if not isinstance(entries, dict):
        _fail(str(path), "'models' must be a table of models: write [models.NAME]")
    models = {}
    for name, d in entries.items():
        where = f"{path} [models.{name}]"
        if not isinstance(d, dict):
            _fail(where, "must be a table")
        models[name] = _parse_model(where, name, d)
    tiers = doc.get("tier", [])
    if not isinstance(tiers, list):
        _fail(str(path), "'tier' must be an array of tables: write [[tier]]")
    rules = []
    for i, d in enumerate(tiers):
        where = f"{path} [[tier]] #{i + 1}"
        if not isinstance(d, dict):
            _fail(where, f"must be a table (write [[tier]] and its fields), got {d!r}")
        rules.append(_parse_rule(where, d))
    if "provenance" in doc and not isinstance(doc["provenance"], dict):
        _fail(str(path), "'provenance' must be a table")
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
        extra = str(extra)
        files.append(_resolved(extra, "" if os.path.isabs(extra) else os.getcwd()))
    return _load(tuple(files))


@lru_cache(maxsize=8)
def _resolved(path: str, cwd: str) -> str:
    """`path` made absolute with its links followed; remembered per (path, working directory) so that a
    repeated load() stats nothing, while a changed KERNGEN_TIERS (or cwd, for a relative one) is seen."""
    return str(Path(path).resolve())


_reload_hooks: list = []


def on_reload(fn) -> None:
    """Call fn() on every reload() (the dispatch registry forgets what it resolved from the old table)."""
    _reload_hooks.append(fn)


def reload() -> None:
    """Read the tier files again on the next load(), and forget every dispatch resolved from the old table."""
    _load.cache_clear()
    _resolved.cache_clear()
    for fn in _reload_hooks:
        fn()
