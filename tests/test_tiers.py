"""Tier table parsing, validation messages, layering and dispatch."""
import pytest

from kerngen import tiers
from kerngen.errors import TierError

SHIPPED = {"deepseek-v3", "kimi-k2", "kimi-k3", "glm-4.5", "qwen3-235b-a22b", "qwen3-30b-a3b",
           "qwen3-next-80b", "gpt-oss-120b", "llama-4-maverick", "mixtral-8x7b"}


def write(tmp_path, text, name="t.toml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_shipped_models_have_mission_constants():
    t = tiers.load()
    assert SHIPPED <= set(t.models)
    ds = t.model("deepseek-v3")
    assert (ds.num_experts, ds.top_k, ds.hidden, ds.routing, ds.n_group, ds.topk_group, ds.routed_scaling_factor) \
        == (256, 8, 7168, "grouped_sigmoid_bias", 8, 4, 2.5)
    k3 = t.model("kimi-k3")
    assert (k3.num_experts, k3.top_k, k3.hidden, k3.routing, k3.routed_scaling_factor) == (896, 16, 3584, "sigmoid_bias", 2.5)
    assert t.model("kimi-k2").routed_scaling_factor == pytest.approx(2.827)
    assert t.model("gpt-oss-120b").routing == "topk_softmax"
    assert t.model("llama-4-maverick").top_k == 1


def test_every_model_dispatches_finalize_over_its_range():
    t = tiers.load()
    for m in t.models.values():
        for T in (m.tokens[0], 8, 64, m.tokens[1]):
            r = t.rule("finalize", {"hidden": m.hidden, "top_k": m.top_k, "num_experts": m.num_experts, "tokens": T})
            assert r.op == "finalize"


@pytest.mark.parametrize("text, needle", [
    ("schema = 2\n", "field 'schema' must be 1"),
    ("schema = 1\nfoo = 3\n", "unknown top-level key 'foo'"),
    ("schema = 1\n[models.m]\nnum_experts = 8\ntop_k = 2\nhidden = 64\ntokens = [1, 8]\n", "[models.m]: field 'routing'"),
    ("schema = 1\n[models.m]\nnum_experts = 3000\ntop_k = 2\nhidden = 64\nrouting = 'softmax_topk'\ntokens = [1, 8]\n",
     "'num_experts' must be an integer in [1, 2048]"),
    ("schema = 1\n[models.m]\nnum_experts = 8\ntop_k = 9\nhidden = 64\nrouting = 'softmax_topk'\ntokens = [1, 8]\n",
     "'top_k'"),
    ("schema = 1\n[models.m]\nnum_experts = 10\ntop_k = 2\nhidden = 64\nrouting = 'grouped_sigmoid_bias'\n"
     "n_group = 4\ntokens = [1, 8]\n", "'n_group' (4) must divide num_experts (10)"),
    ("schema = 1\n[models.m]\nnum_experts = 8\ntop_k = 2\nhidden = 60\nrouting = 'softmax_topk'\ntokens = [1, 8]\n",
     "multiple of 8"),
    ("schema = 1\n[models.m]\nnum_experts = 8\ntop_k = 2\nhidden = 64\nrouting = 'softmax_topk'\n", "'tokens'"),
    ("schema = 1\n[models.m]\nnum_experts = 8\ntop_k = 2\nhidden = 64\nrouting = 'softmax_topk'\ntokens = [1, 8]\ncolor = 1\n",
     "unknown field 'color'"),
    ("schema = 1\n[[tier]]\nop = 'finalise'\nvariant = 'x'\n", "[[tier]] #1: field 'op'"),
    ("schema = 1\n[[tier]]\nop = 'finalize'\n", "[[tier]] #1: missing required field 'variant'"),
    ("schema = 1\n[[tier]]\nop = 'finalize'\nvariant = 'x'\ntokens = [9, 1]\n", "field 'tokens' must be an inclusive range"),
    ("schema = 1\n[[tier]]\nop = 'finalize'\nvariant = 'x'\nparams = { a = [1] }\n", "'params' must be a table of scalars"),
    ("schema = 1\n[tier]\nop = 'finalize'\n", "write [[tier]]"),
    ("schema = 1\n[models\n", "not valid TOML"),
])
def test_bad_files_name_file_table_and_field(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(TierError) as e:
        tiers.parse(p)
    assert needle in str(e.value) and str(p) in str(e.value)


def test_user_file_layers_over_shipped(tmp_path):
    p = write(tmp_path, """schema = 1
[models.tiny]
num_experts = 16
top_k = 2
hidden = 256
routing = "softmax_topk"
tokens = [1, 64]

[models.kimi-k3]
num_experts = 896
top_k = 16
hidden = 3584
routing = "sigmoid_bias"
routed_scaling_factor = 3.0
tokens = [1, 128]

[[tier]]
op = "finalize"
variant = "large_batch"
hidden = [256, 256]
params = { vectors_per_thread = 1, unroll = 2 }
""")
    t = tiers.load(p)
    assert "tiny" in t.models and "deepseek-v3" in t.models
    assert t.model("kimi-k3").routed_scaling_factor == 3.0
    r = t.rule("finalize", {"hidden": 256, "top_k": 2, "tokens": 1})
    assert r.params == {"vectors_per_thread": 1, "unroll": 2} and str(p) in r.source
    shipped = t.rule("finalize", {"hidden": 512, "top_k": 2, "tokens": 1})
    assert "small_batch" == shipped.variant


def test_no_matching_rule_says_how_to_fix(tmp_path):
    p = write(tmp_path, "schema = 1\n")
    t = tiers.Table(models={}, rules=(), files=(str(p),))
    with pytest.raises(TierError, match="add a \\[\\[tier\\]\\] rule"):
        t.rule("finalize", {"hidden": 64, "top_k": 2, "tokens": 1})
    with pytest.raises(TierError, match="unknown model 'nope'"):
        tiers.load().model("nope")


def test_rules_for_splits_token_range():
    t = tiers.load()
    m = t.model("kimi-k3")
    variants = [r.variant for r in t.rules_for("finalize", {"hidden": m.hidden, "top_k": m.top_k}, m.tokens)]
    assert variants[0] == "small_batch" and "large_batch" in variants and variants[-1] == "cute"
    assert len(variants) == len([r for r in t.rules if r.op == "finalize"])  # every finalize rule serves kimi-k3
    only_small = t.rules_for("finalize", {"hidden": m.hidden, "top_k": m.top_k}, (1, 4))
    assert [r.variant for r in only_small] == ["small_batch"] and only_small[0].ranges["tokens"][0] == 1
