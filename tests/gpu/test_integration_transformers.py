"""kerngen.integrations.transformers on the GPU: the CPU test's tiny models of every supported family on CUDA
with kerngen's kernels (route, permute, finalize; torch._grouped_mm in bf16 on sm_90+), against transformers'
eager experts and router, eagerly and replayed from a CUDA graph; greedy generate."""
import pytest
import torch

import kerngen
from tests.test_integration_transformers import (FAMILIES, TOL, TOL_FUSED, check_router, inputs, kt, moe_blocks,
                                                 rel_err, run_block, tiny)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]
SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts of kerngen's kernel entry points the integration calls (so a silent torch fallback fails)."""
    calls = {"route": 0, "permute": 0, "finalize": 0, "grouped_mm": 0, "experts": 0}
    for mod, name, key in ((kerngen, "route", "route"), (kerngen, "permute", "permute"),
                           (kerngen, "finalize", "finalize"), (torch, "_grouped_mm", "grouped_mm"),
                           (kerngen, "experts", "experts")):
        real = getattr(mod, name)

        def counted(*a, _real=real, _key=key, **kw):
            calls[_key] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(mod, name, counted)
    return calls


def cuda_model(case, dtype):
    return tiny(case).to("cuda", dtype)


def tol(block, dtype, T) -> float:
    """TOL, or TOL_FUSED where kerngen.experts' kernels run the block's experts (bf16, their tokens)."""
    fused = dtype == torch.bfloat16 and kt.kernel_activation(getattr(block, "experts", None)) is not None
    return TOL_FUSED if fused and T <= 256 else TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_block_matches_eager_on_gpu(case, dtype, kernel_calls):
    model = cuda_model(case, dtype)
    block = moe_blocks(model)[0]
    for T in (1, 13, 300):
        x = inputs(model, T, dtype).cuda()
        ref = run_block(block, x)
        kt.enable(model)
        out = run_block(block, x)
        kt.disable(model)
        assert out.dtype == dtype and rel_err(out, ref) <= tol(block, dtype, T), (case, T)
    assert kernel_calls["route"] == 3                          # the router's top-k and permutation: kerngen's
    assert kernel_calls["permute"] == 0                        # ... reused by the experts
    assert kernel_calls["finalize"] == (3 if dtype == torch.bfloat16 else 0)   # fp32 rows: the torch reference
    assert (kernel_calls["grouped_mm"] > 0) == (dtype == torch.bfloat16 and SM90)
    # kerngen.experts' kernels at the decode sizes (T = 1, 13) where the family's experts layout is theirs
    fused = dtype == torch.bfloat16 and kt.kernel_activation(block.experts) is not None
    assert kernel_calls["experts"] == (2 if fused else 0), kernel_calls


@pytest.mark.parametrize("T", [1, 29, 300])
@pytest.mark.parametrize("case", sorted(c for c in FAMILIES if c != "llama4_text"))
def test_router_kernels_match_transformers(case, T):
    check_router(cuda_model(case, torch.float32), T)


@pytest.mark.parametrize("case", sorted(c for c in FAMILIES if c != "llama4_text"))
def test_routers_false_permutes_transformers_ids_with_the_kernel(case, kernel_calls):
    model = cuda_model(case, torch.bfloat16)
    block = moe_blocks(model)[0]
    x = inputs(model, 13, torch.bfloat16).cuda()
    ref = run_block(block, x)
    kt.enable(model, routers=False)
    assert rel_err(run_block(block, x), ref) <= tol(block, torch.bfloat16, 13)
    assert kernel_calls["permute"] == 1 and kernel_calls["route"] == 0 and kernel_calls["finalize"] == 1


@pytest.mark.skipif(not SM90, reason="torch._grouped_mm's capturable bf16 path needs sm_90+")
@pytest.mark.parametrize("T", [1, 8, 64])
@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_block_in_a_cuda_graph(case, T):
    """The whole block (kerngen routing, permutation, grouped GEMMs, finalize) captured and replayed, on new
    inputs copied into the captured buffer."""
    model = cuda_model(case, torch.bfloat16)
    block = moe_blocks(model)[0]
    kt.enable(model)
    x = inputs(model, T, torch.bfloat16, seed=3).cuda()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run_block(block, x)   # compiles and loads the kernels outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run_block(block, x)
        for seed in (4, 5):
            x.copy_(inputs(model, T, torch.bfloat16, seed=seed))
            graph.replay()
            torch.cuda.synchronize()
            kt.disable(model)
            ref = run_block(block, x)
            kt.enable(model)
            assert rel_err(out, ref) <= tol(block, torch.bfloat16, T), (case, T, seed)


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_greedy_generate_gives_the_same_ids_on_gpu(case):
    model = cuda_model(case, torch.float32)
    prompt = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        kt.enable(model)
        out = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)


def test_top_k_8_blocks_take_tiles_of_32_where_the_rule_gives_them(monkeypatch):
    """A Qwen3-MoE block of 16 experts, top-k 8, at 240 tokens (about 120 rows an expert): the router's permutation is
    built at the tile-32 rule's tile (num_experts and top_k passed down), the kernels read it, the output is
    transformers' eager block's."""
    tiles = []
    real = kerngen.route
    monkeypatch.setattr(kerngen, "route", lambda *a, **kw: tiles.append(kw.get("tile")) or real(*a, **kw))
    model = tiny("qwen3_moe", num_experts=16, num_experts_per_tok=8).to("cuda", torch.bfloat16)
    block = moe_blocks(model)[0]
    x = inputs(model, 240, torch.bfloat16).cuda()
    ref = run_block(block, x)
    kt.enable(model)
    out = run_block(block, x)
    kt.disable(model)
    assert tiles == [32] and rel_err(out, ref) <= TOL_FUSED


@pytest.mark.parametrize("case", ["gpt_oss", "llama4_text"])
def test_transposed_families_take_the_kernels_past_16_tokens(case, kernel_calls):
    """gpt-oss and Llama-4 keep their expert weights transposed; enable stores them as kerngen.experts reads them
    (relayout), so at 29 tokens (past the transposed build's 16) its kernels serve the block, within the fused
    tolerance of transformers' eager block; relayout=False leaves that to the grouped GEMM."""
    model = cuda_model(case, torch.bfloat16)
    block = moe_blocks(model)[0]
    x = inputs(model, 29, torch.bfloat16).cuda()
    ref = run_block(block, x)
    for relayout, kernels in ((True, 1), (False, 0)):
        kernel_calls["experts"] = 0
        kt.enable(model, relayout=relayout)
        out = run_block(block, x)
        kt.disable(model)
        assert kernel_calls["experts"] == kernels and rel_err(out, ref) <= TOL_FUSED, (relayout, kernel_calls)
    assert block.experts.gate_up_proj.is_contiguous() and torch.equal(run_block(block, x), ref)
