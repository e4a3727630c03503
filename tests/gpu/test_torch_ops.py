"""The custom ops on the GPU: torch.compile(fullgraph=True) with inductor, inside a CUDA graph."""
import pytest
import torch

import kerngen
from kerngen.ops import finalize as fin
from kerngen.ops import routing as rt
from kerngen.ops import tail

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]


def layer(logits, bias, g, e2p, nw, shared):
    ids, w = torch.ops.kerngen.route(logits, 16, "sigmoid_bias", bias, routed_scaling_factor=2.5)
    y = torch.ops.kerngen.finalize(g, e2p, w)
    out = torch.ops.kerngen.moe_tail(g, e2p, w, nw, 1e-6, shared)
    return ids, w, y, out


def inputs(T=8, E=896, K=16, H=3584):
    logits = torch.randn(T, E, device="cuda")
    bias = torch.randn(E, device="cuda") * 0.1
    g = torch.randn(T * K, H, device="cuda").to(torch.bfloat16)
    e2p = torch.randperm(T * K, device="cuda").view(T, K).int()
    nw = torch.rand(H, device="cuda").to(torch.bfloat16)
    shared = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    return logits, bias, g, e2p, nw, shared


def test_fullgraph_inductor_matches_eager_and_references():
    args = inputs()
    compiled = torch.compile(layer, fullgraph=True)
    got = compiled(*args)
    want = layer(*args)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    logits, bias, g, e2p, nw, shared = args
    ids, w = rt.reference(logits, 16, "sigmoid_bias", bias, routed_scaling_factor=2.5)
    assert torch.equal(got[0], ids)
    assert torch.equal(got[2], fin.reference(g, e2p, got[1]))
    ref = tail.reference(g, e2p, got[1], nw, shared=shared)[0]
    torch.testing.assert_close(got[3].float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_compiled_layer_in_cuda_graph():
    args = inputs()
    compiled = torch.compile(layer, fullgraph=True)
    want = compiled(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = compiled(*args)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    kerngen.finalize  # the plain functions stay importable beside the ops


@pytest.mark.parametrize("bad", ["wide", "tall", "ints", "cpu"])
def test_moe_experts_on_cuda_names_bad_topk_weights_before_any_launch(bad):
    """torch.ops.kerngen.moe_experts on CUDA tensors checks topk_weights as its CPU path does (a floating [T, K]
    tensor like topk_ids, on x's device): an InputError naming it, raised before anything is launched."""
    T, K, E, H, I = 3, 2, 4, 256, 128
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:K] for _ in range(T)]).int()
    w13 = (torch.randn(E, 2 * I, H, device="cuda") / 16).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda") / 16).to(torch.bfloat16)
    ok = torch.ops.kerngen.moe_experts(x, ids, torch.rand(T, K, device="cuda"), w13, w2, "silu")
    assert ok.shape == (T, H)
    w = {"wide": torch.rand(T, K + 1, device="cuda"), "tall": torch.rand(T + 1, K, device="cuda"),
         "ints": torch.ones(T, K, dtype=torch.int32, device="cuda"), "cpu": torch.rand(T, K)}[bad]
    with pytest.raises(kerngen.InputError, match="topk_weights"):
        torch.ops.kerngen.moe_experts(x, ids, w, w13, w2, "silu")


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf")])
def test_moe_tail_on_cuda_names_a_bad_eps(eps):
    """kerngen.moe_tail and torch.ops.kerngen.moe_tail check eps (a finite number >= 0) on CUDA tensors too."""
    T, K, H = 2, 4, 256
    g = torch.randn(T * K, H, device="cuda").to(torch.bfloat16)
    e2p = torch.arange(T * K, device="cuda", dtype=torch.int32).view(T, K)
    w = torch.rand(T, K, device="cuda")
    nw = torch.ones(H, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(kerngen.InputError, match="eps"):
        kerngen.moe_tail(g, e2p, w, nw, eps=eps)
    with pytest.raises(kerngen.InputError, match="eps"):
        torch.ops.kerngen.moe_tail(g, e2p, w, nw, eps)
