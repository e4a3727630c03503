"""permute: the permutation a grouped GEMM consumes, and the Routing / RoutingWorkspace that route and permute fill.

Over the local experts [local_start, local_start + num_local), with tile given (e = t*K + k, the expanded index):

    cnt[x]                   entries of local expert x;  ntile[x] = ceil(cnt[x] / tile)
    expert_offsets[x]        tile * (ntile[0] + ... + ntile[x-1]), the padded start row of expert x
    num_permuted_rows        tile * sum(ntile)
    expanded_to_permuted[e]  expert_offsets[x] + rank of e among expert x's entries, -1 if not local
    permuted_to_token[row]   e // K of the entry placed there; -1 for padding rows
    tile_to_expert[j]        the local expert of tile j (j < sum(ntile))

with the rows of one expert in ascending expanded index (deterministic, compared exactly).
`expert_offsets` has num_local + 1 entries (the last is num_permuted_rows); `tile_to_expert` holds local
expert indices. permuted_to_token has T*K + num_local*(tile-1) rows (the worst case, so no host sync is
needed) and tile_to_expert that many rows / tile; everything past num_permuted_rows is -1.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from threading import get_ident

import torch

from .. import plan as plan_mod
from ..errors import InputError, TierError
from ..dispatch import Dispatch, calls, lookup, on_clear, rule_spec
from ..launch import Launcher, Params, current_stream
from ..tiers import MAX_EXPERTS, MAX_TOPK, SMS, Model, Table
from ._common import arch, check_int, check_local, check_tensor, require_gpu, resolve, table

OP = "permute"
TORCH_OPS = ("moe_align_block_size",)   # its torch.ops.kerngen ops (kerngen/torch_ops.py)
SHAPE_FLAGS = ("experts", "top_k")   # the shape `kerngen explain --op permute` needs (default: top_k, hidden)
_WEIGHTS = (torch.float32, torch.bfloat16)
MIN_TOKENS_PER_BLOCK = 16          # permute tiers: the histogram scratch is sized for this
FRESH_PROTO_TOKENS = 64           # calls without workspace= up to this many tokens keep a prototype of their buffers
# struct Params of templates/permute/histogram.cu.j2 and onepass.cu.j2 (hist and ticket unused by onepass)
PARAMS = Params(("ids", "ptr"), ("counts", "ptr"), ("offsets", "ptr"), ("e2p", "ptr"), ("p2t", "ptr"), ("t2e", "ptr"),
                ("num_rows", "ptr"), ("hist", "ptr"), ("ticket", "ptr"), ("tokens", "int"), ("tile", "int"),
                ("local_start", "int"), ("num_local", "int"), ("max_rows", "int"))
MAX_TILE = 1024                      # rows per tile of a permutation (one CTA's threads pad a tile)
MAX_DYNAMIC_SMEM = 226 * 1024        # onepass permute: sm_90 gives a CTA 227 KiB, less its static arrays


# ----------------------------------------------------------------------------------------------- results
@dataclass(frozen=True, eq=False)
class Routing:
    """topk_ids [T,K] int32, topk_weights [T,K]; the permutation fields are None without a tile.

    `tile` is the rows per tile of the permutation (None without one). A Routing kerngen built also carries
    `checked`, the layout its buffers were built with, so kerngen.experts skips re-checking them."""
    topk_ids: torch.Tensor
    topk_weights: torch.Tensor
    expert_counts: torch.Tensor | None = None          # [num_local] int32
    expert_offsets: torch.Tensor | None = None         # [num_local + 1] int32, rows
    expanded_to_permuted: torch.Tensor | None = None   # [T, K] int32, -1 for non-local experts
    permuted_to_token: torch.Tensor | None = None      # [T*K + num_local*(tile-1)] int32, -1 padding/tail
    tile_to_expert: torch.Tensor | None = None         # [len(permuted_to_token) // tile] int32, -1 unused
    num_permuted_rows: torch.Tensor | None = None      # [] int32 on the device
    # layout="align": vLLM / SGLang moe_align_block_size's outputs (block_size = tile), see align_reference
    sorted_token_ids: torch.Tensor | None = None       # [T*K + E*(tile-1)] int32, expanded indices, pad T*K
    expert_ids: torch.Tensor | None = None             # [ceil(len(sorted_token_ids) / tile)] int32
    num_tokens_post_padded: torch.Tensor | None = None  # [1] int32 on the device
    tile: int | None = None                            # rows per tile of the permutation
    checked: tuple | None = field(default=None, init=False, repr=False)   # (T, K, num_local, tile, rows, tiles, dev)

    @property
    def grouped_mm_offs(self) -> torch.Tensor | None:
        """torch._grouped_mm's `offs` over the permuted rows: each local expert's cumulative end row (int32,
        on the device; a view, no computation). With tile 1 the groups are unpadded."""
        return None if self.expert_offsets is None else self.expert_offsets[1:]


def max_rows(tokens: int, top_k: int, num_local: int, tile: int) -> int:
    """Worst-case num_permuted_rows: every local expert's last tile is padded."""
    return tokens * top_k + num_local * (tile - 1)


def align_rows(tokens: int, top_k: int, num_experts: int, block_size: int, pad_sorted_ids: bool = False) -> int:
    """vLLM's max_num_tokens_padded, the length of sorted_token_ids (whole blocks with pad_sorted_ids); its
    expert_ids has ceil(align_rows / block_size) entries."""
    rows = max_rows(tokens, top_k, num_experts, block_size)
    return -(-rows // block_size) * block_size if pad_sorted_ids else rows


LAYOUTS = ("kerngen", "align")   # align: moe_align_block_size's sorted_token_ids / expert_ids (vLLM, SGLang)


def check_layout(op: str, layout) -> bool:
    if layout not in LAYOUTS:
        raise InputError(op, "layout", f"one of {', '.join(LAYOUTS)}", repr(layout))
    return layout == "align"


class RoutingWorkspace:
    """Every output of `route` / `permute` for up to max_tokens tokens, allocated once.

    Pass it as `workspace=` to write into it (no allocation: CUDA graphs, a router stream). Results are
    views of it, valid until the next call that uses the same workspace.
    """

    def __init__(self, max_tokens: int, num_experts: int, top_k: int, tile: int | None = None, *,
                 local_experts: tuple[int, int] | None = None, weights_dtype: torch.dtype = torch.float32,
                 device: torch.device | str | int | None = None, layout: str = "kerngen", separate: bool = False):
        check_int("RoutingWorkspace", "max_tokens", max_tokens, 1, 1 << 24)
        check_int("RoutingWorkspace", "num_experts", num_experts, 1, MAX_EXPERTS)
        check_int("RoutingWorkspace", "top_k", top_k, 1, min(MAX_TOPK, num_experts))
        if tile is not None:
            check_int("RoutingWorkspace", "tile", tile, 1, MAX_TILE)
        if weights_dtype not in _WEIGHTS:
            raise InputError("RoutingWorkspace", "weights_dtype", "torch.float32 or torch.bfloat16", str(weights_dtype))
        ls, nl = check_local("RoutingWorkspace", local_experts, num_experts)
        align = check_layout("RoutingWorkspace", layout)
        if align and tile is None:
            raise InputError("RoutingWorkspace", "tile", "the block size (an integer) for layout 'align'", "None")
        try:
            dev = torch.device("cuda") if device is None else torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise InputError("RoutingWorkspace", "device", "a CUDA device (e.g. 'cuda', 'cuda:1' or an index)",
                             repr(device)) from e
        if dev.type not in ("cuda", "cpu"):   # a CPU workspace holds reference results
            raise InputError("RoutingWorkspace", "device", "a CUDA device (or 'cpu')", repr(device))
        if dev.type == "cuda":
            require_gpu("kerngen.RoutingWorkspace")
        if dev.type == "cuda" and dev.index is not None and not 0 <= dev.index < torch.cuda.device_count():
            raise InputError("RoutingWorkspace", "device", f"one of the {torch.cuda.device_count()} visible GPUs",
                             repr(device))
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        T, K = max_tokens, top_k
        self.max_tokens, self.num_experts, self.top_k, self.tile = T, num_experts, K, tile
        self.local_experts, self.weights_dtype, self.device, self.layout = (ls, nl), weights_dtype, dev, layout
        self.max_rows = 0
        sizes = {"ids": T * K}
        if weights_dtype == torch.float32:
            sizes["weights"] = T * K
        if tile is not None:
            # align: the permutation runs over all experts (the range only marks other experts' blocks -1), and
            # the rows are rounded up to whole blocks, room for pad_sorted_ids
            pn = num_experts if align else nl
            self.max_rows = align_rows(T, K, pn, tile, pad_sorted_ids=True) if align else max_rows(T, K, pn, tile)
            sizes.update(counts=pn, offsets=pn + 1, e2p=T * K, p2t=self.max_rows, t2e=self.max_rows // tile,
                         num_rows=1, hist=-(-T // MIN_TOKENS_PER_BLOCK) * pn, ticket=1)
        # One allocation in its initial state (_initial_buffer); ids and weights alone need no fill.
        # every view starts 16-byte aligned, so ids / e2p feed the 128-bit loads of finalize and moe_tail
        # (separate=True: one allocation a view, for outputs that may not alias each other, as a custom op's)
        self._sizes = sizes
        self._pads = [-(-n // 4) * 4 for n in sizes.values()]
        if separate:
            fill = ((lambda n: torch.full((n,), -1, dtype=torch.int32, device=dev)) if tile is not None else
                    (lambda n: torch.empty((n,), dtype=torch.int32, device=dev)))
            self.buffer, self._initial = None, None
            self._views([fill(n) for n in sizes.values()])
            if tile is not None:
                self.ticket.zero_()
        else:
            self.buffer = (self._initial_buffer() if tile is not None else
                           torch.empty((sum(self._pads),), dtype=torch.int32, device=dev))
            self._initial = None
            self._views(self.buffer.split(self._pads))
        # what a call checks a workspace against (route / permute compare it in one tuple)
        self.signature = (num_experts, K, tile, dev.index if dev.type == "cuda" else -1, layout, T, nl,
                          weights_dtype)
        self._results: dict[tuple, Routing] = {}
        self._last: _Fresh | None = None   # fresh(): the last call's buffers, given again once unused

    def _initial_buffer(self) -> torch.Tensor:
        """A buffer of this layout in its initial state: -1 everywhere (num_rows = -1 reads as "no previous
        call") but the ticket, 0 (permute_place leaves it 0 after each call). Written by kernels only, no host
        copy: a workspace may be built inside a CUDA-graph capture."""
        buf = torch.full((sum(self._pads),), -1, dtype=torch.int32, device=self.device)
        at = sum(self._pads[:-1])
        buf[at:at + 1].zero_()
        return buf

    def _views(self, parts) -> None:
        T, K = self.max_tokens, self.top_k
        views = dict(zip(self._sizes, parts))
        for name, n in self._sizes.items():
            if views[name].shape[0] != n:
                views[name] = views[name][:n]
        self.ids = views["ids"].view(T, K)
        self.weights = (views["weights"].view(torch.float32).view(T, K) if "weights" in views
                        else torch.empty((T, K), dtype=self.weights_dtype, device=self.device))
        if self.tile is not None:
            self.counts, self.offsets = views["counts"], views["offsets"]
            self.e2p = views["e2p"].view(T, K)
            self.p2t, self.t2e, self.hist = views["p2t"], views["t2e"], views["hist"]
            self.num_rows = views["num_rows"]
            self.ticket = views["ticket"]

    def fresh(self, tokens: int, stream: int | None = None) -> "RoutingWorkspace | _Fresh":
        """Buffers like this workspace's for a call without workspace= whose results must outlive the next call. A
        prototype of the kerngen layout gives them with one allocation, one copy and one split (a `_Fresh`) — or,
        on the stream and thread of its last call (`stream`, outside a capture), that call's buffers again where
        nothing refers to them any more (`_Fresh.unused`): its results were dropped, and the kernels that read them
        were queued on that stream before this call's (torch's caching allocator's rule for freed memory). Others
        build a new workspace."""
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        ids_only = self.tile is None   # ids and weights only: no initial state, an empty buffer will do
        if (self.buffer is None or self.layout != "kerngen" or tokens != self.max_tokens
                or (self._initial is None and capturing and not ids_only)):
            return self._fresh_workspace()   # (inside a capture the initial state would only be filled on replay)
        last = self._last
        if (last is not None and stream == last.stream and get_ident() == last.thread and not capturing
                and last.unused()):
            return last
        if self._initial is None:   # the initial state and its split (each view, then its padding), once
            self._initial = self.buffer if ids_only else self._initial_buffer()
            self._split = [m for n, pad in zip(self._sizes.values(), self._pads) for m in (n, pad - n)]
        base = torch.empty_like(self._initial) if ids_only else self._initial.clone()
        f = _Fresh(self, dict(zip(self._sizes, torch.split_with_sizes(base, self._split)[::2])))
        if stream is not None and not capturing and _USE_COUNT is not None and "weights" in self._sizes:
            f.stream, f.thread, f._base, self._last = stream, get_ident(), f._refs(), f   # (held: one call's memory)
        return f

    def _fresh_workspace(self) -> "RoutingWorkspace":
        """A new workspace like this one in its initial state (no checks)."""
        new = object.__new__(RoutingWorkspace)
        new.__dict__.update(self.__dict__)
        new._results, new._last = {}, None
        if self.buffer is None:   # separate buffers: build anew
            return RoutingWorkspace(self.max_tokens, self.num_experts, self.top_k, self.tile,
                                    local_experts=self.local_experts, weights_dtype=self.weights_dtype,
                                    device=self.device, layout=self.layout, separate=True)
        new.buffer = torch.empty_like(self.buffer) if self.tile is None else self._initial_buffer()
        new._views(new.buffer.split(self._pads))
        return new

    def result(self, tokens: int, num_local: int, pad_sorted_ids: bool = False) -> Routing:
        """The Routing of a call of `tokens` tokens: views of this workspace, built once per token count."""
        r = self._results.get((tokens, num_local, pad_sorted_ids))
        if r is None:
            r = self._results[(tokens, num_local, pad_sorted_ids)] = self._result(tokens, num_local, pad_sorted_ids)
        return r

    def _result(self, tokens: int, num_local: int, pad_sorted_ids: bool) -> Routing:
        ids, w = self.ids[:tokens], self.weights[:tokens]
        if self.tile is None:
            return Routing(ids, w)
        if self.layout == "align":   # vLLM's buffer sizes: max_num_tokens_padded, max_num_m_blocks
            E, tile = self.num_experts, self.tile
            rows = align_rows(tokens, self.top_k, E, tile, pad_sorted_ids)
            return Routing(ids, w, self.counts[:E], self.offsets[:E + 1], self.e2p[:tokens],
                           num_permuted_rows=self.num_rows[0], sorted_token_ids=self.p2t[:rows],
                           expert_ids=self.t2e[:-(-rows // tile)], num_tokens_post_padded=self.num_rows[:1], tile=tile)
        rows = max_rows(tokens, self.top_k, num_local, self.tile)
        r = Routing(ids, w, self.counts[:num_local], self.offsets[:num_local + 1], self.e2p[:tokens],
                    self.p2t[:rows], self.t2e[:rows // self.tile], self.num_rows[0], tile=self.tile)
        return mark_checked(r, self.device)


def prototype(T: int, E: int, K: int, tile, local, device, layout: str):
    """What gives a call without workspace= of this signature its fresh buffers (`.fresh(T)`): up to
    FRESH_PROTO_TOKENS tokens, where a call's host cost matters and the memory held stays small, a workspace kept
    with its initial state; beyond, the arguments of a new workspace for each call."""
    if T > FRESH_PROTO_TOKENS:
        return _NewEachCall(T, E, K, tile, local_experts=local, device=device, layout=layout)
    return RoutingWorkspace(T, E, K, tile, local_experts=local, device=device, layout=layout)


class _NewEachCall:
    """fresh() builds a new RoutingWorkspace of these arguments."""
    __slots__ = ("args", "kw")

    def __init__(self, *args, **kw):
        self.args, self.kw = args, kw

    def fresh(self, tokens: int, stream: int | None = None) -> RoutingWorkspace:
        return RoutingWorkspace(*self.args, **self.kw)


class _Fresh:
    """The buffers of one call without workspace= (a prototype's layout, exactly its max_tokens tokens): the
    attributes the launches read, and the Routing over them."""
    __slots__ = ("ids", "weights", "counts", "offsets", "e2p", "p2t", "t2e", "num_rows", "hist", "ticket",
                 "max_rows", "device", "_routing", "_tensors", "_storage", "_base", "stream", "thread")

    def __init__(self, proto: RoutingWorkspace, parts: dict):
        T, K = proto.max_tokens, proto.top_k
        self.ids = parts["ids"].view(T, K)
        self.weights = (parts["weights"].view(torch.float32).view(T, K) if "weights" in parts
                        else torch.empty((T, K), dtype=proto.weights_dtype, device=proto.device))
        self.max_rows, self.device = proto.max_rows, proto.device
        if proto.tile is None:   # top-k only (route without a tile): ids and weights, no permutation
            self.e2p = self.counts = self.offsets = self.p2t = self.t2e = self.num_rows = self.hist = None
            self.ticket = None
            self._routing = Routing(self.ids, self.weights)
        else:
            self.e2p = parts["e2p"].view(T, K)
            self.counts, self.offsets = parts["counts"], parts["offsets"]
            self.p2t, self.t2e = parts["p2t"], parts["t2e"]
            self.num_rows, self.hist, self.ticket = parts["num_rows"], parts["hist"], parts["ticket"]
            self._routing = Routing(self.ids, self.weights, self.counts, self.offsets, self.e2p, self.p2t, self.t2e,
                                    self.num_rows.view(()), tile=proto.tile)
            object.__setattr__(self._routing, "checked", (T, K, proto.local_experts[1], proto.tile,
                                                          self.p2t.shape[0], self.t2e.shape[0], proto.signature[3]))
        self._tensors = tuple(t for t in map(self._routing.__getattribute__, _ROUTING_TENSORS)
                              if t is not None)   # (each counted once more; None's count is anyone's)
        self._storage, self.stream, self.thread, self._base = self.ids.untyped_storage(), None, None, None

    def _refs(self) -> tuple:
        """Who refers to these buffers: the Routing object, each of its tensors, and the tensors over the one
        allocation (a view the caller made counts there)."""
        return (sys.getrefcount(self._routing), *map(sys.getrefcount, self._tensors),
                _USE_COUNT(self._storage._cdata) if _USE_COUNT is not None else -1)

    def unused(self) -> bool:
        """Nothing outside refers to the buffers since they were handed out: their results were dropped."""
        return self._refs() == self._base

    def result(self, tokens: int, num_local: int, pad_sorted_ids: bool = False) -> Routing:
        return self._routing


_ROUTING_TENSORS = ("topk_ids", "topk_weights", "expert_counts", "expert_offsets", "expanded_to_permuted",
                    "permuted_to_token", "tile_to_expert", "num_permuted_rows")
# TensorImpls over a storage (torch's own count; without it a call's buffers are never given again)
_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def mark_checked(r: Routing, device: torch.device) -> Routing:
    """Record on a kerngen-built Routing (int32, contiguous buffers on one device) the layout they hold (the
    kerngen layout only: kerngen.experts reads it)."""
    if r.permuted_to_token is None:
        return r
    T, K = r.expanded_to_permuted.shape
    object.__setattr__(r, "checked", (T, K, r.expert_offsets.shape[0] - 1, r.tile, r.permuted_to_token.shape[0],
                                      r.tile_to_expert.shape[0], device.index if device.type == "cuda" else -1))
    return r


# --------------------------------------------------------------------------------------------- reference
def permute_reference(topk_ids: torch.Tensor, num_experts: int, tile: int,
                      local_experts: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The permutation of the module docstring in plain torch, rows of one expert in ascending expanded index."""
    T, K = topk_ids.shape
    ls, nl = local_experts or (0, num_experts)
    dev = topk_ids.device
    x = topk_ids.reshape(-1).long() - ls
    local = (x >= 0) & (x < nl)
    cnt = torch.bincount(x[local], minlength=nl)
    ntile = (cnt + tile - 1) // tile
    tile_off = torch.cumsum(ntile, 0) - ntile
    rows = int(ntile.sum()) * tile
    offsets = torch.cat([tile_off * tile, torch.tensor([rows], device=dev)])
    group = torch.where(local, x, torch.full_like(x, nl))
    order = torch.sort(group, stable=True).indices                       # by expert, then ascending e
    first = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long, device=dev), cnt]), 0)
    sorted_x = group[order]
    keep = sorted_x < nl
    e_sorted, x_sorted = order[keep], sorted_x[keep]
    rank = torch.arange(e_sorted.numel(), device=dev) - first[x_sorted]
    e2p = torch.full((T * K,), -1, dtype=torch.long, device=dev)
    e2p[e_sorted] = offsets[x_sorted] + rank
    cap = max_rows(T, K, nl, tile)
    p2t = torch.full((cap,), -1, dtype=torch.long, device=dev)
    p2t[e2p[e_sorted]] = e_sorted // K
    t2e = torch.full((cap // tile,), -1, dtype=torch.long, device=dev)
    nt = int(ntile.sum())
    t2e[:nt] = torch.repeat_interleave(torch.arange(nl, device=dev), ntile)
    i32 = torch.int32
    return {"expert_counts": cnt.to(i32), "expert_offsets": offsets.to(i32),
            "expanded_to_permuted": e2p.view(T, K).to(i32), "permuted_to_token": p2t.to(i32),
            "tile_to_expert": t2e.to(i32), "num_permuted_rows": torch.tensor(rows, dtype=i32, device=dev)}


def align_reference(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                    local_experts: tuple[int, int] | None = None, pad_sorted_ids: bool = False):
    """moe_align_block_size's outputs in plain torch, from kerngen's permutation over all experts:
    (sorted_token_ids, expert_ids, num_tokens_post_padded [1]). Expanded indices e = t*K + k in expert order
    (ascending e within an expert), each expert padded to block_size with T*K, T*K after the last block;
    expert_ids the block's expert as a local index, -1 outside local_experts, and past the used blocks what
    vLLM's zero-filled, expert_map-mapped buffer holds (expert 0 mapped: 0 if it is local, else -1). Ids outside
    [0, num_experts) are skipped."""
    T, K = topk_ids.shape
    ls, nl = local_experts or (0, num_experts)
    p = permute_reference(topk_ids, num_experts, block_size)
    rows = align_rows(T, K, num_experts, block_size, pad_sorted_ids)
    sorted_ids = torch.full((rows,), T * K, dtype=torch.int32, device=topk_ids.device)
    e2p = p["expanded_to_permuted"].flatten().long()
    valid = e2p >= 0
    sorted_ids[e2p[valid]] = torch.arange(T * K, device=topk_ids.device, dtype=torch.int32)[valid]
    unused = 0 if ls == 0 else -1
    blocks = torch.full((-(-rows // block_size),), unused, dtype=torch.int32, device=topk_ids.device)
    used = int(p["num_permuted_rows"]) // block_size
    x = p["tile_to_expert"][:used].long()
    blocks[:used] = torch.where((x >= ls) & (x < ls + nl), x - ls, torch.full_like(x, -1)).to(torch.int32)
    return sorted_ids, blocks, p["num_permuted_rows"].reshape(1)


# ----------------------------------------------------------------------------------------------- planning
def with_align(tag: str, consts: dict, align: bool) -> tuple[str, dict]:
    """The align layout is a build of its own (ALIGN only in its constants: kerngen-layout builds unchanged)."""
    return (f"{tag}-align", {**consts, "ALIGN": True}) if align else (tag, consts)


def spec(E: int, K: int, tokens: int, arch_: str, tbl: Table | None = None,
         align: bool = False) -> plan_mod.KernelSpec:
    """The permute kernel the tier table gives this shape (`align`: the moe_align_block_size layout's build)."""
    return plan_mod.plan(tbl or table(), OP, {"num_experts": E, "top_k": K, "tokens": tokens},
                         *with_align(f"E{E}-K{K}", {"E": E, "K": K}, align), arch_)


def explain_spec(tbl: Table, arch_: str, *, experts: int, top_k: int, tokens: int, **_shape) -> plan_mod.KernelSpec:
    """The permute kernel `kerngen explain --op permute` names; other shape keywords (hidden, model) do not apply."""
    return spec(experts, top_k, max(tokens, 1), arch_, tbl)


def model_specs(model: Model, tbl: Table, arch_: str) -> list[plan_mod.KernelSpec]:
    """Every permute kernel `model` can dispatch to over its token range."""
    E, K = model.num_experts, model.top_k
    shape = {"num_experts": E, "top_k": K, "hidden": model.hidden, "arch": arch_}
    return [plan_mod.spec_for(rule, f"E{E}-K{K}", {"E": E, "K": K}, arch_)
            for rule in tbl.rules_for(OP, shape, model.tokens)]


# ----------------------------------------------------------------------------------------------- launching
class Permute:
    """The permutation launches for T tokens: one kernel (onepass) or three (histogram), as the tier says."""

    def __init__(self, s: plan_mod.KernelSpec, T: int, dev: int):
        p, E, K = dict(s.params), dict(s.constants)["E"], dict(s.constants)["K"]
        if s.variant == "onepass":
            threads, ctas = int(p.get("threads", 1024)), int(p.get("ctas", 1))
            if threads % 32 or not 32 <= threads <= 1024 or not 1 <= ctas <= SMS:
                raise InputError(OP, "tier params", f"threads a multiple of 32 in [32, 1024], ctas in [1, {SMS}]",
                                 str(s.params))
            smem = onepass_smem_bytes(E, K, T)
            if smem > MAX_DYNAMIC_SMEM:
                raise TierError(f"permute rule {s.variant} {s.params} at E={E}, K={K}, T={T} needs {smem} bytes of "
                                f"shared memory, more than {MAX_DYNAMIC_SMEM}: give these tokens a histogram rule")
            self.launches = [Launcher(resolve(s), "permute_onepass", dev, (ctas, 1, 1), (threads, 1, 1), PARAMS,
                                      smem=smem, pdl=True)]
            self.first_needs_tokens = False
            return
        if s.variant != "histogram":
            raise InputError(OP, "tier variant", "onepass or histogram", s.variant)
        c = int(p["tokens_per_block"])
        if c < MIN_TOKENS_PER_BLOCK:
            raise InputError(OP, "tier params", f"tokens_per_block >= {MIN_TOKENS_PER_BLOCK}", str(s.params))
        mod = resolve(s)
        nb = -(-T // c)
        place = -(-E // 8) + -(-T * K // 256)   # layout CTAs (a warp per expert), then a thread per entry
        self.launches = [
            Launcher(mod, "permute_block_rank", dev, (nb, 1, 1), (256, 1, 1), PARAMS, pdl=True),
            Launcher(mod, "permute_offsets", dev, (-(-E // 32), 1, 1), (1024, 1, 1), PARAMS, pdl=True),
            Launcher(mod, "permute_place", dev, (place, 1, 1), (256, 1, 1), PARAMS, pdl=True)]
        self.first_needs_tokens = True   # permute_block_rank has no CTA at T = 0

    def __call__(self, stream, ids_ptr, ws: RoutingWorkspace, T: int, tile: int, ls: int, nl: int):
        counts, offsets, e2p, p2t = ws.counts.data_ptr(), ws.offsets.data_ptr(), ws.e2p.data_ptr(), ws.p2t.data_ptr()
        t2e, num_rows = ws.t2e.data_ptr(), ws.num_rows.data_ptr()
        hist, ticket = ws.hist.data_ptr(), ws.ticket.data_ptr()
        for i, launcher in enumerate(self.launches):
            if T or i or not self.first_needs_tokens:
                launcher.launch(stream, ids=ids_ptr, counts=counts, offsets=offsets, e2p=e2p, p2t=p2t, t2e=t2e,
                                num_rows=num_rows, hist=hist, ticket=ticket, tokens=T, tile=tile, local_start=ls,
                                num_local=nl, max_rows=ws.max_rows)


def onepass_smem_bytes(E: int, K: int, T: int) -> int:
    """Dynamic shared memory of permute_onepass (templates/permute/onepass.cu.j2): counts and first tiles of
    every expert, ids and tile padding rows of every entry, a token bitmask per expert."""
    return 4 * (2 * (-(-E // 4) * 4) + 2 * T * K + -(-T // 32) * E)


def kernel(s: plan_mod.KernelSpec, tokens: int, device: int) -> Permute:
    """The launches of permute spec `s` for `tokens` tokens on `device`."""
    return Permute(s, tokens, device)


def _clear_scratch() -> None:
    """Forget the scratch workspaces (dispatch.clear())."""
    _scratch.clear()


def dispatch(device: int, *, E: int, K: int, align: bool) -> Dispatch:
    """The permute launches of this shape on `device`, per token bucket of the tier table."""
    def build() -> Dispatch:
        a = arch(device)
        return Dispatch(
            OP, {"num_experts": E, "top_k": K}, rule_spec(with_align(f"E{E}-K{K}", {"E": E, "K": K}, align), a),
            kernel, device, arch=a)

    return lookup((OP, E, K, align, device), build)


_calls = calls(OP)   # signature -> (launches, prototype of fresh buffers or None, T, K, ls, nl, device,
#                                [T, 0] weights)


def permute(topk_ids: torch.Tensor, *, num_experts: int, tile: int, local_experts: tuple[int, int] | None = None,
            workspace: RoutingWorkspace | None = None, layout: str = "kerngen",
            pad_sorted_ids: bool = False) -> Routing:
    """The permutation of top-k ids computed elsewhere ([T, K] int32, contiguous; CUDA); same outputs as route.

    Ids outside the local range are skipped (-1 in expanded_to_permuted). A token may name an expert more than
    once; its entries then take consecutive rows in ascending k (exact, but the one-pass kernel takes a slower
    path for the whole call). The returned Routing's topk_ids is `topk_ids` itself and topk_weights is empty
    ([T, 0]). layout="align" writes moe_align_block_size's outputs (route's docstring; pad_sorted_ids rounds
    sorted_token_ids' length up to whole blocks, as vLLM's flag does). On CPU tensors use `permute_reference`.
    """
    try:   # the signature pins everything the checks establish
        sig = (topk_ids.dtype, topk_ids.shape, topk_ids.is_contiguous(), topk_ids.get_device(), num_experts, tile,
               local_experts, layout, pad_sorted_ids, None if workspace is None else workspace.signature,
               type(num_experts), type(tile), type(pad_sorted_ids))   # 8 == 8.0 == True: the kinds pinned too
        hit = _calls.get(sig)
    except (AttributeError, TypeError):   # a wrong type or an unhashable value: the checks name it
        sig, hit = None, None
    if hit is None:
        hit = _calls.remember(sig, _prepare(topk_ids, num_experts, tile, local_experts, workspace, layout,
                                            pad_sorted_ids))
    launches, proto, T, K, ls, nl, dev, proto_weights = hit
    stream = current_stream(dev)
    ws = proto.fresh(T, stream) if workspace is None else workspace
    launches(stream, topk_ids.data_ptr(), ws, T, tile, ls, nl)
    return _with_ids(ws.result(T, nl, pad_sorted_ids), topk_ids, proto_weights)


def _with_ids(res: Routing, topk_ids: torch.Tensor, no_weights: torch.Tensor) -> Routing:
    """The workspace's Routing with the caller's ids and no weights ([T, 0]); its checked layout carried over."""
    r = Routing(topk_ids, no_weights, res.expert_counts, res.expert_offsets, res.expanded_to_permuted,
                res.permuted_to_token, res.tile_to_expert, res.num_permuted_rows, res.sorted_token_ids,
                res.expert_ids, res.num_tokens_post_padded, res.tile)
    object.__setattr__(r, "checked", res.checked)
    return r


def _prepare(topk_ids, num_experts, tile, local_experts, workspace, layout, pad_sorted_ids) -> tuple:
    """Every check of permute's arguments, then its launches and what gives a call without workspace= its fresh
    buffers (None with workspace=)."""
    T, K, ls, nl = check_ids(OP, topk_ids, num_experts, "tile", tile, local_experts)
    align = check_layout(OP, layout)
    if not isinstance(pad_sorted_ids, bool):
        raise InputError(OP, "pad_sorted_ids", "True or False", repr(pad_sorted_ids))
    check_tensor(OP, "topk_ids", topk_ids, device=None)
    proto = None
    if workspace is None:   # the prototype of the fresh workspace of each call
        proto = prototype(max(T, 1), num_experts, K, tile, (ls, nl), topk_ids.device, layout)
    else:
        check_workspace(OP, workspace, T, num_experts, K, tile, nl, topk_ids.device, layout)
    dev = topk_ids.get_device()
    # an empty [T, 0] topk_weights, shared by the calls of this signature (it holds no data)
    no_weights = topk_ids.new_empty((T, 0), dtype=torch.float32)
    return dispatch(dev, E=num_experts, K=K, align=align).served(T), proto, T, K, ls, nl, dev, no_weights


class _AlignTarget:
    """The align layout written straight into caller buffers (sorted_token_ids, expert_ids, num_tokens_post_pad,
    as vLLM's op takes them); counts, offsets and rows come from a scratch workspace."""

    def __init__(self, ws: RoutingWorkspace, sorted_ids, expert_ids, num_post_pad):
        self.counts, self.offsets, self.e2p, self.hist, self.ticket = ws.counts, ws.offsets, ws.e2p, ws.hist, ws.ticket
        self.p2t, self.t2e, self.num_rows, self.max_rows = sorted_ids, expert_ids, num_post_pad, sorted_ids.shape[0]


_scratch: dict[tuple, RoutingWorkspace] = {}


def permute_align_into(topk_ids: torch.Tensor, num_experts: int, block_size: int, sorted_token_ids: torch.Tensor,
                       expert_ids: torch.Tensor, num_tokens_post_pad: torch.Tensor,
                       local_experts: tuple[int, int] | None = None) -> None:
    """The align layout of `permute` written into the given buffers (one launch; no copies), vLLM's
    `ops.moe_align_block_size(topk_ids, num_experts, block_size, sorted_ids, expert_ids, num_tokens_post_pad)`:
    sorted_token_ids int32 [>= T*K + E*(block_size-1)] (every entry is written), expert_ids int32
    [>= ceil(len(sorted_token_ids) / block_size)], num_tokens_post_pad int32 [1]; all 16-byte aligned. Ids
    outside [0, num_experts) are skipped, as `align_reference` skips them."""
    T, K, ls, nl = check_align_into("moe_align_block_size", topk_ids, num_experts, block_size, sorted_token_ids,
                                    expert_ids, num_tokens_post_pad, local_experts)
    dev = topk_ids.get_device()
    skey = (num_experts, K, block_size, dev)
    ws = _scratch.get(skey)
    if ws is None or ws.max_tokens < T:
        ws = _scratch[skey] = RoutingWorkspace(max(T, 1), num_experts, K, block_size, device=topk_ids.device,
                                               layout="align")
    target = _AlignTarget(ws, sorted_token_ids, expert_ids, num_tokens_post_pad)
    launches = dispatch(dev, E=num_experts, K=K, align=True).served(T)
    launches(current_stream(dev), topk_ids.data_ptr(), target, T, block_size, ls, nl)


# ----------------------------------------------------------------------------------------------- checks
def check_ids(op, topk_ids, num_experts, tile_name, tile, local_experts) -> tuple[int, int, int, int]:
    """Top-k ids computed elsewhere ([T, K] int32, contiguous; any device: the caller checks it is CUDA) with
    their expert count, tile and local range; returns (T, K, local_start, num_local)."""
    check_tensor(op, "topk_ids", topk_ids, dtypes=(torch.int32,), ndim=2, contiguous=True,
                 device=getattr(topk_ids, "device", None))
    check_int(op, "num_experts", num_experts, 1, MAX_EXPERTS)
    T, K = topk_ids.shape
    check_int(op, "topk_ids.shape[1]", K, 1, min(MAX_TOPK, num_experts))
    check_int(op, tile_name, tile, 1, MAX_TILE)
    return (T, K, *check_local(op, local_experts, num_experts))


def check_align_into(op, topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_pad,
                     local_experts=None, *, cuda: bool = True) -> tuple[int, int, int, int]:
    """Every check of `permute_align_into`'s arguments (cuda=False: of its CPU entry point, which runs
    `align_reference`); returns (T, K, local_start, num_local)."""
    T, K, ls, nl = check_ids(op, topk_ids, num_experts, "block_size", block_size, local_experts)
    if cuda:
        check_tensor(op, "topk_ids", topk_ids)
    need = max_rows(T, K, num_experts, block_size)
    for name, t, n in (("sorted_token_ids", sorted_token_ids, need), ("num_tokens_post_pad", num_tokens_post_pad, 1),
                       ("expert_ids", expert_ids, -(-sorted_token_ids.shape[0] // block_size)
                        if isinstance(sorted_token_ids, torch.Tensor) and sorted_token_ids.dim() == 1 else 1)):
        check_tensor(op, name, t, dtypes=(torch.int32,), ndim=1, device=topk_ids.device, contiguous=True)
        if t.shape[0] < n:
            raise InputError(op, name, f"of length >= {n}", f"length {t.shape[0]}")
        if t.data_ptr() % 16:
            raise InputError(op, name, "16-byte aligned (the kernel's vector stores)", f"offset {t.data_ptr() % 16}")
    return T, K, ls, nl


def check_workspace(op, ws, T, E, K, tile, nl, device, layout="kerngen"):
    if not isinstance(ws, RoutingWorkspace):
        raise InputError(op, "workspace", "a kerngen.RoutingWorkspace", type(ws).__name__)
    if ws.layout != layout:
        raise InputError(op, "workspace", f"built for layout={layout!r}", f"layout={ws.layout!r}")
    if ws.num_experts != E or ws.top_k != K or ws.tile != tile or ws.device != device:
        raise InputError(op, "workspace", f"built for num_experts={E}, top_k={K}, tile={tile} on {device}",
                         f"num_experts={ws.num_experts}, top_k={ws.top_k}, tile={ws.tile} on {ws.device}")
    if T > ws.max_tokens or nl > ws.local_experts[1]:
        raise InputError(op, "workspace", f"room for {T} tokens and {nl} local experts",
                         f"max_tokens={ws.max_tokens}, num_local={ws.local_experts[1]}")



on_clear(_clear_scratch)


reference = permute_reference   # each op's CPU semantics are kerngen.ops.<op>.reference
