"""The vLLM-signature adapter against torch transcriptions of vLLM's routers (router_factory.py's choice,
fused_topk, fused_topk_bias and grouped_topk), written from vLLM's code, not from kerngen's reference."""
import pytest
import torch

import kerngen
from kerngen.adapters import select_experts


def vllm_fused_topk(gating, topk, renormalize, scoring="softmax"):
    """fused_topk: no bias, no routed_scaling_factor."""
    p = torch.softmax(gating.float(), dim=-1) if scoring == "softmax" else torch.sigmoid(gating.float())
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
        w = w / w.sum(-1, keepdim=True)
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


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_no_bias_no_groups_takes_no_scaling_factor_like_fused_topk(scoring):
    g = torch.randn(19, 64)
    w, ids = select_experts(None, g, 6, True, scoring_func=scoring, routed_scaling_factor=2.5)
    rw, rids = vllm_fused_topk(g, 6, True, scoring)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-7)


def test_groups_that_do_not_split_the_experts_fall_back_to_ungrouped_like_vllm():
    g, bias = torch.randn(11, 60), torch.randn(60) * 0.1
    w, ids = select_experts(None, g, 4, True, num_expert_group=8, topk_group=2, scoring_func="sigmoid",
                            routed_scaling_factor=2.0, e_score_correction_bias=bias)
    rw, rids = vllm_grouped_topk(g, 4, True, 1, 1, bias, 2.0)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(num_expert_group=8), "topk_group"),                        # vLLM raises ValueError
    (dict(topk_group=2), "num_expert_group"),
    (dict(num_expert_group=8, topk_group=2), "scoring_func"),      # softmax-scored groups: no kernel
    (dict(num_expert_group=8, topk_group=2, scoring_func="sigmoid"), "scoring_func"),   # max-scored groups
    (dict(scoring_func="softmax", e_score_correction_bias=torch.zeros(256)), "e_score_correction_bias"),
    (dict(num_expert_group=4, topk_group=8, scoring_func="sigmoid", e_score_correction_bias=torch.zeros(256)),
     "topk_group"),
    (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor"),
    (dict(scoring_func="sigmoid", e_score_correction_bias=torch.zeros(7)), "bias"),
    (dict(renormalize=1), "renormalize"),
    (dict(topk=0), "top_k"),
    (dict(topk=300), "top_k"),
    (dict(topk=[2]), "top_k"),
])
def test_every_unsupported_or_bad_combination_is_a_named_input_error(kwargs, arg):
    args = dict(topk=8, renormalize=True) | kwargs
    with pytest.raises(kerngen.InputError, match=arg):
        select_experts(None, torch.randn(3, 256), **args)


def test_bad_arguments_are_named():
    with pytest.raises(kerngen.InputError, match="scoring_func"):
        select_experts(None, torch.randn(2, 16), 2, True, scoring_func="relu")
    with pytest.raises(kerngen.InputError, match="scoring_func"):
        select_experts(None, torch.randn(2, 16), 2, True, num_expert_group=4, topk_group=2)
    with pytest.raises(kerngen.InputError, match="gating_output"):
        select_experts(torch.empty(3, 8), torch.randn(2, 16), 2, True)
