"""kerngen.experts' one_launch on the GPU: experts_gemm12 (both GEMMs in one launch, CTAs taking tickets, GEMM2's
items waiting on their tile's GEMM1 items) gives the bits of the two launches of the same launch shape, within the
reference's bound, call after call (the last CTA zeroes the tickets), bf16, fp8 and MXFP4 weights, tiles of 1-16
rows and hundreds of tiles, local experts, gpt-oss's biases, inside a CUDA graph and on two streams at once."""
import pytest
import torch

import kerngen
from kerngen import tiers
from kerngen.ops import experts as ex
from kerngen.plan import target_arch
from tests.gpu.test_experts import make as make_bf16
from tests.gpu.test_experts_quantized import RULE_1_2, check_rows, make as make_q, replays_on_new_logits

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]

BF16 = [dict(warps=8, unroll=2, blocks_per_sm=4, pdl=True), dict(warps=4, unroll=1, blocks_per_sm=8, pdl=True),
        dict(warps=2, unroll=2, blocks_per_sm=2)]
QUANT = {"mxfp4": [dict(RULE_1_2, prefetch=False, lean=True, gcol=True, pdl=True),
                   dict(RULE_1_2, prefetch=False, lean=True, pdl=True)],
         "fp8": [dict(RULE_1_2, prefetch=False, lean=True, pdl=True), dict(RULE_1_2, pdl=True)]}
SHAPES = [(1024, 256, "silu"), (2880, 2880, "gpt_oss"), (3584, 2048, "situglu")]


def kernels(fmt, H, I, tile, act, **params):
    """(one_launch kernels, the two-launch kernels) of one launch shape."""
    base = {**dict(warps=4, unroll=1, blocks_per_sm=4), **params, "tile": tile}
    ranges = {"tokens": (1, params["fused_x"])} if params.get("fused_x") else {}
    out = tuple(ex.Kernels(ex.rule_spec(tiers.Rule("experts", "mma", ranges, {**base, **one}), H, I, act,
                                        target_arch(0), fmt, "nk"), 0) for one in ({"one_launch": True}, {}))
    assert out[0].one and not out[1].one
    return out


def act_kw(act):
    return dict(interleaved=act == "gpt_oss", a0={"gpt_oss": 1.702, "situglu": 1.0}.get(act, 0.0),
                a1={"gpt_oss": 7.0, "situglu": 2.0}.get(act, 0.0))


def ref_kw(act):
    return dict(activation=act, interleaved=act == "gpt_oss", linear_beta=2.0 if act == "situglu" else 0.0)


def inputs(fmt, T, K, E, H, I, act, seed):
    """x, logits, weights, scales (quantized formats) and biases (gpt-oss)."""
    if fmt == "bf16":   # (test_experts' inputs, its biases too)
        x, logits, w13, w2, b13, b2 = make_bf16(T, K, E, H, I, bias=act == "gpt_oss", seed=seed)
        return x, logits, (w13, w2), {}, ({} if b13 is None else dict(b13=b13, b2=b2))
    x, logits, w, s = make_q(fmt, T, K, E, H, I, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed)
    bias = {}
    if act == "gpt_oss":
        bias = dict(b13=(torch.randn(E, 2 * I, device="cuda", generator=g) * 0.1).to(torch.bfloat16),
                    b2=(torch.randn(E, H, device="cuda", generator=g) * 0.1).to(torch.bfloat16))
    return x, logits, w, s, bias


def run(k, x, r, w, s, **kw):
    out = torch.full((r.permuted_to_token.shape[0], x.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
    k(x, r, *w, out, **s, **kw)
    return out


def same_bits_as_two_launches(fmt, H, I, act, tile, T, params, E=16, K=4, seed=0, local=None):
    one, two = kernels(fmt, H, I, tile, act, **params)
    x, logits, w, s, bias = inputs(fmt, T, K, E, H, I, act, seed)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=tile,
                      **({"local_experts": local} if local else {}))
    if local:
        w = tuple(t[local[0]:local[0] + local[1]].contiguous() for t in w)
        s = {n: v[local[0]:local[0] + local[1]].contiguous() for n, v in s.items()}
        bias = {n: v[local[0]:local[0] + local[1]].contiguous() for n, v in bias.items()}
    want = run(two, x, r, w, s, **act_kw(act), **bias)
    rows = r.permuted_to_token >= 0
    for _ in range(3):   # call after call: each launch finds its tickets zeroed by the last
        got = run(one, x, r, w, s, **act_kw(act), **bias)
        assert torch.equal(got[rows], want[rows])
    check_rows(got, ex.reference(x, r, *w, **s, **ref_kw(act), **bias), r)
    return one, two


@pytest.mark.parametrize("params", BF16, ids=lambda p: f"w{p['warps']}u{p['unroll']}b{p['blocks_per_sm']}")
@pytest.mark.parametrize("H,I,act", SHAPES)
@pytest.mark.parametrize("T,tile", [(1, 8), (2, 8), (7, 8), (16, 16), (40, 16), (3, 1), (12, 4)])
def test_bf16_gives_the_bits_of_two_launches(params, H, I, act, T, tile):
    same_bits_as_two_launches("bf16", H, I, act, tile, T, params, seed=T + H)


@pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
@pytest.mark.parametrize("case", [0, 1])
@pytest.mark.parametrize("H,I,act", SHAPES)
@pytest.mark.parametrize("T", [1, 2])
def test_quantized_gives_the_bits_of_two_launches(fmt, case, H, I, act, T):
    if fmt == "fp8" and (H % 128 or I % 128):
        pytest.skip("fp8 block scales need multiples of 128")
    same_bits_as_two_launches(fmt, H, I, act, 8, T, QUANT[fmt][case], seed=T + H + case)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_local_experts_and_many_tiles(fmt):
    """Experts 4..11 of 16 (tiles of the others unused), and 64 tokens on 8 of 128 experts in tiles of one row
    (hundreds of tiles: every count zeroed), then one token again."""
    params = BF16[0] if fmt == "bf16" else QUANT[fmt][0]
    same_bits_as_two_launches(fmt, 2880, 2880, "gpt_oss", 8, 2, params, local=(4, 8), seed=5)
    if fmt == "bf16":
        same_bits_as_two_launches(fmt, 1024, 256, "silu", 1, 64, params, E=128, K=8, seed=6)
        same_bits_as_two_launches(fmt, 1024, 256, "silu", 1, 1, params, E=128, K=8, seed=7)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_inside_a_cuda_graph(fmt):
    """One launch captured, replayed on new logits five times, each replay's bits the two launches' (eager)."""
    params = BF16[0] if fmt == "bf16" else QUANT[fmt][0]
    H, I, T, K, E = 2880, 2880, 2, 4, 16
    one, two = kernels(fmt, H, I, 8, "gpt_oss", **params)
    x, logits, w, s, bias = inputs(fmt, T, K, E, H, I, "gpt_oss", seed=11)
    replays_on_new_logits(lambda r, out: one(x, r, *w, out, **s, **act_kw("gpt_oss"), **bias), logits, K, H,
                          lambda r: run(two, x, r, w, s, **act_kw("gpt_oss"), **bias), 5)


def test_two_streams_at_once():
    """Each stream its own tickets: two calls in flight together give each its own bits."""
    H, I, K, E = 2048, 768, 8, 128
    one, two = kernels("bf16", H, I, 8, "silu", **BF16[0])
    cases = []
    for seed in (21, 22):
        x, logits, w, s, bias = inputs("bf16", 4, K, E, H, I, "silu", seed)
        r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)
        cases.append((x, r, w, run(two, x, r, w, s)))
    streams = [torch.cuda.Stream() for _ in cases]
    outs = [torch.zeros_like(c[3]) for c in cases]
    torch.cuda.synchronize()
    for _ in range(20):
        for st, (x, r, w, _), o in zip(streams, cases, outs):
            with torch.cuda.stream(st):
                one(x, r, *w, o)
    torch.cuda.synchronize()
    for (x, r, w, want), o in zip(cases, outs):
        rows = r.permuted_to_token >= 0
        assert torch.equal(o[rows], want[rows])


def test_the_callers_scratch_gets_counters_of_its_own():
    """With scratch= (the torch custom op's path) each call zeroes counters of its own and the stream's buffer is never
    made; the bits stay the two launches'."""
    H, I, K, E, T = 2048, 768, 8, 128, 4
    one, two = kernels("bf16", H, I, 8, "silu", **BF16[0])
    x, logits, w, s, _ = inputs("bf16", T, K, E, H, I, "silu", 31)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)
    want = run(two, x, r, w, s)
    rows = r.permuted_to_token >= 0
    tiles = r.tile_to_expert.shape[0]
    for _ in range(3):
        scratch = torch.empty(tiles * 8, I, dtype=torch.bfloat16, device="cuda")
        got = run(one, x, r, w, s, act=scratch)
        assert torch.equal(got[rows], want[rows])
    assert one._sync == {}
