"""Dispatch once: the kernels of one op at one static shape on one device, resolved once and then only launched.

A `Dispatch` is built on the first call of a (op, static shape, dtypes, device) — or by warmup / preload. It
reads the tier table once: the rules' token ranges split the token axis into buckets, and each bucket gets its
KernelSpec then. A call picks the bucket of its token count with a bisect and takes the op's launch object for
that count (built on first use: compile or cache load, then kept). After the first call of a token count
nothing on the path reads the filesystem, reloads the table or scans rules.

Where state lives: each op has one `OpDispatch` (the op module's `dispatch`), the only cache an op keeps. It holds
the op's dispatch objects, one per static key (the op's build keywords, never the token count): each with its
launch objects and what the shape's calls reuse (`kept`: scratch buffers, the TP tails' symmetric buffers and
identity rows, kernels built for another tile); and the op's resolved calls (`calls`): a call whose input signature
was seen skips the checks and the lookup and launches what they found. Every op's is called the same way,
`dispatch(device, **static) -> Dispatch`. `clear()` forgets them all, and `tiers.reload()` calls it. The one
per-process store outside them is the loaded kernels (`launch.resolve`), keyed by KernelSpec: a spec is one binary
whatever shape or table asked for it.
"""
from __future__ import annotations

import inspect
from bisect import bisect_right
from typing import Any, Callable

from . import jit, tiers
from .errors import TierError
from .plan import KernelSpec, spec_for, target_arch, visible_sm_count

MAX_TOKENS = tiers.INT32_MAX


class Dispatch:
    """One op at one static shape on one device.

    `shape` holds the op's rule keys without tokens (num_experts, top_k, hidden); `spec_of(rule)` turns the rule
    of a bucket into its KernelSpec (the op's tag and constants; tail_tp, whose variants are host code, keeps the
    rule itself); `make(spec, tokens, device)` builds the launch object of a bucket for one token count, or with
    per_token=False one object for every token count of the bucket (a launch object whose grid does not follow the
    tokens: built once per spec). `kept` holds what the op keeps beside its launch objects for this shape (scratch
    buffers, per stream where streams must not share them; kernels for another tile; ...), forgotten with it.
    """
    __slots__ = ("op", "device", "arch", "starts", "specs", "errors", "kept", "_make", "_by_tokens", "_per_token",
                 "_by_spec")

    def __init__(self, op: str, shape: dict[str, int], spec_of: Callable[[tiers.Rule], Any],
                 make: Callable[[KernelSpec, int, int], Any], device: int, *, arch: str | None = None,
                 table: tiers.Table | None = None, per_token: bool = True):
        tbl = table or tiers.load()
        self.op, self.device, self._make = op, device, make
        self.kept: dict = {}
        self._per_token, self._by_spec = per_token, {}
        self.arch = arch or target_arch(device if device >= 0 else None)
        key = {**shape, "arch": self.arch, **visible_sm_count(self.arch, device)}
        self.starts, self.specs, self.errors = [], [], []
        for lo, _ in tiers.token_pieces(tbl.rules, op, (1, MAX_TOKENS)):
            try:
                s, err = spec_of(tbl.rule(op, {**key, "tokens": lo})), None
            except TierError as e:
                s, err = None, _detached(e)
            if self.specs and s == self.specs[-1] and err is None and self.errors[-1] is None:
                continue   # the same kernel as the bucket before: one bucket
            self.starts.append(lo)
            self.specs.append(s)
            self.errors.append(err)
        self._by_tokens: dict[int, Any] = {}

    def spec(self, tokens: int) -> KernelSpec | None:
        """The KernelSpec serving `tokens` (0 counts as 1), or None where no rule serves it."""
        return self.specs[bisect_right(self.starts, max(tokens, 1)) - 1]

    def require(self, tokens: int) -> KernelSpec:
        """spec(tokens), or the table's TierError naming the shape."""
        i = bisect_right(self.starts, max(tokens, 1)) - 1
        if self.specs[i] is None:
            raise self.errors[i]
        return self.specs[i]

    def served(self, tokens: int):
        """kernel(tokens), or the table's TierError naming the shape where no rule serves these tokens."""
        k = self.kernel(tokens)
        if k is None:
            self.require(tokens)
        return k

    def kernel(self, tokens: int):
        """The launch object for `tokens` tokens (None where no rule serves them), built once."""
        k = self._by_tokens.get(tokens)
        if k is None and tokens not in self._by_tokens:
            s = self.spec(tokens)
            if s is None:
                k = None
            elif self._per_token:
                k = self._make(s, tokens, self.device)
            else:
                k = self._by_spec.get(s)
                if k is None:
                    k = self._by_spec[s] = self._make(s, tokens, self.device)
            self._by_tokens[tokens] = k
        return k

    def __repr__(self) -> str:
        buckets = ", ".join(f"{lo}+: {getattr(s, 'variant', s)}" for lo, s in zip(self.starts, self.specs))
        return f"Dispatch({self.op} on {self.arch}, device {self.device}; {buckets})"


MAX_SIGNATURES = 4096   # input signatures an op remembers before it forgets them all (bounded memory)


class Calls(dict):
    """The calls of one op resolved so far: input signature (every property its checks establish) -> what the
    checks and the dispatch object found for it (the launch object and the values a launch needs). A dict, so a
    call's lookup is one `get`; bounded by MAX_SIGNATURES; one per op (its OpDispatch's), cleared by `clear()`."""
    __slots__ = ("op",)

    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def remember(self, sig, hit):
        """Keep `hit` under `sig` (None: a call that cannot be remembered); returns hit."""
        if sig is not None:
            if len(self) > MAX_SIGNATURES:
                self.clear()
            self[sig] = hit
        return hit


class OpDispatch:
    """One op's dispatch state: its dispatch objects by static key, built once each by the op's
    `build(device, *, <static keywords>)`, and its resolved calls (`calls`). `op_dispatch(device, **static)` is the
    shape's Dispatch: the same call for every op, its keywords (and their defaults) those of `build`."""

    def __init__(self, op: str, build: Callable[..., Dispatch]):
        sig = inspect.signature(build)
        ps = list(sig.parameters.values())
        if not ps or ps[0].name != "device" or any(p.kind is not p.KEYWORD_ONLY for p in ps[1:]):
            raise TypeError(f"{op}: a dispatch build takes (device, *, <static keywords>), not {sig}")
        self.op, self.build, self.calls = op, build, Calls(op)
        self.fields = tuple(p.name for p in ps[1:])
        self.defaults = {p.name: p.default for p in ps[1:] if p.default is not p.empty}
        self.shapes: dict[tuple, Dispatch] = {}   # (device, every static value in `fields` order) -> Dispatch
        self._seen: dict[tuple, Dispatch] = {}    # (device, the keywords as a call gave them, their values) -> Dispatch
        self.__signature__, self.__doc__ = sig, build.__doc__
        _ops[op] = self

    def __call__(self, device: int, **static) -> Dispatch:
        seen = (device, *static, *static.values())   # the keywords, then their values (one flat tuple)
        d = self._seen.get(seen)
        if d is None:
            d = self._seen[seen] = self._shape(device, static)
        return d

    def _shape(self, device: int, static: dict) -> Dispatch:
        unknown = [k for k in static if k not in self.fields]
        missing = [f for f in self.fields if f not in static and f not in self.defaults]
        if unknown or missing:
            raise TypeError(f"kerngen.ops.{self.op}.dispatch takes (device, *, {', '.join(self.fields)})"
                            + (f"; unknown: {', '.join(unknown)}" if unknown else "")
                            + (f"; missing: {', '.join(missing)}" if missing else ""))
        key = (device, *(static[f] if f in static else self.defaults[f] for f in self.fields))
        d = self.shapes.get(key)
        if d is None:
            check_env()
            d = self.shapes[key] = self.build(device, **static)
        return d

    def clear(self) -> None:
        self.shapes.clear()
        self._seen.clear()
        self.calls.clear()

    def __repr__(self) -> str:
        return f"OpDispatch({self.op}: {len(self.shapes)} shapes, {len(self.calls)} call signatures)"


_ops: dict[str, OpDispatch] = {}
_generation = [0]   # clear()s so far: what was built from the kernels resolved before (a CUDA graph) is stale


def calls(op: str) -> Calls:
    """The resolved calls of `op` (its OpDispatch's)."""
    return _ops[op].calls


def check_env() -> None:
    """Read the serving variables now: a bad KERNGEN_STRICT is an EnvError at a shape's first resolution, cached
    kernels or not, and at every call of a CPU entry point (torch.ops.kerngen.*, the adapters), as on a GPU."""
    jit.is_strict()


def rule_spec(tag_constants: tuple[str, dict], arch: str) -> Callable[[tiers.Rule], KernelSpec]:
    """spec_of for ops whose tag and constants do not depend on the rule."""
    tag, consts = tag_constants
    return lambda rule: spec_for(rule, tag, consts, arch)


def clear() -> None:
    """Forget every dispatch object (with what it keeps) and every op's cached signatures (after the tier table or
    the cache changed); the next call of each shape resolves again."""
    for o in _ops.values():
        o.clear()
    _generation[0] += 1


def generation() -> int:
    """How many times clear() ran: a graph captured from kerngen's launches before the count changed launches
    kernels and buffers kerngen no longer keeps."""
    return _generation[0]


def registry() -> dict[tuple, Dispatch]:
    """The dispatch objects built so far, keyed (op, device, static values...) (read-only use: tests, explain)."""
    return {(o.op, *key): d for o in _ops.values() for key, d in o.shapes.items()}


tiers.on_reload(clear)


def _detached(e: BaseException) -> BaseException:
    """`e` (and what it chains) without tracebacks: a kept exception would keep the frames it passed through and
    through them their callers' locals (a first call's tensors, alive for good)."""
    seen, at = set(), e
    while at is not None and id(at) not in seen:   # (a chain set by hand may loop)
        seen.add(id(at))
        at.__traceback__ = None
        at = at.__cause__ or at.__context__
    return e
