"""torch.ops.kerngen.route and route_permute: kerngen.route, without and with the permutation, as torch custom ops
(kerngen/torch_ops.py says how they behave)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import check_env
from . import permute as _pm
from . import routing as _rt
from ._torch import concrete, dims, one_device


def _logits(logits) -> None:
    """logits [T, E] before the CUDA paths read its shape (a cheap test first: a host cost of each eager call)."""
    if not (isinstance(logits, Tensor) and logits.dim() == 2):
        dims(_rt.OP, logits=(logits, (2,)))


@torch.library.custom_op("kerngen::route", mutates_args=(), device_types="cuda")
def route(logits: Tensor, top_k: int, method: str, bias: Tensor | None = None, n_group: int = 1,
          topk_group: int = 1, routed_scaling_factor: float = 1.0, renormalize: bool = True) -> tuple[Tensor, Tensor]:
    _logits(logits)
    # a workspace of this call's own, one allocation a view: a custom op's outputs may not alias each other
    ws = _pm.RoutingWorkspace(max(logits.shape[0], 1), logits.shape[1], top_k, None, device=logits.device,
                              separate=True)
    r = _rt.route(logits, top_k=top_k, method=method, bias=bias, n_group=n_group, topk_group=topk_group,
                  routed_scaling_factor=routed_scaling_factor, renormalize=renormalize, workspace=ws)
    return r.topk_ids, r.topk_weights


@route.register_kernel("cpu")
def _route_cpu(logits, top_k, method, bias=None, n_group=1, topk_group=1, routed_scaling_factor=1.0,
               renormalize=True):
    check_env()
    _rt.check_args(logits, top_k, method, bias, n_group, topk_group, renormalize, rsf=routed_scaling_factor,
                   cuda=False)
    ids, w = _rt.reference(logits, top_k, method, bias, n_group, topk_group, routed_scaling_factor, renormalize)
    return ids, w


@route.register_fake
def _route_fake(logits, top_k, method, bias=None, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                renormalize=True):
    dims(_rt.OP, logits=(logits, (2,)))
    one_device("route", logits=logits, bias=bias)
    if concrete(logits, bias):
        _rt.check_args(logits, top_k, method, bias, n_group, topk_group, renormalize, rsf=routed_scaling_factor,
                       cuda=False)
    T = logits.shape[0]
    return (logits.new_empty((T, top_k), dtype=torch.int32), logits.new_empty((T, top_k), dtype=torch.float32))


# ------------------------------------------------------------------------------------- route + permutation
@torch.library.custom_op("kerngen::route_permute", mutates_args=(), device_types="cuda")
def route_permute(logits: Tensor, top_k: int, method: str, tile: int, bias: Tensor | None = None, n_group: int = 1,
                  topk_group: int = 1, routed_scaling_factor: float = 1.0, renormalize: bool = True,
                  local_start: int = 0, num_local: int = -1) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                       Tensor, Tensor]:
    """route with the whole permutation: (topk_ids, topk_weights, expert_counts, expert_offsets,
    expanded_to_permuted, permuted_to_token, tile_to_expert, num_permuted_rows); num_local = -1: all experts."""
    _logits(logits)
    E = logits.shape[1]
    local = (local_start, E - local_start if num_local < 0 else num_local)
    ws = _pm.RoutingWorkspace(max(logits.shape[0], 1), E, top_k, tile, local_experts=local, device=logits.device,
                              separate=True)
    r = _rt.route(logits, top_k=top_k, method=method, bias=bias, n_group=n_group, topk_group=topk_group,
                  routed_scaling_factor=routed_scaling_factor, renormalize=renormalize, tile=tile,
                  local_experts=local, workspace=ws)
    return _permutation(r)


def _permutation(r) -> tuple:
    return (r.topk_ids, r.topk_weights, r.expert_counts, r.expert_offsets, r.expanded_to_permuted,
            r.permuted_to_token, r.tile_to_expert, r.num_permuted_rows)


@route_permute.register_kernel("cpu")
def _route_permute_cpu(logits, top_k, method, tile, bias=None, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                       renormalize=True, local_start=0, num_local=-1):
    check_env()
    dims(_rt.OP, logits=(logits, (2,)))
    E = logits.shape[1]
    local = (local_start, E - local_start if num_local < 0 else num_local)
    _rt.check_args(logits, top_k, method, bias, n_group, topk_group, renormalize, tile, local,
                   rsf=routed_scaling_factor, cuda=False)
    ids, w = _rt.reference(logits, top_k, method, bias, n_group, topk_group, routed_scaling_factor, renormalize)
    p = _pm.permute_reference(ids, E, tile, local)
    return (ids, w, p["expert_counts"], p["expert_offsets"], p["expanded_to_permuted"], p["permuted_to_token"],
            p["tile_to_expert"], p["num_permuted_rows"])


@route_permute.register_fake
def _route_permute_fake(logits, top_k, method, tile, bias=None, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                        renormalize=True, local_start=0, num_local=-1):
    dims(_rt.OP, logits=(logits, (2,)))
    one_device("route", logits=logits, bias=bias)
    T, E = logits.shape
    nl = E - local_start if num_local < 0 else num_local
    if concrete(logits, bias):
        _rt.check_args(logits, top_k, method, bias, n_group, topk_group, renormalize, tile, (local_start, nl),
                       rsf=routed_scaling_factor, cuda=False)
    rows = _pm.max_rows(T, top_k, nl, tile)
    i32 = dict(dtype=torch.int32)
    return (logits.new_empty((T, top_k), **i32), logits.new_empty((T, top_k), dtype=torch.float32),
            logits.new_empty((nl,), **i32), logits.new_empty((nl + 1,), **i32), logits.new_empty((T, top_k), **i32),
            logits.new_empty((rows,), **i32), logits.new_empty((rows // tile,), **i32), logits.new_empty((), **i32))
