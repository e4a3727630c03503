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
