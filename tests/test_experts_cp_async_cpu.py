"""kerngen.experts' cp_async (fp8 / MXFP4 weights, prefetch = false, one step a batch; no GPU): a warp's weight
bytes of its next cp_async - 1 steps travel into a shared-memory ring. The 1-token rule of every shipped fp8 and
MXFP4 model (one step a batch) builds with it without spills in the K-step loop and with the ring's bytes in its static shared memory;
the shipped rules' sources hold none of it; rules that cannot take it are refused. The GPU tests
(tests/gpu/test_experts_quantized.py) check that the bits are those of the same build without it."""
import pytest

from kerngen import jit, render, resources, tiers
from kerngen.cache import DiskCache
from kerngen.errors import TierError
from kerngen.ops import experts as ex
from tests.test_experts_fused_x_cpu import one_token_rules


def cp_specs(cps):
    """(model, spec) of every shipped fp8 / MXFP4 model's 1-token rule with cp_async = cps."""
    for m, rule in one_token_rules():
        p = {**{k: v for k, v in rule.params.items() if k != "lean"}, "unroll": 1, "cp_async": cps}   # (a step a slot)
        yield m, ex.rule_spec(tiers.Rule("experts", "mma", rule.ranges, p), m.hidden, m.intermediate, m.activation,
                              "sm_90a", m.experts_format)


@pytest.mark.parametrize("cps", [3])
def test_one_token_rules_build_with_the_ring_and_no_spills_in_the_k_loop(cps, tmp_path):
    store = DiskCache(tmp_path)
    seen = set()
    for m, s in cp_specs(cps):
        if s in seen:
            continue
        seen.add(s)
        p = dict(s.params)
        plain = ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 1)}, {k: v for k, v in p.items() if k != "cp_async"}
                                        | {"tile": dict(s.constants)["TILE"]}), m.hidden, m.intermediate,
                             m.activation, "sm_90a", m.experts_format)
        files, base = jit.build(s, store=store).files, jit.build(plain, store=store).files
        text, use, use0 = resources.sass(files), dict(resources.usage(files)), dict(resources.usage(base))
        raw = 2 if m.experts_format == "fp8" else 1
        for fn in ("experts_gemm1", "experts_gemm2"):
            ring = p["warps"] * cps * p.get("mtiles", 1) * 2 * raw * 32 * 16
            assert use[fn]["SHARED"] == use0[fn]["SHARED"] + ring, (m.name, fn)
            assert use[fn]["REG"] <= 65536 // (32 * p["warps"] * p.get("min_blocks", 1)), (m.name, fn)
            loop = resources.mma_loop(text, fn)
            assert loop is not None and not loop[1], f"{m.name} {fn}: local memory in the K-step loop"
            assert "LDGSTS" in text.split(f"Function : {fn}")[1].split("Function :")[0]


def test_the_shipped_rules_do_not_take_it():
    t = tiers.load()
    rules = [r for r in t.rules if r.op == "experts"]
    assert rules and not any("cp_async" in r.params for r in rules)
    for m, rule in one_token_rules():
        s = ex.rule_spec(rule, m.hidden, m.intermediate, m.activation, "sm_90a", m.experts_format)
        assert "cp.async" not in render.render(s)


@pytest.mark.parametrize("over,fmt,layout,a8", [
    ({}, "bf16", "nk", False), ({"prefetch": True}, "mxfp4", "nk", False), ({"unroll": 2}, "fp8", "nk", False),
    ({}, "fp8", "nk", True)])
def test_rules_that_cannot_take_it_are_refused(over, fmt, layout, a8):
    p = {"tile": 8, "warps": 4, "unroll": 1, "prefetch": False, "cp_async": 3, **over}
    with pytest.raises(TierError, match="cp_async"):
        ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 8)}, p), 2048, 768, "silu", "sm_90a", fmt, layout, a8)


def test_the_ring_depth_is_bounded():
    with pytest.raises(TierError, match="cp_async"):
        tiers.check_params("test", "experts", "mma", {"tile": 8, "warps": 4, "unroll": 1, "cp_async": 1})


def test_a_ring_past_static_shared_memory_is_refused():
    p = {"tile": 8, "warps": 8, "unroll": 1, "prefetch": False, "f16x": True, "mtiles": 2, "cp_async": 4}
    ex.rule_spec(tiers.Rule("experts", "mma", {}, {**p, "mtiles": 1}), 2048, 768, "silu", "sm_90a", "mxfp4")  # 32 KiB
    with pytest.raises(TierError, match="cp_async = 4: its ring .* of 64 KiB"):
        ex.rule_spec(tiers.Rule("experts", "mma", {}, p), 2048, 768, "silu", "sm_90a", "mxfp4")
