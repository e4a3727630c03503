"""torch custom ops: kerngen::finalize, kerngen::route, kerngen::moe_tail.

They trace under torch.compile(fullgraph=True) (fake implementations give output shapes) and capture in
CUDA graphs. A CPU implementation (the torch reference) lets pipelines run and be checked on the CPU.
Calling kerngen.finalize / route / moe_tail directly is cheaper on the host (no dispatcher).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .ops import finalize as _fin
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
