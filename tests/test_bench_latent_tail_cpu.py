"""tools/bench/latent_tail.py on the CPU, no timing: what --rule times at each T beside the tier rule."""
from kerngen import tiers
from kerngen.ops import latent_tail as lt
from tools.bench import latent_tail as bench

KIMI = (3584, 7168, 16)   # L, H, K


def tier_spec(T):
    L, H, K = KIMI
    return lt.spec(L, H, K, "float32", T, "sm_90a", tiers.load())


def test_rule_params_over_the_tier_rule_at_each_token_count():
    rule = bench.parse_rule("early_weights=true")
    assert rule == {"early_weights": True}
    for T in (1, 8, 9, 16):
        tier = dict(tier_spec(T).params)
        assert bench.rule_params(rule, tier_spec(T), T) == {**tier, "early_weights": True}, T
    assert bench.rule_params(rule, tier_spec(17), 17) is None   # the unfused variant: no fused kernel to compare
    assert bench.rule_params(None, tier_spec(1), 1) is None


def test_a_whole_launch_shape_times_alone_up_to_its_max_tokens():
    rule = bench.parse_rule("max_tokens=8,warps=8,unroll=4,cluster=8,pdl=false")
    assert rule == dict(max_tokens=8, warps=8, unroll=4, cluster=8, pdl=False)
    assert bench.rule_params(rule, tier_spec(8), 8) == rule
    assert bench.rule_params(rule, tier_spec(9), 9) is None


def test_split_lays_over_the_tier_rule_and_builds_the_two_kernels():
    rule = bench.parse_rule("split=true,blocks_per_sm=3")
    assert rule == {"split": True, "blocks_per_sm": 3}
    for T in (1, 8, 16):
        params = bench.rule_params(rule, tier_spec(T), T)
        assert params == {**dict(tier_spec(T).params), **rule}, T
        s = bench.spec_for(bench.Rule(lt.OP, "fused", {}, params), *lt.tag_constants(*KIMI[:2], KIMI[2], "float32"),
                           "sm_90a")
        assert lt.split(s) and sorted(lt.persistent(s)) == [lt.NORM, lt.PROJ]
