"""Routing rules for calls with and without a permutation: `permute = false` serves only kerngen.route calls without a
tile (ids and weights), `permute = true` only those with one (left out: both). Dispatch, warmup's specs and the tuner's
output carry the field (a bad one: tests/test_tiers.py)."""
import pytest

from kerngen import tiers, tune
from kerngen.ops import routing as ro
from tests.helpers import user_tiers

IDS_ONLY = """schema = 1

[[tier]]
op = "routing"
variant = "topk"
permute = false
num_experts = [896, 896]
top_k = [16, 16]
tokens = [1, 64]
params = { warps = 4, warps_per_token = 4, early_trigger = true }
"""


@pytest.fixture
def ids_only_tiers(tmp_path, monkeypatch):
    with user_tiers(tmp_path, monkeypatch, IDS_ONLY) as f:
        yield f


def kimi_dispatch(permute: bool):
    return ro.dispatch(-1, E=896, K=16, method="sigmoid_bias", n_group=1, topk_group=1, renormalize=True,
                       ldtype="float32", bdtype="float32", wdtype="float32", align=False, permute=permute)


def test_a_rule_without_permute_serves_only_calls_without_a_tile(ids_only_tiers):
    ids = kimi_dispatch(False)
    with_tile = kimi_dispatch(True)
    for T in (1, 8, 64):
        assert ids.spec(T).variant == "topk" and dict(ids.spec(T).params)["warps"] == 4
        assert dict(with_tile.spec(T).params)["warps"] != 4   # the shipped rules: the user's does not serve them
    assert with_tile.spec(1).variant == "fused"
    assert ids.spec(65) == with_tile.spec(65)   # past the user rule's tokens: the shipped rules for both
    r = tiers.load().rule("routing", {"num_experts": 896, "top_k": 16, "tokens": 1, "arch": "sm_90a"})
    assert r.variant == "fused" and r.permute is None
    r = tiers.load().rule("routing", {"num_experts": 896, "top_k": 16, "tokens": 1, "arch": "sm_90a", "permute": False})
    assert r.variant == "topk" and r.permute is False


def test_warmup_builds_the_rules_of_both_kinds_of_call(ids_only_tiers):
    t = tiers.load()
    routing = [s for s in ro.model_specs(t.model("kimi-k3"), t, "sm_90a") if s.op == "routing"]
    ids = [s for s in routing if s.variant == "topk" and dict(s.params)["warps"] == 4]
    assert {dict(s.constants)["LDTYPE"] for s in ids} == {"float32", "bfloat16"}   # (both logits dtypes)
    assert any(s.variant == "fused" for s in routing)


def test_a_permute_true_rule_is_skipped_by_calls_without_a_tile(tmp_path, monkeypatch):
    text = IDS_ONLY.replace("permute = false", "permute = true").replace("warps = 4, warps_per_token = 4",
                                                                           "warps = 8, warps_per_token = 8")
    with user_tiers(tmp_path, monkeypatch, text):
        s = kimi_dispatch(True).spec(1)
        assert s.variant == "topk" and dict(s.params)["warps"] == 8
        assert dict(kimi_dispatch(False).spec(1).params)["warps"] != 8   # the shipped rules serve it


def test_the_shipped_table_gives_kimi_k3_calls_without_a_tile_the_topk_kernel():
    """kimi-k3's top-k only (measured against SGLang's gate): the topk kernel at 4x4 up to 64 tokens; calls with a
    tile keep the fused rules."""
    t = tiers.load()
    for T in (1, 8, 64):
        q = {"num_experts": 896, "top_k": 16, "tokens": T, "arch": "sm_90a"}
        ids = t.rule("routing", {**q, "permute": False})
        assert ids.variant == "topk" and ids.permute is False and ids.params["warps"] == 4
        assert t.rule("routing", {**q, "permute": True}).permute is None
    assert t.rule("routing", {"num_experts": 896, "top_k": 16, "tokens": 1, "arch": "sm_90a",
                              "permute": True}).variant == "fused"


def test_the_tuners_file_keeps_the_field(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "provenance", lambda: {"gpu": "test"})
    f = tmp_path / "t.toml"
    f.write_text(IDS_ONLY)
    rule = tiers.parse(f)[1][0]
    out = tmp_path / "tuned.toml"
    tune.write(out, "kimi-k3", [rule])
    back = tiers.parse(out)[1][0]
    assert back.permute is False and back.variant == "topk" and back.params == rule.params
