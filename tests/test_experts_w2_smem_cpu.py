"""kerngen.experts' w2_smem (no GPU): experts_gemm2's CTAs copy their first item's 16 MXFP4 weight rows and scales
into shared memory by cp.async before the programmatic-dependent-launch wait and run that item from there. The
builds compile without local memory, 8 CTAs of them still fit an SM with the copies' shared memory, the copies and
the shared-memory steps are in the SASS, the source without the param is the plain rule's, and the builds it does
not serve are refused or (rows not whole copies) left plain. tests/gpu/test_experts_quantized.py checks its bits."""
import pytest

from kerngen import jit, render, resources, tiers
from kerngen.cache import DiskCache
from kerngen.errors import TierError
from kerngen.occupancy import resident
from kerngen.ops import experts as ex

RULE = dict(tile=8, warps=4, unroll=1, blocks_per_sm=8, min_blocks=8, pdl=True, prefetch=False, f16x=True, fused_x=2,
            act_f16=False, lean=True, gcol=True)   # the MXFP4 one-token rule's shape


def spec(H, I, act, **extra):
    return ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 2)}, dict(RULE, **extra)), H, I, act, "sm_90a",
                        "mxfp4")


@pytest.mark.parametrize("H,I,act", [(2880, 2880, "gpt_oss"), (3584, 2048, "situglu"), (1024, 256, "silu")])
def test_w2_smem_builds_fit_eight_ctas_and_copy_before_the_wait(H, I, act, tmp_path):
    s = spec(H, I, act, w2_smem=True)
    assert ex.w2_smem(s) and ex.dynamic_smem(s) == {"experts_gemm1": ex.fused_smem(2, H),
                                                     "experts_gemm2": 16 * (I // 2 + I // 32)}
    files = jit.build(s, store=DiskCache(tmp_path)).files
    use = dict(resources.usage(files))
    for name, launch in ex.persistent(s).items():
        assert use[name].get("STACK", 0) == 0 and use[name]["LOCAL"] == 0, (name, use[name])
        assert resident("sm_90a", use[name]["REG"], launch.threads, use[name]["SHARED"] + launch.dynamic_smem) >= 8
    g2 = resources.function_sass(resources.sass(files), "experts_gemm2")
    assert "LDGSTS" in g2 and "LDS.128" in g2 and "LDS.U8" in g2
    src = render.render(s)
    body = src[src.index("experts_gemm2(const __grid_constant__ Params p)"):]
    assert body.index("w2_to_smem(p)") < body.index("kg_grid_wait()") < body.index("cp.async.wait_all")
    plain = render.render(spec(H, I, act))
    assert "w2_to_smem" not in plain and "SMEM_W" not in plain


def test_rows_that_are_not_whole_copies_stay_plain():
    s = spec(1000, 256, "silu", w2_smem=True)   # H % 16 != 0: an item's last rows past H
    assert not ex.w2_smem(s) and ex.dynamic_smem(s)["experts_gemm2"] == 0
    assert "w2_to_smem" not in render.render(s)


@pytest.mark.parametrize("extra,fmt", [
    (dict(w2_smem=True, one_launch=True), "mxfp4"),           # one launch: no second kernel to start early
    (dict(w2_smem=True, act_f16=True, fused_x=2), "mxfp4"),   # the f16 intermediate (its own launch)
    (dict(w2_smem=True), "fp8"),                              # fp8 weights
])
def test_w2_smem_outside_its_builds_is_refused(extra, fmt):
    with pytest.raises(TierError, match="w2_smem"):
        ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 2)}, dict(RULE, gcol=False, **extra)), 1024, 256,
                     "silu", "sm_90a", fmt)
