"""kerngen.integrations.transformers under torch.compile on the GPU: the MoE block compiled with CUDA graphs
(mode="reduce-overhead", torch's CUDA-graph trees, which own the memory of what they capture) gives transformers'
eager result call after call on changing inputs, and a compiled greedy generate (static cache) the ids of kerngen's
eager one."""
import pytest
import torch

from tests.test_integration_transformers import TOL_FUSED, inputs, kt, moe_blocks, rel_err, run_block, tiny

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]
WIDE = dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=128, head_dim=64)   # kernel-sized


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3-kimi", "gpt_oss"])
@pytest.mark.parametrize("T", [1, 8, 40])
def test_block_compiled_with_cuda_graphs(case, T):
    model = tiny(case, **(WIDE if case != "deepseek_v3-kimi" else dict(hidden_size=256, moe_intermediate_size=128)))
    model = model.to("cuda", torch.bfloat16)
    block = moe_blocks(model)[0]
    xs = [inputs(model, T, torch.bfloat16, seed=s).cuda() for s in range(4)]
    refs = [run_block(block, x) for x in xs]   # transformers' router and eager experts
    kt.enable(model)
    torch._dynamo.reset()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for _ in range(2):   # warm-up, record, then replays; inputs change under the same graph
        for x, ref in zip(xs, refs):
            with torch.no_grad():
                out = compiled(x.clone())
            out = (out[0] if isinstance(out, tuple) else out).clone()
            # inductor keeps the compiled block's bf16 intermediates in fp32 (as kerngen's kernels do): TOL_FUSED
            err = rel_err(out, ref)
            assert err <= TOL_FUSED, (case, T, err)
    kt.disable(model)


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3-kimi"])
def test_compiled_generate_gives_the_eager_ids(case):
    model = tiny(case, **(WIDE if case == "qwen3_moe" else dict(hidden_size=256, moe_intermediate_size=128)))
    model = model.to("cuda", torch.bfloat16)
    model.generation_config.pad_token_id = 0
    kt.enable(model)
    ids = torch.randint(1, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0)).cuda()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    with torch.no_grad():
        eager = model.generate(ids, disable_compile=True, **kw)
        torch._dynamo.reset()
        compiled = model.generate(ids, cache_implementation="static", **kw)
        again = model.generate(ids, cache_implementation="static", **kw)
        # one StaticCache reset and passed to every call (its addresses, so the CUDA graphs recorded on the first
        # call, replayed by the next: what tools.bench.generate --compile times)
        from transformers import StaticCache
        cache = StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=ids.shape[1] + 12)
        reused = []
        for _ in range(2):
            cache.reset()
            reused.append(model.generate(ids, cache=cache, **kw))
    # the same kernels in both; attention and the norms may round differently compiled, so the first tokens
    # (where the logits' margins dwarf that) must agree and the compiled runs must agree with each other
    assert torch.equal(compiled, again)
    assert all(torch.equal(r, compiled) for r in reused)
    assert torch.equal(compiled[:, :ids.shape[1] + 4], eager[:, :ids.shape[1] + 4])
    kt.disable(model)
