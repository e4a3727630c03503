"""kerngen.experts' lean (fp8 / MXFP4 weights, prefetch = false; no GPU): a warp's K steps wholly inside
the dot product run in a loop of their own with no bound checks, an absent activation row reads a zero vector instead
of predicated loads (the partial last step, gpt-oss-120b's 2880 = 22.5 steps, takes the checked loop), and MXFP4
widens to bf16 in three integer instructions a pair. The 1-token rule of every shipped fp8 and MXFP4 model builds
with it in fewer instructions a K step, without local memory in the loop and within its register bound; the shipped
rules but MXFP4's of 1-2 tokens hold none of it; rules that cannot take it are refused. The GPU tests
(tests/gpu/test_experts_quantized.py) check that the bits are those of the build without it."""
import pytest

from kerngen import jit, render, resources, tiers
from kerngen.cache import DiskCache
from kerngen.errors import TierError
from kerngen.ops import experts as ex
from tests.test_experts_fused_x_cpu import one_token_rules


def pairs():
    """(model, its 1-token rule's spec without lean, the same with it) of every shipped fp8 and MXFP4 model."""
    for m, rule in one_token_rules():
        p = {k: v for k, v in rule.params.items() if k not in ("lean", "gcol")}   # (gcol takes lean: its own test)
        specs = [ex.rule_spec(tiers.Rule("experts", "mma", rule.ranges, q), m.hidden, m.intermediate, m.activation,
                              "sm_90a", m.experts_format) for q in (p, {**p, "lean": True})]
        yield m, *specs


def test_one_token_rules_take_fewer_instructions_a_step_without_spills(tmp_path):
    store, seen = DiskCache(tmp_path), set()
    for m, plain, ung in pairs():
        if ung in seen:
            continue
        seen.add(ung)
        text0, text = resources.sass(jit.build(plain, store=store).files), resources.sass(jit.build(ung, store=store).files)
        use = dict(resources.usage(jit.build(ung, store=store).files))
        p = dict(ung.params)
        for fn in ("experts_gemm1", "experts_gemm2"):
            assert use[fn]["REG"] <= 65536 // (32 * p["warps"] * p.get("min_blocks", 1)), (m.name, fn)
            base, loop = resources.mma_loop(text0, fn), resources.mma_loop(text, fn)
            assert loop is not None and not loop[1], f"{m.name} {fn}: local memory in the K-step loop"
            assert loop[0] <= 0.95 * base[0], (m.name, fn, loop[0], base[0])   # at least 5% fewer instructions
        assert "KBool" in render.render(ung)


def test_the_mxfp4_one_token_rule_takes_it_and_no_other():
    """Measured faster for MXFP4 at 1-2 tokens (tiers.toml); the same for fp8 there, slower with prefetch."""
    t = tiers.load()
    taking = [r for r in t.rules if r.op == "experts" and r.params.get("lean")]
    assert [(r.formats, r.ranges["tokens"]) for r in taking] == [(("mxfp4",), (1, 1))] * 2 + [(("mxfp4",), (2, 2))]
    assert taking[0].ranges["top_k"] == (8, 64) and "top_k" not in taking[1].ranges   # (one launch from 8 a token)
    for m, rule in one_token_rules():
        s = ex.rule_spec(rule, m.hidden, m.intermediate, m.activation, "sm_90a", m.experts_format)
        src = render.render(s)
        assert ("KBool" in src) == (m.experts_format == "mxfp4"), m.name
    for m, plain, _ in pairs():
        src = render.render(plain)
        assert "KBool" not in src and "kg_xzero" not in src


@pytest.mark.parametrize("over,fmt,layout,a8", [
    ({}, "bf16", "nk", False), ({"prefetch": True}, "mxfp4", "nk", False), ({}, "mxfp4", "kn", False),
    ({}, "fp8", "nk", True)])
def test_rules_that_cannot_take_it_are_refused(over, fmt, layout, a8):
    p = {"tile": 8, "warps": 4, "unroll": 1, "prefetch": False, "lean": True, **over}
    with pytest.raises(TierError, match="lean"):
        ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 8)}, p), 2048, 768, "silu", "sm_90a", fmt, layout, a8)


def test_the_flag_is_a_flag():
    with pytest.raises(TierError, match="lean"):
        tiers.check_params("test", "experts", "mma", {"tile": 8, "warps": 4, "unroll": 1, "lean": 3})
