"""kerngen tune on the GPU: the experts timers run their candidates (checked against the reference) and write rules
the table loads."""
import itertools

import pytest

from kerngen import tiers, tune

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]


def test_experts_tuning_times_checked_candidates_and_writes_loadable_rules(tmp_path, monkeypatch):
    candidates = tune.experts_candidates
    monkeypatch.setattr(tune, "experts_candidates",
                        lambda fmt="bf16": itertools.islice(candidates(fmt), 2))
    monkeypatch.setitem(tune.TUNERS, "experts", (tune.experts_candidates, tune._time_experts))
    rules = tune.tune("gpt-oss-120b", ["experts"], tokens=[1, 8], progress=False)
    assert {r.formats for r in rules} <= {("bf16",), ("mxfp4",)} and {f for r in rules for f in r.formats} == {
        "bf16", "mxfp4"}
    out = tmp_path / "tuned.toml"
    tune.write(out, "gpt-oss-120b", rules)
    t = tiers.load(out)
    r = t.rule("experts", {"hidden": 2880, "tokens": 8, "format": "mxfp4", "arch": rules[0].arch[0]})
    assert str(out) in r.source and r.params["tile"] in (8, 16)


def test_latent_tail_tuning_times_checked_candidates_and_writes_loadable_rules(tmp_path, monkeypatch):
    """kimi-k3: a split fused candidate and a norm_gemm one, each checked against the reference before it is timed;
    the fused rule stops at its max_tokens and the file loads."""
    cands = [("fused", dict(max_tokens=8, warps=8, unroll=2, cluster=8, blocks_per_sm=2, pdl=True, split=True)),
             ("norm_gemm", dict(cluster=1, pdl=True))]
    monkeypatch.setitem(tune.TUNERS, "latent_tail", (lambda: iter(cands), tune._time_latent_tail))
    rules = tune.tune("kimi-k3", ["latent_tail"], tokens=[1, 8, 64], progress=False)
    assert rules and rules[-1].variant == "norm_gemm" and rules[-1].ranges["tokens"][1] == 8192
    assert all(r.ranges["tokens"][1] <= r.params.get("max_tokens", 8192) for r in rules)
    out = tmp_path / "tuned.toml"
    tune.write(out, "kimi-k3", rules)
    t = tiers.load(out)
    assert str(out) in t.rule("latent_tail", {"hidden": 3584, "top_k": 16, "tokens": 64, "arch": rules[0].arch[0]}).source
