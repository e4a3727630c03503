"""Entry points with the signatures inference engines already call.

`select_experts` has vLLM's custom-routing signature and maps onto kerngen's methods exactly:

| engine arguments                                                   | kerngen method                              |
|--------------------------------------------------------------------|---------------------------------------------|
| scoring_func="softmax", no groups                                  | softmax_topk (softmax over all E, top-k, renormalize as given) |
| scoring_func="sigmoid", num_expert_group in (None, 1)              | sigmoid_bias (bias = e_score_correction_bias or none) |
| scoring_func="sigmoid", num_expert_group > 1                       | grouped_sigmoid_bias (n_group, topk_group; group score = sum of top-2 of sigmoid + bias) |

`renormalize` divides the selected weights by their sum (+1e-20 for sigmoid scores) and
`routed_scaling_factor` multiplies them afterwards, as vLLM's fused_topk / grouped_topk do.
The result is (topk_weights fp32 [T, K], topk_ids int32 [T, K]). CPU tensors run the torch reference.
"""
from __future__ import annotations

import torch

from .errors import InputError
from .ops import routing as _rt

OP = "select_experts"


def select_experts(hidden_states: torch.Tensor, gating_output: torch.Tensor, topk: int, renormalize: bool,
                   num_expert_group: int | None = None, topk_group: int | None = None,
                   scoring_func: str = "softmax", routed_scaling_factor: float = 1.0,
                   e_score_correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    groups = num_expert_group or 1
    if scoring_func == "softmax":
        if groups != 1 or e_score_correction_bias is not None:
            raise InputError(OP, "scoring_func", "'sigmoid' when expert groups or a correction bias are given",
                             repr(scoring_func))
        method, kw = "softmax_topk", {}
    elif scoring_func == "sigmoid":
        method = "grouped_sigmoid_bias" if groups > 1 else "sigmoid_bias"
        kw = {"bias": e_score_correction_bias}
        if groups > 1:
            kw.update(n_group=groups, topk_group=topk_group or groups)
    else:
        raise InputError(OP, "scoring_func", "'softmax' or 'sigmoid'", repr(scoring_func))
    if hidden_states is not None and hidden_states.shape[0] != gating_output.shape[0]:
        raise InputError(OP, "gating_output", f"[{hidden_states.shape[0]}, E] like hidden_states",
                         f"shape {tuple(gating_output.shape)}")
    if gating_output.device.type == "cpu":
        ids, w = _rt.reference(gating_output, topk, method, kw.get("bias"), kw.get("n_group", 1),
                               kw.get("topk_group", 1), routed_scaling_factor, renormalize)
        return w, ids
    r = _rt.route(gating_output, top_k=topk, method=method, routed_scaling_factor=routed_scaling_factor,
                  renormalize=renormalize, **kw)
    return r.topk_weights, r.topk_ids
