"""Block graphs on the GPU: an enabled MoE block's eager bf16 decode forwards replayed from CUDA graphs give the
block's own eager results bit for bit (every family, new inputs each call, several token counts captured in turn
and after larger eager calls grew the buffers the graphs read); greedy generate gives the same ids with graphs on
and off; hooks, recorded router logits and replaced weights send calls back to the forward."""
import pytest
import torch

import kerngen
from tests.test_integration_transformers import FAMILIES, inputs, kt, moe_blocks, run_block, tiny

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]
BF16 = torch.bfloat16


def graphs_of(block):
    return block.__dict__["forward"].graphs


def eager(block, x):
    """The block's forward itself (kerngen's eager path), not the graphs."""
    with torch.no_grad():
        out = graphs_of(block).forward(x)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_replays_equal_the_forward_bitwise(case):
    model = tiny(case).to("cuda", BF16)
    kt.enable(model)
    block = moe_blocks(model)[0]
    bg = graphs_of(block)
    for T in (1, 4, 16):
        for seed in range(4):   # met once (eager), captured, then replayed on new inputs
            x = inputs(model, T, BF16, seed=seed).cuda()
            out = run_block(block, x)
            torch.testing.assert_close(out, eager(block, x), rtol=0, atol=0, msg=f"{case} T={T} seed={seed}")
    assert bg.captures == 3 and bg.replays == 9 and not bg.off, (bg.captures, bg.replays)
    big = inputs(model, 40, BF16).cuda()   # past the bound: the forward (and the eager buffers grow)
    torch.testing.assert_close(run_block(block, big), eager(block, big), rtol=0, atol=0)
    for T in (1, 4, 16):   # the graphs captured before still read live buffers
        x = inputs(model, T, BF16, seed=9).cuda()
        torch.testing.assert_close(run_block(block, x), eager(block, x), rtol=0, atol=0)
    assert bg.replays == 12


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss", "deepseek_v3-grouped", "llama4_text"])
def test_generate_gives_the_same_ids_with_graphs(case):
    model = tiny(case).to("cuda", BF16)
    prompt = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2)).cuda()
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        kt.enable(model, graphs=False)
        ref = model.generate(prompt, **kw)
        kt.disable(model)
        kt.enable(model)
        out = model.generate(prompt, **kw)
        again = model.generate(prompt, **kw)
    bg = graphs_of(moe_blocks(model)[0])
    assert bg.replays > 0 and torch.equal(out, ref) and torch.equal(again, ref)


def test_hooks_router_logits_and_new_weights_run_the_forward():
    model = tiny("qwen3_moe").to("cuda", BF16)
    kt.enable(model)
    block = moe_blocks(model)[0]
    bg = graphs_of(block)
    x = inputs(model, 1, BF16).cuda()
    for _ in range(3):
        run_block(block, x)
    assert bg.replays == 2
    seen = []
    handle = block.gate.register_forward_hook(lambda m, a, out: seen.append(1))
    run_block(block, x)
    handle.remove()
    assert seen == [1] and bg.replays == 2
    ids = torch.randint(0, 64, (1, 1), device="cuda")
    with torch.no_grad():
        for _ in range(2):
            out = model(ids, output_router_logits=True)
    assert len(out.router_logits) == model.config.num_hidden_layers and bg.replays == 2
    with torch.no_grad():
        block.gate.weight = torch.nn.Parameter(block.gate.weight.flip(0))
    ref = eager(block, x)
    for _ in range(3):
        torch.testing.assert_close(run_block(block, x), ref, rtol=0, atol=0)
    assert bg.captures == 2
    kerngen.clear()
    for _ in range(3):
        torch.testing.assert_close(run_block(block, x), ref, rtol=0, atol=0)
    assert bg.captures == 3


def test_a_caller_capture_takes_the_kernels():
    """Inside the caller's own capture the block runs its forward (the caller's graph holds the kernels)."""
    model = tiny("qwen3_moe").to("cuda", BF16)
    kt.enable(model)
    block = moe_blocks(model)[0]
    x = inputs(model, 2, BF16).cuda()
    for _ in range(3):
        run_block(block, x)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = block(x)
    y = inputs(model, 2, BF16, seed=7).cuda()
    x.copy_(y)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager(block, y), rtol=0, atol=0)


def test_graphs_made_again_after_every_earlier_graph_is_gone():
    """Blocks enabled, captured, disabled and collected, then enabled again: the shared pool takes new captures (and
    the RNG's capture state is left clean: a random op after them runs)."""
    import gc
    for _ in range(2):
        model = tiny("qwen3_moe").to("cuda", BF16)
        kt.enable(model)
        block = moe_blocks(model)[0]
        x = inputs(model, 1, BF16).cuda()
        for _ in range(3):
            torch.testing.assert_close(run_block(block, x), eager(block, x), rtol=0, atol=0)
        bg = graphs_of(block)
        assert bg.captures == 1 and bg.replays == 2 and not bg.off
        kt.disable(model)
        del model, block, bg
        gc.collect()
    assert torch.randn(8, device="cuda").isfinite().all()
