"""kerngen.experts' fused_x and act_f16 = false (f16x builds, no GPU): experts_gemm1 quantizing x itself into shared
memory (no experts_quant_x) and experts_gemm2 reading the bf16 intermediate (no experts_quant_act). Every shipped
fp8 / MXFP4 model's 1-2 token rule builds both ways without spills, the launches and their fields follow, and the
rules that cannot take them are refused."""
import pytest
import torch

import kerngen
from kerngen import jit, occupancy, resources, tiers, tune
from kerngen.cache import DiskCache
from kerngen.ops import experts as ex
from tests.helpers import assert_no_spills
from tests.test_experts_quantized_cpu import FORMATS, stub_launches


def one_token_rules():
    """(model, its experts rule at one token) of every shipped fp8 and MXFP4 model: the two-launch rule, the one
    a call whose top_k is not known takes (kimi-k3's own, at 16 experts a token, runs both GEMMs in one launch:
    tests/test_experts_one_launch_cpu.py)."""
    t = tiers.load()
    for m in sorted(t.models.values(), key=lambda m: m.name):
        if m.experts_format in ("fp8", "mxfp4") and m.intermediate:
            yield m, t.rule("experts", {"hidden": m.hidden, "tokens": 1, "arch": "sm_90a", "format": m.experts_format,
                                        "num_experts": 0, "top_k": 0})


def fused_specs():
    """The 1-token rule of every shipped fp8 and MXFP4 model, with fused_x = 2 and act_f16 either way; the f16
    intermediate (a quantizing kernel, or stage_act) at most 4 CTAs an SM (it does not fit 64 registers)."""
    out = []
    for m, rule in one_token_rules():
        for act in ({"act_f16": True}, {"act_f16": False}, {"act_f16": True, "stage_act": True}):
            p = {**{k: v for k, v in rule.params.items() if k != "gcol"}, "fused_x": 2, **act}   # (gcol: its own test)
            if act["act_f16"]:
                p.update({k: min(p[k], 4) for k in ("blocks_per_sm", "min_blocks") if k in p})
            r = tiers.Rule("experts", "mma", {"tokens": (1, 2)}, p)
            s = ex.rule_spec(r, m.hidden, m.intermediate, m.activation, "sm_90a", m.experts_format)
            if s not in out:
                out.append(s)
    return out


@pytest.mark.parametrize("spec", fused_specs(), ids=lambda s: f"{s.tag}-act_f16={dict(s.params)['act_f16']}"
                                                             f"{'-stage_act' if dict(s.params).get('stage_act') else ''}")
def test_fused_builds_compile_without_spills_and_without_their_quantizing_kernels(spec, tmp_path):
    built = jit.build(spec, store=DiskCache(tmp_path))
    assert_no_spills(built.files)
    act_f16 = dict(spec.params)["act_f16"]
    usage = dict(resources.usage(built.files))
    assert set(usage) == {"experts_gemm1", "experts_gemm2"} | ({"experts_quant_act"} if act_f16 else set())
    assert set(usage) == set(ex.persistent(spec))
    H, I = dict(spec.constants)["H"], dict(spec.constants)["I"]
    # x of two tokens as f16 and their scales in gemm1's dynamic shared memory; with stage_act two rows of the
    # intermediate and their scales in gemm2's; the static (the warps' reduction) as it was
    staged = 2 * (2 * I + 4 * -(-I // 128)) if dict(spec.params).get("stage_act") else 0
    launch = ex.persistent(spec)
    assert launch["experts_gemm1"].dynamic_smem == 2 * (2 * H + 4 * -(-H // 128))
    assert launch["experts_gemm2"].dynamic_smem == staged
    # (lean: experts_gemm1's 64-byte zero vector of activations, which experts_gemm2 takes with stage_act only)
    extra = 64 if dict(spec.params).get("lean") and not dict(spec.params).get("stage_act") else 0
    assert usage["experts_gemm1"]["SHARED"] == usage["experts_gemm2"]["SHARED"] + extra
    sass = resources.sass(built.files).split("Function : ")
    gemm1 = next(f for f in sass if f.startswith("experts_gemm1"))
    gemm2 = next(f for f in sass if f.startswith("experts_gemm2"))
    assert "LDS.128" in gemm1   # the activations come from shared memory
    assert ("LDS.128" in gemm2) == bool(staged)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act_f16", [True, False])
def test_fused_launches_and_their_fields(monkeypatch, fmt, act_f16):
    launches = stub_launches(monkeypatch)
    a = FORMATS[fmt][1]()
    H, I = a["x"].shape[1], a["w2"].shape[-1] * (32 if fmt == "mxfp4" else 1)
    rule = tiers.Rule("experts", "mma", {"tokens": (1, 2)}, dict(tile=8, warps=4, unroll=1, blocks_per_sm=4,
                                                                 f16x=True, fused_x=2, act_f16=act_f16))
    k = ex.Kernels(ex.rule_spec(rule, H, I, "silu", "sm_90a", fmt), -1)
    r = a["routing"]
    x = a["x"][:2]
    k(x, r, a["w13"], a["w2"], ex.reference(**a), w13_scale=a["w13_scale"], w2_scale=a["w2_scale"])
    names = [n for n, _, _ in launches]
    assert names == ["experts_gemm1"] + (["experts_quant_act"] if act_f16 else []) + ["experts_gemm2"]
    for _, _, f in launches:
        assert f["x"] == x.data_ptr() and f["tokens"] == 2
        assert bool(f["aq"]) == act_f16   # the intermediate's f16 buffer only where experts_quant_act writes it
    with pytest.raises(kerngen.InputError, match="at most 2 tokens"):
        k(torch.zeros(3, H, dtype=x.dtype), r, a["w13"], a["w2"], ex.reference(**a), w13_scale=a["w13_scale"],
          w2_scale=a["w2_scale"])


@pytest.mark.parametrize("params,tokens,match", [
    (dict(fused_x=2), (1, 2), "f16x"),                                   # bf16 activations: nothing to fuse
    (dict(act_f16=False), (1, 2), "f16x"),
    (dict(f16x=True, fused_x=2), (1, 4), "fused_x = 2"),                 # the rule serves more tokens
    (dict(f16x=True, fused_x=2), None, "fused_x = 2"),                   # ... any count
    (dict(f16x=True, fused_x=True), (1, 1), "fused_x = True"),
    (dict(f16x=True, fused_x=16), (1, 16), "200 KiB"),                   # 16 x 7168 f16 values
    (dict(f16x=True, act_f16=False, mtiles=2), (1, 2), "mtiles"),
    (dict(f16x=True, stage_act=True), (1, 2), "stage_act"),              # no slots without fused_x
    (dict(f16x=True, fused_x=2, act_f16=False, stage_act=True), (1, 2), "stage_act"),
])
def test_rules_that_cannot_fuse_are_refused(params, tokens, match):
    rule = tiers.Rule("experts", "mma", {"tokens": tokens} if tokens else {},
                      dict(tile=8, warps=4, unroll=1, blocks_per_sm=4, **params))
    with pytest.raises(kerngen.TierError, match=match):
        ex.rule_spec(rule, 7168, 2048, "silu", "sm_90a", "fp8")


def test_fused_x_leaves_the_default_builds_as_they_were():
    """Neither param set: the launches of a shipped f16x rule are the four they were."""
    t = tiers.load()
    rule = t.rule("experts", {"hidden": 2880, "tokens": 8, "arch": "sm_90a", "format": "mxfp4"})
    assert rule.params.get("f16x") and "fused_x" not in rule.params
    s = ex.rule_spec(rule, 2880, 2880, "gpt_oss", "sm_90a", "mxfp4")
    assert ex.quant_kernels(s) == ("experts_quant_x", "experts_quant_act")


@pytest.mark.parametrize("model,act_f16,warps,fused", [("gpt-oss-120b", False, 4, 2), ("gpt-oss-120b", False, 8, 2),
                                                       ("gpt-oss-120b", False, 8, 8), ("kimi-k3", False, 8, 2),
                                                       ("deepseek-v3", True, 8, 2), ("deepseek-v3", True, 8, 0)])
def test_thirty_two_warps_an_sm_fit_64_registers_without_spills(model, act_f16, warps, fused, tmp_path):
    """The tuner's 32-warps-an-SM shapes (fused_x, no prefetch: one step a warp in flight, latency hidden by the
    warps): both GEMMs within the 64 registers a thread that 32 warps an SM leave, without spills, for the format's
    intermediate (MXFP4 bf16, fp8 f16), and as many CTAs an SM as asked fit their shared memory (at H 7168 the
    fused rows of x fit four CTAs of 8 warps, not eight of 4)."""
    m = tiers.load().model(model)
    params = dict(tile=8, warps=warps, unroll=1, blocks_per_sm=32 // warps, min_blocks=32 // warps, pdl=True,
                  prefetch=False, f16x=True, fused_x=fused, act_f16=act_f16)
    if not fused:   # (any token count: the activations from experts_quant_x, prefetched a step ahead)
        params = dict(tile=8, warps=8, unroll=1, blocks_per_sm=4, min_blocks=4, pdl=True, prefetch=False,
                      prefetch_x=True, f16x=True)
    assert params in [p for _, p in tune.experts_candidates(m.experts_format)]
    s = ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, fused)} if fused else {}, params), m.hidden,
                     m.intermediate, m.activation, "sm_90a", m.experts_format)
    built = jit.build(s, store=DiskCache(tmp_path))
    assert_no_spills(built.files)
    rows = {u.function: u for u in occupancy.of_artifact(built.files, "sm_90a", ex.persistent(s))}
    for name in ("experts_gemm1", "experts_gemm2"):
        assert rows[name].regs <= 64 and rows[name].resident >= rows[name].per_sm == 32 // warps, rows[name]


def test_early_l2_with_fused_x_prefetches_in_experts_gemm2_only(tmp_path):
    """early_l2 beside fused_x: experts_gemm1 (right behind the routing) reads nothing before its wait, so its SASS is
    the build's without early_l2; experts_gemm2 prefetches its first item's weights toward L2 before its wait, without
    spills and within its register bound. (The same bits: tests/gpu/test_experts_quantized.py.)"""
    store = DiskCache(tmp_path)
    for m, rule in one_token_rules():
        if not rule.params.get("fused_x"):
            continue
        plain = ex.rule_spec(rule, m.hidden, m.intermediate, m.activation, "sm_90a", m.experts_format)
        early = ex.rule_spec(tiers.Rule("experts", "mma", rule.ranges, {**rule.params, "early_l2": True}),
                             m.hidden, m.intermediate, m.activation, "sm_90a", m.experts_format)
        a, b = resources.sass(jit.build(plain, store=store).files), resources.sass(jit.build(early, store=store).files)
        fn = resources.function_sass
        assert fn(a, "experts_gemm1") == fn(b, "experts_gemm1"), m.name
        g2, g2_plain = fn(b, "experts_gemm2"), fn(a, "experts_gemm2")
        assert g2.count("CCTL") > g2_plain.count("CCTL"), m.name   # the L2 prefetches
        assert_no_spills(jit.build(early, store=store).files)
        use, p = dict(resources.usage(jit.build(early, store=store).files)), dict(early.params)
        assert use["experts_gemm2"]["REG"] <= 65536 // (32 * p["warps"] * p.get("min_blocks", 1)), m.name
