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

import torch

from .. import plan as plan_mod
from ..errors import InputError, TierError
from ..dispatch import Dispatch, OpDispatch, rule_spec
from ..launch import Launcher, Params, current_stream
from ..tiers import SMS, Model, Table
from ._common import arch, check_tensor, resolve, table
# the reference, the buffers and the checks live in modules of their own; re-exported here
from .permute_buffers import (FRESH_PROTO_TOKENS, LAYOUTS, MAX_TILE, MIN_TOKENS_PER_BLOCK,  # noqa: F401
                              _USE_COUNT, _WEIGHTS, Routing, RoutingWorkspace, check_layout, mark_checked, prototype)
from .permute_checks import check_align_into, check_ids, check_workspace  # noqa: F401
from .permute_reference import align_reference, align_rows, max_rows, permute_reference  # noqa: F401

OP = "permute"
# struct Params of templates/permute/histogram.cu.j2 and onepass.cu.j2 (hist and ticket unused by onepass)
PARAMS = Params(("ids", "ptr"), ("counts", "ptr"), ("offsets", "ptr"), ("e2p", "ptr"), ("p2t", "ptr"), ("t2e", "ptr"),
                ("num_rows", "ptr"), ("hist", "ptr"), ("ticket", "ptr"), ("tokens", "int"), ("tile", "int"),
                ("local_start", "int"), ("num_local", "int"), ("max_rows", "int"))
MAX_DYNAMIC_SMEM = 226 * 1024        # onepass permute: sm_90 gives a CTA 227 KiB, less its static arrays

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


def _dispatch(device: int, *, E: int, K: int, align: bool) -> Dispatch:
    """The permute launches of this shape on `device`, per token bucket of the tier table."""
    a = arch(device)
    return Dispatch(OP, {"num_experts": E, "top_k": K},
                    rule_spec(with_align(f"E{E}-K{K}", {"E": E, "K": K}, align), a), kernel, device, arch=a)


dispatch = OpDispatch(OP, _dispatch)
_calls = dispatch.calls   # signature -> (launches, prototype of fresh buffers or None, T, K, ls, nl, device,
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
    d = dispatch(dev, E=num_experts, K=K, align=True)
    launches = d.served(T)
    # the scratch workspace of this block size, kept by the shape's dispatch object and grown to the most tokens seen;
    # one for all streams (one per stream would be allocated inside a capture, on its side stream, and outlive it)
    ws = d.kept.get(("align scratch", block_size))
    if ws is None or ws.max_tokens < T:
        ws = d.kept[("align scratch", block_size)] = RoutingWorkspace(max(T, 1), num_experts, K, block_size,
                                                                      device=topk_ids.device, layout="align")
    target = _AlignTarget(ws, sorted_token_ids, expert_ids, num_tokens_post_pad)
    launches(current_stream(dev), topk_ids.data_ptr(), target, T, block_size, ls, nl)


reference = permute_reference   # each op's CPU semantics are kerngen.ops.<op>.reference
