"""torch.ops.kerngen.moe_align_block_size: vLLM's moe_align_block_size on kerngen.permute's kernels, as a torch
custom op (kerngen/torch_ops.py says how they behave)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import check_env
from . import permute as _pm
from ._torch import one_device


@torch.library.custom_op("kerngen::moe_align_block_size",
                         mutates_args=("sorted_token_ids", "expert_ids", "num_tokens_post_pad"), device_types="cuda")
def moe_align_block_size(topk_ids: Tensor, num_experts: int, block_size: int, sorted_token_ids: Tensor,
                         expert_ids: Tensor, num_tokens_post_pad: Tensor) -> None:
    """vLLM's `ops.moe_align_block_size`: writes the block layout into the given buffers (one launch). Ids
    outside [0, num_experts) are skipped on every device (the kernel cannot raise without a host sync)."""
    _pm.permute_align_into(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_pad)


@moe_align_block_size.register_kernel("cpu")
def _moe_align_block_size_cpu(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_pad):
    check_env()
    _pm.check_align_into("moe_align_block_size", topk_ids, num_experts, block_size, sorted_token_ids, expert_ids,
                         num_tokens_post_pad, cuda=False)
    s, e, n = _pm.align_reference(topk_ids, block_size, num_experts)
    sorted_token_ids.fill_(topk_ids.numel())
    sorted_token_ids[:s.shape[0]].copy_(s)
    expert_ids.fill_(0)
    expert_ids[:e.shape[0]].copy_(e)
    num_tokens_post_pad.copy_(n)


@moe_align_block_size.register_fake
def _moe_align_block_size_fake(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_pad):
    one_device("moe_align_block_size", topk_ids=topk_ids, sorted_token_ids=sorted_token_ids, expert_ids=expert_ids,
               num_tokens_post_pad=num_tokens_post_pad)
    return None
