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
