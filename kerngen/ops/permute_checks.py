"""permute's input checks, naming the argument (kerngen.ops.permute re-exports them; the CPU entry points run the
same ones with cuda=False)."""
from __future__ import annotations

import torch

from ..errors import InputError
from ..tiers import MAX_EXPERTS, MAX_TOPK
from ._common import check_int, check_local, check_tensor
from .permute_buffers import MAX_TILE, RoutingWorkspace
from .permute_reference import max_rows


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
