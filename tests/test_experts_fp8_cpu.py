"""kerngen.experts with fp8 block-scaled weights (float8_e4m3fn, one fp32 scale per 128 x 128 block, the layout
DeepSeek-V3 / Kimi K2 checkpoints and transformers' FP8Experts keep), on CPU tensors: the reference against an
fp64 computation written from the format's definition, the argument checks, the kernels' build per model and
activation and their dispatch: tests/test_experts_quantized_cpu.py."""
import pytest
import torch

from kerngen.ops import experts as ex
from tests.helpers import experts_error, experts_on_cpu
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
    got = experts_on_cpu(x, r, w13, w2, w13_scale=s13, w2_scale=s2)
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


def quantized_args(make, H: int, I: int, **over) -> dict:
    """kerngen.experts' arguments for 2 tokens over 4 experts with quantized weights from `make`, `over` replaced."""
    T, E = 2, 4
    w13, s13, w2, s2 = make(E, H, I)
    ids = torch.tensor([[0, 1], [1, 3]], dtype=torch.int32)
    a = dict(x=torch.zeros(T, H, dtype=torch.bfloat16), routing=routing_of(ids, E, 2), w13=w13, w2=w2,
             w13_scale=s13, w2_scale=s2)
    a.update(over)
    return a


def _args(**over):
    return quantized_args(fp8_weights, 256, 128, **over)


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
    assert experts_error(**_args(**over)).arg == arg


def test_quantize_fp8_per_row_and_128_columns():
    """s = amax / 448 per row and 128 columns; the largest magnitude of a group lands on 448; every value within
    half an e4m3 step (2^-4 relative, or the subnormal step) of v / s; zero groups stay zero."""
    g = torch.Generator().manual_seed(3)
    v = (torch.randn(5, 384, generator=g) * torch.logspace(-3, 3, 5)[:, None]).to(torch.bfloat16)
    v[4, 128:256] = 0
    q, s = ex.quantize_fp8(v)
    assert q.dtype == FP8 and q.shape == v.shape and s.shape == (5, 3) and s.dtype == torch.float32
    grp = v.float().unflatten(-1, (3, Q))
    amax = grp.abs().amax(-1)
    assert torch.equal(s, amax.clamp(min=1e-10) / 448)
    qf = q.float().unflatten(-1, (3, Q))
    assert torch.equal(qf.abs().amax(-1)[amax > 0], torch.full_like(amax[amax > 0], 448.0))
    exact = grp / s[..., None]
    assert ((qf - exact).abs() <= torch.maximum(exact.abs() * 2 ** -4, torch.full_like(exact, 2 ** -10))).all()
    assert torch.equal(qf[4, 1], torch.zeros(Q))


@pytest.mark.parametrize("seed", [0, 1])
def test_fp8_activations_reference_is_the_blockwise_fp8_computation(seed):
    """reference(fp8_activations=True) against the block-by-block form the fp8 tensor cores compute: for each 128
    block, sum(xq * wq) times the activation row's scale times the weight block's scale, in fp64."""
    T, K, E, H, I = 3, 2, 4, 256, 128
    w13, s13, w2, s2 = fp8_weights(E, H, I, seed)
    g = torch.Generator().manual_seed(seed + 20)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    r = routing_of(ids, E, 1)

    def gemm(v, w, s):   # v [K] bf16, w [N, K] fp8 with block scales s [N/Q, K/Q]
        vq, vs = ex.quantize_fp8(v)
        out = torch.zeros(w.shape[0], dtype=torch.float64)
        for kb in range(w.shape[1] // Q):
            blk = (w[:, kb * Q:(kb + 1) * Q].double() @ vq[kb * Q:(kb + 1) * Q].double()) * float(vs[kb])
            out += blk * s[:, kb].double().repeat_interleave(Q)
        return out
    want = torch.zeros(r.permuted_to_token.shape[0], H, dtype=torch.float64)
    for row, t in enumerate(r.permuted_to_token.tolist()):
        e = int(r.tile_to_expert[row])
        h = gemm(x[t], w13[e], s13[e])
        a = (torch.nn.functional.silu(h[:I]) * h[I:]).to(torch.bfloat16)
        want[row] = gemm(a, w2[e], s2[e])
    got = experts_on_cpu(x, r, w13, w2, w13_scale=s13, w2_scale=s2, fp8_activations=True)
    # the fp32 sums and one bf16 rounding of the output; an intermediate one bf16 ulp apart may shift one e4m3 step
    err = ((got.double() - want).norm() / want.norm()).item()
    assert err <= 2 ** -7, err
    assert not torch.equal(got, experts_on_cpu(x, r, w13, w2, w13_scale=s13, w2_scale=s2))


@pytest.mark.parametrize("over", [dict(fp8_activations=1), dict(fp8_activations="yes"),
                                  dict(w13=torch.zeros(4, 256, 256, dtype=torch.bfloat16),
                                       w2=torch.zeros(4, 256, 128, dtype=torch.bfloat16), w13_scale=None,
                                       w2_scale=None, fp8_activations=True)])
def test_fp8_activations_take_fp8_weights_and_a_bool(over):
    assert experts_error(**_args(**over)).arg == "fp8_activations"


def test_the_torch_op_takes_fp8_activations():
    """torch.ops.kerngen.moe_experts(..., fp8_activations=True) on CPU tensors: kerngen.experts' checks and reference
    with the same flag, then the top-k weighted sum."""
    import kerngen.torch_ops  # noqa: F401   registers torch.ops.kerngen
    T, K, E, H, I = 3, 2, 4, 256, 128
    w13, s13, w2, s2 = fp8_weights(E, H, I, 4)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    tw = torch.rand(T, K, generator=g)
    got = torch.ops.kerngen.moe_experts(x, ids, tw, w13, w2, "silu", None, None, s13, s2, fp8_activations=True)
    r = routing_of(ids, E, 1)
    rows = experts_on_cpu(x, r, w13, w2, w13_scale=s13, w2_scale=s2, fp8_activations=True)
    want = (rows.float()[r.expanded_to_permuted.long()] * tw[..., None]).sum(1)
    torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    off = torch.ops.kerngen.moe_experts(x, ids, tw, w13, w2, "silu", None, None, s13, s2)
    assert not torch.equal(got, off)
