"""kerngen.experts with quantized weights on the GPU against its reference on the dequantized weights (fp32): fp8
block-scaled and MXFP4 (gpt-oss's layout), T in 1..256 on the kernels, every activation, gpt-oss's interleaved
clamped SwiGLU with biases, an expert-parallel range, beyond the rules (the per-expert reference), inside a CUDA
graph; transformers' FP8Experts served by the integration on CUDA."""
import pytest
import torch

import kerngen
from kerngen.ops import experts as ex
from tests.test_experts_fp8_cpu import fp8_weights
from tests.test_experts_mxfp4_cpu import mx_weights

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]
MAKE = {"fp8": fp8_weights, "mxfp4": mx_weights}
FORMATS = tuple(MAKE)


def make(fmt, T, K, E, H, I, seed=0):
    w13, s13, w2, s2 = (t.cuda() for t in MAKE[fmt](E, H, I, seed))
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(T, H, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda", generator=g)
    return x, logits, (w13, w2), dict(w13_scale=s13, w2_scale=s2)


def check_rows(got, ref, r):
    """The same fp32 sums in another order and the two bf16 roundings (intermediate, output)."""
    rows = r.permuted_to_token >= 0
    scale = ref[rows].float().abs().max().item()
    torch.testing.assert_close(got[rows].float(), ref[rows].float(), rtol=2e-2, atol=2e-2 * scale)


def check(x, r, w, s, **kw):
    check_rows(kerngen.experts(x, r, *w, **s, **kw), ex.reference(x, r, *w, **s, **kw), r)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 3, 8, 16, 17, 64, 256])
@pytest.mark.parametrize("H,I", [(1024, 256), (2048, 768)])
def test_kernels_match_the_dequantized_reference(fmt, T, H, I):
    x, logits, w, s = make(fmt, T, 4, 32, H, I, seed=T)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=ex.tile_for(H, I, "silu", T, 0))
    check(x, r, w, s)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act", ["gelu", "situglu"])
def test_activations(fmt, act):
    x, logits, w, s = make(fmt, 5, 4, 16, 1024, 256)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    check(x, r, w, s, activation=act, linear_beta=2.0 if act == "situglu" else 0.0)


@pytest.mark.parametrize("T", [1, 8, 64])
def test_gpt_oss_mxfp4(T):
    E, H, I = 16, 2880, 2880
    x, logits, w, s = make("mxfp4", T, 4, E, H, I, seed=T)
    g = torch.Generator(device="cuda").manual_seed(T)
    b13 = (torch.randn(E, 2 * I, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    b2 = (torch.randn(E, H, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    r = kerngen.route(logits, top_k=4, method="topk_softmax", tile=ex.tile_for(H, I, "gpt_oss", T, 0))
    check(x, r, w, s, activation="gpt_oss", interleaved=True, b13=b13, b2=b2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_expert_parallel_range(fmt):
    x, logits, (w13, w2), s = make(fmt, 6, 4, 32, 1024, 256)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8, local_experts=(8, 16))
    local = lambda t: t[8:24].contiguous()  # noqa: E731
    check(x, r, (local(w13), local(w2)), {k: local(v) for k, v in s.items()})


@pytest.mark.parametrize("fmt", FORMATS)
def test_beyond_the_rules_runs_the_reference(fmt):
    x, logits, w, s = make(fmt, 300, 2, 8, 1024, 256)
    r = kerngen.route(logits, top_k=2, method="softmax_topk", tile=16)
    rows = r.permuted_to_token >= 0
    assert torch.equal(kerngen.experts(x, r, *w, **s)[rows], ex.reference(x, r, *w, **s)[rows])


@pytest.mark.parametrize("fmt", FORMATS)
def test_inside_a_cuda_graph(fmt):
    T, E, K, H, I = 8, 32, 4, 1024, 256
    x, logits, w, s = make(fmt, T, K, E, H, I)
    ws = kerngen.RoutingWorkspace(T, E, K, 8)
    out = torch.zeros(T * K + E * 7, H, dtype=torch.bfloat16, device="cuda")
    kerngen.experts(x, kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws), *w, **s, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kerngen.experts(x, kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws), *w, **s,
                        out=out)
    logits.copy_(torch.randn_like(logits))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)
    check_rows(out, ex.reference(x, r, *w, **s), r)


@pytest.mark.parametrize("T", [1, 8, 40])
def test_transformers_fp8_experts_on_cuda(T):
    from tests.test_integration_fp8_cpu import TOL_FUSED, fp8_model, inputs, kt, rel_err, run_block
    model, pairs = fp8_model()
    model = model.to("cuda", torch.bfloat16)
    block, new, _ = pairs[0]
    new.to("cuda")
    x = inputs(model, T, torch.bfloat16).cuda()
    want = run_block(block, x)
    block.experts = new
    kt.enable(model)
    assert rel_err(run_block(block, x), want) <= 2 * TOL_FUSED
