"""kerngen.experts with MXFP4 weights as gpt-oss checkpoints store them (`*_blocks` [E, N, K/32, 16] uint8, two e2m1
values a byte, low nibble first; `*_scales` [E, N, K/32] uint8 e8m0, 2^(s - 127)), on CPU tensors: the reference
against an fp64 decoding written from the format's definition, the argument checks, every shipped model's MXFP4
kernels compiled without spills, and the dispatch of the MXFP4 build with its scales (stub launchers)."""
import pytest
import torch

import kerngen
from kerngen import jit, tiers
from kerngen.cache import DiskCache
from kerngen.ops import _common
from kerngen.ops import experts as ex
from tests.helpers import assert_no_spills
from tests.test_experts_cpu import loop_expert, routing_of


def mx_weights(E, H, I, seed=0, scale_range=(118, 124)):
    """Random MXFP4 w13 [E, 2I, H/32, 16], w2 [E, H, I/32, 16] and their e8m0 scales."""
    g = torch.Generator().manual_seed(seed)

    def one(N, K):
        blocks = torch.randint(0, 256, (E, N, K // 32, 16), generator=g, dtype=torch.int32).to(torch.uint8)
        scales = torch.randint(*scale_range, (E, N, K // 32), generator=g, dtype=torch.int32).to(torch.uint8)
        return blocks, scales
    w13, s13 = one(2 * I, H)
    w2, s2 = one(H, I)
    return w13, s13, w2, s2


def decode_fp64(blocks, scales):
    """e2m1 by its definition: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    *lead, G, B = blocks.shape
    out = torch.empty(*lead, G, 2 * B, dtype=torch.float64)
    flat, o = blocks.reshape(-1, B).tolist(), out.view(-1, 2 * B)
    for r, row in enumerate(flat):
        for i, byte in enumerate(row):
            for j, n in enumerate((byte & 15, byte >> 4)):
                e, m = (n >> 1) & 3, n & 1
                v = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
                o[r, 2 * i + j] = -v if n & 8 else v
    return (out * torch.pow(2.0, scales.double() - 127)[..., None]).flatten(-2)


def test_dequantize_is_the_format():
    w13, s13, _, _ = mx_weights(2, 64, 32)
    assert torch.equal(ex.dequantize(w13, s13).double(), decode_fp64(w13, s13))


def test_every_scaled_e2m1_value_is_a_bf16_value():
    """Why the kernels can widen MXFP4 weights to bf16 with their scale applied, without an error of their own."""
    blocks = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 16, 1, 16)   # every byte
    for s in (2, 60, 127, 200, 252):
        v = ex.dequantize(blocks, torch.full((1, 16, 1), s, dtype=torch.uint8))
        assert torch.equal(v.to(torch.bfloat16).float(), v)


@pytest.mark.parametrize("act,interleaved", [("silu", False), ("gpt_oss", True)])
@pytest.mark.parametrize("tile", [1, 8])
def test_reference_is_a_per_token_loop_on_the_decoded_weights(act, interleaved, tile):
    T, K, E, H, I = 3, 2, 4, 128, 64
    w13, s13, w2, s2 = mx_weights(E, H, I, seed=tile)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(T, H, generator=g) * 0.3).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    b13 = (torch.randn(E, 2 * I, generator=g) * 0.1).to(torch.bfloat16) if interleaved else None
    b2 = (torch.randn(E, H, generator=g) * 0.1).to(torch.bfloat16) if interleaved else None
    r = routing_of(ids, E, tile)
    got = kerngen.experts(x, r, w13, w2, w13_scale=s13, w2_scale=s2, activation=act, interleaved=interleaved,
                          b13=b13, b2=b2)
    d13, d2 = decode_fp64(w13, s13), decode_fp64(w2, s2)
    for row, t in enumerate(r.permuted_to_token.tolist()):
        if t < 0:
            continue
        e = int(r.tile_to_expert[row // tile])
        want = loop_expert(x[t], d13[e], d2[e], None if b13 is None else b13[e], None if b2 is None else b2[e], act,
                           interleaved)
        torch.testing.assert_close(got[row].float(), want.float(), rtol=2 ** -7, atol=1e-6)


def _args(**over):
    T, E, H, I = 2, 4, 128, 64
    w13, s13, w2, s2 = mx_weights(E, H, I)
    ids = torch.tensor([[0, 1], [1, 3]], dtype=torch.int32)
    a = dict(x=torch.zeros(T, H, dtype=torch.bfloat16), routing=routing_of(ids, E, 2), w13=w13, w2=w2,
             w13_scale=s13, w2_scale=s2)
    a.update(over)
    return a


@pytest.mark.parametrize("over,arg", [
    (dict(w13_scale=None), "w13_scale"),
    (dict(w2_scale=torch.zeros(4, 128, 1, dtype=torch.uint8)), "w2_scale"),           # one group short
    (dict(w13_scale=torch.zeros(4, 128, 4)), "w13_scale"),                            # dtype
    (dict(w13=torch.zeros(4, 128, 8, 8, dtype=torch.uint8)), "w13"),                  # not 16 bytes a group
    (dict(w13=torch.zeros(4, 128, 128, dtype=torch.uint8)), "w13"),                   # 3-D bytes
    (dict(w2=torch.zeros(4, 128, 1, 16, dtype=torch.uint8)), "w2"),                   # I = 32, not w13's 64
    (dict(x=torch.zeros(2, 96, dtype=torch.bfloat16), w13=torch.zeros(4, 128, 3, 16, dtype=torch.uint8),
          w13_scale=torch.zeros(4, 128, 3, dtype=torch.uint8), w2=torch.zeros(4, 96, 2, 16, dtype=torch.uint8),
          w2_scale=torch.zeros(4, 96, 2, dtype=torch.uint8)), "w13"),                  # H not a multiple of 64
])
def test_bad_inputs_name_the_argument(over, arg):
    with pytest.raises(kerngen.InputError) as e:
        kerngen.experts(**_args(**over))
    assert e.value.arg == arg


def mx_specs():
    """Every shipped model's MXFP4 experts kernels (warmup's list) and each activation at one shape."""
    t = tiers.load()
    specs = [s for m in t.models.values() for s in ex.model_specs(m, t, "sm_90a")
             if dict(s.constants)["FORMAT"] == "mxfp4"]
    for act in ex.ACTIVATIONS:
        s = ex.spec(2048, 768, ex.MAX_TILE, act, 64, "sm_90a", t, "mxfp4")
        if s not in specs:
            specs.append(s)
    return specs


def test_the_mxfp4_models_warm_up_both_formats():
    t = tiers.load()
    names = {m.name for m in t.models.values() if m.experts_format == "mxfp4"}
    assert names >= {"gpt-oss-120b", "kimi-k3"}
    for name in names:
        assert {dict(s.constants)["FORMAT"] for s in ex.model_specs(t.model(name), t, "sm_90a")} == {"bf16", "mxfp4"}


@pytest.mark.parametrize("spec", mx_specs(), ids=lambda s: s.tag)
def test_every_mxfp4_kernel_compiles_without_spills(spec, tmp_path):
    built = jit.build(spec, store=DiskCache(tmp_path))
    assert built.status == "compiled" and b"experts_gemm1" in built.files["kernel.cubin"]
    assert_no_spills(built.files)


def test_mxfp4_weights_dispatch_the_mxfp4_kernels_with_their_scales(monkeypatch):
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
        assert f["w13"] == a["w13"].data_ptr()
