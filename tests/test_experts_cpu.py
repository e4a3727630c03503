"""kerngen.experts without a GPU: its reference (what its CPU entry points run after its checks) against per-token
loops written from transformers' expert classes, the argument checks on both paths, the CPU rule (CUDA tensors only),
and every shipped model's experts kernels compiled for sm_90a."""
import pytest
import torch
import torch.nn.functional as F

import kerngen
from kerngen import jit, tiers
from kerngen.cache import DiskCache
from kerngen.ops import experts as ex
from kerngen.ops import permute as pm
from tests.helpers import assert_no_spills, experts_error, experts_on_cpu
from tests.test_dispatch import stub_gpu  # noqa: F401  (the kernels' path on CPU tensors, stub launchers)

ACTS = ("silu", "gelu", "gpt_oss", "situglu")


def routing_of(ids: torch.Tensor, E: int, tile: int, local=None) -> kerngen.Routing:
    return kerngen.Routing(ids, ids.new_empty((ids.shape[0], 0), dtype=torch.float32),
                           **pm.permute_reference(ids, E, tile, local))


def loop_expert(x, gate_up, down, b13, b2, act, interleaved, alpha=1.702, limit=7.0, beta=1.0, linear_beta=0.0):
    """One token through one expert, as transformers' classes write it (Qwen3MoeExperts / GptOssExperts / the
    SituGLU of Kimi), with the rounding points of kerngen.experts: fp32 GEMMs, the activation rounded to bf16."""
    h = F.linear(x.float(), gate_up.float(), None if b13 is None else b13.float())
    if interleaved:
        gate, up = h[..., ::2], h[..., 1::2]
    else:
        gate, up = h.chunk(2, dim=-1)
    if act == "silu":
        a = F.silu(gate) * up
    elif act == "gelu":
        a = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3))) * up
    elif act == "gpt_oss":
        gate = gate.clamp(min=None, max=limit)
        up = up.clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * alpha)
        a = (up + 1) * glu
    else:
        lin = linear_beta * torch.tanh(up / linear_beta) if linear_beta > 0 else up
        a = beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * lin
    y = F.linear(a.to(torch.bfloat16).float(), down.float(), None if b2 is None else b2.float())
    return y.to(torch.bfloat16)


def weights(E, H, I, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: (torch.randn(*s, generator=g) * 0.5).to(torch.bfloat16)  # noqa: E731
    w13, w2 = r(E, 2 * I, H) / H ** 0.25, r(E, H, I) / I ** 0.25
    return w13, w2, (r(E, 2 * I) if bias else None), (r(E, H) if bias else None)


CASES = [(act, inter, bias, inw) for act in ACTS for inter, bias, inw in
         ((False, False, False), (True, True, False), (False, True, True))]


@pytest.mark.parametrize("act,interleaved,bias,input_weight", CASES)
@pytest.mark.parametrize("tile", [1, 8])
def test_reference_matches_a_per_token_loop(act, interleaved, bias, input_weight, tile):
    T, K, E, H, I = 5, 3, 6, 64, 48
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)
    ids[0, :] = torch.tensor([0, 1, 2])     # expert 3.. may be empty; expert 0 has several rows
    ids[1, 0] = 0
    local = (1, 4)                           # expert parallelism: experts 1..4 here
    r = routing_of(ids, E, tile, local)
    w13, w2, b13, b2 = weights(4, H, I, bias)
    s = torch.rand(T, generator=g) if input_weight else None
    kw = dict(activation=act, interleaved=interleaved, b13=b13, b2=b2, input_weights=s, beta=1.5,
              linear_beta=2.0 if act == "situglu" else 0.0)
    out = experts_on_cpu(x, r, w13, w2, **kw)
    assert out.shape == (r.permuted_to_token.shape[0], H) and out.dtype == torch.bfloat16
    e2p = r.expanded_to_permuted
    seen = 0
    for t in range(T):
        xt = x[t] if s is None else (x[t].float() * s[t]).to(torch.bfloat16)
        for k in range(K):
            e = int(ids[t, k]) - local[0]
            if not 0 <= e < local[1]:
                assert e2p[t, k] == -1
                continue
            want = loop_expert(xt, w13[e], w2[e], None if b13 is None else b13[e], None if b2 is None else b2[e],
                               act, interleaved, beta=1.5, linear_beta=kw["linear_beta"])
            torch.testing.assert_close(out[e2p[t, k]].float(), want.float(), rtol=1e-2, atol=1e-2)
            seen += 1
    assert seen > 0
    pad = r.permuted_to_token < 0
    assert torch.all(out[pad] == 0)


def test_situglu_without_linear_beta_is_up():
    h = torch.randn(3, 16)
    got = ex.activate(h, 8, "situglu", False, beta=2.0, linear_beta=0.0)
    g, u = h[:, :8], h[:, 8:]
    torch.testing.assert_close(got, 2.0 * torch.tanh(g / 2.0) * torch.sigmoid(g) * u)


def test_tile_is_read_from_the_routing():
    ids = torch.tensor([[0, 2], [1, 2]], dtype=torch.int32)
    for tile in (1, 3, 8):
        assert ex.infer_tile(routing_of(ids, 4, tile)) == tile


def _args(**over):
    T, H, I, E = 2, 16, 8, 4
    ids = torch.tensor([[0, 1], [1, 3]], dtype=torch.int32)
    w13, w2, _, _ = weights(E, H, I, False)
    a = dict(x=torch.zeros(T, H, dtype=torch.bfloat16), routing=routing_of(ids, E, 2), w13=w13, w2=w2)
    a.update(over)
    return a


@pytest.mark.parametrize("over,arg", [
    (dict(x=torch.zeros(2, 16)), "x"),
    (dict(x=torch.zeros(3, 16, dtype=torch.bfloat16)), "routing"),
    (dict(w13=torch.zeros(3, 16, 16, dtype=torch.bfloat16)), "w13"),              # wrong E
    (dict(w13=torch.zeros(4, 16, 24, dtype=torch.bfloat16)), "w13"),              # wrong H
    (dict(w13=torch.zeros(4, 16, 16)), "w13"),                                    # dtype
    (dict(w2=torch.zeros(4, 16, 16, dtype=torch.bfloat16)), "w2"),                # wrong I
    (dict(w2=torch.zeros(4, 16, 8, dtype=torch.float16)), "w2"),
    (dict(activation="relu"), "activation"),
    (dict(interleaved=1), "interleaved"),
    (dict(b13=torch.zeros(4, 8, dtype=torch.bfloat16)), "b13"),
    (dict(b2=torch.zeros(4, 16)), "b2"),
    (dict(input_weights=torch.zeros(3)), "input_weights"),
    (dict(input_weights=torch.zeros(2, dtype=torch.int32)), "input_weights"),
    (dict(tile=0), "tile"),
    (dict(activation="gpt_oss", limit=-1.0), "limit"),
    (dict(activation="situglu", beta=0.0), "beta"),
    (dict(w13=torch.zeros(4, 16, 32, dtype=torch.bfloat16)[:, :, ::2]), "w13"),   # strided: neither layout
    (dict(w2=torch.zeros(4, 8, 16, dtype=torch.bfloat16).transpose(1, 2)), "w2"),   # transposed beside a contiguous w13
    (dict(w13=torch.zeros(4, 16, 16, dtype=torch.bfloat16).transpose(1, 2)), "w2"),  # transposed w13, contiguous w2
    (dict(w13=torch.zeros(4, 16, 16, dtype=torch.bfloat16, device="meta")), "w13"),   # not on x's device
])
def test_bad_inputs_name_the_argument(over, arg):
    """kerngen.experts and its CPU entry points' check raise the same InputError, before the device check."""
    assert experts_error(**_args(**over)).arg == arg


@pytest.mark.parametrize("over", [
    dict(out=torch.zeros(3, 16, dtype=torch.bfloat16)),
    dict(scratch=torch.zeros(64, 8)),                                # dtype
    dict(scratch=torch.zeros(64, 9, dtype=torch.bfloat16)),          # not [., I]
    dict(scratch=torch.zeros(1, 8, dtype=torch.bfloat16)),           # fewer rows than the routing's
    dict(scratch=torch.zeros(8, 64, dtype=torch.bfloat16).t()),      # not contiguous
])
def test_bad_buffers_name_the_argument(stub_gpu, over):
    """out= and scratch=, which only the kernels' path takes (CPU tensors standing in for CUDA ones)."""
    with pytest.raises(kerngen.InputError) as e:
        kerngen.experts(**_args(**over))
    assert e.value.arg == next(iter(over))


def test_a_cpu_tensor_is_the_kernel_ops_input_error():
    """The CPU rule of every op that launches kernels: a CPU tensor is an InputError naming it, saying a CUDA tensor
    is expected and where the CPU runs the same semantics, worded as finalize's."""
    with pytest.raises(kerngen.InputError) as e:
        kerngen.experts(**_args())
    assert e.value.arg == "x" and e.value.expected.startswith("a CUDA tensor")
    assert "torch.ops.kerngen.moe_experts" in str(e.value) and "kerngen.ops.experts.reference" in str(e.value)
    with pytest.raises(kerngen.InputError) as f:
        kerngen.finalize(torch.zeros(4, 16, dtype=torch.bfloat16), torch.zeros(2, 2, dtype=torch.int32),
                         torch.zeros(2, 2))
    rule = "a CUDA tensor (kerngen's kernels run on the GPU; on the CPU: "
    assert f.value.arg == "gemm2_out" and f.value.got == e.value.got == "a tensor on cpu"
    assert e.value.expected.startswith(rule) and f.value.expected.startswith(rule + "torch.ops.kerngen.finalize")
    assert ex.check(**_args(), cuda=False) == (2, 16, 8, "bf16", "nk")   # the CPU entry points' check passes


@pytest.mark.parametrize("over,arg", [
    (dict(x=torch.zeros(2, 16)), "x"),
    (dict(w13=torch.zeros(4, 16, 24, dtype=torch.bfloat16)), "w13"),
    (dict(w13=torch.zeros(4, 16, 16)), "w13"),
    (dict(w2=torch.zeros(4, 16, 16, dtype=torch.bfloat16)), "w2"),
    (dict(w13_scale=torch.ones(4, 1, 1)), "w13_scale"),
    (dict(b2=torch.zeros(4, 16)), "b2"),
    (dict(activation="relu"), "activation"),
    (dict(activation="gpt_oss", limit=-1.0), "limit"),
])
def test_the_torch_op_on_cpu_checks_as_kerngen_experts(over, arg):
    """torch.ops.kerngen.moe_experts on CPU tensors (the CPU entry point) raises kerngen.experts' InputError."""
    import kerngen.torch_ops  # noqa: F401   registers torch.ops.kerngen
    a = _args(**over)
    want = experts_error(**a)
    assert want.arg == arg
    ids, w = a["routing"].topk_ids, torch.rand(2, 2)
    op_args = {k: a.get(k) for k in ("b13", "b2", "w13_scale", "w2_scale")}
    op_args.update((k, a[k]) for k in ("limit",) if k in a)
    with pytest.raises(kerngen.InputError) as e:
        torch.ops.kerngen.moe_experts(a["x"], ids, w, a["w13"], a["w2"], a.get("activation", "silu"), **op_args)
    assert (e.value.op, e.value.arg, e.value.expected) == (want.op, want.arg, want.expected)


def _transposed(w: torch.Tensor) -> torch.Tensor:
    """The same values as a transposed view of a contiguous [E, K, N] tensor (transformers' gpt-oss / Llama-4)."""
    return w.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("act,interleaved,bias,input_weight", CASES)
def test_transposed_weights_give_the_same_rows(act, interleaved, bias, input_weight):
    """Weights stored [E, H, 2I] / [E, I, H] and passed as their transposes: the same values, the same rows."""
    T, E, K, H, I = 6, 4, 2, 32, 16
    ids = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:K] for t in range(T)]).int()
    w13, w2, b13, b2 = weights(E, H, I, bias)
    x = torch.randn(T, H).to(torch.bfloat16)
    kw = dict(activation=act, interleaved=interleaved, b13=b13, b2=b2,
              input_weights=torch.rand(T) if input_weight else None)
    r = routing_of(ids, E, 8)
    want = experts_on_cpu(x, r, w13, w2, **kw)
    got = experts_on_cpu(x, r, _transposed(w13), _transposed(w2), **kw)
    assert torch.equal(got, want)
    assert ex.weights_layout(_transposed(w13), _transposed(w2), "bf16") == "kn"
    assert ex.weights_layout(w13, w2, "bf16") == "nk"


def test_quantized_weights_must_be_contiguous():
    w = torch.zeros(4, 16, 16, dtype=torch.float8_e4m3fn)
    with pytest.raises(kerngen.InputError, match="checkpoint layout") as e:
        ex.weights_layout(w.transpose(1, 2), w.transpose(1, 2), "fp8")
    assert e.value.arg == "w13"


def test_transposed_builds_are_their_own_kernels():
    """A "kn" build has its own tag and the KN constant; an "nk" build's spec is what it always was."""
    nk, kn = (ex.spec(2880, 2880, 8, "gpt_oss", 1, "sm_90a", layout=lay) for lay in ("nk", "kn"))
    assert kn.tag == nk.tag + "-kn" and dict(kn.constants)["KN"] == 1 and "KN" not in dict(nk.constants)
    assert nk != kn
    m = tiers.load().model("gpt-oss-120b")
    layouts = {("KN" in dict(s.constants), dict(s.constants)["FORMAT"]) for s in ex.model_specs(m, tiers.load(),
                                                                                                  "sm_90a")}
    assert layouts == {(False, "bf16"), (True, "bf16"), (False, "mxfp4")}


def test_a_routing_without_permutation_is_refused():
    ids = torch.tensor([[0, 1]], dtype=torch.int32)
    no_tile = kerngen.Routing(ids, torch.zeros(1, 2))
    assert experts_error(**_args(x=torch.zeros(1, 16, dtype=torch.bfloat16), routing=no_tile)).arg == "routing"


def experts_specs():
    """Every shipped model's experts kernels (warmup's list: each rule and tile over its token range), and each
    activation (the code that changes) at one shape at the largest tile (the most registers)."""
    t = tiers.load()
    specs = []
    for m in t.models.values():
        specs += [s for s in ex.model_specs(m, t, "sm_90a") if s not in specs]
    for act in ex.ACTIVATIONS:
        s = ex.spec(2880, 2880, ex.MMA_MAX_TILE, act, 64, "sm_90a", t)
        if s not in specs:
            specs.append(s)
    return specs


def test_every_model_with_an_intermediate_size_has_experts_kernels():
    t = tiers.load()
    for m in t.models.values():
        assert bool(ex.model_specs(m, t, "sm_90a")) == bool(m.intermediate), m.name
    assert any(m.intermediate for m in t.models.values())


def test_experts_rules_exist():
    assert len(experts_specs()) >= len(tiers.load().models), "tiers.toml has no experts rule for the shipped shapes"


@pytest.mark.parametrize("spec", experts_specs(), ids=lambda s: s.tag)
def test_every_experts_rule_compiles_without_spills(spec, tmp_path):
    built = jit.build(spec, store=DiskCache(tmp_path))
    cubin = built.files["kernel.cubin"]
    assert built.status == "compiled" and cubin[:4] == b"\x7fELF"
    assert all(name.encode() in cubin for name in ex.gemm_kernels(spec))
    assert_no_spills(built.files)


def test_no_tokens_gives_the_empty_rows(stub_gpu):
    ids = torch.zeros((0, 2), dtype=torch.int32)
    w13, w2, _, _ = weights(4, 16, 8, False)
    args = (torch.zeros(0, 16, dtype=torch.bfloat16), routing_of(ids, 4, 2), w13, w2)
    assert experts_on_cpu(*args).shape == (4, 16)
    assert kerngen.experts(*args).shape == (4, 16) and not stub_gpu   # the kernels' path: nothing launched


def test_python_packing_matches_the_params_struct():
    from kerngen import render
    from tests.test_params_layout import check_layout
    t = tiers.load()
    if not any(r.op == "experts" for r in t.rules):
        pytest.skip("no experts rule in tiers.toml")
    check_layout("experts stream", render.render(ex.spec(2048, 768, 8, "silu", 1, "sm_90a", t)), ex.PARAMS)


def test_rules_marked_contiguous_only_leave_transposed_weights_to_grouped_mm():
    """The tile-16 rule has transposed = false: "kn" builds stop at 16 tokens, "nk" ones go on to 256."""
    t = tiers.load()
    assert any(r.op == "experts" and r.params.get("transposed") is False for r in t.rules)
    for T, served in ((1, True), (16, True), (17, False), (256, False)):
        assert (ex.tile_for(2880, 2880, "gpt_oss", T, -1, "bf16", "kn") is not None) == served, T
        assert ex.tile_for(2880, 2880, "gpt_oss", T, -1, "bf16", "nk") is not None, T
    with pytest.raises(kerngen.TierError, match="transposed = false"):
        ex.spec(2880, 2880, None, "gpt_oss", 64, "sm_90a", layout="kn")
    assert "transposed" not in dict(ex.spec(2880, 2880, None, "gpt_oss", 64, "sm_90a").params)


def test_tiles_of_32_where_an_experts_rows_fill_them():
    """The rule keyed on num_experts and top_k: top-k 8 of 128 experts (qwen3) at 192-256 tokens takes tiles of 32
    rows; fewer rows an expert (top-k 4, 256 experts), fewer tokens, or experts / top-k unknown keep tiles of 16.
    Warmup builds the tile-32 kernels for the models the rule serves, and `explain` names them."""
    for E, K, T, tile in ((128, 8, 256, 32), (128, 8, 224, 32), (128, 8, 192, 32), (128, 8, 191, 16), (128, 4, 256, 16),
                          (256, 8, 256, 16), (0, 0, 256, 16)):
        assert ex.tile_for(2048, 768, "silu", T, -1, experts=E, top_k=K) == tile, (E, K, T)
    t = tiers.load()
    tiles = lambda m: {ex.tile_of(s) for s in ex.model_specs(t.model(m), t, "sm_90a")}  # noqa: E731
    assert 32 in tiles("qwen3-30b-a3b") and 32 in tiles("qwen3-235b-a22b")
    assert 32 not in tiles("gpt-oss-120b") and 32 not in tiles("deepseek-v3")
    shape = dict(hidden=2048, tokens=256, intermediate=768)
    assert ex.tile_of(ex.explain_spec(t, "sm_90a", experts=128, top_k=8, **shape)) == 32
    assert ex.tile_of(ex.explain_spec(t, "sm_90a", experts=128, top_k=4, **shape)) == 16


def test_gemm1_blocks_and_gemm2_blocks_size_one_gemms_grid_each():
    """gemm1_blocks: experts_gemm1's CTAs an SM (its registers hold fewer than GEMM2's), GEMM2 keeps blocks_per_sm;
    gemm2_blocks the same for experts_gemm2; with one_launch (one kernel for both) either is a TierError."""
    rule = tiers.Rule("experts", "mma", {}, dict(tile=32, warps=4, unroll=2, blocks_per_sm=8, gemm1_blocks=5))
    launches = ex.Kernels.persistent(ex.rule_spec(rule, 2048, 768, "silu", "sm_90a"))
    assert launches["experts_gemm1"].per_sm == 5 and launches["experts_gemm2"].per_sm == 8
    rule = tiers.Rule("experts", "mma", {}, dict(tile=16, warps=4, unroll=2, blocks_per_sm=8, gemm2_blocks=6))
    launches = ex.Kernels.persistent(ex.rule_spec(rule, 2048, 768, "silu", "sm_90a"))
    assert launches["experts_gemm1"].per_sm == 8 and launches["experts_gemm2"].per_sm == 6
    for extra in (dict(gemm1_blocks=2), dict(gemm2_blocks=2)):
        one = tiers.Rule("experts", "mma", {}, dict(tile=8, warps=8, unroll=2, blocks_per_sm=4, one_launch=True,
                                                    **extra))
        with pytest.raises(kerngen.TierError, match="gemm2_blocks with one_launch"):
            ex.rule_spec(one, 2048, 768, "silu", "sm_90a")


@pytest.mark.parametrize("tile,mtiles,unroll", [(16, 2, 1), (16, 2, 2), (32, 2, 1), (8, 2, 2)])
def test_bf16_items_of_several_weight_tiles_compile_without_spills_and_size_the_grid(tile, mtiles, unroll, tmp_path,
                                                                                     monkeypatch):
    """mtiles on bf16 weights: an item's `mtiles` m16 tiles of weight rows share each activation load, so an item
    covers 8 mtiles intermediate / 16 mtiles output columns and the grids size from that; no spills."""
    from tests.test_experts_quantized_cpu import stub_launches
    H, I = 2048, 768
    rule = tiers.Rule("experts", "mma", {}, dict(tile=tile, warps=4, unroll=unroll, blocks_per_sm=4, pdl=True,
                                                 mtiles=mtiles))
    s = ex.rule_spec(rule, H, I, "silu", "sm_90a")
    assert_no_spills(jit.build(s, store=DiskCache(tmp_path)).files)
    stub_launches(monkeypatch)
    gemm1, gemm2 = ex.Kernels(s, -1).launchers(3)
    cap = 4 * tiers.SMS
    assert gemm1.grid[0] == min(3 * -(-I // (8 * mtiles)), cap) and gemm2.grid[0] == min(3 * -(-H // (16 * mtiles)), cap)


@pytest.mark.parametrize("fmt,layout,params,match", [("bf16", "kn", {}, "stored transposed"),
                                                    ("fp8", "nk", {}, "without f16x"),
                                                    ("mxfp4", "nk", {}, "without f16x")])
def test_mtiles_where_no_build_takes_it_is_a_tier_error(fmt, layout, params, match):
    rule = tiers.Rule("experts", "mma", {}, {**dict(tile=8, warps=4, unroll=1, mtiles=2), **params})
    with pytest.raises(kerngen.TierError, match=match):
        ex.rule_spec(rule, 2048, 768, "silu", "sm_90a", fmt, layout)
