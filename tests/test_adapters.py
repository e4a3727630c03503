"""The vLLM-signature adapter against independent torch versions of vLLM's fused_topk and grouped_topk."""
import pytest
import torch

import kerngen
from kerngen.adapters import select_experts


def vllm_fused_topk(gating, topk, renormalize):
    p = torch.softmax(gating.float(), dim=-1)
    w, ids = torch.sort(p, dim=-1, descending=True, stable=True)
    w, ids = w[:, :topk], ids[:, :topk]
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids.int()


def vllm_grouped_topk(gating, topk, renormalize, num_expert_group, topk_group, bias, rsf):
    scores = torch.sigmoid(gating.float())
    T, E = scores.shape
    biased = scores + bias.float() if bias is not None else scores
    if num_expert_group > 1:
        g = biased.view(T, num_expert_group, -1).topk(2, dim=-1).values.sum(-1)
        gi = torch.sort(g, dim=-1, descending=True, stable=True).indices[:, :topk_group]
        mask = torch.zeros_like(g).scatter_(1, gi, 1).bool()
        mask = mask.unsqueeze(-1).expand(T, num_expert_group, E // num_expert_group).reshape(T, E)
        biased = biased.masked_fill(~mask, float("-inf"))
    ids = torch.sort(biased, dim=-1, descending=True, stable=True).indices[:, :topk]
    w = scores.gather(1, ids)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * rsf, ids.int()


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_matches_fused_topk(renormalize):
    g = torch.randn(37, 128)
    w, ids = select_experts(torch.empty(37, 8), g, 8, renormalize)
    rw, rids = vllm_fused_topk(g, 8, renormalize)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("groups, topk_group, with_bias", [(8, 4, True), (1, 1, True), (1, 1, False)])
def test_sigmoid_matches_grouped_topk(groups, topk_group, with_bias):
    g = torch.randn(29, 256)
    bias = torch.randn(256) * 0.1 if with_bias else None
    w, ids = select_experts(None, g, 8, True, num_expert_group=groups, topk_group=topk_group,
                            scoring_func="sigmoid", routed_scaling_factor=2.5, e_score_correction_bias=bias)
    rw, rids = vllm_grouped_topk(g, 8, True, groups, topk_group, bias, 2.5)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_named():
    with pytest.raises(kerngen.InputError, match="scoring_func"):
        select_experts(None, torch.randn(2, 16), 2, True, scoring_func="relu")
    with pytest.raises(kerngen.InputError, match="scoring_func"):
        select_experts(None, torch.randn(2, 16), 2, True, num_expert_group=4, topk_group=2)
    with pytest.raises(kerngen.InputError, match="gating_output"):
        select_experts(torch.empty(3, 8), torch.randn(2, 16), 2, True)
