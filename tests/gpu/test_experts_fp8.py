"""kerngen.experts with fp8 block-scaled weights on the GPU against its reference (the dequantized weights in
fp32): T in 1..256 on the kernels, beyond the rules on the per-expert reference, every activation, an
expert-parallel range, inside a CUDA graph; transformers' FP8Experts served by the integration on CUDA."""
import pytest
import torch

import kerngen
from kerngen.ops import experts as ex
from tests.test_experts_fp8_cpu import fp8_weights

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]


def make(T, K, E, H, I, seed=0):
    w13, s13, w2, s2 = (t.cuda() for t in fp8_weights(E, H, I, seed))
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(T, H, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda", generator=g)
    return x, logits, w13, s13, w2, s2


def check(x, r, w13, s13, w2, s2, **kw):
    got = kerngen.experts(x, r, w13, w2, w13_scale=s13, w2_scale=s2, **kw)
    ref = ex.reference(x, r, w13, w2, w13_scale=s13, w2_scale=s2, **kw)
    rows = r.permuted_to_token >= 0
    # the same fp32 sums in another order, one bf16 rounding of the intermediate and of the output
    scale = ref[rows].float().abs().max().item()
    torch.testing.assert_close(got[rows].float(), ref[rows].float(), rtol=2e-2, atol=2e-2 * scale)
    return got


@pytest.mark.parametrize("T", [1, 3, 8, 16, 17, 64, 256])
@pytest.mark.parametrize("H,I", [(1024, 256), (2048, 768)])
def test_kernels_match_the_dequantized_reference(T, H, I):
    E, K = 32, 4
    x, logits, w13, s13, w2, s2 = make(T, K, E, H, I, seed=T)
    tile = ex.tile_for(H, I, "silu", T, 0)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=tile)
    check(x, r, w13, s13, w2, s2)


@pytest.mark.parametrize("act", ["gelu", "situglu"])
def test_activations(act):
    x, logits, w13, s13, w2, s2 = make(5, 4, 16, 1024, 256)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    check(x, r, w13, s13, w2, s2, activation=act, linear_beta=2.0 if act == "situglu" else 0.0)


def test_an_expert_parallel_range():
    x, logits, w13, s13, w2, s2 = make(6, 4, 32, 1024, 256)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8, local_experts=(8, 16))
    check(x, r, w13[8:24].contiguous(), s13[8:24].contiguous(), w2[8:24].contiguous(), s2[8:24].contiguous())


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
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws)
    out = torch.zeros(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
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


@pytest.mark.parametrize("T", [1, 8, 40])
def test_transformers_fp8_experts_on_cuda(T):
    from tests.test_integration_fp8_cpu import TOL_FUSED, fp8_model, inputs, kt, rel_err, run_block
    model, pairs = fp8_model()
    model = model.to("cuda", torch.bfloat16)
    block, new, ref = pairs[0]
    new.to("cuda")
    x = inputs(model, T, torch.bfloat16).cuda()
    want = run_block(block, x)
    block.experts = new
    kt.enable(model)
    assert rel_err(run_block(block, x), want) <= 2 * TOL_FUSED
