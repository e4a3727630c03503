"""kerngen.experts on the GPU against its reference: T in 1..64, every activation, local expert ranges, empty
experts, the grouped-GEMM fallback, and inside a CUDA graph."""
import pytest
import torch

import kerngen
from kerngen.ops import experts as ex

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]

ACTS = ("silu", "gelu", "gpt_oss", "situglu")


def make(T, K, E, H, I, *, bias=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: (torch.randn(*s, device="cuda", generator=g) * 0.5).to(torch.bfloat16)  # noqa: E731
    x = r(T, H)
    logits = torch.randn(T, E, device="cuda", generator=g)
    w13, w2 = r(E, 2 * I, H) / H ** 0.25, r(E, H, I) / I ** 0.25
    b13, b2 = (r(E, 2 * I), r(E, H)) if bias else (None, None)
    return x, logits, w13, w2, b13, b2


def check(x, routing, w13, w2, **kw):
    got = kerngen.experts(x, routing, w13, w2, **kw)
    ref = ex.reference(x, routing, w13, w2, **kw)
    rows = routing.permuted_to_token >= 0
    torch.testing.assert_close(got[rows].float(), ref[rows].float(), rtol=2e-2, atol=2e-2)
    return got


@pytest.mark.parametrize("T", [1, 2, 7, 16, 33, 64])
@pytest.mark.parametrize("act", ACTS)
def test_stream_matches_reference(T, act):
    E, K, H, I = 32, 4, 1024, 256
    x, logits, w13, w2, b13, b2 = make(T, K, E, H, I, bias=act == "gpt_oss")
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)
    check(x, r, w13, w2, activation=act, interleaved=act == "gpt_oss", b13=b13, b2=b2,
          linear_beta=3.0 if act == "situglu" else 0.0)


@pytest.mark.parametrize("H,I", [(2048, 768), (2880, 2880), (7168, 2048)])
def test_model_shapes(H, I):
    x, logits, w13, w2, _, _ = make(4, 8, 16, H, I)
    check(x, kerngen.route(logits, top_k=8, method="softmax_topk", tile=8), w13, w2)


def test_local_experts_and_empty_experts():
    T, E, K, H, I = 9, 64, 2, 512, 128
    x, logits, w13, w2, _, _ = make(T, K, E, H, I)
    logits[:, 40:] = -float("inf")        # experts 40.. get no rows
    for local in ((0, 64), (16, 32), (48, 16)):
        r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=4, local_experts=local)
        check(x, r, w13[local[0]:local[0] + local[1]].contiguous(), w2[local[0]:local[0] + local[1]].contiguous())


def test_input_weights_llama4():
    x, logits, w13, w2, _, _ = make(5, 1, 16, 512, 128)
    r = kerngen.route(logits, top_k=1, method="top1_sigmoid", tile=1)
    check(x, r, w13, w2, input_weights=r.topk_weights[:, 0].contiguous())


def test_beyond_the_rules_uses_grouped_mm():
    T = 200                                  # past tokens 1..64
    x, logits, w13, w2, _, _ = make(T, 4, 16, 512, 128)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    check(x, r, w13, w2)


def test_inside_a_cuda_graph():
    T, E, K, H, I = 8, 32, 4, 1024, 256
    x, logits, w13, w2, _, _ = make(T, K, E, H, I)
    ws = kerngen.RoutingWorkspace(T, E, K, 8)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws)
    out = torch.zeros(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
    kerngen.experts(x, r, w13, w2, out=out)          # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws)
        kerngen.experts(x, r, w13, w2, out=out)
    logits.copy_(torch.randn_like(logits))
    x.copy_(torch.randn_like(x.float()).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    ref = ex.reference(x, r, w13, w2)
    rows = r.permuted_to_token >= 0
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), rtol=2e-2, atol=2e-2)
