"""tools/bench/moe_block.py on the CPU, no timing: its blocks for tiny made-up models of every routing method,
each implementation's output checked against eager's as the bench checks it after timing."""
import pytest
import torch

pytest.importorskip("transformers")
from kerngen.tiers import Model  # noqa: E402
from tests.helpers import one_thread  # noqa: E402
from tools.bench import moe_block as bench  # noqa: E402


TINY = {   # (model, the transformers block the bench builds for it)
    "sigmoid_bias": (Model("tiny-sigmoid", 16, 4, 64, "sigmoid_bias", (1, 64), routed_scaling_factor=2.5),
                     "DeepseekV3MoE"),
    "grouped_sigmoid_bias": (Model("tiny-grouped", 16, 4, 64, "grouped_sigmoid_bias", (1, 64), n_group=4,
                                   topk_group=2, routed_scaling_factor=2.5), "DeepseekV3MoE"),
    "softmax_topk": (Model("tiny-softmax", 16, 4, 64, "softmax_topk", (1, 64)), "Qwen3MoeSparseMoeBlock"),
    "topk_softmax": (Model("tiny-topk-softmax", 16, 2, 64, "topk_softmax", (1, 64)), "GptOssMLP"),
    "top1_sigmoid": (Model("tiny-top1", 16, 1, 64, "top1_sigmoid", (1, 64), router_weight="input"),
                     "Llama4TextMoe"),
}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def case(method, T, dtype=torch.bfloat16):
    m, cls = TINY[method]
    block = bench.build_block(m, 32, device="cpu", dtype=dtype)
    x = torch.randn(1, T, m.hidden, generator=torch.Generator().manual_seed(T)).to(dtype)
    return m, cls, block, x


@pytest.mark.parametrize("method", sorted(TINY))
@pytest.mark.parametrize("T", [1, 8])
def test_every_implementation_matches_eager(method, T):
    m, cls, block, x = case(method, T)
    assert type(block).__name__ == cls
    checked = bench.check(block, x, graph=False)
    want = {"eager", "kerngen"} if cls == "Llama4TextMoe" else set(bench.IMPLS)
    assert set(checked["outputs"]) == want and not checked["notes"]
    errs = bench.errors(checked["outputs"])
    assert errs["eager"] == 0 and max(errs.values()) <= bench.TOL, errs


def test_the_check_catches_a_wrong_weight(monkeypatch):
    m, cls, block, x = case("sigmoid_bias", 8)
    from kerngen.integrations import transformers_experts as kx
    real = kx._finalize
    monkeypatch.setattr(kx, "_finalize", lambda g, e2p, w: real(g, e2p, w.flip(-1)))   # weights of other slots
    errs = bench.errors(bench.check(block, x, graph=False)["outputs"])
    assert errs["kerngen"] > bench.TOL and errs["grouped_mm"] <= bench.TOL


def test_unknown_model_is_refused_by_name():
    with pytest.raises(SystemExit):
        bench.main(["--models", "no-such-model"])
