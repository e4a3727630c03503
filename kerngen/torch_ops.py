"""torch custom ops: kerngen::finalize, kerngen::route, kerngen::route_permute, kerngen::moe_align_block_size,
kerngen::moe_tail.

They trace under torch.compile(fullgraph=True) (fake implementations give output shapes) and capture in
CUDA graphs. A CPU implementation (the torch reference) lets pipelines run and be checked on the CPU.
Calling kerngen.finalize / route / moe_tail directly is cheaper on the host (no dispatcher).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .ops import finalize as _fin
from .ops import permute as _pm
from .ops import routing as _rt
from .ops import tail as _tail


# ------------------------------------------------------------------------------------------------ finalize
@torch.library.custom_op("kerngen::finalize", mutates_args=(), device_types="cuda")
def finalize(gemm2_out: Tensor, expanded_to_permuted: Tensor, topk_weights: Tensor,
             hidden: int | None = None) -> Tensor:
    return _fin.finalize(gemm2_out, expanded_to_permuted, topk_weights, hidden=hidden)


@finalize.register_kernel("cpu")
def _finalize_cpu(gemm2_out, expanded_to_permuted, topk_weights, hidden=None):
    return _fin.reference(gemm2_out, expanded_to_permuted, topk_weights, hidden)


@finalize.register_fake
def _finalize_fake(gemm2_out, expanded_to_permuted, topk_weights, hidden=None):
    H = gemm2_out.shape[1] if hidden is None else hidden
    return gemm2_out.new_empty((expanded_to_permuted.shape[0], H))


# ------------------------------------------------------------------------------------------------- routing
@torch.library.custom_op("kerngen::route", mutates_args=(), device_types="cuda")
def route(logits: Tensor, top_k: int, method: str, bias: Tensor | None = None, n_group: int = 1,
          topk_group: int = 1, routed_scaling_factor: float = 1.0, renormalize: bool = True) -> tuple[Tensor, Tensor]:
    r = _rt.route(logits, top_k=top_k, method=method, bias=bias, n_group=n_group, topk_group=topk_group,
                  routed_scaling_factor=routed_scaling_factor, renormalize=renormalize)
    # route's outputs are views of one workspace buffer; a custom op's outputs may not alias each other.
    return r.topk_ids.clone(), r.topk_weights.clone()


@route.register_kernel("cpu")
def _route_cpu(logits, top_k, method, bias=None, n_group=1, topk_group=1, routed_scaling_factor=1.0,
               renormalize=True):
    _rt.check_args(logits, top_k, method, bias, n_group, topk_group, renormalize, rsf=routed_scaling_factor,
                   cuda=False)
    ids, w = _rt.reference(logits, top_k, method, bias, n_group, topk_group, routed_scaling_factor, renormalize)
    return ids, w


@route.register_fake
def _route_fake(logits, top_k, method, bias=None, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                renormalize=True):
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
    T, E = logits.shape
    nl = E - local_start if num_local < 0 else num_local
    rows = _pm.max_rows(T, top_k, nl, tile)
    i32 = dict(dtype=torch.int32)
    return (logits.new_empty((T, top_k), **i32), logits.new_empty((T, top_k), dtype=torch.float32),
            logits.new_empty((nl,), **i32), logits.new_empty((nl + 1,), **i32), logits.new_empty((T, top_k), **i32),
            logits.new_empty((rows,), **i32), logits.new_empty((rows // tile,), **i32), logits.new_empty((), **i32))


# ---------------------------------------------------------------------------- moe_align_block_size (vLLM's)
@torch.library.custom_op("kerngen::moe_align_block_size",
                         mutates_args=("sorted_token_ids", "expert_ids", "num_tokens_post_pad"), device_types="cuda")
def moe_align_block_size(topk_ids: Tensor, num_experts: int, block_size: int, sorted_token_ids: Tensor,
                         expert_ids: Tensor, num_tokens_post_pad: Tensor) -> None:
    """vLLM's `ops.moe_align_block_size`: writes the block layout into the given buffers (one launch)."""
    _pm.permute_align_into(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_pad)


@moe_align_block_size.register_kernel("cpu")
def _moe_align_block_size_cpu(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_pad):
    s, e, n = _pm.align_reference(topk_ids, block_size, num_experts)
    sorted_token_ids.fill_(topk_ids.numel())
    sorted_token_ids[:s.shape[0]].copy_(s)
    expert_ids.fill_(0)
    expert_ids[:e.shape[0]].copy_(e)
    num_tokens_post_pad.copy_(n)


@moe_align_block_size.register_fake
def _moe_align_block_size_fake(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_pad):
    return None


# --------------------------------------------------------------------------------------------------- tail
@torch.library.custom_op("kerngen::moe_tail", mutates_args=(), device_types="cuda")
def moe_tail(gemm2_out: Tensor, expanded_to_permuted: Tensor, topk_weights: Tensor, norm_weight: Tensor,
             eps: float = 1e-6, shared: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    return _tail.moe_tail(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, eps=eps, shared=shared,
                          residual=residual)


@moe_tail.register_kernel("cpu")
def _moe_tail_cpu(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, eps=1e-6, shared=None,
                  residual=None):
    return _tail.reference(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, eps=eps, shared=shared,
                           residual=residual)[0]


@moe_tail.register_fake
def _moe_tail_fake(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, eps=1e-6, shared=None,
                   residual=None):
    return gemm2_out.new_empty((expanded_to_permuted.shape[0], norm_weight.shape[0]))
