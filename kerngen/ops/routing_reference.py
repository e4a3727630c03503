"""routing's plain torch side: the top-k ids and weights of the semantics in kerngen.ops.routing's docstring
(kerngen.ops.routing re-exports `reference`)."""
from __future__ import annotations

import torch

from ..errors import InputError
from ..tiers import METHODS

_SIGMOID_BIAS = ("sigmoid_bias", "grouped_sigmoid_bias")


def _key_and_values(logits, method, bias):
    s = logits.float()
    s = torch.where(torch.isnan(s), torch.full_like(s, float("-inf")), s)
    if method in _SIGMOID_BIAS or method == "top1_sigmoid":
        g = 1.0 / (1.0 + torch.exp(-s))                  # reciprocal of (1 + exp(-s)), as the kernels round it
    else:
        g = None
    if method in _SIGMOID_BIAS:
        key = g if bias is None else g + bias.float()
        key = torch.where(s == float("-inf"), s, key)
    else:
        key = s
    return s, g, key


def _topk_stable(key, k):
    return torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :k]


def reference(logits: torch.Tensor, top_k: int, method: str, bias: torch.Tensor | None = None, n_group: int = 1,
              topk_group: int = 1, routed_scaling_factor: float = 1.0,
              renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch (module docstring semantics): (topk_ids int32 [T,K], topk_weights fp32 [T,K])."""
    T, E = logits.shape
    K, rsf = top_k, routed_scaling_factor
    ninf = float("-inf")
    s, g, key = _key_and_values(logits, method, bias)
    if method == "grouped_sigmoid_bias":
        gs = E // n_group
        top = key.view(T, n_group, gs).topk(min(2, gs), dim=-1).values
        score = top[..., 0] if gs == 1 else torch.where(top[..., 1] == ninf, top[..., 0], top[..., 0] + top[..., 1])
        keep = torch.zeros(T, n_group, dtype=torch.bool, device=s.device)
        keep.scatter_(1, _topk_stable(score, topk_group), True)
        key = key.masked_fill(~keep.repeat_interleave(gs, dim=1), ninf)
    ids = _topk_stable(key, K)
    if method in _SIGMOID_BIAS:
        w = g.gather(-1, ids)
        w = w * rsf / (w.sum(-1, keepdim=True) + 1e-20) if renormalize else w * rsf
    elif method == "softmax_topk":
        finite = s.amax(-1, keepdim=True) > ninf
        p = torch.where(finite, s.softmax(-1), torch.zeros_like(s))
        w = p.gather(-1, ids)
        if renormalize:
            total = w.sum(-1, keepdim=True)
            w = torch.where(total > 0, w / total, torch.zeros_like(w))
        w = w * rsf
    elif method == "topk_softmax":
        sel = s.gather(-1, ids)
        finite = sel[:, :1] > ninf
        w = torch.where(finite, sel.softmax(-1), torch.zeros_like(sel)) * rsf
    elif method == "top1_sigmoid":
        w = g.gather(-1, ids) * rsf
    else:
        raise InputError("routing", "method", f"one of {', '.join(METHODS)}", repr(method))
    return ids.to(torch.int32), w.float()
