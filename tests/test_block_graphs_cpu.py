"""Block graphs (kerngen.integrations.transformers_graphs) without a GPU: enable graphs every MoE block and disable
restores transformers' forward; KERNGEN_BLOCK_GRAPHS and enable(graphs=) set the token bound; the capture policy
(a shape met once runs eagerly, the second time it is captured, then replayed on the new input) with the capture
and replay stubbed; replaced weights, kerngen.clear() and hooks inside the block send calls back to the forward."""
import copy

import pytest
import torch
pytest.importorskip("transformers")
from transformers.utils import output_capturing  # noqa: E402

import kerngen  # noqa: E402
import kerngen.integrations.transformers as kt  # noqa: E402
from kerngen.integrations import transformers_graphs as kg  # noqa: E402
from tests.test_integration_transformers import inputs, moe_blocks, tiny  # noqa: E402


def graphs_of(block):
    return getattr(block.__dict__.get("forward"), "graphs", None)


@pytest.mark.parametrize("case", ["qwen3_moe", "gpt_oss", "llama4_text", "deepseek_v3-grouped"])
def test_enable_graphs_each_block_and_disable_restores(case):
    model = tiny(case)
    names = kt.enable(model)
    blocks = moe_blocks(model)
    assert blocks and all(graphs_of(b) is not None for b in blocks)
    assert all(graphs_of(b).max_tokens == kg.GRAPH_TOKENS for b in blocks)
    block_names = [n for n, m in model.named_modules() if any(m is b for b in blocks)]
    assert set(block_names) <= set(names) and len(names) == len(set(names))
    assert kt.enable(model) == names   # graphed once
    assert set(kt.disable(model)) == set(names)
    assert all("forward" not in b.__dict__ for b in blocks)


def test_graphs_off_and_the_variable(monkeypatch):
    model = tiny("qwen3_moe")
    kt.enable(model, graphs=False)
    assert all(graphs_of(b) is None for b in moe_blocks(model))
    kt.disable(model)
    monkeypatch.setenv("KERNGEN_BLOCK_GRAPHS", "0")
    kt.enable(model)
    assert all(graphs_of(b) is None for b in moe_blocks(model))
    kt.disable(model)
    monkeypatch.setenv("KERNGEN_BLOCK_GRAPHS", "1")
    kt.enable(model)
    assert all(graphs_of(b).max_tokens == 2 ** 31 - 1 for b in moe_blocks(model))
    kt.disable(model)
    monkeypatch.setenv("KERNGEN_BLOCK_GRAPHS", "sometimes")
    with pytest.raises(kerngen.EnvError, match="KERNGEN_BLOCK_GRAPHS"):
        kt.enable(model)
    assert all("forward" not in b.__dict__ for b in moe_blocks(model))   # refused before anything was patched


def test_a_forward_set_on_the_instance_is_graphed_and_restored():
    model = tiny("qwen3_moe")
    block = moe_blocks(model)[0]
    calls = []
    own = block.forward

    def mine(x):
        calls.append(1)
        return own(x)
    block.forward = mine
    kt.enable(model)
    with torch.no_grad():
        block(inputs(model, 2, torch.float32))
    assert calls == [1] and graphs_of(block).forward is mine
    kt.disable(model)
    assert block.__dict__["forward"] is mine


def enabled_block():
    """A tiny Qwen3-MoE model enabled: its first block, the block's BlockGraphs and a 2-token input."""
    model = tiny("qwen3_moe")
    kt.enable(model)
    block = moe_blocks(model)[0]
    return block, graphs_of(block), inputs(model, 2, torch.float32)


class FakeGraph:
    """A captured forward stand-in: replay runs the forward on the captured input into the captured output."""

    def __init__(self, forward, xs, out):
        self.forward, self.xs, self.out = forward, xs, out
        self.replays = 0

    def replay(self):
        self.replays += 1
        self.out.copy_(self.forward(self.xs))


@pytest.fixture
def stubbed(monkeypatch):
    """BlockGraphs with eligibility from its CPU-checkable conditions and a capture that records FakeGraphs."""
    made = []

    def capture(self, x, key):
        xs = x.clone()
        g = self._graphs[key] = kg._Graph(FakeGraph(self.forward, xs, self.forward(xs).clone()), xs, None)
        g.out = g.graph.out
        self._seen.discard(key)
        self.captures += 1
        made.append(key)
        return g
    monkeypatch.setattr(kg.BlockGraphs, "_capture", capture)
    monkeypatch.setattr(kg.BlockGraphs, "eligible",
                        lambda self, x: not torch.is_grad_enabled() and not self.block.training)
    return made


def test_a_shape_is_captured_the_second_time_and_replayed_on_new_inputs(stubbed):
    model = tiny("qwen3_moe")
    block = moe_blocks(model)[0]
    kt.enable(model)
    bg = graphs_of(block)
    xs = [inputs(model, 3, torch.float32, seed=s) for s in range(4)]
    with torch.no_grad():
        refs = [bg.forward(x) for x in xs]
        outs = [block(x) for x in xs]
    assert bg.captures == 1 and bg.replays == 3 and len(stubbed) == 1
    for out, ref in zip(outs, refs):
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert outs[3].data_ptr() != bg._graphs[stubbed[0]].out.data_ptr()   # a copy, not the graph's buffer
    with torch.no_grad():   # another token count: its own graph, the second time it is met
        block(inputs(model, 5, torch.float32))
        block(inputs(model, 5, torch.float32))
    assert bg.captures == 2 and bg.replays == 4
    with torch.enable_grad():
        block(xs[0])
    assert bg.replays == 4   # with gradients: the forward


def test_replaced_weights_and_clear_drop_the_graphs(stubbed):
    block, bg, x = enabled_block()
    with torch.no_grad():
        for _ in range(3):
            block(x)
        assert bg.captures == 1 and bg.replays == 2
        block.gate.weight = torch.nn.Parameter(block.gate.weight.flip(0))   # a new tensor: new pointers
        new = bg.forward(x)
        torch.testing.assert_close(block(x), new, rtol=0, atol=0)   # met once again: the forward
        assert bg.captures == 1 and not bg._graphs
        block(x)
        assert bg.captures == 2
        kerngen.clear()
        block(x)
        block(x)
        assert bg.captures == 3 and bg.replays == 4
        torch.testing.assert_close(block(x), new, rtol=0, atol=0)
        block.gate = copy.deepcopy(block.gate)   # a submodule replaced (the same values): captured again
        block(x)
        assert bg.captures == 3 and not bg._graphs
        block(x)
        assert bg.captures == 4


def test_hooks_inside_the_block_run_the_forward(stubbed):
    block, bg, x = enabled_block()
    seen = []
    handle = block.gate.register_forward_hook(lambda m, a, out: seen.append(1))
    with torch.no_grad():
        for _ in range(3):
            block(x)
    assert seen == [1, 1, 1] and bg.captures == 0
    handle.remove()

    def output_capturing_hook(m, a, out):   # named as transformers' recorders are
        seen.append(2)
    handle = block.gate.register_forward_hook(output_capturing_hook)
    assert bg._walk() is not None   # nothing recorded: a replay is the same
    token = output_capturing.__dict__["_active_collector"].set({"router_logits": []})
    try:
        assert bg._walk() is None
    finally:
        output_capturing.__dict__["_active_collector"].reset(token)
    handle.remove()
    assert not kg.global_hooks()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: None)
    try:
        assert kg.global_hooks()   # (eligible() then sends every call to the forward)
    finally:
        handle.remove()
    assert bg._walk() is not None and not kg.global_hooks()


def test_not_eligible_on_the_cpu():
    model = tiny("qwen3_moe")
    block = moe_blocks(model)[0]
    kt.enable(model)
    bg = graphs_of(block)
    with torch.no_grad():
        assert not bg.eligible(inputs(model, 1, torch.bfloat16))
        for _ in range(3):
            block(inputs(model, 1, torch.float32))
    assert bg.captures == 0 and not bg._seen


def test_tokens_bound():
    assert kg.tokens_bound(False) == 0 and kg.tokens_bound(True) == 2 ** 31 - 1
