"""torch.ops.kerngen.moe_tail: kerngen.moe_tail as a torch custom op (kerngen/torch_ops.py says how they behave)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import check_env
from . import _common
from . import tail as _tail
from ._torch import concrete, dims, one_device


@torch.library.custom_op("kerngen::moe_tail", mutates_args=(), device_types="cuda")
def moe_tail(gemm2_out: Tensor, expanded_to_permuted: Tensor, topk_weights: Tensor, norm_weight: Tensor,
             eps: float = 1e-6, shared: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    return _tail.moe_tail(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, eps=eps, shared=shared,
                          residual=residual)


@moe_tail.register_kernel("cpu")
def _moe_tail_cpu(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, eps=1e-6, shared=None,
                  residual=None):
    check_env()
    _tail.check_args(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, shared, residual, cuda=False)
    _common.check_eps(_tail.OP, eps)
    return _tail.reference(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, eps=eps, shared=shared,
                           residual=residual)[0]


@moe_tail.register_fake
def _moe_tail_fake(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, eps=1e-6, shared=None,
                   residual=None):
    dims("moe_tail", gemm2_out=(gemm2_out, (2,)), expanded_to_permuted=(expanded_to_permuted, (2,)),
         norm_weight=(norm_weight, (1,)))
    one_device("moe_tail", gemm2_out=gemm2_out, expanded_to_permuted=expanded_to_permuted,
               topk_weights=topk_weights, norm_weight=norm_weight, shared=shared, residual=residual)
    if concrete(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, shared, residual):
        _tail.check_args(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, shared, residual, cuda=False)
    _common.check_eps(_tail.OP, eps)
    return gemm2_out.new_empty((expanded_to_permuted.shape[0], norm_weight.shape[0]))
