"""kerngen.latent_tail without a GPU: the reference against an independent fp64 computation; the CPU rule of every
op (kerngen.latent_tail refuses CPU tensors, torch.ops.kerngen.latent_tail runs the reference after the same checks
and reads KERNGEN_STRICT); the argument checks, on both entry points; the tier rules, the fused kernel compiled for sm_90a without spills (kimi-k3's shapes and others; early_weights
builds issuing their first weight loads before the grid-dependency wait), its params struct against the Python
packing, the unfused host path, and the tensor-parallel form on two gloo ranks.
The kernel itself runs in tests/gpu/test_latent_tail.py."""
import pytest
import torch
import torch.distributed as dist

import kerngen
import kerngen.torch_ops  # noqa: F401  (registers torch.ops.kerngen.*)
from kerngen import jit, render, resources, tiers, warmup
from kerngen.errors import EnvError, TierError
from kerngen.cache import DiskCache
from kerngen.compile import nvrtc_compile
from kerngen.ops import _common
from kerngen.ops import finalize as fin
from kerngen.ops import latent_tail as lt
from kerngen.plan import spec_for
from tests.helpers import assert_no_spills, gloo_world

BF = torch.bfloat16


def make(T, K, L, H, *, rows=None, pad=0, skip=0.15, shared=True, residual=True, wdtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = T * K if rows is None else rows
    gemm2 = torch.randn(rows, L + pad, generator=g).to(BF)
    e2p = torch.randint(0, max(rows, 1), (T, K), generator=g, dtype=torch.int32)
    r = torch.rand(T, K, generator=g)
    e2p = torch.where(r < skip, -1, torch.where(r > 1 - skip / 2, rows + 3, e2p)).int().contiguous()  # -1, past end
    w = torch.rand(T, K, generator=g).to(wdtype)
    nw = (0.5 + torch.rand(L, generator=g)).to(BF)
    up = (torch.randn(H, L, generator=g) / L ** 0.5).to(BF)
    sh = torch.randn(T, H, generator=g).to(BF) if shared else None
    res = (3 * torch.randn(T, H, generator=g)).to(BF) if residual else None
    return gemm2, e2p, w, nw, up, sh, res


def fp64(gemm2, e2p, w, nw, up, sh, res, eps=1e-6):
    """The tail in fp64, written from the definition (n rounded to bf16 at the documented point)."""
    T, K = e2p.shape
    L = nw.shape[0]
    y = torch.zeros(T, L, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            i = int(e2p[t, k])
            if 0 <= i < gemm2.shape[0]:
                y[t] += float(w[t, k]) * gemm2[i, :L].double()
    n = y / torch.sqrt((y * y).mean(-1, keepdim=True) + eps) * nw.double()
    out = n.to(BF).double() @ up.double().T
    for extra in (sh, res):
        if extra is not None:
            out = out + extra.double()
    return out


def assert_close_to(got, want, what="", rel=1e-2):
    """Within one bf16 rounding of the result plus bf16 steps of n carried through the projection (`rel` of the
    row's RMS: 1e-2 for one rounding of n, 2e-2 where y and the projection are rounded too)."""
    scale = want.pow(2).mean(-1, keepdim=True).sqrt()
    err = (got.double() - want).abs()
    assert (err <= 2 ** -8 * want.abs() + rel * scale + 1e-6).all(), (what, err.max().item())


@pytest.mark.parametrize("T", [1, 5, 17])
@pytest.mark.parametrize("K", [1, 4, 16])
@pytest.mark.parametrize("L,H", [(64, 128), (256, 96)])
@pytest.mark.parametrize("shared,residual", [(True, True), (False, False), (True, False), (False, True)])
def test_reference_matches_fp64(T, K, L, H, shared, residual):
    args = make(T, K, L, H, pad=8 if L == 64 else 0, shared=shared, residual=residual, seed=T * K)
    got = lt.reference(*args[:5], shared=args[5], residual=args[6])
    assert got.shape == (T, H) and got.dtype == BF
    assert_close_to(got, fp64(*args), (T, K, L, H))
    assert torch.equal(torch.ops.kerngen.latent_tail(*args[:5], shared=args[5], residual=args[6]), got)


class _Reference:
    """A CPU stand-in for a launch object: the reference into `out` (the op's own checks and dispatch run)."""
    def __init__(self, s):
        self.spec = s

    def run(self, g, e2p, w, nw, up, shared, residual, eps, out, fresh=False):
        return out.copy_(lt.reference(g, e2p, w, nw, up, shared=shared, residual=residual, eps=eps))


@pytest.fixture
def cpu_kernels(monkeypatch):
    """kerngen.latent_tail on CPU tensors, its kernels stood in for by the reference."""
    monkeypatch.setattr(_common, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(lt, "kernel", lambda s, tokens, device, *a: _Reference(s))
    kerngen.clear()
    yield
    kerngen.clear()


def test_latent_sum_is_finalize_before_its_rounding():
    gemm2, e2p, w, *_ = make(6, 8, 128, 64, pad=16)
    y = lt.latent_sum(gemm2, e2p, w, 128)
    assert y.dtype == torch.float32 and torch.equal(y.to(BF), fin.reference(gemm2, e2p, w, 128))


def test_bf16_weights_eps_and_in_place_residual(cpu_kernels):
    gemm2, e2p, w, nw, up, sh, res = make(3, 4, 64, 64, wdtype=BF)
    want = lt.reference(gemm2, e2p, w, nw, up, shared=sh, residual=res, eps=1e-3)
    assert_close_to(want, fp64(gemm2, e2p, w, nw, up, sh, res, eps=1e-3))
    got = kerngen.latent_tail(gemm2, e2p, w, nw, up, shared=sh, residual=res, eps=1e-3, out=res)
    assert got is res and torch.equal(got, want)


def test_no_tokens_and_no_rows(cpu_kernels):
    gemm2, e2p, w, nw, up, *_ = make(0, 4, 64, 32)
    assert kerngen.latent_tail(gemm2, e2p, w, nw, up).shape == (0, 32)
    g0 = torch.zeros(0, 64, dtype=BF)
    e = torch.full((2, 3), -1, dtype=torch.int32)
    out = kerngen.latent_tail(g0, e, torch.rand(2, 3), nw, up, shared=torch.ones(2, 32, dtype=BF))
    assert torch.equal(out, torch.ones(2, 32, dtype=BF))   # y = 0: n = 0, out = shared
    assert torch.equal(torch.ops.kerngen.latent_tail(g0, e, torch.rand(2, 3), nw, up, shared=torch.ones(2, 32, dtype=BF)),
                       out)


# ---------------------------------------------------------------------------------------------- the CPU rule

def _finalize_error(g, e2p, w):
    with pytest.raises(kerngen.InputError) as e:
        kerngen.finalize(g, e2p, w)
    return e.value


def test_cpu_tensors_are_refused_as_finalize_refuses_them():
    """kerngen.latent_tail launches kernels: a CPU tensor is the InputError finalize raises, naming gemm2_out and
    the CPU entry points (before: the reference ran)."""
    a = _args()
    want = _finalize_error(a["gemm2_out"], a["expanded_to_permuted"], a["topk_weights"])
    for call in (lambda: kerngen.latent_tail(**a), lambda: kerngen.latent_tail(**a, out=torch.empty(2, 32, dtype=BF))):
        with pytest.raises(kerngen.InputError) as e:
            call()
        assert e.value.arg == want.arg == "gemm2_out" and str(e.value) == str(want).replace("finalize", "latent_tail")


def test_the_cpu_op_is_the_reference_and_traces():
    a = _args()
    got = torch.ops.kerngen.latent_tail(a["gemm2_out"], a["expanded_to_permuted"], a["topk_weights"],
                                        a["norm_weight"], a["up_proj"], 1e-5, a["shared"], a["residual"])
    assert torch.equal(got, lt.reference(*list(a.values())[:5], shared=a["shared"], residual=a["residual"], eps=1e-5))
    torch.library.opcheck(torch.ops.kerngen.latent_tail.default, tuple(list(a.values())[:5]),
                          {"shared": a["shared"], "residual": a["residual"]})


def test_the_cpu_op_reads_kerngen_strict(monkeypatch):
    """A bad KERNGEN_STRICT is an EnvError on every call of the CPU op, as at a shape's first dispatch on a GPU."""
    a = list(_args().values())[:5]
    monkeypatch.setenv("KERNGEN_STRICT", "maybe")
    with pytest.raises(EnvError, match="KERNGEN_STRICT"):
        torch.ops.kerngen.latent_tail(*a)
    monkeypatch.setenv("KERNGEN_STRICT", "1")   # strict: a cache miss raises on a GPU; the reference builds nothing
    assert torch.ops.kerngen.latent_tail(*a).shape == (2, 32)


def _offset(t: torch.Tensor, elements: int = 4) -> torch.Tensor:
    """t's values at an address `elements` bf16 past a 16-byte boundary, same shape and strides."""
    flat = torch.zeros(t.numel() + 64, dtype=t.dtype)
    v = flat[elements:elements + t.numel()].view(t.shape)
    v.copy_(t)
    return v


def _misaligned():
    gemm2, *_ = make(2, 4, 64, 32)
    base = torch.zeros(gemm2.shape[0], 72, dtype=BF)
    return [(dict(gemm2_out=base[:, 4:68]), "gemm2_out"), (dict(norm_weight=_offset(torch.ones(64, dtype=BF))), "norm_weight"),
            (dict(up_proj=_offset(torch.randn(32, 64).to(BF))), "up_proj")]


def _args(**over):
    gemm2, e2p, w, nw, up, sh, res = make(2, 4, 64, 32)
    a = dict(gemm2_out=gemm2, expanded_to_permuted=e2p, topk_weights=w, norm_weight=nw, up_proj=up, shared=sh,
             residual=res)
    a.update(over)
    return a


@pytest.mark.parametrize("over,arg", [
    (dict(gemm2_out=torch.zeros(8, 64)), "gemm2_out"),
    (dict(gemm2_out=torch.zeros(8, 64, dtype=torch.float16)), "gemm2_out"),
    (dict(gemm2_out=[1, 2]), "gemm2_out"),
    (dict(gemm2_out=torch.zeros(64, 8, dtype=BF).t()), "gemm2_out"),            # last dim not contiguous
    (dict(expanded_to_permuted=torch.zeros(2, 4, dtype=torch.int64)), "expanded_to_permuted"),
    (dict(expanded_to_permuted=torch.zeros(2, 65, dtype=torch.int32), topk_weights=torch.rand(2, 65)),
     "expanded_to_permuted"),                                                   # K > 64
    (dict(topk_weights=torch.rand(2, 3)), "topk_weights"),
    (dict(topk_weights=torch.rand(2, 4).half()), "topk_weights"),
    (dict(norm_weight=torch.ones(60, dtype=BF)), "norm_weight"),                 # L not a multiple of 8
    (dict(norm_weight=torch.ones(72, dtype=BF)), "norm_weight"),                 # L wider than gemm2_out
    (dict(norm_weight=torch.ones(64)), "norm_weight"),
    (dict(norm_weight=torch.ones(56, dtype=BF)), "norm_weight"),                 # shorter than up_proj and gemm2_out
    (dict(up_proj=torch.zeros(32, 56, dtype=BF)), "up_proj"),                   # narrower than norm_weight
    (dict(up_proj=torch.zeros(32, 72, dtype=BF)), "up_proj"),                   # not [H, L]
    (dict(up_proj=torch.zeros(36, 64, dtype=BF), shared=None, residual=None), "up_proj"),   # H not a multiple of 8
    (dict(up_proj=torch.zeros(32, 64, dtype=torch.float16)), "up_proj"),
    (dict(up_proj=torch.zeros(64, 32, dtype=BF).t()), "up_proj"),                # not contiguous
    (dict(shared=torch.zeros(2, 40, dtype=BF)), "shared"),
    (dict(shared=torch.zeros(2, 32)), "shared"),
    (dict(residual=torch.zeros(3, 32, dtype=BF)), "residual"),
    (dict(out=torch.zeros(2, 40, dtype=BF)), "out"),
    (dict(out=torch.zeros(2, 32)), "out"),
    (dict(eps="1e-6"), "eps"),
    (dict(eps=-1.0), "eps"),
])
def test_bad_inputs_name_the_argument(over, arg, cpu_kernels):
    """The same InputError from the op (its CUDA path, kernels stood in for) and from the CPU op."""
    with pytest.raises(kerngen.InputError) as e:
        kerngen.latent_tail(**_args(**over))
    assert e.value.arg == arg and e.value.op == "latent_tail"
    if "out" in over or not all(isinstance(v, (torch.Tensor, float)) for v in over.values()):
        return   # the torch op has no out=; torch's dispatcher itself refuses other types
    a = _args(**over)
    with pytest.raises(kerngen.InputError) as cpu:
        torch.ops.kerngen.latent_tail(*(a.pop(k) for k in list(a)[:5]), a.pop("eps", 1e-6), **a)
    assert (cpu.value.arg, cpu.value.op, str(cpu.value)) == (arg, "latent_tail", str(e.value))


@pytest.mark.parametrize("case", range(3), ids=["gemm2_out", "norm_weight", "up_proj"])
def test_misaligned_inputs_are_refused_on_both_devices(case, cpu_kernels):
    """16-byte alignment is checked before the reference too (before: on CUDA only)."""
    over, arg = _misaligned()[case]
    a = _args(**over)
    for call in (lambda: kerngen.latent_tail(**a),
                 lambda: torch.ops.kerngen.latent_tail(*list(a.values())[:5], 1e-6, a["shared"], a["residual"])):
        with pytest.raises(kerngen.InputError, match="16-byte aligned") as e:
            call()
        assert e.value.arg == arg


def test_a_wrong_argument_after_a_good_call_is_still_named(cpu_kernels):
    a = _args()
    kerngen.latent_tail(**a)
    with pytest.raises(kerngen.InputError) as e:
        kerngen.latent_tail(**{**a, "shared": a["shared"][:, :16].contiguous()})
    assert e.value.arg == "shared"
    kerngen.latent_tail(**a)
    with pytest.raises(kerngen.InputError) as e:
        kerngen.latent_tail(**{**a, "eps": float("inf")})
    assert e.value.arg == "eps"


def test_a_group_without_torch_distributed_is_rejected():
    assert not dist.is_initialized()
    with pytest.raises(kerngen.InputError) as e:
        kerngen.latent_tail(**_args(), group=object())
    assert e.value.arg == "group"


# ---------------------------------------------------------------------------------------------- tiers, warmup

def test_kimi_k3_is_latent_and_its_rules_pick_split_fused_then_norm_gemm():
    t = tiers.load()
    m = t.model("kimi-k3")
    assert (m.hidden, m.model_hidden) == (3584, 7168)
    assert all(not o.model_hidden for name, o in t.models.items() if name != "kimi-k3")
    for T, variant, mt in ((1, "fused", 8), (8, "fused", 8), (9, "fused", 16), (16, "fused", 16),
                           (17, "norm_gemm", 0), (8192, "norm_gemm", 0), (8193, "unfused", 0)):
        s = lt.spec(m.hidden, m.model_hidden, m.top_k, m.weights_dtype, T, "sm_90a", t)
        assert s.variant == variant and dict(s.params).get("max_tokens", 0) == mt, T
    specs = lt.model_specs(m, t, "sm_90a")
    assert [s.variant for s in specs] == ["fused"] * 2 + ["norm_gemm"] * 5 and lt.split(specs[0])
    assert lt.split(specs[1]) and dict(specs[1].params)["max_tokens"] == 16
    assert [dict(s.params)["cluster"] for s in specs[2:]] == [4, 2, 1, 1, 1]   # fewer CTAs a token as T grows
    # fewer rows loaded at once as T grows (the norm CTAs fit one wave: 2 CTAs an SM to 264 tokens, 4 beyond)
    assert [dict(s.params).get("norm_loads", 16) for s in specs[2:]] == [16, 16, 16, 8, 2]
    assert set(specs) <= set(warmup.model_specs(m, t, "sm_90a"))
    assert not lt.model_specs(t.model("deepseek-v3"), t, "sm_90a")


def test_explain_names_the_fused_kernel_and_says_when_there_is_none():
    t = tiers.load()
    s = lt.explain_spec(t, "sm_90a", hidden=3584, top_k=16, tokens=4, model="kimi-k3")
    assert dict(s.constants)["H"] == 7168 and s.variant == "fused"
    assert lt.explain_spec(t, "sm_90a", hidden=3584, top_k=16, tokens=64, model="kimi-k3").variant == "norm_gemm"
    with pytest.raises(kerngen.InputError, match="unfused"):
        lt.explain_spec(t, "sm_90a", hidden=9000, top_k=16, tokens=64)


def test_the_dispatch_buckets(monkeypatch):
    d = lt.dispatch(-1, L=3584, H=7168, top_k=16, weights_dtype="float32")
    assert d.starts == [1, 9, 17, 25, 49, 133, 265, 8193]
    assert [s.variant for s in d.specs] == ["fused"] * 2 + ["norm_gemm"] * 5 + ["unfused"]


@pytest.mark.parametrize("text, needle", [
    ("[models.m]\nnum_experts = 8\ntop_k = 2\nhidden = 64\nmodel_hidden = 100\nrouting = 'softmax_topk'\n"
     "tokens = [1, 8]\n", "field 'model_hidden' must be a multiple of 8"),
    ("[[tier]]\nop = 'latent_tail'\nvariant = 'unfused'\nparams = { warps = 4 }\n",
     "unknown param 'warps' of latent_tail variant 'unfused'"),
    ("[[tier]]\nop = 'latent_tail'\nvariant = 'tiled'\n", "unknown variant 'tiled' of latent_tail for backend 'nvrtc'"),
    ("[[tier]]\nop = 'latent_tail'\nvariant = 'fused'\nparams = { max_tokens = 8, warps = 8, unroll = 2, split = 1 }\n",
     "param 'split' of latent_tail variant 'fused' must be true or false"),
    ("[[tier]]\nop = 'latent_tail'\nvariant = 'fused'\n"
     "params = { max_tokens = 33, warps = 8, unroll = 2, split = true }\n",
     "param 'max_tokens' of latent_tail variant 'fused' must be an integer in [1, 32]"),
    ("[[tier]]\nop = 'latent_tail'\nvariant = 'fused'\nparams = { max_tokens = 17, warps = 8, unroll = 2 }\n",
     "param 'max_tokens' must be at most 16 without split = true (split builds: 32), got 17"),
    ("[[tier]]\nop = 'latent_tail'\nvariant = 'fused'\nparams = { max_tokens = 8, warps = 8 }\n",
     "missing param 'unroll'"),
])
def test_bad_rules_are_named(tmp_path, text, needle):
    p = tmp_path / "t.toml"
    p.write_text("schema = 1\n" + text)
    with pytest.raises(kerngen.TierError) as e:
        tiers.parse(p)
    assert needle in str(e.value)


def test_variants_list_the_template_and_the_host_path():
    assert tiers.variants("latent_tail") == ["fused", "norm_gemm", "unfused"]


# ---------------------------------------------------------------------------------------------- the fused kernel

def fused(L, H, K, wdtype="float32", **params):
    p = {"max_tokens": 16, "warps": 16, "unroll": 2, "cluster": 8, "blocks_per_sm": 1, "pdl": True, **params}
    return spec_for(tiers.Rule("latent_tail", "fused", {}, p), *lt.tag_constants(L, H, K, wdtype), "sm_90a")


SPLIT_ONLY = ("split",) + lt.SPLIT_ONLY   # params only split builds take


def with_params(s, params):
    return spec_for(tiers.Rule("latent_tail", "fused", {}, params), s.tag, dict(s.constants), s.arch)


def fused_specs():
    """kimi-k3's up to 8 tokens (warmup's list; its 9-16-token split rule at 2 steps a batch spills as one launch),
    a square deepseek-width projection at 8 tokens, and odd widths: L not a multiple of 64 (a partial last k step)
    nor of 8 * cluster, H not of 16, plain CTAs, K = 64, bf16 weights."""
    t = tiers.load()
    specs = [with_params(s, {k: v for k, v in s.params if k not in ("early_weights",) + SPLIT_ONLY})   # one launch
             for s in lt.model_specs(t.model("kimi-k3"), t, "sm_90a")
             if s.variant == "fused" and dict(s.params)["max_tokens"] <= 8]
    specs += [fused(7168, 7168, 8, max_tokens=8), fused(2048, 4096, 10, "bfloat16", warps=8, unroll=4, cluster=4),
              fused(1000, 1224, 64, max_tokens=4, warps=8, cluster=1, pdl=False), fused(136, 8, 1, max_tokens=1,
                                                                                       warps=1, unroll=1, cluster=2)]
    return specs


@pytest.mark.parametrize("spec", fused_specs(), ids=lambda s: f"{s.tag}-{dict(s.params)['max_tokens']}")
def test_the_fused_kernel_compiles_without_spills(spec, tmp_path):
    lt.launch_shape(spec, -1)   # the params fit the template's limits
    built = jit.build(spec, store=DiskCache(tmp_path))
    cubin = built.files["kernel.cubin"]
    assert built.status == "compiled" and cubin[:4] == b"\x7fELF" and b"latent_tail_fused" in cubin
    assert_no_spills(built.files)


def early_specs():
    """One-launch builds with early_weights: kimi-k3's rules that are not split (a split rule's early loads are
    test_split_builds_compile_without_spills_and_wait_where_they_should's), kimi-k3's launch shape at 2 steps a
    batch, the other shapes of fused_specs, and the tier rules at L = 136, H = 8 (the warps load every step of a row
    early, nothing is left to the L2 prefetch; CTAs of a cluster without an item)."""
    t = tiers.load()
    kimi = [s for s in lt.model_specs(t.model("kimi-k3"), t, "sm_90a") if s.variant == "fused"]
    rules = [lt.spec(136, 8, 2, "float32", T, "sm_90a") for T in (1, 8)]
    shapes = [s for s in kimi if not lt.split(s)] + [fused(3584, 7168, 16, max_tokens=8, warps=8, unroll=2,
                                                           blocks_per_sm=2)] + fused_specs()[len(kimi):] + rules
    return [with_params(s, {**{k: v for k, v in s.params if k not in SPLIT_ONLY}, "early_weights": True})
            for s in shapes]


@pytest.mark.parametrize("spec", early_specs(), ids=lambda s: f"{s.tag}-{dict(s.params)['max_tokens']}")
def test_early_weights_load_the_first_steps_before_the_wait(spec, tmp_path):
    """Each warp's first UNROLL steps of its 16 weight rows (two 16-byte streaming loads a row a step) are issued
    before ACQBULK (griddepcontrol.wait), in registers (no spills), with no compiler warning; the build without the
    param issues none there."""
    lt.launch_shape(spec, -1)
    p = dict(spec.params)
    cubin, log = nvrtc_compile(render.render(spec), "latent_tail_fused", spec.arch, "early", None)
    assert not log, log
    without = jit.build(with_params(spec, {k: v for k, v in p.items() if k != "early_weights"}),
                        store=DiskCache(tmp_path)).files
    for files, early in (({"kernel.cubin": cubin}, 4 * p["unroll"]), (without, 0)):
        assert_no_spills(files)
        ops = resources.opcodes(files)
        assert ops[:ops.index("ACQBULK")].count("LDG.E.EF.128") == early


def test_early_weights_false_renders_the_rules_source():
    assert render.render(fused(3584, 7168, 16, early_weights=False)) == render.render(fused(3584, 7168, 16))


def test_python_packing_matches_the_params_struct():
    from tests.test_params_layout import check_layout
    assert lt.PARAMS.format == "8Q3if" and lt.PARAMS.size == 80
    for s in (fused(3584, 7168, 16), fused(64, 64, 2, "bfloat16", cluster=1, warps=2)):
        check_layout(f"latent_tail {s.tag}", render.render(s), lt.PARAMS)


def test_launch_shape():
    s = fused(3584, 7168, 16)
    grid, block, smem = lt.launch_shape(s, -1)
    assert grid == (128, 1, 1) and block == (512, 1, 1) and smem == 16 * 3592 * 2   # 448 items, 132 SMs, cluster 8
    assert lt.launch_shape(fused(64, 16, 2, cluster=8), -1)[0] == (8, 1, 1)         # one item: still a cluster
    with pytest.raises(kerngen.InputError, match="token, vector"):
        lt.launch_shape(fused(3584, 7168, 16, cluster=1, warps=4), -1)
    with pytest.raises(kerngen.InputError, match="shared memory"):
        lt.launch_shape(fused(8192, 7168, 16), -1)
    with pytest.raises(kerngen.InputError, match="max_tokens >= 12"):
        lt.kernel(fused(3584, 7168, 16, max_tokens=8), 12, -1)


# ---------------------------------------------------------------------------------------------- split builds

# A user tier file sending kimi-k3's first 16 token counts to split builds: the shipped 1-8 rule's launch shape and, for
# 9-16 (norm_gemm's in the shipped table), the 16-token shape the fused rule had there.
SPLIT_TIERS = """schema = 1

[[tier]]
op = "latent_tail"
variant = "fused"
tokens = [1, 8]
hidden = [8, 8192]
params = { max_tokens = 8, warps = 8, unroll = 2, cluster = 8, blocks_per_sm = 2, pdl = true, split = true }

[[tier]]
op = "latent_tail"
variant = "fused"
tokens = [9, 16]
hidden = [8, 4096]
params = { max_tokens = 16, warps = 16, unroll = 2, cluster = 8, blocks_per_sm = 1, pdl = true, split = true }
"""


def split_specs():
    """kimi-k3's rules, the other shapes of fused_specs and their early_weights builds, with split = true."""
    return [with_params(s, {**dict(s.params), "split": True}) for s in fused_specs() + early_specs()]


def _split_id(s):
    p = dict(s.params)
    return f"{s.tag}-{p['max_tokens']}" + ("-early" if p.get("early_weights") else "")


@pytest.mark.parametrize("spec", split_specs(), ids=_split_id)
def test_split_builds_compile_without_spills_and_wait_where_they_should(spec):
    """Both kernels, no spills, no compiler warning; the norm kernel lets its dependent launch (PREEXIT) and loads
    its norm weights before it waits (ACQBULK), nothing else; the projection issues its first item's weight loads (L2
    prefetches, and with early_weights its first UNROLL steps, two 16-byte streaming loads a row a step) before its
    wait, and no other load."""
    launches = lt.persistent(spec)
    assert sorted(launches) == [lt.NORM, lt.PROJ] and lt.launch_shape(spec, -1)
    cubin, log = nvrtc_compile(render.render(spec), "latent_tail_split", spec.arch, "split", None)
    assert not log, log
    files = {"kernel.cubin": cubin}
    assert_no_spills(files)
    assert sorted(f for f, _ in resources.usage(files)) == sorted(launches)
    sass = resources.sass(files)
    p = dict(spec.params)
    for part in sass.split("Function : ")[1:]:
        name = part.split()[0]
        ops = _opcodes(part)
        before = ops[:ops.index("ACQBULK")]
        if name == lt.NORM:   # its one load before the wait: its norm weights (constant, as up_proj)
            assert "PREEXIT" in before
            assert [o for o in before if o.startswith(("LDG", "LDS", "STG", "STS"))] == ["LDG.E.128.STRONG.SM"]
        else:
            assert "PREEXIT" not in before and "CCTL.E.PF2" in before
            loads = [o for o in before if o.startswith(("LDG", "LDS", "LD."))]
            assert loads == ["LDG.E.EF.128"] * (4 * p["unroll"] if p.get("early_weights") else 0), loads


def _opcodes(sass: str) -> list[str]:
    import re
    return [m.group(1) for line in sass.splitlines()
            for m in [re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][\w.]*)", line)] if m]


def test_split_builds_of_kimi_k3_fit_their_blocks_per_sm(tmp_path):
    """The registers and shared memory of the built projection let an SM hold the rule's blocks_per_sm."""
    t = tiers.load()
    for s in [s for s in lt.model_specs(t.model("kimi-k3"), t, "sm_90a") if s.variant == "fused"]:
        s = with_params(s, {**dict(s.params), "split": True})
        rows = warmup.usage(s, jit.build(s, store=DiskCache(tmp_path)).files)
        proj = next(u for u in rows if u.function == lt.PROJ)
        assert proj.stack == 0 and proj.resident >= proj.per_sm == dict(s.params)["blocks_per_sm"], proj


def test_split_false_renders_the_fused_source():
    assert render.render(fused(3584, 7168, 16, split=False)) == render.render(fused(3584, 7168, 16))
    assert "latent_tail_norm(" not in render.render(fused(3584, 7168, 16))


def test_python_packing_matches_the_split_params_struct():
    from tests.test_params_layout import check_layout
    assert lt.PARAMS_SPLIT.format == "8Q3ifQ" and lt.PARAMS_SPLIT.size == 88
    for s in (fused(3584, 7168, 16, split=True), fused(64, 64, 2, "bfloat16", cluster=1, warps=2, split=True)):
        check_layout(f"latent_tail split {s.tag}", render.render(s), lt.PARAMS_SPLIT)


def test_split_launch_shapes(monkeypatch):
    """The projection: a persistent grid of plain CTAs (blocks_per_sm an SM, capped at what an SM holds and at the
    items, not rounded to clusters); the norm kernel: a cluster of `cluster` CTAs a token, a thread a vector."""
    s = fused(3584, 7168, 16, max_tokens=8, warps=8, blocks_per_sm=2, split=True)
    assert lt.launch_shape(s, -1) == ((264, 1, 1), (256, 1, 1), 8 * 3592 * 2)
    assert lt.norm_shape(s, 5) == ((40, 1, 1), (64, 1, 1))                  # 448 vectors / 8 CTAs: 56 -> 64 threads
    assert lt.norm_shape(fused(1000, 1224, 4, cluster=1, split=True), 3) == ((3, 1, 1), (128, 1, 1))   # 125 vectors
    assert lt.launch_shape(fused(64, 16, 2, cluster=8, split=True), -1)[0] == (1, 1, 1)   # one item, one CTA
    monkeypatch.setattr(lt, "resolve", lambda spec: _Module())
    monkeypatch.setattr(_common, "sm_count", lambda dev: 132)
    for fits, grid in ((3, 264), (2, 264), (1, 132)):
        monkeypatch.setattr(_common, "resident", lambda fn, threads, smem, n=fits: n if fn == lt.PROJ else 0)
        assert lt.launch_shape(s, 0)[0] == (grid, 1, 1), fits
    with pytest.raises(kerngen.InputError, match="L / 8 / cluster"):
        lt.persistent(fused(8200, 64, 2, max_tokens=1, cluster=1, split=True))
    with pytest.raises(kerngen.InputError, match="shared memory"):
        lt.persistent(fused(8192, 64, 2, max_tokens=16, split=True))


class _Module:
    def function(self, name, device):
        return name


class _Launcher:
    """Records each launch: (function, grid, block, smem, pdl, fields)."""
    log: list = []

    def __init__(self, module, name, device, grid, block, params, smem=0, pdl=False):
        self.name, self.grid, self.block, self.smem, self.pdl, self.params = name, grid, block, smem, pdl, params

    def __call__(self, stream, *fields):
        assert len(fields) == len(self.params.names)
        _Launcher.log.append((self.name, self.grid, self.block, self.smem, self.pdl, dict(zip(self.params.names, fields))))


def test_the_dispatch_takes_split_builds_when_the_tiers_ask(tmp_path, monkeypatch):
    """A tier file with split = true: kerngen.latent_tail runs the norm kernel then the projection (both with PDL) on
    the same fields, n in one scratch buffer of the stream [max_tokens, L] bf16 shared by the shape's split builds;
    the shipped rule up to 8 tokens is a split build too."""
    assert all(lt.split(lt.spec(3584, 7168, 16, "float32", T, "sm_90a")) for T in (1, 8))
    user = tmp_path / "split.toml"
    user.write_text(SPLIT_TIERS)
    monkeypatch.setenv("KERNGEN_TIERS", str(user))
    tiers.reload()
    monkeypatch.setattr(_common, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(lt, "resolve", lambda spec: _Module())
    monkeypatch.setattr(lt, "Launcher", _Launcher)
    monkeypatch.setattr(lt, "current_stream", lambda dev: 7)
    _Launcher.log = []
    try:
        d = lt.dispatch(-1, L=256, H=512, top_k=4, weights_dtype="float32")
        assert [(s.variant, dict(s.params).get("split")) for s in d.specs] == [("fused", True), ("fused", True)] + [
            ("norm_gemm", None)] * 5 + [("unfused", None)]
        scratch = []
        for T in (1, 5, 9, 5):
            gemm2, e2p, w, nw, up, sh, res = make(T, 4, 256, 512, seed=T)
            out = torch.empty(T, 512, dtype=BF)
            assert kerngen.latent_tail(gemm2, e2p, w, nw, up, shared=sh, residual=res, out=out) is out
            assert type(d.kernel(T)) is lt.Split
            (n1, g1, b1, m1, p1, f1), (n2, g2, b2, m2, p2, f2) = _Launcher.log[-2:]
            assert (n1, n2, p1, p2, f1) == (lt.NORM, lt.PROJ, True, True, f2)
            assert g1 == (T * 8, 1, 1) and b1 == (32, 1, 1) and m1 == 0                 # 32 vectors a row: 4 a CTA
            assert g2 == (32, 1, 1) and m2 == (8 if T <= 8 else 16) * 264 * 2         # 512 / 16 items < 264 CTAs
            assert f1["tokens"] == T and f1["out"] == out.data_ptr() and f1["residual"] == res.data_ptr()
            scratch.append(f1["n"])
        buf = d.kernel(1)._scratch[7]
        assert buf.shape == (16, 256) and buf.dtype == BF and scratch[-1] == buf.data_ptr()
        assert scratch[0] != scratch[2] and scratch[2] == scratch[3]   # grown once to the 16-token rule's rows
        gemm2, e2p, w, nw, up, sh, res = make(5, 4, 256, 512, seed=5)
        kerngen.latent_tail(gemm2, e2p, w, nw, up, shared=sh, residual=res, own_scratch=True)
        assert _Launcher.log[-2][5]["n"] != buf.data_ptr()   # this call's own n (the torch op's)
    finally:
        monkeypatch.delenv("KERNGEN_TIERS")
        tiers.reload()


# ---------------------------------------------------------------------------------------------- the unfused path

def _finalize_reference(g, e2p, w, *, hidden=None, out=None):
    r = fin.reference(g, e2p, w, hidden)
    return r if out is None else out.copy_(r)


def test_the_unfused_variant_is_finalize_and_torch(monkeypatch):
    """Latents wider than the norm kernel's 8192 dispatch to the unfused variant: finalize (its reference standing in
    for the kernel) + torch."""
    monkeypatch.setattr(_common, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(lt, "finalize", _finalize_reference)
    kerngen.clear()
    try:
        args = make(20, 16, 8200, 16, seed=3)
        got = kerngen.latent_tail(*args[:5], shared=args[5], residual=args[6])
        assert type(lt.dispatch(-1, L=8200, H=16, top_k=16, weights_dtype="float32").kernel(20)) is lt.Unfused
        assert_close_to(got, fp64(*args), "unfused", rel=2e-2)
        plain = kerngen.latent_tail(*args[:5])   # no adds: the matmul's own bf16 output
        assert_close_to(plain, fp64(*args[:5], None, None), "unfused, no adds", rel=2e-2)
    finally:
        kerngen.clear()


# ---------------------------------------------------------------------------------------------- tensor parallel

WORLD, TT, KK, LL, HH = 2, 5, 4, 128, 96


def rank_inputs(rank):
    gemm2, e2p, w, *_ = make(TT, KK, LL, HH, seed=10 + rank)
    return gemm2, e2p, w


def common_inputs():
    _, _, _, nw, up, sh, res = make(TT, KK, LL, HH, seed=99)
    return nw, up, sh, res


def single_expected():
    """The single-process tail over every rank's rows at once (what the TP form must give)."""
    parts = [rank_inputs(r) for r in range(WORLD)]
    nw, up, sh, res = common_inputs()
    gemm2 = torch.cat([p[0] for p in parts])
    e2p = torch.cat([torch.where((p[1] >= 0) & (p[1] < TT * KK), p[1] + r * TT * KK, -1)
                     for r, p in enumerate(parts)], dim=1).int()
    w = torch.cat([p[2] for p in parts], dim=1)
    return lt.reference(gemm2, e2p, w, nw, up, shared=sh, residual=res)


def _tp_worker(rank, init, results):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        gemm2, e2p, w = rank_inputs(rank)
        nw, up, sh, res = common_inputs()
        try:   # CPU tensors: refused as by finalize (moe_tail's group= path refuses them too)
            kerngen.latent_tail(gemm2, e2p, w, nw, up, shared=sh, residual=res, group=dist.group.WORLD)
            refused = None
        except kerngen.InputError as e:
            refused = e.arg
        # the GPU orchestration, with references for the kernels: finalize's bf16 partial, the fp32 sum rounded
        # to bf16 and fed back with K = 1
        _common.KERNEL_DEVICES = ("cuda", "cpu")
        lt.finalize = _finalize_reference
        seen = []
        whole = lt.latent_tail

        def local(g, e, ww, n, u, **kw):
            seen.append((tuple(g.shape), g.dtype, e.flatten().tolist(), ww.flatten().tolist()))
            return kw["out"].copy_(lt.reference(g, e, ww, n, u, shared=kw["shared"], residual=kw["residual"]))

        lt.latent_tail = local
        out = torch.empty(TT, HH, dtype=BF)
        kernel_path = whole(gemm2, e2p, w, nw, up, shared=sh, residual=res, out=out, group=dist.group.WORLD)
        lt.latent_tail = whole
        errors = []
        for kw, name in ((dict(group="not a group"), "group"), (dict(group=dist.group.WORLD, shared=sh[:, :8]), "shared"),
                         (dict(group=dist.group.WORLD, out=torch.empty(TT, 8, dtype=BF)), "out")):
            try:
                kerngen.latent_tail(gemm2, e2p, w, nw, up, **kw)
            except kerngen.InputError as e:
                errors.append(e.arg == name)
        _common.KERNEL_DEVICES = ("cuda",)
        results[rank] = (refused, kernel_path is out, kernel_path, seen, errors)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return gloo_world(_tp_worker, tmp_path_factory.mktemp("latent-tp"), WORLD)


def _rel(a, b):
    scale = b.float().pow(2).mean(-1, keepdim=True).sqrt()
    return ((a.float() - b.float()).abs() / (scale + b.float().abs())).max().item()


def test_every_rank_gets_the_single_process_result(tp_results):
    want = single_expected()
    for rank in range(WORLD):
        refused, given, kernel_path, seen, _ = tp_results[rank]
        assert refused == "gemm2_out" and given and kernel_path.shape == (TT, HH)
        assert _rel(kernel_path, want) < 2e-2, rank   # bf16 partial and bf16 sum on the GPU path
        assert seen == [((TT, LL), BF, list(range(TT)), [1.0] * TT)]   # the summed rows, K = 1, weight 1
    assert torch.equal(tp_results[0][2], tp_results[1][2])


def test_normalizing_partials_would_be_detected():
    want = single_expected()
    nw, up, sh, res = common_inputs()
    wrong = sum(lt.reference(*rank_inputs(r), nw, up).float() for r in range(WORLD)) + sh.float() + res.float()
    assert _rel(wrong, want) > 2e-2


def test_bad_tp_arguments_name_the_argument(tp_results):
    for rank in range(WORLD):
        assert tp_results[rank][4] == [True, True, True]


def norm_gemm(L, H, K, wdtype="float32", **params):
    p = {"cluster": 8, "pdl": True, **params}
    return spec_for(tiers.Rule("latent_tail", "norm_gemm", {}, p), *lt.tag_constants(L, H, K, wdtype), "sm_90a")


@pytest.mark.parametrize("L,H,K,wdtype,cluster", [(3584, 7168, 16, "float32", 8), (1000, 1224, 64, "bfloat16", 1),
                                                  (136, 8, 1, "float32", 2)])
def test_norm_gemm_builds_the_split_norm_kernel_alone(L, H, K, wdtype, cluster):
    """A norm_gemm build is latent_tail_norm, instruction for instruction the split build's of the same cluster,
    and latent_tail_add (the projection runs in torch.mm between them), without spills; the norm's launch is a
    cluster a token."""
    s = norm_gemm(L, H, K, wdtype, cluster=cluster)
    assert list(lt.persistent(s)) == [lt.NORM, lt.ADD]
    assert lt.norm_shape(s, 5)[0] == (5 * cluster, 1, 1)
    cubin, log = nvrtc_compile(render.render(s), "latent_tail_norm_gemm", s.arch, "norm_gemm", None)
    assert not log, log
    files = {"kernel.cubin": cubin}
    assert_no_spills(files)
    assert sorted(f for f, _ in resources.usage(files)) == sorted([lt.NORM, lt.ADD])
    sp = fused(L, H, K, wdtype, cluster=cluster, max_tokens=8, warps=8, split=True)
    split_cubin, _ = nvrtc_compile(render.render(sp), "latent_tail_split", sp.arch, "split", None)

    def norm_sass(cb):
        part = next(p for p in resources.sass({"kernel.cubin": cb}).split("Function : ")[1:] if p.startswith(lt.NORM))
        return _opcodes(part)
    assert norm_sass(cubin) == norm_sass(split_cubin)


@pytest.mark.parametrize("loads", [None, 4])
def test_norm_gemm_params_change_only_their_kernel(loads):
    """gemm_bf16 changes latent_tail_add alone: one 16-byte load of h a thread (8 bf16) where fp32 h takes two;
    norm_loads changes latent_tail_norm alone (its row loads batched)."""
    def kernels(**p):
        s = norm_gemm(3584, 7168, 16, cluster=2, **p)
        cubin, log = nvrtc_compile(render.render(s), "latent_tail_norm_gemm", s.arch, "norm_gemm", None)
        assert not log, log
        assert_no_spills({"kernel.cubin": cubin})
        return {part.split()[0]: _opcodes(part)
                for part in resources.sass({"kernel.cubin": cubin}).split("Function : ")[1:]}
    extra = {} if loads is None else {"norm_loads": loads}
    base, b16 = kernels(**extra), kernels(gemm_bf16=True, **extra)
    assert base[lt.NORM] == b16[lt.NORM]
    h_loads = lambda ops: sum(o.startswith("LDG.E.128.CONSTANT") for o in ops)  # noqa: E731
    assert h_loads(base[lt.ADD]) == h_loads(b16[lt.ADD]) + 1
    if loads is not None:
        assert kernels()[lt.NORM] != base[lt.NORM] and kernels()[lt.ADD] == base[lt.ADD]


@pytest.mark.parametrize("cluster", [1, 8])
def test_norm_gemm_addmm_adds_the_sum_to_the_norm_kernel_alone(cluster):
    """addmm: latent_tail_norm also writes out = bf16(shared + residual) (16-byte loads of both, one 16-byte store a
    vector), the add kernel unchanged (left unlaunched); without gemm_bf16 the rule is refused."""
    def kernels(**p):
        s = norm_gemm(3584, 7168, 16, cluster=cluster, gemm_bf16=True, **p)
        cubin, log = nvrtc_compile(render.render(s), "latent_tail_norm_gemm", s.arch, "norm_gemm", None)
        assert not log, log
        assert_no_spills({"kernel.cubin": cubin})
        return {part.split()[0]: _opcodes(part)
                for part in resources.sass({"kernel.cubin": cubin}).split("Function : ")[1:]}
    base, fold = kernels(), kernels(addmm=True)
    assert base[lt.ADD] == fold[lt.ADD]
    stores = lambda ops: sum(o.startswith("STG.E.128") for o in ops)  # noqa: E731
    assert stores(fold[lt.NORM]) > stores(base[lt.NORM])
    with pytest.raises(kerngen.TierError, match="addmm.*gemm_bf16"):
        tiers.check_params("a rule", "latent_tail", "norm_gemm", {"cluster": 1, "addmm": True})


@pytest.mark.parametrize("cluster,vectors", [(1, 2), (1, 4), (2, 3), (8, 8)])
def test_norm_vectors_give_fewer_norm_threads(cluster, vectors):
    """norm_vectors: a norm thread computes that many vectors of its CTA's slice, so the CTA has ceil(slice /
    vectors) threads rounded up to warps (its launch and the kernel's __launch_bounds__ agree); no spills."""
    s = norm_gemm(3584, 7168, 16, cluster=cluster, norm_vectors=vectors, norm_loads=8)
    threads = -(-(-(-448 // cluster) // vectors) // 32) * 32
    assert lt.persistent(s)[lt.NORM].threads == threads and lt.norm_shape(s, 3)[1] == (threads, 1, 1)
    cubin, log = nvrtc_compile(render.render(s), "latent_tail_norm_gemm", s.arch, "norm_gemm", None)
    assert not log, log
    assert_no_spills({"kernel.cubin": cubin})
    assert "__launch_bounds__(NORM_T)" in render.render(s) and f"NORM_V = {vectors};" in render.render(s)
    assert lt.persistent(norm_gemm(8192, 64, 4, cluster=1))[lt.NORM].threads == 1024
    with pytest.raises(kerngen.InputError, match="norm_vectors"):   # 1025 vectors a CTA
        lt.persistent(norm_gemm(8192 + 8, 64, 4, cluster=1))


def test_norm_gemm_rules_are_checked(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text('schema = 1\n[[tier]]\nop = "latent_tail"\nvariant = "norm_gemm"\nparams = { cluster = 9 }\n')
    with pytest.raises(kerngen.TierError, match="cluster"):
        tiers.parse(p)


def test_the_torch_op_gives_each_call_its_own_scratch(monkeypatch):
    """torch.ops.kerngen.latent_tail's CUDA implementation asks for buffers of its own (CUDA graphs own a call's
    memory under torch.compile)."""
    from kerngen.ops import latent_tail_torch
    seen = {}
    monkeypatch.setattr(lt, "latent_tail", lambda *a, **kw: seen.update(kw) or a[0])
    latent_tail_torch.latent_tail._init_fn(*make(2, 4, 64, 32)[:5])
    assert seen["own_scratch"] is True


@pytest.mark.parametrize("ng,na", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("T", [1, 8])
def test_the_phase_probe_instruments_the_split_kernels(T, ng, na):
    """tools/diagnose/latent_phases.py finds each boundary of kimi-k3's split kernels, with n copied into shared
    memory or read from global memory (n_global), the norm's sums exchanged by cluster barriers or st.async
    (norm_async) (its anchors are template text: this fails when they drift) and the instrumented source compiles
    for sm_90a with a stamp at each."""
    from kerngen.compile import nvrtc_compile
    from kerngen.render import render
    from tools.diagnose import latent_phases as probe
    m = tiers.load().model("kimi-k3")
    s = lt.spec(m.hidden, m.model_hidden, m.top_k, "float32", T, "sm_90a")
    assert s.variant == "fused" and lt.split(s)
    s = lt.rule_spec(tiers.Rule(lt.OP, "fused", {}, {**dict(s.params), "n_global": ng, "norm_async": na}), m.hidden,
                     m.model_hidden, m.top_k, "float32", "sm_90a")
    src = probe.instrument(render(s))
    assert src.count("kg_stamp(0, ") == len(probe.NORM_STAMPS) and src.count("kg_stamp(1, ") == len(probe.PROJ_STAMPS)
    cubin, _ = nvrtc_compile(src, "latent_phases", "sm_90a", "latent_phases", None)
    assert cubin[:4] == b"\x7fELF" and b"latent_tail_proj" in cubin and b"kg_ts" in cubin


@pytest.mark.parametrize("early", [False, True])
def test_split_even_rows_build_without_spills_and_a_cta_a_row_at_most(early, tmp_path):
    """even_rows (split builds): the projection compiles for sm_90a without spills, each CTA's share of rows from its
    index and the grid; the grid is the persistent one but never more CTAs than up_proj has rows; without
    split = true it is a named error."""
    m = tiers.load().model("kimi-k3")
    base = dict(lt.spec(m.hidden, m.model_hidden, m.top_k, "float32", 1, "sm_90a").params)
    mk = lambda H=m.model_hidden, **over: lt.rule_spec(  # noqa: E731
        tiers.Rule(lt.OP, "fused", {}, {**base, "early_weights": early, **over}), m.hidden, H, m.top_k, "float32",
        "sm_90a")
    even = mk(even_rows=True)
    assert lt.even_rows(even) and not lt.even_rows(mk())
    src = render.render(even)
    assert "share_begin(blockIdx.x + 1)" in src and "share_begin" not in render.render(mk())
    assert_no_spills(jit.build(even, store=DiskCache(tmp_path)).files)
    grid = lambda s: lt.launch_shape(s, -1)[0][0]  # noqa: E731
    assert grid(even) == grid(mk()) == min(-(-m.model_hidden // 16), grid(mk()))
    assert grid(mk(H=40, even_rows=True)) == 40 and grid(mk(H=40)) == 3
    with pytest.raises(kerngen.InputError, match="even_rows"):
        lt.persistent(mk(even_rows=True, split=False))


@pytest.mark.parametrize("even", [False, True])
def test_split_n_global_builds_without_spills_or_dynamic_shared_memory(even, tmp_path):
    """n_global (split builds): the projection reads n from p.n (no copy into shared memory, so no dynamic shared
    memory); it compiles for sm_90a without spills within the rule's 2 CTAs an SM; without split = true it is a
    named error."""
    m = tiers.load().model("kimi-k3")
    base = dict(lt.spec(m.hidden, m.model_hidden, m.top_k, "float32", 1, "sm_90a").params)
    mk = lambda **over: lt.rule_spec(tiers.Rule(lt.OP, "fused", {}, {**base, "even_rows": even, "n_global": False,  # noqa: E731
                                                                   **over}),
                                     m.hidden, m.model_hidden, m.top_k, "float32", "sm_90a")
    ng = mk(n_global=True)
    assert lt.n_global(ng) and not lt.n_global(mk())
    assert lt.persistent(ng)[lt.PROJ].dynamic_smem == 0 < lt.persistent(mk())[lt.PROJ].dynamic_smem
    src = render.render(ng)
    assert "constexpr int NP = L;" in src and "project(p, p.n" in src and "smem_raw" not in src.split("latent_tail_proj")[-1]
    built = jit.build(ng, store=DiskCache(tmp_path))
    assert_no_spills(built.files)
    regs = dict(resources.usage(built.files))[lt.PROJ]["REG"]
    assert regs * 256 * 2 <= 65536, regs
    with pytest.raises(kerngen.InputError, match="n_global"):
        lt.persistent(mk(n_global=True, split=False, even_rows=False))


@pytest.mark.parametrize("loads", [4, 8])
def test_split_proj_registers_bound_the_projection_without_spills(loads, tmp_path):
    """proj_registers (split builds): the projection compiles for sm_90a within that many registers a thread (112:
    two of its CTAs and a norm CTA of norm_loads 4-8 within an SM sub-partition's 16384 registers: two warps of
    each projection CTA, one norm warp), without spills; without split = true it is a named error."""
    m = tiers.load().model("kimi-k3")
    base = dict(lt.spec(m.hidden, m.model_hidden, m.top_k, "float32", 1, "sm_90a").params)
    s = lt.rule_spec(tiers.Rule(lt.OP, "fused", {}, {**base, "proj_registers": 112, "norm_loads": loads}),
                     m.hidden, m.model_hidden, m.top_k, "float32", "sm_90a")
    assert "__maxnreg__(112)" in render.render(s)
    built = jit.build(s, store=DiskCache(tmp_path))
    assert_no_spills(built.files)
    regs = {k: -(-u["REG"] // 8) * 8 for k, u in resources.usage(built.files)}
    assert regs[lt.PROJ] <= 112
    assert 2 * 2 * regs[lt.PROJ] * 32 + regs[lt.NORM] * 32 <= 16384, regs
    with pytest.raises(kerngen.InputError, match="proj_registers"):
        lt.persistent(lt.rule_spec(tiers.Rule(lt.OP, "fused", {}, {**base, "split": False, "n_global": False,
                                                                    "proj_registers": 112}),
                                   m.hidden, m.model_hidden, m.top_k, "float32", "sm_90a"))


@pytest.mark.parametrize("early", [True, False])
def test_split_l2_lines_bound_the_first_items_l2_prefetch(early, tmp_path):
    """l2_lines (split builds): only the first l2_lines 128-byte lines of each first-item row (past the early_weights
    steps) go toward L2 before the wait; 0 leaves no L2 prefetch in the projection (its SASS has no CCTL.E.PF2), a
    positive count keeps them; no spills within 2 CTAs an SM; without split = true it is a named error."""
    m = tiers.load().model("kimi-k3")
    base = dict(lt.spec(m.hidden, m.model_hidden, m.top_k, "float32", 1, "sm_90a").params)
    assert base["l2_lines"] == 16   # the shipped rule's
    base.pop("l2_lines")
    mk = lambda **over: lt.rule_spec(tiers.Rule(lt.OP, "fused", {}, {**base, "early_weights": early, **over}),  # noqa: E731
                                     m.hidden, m.model_hidden, m.top_k, "float32", "sm_90a")
    assert "l2_lines of each row" not in render.render(mk())   # without it: every line of the first item
    assert "l2_lines of each row" in render.render(mk(l2_lines=8))

    def proj_sass(s):
        b = jit.build(s, store=DiskCache(tmp_path))
        assert_no_spills(b.files)
        assert dict(resources.usage(b.files))[lt.PROJ]["REG"] * 256 * 2 <= 65536
        return resources.sass(b.files).split(f"Function : {lt.PROJ}")[1].split("Function :")[0]

    assert "PF2" not in proj_sass(mk(l2_lines=0))
    assert "PF2" in proj_sass(mk(l2_lines=8)) and "PF2" in proj_sass(mk())
    with pytest.raises(kerngen.InputError, match="l2_lines"):
        lt.persistent(mk(l2_lines=8, split=False, n_global=False))


@pytest.mark.parametrize("split", [True, False])
def test_items_per_cta_sizes_the_grid_and_leaves_the_source(split):
    """items_per_cta: a grid of at most ceil(items / items_per_cta) CTAs (kimi-k3: 448 items of 16 rows, 264 CTAs
    at 2 an SM; 2 a CTA: 224, every CTA two items), never more than the persistent grid, whole clusters for the fused
    kernel; the kernel source is the rule's without it."""
    m = tiers.load().model("kimi-k3")
    base = dict(lt.spec(m.hidden, m.model_hidden, m.top_k, "float32", 1, "sm_90a").params)
    base.update(split=split)
    if not split:   # the one-launch kernel: none of the split builds' params
        base = {k: v for k, v in base.items() if k not in lt.SPLIT_ONLY}
    mk = lambda H=m.model_hidden, **over: lt.rule_spec(  # noqa: E731
        tiers.Rule(lt.OP, "fused", {}, {**base, **over}), m.hidden, H, m.top_k, "float32", "sm_90a")
    grid = lambda s: lt.launch_shape(s, -1)[0][0]  # noqa: E731
    full = grid(mk())
    assert full == 2 * tiers.SMS
    assert grid(mk(items_per_cta=1)) == full
    assert grid(mk(items_per_cta=2)) == 224
    assert grid(mk(items_per_cta=3)) == (150 if split else 144)   # ceil(448 / 3); the fused kernel's clusters of 8
    assert grid(mk(H=40, items_per_cta=2)) == (2 if split else 8)
    assert render.render(mk(items_per_cta=2)) == render.render(mk())
    with pytest.raises(kerngen.TierError, match="items_per_cta"):
        tiers.check_params("a rule", lt.OP, "fused", {**base, "items_per_cta": 0})


def test_split_weights_delay_holds_the_first_loads_back(tmp_path):
    """weights_delay (split builds): the projection sleeps on the global timer before its first weight loads (its
    SASS gains NANOSLEEP), without spills; the rule's own build is unchanged; without split = true a named error."""
    m = tiers.load().model("kimi-k3")
    base = dict(lt.spec(m.hidden, m.model_hidden, m.top_k, "float32", 1, "sm_90a").params)
    mk = lambda **over: lt.rule_spec(tiers.Rule(lt.OP, "fused", {}, {**base, **over}),  # noqa: E731
                                     m.hidden, m.model_hidden, m.top_k, "float32", "sm_90a")
    assert "weights_delay:" not in render.render(mk()).split("latent_tail_proj(")[-1]
    assert render.render(mk(weights_delay=0)) == render.render(mk())
    b = jit.build(mk(weights_delay=600), store=DiskCache(tmp_path))
    assert_no_spills(b.files)
    proj = resources.sass(b.files).split(f"Function : {lt.PROJ}")[1].split("Function :")[0]
    assert "NANOSLEEP" in proj and "600" not in render.render(mk())
    with pytest.raises(kerngen.InputError, match="weights_delay"):
        lt.persistent(mk(weights_delay=600, split=False, n_global=False))


@pytest.mark.parametrize("tokens", [1, 9])
def test_split_next_early_loads_the_next_item_before_the_epilogue(tokens, tmp_path):
    """next_early (split builds with early_weights; the 1-8-token rule takes it): the projection loads the next
    item's first steps before its reduction across warps (its source holds the loads, its SASS is not the one
    without); the 1-8 and 9-16-token rules' launch shapes build with it without spills and within their register
    bound; without early_weights or with even_rows it changes nothing; without split a named error."""
    m = tiers.load().model("kimi-k3")
    base = dict(lt.spec(m.hidden, m.model_hidden, m.top_k, "float32", tokens, "sm_90a").params)
    assert base.get("early_weights") and base.get("split") and base.get("next_early", False) == (tokens <= 8)
    base.pop("next_early", None)   # (the 1-8-token rule takes it)
    mk = lambda **over: lt.rule_spec(tiers.Rule(lt.OP, "fused", {}, {**base, **over}),  # noqa: E731
                                     m.hidden, m.model_hidden, m.top_k, "float32", "sm_90a")
    src = render.render(mk(next_early=True)).split("latent_tail_proj(")[0]
    assert "next_early: the next item" in src and "next_early: the next item" not in render.render(mk())
    proj = lambda files: resources.sass(files).split(f"Function : {lt.PROJ}")[1].split("Function :")[0]  # noqa: E731
    b, b0 = jit.build(mk(next_early=True), store=DiskCache(tmp_path)), jit.build(mk(), store=DiskCache(tmp_path))
    assert_no_spills(b.files)
    assert proj(b.files) != proj(b0.files) and "LDG.E.EF.128" in proj(b.files)
    regs = dict(resources.usage(b.files))[lt.PROJ]["REG"]
    assert regs <= 65536 // (32 * base["warps"] * base["blocks_per_sm"]), regs
    for over in ({"early_weights": False}, {"even_rows": True}):   # (no early_weights registers / no item stride)
        assert render.render(mk(next_early=True, **over)) == render.render(mk(**over))
    one = {k: v for k, v in base.items() if k not in lt.SPLIT_ONLY}
    with pytest.raises(kerngen.InputError, match="next_early"):
        lt.persistent(lt.rule_spec(tiers.Rule(lt.OP, "fused", {}, {**one, "split": False, "next_early": True}),
                                   m.hidden, m.model_hidden, m.top_k, "float32", "sm_90a"))


def test_beside_norm_leaves_a_slot_for_each_norm_cta():
    """beside_norm (split builds): the projection's grid is the persistent one less a CTA for each norm CTA at this
    token count (kimi-k3: 264 - 8 at T = 1, 264 - 64 at T = 8), so every projection CTA can start at once; with
    even_rows the shares follow the grid; the source is the rule's; without split = true a named error."""
    m = tiers.load().model("kimi-k3")
    base = dict(lt.spec(m.hidden, m.model_hidden, m.top_k, "float32", 1, "sm_90a").params)
    mk = lambda **over: lt.rule_spec(tiers.Rule(lt.OP, "fused", {}, {**base, **over}),  # noqa: E731
                                     m.hidden, m.model_hidden, m.top_k, "float32", "sm_90a")
    grid = lambda s, T=0: lt.launch_shape(s, -1, T)[0][0]  # noqa: E731
    s = mk(beside_norm=True, even_rows=True)
    assert [grid(s, T) for T in (0, 1, 2, 8)] == [264, 256, 248, 200]
    assert [grid(mk(), T) for T in (0, 1, 8)] == [264, 264, 264]
    assert grid(mk(beside_norm=True, cluster=4), 8) == 264 - 32
    assert render.render(mk(beside_norm=True)) == render.render(mk())
    one = {k: v for k, v in base.items() if k not in lt.SPLIT_ONLY}
    with pytest.raises(kerngen.InputError, match="beside_norm"):
        lt.persistent(lt.rule_spec(tiers.Rule(lt.OP, "fused", {}, {**one, "split": False, "beside_norm": True}),
                                   m.hidden, m.model_hidden, m.top_k, "float32", "sm_90a"))


@pytest.mark.parametrize("variant,T", [("fused", 1), ("norm_gemm", 17)])
def test_norm_async_hands_the_sums_over_without_a_gpu_wide_fence(variant, T, tmp_path):
    """norm_async (clusters of 2 or more): latent_tail_norm exchanges its CTAs' sums of squares by st.async counted
    by an mbarrier (SASS: STAS, SYNCS) and has no MEMBAR.ALL.GPU, which each cluster barrier with release semantics
    costs (two in the rule's build); no spills; its other code and the projection's are the rule's (the sum in rank
    order: the same bits, checked on the GPU); at cluster 1 it changes nothing."""
    m = tiers.load().model("kimi-k3")
    base = dict(lt.spec(m.hidden, m.model_hidden, m.top_k, "float32", T, "sm_90a").params)
    assert lt.spec(m.hidden, m.model_hidden, m.top_k, "float32", T, "sm_90a").variant == variant
    mk = lambda **over: lt.rule_spec(tiers.Rule(lt.OP, variant, {}, {**base, **over}),  # noqa: E731
                                     m.hidden, m.model_hidden, m.top_k, "float32", "sm_90a")

    def norm_sass(s):
        b = jit.build(s, store=DiskCache(tmp_path))
        assert_no_spills(b.files)
        return resources.sass(b.files).split(f"Function : {lt.NORM}")[1].split("Function :")[0]

    assert base.get("cluster", 1) > 1
    assert base.get("norm_async", False) == (variant == "fused")   # the shipped 1-8-token rule takes it
    plain, fast = norm_sass(mk(norm_async=False)), norm_sass(mk(norm_async=True))
    assert plain.count("MEMBAR.ALL.GPU") >= 2 and "STAS" not in plain
    assert "MEMBAR" not in fast and "STAS" in fast and "SYNCS" in fast
    assert render.render(mk(norm_async=True, cluster=1)) == render.render(mk(cluster=1))
    if variant == "fused":
        src = lambda s: render.render(s).split("latent_tail_proj(const")[1]  # noqa: E731
        assert src(mk(norm_async=True)) == src(mk(norm_async=False))


def test_late_launch_triggers_the_projection_after_the_routing_or_the_gather(tmp_path):
    """late_launch (split): latent_tail_norm's one griddepcontrol.launch_dependents comes at entry, before its grid
    wait (0), once its routing is in shared memory, before the rows' loads (1), or after its rows are gathered (the
    sums of squares stored, a barrier; 2); the projection's code is the rule's; no spills; refused without split."""
    m = tiers.load().model("kimi-k3")
    base = dict(lt.spec(m.hidden, m.model_hidden, m.top_k, "float32", 1, "sm_90a").params)
    mk = lambda **over: lt.rule_spec(tiers.Rule(lt.OP, "fused", {}, {**base, **over}),  # noqa: E731
                                     m.hidden, m.model_hidden, m.top_k, "float32", "sm_90a")
    norm = lambda s: render.render(s).split("latent_tail_norm(const")[1].split("latent_tail_proj(const")[0]  # noqa: E731
    proj = lambda s: render.render(s).split("latent_tail_proj(const")[1]  # noqa: E731
    at = [norm(mk(late_launch=n)) for n in (0, 1, 2)]
    assert at[0] == norm(mk())
    for src in at:
        assert src.count("kg_launch_dependents();") == 1
    spot = [src.index("kg_launch_dependents();") for src in at]
    assert spot[0] < at[0].index("kg_grid_wait();")
    assert at[1].index("w_s[i] = kg_to_float") < spot[1] < at[1].index("gather_y<NORM_KC>")
    assert at[2].index("part_s[tid] = sum_sq8(y);") < spot[2] < at[2].index("rstd_s = rstd_of")
    for n in (1, 2):
        assert proj(mk(late_launch=n)) == proj(mk())
        assert_no_spills(jit.build(mk(late_launch=n), store=DiskCache(tmp_path)).files)
    one = {k: v for k, v in base.items() if k not in lt.SPLIT_ONLY}
    with pytest.raises(kerngen.InputError, match="late_launch"):
        lt.persistent(lt.rule_spec(tiers.Rule(lt.OP, "fused", {}, {**one, "split": False, "late_launch": 2}),
                                   m.hidden, m.model_hidden, m.top_k, "float32", "sm_90a"))
    with pytest.raises(TierError, match="late_launch"):
        tiers.check_params("latent_tail", "latent_tail", "fused", {**base, "late_launch": 3})


@pytest.mark.parametrize("mt,unroll", [(16, 2), (24, 2), (32, 2)])
def test_split_builds_serve_up_to_32_tokens_without_spills(mt, unroll, tmp_path):
    """Split builds take max_tokens up to 32 (up to four n-blocks of 8 tokens a step): kimi-k3's rule with n_global
    compiles for sm_90a without spills within two projection CTAs an SM; the one-launch kernel stays at 16 (a named
    error past it, before any build)."""
    m = tiers.load().model("kimi-k3")
    base = dict(lt.spec(m.hidden, m.model_hidden, m.top_k, "float32", 1, "sm_90a").params)
    s = lt.rule_spec(tiers.Rule(lt.OP, "fused", {}, {**base, "max_tokens": mt, "unroll": unroll}),
                     m.hidden, m.model_hidden, m.top_k, "float32", "sm_90a")
    assert lt.split(s) and lt.n_global(s)
    assert f"constexpr int MAX_T = {mt};" in render.render(s)
    built = jit.build(s, store=DiskCache(tmp_path))
    assert_no_spills(built.files)
    assert dict(resources.usage(built.files))[lt.PROJ]["REG"] * 256 * 2 <= 65536
    with pytest.raises(kerngen.InputError, match="max_tokens"):
        lt.kernel(s, mt + 1, -1)
    one = {k: v for k, v in dict(base, max_tokens=mt, unroll=unroll, split=False, early_weights=False).items()
           if k not in lt.SPLIT_ONLY}
    if mt > 16:
        with pytest.raises(kerngen.InputError, match="max_tokens at most 16"):
            lt.persistent(lt.rule_spec(tiers.Rule(lt.OP, "fused", {}, one), m.hidden, m.model_hidden, m.top_k,
                                       "float32", "sm_90a"))
