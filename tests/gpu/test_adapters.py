"""The vLLM-signature adapter on the GPU against the same vLLM-style references."""
import pytest
import torch

from kerngen.adapters import select_experts
from tests.test_adapters import vllm_fused_topk, vllm_grouped_topk

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]


@pytest.mark.parametrize("T", [1, 8, 300])
def test_softmax_on_gpu(T):
    g = torch.randn(T, 128, device="cuda")
    w, ids = select_experts(None, g, 8, True)
    rw, rids = vllm_fused_topk(g, 8, True)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1, 8, 300])
def test_deepseek_grouped_on_gpu(T):
    g = torch.randn(T, 256, device="cuda")
    bias = torch.randn(256, device="cuda") * 0.1
    w, ids = select_experts(None, g, 8, True, num_expert_group=8, topk_group=4, scoring_func="sigmoid",
                            routed_scaling_factor=2.5, e_score_correction_bias=bias)
    rw, rids = vllm_grouped_topk(g, 8, True, 8, 4, bias, 2.5)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_fused_topk_path_takes_no_scaling_factor_on_gpu(scoring):
    g = torch.randn(33, 128, device="cuda")
    w, ids = select_experts(None, g, 8, True, scoring_func=scoring, routed_scaling_factor=2.5)
    rw, rids = vllm_fused_topk(g, 8, True, scoring)
    assert torch.equal(ids, rids)
    torch.testing.assert_close(w, rw, rtol=1e-5, atol=1e-6)


def test_same_errors_on_gpu_as_on_cpu():
    import kerngen
    g = torch.randn(4, 256, device="cuda")
    for kw, arg in [(dict(num_expert_group=8), "topk_group"), (dict(topk=0), "top_k"),
                    (dict(routed_scaling_factor=float("nan")), "routed_scaling_factor")]:
        with pytest.raises(kerngen.InputError, match=arg):
            select_experts(None, g, **(dict(topk=8, renormalize=True) | kw))
