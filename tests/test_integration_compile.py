"""kerngen.integrations.transformers under torch.compile, on the CPU: the MoE block traces with no graph break
(torch._dynamo.explain), its kernels' work is kerngen's custom ops (kerngen::route, kerngen::moe_experts), and the
compiled block gives transformers' eager result within the integration's tolerance. The CPU kernels of the ops
are kerngen's references; the CUDA ones run in tests/gpu/test_integration_transformers.py."""
import pytest
import torch

pytest.importorskip("transformers")
import kerngen.integrations.transformers as kt  # noqa: E402
from tests.helpers import one_thread  # noqa: E402
from tests.test_integration_transformers import TOL, TOL_FUSED, inputs, moe_blocks, rel_err, run_block, tiny  # noqa: E402

# families whose experts kerngen.experts serves (gate and up concatenated; gpt-oss's interleaved gate on weights
# stored transposed, read in place), and one it does not
SERVED = ["qwen3_moe", "deepseek_v3-kimi", "deepseek_v3-grouped", "mixtral", "qwen2_moe", "gpt_oss"]
NOT_SERVED = ["nemotron_h"]   # no gate (up, activation, down): transformers' grouped_mm code, kerngen's router


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def kerngen_ops(explanation) -> set[str]:
    return {str(op) for ops in explanation.ops_per_graph for op in ops if "kerngen" in str(op)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", SERVED + NOT_SERVED)
def test_block_traces_whole_and_matches_eager(case, dtype):
    model = tiny(case).to(dtype)
    block = moe_blocks(model)[0]
    x = inputs(model, 5, dtype)
    ref = run_block(block, x)   # transformers' router and "eager" experts
    kt.enable(model)
    torch._dynamo.reset()
    with torch.no_grad():
        explanation = torch._dynamo.explain(block)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    ops = kerngen_ops(explanation)
    assert "kerngen.route" in ops
    served = case in SERVED and dtype == torch.bfloat16   # the kernels take bf16 activations
    assert ("kerngen.moe_experts" in ops) == served, ops
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        out = compiled(x)
    out = out[0] if isinstance(out, tuple) else out
    assert out.dtype == dtype and out.shape == ref.shape
    # served: kerngen.experts' arithmetic (gate and up in fp32 into the activation, rounded once), as eager on CUDA
    assert rel_err(out, ref) <= (TOL_FUSED if served else TOL[dtype]), case
    assert "_kerngen_state" not in block.experts.__dict__   # the compiled path keeps nothing on the module
    kt.disable(model)


def test_compiled_block_follows_the_routing():
    """Another input routes to other experts: the compiled block's output changes with it, as eager's does."""
    model = tiny("qwen3_moe").to(torch.bfloat16)
    block = moe_blocks(model)[0]
    kt.enable(model)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    for seed in (1, 2, 3):
        x = inputs(model, 7, torch.bfloat16, seed=seed)
        kt.disable(model)
        ref = run_block(block, x)
        kt.enable(model)
        with torch.no_grad():
            out = compiled(x)
        assert rel_err(out, ref) <= TOL_FUSED, seed
    kt.disable(model)
