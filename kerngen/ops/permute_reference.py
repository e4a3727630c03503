"""permute's plain torch side: the permutation (kerngen.ops.permute's docstring) and moe_align_block_size's outputs,
and the sizes of their buffers. kerngen.ops.permute re-exports all of it (its `reference` is permute_reference)."""
from __future__ import annotations

import torch


def max_rows(tokens: int, top_k: int, num_local: int, tile: int) -> int:
    """Worst-case num_permuted_rows: every local expert's last tile is padded."""
    return tokens * top_k + num_local * (tile - 1)


def align_rows(tokens: int, top_k: int, num_experts: int, block_size: int, pad_sorted_ids: bool = False) -> int:
    """vLLM's max_num_tokens_padded, the length of sorted_token_ids (whole blocks with pad_sorted_ids); its
    expert_ids has ceil(align_rows / block_size) entries."""
    rows = max_rows(tokens, top_k, num_experts, block_size)
    return -(-rows // block_size) * block_size if pad_sorted_ids else rows


def permute_reference(topk_ids: torch.Tensor, num_experts: int, tile: int,
                      local_experts: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """The permutation of the module docstring in plain torch, rows of one expert in ascending expanded index."""
    T, K = topk_ids.shape
    ls, nl = local_experts or (0, num_experts)
    dev = topk_ids.device
    x = topk_ids.reshape(-1).long() - ls
    local = (x >= 0) & (x < nl)
    cnt = torch.bincount(x[local], minlength=nl)
    ntile = (cnt + tile - 1) // tile
    tile_off = torch.cumsum(ntile, 0) - ntile
    rows = int(ntile.sum()) * tile
    offsets = torch.cat([tile_off * tile, torch.tensor([rows], device=dev)])
    group = torch.where(local, x, torch.full_like(x, nl))
    order = torch.sort(group, stable=True).indices                       # by expert, then ascending e
    first = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long, device=dev), cnt]), 0)
    sorted_x = group[order]
    keep = sorted_x < nl
    e_sorted, x_sorted = order[keep], sorted_x[keep]
    rank = torch.arange(e_sorted.numel(), device=dev) - first[x_sorted]
    e2p = torch.full((T * K,), -1, dtype=torch.long, device=dev)
    e2p[e_sorted] = offsets[x_sorted] + rank
    cap = max_rows(T, K, nl, tile)
    p2t = torch.full((cap,), -1, dtype=torch.long, device=dev)
    p2t[e2p[e_sorted]] = e_sorted // K
    t2e = torch.full((cap // tile,), -1, dtype=torch.long, device=dev)
    nt = int(ntile.sum())
    t2e[:nt] = torch.repeat_interleave(torch.arange(nl, device=dev), ntile)
    i32 = torch.int32
    return {"expert_counts": cnt.to(i32), "expert_offsets": offsets.to(i32),
            "expanded_to_permuted": e2p.view(T, K).to(i32), "permuted_to_token": p2t.to(i32),
            "tile_to_expert": t2e.to(i32), "num_permuted_rows": torch.tensor(rows, dtype=i32, device=dev)}


def align_reference(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                    local_experts: tuple[int, int] | None = None, pad_sorted_ids: bool = False):
    """moe_align_block_size's outputs in plain torch, from kerngen's permutation over all experts:
    (sorted_token_ids, expert_ids, num_tokens_post_padded [1]). Expanded indices e = t*K + k in expert order
    (ascending e within an expert), each expert padded to block_size with T*K, T*K after the last block;
    expert_ids the block's expert as a local index, -1 outside local_experts, and past the used blocks what
    vLLM's zero-filled, expert_map-mapped buffer holds (expert 0 mapped: 0 if it is local, else -1). Ids outside
    [0, num_experts) are skipped."""
    T, K = topk_ids.shape
    ls, nl = local_experts or (0, num_experts)
    p = permute_reference(topk_ids, num_experts, block_size)
    rows = align_rows(T, K, num_experts, block_size, pad_sorted_ids)
    sorted_ids = torch.full((rows,), T * K, dtype=torch.int32, device=topk_ids.device)
    e2p = p["expanded_to_permuted"].flatten().long()
    valid = e2p >= 0
    sorted_ids[e2p[valid]] = torch.arange(T * K, device=topk_ids.device, dtype=torch.int32)[valid]
    unused = 0 if ls == 0 else -1
    blocks = torch.full((-(-rows // block_size),), unused, dtype=torch.int32, device=topk_ids.device)
    used = int(p["num_permuted_rows"]) // block_size
    x = p["tile_to_expert"][:used].long()
    blocks[:used] = torch.where((x >= ls) & (x < ls + nl), x - ls, torch.full_like(x, -1)).to(torch.int32)
    return sorted_ids, blocks, p["num_permuted_rows"].reshape(1)
