"""permute's results and buffers: the Routing that route and permute return, the RoutingWorkspace they write into, and
the fresh buffers of a call without workspace= (kerngen.ops.permute re-exports them)."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from threading import get_ident

import torch

from ..errors import InputError
from ..tiers import MAX_EXPERTS, MAX_TOPK
from ._common import check_int, check_local, require_gpu
from .permute_reference import align_rows, max_rows

_WEIGHTS = (torch.float32, torch.bfloat16)
MIN_TOKENS_PER_BLOCK = 16          # permute tiers: the histogram scratch is sized for this
FRESH_PROTO_TOKENS = 64           # calls without workspace= up to this many tokens keep a prototype of their buffers
MAX_TILE = 1024                      # rows per tile of a permutation (one CTA's threads pad a tile)


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
        except (RuntimeError, TypeError, ValueError) as e:   # ValueError: an index past a long long
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
        if separate:   # each view in its initial state by one fill (ids and weights need none): a kernel each
            def part(name: str, n: int) -> torch.Tensor:
                if tile is None or name in ("ids", "weights"):
                    return torch.empty((n,), dtype=torch.int32, device=dev)
                return torch.full((n,), 0 if name == "ticket" else -1, dtype=torch.int32, device=dev)
            self.buffer, self._initial = None, None
            self._views([part(name, n) for name, n in sizes.items()])
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
