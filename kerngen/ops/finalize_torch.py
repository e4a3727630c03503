"""torch.ops.kerngen.finalize: kerngen.finalize as a torch custom op (kerngen/torch_ops.py says how they behave)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import check_env
from . import finalize as _fin
from ._torch import concrete, dims, one_device


@torch.library.custom_op("kerngen::finalize", mutates_args=(), device_types="cuda")
def finalize(gemm2_out: Tensor, expanded_to_permuted: Tensor, topk_weights: Tensor,
             hidden: int | None = None) -> Tensor:
    return _fin.finalize(gemm2_out, expanded_to_permuted, topk_weights, hidden=hidden)


@finalize.register_kernel("cpu")
def _finalize_cpu(gemm2_out, expanded_to_permuted, topk_weights, hidden=None):
    check_env()
    _fin.check_args(gemm2_out, expanded_to_permuted, topk_weights, hidden, cuda=False)
    return _fin.reference(gemm2_out, expanded_to_permuted, topk_weights, hidden)


@finalize.register_fake
def _finalize_fake(gemm2_out, expanded_to_permuted, topk_weights, hidden=None):
    dims("finalize", gemm2_out=(gemm2_out, (2,)), expanded_to_permuted=(expanded_to_permuted, (2,)))
    one_device("finalize", gemm2_out=gemm2_out, expanded_to_permuted=expanded_to_permuted, topk_weights=topk_weights)
    if concrete(gemm2_out, expanded_to_permuted, topk_weights):
        _fin.check_args(gemm2_out, expanded_to_permuted, topk_weights, hidden, cuda=False)
    H = gemm2_out.shape[1] if hidden is None else hidden
    return gemm2_out.new_empty((expanded_to_permuted.shape[0], H))
