"""Entry points with the signatures inference engines already call.

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

import torch

from .errors import InputError
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
