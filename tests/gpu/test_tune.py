"""kerngen tune on the GPU: every op's candidates run, are checked, and the winners load as tier rules."""
import pytest
import torch

from kerngen import tiers, tune

pytestmark = pytest.mark.gpu


def test_tune_writes_rules_that_dispatch_uses(tmp_path, gpu_cache):
    rules = tune.tune("kimi-k3", ["routing", "finalize", "tail"], tokens=(1, 8), progress=False)
    assert {r.op for r in rules} == {"routing", "finalize", "tail"}
    path = tmp_path / "tuned.toml"
    tune.write(path, "kimi-k3", rules)
    t = tiers.load(path)
    assert torch.cuda.get_device_name() in path.read_text()
    for op, shape in (("routing", {"num_experts": 896, "top_k": 16}), ("finalize", {"hidden": 3584, "top_k": 16}),
                      ("tail", {"hidden": 3584, "top_k": 16})):
        for T in (1, 8):
            assert str(path) in t.rule(op, {**shape, "tokens": T}).source, (op, T)
