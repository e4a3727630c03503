"""Entry points with the signatures inference engines already call: `select_experts` (vLLM's custom routing)
and `moe_align_block_size` (vLLM's and SGLang's block layout for their Triton fused-MoE kernels).

`select_experts` has vLLM's custom-routing signature and follows vLLM's router choice
(`vllm/model_executor/layers/fused_moe/router/router_factory.py`) argument for argument:

| vLLM arguments                                         | vLLM path        | kerngen                                   |
|--------------------------------------------------------|------------------|-------------------------------------------|
| num_expert_group given without topk_group (or reverse) | ValueError       | InputError naming the missing argument    |
| groups > 1, E % groups == 0, E > groups, scoring sigmoid, bias | grouped_topk (group score: sum of the top-2 biased scores) | grouped_sigmoid_bias |
| groups > 1, no bias (group score: the group's max), or softmax scoring | grouped_topk | no kernel: InputError |
| num_expert_group = topk_group = 1                      | grouped_topk over one group | softmax_topk / sigmoid_bias, routed_scaling_factor applied |
| groups > 1 but E % groups != 0 or E <= groups          | falls back to the ungrouped paths below | the same |
| no groups (or 1 and 1), bias given, sigmoid            | fused_topk_bias  | sigmoid_bias with the bias                |
| no groups, bias given, softmax                         | fused_topk_bias  | no kernel: InputError                     |
| no groups, no bias, softmax                            | fused_topk       | softmax_topk; **routed_scaling_factor is not applied** (fused_topk takes none) |
| no groups, no bias, sigmoid                            | fused_topk       | sigmoid_bias without bias; routed_scaling_factor not applied |

`renormalize` divides the selected weights by their sum (kerngen adds 1e-20 for sigmoid scores, so a row of
all-zero weights stays 0 instead of NaN); `routed_scaling_factor` multiplies afterwards where vLLM applies it.
Ties go to the lower expert index and NaN logits count as -inf (vLLM's torch.topk leaves both unspecified).
The result is (topk_weights fp32 [T, K], topk_ids int32 [T, K]). CPU tensors run the torch reference after
the same argument checks as the kernels.
"""
from __future__ import annotations

import math
import weakref

import torch

from .dispatch import check_env
from .errors import InputError
from .ops import permute as _pm
from .ops import routing as _rt

OP = "select_experts"
SCORING = ("softmax", "sigmoid")


def _positive_int(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise InputError(OP, name, "a positive integer", repr(v))
    return v


def _grouping(E: int, num_expert_group, topk_group) -> str | None:
    """vLLM's choice: "groups" (grouped top-k proper), "one" (grouped top-k over one group: the ungrouped
    selection, with routed_scaling_factor applied) or None (no grouping asked, or groups that do not split
    the experts: vLLM falls back to its ungrouped routers)."""
    if (num_expert_group is None) != (topk_group is None):
        given, missing = ("num_expert_group", "topk_group") if topk_group is None else ("topk_group",
                                                                                         "num_expert_group")
        raise InputError(OP, missing, f"given together with {given} (vLLM raises too)", "None")
    if num_expert_group is None:
        return None
    G, TG = _positive_int("num_expert_group", num_expert_group), _positive_int("topk_group", topk_group)
    if TG > G:
        raise InputError(OP, "topk_group", f"at most num_expert_group = {G}", repr(TG))
    if G == 1:
        return "one"
    return "groups" if E > G and E % G == 0 else None


def select_experts(hidden_states: torch.Tensor | None, gating_output: torch.Tensor, topk: int, renormalize: bool,
                   num_expert_group: int | None = None, topk_group: int | None = None,
                   scoring_func: str = "softmax", routed_scaling_factor: float = 1.0,
                   e_score_correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    if not isinstance(gating_output, torch.Tensor) or gating_output.dim() != 2:
        raise InputError(OP, "gating_output", "a 2-dimensional tensor [T, E]", _describe(gating_output))
    if scoring_func not in SCORING:
        raise InputError(OP, "scoring_func", "'softmax' or 'sigmoid'", repr(scoring_func))
    rsf = routed_scaling_factor
    if not isinstance(rsf, (int, float)) or isinstance(rsf, bool) or not (0 < rsf and math.isfinite(rsf)):
        raise InputError(OP, "routed_scaling_factor", "a positive finite number", repr(rsf))
    if hidden_states is not None and (not isinstance(hidden_states, torch.Tensor)
                                      or hidden_states.shape[:1] != gating_output.shape[:1]):
        raise InputError(OP, "gating_output", "[T, E] with T the token count of hidden_states",
                         f"shape {tuple(gating_output.shape)} for hidden_states {_describe(hidden_states)}")
    bias = e_score_correction_bias
    E = gating_output.shape[1]
    kw: dict = {"bias": bias}
    grouping = _grouping(E, num_expert_group, topk_group)
    if grouping == "groups":
        if scoring_func != "sigmoid" or bias is None:
            raise InputError(OP, "scoring_func", "'sigmoid' with e_score_correction_bias for grouped routing "
                             "(kerngen has no kernel for vLLM's max-scored groups)",
                             f"{scoring_func!r} with{'out' if bias is None else ''} a bias")
        method = "grouped_sigmoid_bias"
        kw.update(n_group=num_expert_group, topk_group=topk_group)
    else:
        if bias is not None and scoring_func != "sigmoid":
            raise InputError(OP, "e_score_correction_bias", "None with scoring_func 'softmax' (kerngen has no "
                             "kernel for softmax scores selected with a bias)", "a tensor")
        method = "softmax_topk" if scoring_func == "softmax" else "sigmoid_bias"
        if bias is None and grouping is None:
            rsf = 1.0   # vLLM's fused_topk takes no scaling factor: the model code applies it itself
    if not isinstance(renormalize, bool):
        raise InputError(OP, "renormalize", "True or False", repr(renormalize))
    if gating_output.device.type != "cuda":
        check_env()
        _rt.check_args(gating_output, topk, method, rsf=rsf, renormalize=renormalize, cuda=False,
                       **{k: v for k, v in kw.items() if v is not None})
        ids, w = _rt.reference(gating_output, topk, method, bias, kw.get("n_group", 1), kw.get("topk_group", 1),
                               rsf, renormalize)
        return w, ids
    r = _rt.route(gating_output, top_k=topk, method=method, routed_scaling_factor=rsf, renormalize=renormalize,
                  **kw)
    return r.topk_weights, r.topk_ids


def _describe(x) -> str:
    return f"shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                         expert_map: torch.Tensor | None = None, pad_sorted_ids: bool = False, *,
                         local_experts: tuple[int, int] | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's `moe_align_block_size` (fused_moe/moe_align_block_size.py) with its signature and outputs:
    (sorted_token_ids [T*K + E*(block_size-1)] int32, expanded indices in expert order, each expert padded to
    block_size with T*K; expert_ids [ceil(len / block_size)] int32, a block's expert (mapped through expert_map:
    -1 for experts of other ranks); num_tokens_post_padded [1] int32), computed by kerngen's permutation kernel
    in one launch on CUDA straight into the returned tensors (`permute.permute_align_into`), by
    `permute.align_reference` on the CPU.

    Experts within a block are in ascending expanded index (vLLM leaves the order open). kerngen's expert
    parallelism is a contiguous range: `expert_map` must map [start, start + count) to 0..count-1 and the rest
    to -1 (checked once per map tensor, with one device-to-host copy), or pass `local_experts=(start, count)`.
    Ids outside [0, num_experts) are skipped on every device (the kernel cannot raise without a host sync).
    """
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2 or topk_ids.dtype != torch.int32:
        raise InputError("moe_align_block_size", "topk_ids", "an int32 tensor [T, K]", _describe(topk_ids))
    local = _local_range(expert_map, num_experts, local_experts)
    _pm.check_ids("moe_align_block_size", topk_ids.contiguous(), num_experts, "block_size", block_size, local)
    if not isinstance(pad_sorted_ids, bool):
        raise InputError("moe_align_block_size", "pad_sorted_ids", "True or False", repr(pad_sorted_ids))
    if topk_ids.device.type != "cuda":   # the same checks on every device
        check_env()
        return _pm.align_reference(topk_ids, block_size, num_experts, local, pad_sorted_ids)
    rows = _pm.align_rows(topk_ids.shape[0], topk_ids.shape[1], num_experts, block_size, pad_sorted_ids)
    sorted_ids = torch.empty((rows,), dtype=torch.int32, device=topk_ids.device)
    expert_ids = torch.empty((-(-rows // block_size),), dtype=torch.int32, device=topk_ids.device)
    post_pad = torch.empty((1,), dtype=torch.int32, device=topk_ids.device)
    _pm.permute_align_into(topk_ids.contiguous(), num_experts, block_size, sorted_ids, expert_ids, post_pad, local)
    return sorted_ids, expert_ids, post_pad


# id -> (weakref, version, range): a freed map's address may come back. Per map tensor, not per shape: the
# engine's map read once, whatever the tier table (so no dispatch object holds it)
_maps: dict[int, tuple] = {}


def _local_range(expert_map, num_experts: int, local_experts) -> tuple[int, int] | None:
    """The contiguous local range an expert_map describes (or local_experts as given)."""
    if expert_map is None:
        return local_experts
    if local_experts is not None:
        raise InputError("moe_align_block_size", "local_experts", "left out when expert_map is given", "both")
    if (not isinstance(expert_map, torch.Tensor) or expert_map.dim() != 1
            or expert_map.shape[0] != num_experts or expert_map.dtype not in (torch.int32, torch.int64)):
        raise InputError("moe_align_block_size", "expert_map", f"an integer tensor [{num_experts}]",
                         _describe(expert_map))
    hit = _maps.get(id(expert_map))   # the same live tensor, unchanged since it was read
    if hit is not None and hit[0]() is expert_map and hit[1] == expert_map._version:
        return hit[2]
    m = expert_map.cpu().long()
    local = (m >= 0).nonzero().flatten()
    start, count = (int(local[0]), local.numel()) if local.numel() else (0, 0)
    want = torch.full((num_experts,), -1, dtype=torch.long)
    want[start:start + count] = torch.arange(count)
    if count == 0 or not torch.equal(m, want):
        raise InputError("moe_align_block_size", "expert_map", "a contiguous range [start, start + count) "
                         "mapped to 0..count-1 and -1 elsewhere (kerngen's expert parallelism)", "another mapping")
    _maps[id(expert_map)] = (weakref.ref(expert_map), expert_map._version, (start, count))
    return start, count
