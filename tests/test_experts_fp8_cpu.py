"""kerngen.experts with fp8 block-scaled weights (float8_e4m3fn, one fp32 scale per 128 x 128 block, the layout
DeepSeek-V3 / Kimi K2 checkpoints and transformers' FP8Experts keep), on CPU tensors: the reference against an
fp64 computation written from the format's definition, the argument checks, the kernels' build per model and
activation, and the dispatch of the fp8 kernels with their scales (stub launchers)."""
import pytest
import torch

import kerngen
from kerngen import jit, tiers
from kerngen.cache import DiskCache
from kerngen.ops import _common
from kerngen.ops import experts as ex
from tests.helpers import assert_no_spills
from tests.test_experts_cpu import routing_of

FP8 = torch.float8_e4m3fn
Q = ex.QBLOCK


def fp8_weights(E, H, I, seed=0):
    """fp8 w13 [E, 2I, H], w2 [E, H, I] and their block scales, with the scale ranges of real checkpoints."""
    g = torch.Generator().manual_seed(seed)

    def one(N, K):
        w = (torch.randn(E, N, K, generator=g) * 100).clamp(-448, 448).to(FP8)
        s = torch.rand(E, N // Q, K // Q, generator=g) * 1e-3 + 1e-5
        return w, s
    w13, s13 = one(2 * I, H)
    w2, s2 = one(H, I)
    return w13, s13, w2, s2


def fp64_expert_rows(x, routing, w13, s13, w2, s2, tile):
    """Every permuted row through its expert in fp64, with each weight element times its block's scale written out
    as loops over the blocks (the intermediate rounded to bf16, as kerngen.experts defines it)."""
    def deq(w, s):
        out = torch.empty(w.shape, dtype=torch.float64)
        for nb in range(s.shape[0]):
            for kb in range(s.shape[1]):
                out[nb * Q:(nb + 1) * Q, kb * Q:(kb + 1) * Q] = w[nb * Q:(nb + 1) * Q, kb * Q:(kb + 1) * Q].double() \
                    * float(s[nb, kb])
        return out
    I = w2.shape[2]
    rows = torch.zeros(routing.permuted_to_token.shape[0], w2.shape[1], dtype=torch.float64)
    for r, t in enumerate(routing.permuted_to_token.tolist()):
        if t < 0:
            continue
        e = int(routing.tile_to_expert[r // tile])
        h = deq(w13[e], s13[e]) @ x[t].double()
        a = (torch.nn.functional.silu(h[:I]) * h[I:]).to(torch.bfloat16).double()
        rows[r] = deq(w2[e], s2[e]) @ a
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("tile", [1, 8])
def test_reference_is_the_dequantized_fp64_computation(seed, tile):
    T, K, E, H, I = 3, 2, 4, 256, 128
    w13, s13, w2, s2 = fp8_weights(E, H, I, seed)
    g = torch.Generator().manual_seed(seed + 10)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    r = routing_of(ids, E, tile)
    got = kerngen.experts(x, r, w13, w2, w13_scale=s13, w2_scale=s2)
    want = fp64_expert_rows(x, r, w13, s13, w2, s2, tile)
    valid = r.permuted_to_token >= 0
    # one bf16 rounding of the output (the fp32 sums differ from fp64 by far less): half an ulp, 2**-9 relative
    err = ((got[valid].double() - want[valid]).abs() / want[valid].abs().clamp_min(1e-30)).max().item()
    assert err <= 2 ** -8, err
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid]))


def test_every_e4m3_value_is_a_bf16_value():
    """Why the kernels widen fp8 weights to bf16 before the tensor cores without an error of their own."""
    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    finite = every[torch.isfinite(every)]
    assert torch.equal(finite.to(torch.bfloat16).float(), finite)


def _args(**over):
    T, E, H, I = 2, 4, 256, 128
    w13, s13, w2, s2 = fp8_weights(E, H, I)
    ids = torch.tensor([[0, 1], [1, 3]], dtype=torch.int32)
    a = dict(x=torch.zeros(T, H, dtype=torch.bfloat16), routing=routing_of(ids, E, 2), w13=w13, w2=w2,
             w13_scale=s13, w2_scale=s2)
    a.update(over)
    return a


@pytest.mark.parametrize("over,arg", [
    (dict(w13_scale=None), "w13_scale"),
    (dict(w2_scale=None), "w2_scale"),
    (dict(w13_scale=torch.ones(4, 2, 1)), "w13_scale"),                       # one block row short
    (dict(w2_scale=torch.ones(4, 2, 1, dtype=torch.bfloat16)), "w2_scale"),     # dtype
    (dict(w2=torch.zeros(4, 256, 128, dtype=torch.bfloat16)), "w2"),            # formats mixed
    (dict(w13=torch.zeros(4, 256, 256, dtype=torch.bfloat16), w2=torch.zeros(4, 256, 128, dtype=torch.bfloat16)),
     "w13_scale"),                                                              # scales with bf16 weights
    (dict(x=torch.zeros(2, 192, dtype=torch.bfloat16), w13=torch.zeros(4, 256, 192, dtype=FP8),
          w2=torch.zeros(4, 192, 128, dtype=FP8)), "w13"),                      # H not a multiple of 128
])
def test_bad_inputs_name_the_argument(over, arg):
    with pytest.raises(kerngen.InputError) as e:
        kerngen.experts(**_args(**over))
    assert e.value.arg == arg


def fp8_specs():
    """Every shipped model's fp8 experts kernels (warmup's list) and each activation at one shape."""
    t = tiers.load()
    specs = [s for m in t.models.values() for s in ex.model_specs(m, t, "sm_90a") if dict(s.constants)["FORMAT"] == "fp8"]
    for act in ex.ACTIVATIONS:
        s = ex.spec(2048, 768, ex.MAX_TILE, act, 64, "sm_90a", t, "fp8")
        if s not in specs:
            specs.append(s)
    return specs


def test_the_fp8_models_warm_up_both_formats():
    t = tiers.load()
    fp8_models = [m for m in t.models.values() if m.experts_format == "fp8"]
    assert {m.name for m in fp8_models} >= {"deepseek-v3", "kimi-k2"}
    for m in fp8_models:
        formats = {dict(s.constants)["FORMAT"] for s in ex.model_specs(m, t, "sm_90a")}
        assert formats == {"bf16", "fp8"}, m.name


@pytest.mark.parametrize("spec", fp8_specs(), ids=lambda s: s.tag)
def test_every_fp8_kernel_compiles_without_spills(spec, tmp_path):
    built = jit.build(spec, store=DiskCache(tmp_path))
    cubin = built.files["kernel.cubin"]
    assert built.status == "compiled" and b"experts_gemm1" in cubin and b"experts_gemm2" in cubin
    assert_no_spills(built.files)


def test_fp8_weights_dispatch_the_fp8_kernels_with_their_scales(monkeypatch):
    """On CPU tensors with a stub launcher: the fp8 build is chosen, and both launches get the scale pointers."""
    launches = []

    class Stub:
        def __init__(self, module, name, device, grid, block, params, smem=0, pdl=False):
            self.name, self.params = name, params

        def __call__(self, stream, *values):   # the fields in the struct's order
            assert len(values) == len(self.params.names)
            launches.append((self.name, dict(zip(self.params.names, values))))

    monkeypatch.setattr(_common, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(ex, "resolve", lambda spec: spec)
    monkeypatch.setattr(ex, "current_stream", lambda dev: 0)
    monkeypatch.setattr(ex, "Launcher", Stub)
    monkeypatch.setattr(ex, "sm_count", lambda dev: 132)
    kerngen.clear()
    a = _args()
    kerngen.experts(**a)
    kerngen.clear()
    assert [n for n, _ in launches] == ["experts_gemm1", "experts_gemm2"]
    for _, f in launches:
        assert f["s13"] == a["w13_scale"].data_ptr() and f["s2"] == a["w2_scale"].data_ptr()
    assert ex.dispatch(256, 128, "silu", -1, "fp8").spec(2).tag.endswith("-fp8")
