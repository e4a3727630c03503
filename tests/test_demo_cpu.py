"""tools/bench/moe_layer_demo.py on the CPU: its torch layer against a per-token loop, and its permuted-row expert
path (with the torch references of route and moe_tail) against its torch layer, for tiny made-up models."""
import pytest
import torch
import torch.nn.functional as F

from kerngen.ops import permute as pm
from kerngen.ops import routing, tail
from kerngen.tiers import Model
from tools.bench import moe_layer_demo as demo


TINY = {
    "sigmoid_bias": Model("tiny", 8, 2, 64, "sigmoid_bias", (1, 64), routed_scaling_factor=2.5),
    "grouped_sigmoid_bias": Model("tiny-grouped", 8, 2, 64, "grouped_sigmoid_bias", (1, 64), n_group=4,
                                  topk_group=2, routed_scaling_factor=2.5),
    "softmax_topk": Model("tiny-softmax", 8, 2, 64, "softmax_topk", (1, 64)),
    "top1_sigmoid": Model("tiny-llama4", 8, 1, 64, "top1_sigmoid", (1, 64), router_weight="input"),
}
INTER = 16
# The loop and the demo round the same values to bf16 and sum short dot products in fp32, so on one CPU they
# agree to about one bf16 step (2**-7 of |out|); tighter than the demo's GPU tolerance, which covers cuBLAS
# picking different sum orders for different GEMM shapes.
CPU_TOL = 1e-2


def expert(v, w1, w2):
    """One token through one expert with fp32 dot products and the layer's bf16 roundings."""
    h = (w1.float() @ v.float()).to(torch.bfloat16).float()
    act = (F.silu(h[:INTER]) * h[INTER:]).to(torch.bfloat16).float()
    return (w2.float() @ act).to(torch.bfloat16).float()


def loop_layer(m, w, x, residual):
    """The layer one token and one slot at a time, routed by kerngen's routing reference."""
    ids, weights = routing.reference(x.float() @ w.router.T, m.top_k, m.routing, w.bias, m.n_group, m.topk_group,
                                     m.routed_scaling_factor, m.renormalize)
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        y = residual[t].float() + expert(x[t], w.shared1, w.shared2)
        for k in range(m.top_k):
            e = int(ids[t, k])
            if m.weight_on_input:   # Llama4TextMoe: the bf16 input row times its router score
                y = y + expert(x[t] * weights[t, k].to(x.dtype), w.w1[e], w.w2[e])
            else:
                y = y + weights[t, k] * expert(x[t], w.w1[e], w.w2[e])
        out[t] = (y * torch.rsqrt(y.pow(2).mean() + demo.EPS) * w.norm.float()).to(x.dtype)
    return out, ids


def case(method, T, seed=0):
    m = TINY[method]
    w = demo.make_weights(m, INTER, device="cpu", seed=seed)
    x, residual = demo.make_inputs(T, m.hidden, device="cpu", seed=seed + 1)
    return m, w, x, residual


@pytest.mark.parametrize("method", sorted(TINY))
@pytest.mark.parametrize("T", [1, 5, 16])
def test_torch_layer_matches_per_token_loop(method, T):
    m, w, x, residual = case(method, T)
    out, ids = demo.torch_layer(m, w)(x, residual)
    ref, ref_ids = loop_layer(m, w, x, residual)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert demo.ids_agreement(ids, ref_ids) == 1.0
    _, rel = demo.output_error(out, ref)
    assert rel <= CPU_TOL


def test_error_bound_catches_a_wrong_expert():
    m, w, x, residual = case("sigmoid_bias", 4)
    ref, ids = loop_layer(m, w, x, residual)
    w.w2[int(ids[0, 0])].neg_()   # token 0's first expert now pushes the other way
    out, _ = demo.torch_layer(m, w)(x, residual)
    _, rel = demo.output_error(out, ref)
    assert rel > demo.TOL


@pytest.mark.parametrize("method", sorted(TINY))
@pytest.mark.parametrize("T", [1, 3, 4, 16])
@pytest.mark.parametrize("tile", [1, 4, 16])
def test_permuted_experts_and_tail_match_torch_layer(method, T, tile):
    """The kerngen path with route and moe_tail replaced by their torch references (T*K below, at and above E)."""
    m, w, x, residual = case(method, T)
    E, K = m.num_experts, m.top_k
    ids, weights = routing.reference(x.float() @ w.router.T, K, m.routing, w.bias, m.n_group, m.topk_group,
                                     m.routed_scaling_factor, m.renormalize)
    p = pm.permute_reference(ids, E, tile)
    rows = demo.permuted_rows_bound(T, K, E, tile)
    assert int(p["num_permuted_rows"]) <= rows
    on_input = weights[:, 0] if m.weight_on_input else None
    g = demo.permuted_experts(x, p["permuted_to_token"], p["tile_to_expert"], w, tile, rows, on_input)
    tail_weights = torch.ones_like(weights) if m.weight_on_input else weights
    out, _ = tail.reference(g, p["expanded_to_permuted"], tail_weights, w.norm, eps=demo.EPS,
                            shared=demo.mlp(x, w.shared1, w.shared2), residual=residual)
    ref, _ = demo.torch_layer(m, w)(x, residual)
    _, rel = demo.output_error(out, ref)
    assert rel <= CPU_TOL


@pytest.mark.parametrize("E,K,tile", [(8, 2, 4), (896, 16, 16), (256, 8, 128), (5, 3, 7)])
def test_permuted_rows_bound_holds_and_is_reached(E, K, tile):
    from kerngen.ops.permute import max_rows
    g = torch.Generator().manual_seed(E)
    for T in (1, 2, 3, 8, 64, 300):
        bound = demo.permuted_rows_bound(T, K, E, tile)
        assert bound % tile == 0 and bound <= max_rows(T, K, E, tile)
        for _ in range(3):
            ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
            assert int(pm.permute_reference(ids, E, tile)["num_permuted_rows"]) <= bound
        if T * K <= E:   # one row for each of T*K experts: every one pads to a full tile
            ids = torch.arange(T * K, dtype=torch.int32).view(T, K)
            assert int(pm.permute_reference(ids, E, tile)["num_permuted_rows"]) == bound


def test_weight_on_output_would_be_wrong_for_a_weight_on_input_model():
    """Llama-4 wired as route -> experts -> weighted finalize differs from its own layer beyond the tolerance."""
    m, w, x, residual = case("top1_sigmoid", 8)
    wrong = Model("tiny-llama4", 8, 1, 64, "top1_sigmoid", (1, 64))          # router_weight = "output"
    ref, _ = loop_layer(m, w, x, residual)
    out, _ = demo.torch_layer(wrong, w)(x, residual)
    assert demo.output_error(out, ref)[1] > CPU_TOL


def test_schedule_option_and_its_table_columns():
    assert demo.parse_schedules("one") == ("one",) and demo.parse_schedules("three,one") == ("three", "one")
    for bad in ("two", "one,one", "one,", ""):
        with pytest.raises(ValueError, match="schedule"):
            demo.parse_schedules(bad)
    with pytest.raises(SystemExit):
        demo.main(["--schedule", "one,two"])   # refused before anything touches a GPU
    assert demo.header() == demo.HEADER and "3-stream" not in demo.HEADER
    both = demo.header(("one", "three"))
    row = dict(model="m", E=8, K=2, H=64, I=16, T=4, schedules=("one", "three"), kerngen_us=50.0, three_us=42.5,
               torch_us=100.0, compile_us=None, max_abs=1e-3, max_rel=1e-2, ids_equal=1.0, same_bits=True)
    cells = demo.markdown_row(row).split(" | ")
    names = both.split("\n")[0].split(" | ")
    assert len(cells) == len(names) == both.split("\n")[1].count("---")
    assert cells[names.index("3-stream saves µs")] == "7.5" and cells[names.index("vs torch")] == "2.00x"
    assert cells[-1] == "yes |"


# ---------------------------------------------------------------------------------------------- the latent layer

LATENT = Model("tiny-latent", 8, 2, 64, "sigmoid_bias", (1, 64), routed_scaling_factor=2.5, model_hidden=96)


def latent_loop_layer(m, w, x, residual):
    """The latent layer one token and one slot at a time: experts on x @ down.T (width L), the weighted sum and
    RMSNorm in L, then up to the model's width and the shared + residual add."""
    ids, weights = routing.reference(x.float() @ w.router.T, m.top_k, m.routing, w.bias, m.n_group, m.topk_group,
                                     m.routed_scaling_factor, m.renormalize)
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        xl = (w.down.float() @ x[t].float()).to(x.dtype)
        y = sum(weights[t, k] * expert(xl, w.w1[int(ids[t, k])], w.w2[int(ids[t, k])]) for k in range(m.top_k))
        n = (y * torch.rsqrt(y.pow(2).mean() + demo.EPS) * w.norm.float()).to(x.dtype)
        h = (w.up.float() @ n.float()).to(x.dtype).float()
        out[t] = (h + expert(x[t], w.shared1, w.shared2) + residual[t].float()).to(x.dtype)
    return out, ids


def latent_case(T, seed=0):
    w = demo.make_weights(LATENT, INTER, device="cpu", seed=seed)
    x, residual = demo.make_inputs(T, demo.model_width(LATENT), device="cpu", seed=seed + 1)
    return w, x, residual


@pytest.mark.parametrize("T", [1, 5, 16])
def test_latent_torch_layer_matches_per_token_loop(T):
    w, x, residual = latent_case(T)
    assert (w.down.shape, w.up.shape, w.norm.shape, w.router.shape) == ((64, 96), (96, 64), (64,), (8, 96))
    out, ids = demo.torch_layer(LATENT, w)(x, residual)
    ref, ref_ids = latent_loop_layer(LATENT, w, x, residual)
    assert out.shape == (T, 96) and demo.ids_agreement(ids, ref_ids) == 1.0
    assert demo.output_error(out, ref)[1] <= CPU_TOL
    w.up.neg_()   # the projection matters
    assert demo.output_error(demo.torch_layer(LATENT, w)(x, residual)[0], ref)[1] > demo.TOL


@pytest.mark.parametrize("T,tile", [(1, 4), (3, 16), (16, 4)])
def test_latent_permuted_experts_and_tail_match_torch_layer(T, tile):
    """The kerngen path of a latent layer with route, the experts and latent_tail replaced by torch references."""
    from kerngen.ops import latent_tail as lt
    w, x, residual = latent_case(T)
    ids, weights = routing.reference(x.float() @ w.router.T, LATENT.top_k, LATENT.routing, w.bias,
                                     routed_scaling_factor=LATENT.routed_scaling_factor)
    p = pm.permute_reference(ids, LATENT.num_experts, tile)
    rows = demo.permuted_rows_bound(T, LATENT.top_k, LATENT.num_experts, tile)
    g = demo.permuted_experts(demo.experts_input(x, w), p["permuted_to_token"], p["tile_to_expert"], w, tile, rows)
    out = lt.reference(g, p["expanded_to_permuted"], weights, w.norm, w.up, shared=demo.mlp(x, w.shared1, w.shared2),
                       residual=residual, eps=demo.EPS)
    ref, _ = demo.torch_layer(LATENT, w)(x, residual)
    assert demo.output_error(out, ref)[1] <= CPU_TOL
