"""Tier rules per GPU architecture: a rule names the targets it serves; dispatch, warmup and explain match on
the target arch, the tuner writes its GPU's arch into the rules it emits."""
import subprocess
import sys

import pytest

from kerngen import plan, tiers, tune, warmup
from kerngen.errors import TierError

TWO_ARCHES = """schema = 1

[[tier]]
op = "finalize"
variant = "small_batch"
arch = ["sm_100a"]
tokens = [1, 64]
params = { block_x = 32, loads_per_group = 2, pdl = true, early_read = false }

[[tier]]
op = "finalize"
variant = "small_batch"
arch = ["sm_90a"]
tokens = [1, 64]
params = { block_x = 16, loads_per_group = 2, pdl = true, early_read = false }
"""


@pytest.fixture
def two(tmp_path):
    path = tmp_path / "arch.toml"
    path.write_text(TWO_ARCHES)
    return tiers.load(path)


def test_a_rule_serves_only_the_arches_it_names(two):
    shape = {"hidden": 3584, "top_k": 16, "tokens": 8}
    assert two.rule("finalize", {**shape, "arch": "sm_100a"}).params["block_x"] == 32
    assert two.rule("finalize", {**shape, "arch": "sm_90a"}).params["block_x"] == 16
    other = two.rule("finalize", {**shape, "arch": "sm_120"})        # neither: a shipped rule serves it
    assert "arch.toml" not in other.source and (not other.arch or "sm_120" in other.arch)


def test_plan_puts_the_target_arch_in_the_spec_and_the_match(two):
    for arch, bx in (("sm_90a", 16), ("sm_100a", 32)):
        s = plan.plan(two, "finalize", {"hidden": 3584, "top_k": 16, "tokens": 8}, "t", {"H": 3584}, arch)
        assert s.arch == arch and dict(s.params)["block_x"] == bx


def test_warmup_for_two_arches_takes_each_arches_rules(two):
    m = two.model("kimi-k3")
    got = {arch: {dict(s.params).get("block_x") for s in warmup.model_specs(m, two, arch, ("finalize",))
                  if s.variant == "small_batch"} for arch in ("sm_90a", "sm_100a")}
    assert 16 in got["sm_90a"] and 32 not in got["sm_90a"]
    assert 32 in got["sm_100a"] and 16 not in got["sm_100a"]


def test_sm_count_ranges_apply_when_the_shape_has_one(tmp_path):
    path = tmp_path / "sm.toml"
    path.write_text(TWO_ARCHES.replace('arch = ["sm_100a"]', 'arch = ["sm_100a"]\nsm_count = [140, 160]'))
    t = tiers.load(path)
    shape = {"hidden": 3584, "top_k": 16, "tokens": 8, "arch": "sm_100a"}
    assert t.rule("finalize", {**shape, "sm_count": 148}).params["block_x"] == 32
    assert t.rule("finalize", {**shape, "sm_count": 132}).params.get("block_x") != 32


@pytest.mark.parametrize("bad", ['"sm_90a"', "[]", '["banana"]', "[90]"])
def test_a_bad_arch_field_is_a_tier_error_naming_it(tmp_path, bad):
    path = tmp_path / "bad.toml"
    path.write_text(TWO_ARCHES.replace('arch = ["sm_90a"]', f"arch = {bad}"))
    with pytest.raises(TierError, match="arch"):
        tiers.load(path)


def test_the_tuner_writes_its_gpus_arch_into_its_rules(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "provenance", lambda: {"gpu": "NVIDIA B200", "sm_count": 148})
    model = tiers.load().model("kimi-k3")
    small = dict(block_x=16, loads_per_group=2, pdl=True, early_read=False)
    rules = tune._merge("finalize", model, [(1, 1.0, "small_batch", small)], "sm_100a")
    out = tmp_path / "tuned.toml"
    tune.write(out, "kimi-k3", rules)
    assert 'arch = ["sm_100a"]' in out.read_text()
    t = tiers.load(out)
    assert t.rules[0].arch == ("sm_100a",)
    assert t.rule("finalize", {"hidden": 3584, "top_k": 16, "tokens": 1, "arch": "sm_90a"}).source != t.rules[0].source


def test_explain_names_the_rule_of_the_target_arch(tmp_path):
    path = tmp_path / "arch.toml"
    path.write_text(TWO_ARCHES)
    outs = {}
    for arch in ("sm_90a", "sm_100a"):
        r = subprocess.run([sys.executable, "-m", "kerngen", "explain", "--op", "finalize", "--topk", "16",
                            "--hidden", "3584", "--tokens", "8", "--arch", arch, "--tiers", str(path)],
                           capture_output=True, text=True, cwd=tmp_path,
                           env={"KERNGEN_CACHE_DIR": str(tmp_path / "c"), "PATH": "/usr/bin:/bin",
                                **{k: v for k, v in __import__("os").environ.items() if k.startswith("PYTHON")}})
        assert r.returncode == 0, r.stderr
        outs[arch] = r.stdout
    assert "'block_x': 16" in outs["sm_90a"] and "'block_x': 32" in outs["sm_100a"]
    assert "arch      sm_100a" in outs["sm_100a"]


def test_every_shipped_rule_of_an_arch_builds_for_it(tmp_path):
    """Each rule that names arches compiles for each of them (the other rules: tests/test_compile.py)."""
    from kerngen import jit
    from kerngen.cache import DiskCache
    from tests.helpers import assert_no_spills
    tbl = tiers.load()
    named = {a for r in tbl.rules for a in r.arch}
    built = 0
    for arch in sorted(named):
        for name in ("kimi-k3", "deepseek-v3", "mixtral-8x7b"):
            for s in warmup.model_specs(tbl.model(name), tbl, arch, ("routing", "finalize")):
                rule_arches = {a for r in tbl.rules for a in r.arch if r.variant == s.variant}
                if arch in rule_arches and s.backend == "nvrtc":
                    assert_no_spills(jit.build(s, store=DiskCache(tmp_path), strict=False).files)
                    built += 1
    assert built or not named


def test_warmup_for_both_shipped_arches_takes_each_arches_rules(tmp_path):
    """`kerngen warmup --arch sm_90a,sm_100a`: the H200's onepass permutation has 32 CTAs, the B200's 36."""
    tbl = tiers.load()
    m = tbl.model("kimi-k3")
    ctas = {arch: {dict(s.params).get("ctas") for s in warmup.model_specs(m, tbl, arch, ("routing",))
                   if s.op == "permute" and s.variant == "onepass"} for arch in ("sm_90a", "sm_100a")}
    assert ctas["sm_90a"] == {32} and ctas["sm_100a"] == {36}
    out = subprocess.run([sys.executable, "-m", "kerngen", "explain", "--model", "kimi-k3", "--op", "finalize",
                          "--tokens", "18", "--arch", "sm_100a"], capture_output=True, text=True, cwd=tmp_path,
                         env={**__import__("os").environ, "KERNGEN_CACHE_DIR": str(tmp_path / "c")})
    # 18 tokens: the B200's first small_batch rule (block_x 16, up to 18), the H200's second (block_x 64)
    assert out.returncode == 0 and "small_batch" in out.stdout and "'block_x': 16" in out.stdout, out.stderr
