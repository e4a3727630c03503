"""torch.ops.kerngen.latent_tail: kerngen.latent_tail as a torch custom op (kerngen/torch_ops.py says how they
behave)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import check_env
from . import latent_tail as _lt
from ._torch import concrete, dims, one_device


@torch.library.custom_op("kerngen::latent_tail", mutates_args=(), device_types="cuda")
def latent_tail(gemm2_out: Tensor, expanded_to_permuted: Tensor, topk_weights: Tensor, norm_weight: Tensor,
                up_proj: Tensor, eps: float = 1e-6, shared: Tensor | None = None,
                residual: Tensor | None = None) -> Tensor:
    return _lt.latent_tail(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, up_proj, eps=eps, shared=shared,
                           residual=residual, own_scratch=True)


@latent_tail.register_kernel("cpu")
def _latent_tail_cpu(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, up_proj, eps=1e-6, shared=None,
                     residual=None):
    check_env()
    _lt.check_args(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, up_proj, shared, residual, eps,
                   cuda=False)
    return _lt.reference(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, up_proj, shared=shared,
                         residual=residual, eps=eps)


@latent_tail.register_fake
def _latent_tail_fake(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, up_proj, eps=1e-6, shared=None,
                      residual=None):
    dims("latent_tail", gemm2_out=(gemm2_out, (2,)), expanded_to_permuted=(expanded_to_permuted, (2,)),
         up_proj=(up_proj, (2,)))
    one_device("latent_tail", gemm2_out=gemm2_out, expanded_to_permuted=expanded_to_permuted,
               topk_weights=topk_weights, norm_weight=norm_weight, up_proj=up_proj, shared=shared, residual=residual)
    if concrete(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, up_proj, shared, residual):
        _lt.check_args(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, up_proj, shared, residual, eps,
                       cuda=False)
    return gemm2_out.new_empty((expanded_to_permuted.shape[0], up_proj.shape[0]))
