"""kerngen.experts on the GPU against its reference: T in 1..64, every activation, local expert ranges, empty
experts, launch shapes straight from rules, the grouped-GEMM fallback past the rules, and inside a CUDA graph."""
import pytest
import torch

import kerngen
from kerngen.ops import experts as ex
from kerngen.plan import spec_for, target_arch
from kerngen.errors import TierError
from kerngen.tiers import Rule
from tests.test_experts_cpu import _transposed as transposed

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]

ACTS = ("silu", "gelu", "gpt_oss", "situglu")


def make(T, K, E, H, I, *, bias=False, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: (torch.randn(*s, device="cuda", generator=g) * 0.5).to(torch.bfloat16)  # noqa: E731
    x = r(T, H)
    logits = torch.randn(T, E, device="cuda", generator=g)
    w13, w2 = r(E, 2 * I, H) / H ** 0.25, r(E, H, I) / I ** 0.25
    b13, b2 = (r(E, 2 * I), r(E, H)) if bias else (None, None)
    return x, logits, w13, w2, b13, b2


def check(x, routing, w13, w2, **kw):
    got = kerngen.experts(x, routing, w13, w2, **kw)
    ref = ex.reference(x, routing, w13, w2, **kw)
    rows = routing.permuted_to_token >= 0
    torch.testing.assert_close(got[rows].float(), ref[rows].float(), rtol=2e-2, atol=2e-2)
    return got


@pytest.mark.parametrize("T", [1, 2, 7, 16, 33, 64])
@pytest.mark.parametrize("act", ACTS)
def test_kernels_match_the_reference(T, act):
    E, K, H, I = 32, 4, 1024, 256
    x, logits, w13, w2, b13, b2 = make(T, K, E, H, I, bias=act == "gpt_oss")
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)
    check(x, r, w13, w2, activation=act, interleaved=act == "gpt_oss", b13=b13, b2=b2,
          linear_beta=3.0 if act == "situglu" else 0.0)


@pytest.mark.parametrize("H,I", [(2048, 768), (2880, 2880), (7168, 2048)])
def test_model_shapes(H, I):
    x, logits, w13, w2, _, _ = make(4, 8, 16, H, I)
    check(x, kerngen.route(logits, top_k=8, method="softmax_topk", tile=8), w13, w2)


def test_local_experts_and_empty_experts():
    T, E, K, H, I = 9, 64, 2, 512, 128
    x, logits, w13, w2, _, _ = make(T, K, E, H, I)
    logits[:, 40:] = -float("inf")        # experts 40.. get no rows
    for local in ((0, 64), (16, 32), (48, 16)):
        r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=4, local_experts=local)
        check(x, r, w13[local[0]:local[0] + local[1]].contiguous(), w2[local[0]:local[0] + local[1]].contiguous())


def test_input_weights_llama4():
    x, logits, w13, w2, _, _ = make(5, 1, 16, 512, 128)
    r = kerngen.route(logits, top_k=1, method="top1_sigmoid", tile=1)
    check(x, r, w13, w2, input_weights=r.topk_weights[:, 0].contiguous())


@pytest.mark.parametrize("tile", [1, 8])
def test_two_tile_items_scale_llama4_rows_by_their_input_weight(tile):
    """mtiles = 2 on bf16 with input weights (each gathered row times its weight before the GEMM, SCALE)."""
    T, K, E, H, I = 7, 1, 16, 512, 128
    x, logits, w13, w2, _, _ = make(T, K, E, H, I, seed=4)
    r = kerngen.route(logits, top_k=1, method="top1_sigmoid", tile=tile)
    tag, consts = ex.tag_constants(H, I, tile, "silu")
    k = ex.Kernels(spec_for(Rule(op="experts", variant="mma", ranges={}, params=dict(warps=4, unroll=1, mtiles=2)),
                            tag, consts, target_arch()), torch.cuda.current_device())
    out = torch.full((r.permuted_to_token.shape[0], H), float("nan"), dtype=torch.bfloat16, device="cuda")
    iw = r.topk_weights[:, 0].contiguous()
    k(x, r, w13, w2, out, input_weights=iw)
    ref = ex.reference(x, r, w13, w2, input_weights=iw)
    rows = r.permuted_to_token >= 0
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), rtol=2e-2, atol=2e-2)


def test_beyond_the_rules_uses_grouped_mm():
    """Past the rules torch._grouped_mm runs: it rounds h (gate and up) to bf16 before the activation, one more
    rounding point than the reference, so 2 bf16 ulps of the output's scale are allowed."""
    T = 300                                  # past the rules (tokens 1..256)
    x, logits, w13, w2, _, _ = make(T, 4, 16, 512, 128)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    with pytest.raises(TierError):
        ex.spec(512, 128, 8, "silu", T, target_arch())
    got = kerngen.experts(x, r, w13, w2)
    ref = ex.reference(x, r, w13, w2)
    rows = r.permuted_to_token >= 0
    torch.testing.assert_close(got[rows].float(), ref[rows].float(), rtol=2e-2, atol=2 * 2 ** -8 * ref.abs().max().item())


def test_inside_a_cuda_graph():
    T, E, K, H, I = 8, 32, 4, 1024, 256
    x, logits, w13, w2, _, _ = make(T, K, E, H, I)
    ws = kerngen.RoutingWorkspace(T, E, K, 8)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws)
    out = torch.zeros(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
    kerngen.experts(x, r, w13, w2, out=out)          # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws)
        kerngen.experts(x, r, w13, w2, out=out)
    logits.copy_(torch.randn_like(logits))
    x.copy_(torch.randn_like(x.float()).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    ref = ex.reference(x, r, w13, w2)
    rows = r.permuted_to_token >= 0
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), rtol=2e-2, atol=2e-2)


PARAM_CASES = [dict(warps=1, unroll=1, blocks_per_sm=1), dict(warps=1, unroll=2, blocks_per_sm=4),
               dict(warps=2, unroll=1, blocks_per_sm=4), dict(warps=4, unroll=1, blocks_per_sm=1),
               dict(warps=4, unroll=2, blocks_per_sm=8, pdl=True), dict(warps=8, unroll=4, blocks_per_sm=2),
               dict(warps=8, unroll=2, blocks_per_sm=4, pdl=True, early_l2=True)]


# bf16 items of two m16 tiles of weight rows sharing each activation load (mtiles; with one_launch too), and GEMM1 on
# a grid of its own size (gemm1_blocks)
MORE_CASES = [dict(warps=4, unroll=1, blocks_per_sm=4, mtiles=2), dict(warps=2, unroll=2, blocks_per_sm=4, mtiles=2,
                                                                       pdl=True),
              dict(warps=8, unroll=2, blocks_per_sm=4, mtiles=2, one_launch=True),
              dict(warps=4, unroll=2, blocks_per_sm=8, gemm1_blocks=3, pdl=True)]


@pytest.mark.parametrize("params", PARAM_CASES + MORE_CASES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("T,tile", [(1, 8), (5, 8), (16, 16), (40, 16), (3, 1), (12, 4), (80, 32), (200, 32)])
@pytest.mark.parametrize("H,I,act", [(1024, 256, "silu"), (2880, 2880, "gpt_oss"), (1000, 200, "situglu"),
                                     (64, 16, "gelu")])
def test_every_launch_shape_against_the_reference(params, T, tile, H, I, act):
    """The kernels straight from a rule with these params: K not a multiple of 64 (1000, 200), tiles of 1..32."""
    E, K = 24, 4
    x, logits, w13, w2, b13, b2 = make(T, K, E, H, I, bias=act == "gpt_oss", seed=T)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=tile)
    tag, consts = ex.tag_constants(H, I, tile, act)
    k = ex.Kernels(spec_for(Rule(op="experts", variant="mma", ranges={}, params=params), tag, consts,
                            target_arch()), torch.cuda.current_device())
    out = torch.full((r.permuted_to_token.shape[0], H), float("nan"), dtype=torch.bfloat16, device="cuda")
    act_buf = torch.full((r.tile_to_expert.shape[0] * tile, I), float("nan"), dtype=torch.bfloat16, device="cuda")
    a0, a1 = (1.702, 7.0) if act == "gpt_oss" else (1.0, 2.0)
    k(x, r, w13, w2, out, act_buf, interleaved=act == "gpt_oss", b13=b13, b2=b2, a0=a0, a1=a1)
    ref = ex.reference(x, r, w13, w2, activation=act, interleaved=act == "gpt_oss", b13=b13, b2=b2,
                       linear_beta=2.0 if act == "situglu" else 0.0)
    rows = r.permuted_to_token >= 0
    # An intermediate value one bf16 step away (another fp32 sum order) moves an output by up to about 5e-4 of the
    # largest (gpt_oss at T = 200: 0.030 of 57.5, at tiles of 16 and 32 alike): atol at least 1e-3 of it.
    atol = max(2e-2, 1e-3 * ref[rows].float().abs().max().item())
    torch.testing.assert_close(out[rows].float(), ref[rows].float(), rtol=2e-2, atol=atol)


@pytest.mark.parametrize("params", PARAM_CASES[1::2], ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("T,tile", [(1, 8), (16, 16), (40, 16), (3, 1), (12, 4), (200, 32)])
@pytest.mark.parametrize("H,I,act", [(1024, 256, "silu"), (2880, 2880, "gpt_oss"), (1000, 200, "situglu"),
                                     (64, 16, "gelu"), (520, 136, "silu")])
def test_transposed_weights_give_the_bits_of_contiguous_ones(params, T, tile, H, I, act):
    """The "kn" build reads [E, H, 2I] / [E, I, H] in place and feeds the tensor cores the same products in the same
    K order as the "nk" build: bitwise equal rows, and both at the reference. H = 520: a last GEMM2 item of 8
    columns; K = 1000 / 200: not a multiple of 64; gpt_oss: interleaved gate and up."""
    E, K = 24, 4
    x, logits, w13, w2, b13, b2 = make(T, K, E, H, I, bias=act == "gpt_oss", seed=T + 1)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=tile)
    a0, a1 = (1.702, 7.0) if act == "gpt_oss" else (1.0, 2.0)
    rows = r.permuted_to_token >= 0
    outs = []
    for layout, (a, b) in (("nk", (w13, w2)), ("kn", (transposed(w13), transposed(w2)))):
        tag, consts = ex.tag_constants(H, I, tile, act, "bf16", layout)
        k = ex.Kernels(spec_for(Rule(op="experts", variant="mma", ranges={}, params=params), tag, consts,
                                target_arch()), torch.cuda.current_device())
        out = torch.full((r.permuted_to_token.shape[0], H), float("nan"), dtype=torch.bfloat16, device="cuda")
        act_buf = torch.full((r.tile_to_expert.shape[0] * tile, I), float("nan"), dtype=torch.bfloat16, device="cuda")
        k(x, r, a, b, out, act_buf, interleaved=act == "gpt_oss", b13=b13, b2=b2, a0=a0, a1=a1)
        outs.append(out[rows])
    ref = ex.reference(x, r, w13, w2, activation=act, interleaved=act == "gpt_oss", b13=b13, b2=b2,
                       linear_beta=2.0 if act == "situglu" else 0.0)
    assert torch.equal(outs[1].view(torch.int16), outs[0].view(torch.int16))
    # the reference rounds the intermediate to bf16 too, a rounding a flip of which moves H = 2880 sums by ~2**-6
    torch.testing.assert_close(outs[1].float(), ref[rows].float(), rtol=2e-2,
                               atol=2e-2 * max(1.0, ref[rows].float().abs().max().item()))


@pytest.mark.parametrize("T", [1, 5, 16])
def test_transposed_weights_through_the_api(T):
    """kerngen.experts with transposed views where the rules serve them (up to 16 tokens): gpt-oss (interleaved,
    biases, its gate) and Llama-4 (one expert, the router weight on the input), inside a CUDA graph too."""
    x, logits, w13, w2, b13, b2 = make(T, 4, 16, 2880, 2880, bias=True, seed=T)
    w13t, w2t = transposed(w13), transposed(w2)
    r = kerngen.route(logits, top_k=4, method="topk_softmax", tile=ex.tile_for(2880, 2880, "gpt_oss", T, 0, "bf16",
                                                                               "kn"))
    kw = dict(activation="gpt_oss", interleaved=True, b13=b13, b2=b2)
    got = check(x, r, w13t, w2t, **kw)
    assert torch.equal(got[r.permuted_to_token >= 0], kerngen.experts(x, r, w13, w2, **kw)[r.permuted_to_token >= 0])
    x, logits, w13, w2, _, _ = make(T, 1, 16, 512, 256, seed=T)
    r = kerngen.route(logits, top_k=1, method="top1_sigmoid", tile=8)
    check(x, r, transposed(w13), transposed(w2), input_weights=r.topk_weights[:, 0].contiguous())
    out = torch.zeros(r.permuted_to_token.shape[0], 512, dtype=torch.bfloat16, device="cuda")
    args = (x, r, transposed(w13), transposed(w2))
    kerngen.experts(*args, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kerngen.experts(*args, out=out)
    x.copy_(torch.randn_like(x.float()).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    rows = r.permuted_to_token >= 0
    torch.testing.assert_close(out[rows].float(), ex.reference(x, r, w13, w2)[rows].float(), rtol=2e-2, atol=2e-2)


def test_transposed_weights_past_their_rules_run_grouped_mm():
    """At 17..256 tokens the rule leaves transposed weights to torch._grouped_mm (one more bf16 rounding, of h):
    the grouped GEMM's rows, close to the reference."""
    T = 40
    x, logits, w13, w2, _, _ = make(T, 4, 16, 512, 256, seed=T)
    assert ex.tile_for(512, 256, "silu", T, 0, "bf16", "kn") is None
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    got = kerngen.experts(x, r, transposed(w13), transposed(w2))
    ref = ex.reference(x, r, w13, w2)
    rows = r.permuted_to_token >= 0
    torch.testing.assert_close(got[rows].float(), ref[rows].float(), rtol=2e-2, atol=2 * 2 ** -8 * ref.abs().max().item())


def test_the_torch_op_takes_tiles_of_32_where_the_rule_gives_them():
    """torch.ops.kerngen.moe_experts at 256 tokens, top-k 8 of 128 experts: the tile-32 rule's kernels (about 16
    rows an expert, some experts two tiles), against the reference's weighted sum."""
    T, E, K, H, I = 256, 128, 8, 512, 256
    x, logits, w13, w2, _, _ = make(T, K, E, H, I, seed=5)
    assert ex.tile_for(H, I, "silu", T, 0, experts=E, top_k=K) == 32
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=32)
    got = torch.ops.kerngen.moe_experts(x, r.topk_ids, r.topk_weights, w13, w2, "silu")
    rows = ex.reference(x, r, w13, w2).float()
    e2p = r.expanded_to_permuted.long()
    ref = (rows[e2p] * r.topk_weights.float().unsqueeze(-1)).sum(1)
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("T", [1, 8])
def test_the_torch_op_fills_one_workspace_at_decode_sizes(T):
    """torch.ops.kerngen.moe_experts at decode sizes: the permutation's workspace is one allocation set to its
    initial state by at most two fills (not one a view: each is a node of the caller's CUDA graph; the one-launch
    rule zeroes its counters too), and the weighted sum is the reference's."""
    from torch.profiler import ProfilerActivity, profile
    E, K, H, I = 128, 8, 512, 256
    x, logits, w13, w2, _, _ = make(T, K, E, H, I, seed=11 + T)
    r = kerngen.route(logits, top_k=K, method="softmax_topk")
    op = lambda: torch.ops.kerngen.moe_experts(x, r.topk_ids, r.topk_weights, w13, w2, "silu")   # noqa: E731
    op()   # builds the kernels
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        got = op()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    fills = [n for n in names if "Fill" in n]
    one_launch = any(n == "experts_gemm12" for n in names)   # its tile counters: one zero fill more
    assert 1 <= len(fills) <= 2 + one_launch, names
    rp = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)   # the sum's rows at any tile
    rows = ex.reference(x, rp, w13, w2).float()
    ref = (rows[rp.expanded_to_permuted.long()] * rp.topk_weights.float().unsqueeze(-1)).sum(1)
    torch.testing.assert_close(got.float(), ref, rtol=2e-2, atol=2e-2)
