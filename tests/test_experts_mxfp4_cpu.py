"""kerngen.experts with MXFP4 weights as gpt-oss checkpoints store them (`*_blocks` [E, N, K/32, 16] uint8, two e2m1
values a byte, low nibble first; `*_scales` [E, N, K/32] uint8 e8m0, 2^(s - 127)), on CPU tensors: the reference
against an fp64 decoding written from the format's definition and the argument checks (the builds and their
dispatch: tests/test_experts_quantized_cpu.py)."""
import pytest
import torch

from kerngen.ops import experts as ex
from tests.helpers import experts_error, experts_on_cpu
from tests.test_experts_cpu import loop_expert, routing_of
from tests.test_experts_fp8_cpu import quantized_args


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
    got = experts_on_cpu(x, r, w13, w2, w13_scale=s13, w2_scale=s2, activation=act, interleaved=interleaved,
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
    return quantized_args(mx_weights, 128, 64, **over)


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
    assert experts_error(**_args(**over)).arg == arg
