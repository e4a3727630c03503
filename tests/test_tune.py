"""The tuner's output file: rules merged over token buckets, provenance, refusal to touch tiers.toml."""
import pytest

from kerngen import env, tiers, tune
from kerngen.errors import KerngenError


def test_merge_and_write_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "provenance", lambda: {"gpu": "NVIDIA H200", "sm_count": 132, "date": "2026-11-29"})
    model = tiers.load().model("kimi-k3")
    small = dict(block_x=16, loads_per_group=2, pdl=True, early_read=False)
    large = dict(vectors_per_thread=2, unroll=4, pdl=True, early_read=False)
    winners = [(1, 1.5, "small_batch", small), (8, 1.9, "small_batch", small), (64, 3.0, "large_batch", large),
               (4096, 120.0, "large_batch", large)]
    rules = tune._merge("finalize", model, winners)
    assert [(r.variant, r.ranges["tokens"]) for r in rules] == [("small_batch", (1, 36)), ("large_batch", (37, 8192))]
    out = tmp_path / "tuned.toml"
    tune.write(out, "kimi-k3", rules)
    t = tiers.load(out)
    r = t.rule("finalize", {"hidden": 3584, "top_k": 16, "tokens": 20})
    assert r.variant == "small_batch" and r.params == small and str(out) in r.source
    assert t.rule("finalize", {"hidden": 3584, "top_k": 16, "tokens": 37}).params == large
    assert "NVIDIA H200" in out.read_text()


def test_never_writes_the_shipped_table():
    with pytest.raises(KerngenError, match="refusing"):
        tune.write(env.shipped_tiers(), "kimi-k3", [])
