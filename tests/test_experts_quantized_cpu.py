"""kerngen.experts' quantized builds (fp8 block-scaled, MXFP4), per format: the shipped models that ship in it warm up
both it and bf16, every such kernel (and each activation at one shape) compiles for sm_90a without spills, and
its weights dispatch its build with their scales as launch fields (stub launchers on CPU tensors)."""
import pytest
import torch

import kerngen
from kerngen import jit, resources, tiers
from kerngen.cache import DiskCache
from kerngen.ops import _common
from kerngen.ops import experts as ex
from tests.helpers import assert_no_spills
from tests.test_experts_fp8_cpu import _args as fp8_args
from tests.test_experts_mxfp4_cpu import _args as mxfp4_args

FORMATS = {"fp8": ({"deepseek-v3", "kimi-k2"}, fp8_args), "mxfp4": ({"gpt-oss-120b", "kimi-k3"}, mxfp4_args)}


def specs(fmt):
    """Every shipped model's experts kernels in `fmt` (warmup's list) and each activation at two shapes: the 3-token
    rule (grid stride) at the largest routing tile, and the 64-token rule at its own tile (with tickets; routings of
    tile 16 or 32 build it with a few bytes of spills, as tiers.toml says)."""
    t = tiers.load()
    out = [s for m in t.models.values() for s in ex.model_specs(m, t, "sm_90a") if dict(s.constants)["FORMAT"] == fmt]
    for act in ex.ACTIVATIONS:
        for tile, tokens in ((ex.MMA_MAX_TILE, 3), (None, 64)):
            s = ex.spec(2048, 768, tile, act, tokens, "sm_90a", t, fmt)
            if s not in out:
                out.append(s)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_models_shipping_a_format_warm_up_it_and_bf16(fmt):
    t = tiers.load()
    names = {m.name for m in t.models.values() if m.experts_format == fmt}
    assert names >= FORMATS[fmt][0]
    for name in names:
        assert {dict(s.constants)["FORMAT"] for s in ex.model_specs(t.model(name), t, "sm_90a")} == {"bf16", fmt}


@pytest.mark.parametrize("spec", specs("fp8") + specs("mxfp4"), ids=lambda s: s.tag)
def test_every_quantized_kernel_compiles_without_spills(spec, tmp_path):
    built = jit.build(spec, store=DiskCache(tmp_path))
    cubin = built.files["kernel.cubin"]
    assert built.status == "compiled" and all(name.encode() in cubin for name in ex.gemm_kernels(spec))
    assert_no_spills(built.files)


def a8_specs():
    """fp8_activations' builds of the shipped fp8 models (the w8a8 rules, with A8)."""
    t = tiers.load()
    out = []
    for name in sorted(FORMATS["fp8"][0]):
        m = t.model(name)
        for lo, _ in tiers.token_pieces(t.rules, "experts", m.tokens):
            try:
                rule = t.rule("experts", {"hidden": m.hidden, "tokens": lo, "arch": "sm_90a", "format": "w8a8"})
            except kerngen.TierError:
                continue   # these tokens run the reference
            s = ex.rule_spec(rule, m.hidden, m.intermediate, m.activation, "sm_90a", "fp8", "nk", True)
            if s not in out:
                out.append(s)
    return out


@pytest.mark.parametrize("spec", a8_specs(), ids=lambda s: s.tag)
def test_fp8_activation_builds_compile_without_spills(spec, tmp_path):
    built = jit.build(spec, store=DiskCache(tmp_path))
    cubin = built.files["kernel.cubin"]
    assert spec.tag.endswith("-fp8-a8") and dict(spec.constants)["A8"] == 1
    for name in (b"experts_quant_x", b"experts_gemm1", b"experts_quant_act", b"experts_gemm2"):
        assert name in cubin
    assert_no_spills(built.files)


def shape_spec(fmt, H, I, tile=8, **params):
    """The spec of one f16x launch shape (4 warps, one step a batch, 4 CTAs an SM, PDL unless `params` say
    otherwise) for sm_90a, as a tier rule gives it."""
    p = {**dict(warps=4, unroll=1, blocks_per_sm=4, pdl=True, f16x=True), **params, "tile": tile}
    return ex.rule_spec(tiers.Rule("experts", "mma", {}, p), H, I, "silu", "sm_90a", fmt)


def stub_launches(monkeypatch) -> list:
    """kerngen.experts on CPU tensors through stub launchers: the list they append (kernel name, spec, fields by
    name) to, a launch each."""
    launches = []

    class Stub:
        def __init__(self, module, name, device, grid, block, params, smem=0, pdl=False):
            self.name, self.params, self.spec, self.grid = name, params, module, grid

        def __call__(self, stream, *values):   # the fields in the struct's order
            assert len(values) == len(self.params.names)
            launches.append((self.name, self.spec, dict(zip(self.params.names, values))))

    monkeypatch.setattr(_common, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(ex, "resolve", lambda spec: spec)
    monkeypatch.setattr(ex, "current_stream", lambda dev: 0)
    monkeypatch.setattr(ex, "Launcher", Stub)
    monkeypatch.setattr(ex, "sm_count", lambda dev: 132)
    kerngen.clear()
    return launches


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_weights_dispatch_their_build_with_their_scales(monkeypatch, fmt):
    launches = stub_launches(monkeypatch)
    a = FORMATS[fmt][1]()
    kerngen.experts(**a)
    kerngen.clear()
    quant = ["experts_quant_x", "experts_gemm1", "experts_gemm12", "experts_quant_act", "experts_gemm2"]
    spec = launches[0][1]   # a rule with f16 activations: up to two more launches (none a fused_x build makes)
    made = ex.gemm_kernels(spec) + (ex.quant_kernels(spec) if dict(spec.params).get("f16x") else ())
    assert [n for n, _, _ in launches] == [n for n in quant if n in made]
    for _, spec, f in launches:
        assert dict(spec.constants)["FORMAT"] == fmt and spec.tag.endswith(f"-{fmt}")
        assert f["s13"] == a["w13_scale"].data_ptr() and f["s2"] == a["w2_scale"].data_ptr()
        assert f["w13"] == a["w13"].data_ptr() and f["w2"] == a["w2"].data_ptr()


def test_fp8_activations_dispatch_four_launches_with_their_buffers(monkeypatch):
    launches = stub_launches(monkeypatch)
    a = fp8_args()
    kerngen.experts(**a, fp8_activations=True)
    kerngen.experts(**a)
    kerngen.clear()
    names = [n for n, _, _ in launches]
    four = ["experts_quant_x", "experts_gemm1", "experts_quant_act", "experts_gemm2"]
    x16 = dict(launches[-1][1].params).get("f16x")   # the weight-only rule's own quantizing launches (f16)
    assert names == four + (four if x16 else ["experts_gemm1", "experts_gemm2"])
    quant = [f for n, s, f in launches[:4]]
    assert all(s.tag.endswith("-fp8-a8") for _, s, _ in launches[:4])
    assert not launches[4][1].tag.endswith("-a8")
    for f in quant:   # the same buffers for all four: x and the intermediate quantized, their scales
        assert {k: f[k] for k in ("xq", "xsc", "aq", "asc")} == {k: quant[0][k] for k in ("xq", "xsc", "aq", "asc")}
        assert all(f[k] for k in ("xq", "xsc", "aq", "asc"))


def f16x_specs():
    """The shipped fp8 and MXFP4 rules' builds with f16x (activations carried as f16)."""
    out = []
    for s in specs("fp8") + specs("mxfp4"):
        c = dict(s.constants)
        if c.get("A8"):
            continue   # fp8 activations: no f16x
        fx = dict(s.params).get("fused_x")   # a fused_x build serves at most so many tokens
        rule = tiers.Rule("experts", "mma", {"tokens": (1, fx)} if fx else {},
                          {**dict(s.params), "f16x": True, "tile": c["TILE"], "backend": s.backend})
        x = ex.rule_spec(rule, c["H"], c["I"], c["ACT"], "sm_90a", c["FORMAT"])
        if x not in out:
            out.append(x)
    return out


@pytest.mark.parametrize("spec", f16x_specs(), ids=lambda s: s.tag + "-f16x")
def test_f16x_builds_compile_without_spills(spec, tmp_path):
    built = jit.build(spec, store=DiskCache(tmp_path))
    cubin = built.files["kernel.cubin"]
    for name in ex.gemm_kernels(spec) + ex.quant_kernels(spec):            # (a fused_x build: x quantized by
        assert name.encode() in cubin                                          # gemm1, no quantizing kernel)
    assert_no_spills(built.files)


@pytest.mark.parametrize("fmt", FORMATS)
def test_f16x_dispatches_four_launches_with_f16_buffers(monkeypatch, fmt):
    launches = stub_launches(monkeypatch)
    a = FORMATS[fmt][1]()
    H, I = a["x"].shape[1], a["w2"].shape[-1] * (32 if fmt == "mxfp4" else 1)
    s = shape_spec(fmt, H, I)
    k = ex.Kernels(s, -1)
    assert k.x16 and not k.a8 and set(ex.persistent(s)) == {"experts_gemm1", "experts_gemm2", "experts_quant_x",
                                                             "experts_quant_act"}
    r = a["routing"]
    k(a["x"], r, a["w13"], a["w2"], ex.reference(**a), w13_scale=a["w13_scale"], w2_scale=a["w2_scale"])
    assert [n for n, _, _ in launches] == ["experts_quant_x", "experts_gemm1", "experts_quant_act", "experts_gemm2"]
    (xq, xs, aq, asc), ptrs = k.quant_scratch(0, a["x"].shape[0], r.tile_to_expert.shape[0], a["x"].device)
    assert xq.dtype == aq.dtype == torch.float16 and xq.shape == (a["x"].shape[0], H)
    assert xs.shape[1] == -(-H // 128) and asc.shape[1] == -(-I // 128)
    assert all(f["xq"] == ptrs[0] and f["asc"] == ptrs[3] for _, _, f in launches)


@pytest.mark.parametrize("fmt,a8", [("bf16", False), ("fp8", True)])
def test_f16x_is_refused_where_activations_are_not_bf16_over_quantized_weights(fmt, a8):
    rule = tiers.Rule("experts", "mma", {"tokens": (1, 8)}, dict(tile=8, warps=4, unroll=1, f16x=True))
    with pytest.raises(kerngen.TierError, match="f16x"):
        ex.rule_spec(rule, 1024, 256, "silu", "sm_90a", fmt, "nk", a8)


def test_quantize_f16_is_exact_within_its_range_with_power_of_two_scales():
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(5, 2880, generator=g) * 10).to(torch.bfloat16)
    x[0, :128] = 0
    x[1, 128:256] *= 2.0 ** 120
    x[2, 256:384] *= 2.0 ** -120
    x[3, 2816:] = torch.finfo(torch.bfloat16).max   # the short last group at the largest bf16
    q, s = ex.quantize_f16(x)
    assert q.dtype == torch.float16 and q.shape == x.shape and s.shape == (5, 23)
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5)   # powers of two
    back = (torch.nn.functional.pad(q.float(), (0, 64)).unflatten(-1, (-1, 128)) * s[..., None]).flatten(-2)
    assert torch.equal(back[:, :2880], x.float())
    tiny = torch.tensor([[1.0, 2.0 ** -40, 3.0] + [0.0] * 125], dtype=torch.bfloat16)
    q, s = ex.quantize_f16(tiny)   # 2^-40 below the group's largest: an f16 subnormal's step (2^-39 of it) away
    assert q[0, 1].item() == 0.0 and q[0, 2].item() * s[0, 0].item() == 3.0


@pytest.mark.parametrize("fmt,H,I", [("fp8", 7168, 2048), ("mxfp4", 2880, 2880), ("mxfp4", 3584, 2048)])
@pytest.mark.parametrize("params", [dict(prefetch_x=True), dict()])
def test_two_tiles_an_item_compile_without_spills_and_halve_the_grid(fmt, H, I, params, tmp_path, monkeypatch):
    """mtiles=2 (f16x builds): items of two m16 tiles of weight rows, so an item covers 16 intermediate / 32 output
    columns and the grid sizes from that; without spills at 4 CTAs of 4 warps."""
    s = shape_spec(fmt, H, I, mtiles=2, **params)
    built = jit.build(s, store=DiskCache(tmp_path))
    assert_no_spills(built.files)
    stub_launches(monkeypatch)
    k = ex.Kernels(s, -1)
    gemm1, gemm2 = k.launchers(3)[1::2]
    assert gemm1.grid[0] == min(3 * -(-I // 16), 4 * tiers.SMS) and gemm2.grid[0] == min(3 * -(-H // 32), 4 * tiers.SMS)


def test_mtiles_needs_f16x():
    rule = tiers.Rule("experts", "mma", {"tokens": (1, 8)}, dict(tile=8, warps=4, unroll=1, mtiles=2))
    with pytest.raises(kerngen.TierError, match="mtiles"):
        ex.rule_spec(rule, 7168, 2048, "silu", "sm_90a", "fp8")


@pytest.mark.parametrize("params", [dict(), dict(f16x=True, prefetch=False)])
def test_pingpong_needs_f16x_and_prefetch(params):
    rule = tiers.Rule("experts", "mma", {"tokens": (1, 8)}, dict(tile=8, warps=4, unroll=1, pingpong=True, **params))
    with pytest.raises(kerngen.TierError, match="pingpong"):
        ex.rule_spec(rule, 7168, 2048, "silu", "sm_90a", "fp8")


@pytest.mark.parametrize("fmt,H,I", [("fp8", 7168, 2048), ("mxfp4", 2880, 2880)])
@pytest.mark.parametrize("params", [dict(), dict(prefetch_x=True), dict(warps=8, blocks_per_sm=3)])
def test_pingpong_builds_another_loop_without_spills(fmt, H, I, params, tmp_path):
    """pingpong (two weight buffers taking turns, two steps a loop turn) changes the built code, and the one-tile
    shapes the tuner offers it in build without spills (with two tiles it needs min_blocks=4 and spills a little:
    the GPU measures whether that pays)."""
    built = [jit.build(shape_spec(fmt, H, I, pingpong=pp, **params), store=DiskCache(tmp_path))
             for pp in (False, True)]
    assert resources.opcodes(built[0].files) != resources.opcodes(built[1].files)
    assert_no_spills(built[1].files)


def test_with_a_callers_scratch_the_quantized_activations_are_the_calls_own(monkeypatch):
    """scratch= (memory that must not outlive the call, e.g. in torch.compile's CUDA-graph pool): an f16x build
    allocates its quantized activations per call instead of keeping them per stream."""
    launches = stub_launches(monkeypatch)
    a = FORMATS["fp8"][1]()
    H, I = a["x"].shape[1], a["w2"].shape[-1]
    s = shape_spec("fp8", H, I)
    k = ex.Kernels(s, -1)
    r, out = a["routing"], ex.reference(**a)
    act = torch.empty(r.tile_to_expert.shape[0] * 8, I, dtype=torch.bfloat16)
    k(a["x"], r, a["w13"], a["w2"], out, act, w13_scale=a["w13_scale"], w2_scale=a["w2_scale"])
    assert not k._q and all(f["act"] == act.data_ptr() for _, _, f in launches)
    k(a["x"], r, a["w13"], a["w2"], out, w13_scale=a["w13_scale"], w2_scale=a["w2_scale"])
    assert len(k._q) == 1 and launches[-1][2]["xq"] == k._q[0][1][0]


@pytest.mark.parametrize("f16x", [False, True])
def test_quantized_activation_buffers_are_one_allocation_in_aligned_pieces(monkeypatch, f16x):
    stub_launches(monkeypatch)
    k = ex.Kernels(shape_spec("mxfp4", 2880, 2880, f16x=f16x) if f16x else
                   ex.spec(7168, 2048, 8, "silu", 8, "sm_90a", fmt="fp8", a8=True), -1)
    (xq, xs, aq, asc), ptrs = k.quant_buffers(5, 24, torch.device("cpu"))
    H, I = (2880, 2880) if f16x else (7168, 2048)
    assert xq.dtype == aq.dtype == (torch.float16 if f16x else torch.uint8) and xs.dtype == asc.dtype == torch.float32
    assert [t.shape for t in (xq, xs, aq, asc)] == [(5, H), (5, -(-H // 128)), (24, I), (24, -(-I // 128))]
    assert all(t.is_contiguous() and p % 16 == 0 for t, p in zip((xq, xs, aq, asc), ptrs))
    ends = sorted((p, p + t.numel() * t.element_size()) for t, p in zip((xq, xs, aq, asc), ptrs))
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))   # no overlap
    assert len({t.untyped_storage().data_ptr() for t in (xq, xs, aq, asc)}) == 1


def _before_the_wait(sass_part: str) -> list[str]:
    from tests.test_latent_tail_cpu import _opcodes
    ops = _opcodes(sass_part)
    return ops[:ops.index("ACQBULK")]


@pytest.mark.parametrize("fmt,H,I,params", [("fp8", 7168, 2048, dict(mtiles=2, prefetch_x=True)),
                                            ("fp8", 7168, 2048, dict(unroll=2, min_blocks=4, prefetch=False)),
                                            ("mxfp4", 2880, 2880, dict(mtiles=2)),
                                            ("mxfp4", 3584, 2048, dict())])
def test_early_l2_prefetches_the_first_weights_before_the_wait_and_fits(fmt, H, I, params, tmp_path):
    """early_l2: both GEMMs (each after a quantizing launch of the op's own) issue their first item's L2 prefetches
    before their wait and no weight load; without it nothing is prefetched there; no spills, and the build still
    fits its CTAs an SM."""
    from kerngen import resources, warmup
    for early in (True, False):
        s = shape_spec(fmt, H, I, early_l2=early, **params)
        built = jit.build(s, store=DiskCache(tmp_path))
        assert_no_spills(built.files)
        sass = resources.sass(built.files)
        for part in sass.split("Function : ")[1:]:
            if part.split()[0] in ("experts_gemm1", "experts_gemm2"):
                before = _before_the_wait(part)
                assert ("CCTL.E.PF2" in before) == early, (part.split()[0], early)
                assert not [o for o in before if o.startswith("LDG.E.128")], before   # no weight bytes into registers
        rows = warmup.usage(s, built.files)
        assert all(u.resident >= u.per_sm for u in rows), rows


@pytest.mark.parametrize("fmt,a8,layout", [("bf16", False, "nk"), ("fp8", False, "nk"), ("mxfp4", False, "nk"),
                                           ("bf16", False, "kn")])
def test_early_l2_without_quantized_activations_prefetches_in_gemm2_only(fmt, a8, layout, tmp_path):
    """Without quantizing launches, experts_gemm1 follows the caller's kernel (the routing may still run): it waits
    first; experts_gemm2 follows experts_gemm1 and prefetches. Transposed weights (kn) take no early_l2."""
    from kerngen import resources
    rule = tiers.Rule("experts", "mma", {}, dict(tile=8, warps=4, unroll=2, blocks_per_sm=4, pdl=True, early_l2=True))
    s = ex.rule_spec(rule, 2048, 768, "silu", "sm_90a", fmt, layout, a8)
    built = jit.build(s, store=DiskCache(tmp_path))
    assert_no_spills(built.files)
    seen = {}
    for part in resources.sass(built.files).split("Function : ")[1:]:
        seen[part.split()[0]] = "CCTL.E.PF2" in _before_the_wait(part)
    assert seen == {"experts_gemm1": False, "experts_gemm2": layout == "nk"}
