"""kerngen.experts with quantized weights on the GPU against its reference on the dequantized weights (fp32): fp8
block-scaled and MXFP4 (gpt-oss's layout), T in 1..256 on the kernels, every activation, gpt-oss's interleaved
clamped SwiGLU with biases, an expert-parallel range, beyond the rules (the per-expert reference), inside a CUDA
graph; transformers' FP8Experts served by the integration on CUDA."""
import pytest
import torch

import kerngen
from kerngen.ops import experts as ex
from tests.gpu.test_experts import make as make_bf16
from tests.test_experts_fp8_cpu import fp8_weights
from tests.test_experts_mxfp4_cpu import mx_weights

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]
MAKE = {"fp8": fp8_weights, "mxfp4": mx_weights}
FORMATS = tuple(MAKE)


def make(fmt, T, K, E, H, I, seed=0):
    w13, s13, w2, s2 = (t.cuda() for t in MAKE[fmt](E, H, I, seed))
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(T, H, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
    logits = torch.randn(T, E, device="cuda", generator=g)
    return x, logits, (w13, w2), dict(w13_scale=s13, w2_scale=s2)


def check_rows(got, ref, r):
    """The same fp32 sums in another order and the two bf16 roundings (intermediate, output)."""
    rows = r.permuted_to_token >= 0
    scale = ref[rows].float().abs().max().item()
    torch.testing.assert_close(got[rows].float(), ref[rows].float(), rtol=2e-2, atol=2e-2 * scale)


def check(x, r, w, s, **kw):
    check_rows(kerngen.experts(x, r, *w, **s, **kw), ex.reference(x, r, *w, **s, **kw), r)


def shape_kernels(fmt, H, I, tile, act="silu", a8=False, **params):
    """The kernels of one launch shape (4 warps, one step a batch, 4 CTAs an SM, PDL, unless `params` say otherwise)
    for routing tile `tile`, as a tier rule gives them (a8: fp8 activations)."""
    from kerngen import tiers
    from kerngen.plan import target_arch
    ranges = {"tokens": (1, params["fused_x"])} if params.get("fused_x") else {}   # (fused_x bounds the rule's T)
    rule = tiers.Rule("experts", "mma", ranges, {**dict(warps=4, unroll=1, blocks_per_sm=4, pdl=True), **params,
                                                 "tile": tile})
    return ex.Kernels(ex.rule_spec(rule, H, I, act, target_arch(0), fmt, "nk", a8), 0)


def replay_on_new_logits(run, logits, out):
    """run() once, captured in a CUDA graph, replayed on new logits into a zeroed out."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    logits.copy_(torch.randn_like(logits))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()


def replayed_two_tokens(fmt, k, seed, E=16, K=4, H=1024, I=256):
    """Kernels `k` on two tokens through a workspace's routing, replayed from a CUDA graph on new logits and checked;
    (x, the routing of the new logits, weights, scales)."""
    x, logits, w, s = make(fmt, 2, K, E, H, I, seed=seed)
    ws = kerngen.RoutingWorkspace(2, E, K, 8)
    route = lambda: kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws)  # noqa: E731
    out = torch.zeros(route().permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
    replay_on_new_logits(lambda: k(x, route(), *w, out, **s), logits, out)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)
    check_rows(out, ex.reference(x, r, *w, **s), r)
    return x, r, w, s


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 3, 8, 16, 17, 64, 256])
@pytest.mark.parametrize("H,I", [(1024, 256), (2048, 768)])
def test_kernels_match_the_dequantized_reference(fmt, T, H, I):
    x, logits, w, s = make(fmt, T, 4, 32, H, I, seed=T)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=ex.tile_for(H, I, "silu", T, 0))
    check(x, r, w, s)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act", ["gelu", "situglu"])
def test_activations(fmt, act):
    x, logits, w, s = make(fmt, 5, 4, 16, 1024, 256)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    check(x, r, w, s, activation=act, linear_beta=2.0 if act == "situglu" else 0.0)


@pytest.mark.parametrize("T", [1, 8, 64])
def test_gpt_oss_mxfp4(T):
    E, H, I = 16, 2880, 2880
    x, logits, w, s = make("mxfp4", T, 4, E, H, I, seed=T)
    g = torch.Generator(device="cuda").manual_seed(T)
    b13 = (torch.randn(E, 2 * I, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    b2 = (torch.randn(E, H, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    r = kerngen.route(logits, top_k=4, method="topk_softmax", tile=ex.tile_for(H, I, "gpt_oss", T, 0))
    check(x, r, w, s, activation="gpt_oss", interleaved=True, b13=b13, b2=b2)


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_expert_parallel_range(fmt):
    x, logits, (w13, w2), s = make(fmt, 6, 4, 32, 1024, 256)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8, local_experts=(8, 16))
    local = lambda t: t[8:24].contiguous()  # noqa: E731
    check(x, r, (local(w13), local(w2)), {k: local(v) for k, v in s.items()})


@pytest.mark.parametrize("fmt", FORMATS)
def test_beyond_the_rules_runs_the_reference(fmt):
    x, logits, w, s = make(fmt, 300, 2, 8, 1024, 256)
    r = kerngen.route(logits, top_k=2, method="softmax_topk", tile=16)
    rows = r.permuted_to_token >= 0
    assert torch.equal(kerngen.experts(x, r, *w, **s)[rows], ex.reference(x, r, *w, **s)[rows])


@pytest.mark.parametrize("fmt", FORMATS)
def test_inside_a_cuda_graph(fmt):
    T, E, K, H, I = 8, 32, 4, 1024, 256
    x, logits, w, s = make(fmt, T, K, E, H, I)
    ws = kerngen.RoutingWorkspace(T, E, K, 8)
    out = torch.zeros(T * K + E * 7, H, dtype=torch.bfloat16, device="cuda")
    kerngen.experts(x, kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws), *w, **s, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kerngen.experts(x, kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws), *w, **s,
                        out=out)
    logits.copy_(torch.randn_like(logits))
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)
    check_rows(out, ex.reference(x, r, *w, **s), r)


@pytest.mark.parametrize("T", [1, 8, 40])
def test_transformers_fp8_experts_on_cuda(T):
    from tests.test_integration_fp8_cpu import TOL_FUSED, fp8_model, inputs, kt, rel_err, run_block
    model, pairs = fp8_model()
    model = model.to("cuda", torch.bfloat16)
    block, new, _ = pairs[0]
    new.to("cuda")
    x = inputs(model, T, torch.bfloat16).cuda()
    want = run_block(block, x)
    block.experts = new
    kt.enable(model)
    assert rel_err(run_block(block, x), want) <= 2 * TOL_FUSED


def _route(x, E, K, seed):
    logits = torch.randn(x.shape[0], E, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    return kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)


def _codes(shape, allowed, seed):
    """uint8 tensor of `shape` whose bytes are drawn from `allowed` (a list of byte values)."""
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(allowed), shape, generator=g)
    return torch.tensor(allowed, dtype=torch.uint8)[pick]


@pytest.mark.parametrize("f16x", [False, True])
@pytest.mark.parametrize("codes", ["all", "subnormal"])
def test_fp8_every_code(codes, f16x):
    """Every e4m3 code (NaN excepted) or only the subnormal ones (exponent 0): the kernels' widening is exact for
    each, subnormals included (a flush to zero would leave these rows 0), by bit placement into bf16 and (f16x)
    by cvt.rn.f16x2.e4m3x2."""
    E, K, H, I = 8, 2, 1024, 256
    allowed = ([b for b in range(256) if b & 0x7F != 0x7F] if codes == "all"
               else [b | s for b in range(8) for s in (0, 0x80)])
    w13 = _codes((E, 2 * I, H), allowed, 1).view(torch.float8_e4m3fn).cuda()
    w2 = _codes((E, H, I), allowed, 2).view(torch.float8_e4m3fn).cuda()
    g = torch.Generator().manual_seed(3)
    big = 1.0 if codes == "subnormal" else 1 / 448
    s13 = (torch.rand(E, 2 * I // 128, H // 128, generator=g) * 0.02 * big + 1e-3 * big).cuda()
    s2 = (torch.rand(E, H // 128, I // 128, generator=g) * 0.02 * big + 1e-3 * big).cuda()
    if codes == "subnormal":   # the subnormals are at most 2^-6 * 7/8: scale them up to O(1) sums
        s13, s2 = s13 * 64, s2 * 64
    x = (torch.randn(5, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))).to(torch.bfloat16)
    r = _route(x, E, K, 5)
    s = dict(w13_scale=s13, w2_scale=s2)
    got = run_f16x(f16x_kernels("fp8", H, I, 8, f16x=f16x), x, r, (w13, w2), s)
    ref = ex.reference(x, r, w13, w2, **s)
    rows = r.permuted_to_token >= 0
    assert ref[rows].float().abs().max() > 0
    check_rows(got, ref, r)


@pytest.mark.parametrize("top", [24, 127, 129, 160, 230])
def test_mxfp4_scale_bytes_across_the_range(top):
    """Scale bytes in [top - 24, top] (each row's four groups of a step differ by up to 2^24), every e2m1 code: x is
    scaled by 2^(127 - top) so the sums stay O(1); the kernels' per-group factor and per-row fp32 factor are exact
    for bytes above 128 as below."""
    E, K, H, I = 8, 2, 1024, 256
    w13, s13, _, _ = mx_weights(E, H, I, seed=top, scale_range=(top - 24, top + 1))
    _, _, w2, s2 = mx_weights(E, H, I, seed=top + 1)
    w13, s13, w2, s2 = (t.cuda() for t in (w13, s13, w2, s2))
    x = (torch.randn(5, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(top)) * 0.3
         * 2.0 ** (127 - top)).to(torch.bfloat16)
    r = _route(x, E, K, top)
    s = dict(w13_scale=s13, w2_scale=s2)
    check_rows(kerngen.experts(x, r, w13, w2, **s), ex.reference(x, r, w13, w2, **s), r)


def test_mxfp4_subnormal_codes():
    """Only the codes 0 and +-0.5 (0.5 becomes a bf16 subnormal when placed): a flush to zero would leave rows 0."""
    E, K, H, I = 8, 2, 1024, 256
    allowed = [lo | hi << 4 for lo in (0, 1, 8, 9) for hi in (0, 1, 8, 9)]
    w13 = _codes((E, 2 * I, H // 32, 16), allowed, 1).cuda()
    w2 = _codes((E, H, I // 32, 16), allowed, 2).cuda()
    s13 = torch.full((E, 2 * I, H // 32), 124, dtype=torch.uint8, device="cuda")
    s2 = torch.full((E, H, I // 32), 124, dtype=torch.uint8, device="cuda")
    x = torch.randn(5, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).to(torch.bfloat16)
    r = _route(x, E, K, 7)
    s = dict(w13_scale=s13, w2_scale=s2)
    got, ref = kerngen.experts(x, r, w13, w2, **s), ex.reference(x, r, w13, w2, **s)
    assert ref[r.permuted_to_token >= 0].float().abs().max() > 0
    check_rows(got, ref, r)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 8, 64])
def test_gpt_oss_and_kimi_shapes(fmt, T):
    """The shipped models' widths (H not a multiple of the 128-wide step: gpt-oss's 2880) on their own rules."""
    for H, I, act in ((2880, 2880, "gpt_oss"), (3584, 2048, "situglu"), (7168, 2048, "silu")):
        if fmt == "fp8" and H % 128:
            continue
        x, logits, w, s = make(fmt, T, 4, 16, H, I, seed=T + H)
        r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=ex.tile_for(H, I, act, T, 0, fmt))
        kw = dict(activation=act, interleaved=act == "gpt_oss", linear_beta=2.0 if act == "situglu" else 0.0)
        check(x, r, w, s, **kw)


@pytest.mark.parametrize("T", [1, 2])
def test_mxfp4_at_sixteen_experts_a_token_on_its_one_launch_rule(T):
    """kimi-k3's K (16 experts a token): the shipped 1-2-token MXFP4 rules run both GEMMs in one launch; the
    reference's values through kerngen.experts, over experts named by several tokens too."""
    E, K, H, I = 64, 16, 3584, 2048
    assert dict(ex.spec(H, I, None, "situglu", T, "sm_90a", fmt="mxfp4", experts=E, top_k=K).params)["one_launch"]
    x, logits, w, s = make("mxfp4", T, K, E, H, I, seed=70 + T)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=ex.tile_for(H, I, "situglu", T, 0, "mxfp4",
                                                                                  experts=E, top_k=K))
    check(x, r, w, s, activation="situglu", linear_beta=2.0)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("params", [dict(prefetch=False), dict(prefetch_x=True), dict(unroll=2, prefetch_x=True),
                                    dict(warps=8, unroll=2), dict(tile=16), dict(tile=16, prefetch_x=True),
                                    dict(tile=32), dict(tile=32, f16x=True, mtiles=2)])
def test_launch_shapes_the_sweep_tries(fmt, params):
    """The quantized loop's variants (no prefetch, activations prefetched too, two steps a load batch, 8 warps, tiles
    of 8, 16 and 32 rows) give the reference's rows: the tier rules may pick any of them."""
    p = dict(params)
    tile = p.pop("tile", 8)
    H, I, T = 2880 if fmt == "mxfp4" else 3584, 2048, 60 if tile == 32 else 6   # (tiles of 32: about 15 rows each)
    x, logits, w, s = make(fmt, T, 4, 16, H, I, seed=11)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=tile)
    out = torch.zeros(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
    shape_kernels(fmt, H, I, tile, **p)(x, r, *w, out, w13_scale=s["w13_scale"], w2_scale=s["w2_scale"])
    check_rows(out, ex.reference(x, r, *w, **s), r)


def check_a8(got, ref, r):
    """fp8 activations: the same fp32 sums in another order, so an intermediate value may round to the neighbouring
    bf16 and then to the neighbouring e4m3 (or move its group's scale): norm-wise within 1%, every value within 5%
    of the largest."""
    rows = r.permuted_to_token >= 0
    g, f = got[rows].float(), ref[rows].float()
    assert ((g - f).norm() / f.norm()).item() < 1e-2
    assert ((g - f).abs().max() / f.abs().max()).item() < 5e-2


@pytest.mark.parametrize("T", [1, 2, 5, 8, 16, 17, 64, 200])
@pytest.mark.parametrize("H,I", [(1024, 256), (2048, 768)])
def test_fp8_activations_match_their_reference(T, H, I):
    """fp8_activations=True against the reference that quantizes x and the intermediate the same way (the sums in
    another order; an intermediate value one bf16 ulp apart may quantize one e4m3 step apart), and within the
    activation quantization's error of the weight-only reference."""
    x, logits, w, s = make("fp8", T, 4, 32, H, I, seed=T + 3)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=ex.tile_for(H, I, "silu", T, 0, "fp8"))
    got = kerngen.experts(x, r, *w, **s, fp8_activations=True)
    check_a8(got, ex.reference(x, r, *w, **s, fp8_activations=True), r)
    rows = r.permuted_to_token >= 0
    ref = ex.reference(x, r, *w, **s)[rows].float()
    err = (got[rows].float() - ref).norm() / ref.norm()
    assert err < 0.06, err   # e4m3 keeps 3 mantissa bits: about 2-3% relative on these sums


def test_fp8_activations_quantize_x_as_the_reference():
    """The quantizing launch's x bytes and scales equal quantize_fp8's, bit for bit (ties, zeros, large values)."""
    T, E, K, H, I = 6, 16, 4, 1024, 256
    x, logits, w, s = make("fp8", T, K, E, H, I, seed=5)
    x[0, :128] = 0   # a zero group (scale 1e-10 / 448)
    x[1, :4] = torch.tensor([448.0, -448.0, 1e4, 3.5], dtype=torch.bfloat16)
    x[2] = x[2].round()   # ties of v / s
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)
    k = ex.Kernels(ex.rule_spec(ex.table().rule("experts", {"hidden": H, "tokens": T, "arch": "sm_90a",
                                                            "format": "w8a8"}), H, I, "silu", "sm_90a", "fp8", "nk",
                                True), 0)
    assert k.a8
    out = torch.zeros(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
    k(x, r, *w, out, **s)
    torch.cuda.synchronize()
    (xq, xs, aq, asc), _ = k.quant_scratch(torch.cuda.current_stream().cuda_stream, T, r.tile_to_expert.shape[0],
                                           x.device)
    q, sc = ex.quantize_fp8(x)
    assert torch.equal(xs[:T], sc)
    assert torch.equal(xq[:T], q.view(torch.uint8))
    check_a8(out, ex.reference(x, r, *w, **s, fp8_activations=True), r)


def test_fp8_activations_inside_a_cuda_graph_and_with_input_weights():
    T, E, K, H, I = 8, 32, 4, 1024, 256
    x, logits, w, s = make("fp8", T, K, E, H, I, seed=9)
    inw = torch.rand(T, device="cuda") + 0.5
    ws = kerngen.RoutingWorkspace(T, E, K, 8)
    out = torch.zeros(T * K + E * 7, H, dtype=torch.bfloat16, device="cuda")
    run = lambda: kerngen.experts(x, kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws),  # noqa: E731
                                  *w, **s, out=out, input_weights=inw, fp8_activations=True)
    replay_on_new_logits(run, logits, out)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)
    check_a8(out, ex.reference(x, r, *w, **s, input_weights=inw, fp8_activations=True), r)


@pytest.mark.parametrize("params", [dict(prefetch_x=True), dict(unroll=2), dict(prefetch=False), dict(tile=16),
                                    dict(tile=16, prefetch_x=True, min_blocks=6), dict(blocks_per_sm=1, warps=8),
                                    dict(early_l2=True)])
@pytest.mark.parametrize("local", [None, (4, 12)])
def test_fp8_activations_launch_shapes(params, local):
    """Each launch shape the w8a8 rules may pick, over many items a CTA (across tiles of no local expert too)."""
    H, I, T = 3584, 2048, 6
    x, logits, (w13, w2), s = make("fp8", T, 4, 16, H, I, seed=12)
    p = dict(params)
    tile = p.pop("tile", 8)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=tile, local_experts=local)
    if local:
        w13, w2 = w13[local[0]:local[0] + local[1]].contiguous(), w2[local[0]:local[0] + local[1]].contiguous()
        s = {k: v[local[0]:local[0] + local[1]].contiguous() for k, v in s.items()}
    out = torch.zeros(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
    shape_kernels("fp8", H, I, tile, a8=True, **p)(x, r, w13, w2, out, **s)
    check_a8(out, ex.reference(x, r, w13, w2, **s, fp8_activations=True), r)


def f16x_kernels(fmt, H, I, tile, act="silu", f16x=True, **params):
    """The kernels of a launch shape with f16x (activations carried as f16; f16x=False: bf16), built for routing
    tile `tile`."""
    k = shape_kernels(fmt, H, I, tile, act, f16x=f16x, **params)
    assert k.x16 == f16x and not k.a8
    return k


def run_f16x(k, x, r, w, s, **kw):
    out = torch.zeros(r.permuted_to_token.shape[0], x.shape[1], dtype=torch.bfloat16, device="cuda")
    k(x, r, *w, out, w13_scale=s["w13_scale"], w2_scale=s["w2_scale"], **kw)
    return out


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("params", [dict(), dict(prefetch=False), dict(prefetch_x=True), dict(unroll=2),
                                    dict(tile=16), dict(tile=16, prefetch_x=True),
                                    dict(warps=8, unroll=2, blocks_per_sm=2), dict(mtiles=2),
                                    dict(mtiles=2, prefetch_x=True), dict(mtiles=2, tile=16),
                                    dict(mtiles=2, prefetch_x=True, early_l2=True),
                                    dict(unroll=2, prefetch=False, min_blocks=4, early_l2=True),
                                    dict(pingpong=True), dict(pingpong=True, prefetch_x=True),
                                    dict(mtiles=2, prefetch_x=True, pingpong=True, min_blocks=4),
                                    dict(unroll=2, prefetch_x=True, pingpong=True),
                                    dict(warps=8, prefetch=False, prefetch_x=True, min_blocks=4)])
@pytest.mark.parametrize("H,I", [(1024, 256), (2880, 2880)])
def test_f16x_launch_shapes_match_the_dequantized_reference(fmt, params, H, I):
    """f16x builds (the activations as f16 times a power of two per 128 columns, exact for these values) against the
    bf16-activation reference, with the weight-only kernels' tolerance; gpt-oss's 2880 ends its rows mid-step;
    mtiles=2 items of two tiles of weight rows sharing each activation fragment."""
    if fmt == "fp8" and H % 128:
        pytest.skip("fp8 block scales need multiples of 128")
    p = dict(params)
    tile = p.pop("tile", 8)
    for T in (1, 7, 40):
        x, logits, w, s = make(fmt, T, 4, 16, H, I, seed=T + H)
        r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=tile)
        check_rows(run_f16x(f16x_kernels(fmt, H, I, tile, **p), x, r, w, s), ex.reference(x, r, *w, **s), r)


@pytest.mark.parametrize("fmt", FORMATS)
def test_f16x_quantize_x_as_quantize_f16(fmt):
    """The quantizing launch's f16 values and scales equal quantize_f16's bit for bit (zeros, huge and tiny groups, a
    group mixing 2^-40 with 1, the short last group of a 2880-wide row; MXFP4 builds store each 4 as 0, 2, 1, 3)."""
    T, E, K, H, I = 6, 16, 4, 2880 if fmt == "mxfp4" else 1024, 256
    x, logits, w, s = make(fmt, T, K, E, H, I, seed=5)
    x[0, :128] = 0
    x[1, :128] *= 2.0 ** 100
    x[2, 128:256] *= 2.0 ** -100
    x[3, 256:260] = torch.tensor([1.0, 2.0 ** -40, -(2.0 ** -35), 3.0], dtype=torch.bfloat16)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)
    k = f16x_kernels(fmt, H, I, 8)
    out = run_f16x(k, x, r, w, s)
    torch.cuda.synchronize()
    (xq, xs, aq, asc), _ = k.quant_scratch(torch.cuda.current_stream().cuda_stream, T, r.tile_to_expert.shape[0],
                                           x.device)
    q, sc = ex.quantize_f16(x)
    if fmt == "mxfp4":   # each 4 values stored as 0, 2, 1, 3 (the pairs the e2m1 widening makes)
        q = q.unflatten(-1, (-1, 4))[..., [0, 2, 1, 3]].flatten(-2)
    assert xq.dtype == torch.float16 and torch.equal(xs[:T], sc)
    assert torch.equal(xq[:T].view(torch.int16), q.view(torch.int16))
    assert out.isfinite().any()   # (the 2^100 row overflows the intermediate, as in the reference)


@pytest.mark.parametrize("fmt", FORMATS)
def test_f16x_inside_a_cuda_graph_with_input_weights_and_a_local_range(fmt):
    T, E, K, H, I = 8, 32, 4, 1024, 256
    x, logits, (w13, w2), s = make(fmt, T, K, E, H, I, seed=9)
    lo, n = 4, 12
    w13, w2 = w13[lo:lo + n].contiguous(), w2[lo:lo + n].contiguous()
    s = {key: v[lo:lo + n].contiguous() for key, v in s.items()}
    inw = torch.rand(T, device="cuda") + 0.5
    k = f16x_kernels(fmt, H, I, 8)
    ws = kerngen.RoutingWorkspace(T, E, K, 8, local_experts=(lo, n))
    route = lambda: kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, local_experts=(lo, n),  # noqa: E731
                                  workspace=ws)
    out = torch.zeros(route().permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
    run = lambda: k(x, route(), w13, w2, out, input_weights=inw, **s)  # noqa: E731
    replay_on_new_logits(run, logits, out)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, local_experts=(lo, n))
    rows = r.permuted_to_token.shape[0]
    check_rows(out[:rows], ex.reference(x, r, w13, w2, **s, input_weights=inw), r)


def check_scale_bytes_and_subnormal_codes(k, top, spread, T, both=False):
    """Kernels `k` (MXFP4, 1024 x 256) on scale bytes in [top - spread, top] (w13's; w2's too where `both`), x of T
    tokens scaled by 2^(127 - top), then on the codes 0 and +-0.5 alone (0.5 an e4m3 subnormal once placed)."""
    E, K, H, I = 8, 2, 1024, 256
    w13, s13, _, _ = mx_weights(E, H, I, seed=top, scale_range=(top - spread, top + 1))
    _, _, w2, s2 = mx_weights(E, H, I, seed=top + 1, **({"scale_range": (top - spread, top + 1)} if both else {}))
    w, s = (w13.cuda(), w2.cuda()), dict(w13_scale=s13.cuda(), w2_scale=s2.cuda())
    x = (torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(top)) * 0.3
         * 2.0 ** (127 - top)).to(torch.bfloat16)
    r = _route(x, E, K, top)
    check_rows(run_f16x(k, x, r, w, s), ex.reference(x, r, *w, **s), r)
    allowed = [lo | hi << 4 for lo in (0, 1, 8, 9) for hi in (0, 1, 8, 9)]
    x = torch.randn(T, H, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).to(torch.bfloat16)
    w = (_codes((E, 2 * I, H // 32, 16), allowed, 1).cuda(), _codes((E, H, I // 32, 16), allowed, 2).cuda())
    s = dict(w13_scale=torch.full((E, 2 * I, H // 32), 124, dtype=torch.uint8, device="cuda"),
             w2_scale=torch.full((E, H, I // 32), 124, dtype=torch.uint8, device="cuda"))
    ref = ex.reference(x, r, *w, **s)
    assert ref[r.permuted_to_token >= 0].float().abs().max() > 0
    check_rows(run_f16x(k, x, r, w, s), ref, r)


@pytest.mark.parametrize("top", [24, 127, 160, 230])
def test_f16x_mxfp4_scale_bytes_and_subnormal_codes(top):
    """Scale bytes of a row's groups of a step up to 2^20 apart (the f16 group factors stay exact) and the codes 0
    and +-0.5 alone, on the f16x build."""
    check_scale_bytes_and_subnormal_codes(f16x_kernels("mxfp4", 1024, 256, 8), top, 20, 5)


@pytest.mark.parametrize("prefetch_x", [False, True])
def test_f16x_tiles_with_padding_rows_under_a_register_bound(prefetch_x):
    """Tiles of 16 rows, many of them padding (null B rows), in a build bound to 64 registers (8 CTAs of 4 warps,
    spilling): the activation loads of a null row are never issued (an earlier build dereferenced one here)."""
    H, I, E, K, T = 7168, 2048, 32, 8, 256
    x, logits, w, s = make("fp8", T, K, E, H, I, seed=21)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=16)
    k = f16x_kernels("fp8", H, I, 16, blocks_per_sm=8, min_blocks=8, prefetch_x=prefetch_x)
    out = run_f16x(k, x, r, w, s)
    torch.cuda.synchronize()
    check_rows(out, ex.reference(x, r, *w, **s), r)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("T", [1, 8, 40])
def test_early_l2_gives_the_same_bits(fmt, T):
    """early_l2 only moves bytes toward L2 before the wait: the same results, bit for bit, with PDL on (the GEMMs
    start while the quantizing launch before them runs), over local experts too (tiles of no local expert)."""
    H, I = (2880, 2880) if fmt == "mxfp4" else (1024, 256)
    x, logits, w, s = make(fmt, T, 4, 16, H, I, seed=30 + T)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8, local_experts=(4, 8))
    w = tuple(t[4:12].contiguous() for t in w)
    s = {k: v[4:12].contiguous() for k, v in s.items()}
    base = run_f16x(f16x_kernels(fmt, H, I, 8, mtiles=2), x, r, w, s)
    early = run_f16x(f16x_kernels(fmt, H, I, 8, mtiles=2, early_l2=True), x, r, w, s)
    torch.cuda.synchronize()
    assert torch.equal(base, early)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("params", [dict(), dict(prefetch_x=True), dict(mtiles=2, prefetch_x=True, min_blocks=4),
                                    dict(unroll=2, prefetch_x=True), dict(warps=8, blocks_per_sm=3)])
@pytest.mark.parametrize("T", [1, 8, 40])
def test_pingpong_gives_the_same_bits(fmt, params, T):
    """pingpong runs each warp's steps in the same order on two weight buffers taking turns: the same bits as the
    build that copies the next steps' weights into one, for odd and even step counts a warp (gpt-oss's 2880 ends its
    rows mid-step), over local experts too."""
    H, I = (2880, 2880) if fmt == "mxfp4" else (1024, 256)
    x, logits, w, s = make(fmt, T, 4, 16, H, I, seed=50 + T)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8, local_experts=(4, 8))
    w = tuple(t[4:12].contiguous() for t in w)
    s = {k: v[4:12].contiguous() for k, v in s.items()}
    base = run_f16x(f16x_kernels(fmt, H, I, 8, **params), x, r, w, s)
    turns = run_f16x(f16x_kernels(fmt, H, I, 8, pingpong=True, **params), x, r, w, s)
    torch.cuda.synchronize()
    assert torch.equal(base, turns)


FUSED_SHAPES = [dict(), dict(prefetch_x=True), dict(unroll=2, prefetch=False, prefetch_x=True, min_blocks=4),
                dict(blocks_per_sm=6), dict(tile=16), dict(warps=8, blocks_per_sm=2),
                dict(prefetch=False, blocks_per_sm=8, min_blocks=8),
                dict(warps=8, prefetch=False, blocks_per_sm=4, min_blocks=4)]   # (64 registers, 32 warps an SM)


def same_bits_over_local_experts(fmt, params, T, seed, **changed):
    """The build of launch shape `params` with `changed` params against the one without them, on the same T tokens
    over local experts 4..11 of 16 (tiles of no local expert), with input weights; gpt-oss's 2880 (MXFP4) ends its
    rows mid-step. Returns the changed build's kernels after asserting the two outputs have the same bits."""
    H, I = (2880, 2880) if fmt == "mxfp4" else (1024, 256)
    p = dict(params)
    tile = p.pop("tile", 8)
    x, logits, w, s = make(fmt, T, 4, 16, H, I, seed=seed)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=tile, local_experts=(4, 8))
    w = tuple(t[4:12].contiguous() for t in w)
    s = {k: v[4:12].contiguous() for k, v in s.items()}
    inw = torch.rand(T, device="cuda") + 0.5
    base = run_f16x(f16x_kernels(fmt, H, I, tile, **p), x, r, w, s, input_weights=inw)
    k = f16x_kernels(fmt, H, I, tile, **changed, **p)
    got = run_f16x(k, x, r, w, s, input_weights=inw)
    torch.cuda.synchronize()
    assert torch.equal(base, got)
    return k


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("params", FUSED_SHAPES)
@pytest.mark.parametrize("T", [1, 2])
def test_fused_x_gives_the_same_bits(fmt, params, T):
    """fused_x: experts_gemm1 quantizes x into shared memory itself, with experts_quant_x's arithmetic: the same bits
    as the build that launches it."""
    k = same_bits_over_local_experts(fmt, params, T, 70 + T, fused_x=2)
    assert "experts_quant_x" not in ex.persistent(k.spec)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("params", [dict(), dict(prefetch_x=True), dict(unroll=2, prefetch=False, prefetch_x=True),
                                    dict(tile=16), dict(mtiles=2, prefetch_x=True)])
@pytest.mark.parametrize("T", [1, 2])
def test_stage_act_gives_the_same_bits(fmt, params, T):
    """stage_act: experts_gemm2 copies its tile's rows of the f16 intermediate into shared memory (once a tile) and
    reads them there: the same bits as the build without fused_x or stage_act."""
    k = same_bits_over_local_experts(fmt, params, T, 90 + T, fused_x=2, stage_act=True)
    assert ex.persistent(k.spec)["experts_gemm2"].dynamic_smem > 0


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stage", [False, True])
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("T", [3, 8])
def test_fused_x_up_to_eight_tokens_gives_the_same_bits(fmt, stage, pingpong, T):
    """fused_x = 8 with two m16 tiles an item and prefetch_x (the shape of the 3..128-token rules), with two weight
    buffers taking turns or not: x of up to eight tokens (and with stage_act the intermediate's rows) in dynamic
    shared memory past 48 KiB; the same bits."""
    H, I = (2880, 2880) if fmt == "mxfp4" else (1024, 256)
    x, logits, w, s = make(fmt, T, 4, 16, H, I, seed=100 + T)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    p = dict(mtiles=2, prefetch_x=True)
    base = run_f16x(f16x_kernels(fmt, H, I, 8, **p), x, r, w, s)
    turns = dict(pingpong=True, min_blocks=4) if pingpong else {}
    fused = run_f16x(f16x_kernels(fmt, H, I, 8, fused_x=8, stage_act=stage, **turns, **p), x, r, w, s)
    torch.cuda.synchronize()
    assert torch.equal(base, fused)
    if not (stage or pingpong):   # one m16 tile, 8 warps an item at 64 registers, against its own quant_x build
        q = dict(warps=8, prefetch=False, blocks_per_sm=4, min_blocks=4)
        base = run_f16x(f16x_kernels(fmt, H, I, 8, **q), x, r, w, s)
        fused = run_f16x(f16x_kernels(fmt, H, I, 8, fused_x=8, **q), x, r, w, s)
        torch.cuda.synchronize()
        assert torch.equal(base, fused)


@pytest.mark.parametrize("fmt", FORMATS)
def test_stage_act_reads_tiles_of_more_rows_where_they_are(fmt):
    """A permutation naming one expert several times for a token (kerngen.permute takes it): tiles of more rows than
    the two slots read the intermediate from global memory, the others from their slots; the same bits."""
    T, E, H, I = 2, 16, 1024, 256
    x, _, w, s = make(fmt, T, 4, E, H, I, seed=95)
    ids = torch.tensor([[3, 3, 3, 1], [3, 5, 3, 2]], dtype=torch.int32, device="cuda")
    r = kerngen.permute(ids, num_experts=E, tile=8)
    base = run_f16x(f16x_kernels(fmt, H, I, 8), x, r, w, s)
    staged = run_f16x(f16x_kernels(fmt, H, I, 8, fused_x=2, stage_act=True), x, r, w, s)
    torch.cuda.synchronize()
    assert torch.equal(base, staged)
    check_rows(staged, ex.reference(x, r, *w, **s), r)


@pytest.mark.parametrize("fmt", FORMATS)
def test_fused_x_quantizes_extreme_rows_as_experts_quant_x(fmt):
    """The groups test_f16x_quantize_x_as_quantize_f16 checks the quantizing launch on (a zero group, 2^100 and
    2^-100 groups, 2^-40 beside 1, NaN and inf, the short last group of a 2880-wide row): the fused build's output
    has the same bits (NaNs included) as the build that launches experts_quant_x."""
    T, E, K, H, I = 2, 16, 4, 2880 if fmt == "mxfp4" else 1024, 256
    x, logits, w, s = make(fmt, T, K, E, H, I, seed=6)
    x[0, :128] = 0
    x[0, 128:256] *= 2.0 ** 100
    x[1, 128:256] *= 2.0 ** -100
    x[1, 256:260] = torch.tensor([1.0, 2.0 ** -40, -(2.0 ** -35), 3.0], dtype=torch.bfloat16)
    x[1, 384] = float("nan")
    x[1, 520] = float("inf")
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)
    base = run_f16x(f16x_kernels(fmt, H, I, 8), x, r, w, s)
    fused = run_f16x(f16x_kernels(fmt, H, I, 8, fused_x=2), x, r, w, s)
    torch.cuda.synchronize()
    assert torch.equal(base.view(torch.int16), fused.view(torch.int16))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("params", [dict(fused_x=2), dict(fused_x=2, prefetch_x=True),
                                    dict(fused_x=2, unroll=2, prefetch=False, prefetch_x=True, min_blocks=4), dict(),
                                    dict(fused_x=2, prefetch=False, blocks_per_sm=8, min_blocks=8),
                                    dict(fused_x=8, warps=8, prefetch=False, blocks_per_sm=4, min_blocks=4)])
@pytest.mark.parametrize("H,I", [(1024, 256), (2880, 2880)])
def test_act_f16_false_matches_the_dequantized_reference(fmt, params, H, I):
    """act_f16 = false: experts_gemm2 on the bf16 intermediate (no experts_quant_act), with fused_x or without (then
    also past two tokens), against the reference with the weight-only kernels' tolerance."""
    if fmt == "fp8" and H % 128:
        pytest.skip("fp8 block scales need multiples of 128")
    for T in (1, params["fused_x"]) if params.get("fused_x") else (1, 7, 40):
        x, logits, w, s = make(fmt, T, 4, 16, H, I, seed=T + H + 1)
        r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
        k = f16x_kernels(fmt, H, I, 8, act_f16=False, **params)
        assert "experts_quant_act" not in ex.persistent(k.spec)
        check_rows(run_f16x(k, x, r, w, s), ex.reference(x, r, *w, **s), r)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("act_f16", [True, False])
def test_fused_x_inside_a_cuda_graph(fmt, act_f16):
    """Two launches (or three) replayed from a graph on new logits; more tokens than fused_x is a kerngen error."""
    E, K, H, I = 16, 4, 1024, 256
    k = f16x_kernels(fmt, H, I, 8, fused_x=2, act_f16=act_f16)
    replayed_two_tokens(fmt, k, seed=81)
    x3, logits3, w, s = make(fmt, 3, K, E, H, I, seed=82)
    r3 = kerngen.route(logits3, top_k=K, method="softmax_topk", tile=8)
    with pytest.raises(kerngen.InputError, match="at most 2 tokens"):
        k(x3, r3, *w, torch.empty(r3.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda"), **s)


RULE_1_2 = dict(f16x=True, fused_x=2, act_f16=False, blocks_per_sm=8, min_blocks=8)   # the 1-2-token rule's shape
UNG_SHAPES = [RULE_1_2, dict(RULE_1_2, unroll=2, blocks_per_sm=4, min_blocks=4),
              dict(f16x=True, unroll=2, blocks_per_sm=4, min_blocks=4), dict(f16x=True, mtiles=2),
              dict(f16x=True, fused_x=2, stage_act=True), dict(f16x=False), dict(f16x=False, unroll=2)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("params", UNG_SHAPES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("H,I", [(1024, 256), (2880, 2880), (3584, 1024)])
def test_lean_gives_the_bits_of_the_build_without_it(fmt, params, H, I):
    """lean (whole K steps with no bound checks, absent rows read a zero vector) changes no arithmetic: the same
    bits as the same launch shape without it, every token count it serves, x from shared memory (fused_x, stage_act)
    and from global memory, f16 and bf16 activations, one and two steps a batch, rows that end mid-step (2880)."""
    if fmt == "fp8" and H % 128:
        pytest.skip("fp8 block scales need multiples of 128")
    assert_same_bits(fmt, H, I, dict(prefetch=False, **params), dict(lean=True),
                     (1, 2) if params.get("fused_x") else (1, 5, 40), seed=H + 7)


def assert_same_bits(fmt, H, I, base: dict, extra: dict, tokens, seed: int):
    """The launch shape `base` with `extra` gives the bits of `base` alone at each token count (4 of 16 experts,
    tile 8), within the dequantized reference's bound."""
    k = shape_kernels(fmt, H, I, 8, **base, **extra)
    plain = shape_kernels(fmt, H, I, 8, **base)
    for T in tokens:
        x, logits, w, s = make(fmt, T, 4, 16, H, I, seed=T + seed)
        r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
        got, want = run_f16x(k, x, r, w, s), run_f16x(plain, x, r, w, s)
        rows = r.permuted_to_token >= 0
        assert torch.equal(got[rows], want[rows])
        check_rows(got, ex.reference(x, r, *w, **s), r)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("H,I", [(1024, 256), (2880, 2880)])
def test_early_l2_with_fused_x_gives_the_bits_without_it(fmt, H, I):
    """early_l2 beside fused_x (experts_gemm2's first weights toward L2 before its wait; experts_gemm1 reads nothing
    before its own): prefetches only, so the same bits as the 1-2-token rule's shape without it."""
    if fmt == "fp8" and H % 128:
        pytest.skip("fp8 block scales need multiples of 128")
    assert_same_bits(fmt, H, I, dict(RULE_1_2, prefetch=False, lean=True), dict(early_l2=True), (1, 2), seed=H + 11)


@pytest.mark.parametrize("fmt", FORMATS)
def test_lean_inside_a_cuda_graph(fmt):
    """Replayed from a graph on new logits (two tokens, x quantized by experts_gemm1 itself)."""
    replayed_two_tokens(fmt, shape_kernels(fmt, 1024, 256, 8, **RULE_1_2, prefetch=False, lean=True), seed=97)


GCOL = dict(RULE_1_2, prefetch=False, lean=True, gcol=True)   # the 1-2-token rule's shape (it takes gcol)
GCOL_SHAPES = [GCOL, dict(GCOL, unroll=2, blocks_per_sm=6, min_blocks=6),
               dict(GCOL, warps=2, blocks_per_sm=16, min_blocks=16),
               dict(GCOL, warps=3, blocks_per_sm=10, min_blocks=10), dict(GCOL, warps=3, blocks_per_sm=11, min_blocks=11),
               dict(GCOL, wide=True, blocks_per_sm=7, min_blocks=7),
               dict(GCOL, wide=True, unroll=2, blocks_per_sm=4, min_blocks=4), dict(GCOL, gemm1_unroll=2),
               dict(GCOL, unroll=2, gemm1_unroll=2, gemm2_blocks=6)]


@pytest.mark.parametrize("params", GCOL_SHAPES, ids=lambda p: f"warps={p.get('warps', 4)},ctas={p['blocks_per_sm']},"
                                                               f"unroll={p.get('unroll', 1)}"
                                                               f"{',wide' if p.get('wide') else ''}"
                                                               f"{',gemm1_unroll=2' if p.get('gemm1_unroll') else ''}"
                                                               f"{',gemm2_blocks=6' if p.get('gemm2_blocks') else ''}")
@pytest.mark.parametrize("H,I,act", [(1024, 256, "silu"), (2880, 2880, "gpt_oss"), (3584, 2048, "situglu")])
@pytest.mark.parametrize("T", [1, 2])
def test_gcol_matches_the_dequantized_reference(params, H, I, act, T):
    """gcol (experts_gemm1's mma columns each one 32-value group, its scale in fp32; one and two steps a load batch,
    an item's K split 2, 3 or 4 ways, two groups a lane with wide) against the reference with the weight-only
    kernels' tolerance: gpt-oss's 2880 ends its rows mid-step (and takes its interleaved clamped SwiGLU with biases),
    over local experts 4..11 of 16 with input weights, and with both tokens on the same experts (tiles of two
    rows)."""
    k = shape_kernels("mxfp4", H, I, 8, act, **params)
    assert set(ex.persistent(k.spec)) == {"experts_gemm1", "experts_gemm2"}
    g = torch.Generator(device="cuda").manual_seed(H + T)
    ref_kw = dict(activation=act, interleaved=act == "gpt_oss", linear_beta=2.0 if act == "situglu" else 0.0)
    k_kw = dict(interleaved=act == "gpt_oss", a0={"gpt_oss": 1.702, "situglu": 1.0}.get(act, 0.0),
                a1={"gpt_oss": 7.0, "situglu": 2.0}.get(act, 0.0))   # (alpha, limit; beta, linear_beta)
    bias = {}
    if act == "gpt_oss":
        bias = dict(b13=(torch.randn(16, 2 * I, device="cuda", generator=g) * 0.1).to(torch.bfloat16),
                    b2=(torch.randn(16, H, device="cuda", generator=g) * 0.1).to(torch.bfloat16))
    x, logits, w, s = make("mxfp4", T, 4, 16, H, I, seed=H + T)
    for same in (False, True):
        if same:
            logits = logits[:1].expand(T, -1).contiguous()
        r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
        check_rows(run_f16x(k, x, r, w, s, **k_kw, **bias), ex.reference(x, r, *w, **s, **ref_kw, **bias), r)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8, local_experts=(4, 8))
    wl, sl = tuple(t[4:12].contiguous() for t in w), {n: v[4:12].contiguous() for n, v in s.items()}
    bl = {n: v[4:12].contiguous() for n, v in bias.items()}
    inw = torch.rand(T, device="cuda", generator=g) + 0.5
    check_rows(run_f16x(k, x, r, wl, sl, input_weights=inw, **k_kw, **bl),
               ex.reference(x, r, *wl, **sl, input_weights=inw, **ref_kw, **bl), r)


def test_gcol_runs_tiles_of_more_rows_a_pair_at_a_time():
    """A permutation naming one expert several times for a token: tiles of up to four rows at two tokens, each pair
    of rows its own pass of experts_gemm1; the reference's values."""
    T, E, H, I = 2, 16, 2880, 2880
    x, _, w, s = make("mxfp4", T, 4, E, H, I, seed=96)
    ids = torch.tensor([[3, 3, 3, 1], [3, 5, 3, 2]], dtype=torch.int32, device="cuda")
    r = kerngen.permute(ids, num_experts=E, tile=8)
    for params in GCOL_SHAPES:
        got = run_f16x(shape_kernels("mxfp4", H, I, 8, **params), x, r, w, s)
        check_rows(got, ex.reference(x, r, *w, **s), r)


@pytest.mark.parametrize("T", [1, 2])
@pytest.mark.parametrize("H,I,act", [(2880, 2880, "gpt_oss"), (3584, 2048, "situglu")])
def test_gemm1_unroll_gives_the_bits_of_one_step_a_batch(H, I, act, T):
    """Two steps a load batch in experts_gemm1 alone (gemm1_unroll = 2) adds each warp's steps in the same order as
    one a batch: the 1-token rule's bits, rows ending mid-step (2880) included."""
    x, logits, w, s = make("mxfp4", T, 4, 16, H, I, seed=H + 7 * T)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    kw = dict(interleaved=act == "gpt_oss", a0={"gpt_oss": 1.702, "situglu": 1.0}[act],
              a1={"gpt_oss": 7.0, "situglu": 2.0}[act])
    one, two = (run_f16x(shape_kernels("mxfp4", H, I, 8, act, **p), x, r, w, s, **kw)
                for p in (GCOL, dict(GCOL, gemm1_unroll=2)))
    rows = r.permuted_to_token >= 0
    assert torch.equal(two[rows].view(torch.int16), one[rows].view(torch.int16))


def replays_on_new_logits(call, logits, K, H, want, times):
    """call(routing, out) on a routing of `logits` (tiles of 8, one workspace) captured once in a CUDA graph and
    replayed `times` times on new logits: each replay's rows the bits of want(routing of those logits)."""
    ws = kerngen.RoutingWorkspace(logits.shape[0], logits.shape[1], K, 8)
    route = lambda: kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws)  # noqa: E731
    out = torch.zeros(route().permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
    call(route(), out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(route(), out)
    for i in range(times):
        logits.copy_(torch.randn_like(logits))
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8)
        rows = r.permuted_to_token >= 0
        assert torch.equal(out[rows].view(torch.int16), want(r)[rows].view(torch.int16)), i


def test_mxfp4_scales_not_2_byte_aligned_are_refused():
    """MXFP4 scale tensors at an odd address (a view of a signature seen before included): a kerngen error naming
    the scales, before a 16-bit scale load could fault."""
    x, logits, w, s = make("mxfp4", 1, 4, 16, 1024, 256, seed=5)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    kerngen.experts(x, r, *w, **s)
    for name in ("w13_scale", "w2_scale"):
        n = s[name].numel()
        odd = torch.empty(n + 2, dtype=torch.uint8, device="cuda")[1:1 + n].view_as(s[name])
        odd.copy_(s[name])
        with pytest.raises(kerngen.InputError) as e:
            kerngen.experts(x, r, *w, **{**s, name: odd})
        assert e.value.arg == name and "2-byte aligned" in str(e.value)


@pytest.mark.parametrize("top", [24, 127, 160, 230])
@pytest.mark.parametrize("wide", [False, True])
def test_gcol_scale_bytes_and_subnormal_codes(top, wide):
    """Scale bytes up to 2^24 apart in both GEMMs (gcol: each group's fp32 factor 2^(s - 127), exact for all of them)
    and the codes 0 and +-0.5 alone, at two tokens, one group a lane and two (wide)."""
    wider = {"wide": True, "blocks_per_sm": 7, "min_blocks": 7} if wide else {}
    check_scale_bytes_and_subnormal_codes(shape_kernels("mxfp4", 1024, 256, 8, **{**GCOL, **wider}), top, 24, 2,
                                          both=True)


def test_gcol_inside_a_cuda_graph():
    """Two launches replayed from a graph on new logits; three tokens are a kerngen error (fused_x = 2)."""
    k = shape_kernels("mxfp4", 1024, 256, 8, **GCOL)
    replayed_two_tokens("mxfp4", k, seed=98)
    x3, logits3, w, s = make("mxfp4", 3, 4, 16, 1024, 256, seed=99)
    r3 = kerngen.route(logits3, top_k=4, method="softmax_topk", tile=8)
    with pytest.raises(kerngen.InputError, match="at most 2 tokens"):
        k(x3, r3, *w, torch.empty(r3.permuted_to_token.shape[0], 1024, dtype=torch.bfloat16, device="cuda"), **s)


TICKET_SHAPES = [dict(f16x=True, mtiles=2, prefetch_x=True), dict(f16x=True, mtiles=2, prefetch_x=True, tile=16),
                 dict(f16x=True, unroll=2, blocks_per_sm=4, min_blocks=4), dict(prefetch=False, lean=True)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("params", TICKET_SHAPES, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("T,E,K", [(3, 16, 4), (8, 128, 8), (40, 64, 8)])
def test_tickets_give_the_bits_of_the_grid_stride(fmt, params, T, E, K):
    """tickets (each GEMM's CTAs taking their items from a counter) change which CTA runs an item, not its sums: the
    bits of the same launch shape without them, call after call (each launch's last CTA zeroes its counters), with a
    caller's scratch too, and the dequantized reference's values. MXFP4 at gpt-oss's widths (rows that end mid-step);
    fp8 at widths of whole 128 x 128 scale blocks, as its format requires."""
    H, I = (2880, 2880) if fmt == "mxfp4" else (3072, 1536)
    x, logits, w, s = make(fmt, T, K, E, H, I, seed=T + E + len(params))
    tile = params.get("tile", 8)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=tile)
    shape = {k: v for k, v in params.items() if k != "tile"}
    want = run_f16x(shape_kernels(fmt, H, I, tile, **shape), x, r, w, s)
    k = shape_kernels(fmt, H, I, tile, **dict(shape, tickets=True))
    assert k.sync_buf and not k.one
    rows = r.permuted_to_token >= 0
    for _ in range(3):
        got = run_f16x(k, x, r, w, s)
        assert torch.equal(got[rows].view(torch.int16), want[rows].view(torch.int16))
    act = torch.empty(r.tile_to_expert.shape[0] * tile, I, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
    k(x, r, *w, out, act, **s)
    assert torch.equal(out[rows].view(torch.int16), want[rows].view(torch.int16))
    check_rows(got, ex.reference(x, r, *w, **s), r)


def test_tickets_inside_a_cuda_graph_on_new_logits():
    """tickets captured once and replayed on new logits: each replay's rows the eager call's (the counters left
    zeroed by every launch)."""
    H, I, T, K, E = 2880, 2880, 8, 4, 128
    x, logits, w, s = make("mxfp4", T, K, E, H, I, seed=41)
    k = shape_kernels("mxfp4", H, I, 8, f16x=True, mtiles=2, prefetch_x=True, tickets=True)
    replays_on_new_logits(lambda r, out: k(x, r, *w, out, **s), logits, K, H, lambda r: run_f16x(k, x, r, w, s), 4)


@pytest.mark.parametrize("T", [20, 64, 200])
def test_tickets_on_bf16_weights_give_the_bits_of_the_grid_stride(T):
    """bf16 weights with the 17-256-token rule's launch shape (tiles of 16, two steps a batch, 8 CTAs an SM) and
    tickets: the bits of the grid stride."""
    H, I, E, K = 2048, 768, 128, 8
    x, logits, w13, w2, _, _ = make_bf16(T, K, E, H, I, seed=T)
    r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=16)
    shape = dict(warps=4, unroll=2, blocks_per_sm=8, min_blocks=8, pdl=True)
    outs = []
    for extra in ({}, {"tickets": True}, {"tickets": True}):
        k = shape_kernels("bf16", H, I, 16, **shape, **extra)
        out = torch.zeros(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
        k(x, r, w13, w2, out)
        outs.append(out)
    rows = r.permuted_to_token >= 0
    assert all(torch.equal(o[rows].view(torch.int16), outs[0][rows].view(torch.int16)) for o in outs[1:])
    check_rows(outs[1], ex.reference(x, r, w13, w2), r)
