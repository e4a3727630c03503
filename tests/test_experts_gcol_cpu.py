"""kerngen.experts' gcol (MXFP4 at 1-2 tokens, experts_gemm1; no GPU): the eight columns of each mma are a tile
row's four 32-value groups, twice, so each group's dot product comes out of the tensor cores alone and takes its e8m0
scale as one fp32 multiply (no f16 group factor a weight pair, no largest scale byte a row by shuffles). Every shipped
MXFP4 model's 1-token rule (which takes it) builds experts_gemm1 with it in at least a fifth fewer instructions a K
step than without, without local memory and within its register bound, and experts_gemm2 as without it; the launch
shapes that cannot take it are refused. The GPU tests (tests/gpu/test_experts_quantized.py) check it against the
dequantized reference."""
import pytest

from kerngen import jit, resources, tiers
from kerngen.cache import DiskCache
from kerngen.errors import TierError
from kerngen.ops import experts as ex
from tests.test_experts_fused_x_cpu import one_token_rules
from tools.diagnose.same_sass import normalize


def mxfp4_pairs():
    """(model, its 1-token rule's spec, the same with gcol) of every shipped MXFP4 model."""
    for m, rule in one_token_rules():
        if m.experts_format == "mxfp4":
            p = {k: v for k, v in rule.params.items() if k != "gcol"}
            yield m, *(ex.rule_spec(tiers.Rule("experts", "mma", rule.ranges, q), m.hidden, m.intermediate,
                                    m.activation, "sm_90a", "mxfp4") for q in (p, {**p, "gcol": True}))


def test_gcol_takes_a_fifth_fewer_instructions_a_step_without_spills(tmp_path):
    store, seen = DiskCache(tmp_path), 0
    for m, plain, gcol in mxfp4_pairs():
        seen += 1
        text0, text = (resources.sass(jit.build(s, store=store).files) for s in (plain, gcol))
        use = dict(resources.usage(jit.build(gcol, store=store).files))
        p = dict(gcol.params)
        assert set(use) == set(ex.persistent(gcol)) == {"experts_gemm1", "experts_gemm2"}
        assert p.get("gcol") and dict(plain.params).get("gcol") is None
        for fn in ("experts_gemm1", "experts_gemm2"):
            assert use[fn]["REG"] <= 65536 // (32 * p["warps"] * p["min_blocks"]), (m.name, fn)
            assert use[fn].get("STACK", 0) == 0, (m.name, fn)
            loop = resources.mma_loop(text, fn)
            assert loop is not None and not loop[1], f"{m.name} {fn}: local memory in the K-step loop"
        base, loop = resources.mma_loop(text0, "experts_gemm1"), resources.mma_loop(text, "experts_gemm1")
        assert loop[0] <= 0.8 * base[0], (m.name, loop[0], base[0])
        body = resources.function_sass(text, "experts_gemm1")
        assert "HMUL2" not in body and "SHFL.BFLY" not in body.split("HMMA", 1)[1].rsplit("HMMA", 1)[0], \
            f"{m.name}: a group factor or a row's largest scale in the K steps"
        assert normalize(text)["experts_gemm2"] == normalize(text0)["experts_gemm2"]   # gemm2 as it was
        launch = ex.persistent(gcol)   # x's f16 rows and their scales in experts_gemm1's dynamic shared memory only
        assert launch["experts_gemm1"].dynamic_smem == 2 * (2 * m.hidden + 4 * -(-m.hidden // 128))
        assert launch["experts_gemm2"].dynamic_smem == 0
    assert seen >= 2   # gpt-oss-120b, kimi-k3


def test_wide_reads_two_groups_a_lane_in_fewer_instructions_a_kib(tmp_path):
    """wide (with gcol): a lane's two 16-byte vectors of each row a step, 256-wide steps; at 7 CTAs of 4 warps (72
    registers) no local memory in the K-step loop, and fewer instructions a KiB of weights than one group a lane."""
    store = DiskCache(tmp_path)
    for m, _, gcol in mxfp4_pairs():
        p = {**dict(gcol.params), "tile": 8, "wide": True, "blocks_per_sm": 7, "min_blocks": 7}
        wide = ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 2)}, p), m.hidden, m.intermediate,
                            m.activation, "sm_90a", "mxfp4")
        built = jit.build(wide, store=store)
        text, use = resources.sass(built.files), dict(resources.usage(built.files))
        assert use["experts_gemm1"]["REG"] <= 65536 // (32 * 4 * 7), m.name
        loop, one = resources.mma_loop(text, "experts_gemm1"), resources.mma_loop(
            resources.sass(jit.build(gcol, store=store).files), "experts_gemm1")
        assert loop is not None and not loop[1], f"{m.name}: local memory in the K-step loop"
        assert loop[0] / 2 < one[0], (m.name, loop[0], one[0])   # a step is 2 KiB a warp
        body = resources.function_sass(text, "experts_gemm1")
        assert body.count("HMMA") >= 16 and body.count("LDG.E.EF.128") >= 4


def gcol_shape(m, gcol, store, **change):
    """The 1-token gcol spec of model `m` with `change`d params, its SASS and its kernels' resources."""
    p = {**dict(gcol.params), "tile": 8, **change}
    spec = ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 1)}, p), m.hidden, m.intermediate, m.activation,
                        "sm_90a", "mxfp4")
    built = jit.build(spec, store=store)
    return spec, p, resources.sass(built.files), dict(resources.usage(built.files))


def test_gemm1_unroll_batches_two_steps_in_experts_gemm1_alone(tmp_path):
    """gemm1_unroll = 2 (with gcol, at the 1-token rule's 8 CTAs of 4 warps): experts_gemm1 issues two steps' weight
    loads together (twice the evict-first 16-byte loads of the rule's build, the scale bytes of a lane's two groups by
    one 16-bit load a row) within its 64 registers and without local memory in its K-step loop; experts_gemm2 is the
    rule's, instruction for instruction."""
    store, seen = DiskCache(tmp_path), 0
    for m, _, gcol in mxfp4_pairs():
        seen += 1
        _, p, text, use = gcol_shape(m, gcol, store, gemm1_unroll=2)
        one = resources.sass(jit.build(gcol, store=store).files)
        assert use["experts_gemm1"]["REG"] <= 65536 // (32 * p["warps"] * p["min_blocks"]), m.name
        loop = resources.mma_loop(text, "experts_gemm1")
        assert loop is not None and not loop[1], f"{m.name}: local memory in the K-step loop"
        assert loop[0] > 1.8 * resources.mma_loop(one, "experts_gemm1")[0], m.name   # two steps a pass
        g1, g1_one = (resources.function_sass(t, "experts_gemm1") for t in (text, one))
        assert g1.count("LDG.E.EF.128") == 2 * g1_one.count("LDG.E.EF.128"), m.name
        assert "LDG.E.U16.CONSTANT" in g1 and "LDG.E.U8.CONSTANT" not in g1, m.name
        assert normalize(text)["experts_gemm2"] == normalize(one)["experts_gemm2"], m.name
    assert seen >= 2


def test_two_steps_a_batch_in_each_gemm_at_its_own_register_bound(tmp_path):
    """gemm1_unroll = 2 at the 1-token rule's 8 CTAs (64 registers) beside experts_gemm2 at two steps a batch too and
    6 CTAs (gemm2_blocks: its own register bound, 85; one round of gpt-oss-120b's 720 items at one token): neither K-step
    loop touches local memory, each kernel within its bound, each grid its own CTAs an SM."""
    store = DiskCache(tmp_path)
    for m, _, gcol in mxfp4_pairs():
        spec, p, text, use = gcol_shape(m, gcol, store, unroll=2, gemm1_unroll=2, gemm2_blocks=6)
        launch = ex.persistent(spec)
        assert launch["experts_gemm1"].per_sm == 8 and launch["experts_gemm2"].per_sm == 6
        for fn, ctas in (("experts_gemm1", 8), ("experts_gemm2", 6)):
            assert use[fn]["REG"] <= 65536 // (32 * p["warps"] * ctas), (m.name, fn, use[fn]["REG"])
            loop = resources.mma_loop(text, fn)
            assert loop is not None and not loop[1], f"{m.name} {fn}: local memory in the K-step loop"
        assert use["experts_gemm2"]["REG"] > 65536 // (32 * p["warps"] * 8), m.name   # (the bound did move)


def test_three_warps_an_item_at_eleven_ctas_fit_without_spills_in_the_k_loops(tmp_path):
    """gcol at 11 CTAs of 3 warps an SM (1452 CTAs on 132 SMs: gpt-oss-120b's 1440 experts_gemm1 items at one token
    in one round, where 8 CTAs of 4 take 1.36): both kernels within the 56 registers a thread that 33 warps an SM
    leave, and neither K-step loop touches local memory."""
    store = DiskCache(tmp_path)
    for m, _, gcol in mxfp4_pairs():
        _, _, text, use = gcol_shape(m, gcol, store, warps=3, blocks_per_sm=11, min_blocks=11)
        for fn in ("experts_gemm1", "experts_gemm2"):
            assert use[fn]["REG"] <= 56, (m.name, fn, use[fn]["REG"])
            loop = resources.mma_loop(text, fn)
            assert loop is not None and not loop[1], f"{m.name} {fn}: local memory in the K-step loop"


def test_gemm1_unroll_without_gcol_is_refused():
    m, plain, _ = next(mxfp4_pairs())
    with pytest.raises(TierError, match="gemm1_unroll"):
        ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 2)}, {**dict(plain.params), "tile": 8, "gemm1_unroll": 2}),
                     m.hidden, m.intermediate, m.activation, "sm_90a", "mxfp4")


def test_wide_without_gcol_is_refused():
    m, plain, _ = next(mxfp4_pairs())
    with pytest.raises(TierError, match="wide"):
        ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 2)}, {**dict(plain.params), "tile": 8, "wide": True}),
                     m.hidden, m.intermediate, m.activation, "sm_90a", "mxfp4")


@pytest.mark.parametrize("change", [dict(fused_x=0), dict(fused_x=8), dict(act_f16=True),
                                    dict(lean=False), dict(mtiles=2), dict(tile=1)],
                         ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_launch_shapes_that_cannot_take_it_are_refused(change):
    m, plain, _ = next(mxfp4_pairs())
    p = {**dict(plain.params), "tile": 8, "gcol": True, **change}
    p = {k: v for k, v in p.items() if k not in change or v or k == "act_f16"}   # (fused_x=0, lean=False: left out)
    with pytest.raises(TierError, match="gcol"):
        ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 2)}, p), m.hidden, m.intermediate, m.activation,
                     "sm_90a", "mxfp4")


def test_fp8_weights_refuse_it():
    m = next(m for m, _ in one_token_rules() if m.experts_format == "fp8")
    rule = tiers.load().rule("experts", {"hidden": m.hidden, "tokens": 1, "arch": "sm_90a", "format": "fp8"})
    p = {**rule.params, "fused_x": 2, "act_f16": False, "unroll": 1, "lean": True, "prefetch": False, "gcol": True}
    with pytest.raises(TierError, match="gcol"):
        ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 2)}, p), m.hidden, m.intermediate, m.activation,
                     "sm_90a", "fp8")
