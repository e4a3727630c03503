"""kerngen.experts' quantized builds (fp8 block-scaled, MXFP4), per format: the shipped models that ship in it warm up
both it and bf16, every such kernel (and each activation at one shape) compiles for sm_90a without spills, and
its weights dispatch its build with their scales as launch fields (stub launchers on CPU tensors)."""
import pytest

import kerngen
from kerngen import jit, tiers
from kerngen.cache import DiskCache
from kerngen.ops import _common
from kerngen.ops import experts as ex
from tests.helpers import assert_no_spills
from tests.test_experts_fp8_cpu import _args as fp8_args
from tests.test_experts_mxfp4_cpu import _args as mxfp4_args

FORMATS = {"fp8": ({"deepseek-v3", "kimi-k2"}, fp8_args), "mxfp4": ({"gpt-oss-120b", "kimi-k3"}, mxfp4_args)}


def specs(fmt):
    """Every shipped model's experts kernels in `fmt` (warmup's list) and each activation at one shape."""
    t = tiers.load()
    out = [s for m in t.models.values() for s in ex.model_specs(m, t, "sm_90a") if dict(s.constants)["FORMAT"] == fmt]
    for act in ex.ACTIVATIONS:
        s = ex.spec(2048, 768, ex.MAX_TILE, act, 64, "sm_90a", t, fmt)
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
    assert built.status == "compiled" and b"experts_gemm1" in cubin and b"experts_gemm2" in cubin
    assert_no_spills(built.files)


def a8_specs():
    """fp8_activations' builds of the shipped fp8 models (the fp8 rules with A8)."""
    t = tiers.load()
    out = []
    for name in sorted(FORMATS["fp8"][0]):
        m = t.model(name)
        for lo, _ in tiers.token_pieces(t.rules, "experts", m.tokens):
            try:
                rule = t.rule("experts", {"hidden": m.hidden, "tokens": lo, "arch": "sm_90a", "format": "fp8"})
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


def stub_launches(monkeypatch) -> list:
    """kerngen.experts on CPU tensors through stub launchers: the list they append (kernel name, spec, fields by
    name) to, a launch each."""
    launches = []

    class Stub:
        def __init__(self, module, name, device, grid, block, params, smem=0, pdl=False):
            self.name, self.params, self.spec = name, params, module

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
    assert [n for n, _, _ in launches] == ["experts_gemm1", "experts_gemm2"]
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
    assert names == ["experts_quant_x", "experts_gemm1", "experts_quant_act", "experts_gemm2", "experts_gemm1",
                     "experts_gemm2"]
    quant = [f for n, s, f in launches[:4]]
    assert all(s.tag.endswith("-fp8-a8") for _, s, _ in launches[:4])
    assert not launches[4][1].tag.endswith("-a8")
    for f in quant:   # the same buffers for all four: x and the intermediate quantized, their scales
        assert {k: f[k] for k in ("xq", "xsc", "aq", "asc")} == {k: quant[0][k] for k in ("xq", "xsc", "aq", "asc")}
        assert all(f[k] for k in ("xq", "xsc", "aq", "asc"))
