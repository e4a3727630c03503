"""kerngen.experts with MXFP4 weights (gpt-oss's checkpoint layout) on the GPU against its reference on the decoded
weights: T in 1..256 on the kernels, gpt-oss's interleaved clamped SwiGLU with biases, SituGLU, inside a CUDA graph,
and the per-expert reference beyond the rules."""
import pytest
import torch

import kerngen
from kerngen.ops import experts as ex
from tests.test_experts_mxfp4_cpu import mx_weights

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]


def make(T, K, E, H, I, seed=0):
    w13, s13, w2, s2 = (t.cuda() for t in mx_weights(E, H, I, seed))
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(T, H, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda", generator=g)
    return x, logits, w13, s13, w2, s2


def check(x, r, w13, s13, w2, s2, **kw):
    got = kerngen.experts(x, r, w13, w2, w13_scale=s13, w2_scale=s2, **kw)
    ref = ex.reference(x, r, w13, w2, w13_scale=s13, w2_scale=s2, **kw)
    rows = r.permuted_to_token >= 0
    scale = ref[rows].float().abs().max().item()
    torch.testing.assert_close(got[rows].float(), ref[rows].float(), rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("T", [1, 4, 8, 16, 17, 64, 256])
def test_gpt_oss_shape(T):
    E, K, H, I = 16, 4, 2880, 2880
    x, logits, w13, s13, w2, s2 = make(T, K, E, H, I, seed=T)
    g = torch.Generator(device="cuda").manual_seed(T)
    b13 = (torch.randn(E, 2 * I, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    b2 = (torch.randn(E, H, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    r = kerngen.route(logits, top_k=K, method="topk_softmax", tile=ex.tile_for(H, I, "gpt_oss", T, 0))
    check(x, r, w13, s13, w2, s2, activation="gpt_oss", interleaved=True, b13=b13, b2=b2)


@pytest.mark.parametrize("T", [1, 8, 40])
def test_situglu(T):
    x, logits, w13, s13, w2, s2 = make(T, 4, 32, 1024, 512)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=ex.tile_for(1024, 512, "situglu", T, 0))
    check(x, r, w13, s13, w2, s2, activation="situglu", linear_beta=2.0)


def test_beyond_the_rules_runs_the_reference():
    x, logits, w13, s13, w2, s2 = make(300, 2, 8, 1024, 256)
    r = kerngen.route(logits, top_k=2, method="softmax_topk", tile=16)
    got = kerngen.experts(x, r, w13, w2, w13_scale=s13, w2_scale=s2)
    ref = ex.reference(x, r, w13, w2, w13_scale=s13, w2_scale=s2)
    rows = r.permuted_to_token >= 0
    assert torch.equal(got[rows], ref[rows])


def test_inside_a_cuda_graph():
    T, E, K, H, I = 8, 32, 4, 1024, 256
    x, logits, w13, s13, w2, s2 = make(T, K, E, H, I)
    ws = kerngen.RoutingWorkspace(T, E, K, 8)
    out = torch.zeros(T * K + E * 7, H, dtype=torch.bfloat16, device="cuda")
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws)
    kerngen.experts(x, r, w13, w2, w13_scale=s13, w2_scale=s2, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws)
        kerngen.experts(x, r, w13, w2, w13_scale=s13, w2_scale=s2, out=out)
    logits.copy_(torch.randn_like(logits))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)
    ref = ex.reference(x, r, w13, w2, w13_scale=s13, w2_scale=s2)
    rows = r.permuted_to_token >= 0
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), rtol=2e-2,
                               atol=2e-2 * ref[rows].float().abs().max().item())
