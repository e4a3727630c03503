"""tools/bench/latent_tail.py on the CPU, no timing: what --rule times at each T beside the tier rule."""
import pytest

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
    for T in (1, 4, 8):
        tier = dict(tier_spec(T).params)
        assert bench.rule_params(rule, tier_spec(T), T) == {**tier, "early_weights": True}, T
    for T in (17, 24):   # norm_gemm: no fused kernel to lay them over
        assert bench.rule_params(rule, tier_spec(T), T) is None
    assert bench.rule_params(None, tier_spec(1), 1) is None


def test_a_whole_launch_shape_times_alone_up_to_its_max_tokens():
    rule = bench.parse_rule("max_tokens=8,warps=8,unroll=4,cluster=8,pdl=false")
    assert rule == dict(max_tokens=8, warps=8, unroll=4, cluster=8, pdl=False)
    assert bench.rule_params(rule, tier_spec(8), 8) == rule
    assert bench.rule_params(rule, tier_spec(9), 9) is None


def test_split_lays_over_the_tier_rule_and_builds_the_two_kernels():
    rule = bench.parse_rule("split=true,blocks_per_sm=3")
    assert rule == {"split": True, "blocks_per_sm": 3}
    for T in (1, 8):
        params = bench.rule_params(rule, tier_spec(T), T)
        assert params == {**dict(tier_spec(T).params), **rule}, T
        s = bench.spec_for(bench.Rule(lt.OP, "fused", {}, params), *lt.tag_constants(*KIMI[:2], KIMI[2], "float32"),
                           "sm_90a")
        assert lt.split(s) and sorted(lt.persistent(s)) == [lt.NORM, lt.PROJ]


def test_a_variant_named_times_at_every_token_count():
    rule = bench.parse_rule("variant=norm_gemm,cluster=8,pdl=true")
    assert rule == {"variant": "norm_gemm", "cluster": 8, "pdl": True}
    for T in (1, 16, 17, 512):
        assert bench.rule_params(rule, tier_spec(T), T) == rule


def test_the_whole_unfused_tail_is_the_reference_within_its_roundings():
    import torch
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(40, 72, generator=gen).bfloat16()
    e2p = torch.randperm(40, generator=gen)[:12].view(3, 4).int()
    e2p[0, 1], e2p[1, 2] = -1, 99   # skipped rows
    w, nw = torch.rand(3, 4, generator=gen), (torch.rand(64, generator=gen) + 0.5).bfloat16()
    up, sh, res = (torch.randn(*s, generator=gen).bfloat16() for s in ((16, 64), (3, 16), (3, 16)))
    got = bench.unfused_all(g, e2p, w, nw, up, sh, res)
    want = lt.reference(g, e2p, w, nw, up, shared=sh, residual=res)
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -6, atol=0.05)
    assert not torch.equal(bench.unfused_all(g, e2p.clamp(min=0), w, nw, up, sh, res), got)   # the skips matter


def test_several_rules_each_a_column():
    rules = bench.parse_rules("split=true;variant=norm_gemm,cluster=1;max_tokens=8,warps=8,unroll=2")
    assert rules == [{"split": True}, {"variant": "norm_gemm", "cluster": 1},
                     {"max_tokens": 8, "warps": 8, "unroll": 2}]
    assert bench.parse_rules(None) == [] and bench.parse_rules("") == []
    assert [bench.rule_params(r, tier_spec(20), 20) is None for r in rules] == [True, False, True]


def test_rows_written_needs_a_producer_step(capsys):
    """--rows-written rewrites the routed rows in the producer's step; with --chained (no producer) it is a usage
    error before anything needs a GPU."""
    with pytest.raises(SystemExit) as e:
        bench.main(["--rows-written", "--chained"])
    assert e.value.code == 2 and "--rows-written" in capsys.readouterr().err
