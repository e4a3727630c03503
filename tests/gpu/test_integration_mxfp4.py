"""gpt-oss on its MXFP4 checkpoint (transformers' Mxfp4GptOssMLP / Mxfp4GptOssExperts) served by
kerngen.integrations.transformers on CUDA: kerngen's router and kerngen.experts' MXFP4 kernels (the per-expert
reference beyond their rules' 256 tokens) against transformers' dequantization (convert_moe_packed_tensors) into its
GptOssExperts run in fp64 on transformers' router's ids and weights; eagerly, replayed from a CUDA graph, and
compiled with CUDA graphs. The modules are built as in tests/test_integration_mxfp4_cpu.py (transformers' loaded
module with triton_kernels' tensor in a strided layout); tolerance: TOL[bf16] = 2**-6 of |exact| + RMS, as there."""
import pytest
import torch

from tests.gpu.test_integration_transformers import kernel_calls  # noqa: F401  (fixture)
from tests.test_integration_mxfp4_cpu import TOL, exact_rows, inputs, kt, mxfp4_model, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]
BF16 = torch.bfloat16


def cuda_model(seed=0):
    model, blocks = mxfp4_model("cuda", seed=seed)
    return model, blocks[0][1], blocks[0][2]   # (model, reference GptOssMLP, Mxfp4GptOssMLP of layer 0)


@pytest.mark.parametrize("T", [1, 13, 300])
def test_block_matches_transformers_dequantized_experts_in_fp64(T, kernel_calls):  # noqa: F811
    model, ref_block, mx_block = cuda_model()
    x = inputs(model, T, BF16).cuda()
    exact = exact_rows(ref_block, x.view(T, -1))
    kt.enable(model)
    with torch.no_grad():
        out, logits = mx_block(x)
    assert out.dtype == BF16 and out.shape == x.shape and logits.shape == (T, model.config.num_local_experts)
    assert rel_err(out.view(T, -1), exact) <= TOL[BF16], (T, rel_err(out.view(T, -1), exact))
    # kerngen's router (its permutation reused by the experts), kerngen.experts, the finalize kernel
    assert (kernel_calls["route"], kernel_calls["permute"], kernel_calls["experts"], kernel_calls["finalize"]) == \
        (1, 0, 1, 1), kernel_calls
    kt.disable(model)


def test_routers_false_permutes_transformers_ids(kernel_calls):  # noqa: F811
    model, ref_block, mx_block = cuda_model(seed=1)
    x = inputs(model, 13, BF16).cuda()
    exact = exact_rows(ref_block, x.view(13, -1))
    kt.enable(model, routers=False)
    with torch.no_grad():
        out = mx_block(x)[0]
    assert rel_err(out.view(13, -1), exact) <= TOL[BF16]
    assert (kernel_calls["route"], kernel_calls["permute"], kernel_calls["experts"]) == (0, 1, 1), kernel_calls


def test_experts_run_the_mxfp4_kernels(monkeypatch):
    """At decode sizes kerngen.experts launches its MXFP4 build (not the per-expert reference)."""
    from kerngen.ops import experts as ex
    model, _, mx_block = cuda_model()
    refs = []
    real = ex.reference
    monkeypatch.setattr(ex, "reference", lambda *a, **kw: refs.append(1) or real(*a, **kw))
    kt.enable(model)
    with torch.no_grad():
        mx_block(inputs(model, 8, BF16).cuda())
    assert not refs
    d = ex.dispatch(0, H=128, I=128, activation="gpt_oss", fmt="mxfp4", layout="nk")
    assert d.kernel(8) is not None


@pytest.mark.parametrize("T", [1, 8, 64])
def test_block_in_a_cuda_graph(T):
    """The whole block (kerngen routing and permutation, the MXFP4 experts kernels, finalize) captured and replayed on
    new inputs copied into the captured buffer."""
    model, ref_block, mx_block = cuda_model()
    kt.enable(model)
    x = inputs(model, T, BF16, seed=3).cuda()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            mx_block(x)   # compiles and loads the kernels outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mx_block(x)[0]
    for seed in (4, 5):
        x.copy_(inputs(model, T, BF16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        exact = exact_rows(ref_block, x.view(T, -1))
        assert rel_err(out.view(T, -1), exact) <= TOL[BF16], (T, seed)


@pytest.mark.parametrize("T", [1, 8, 40])
def test_block_compiled_with_cuda_graphs(T):
    """torch.compile(mode="reduce-overhead"): kerngen::route and kerngen::moe_experts (MXFP4 weights and scales) in
    torch's CUDA-graph trees, call after call on changing inputs."""
    model, ref_block, mx_block = cuda_model()
    xs = [inputs(model, T, BF16, seed=s).cuda() for s in range(3)]
    exacts = [exact_rows(ref_block, x.view(T, -1)) for x in xs]
    kt.enable(model)
    torch._dynamo.reset()
    compiled = torch.compile(mx_block, mode="reduce-overhead", fullgraph=True)
    for _ in range(2):   # warm-up, record, then replays
        for x, exact in zip(xs, exacts):
            with torch.no_grad():
                out = compiled(x.clone())[0].clone()
            assert rel_err(out.view(T, -1), exact) <= TOL[BF16], (T, rel_err(out.view(T, -1), exact))
    assert "_kerngen_state" not in mx_block.experts.__dict__   # the compiled path keeps no per-call state
    kt.disable(model)


def test_block_graphs_replay_the_mxfp4_block_bitwise():
    """The MXFP4 block's decode forwards replayed from kerngen's block graphs: its own eager forward's outputs
    (the routed rows and the router's scores) bit for bit, on new inputs."""
    model, _, mx_block = cuda_model(seed=2)
    kt.enable(model)
    graphs = mx_block.__dict__["forward"].graphs
    for seed in range(4):
        x = inputs(model, 2, BF16, seed=seed).cuda()
        with torch.no_grad():
            out, scores = mx_block(x)
            ref, ref_scores = graphs.forward(x)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        torch.testing.assert_close(scores, ref_scores, rtol=0, atol=0)
    assert graphs.captures == 1 and graphs.replays == 3
    kt.disable(model)
