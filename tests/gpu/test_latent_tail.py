"""latent_tail on the GPU against the torch reference: the fused kernel (T <= 16), norm_gemm (the tier table's from
9 tokens) and the unfused path,
-1 rows, shared / residual on and off, CUDA graphs, and the signature fast path after the first call. The fused
tests also run the tier rule's build with params a rule may add (early_weights; split: the norm kernel, then the
projection waiting on it through PDL), launched directly; split builds also through dispatch (a user tier file),
in CUDA graphs, back to back on one scratch buffer, after a producer that lets them start early, and bitwise
against the one-launch kernel of the same params.

Tolerance: the fused kernel computes y bitwise as finalize does, the sum of squares and the projection's dot
products in another order than the reference (fp32 either way), and rounds n and the output to bf16 at the
same points: |got - ref| within one bf16 step of the output plus 1e-2 of the row's RMS (an n element one
bf16 step apart, carried through the projection). The unfused variant rounds y and the projection to bf16
too: 2e-2 of the row's RMS.
"""
import pytest
import torch

import kerngen
from kerngen import tiers
from kerngen.ops import latent_tail as lt
from kerngen.ops._common import DTYPE_NAMES
from kerngen.plan import spec_for, target_arch
from tests.helpers import user_tiers

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]
BF = torch.bfloat16
KIMI = (16, 3584, 7168)   # K, L, H of kimi-k3 (H assumed: Kimi K2's hidden size)
VARIANTS = [None, {"early_weights": True}, {"split": True}, {"split": True, "early_weights": True}]
# None: kerngen.latent_tail (dispatch); else laid over the tier rule's params


def variant_id(over):
    return "dispatch" if over is None else ",".join(f"{k}={v}" for k, v in over.items())


def make(T, K, L, H, *, pad=0, skip=0.1, shared=True, residual=True, wdtype=torch.float32, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = max(T * K, 1)
    gemm2 = torch.randn(rows, L + pad, device="cuda", generator=g).to(BF)
    e2p = torch.randperm(rows, device="cuda", generator=g)[: T * K].view(T, K).int()
    e2p = torch.where(torch.rand(T, K, device="cuda", generator=g) < skip, -1, e2p).int().contiguous()
    w = torch.rand(T, K, device="cuda", generator=g).to(wdtype)
    nw = (0.5 + torch.rand(L, device="cuda", generator=g)).to(BF)
    up = (torch.randn(H, L, device="cuda", generator=g) / L ** 0.5).to(BF)
    sh = torch.randn(T, H, device="cuda", generator=g).to(BF) if shared else None
    res = (3 * torch.randn(T, H, device="cuda", generator=g)).to(BF) if residual else None
    return gemm2, e2p, w, nw, up, sh, res


def reference(gemm2, e2p, w, nw, up, sh, res, eps=1e-6):
    return lt.reference(gemm2.cpu(), e2p.cpu(), w.cpu(), nw.cpu(), up.cpu(), shared=None if sh is None else sh.cpu(),
                        residual=None if res is None else res.cpu(), eps=eps)


def close(got, ref, rel):
    got, ref = got.cpu().double(), ref.double()
    scale = ref.pow(2).mean(-1, keepdim=True).sqrt()
    err = (got - ref).abs()
    bad = err > 2 ** -8 * ref.abs() + rel * scale + 1e-6
    assert not bad.any(), f"{int(bad.sum())} elements off, max abs diff {err.max().item():.4g}"
    assert torch.isfinite(got).all()


def kimi_dispatch():
    return lt.dispatch(torch.cuda.current_device(), L=KIMI[1], H=KIMI[2], top_k=KIMI[0], weights_dtype="float32")


FUSED16 = {"max_tokens": 16, "warps": 16, "unroll": 2, "cluster": 8, "blocks_per_sm": 1, "pdl": True}


def run_fused(over, gemm2, e2p, w, nw, up, sh, res, out, eps=1e-6):
    """The one-launch fused build of the tier rule at this shape and T (FUSED16 where the rule is not fused: 9-16
    tokens) with `over` laid over its params, launched directly."""
    T, K = e2p.shape
    L, H, wd, arch = nw.shape[0], up.shape[0], DTYPE_NAMES[w.dtype], target_arch()
    rule = lt.spec(L, H, K, wd, T, arch)
    split_only = ("split", "early_weights") + lt.SPLIT_ONLY   # `over` sets these: the base is one launch
    base = {k: v for k, v in rule.params if k not in split_only} if rule.variant == "fused" else FUSED16
    s = spec_for(tiers.Rule(lt.OP, "fused", {}, {**base, **over}), *lt.tag_constants(L, H, K, wd), arch)
    return lt.run(lt.kernel(s, T, torch.cuda.current_device()), gemm2, e2p, w, nw, up, sh, res, eps, out)


def check(T, K, L, H, over=None, **kw):
    args = make(T, K, L, H, **kw)
    out = torch.full((T, H), float("nan"), dtype=BF, device="cuda")   # poisoned
    if over is None:
        got = kerngen.latent_tail(*args[:5], shared=args[5], residual=args[6], out=out)
    else:
        got = run_fused(over, *args, out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    fused = over is not None or lt.spec(L, H, K, DTYPE_NAMES[args[2].dtype], T, target_arch()).variant == "fused"
    close(got, reference(*args), 1e-2 if fused else 2e-2)


@pytest.mark.parametrize("over", VARIANTS, ids=variant_id)
@pytest.mark.parametrize("T", range(1, 17))
def test_fused_kimi_k3(T, over):
    check(T, *KIMI, over, seed=T)


@pytest.mark.parametrize("T", [17, 24, 33, 64, 200])
def test_norm_gemm_dispatched_kimi_k3(T):
    check(T, *KIMI, seed=T)


def test_unfused_past_the_norm_kernels_width():
    """Latents wider than 8192: the unfused variant (kerngen.finalize + torch)."""
    assert type(lt.dispatch(torch.cuda.current_device(), L=8200, H=64, top_k=4, weights_dtype="float32").kernel(3)) \
        is lt.Unfused
    check(3, 4, 8200, 64, seed=9)


@pytest.mark.parametrize("over", VARIANTS, ids=variant_id)
@pytest.mark.parametrize("T", [1, 8, 16])
@pytest.mark.parametrize("K,L,H,pad,wdtype", [(8, 1024, 2048, 8, torch.float32), (4, 1000, 1224, 0, BF),
                                              (64, 256, 512, 0, torch.float32), (2, 136, 8, 0, torch.float32)])
def test_other_shapes(T, K, L, H, pad, wdtype, over):
    """L = 1000: a partial last step; L = 136, H = 8: fewer steps than a CTA's warps load at once, one item for a
    cluster of eight CTAs."""
    check(T, K, L, H, over, pad=pad, wdtype=wdtype, seed=K + T)


@pytest.mark.parametrize("over", VARIANTS, ids=variant_id)
@pytest.mark.parametrize("shared,residual", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("T", [1, 12])
def test_without_shared_or_residual(T, shared, residual, over):
    check(T, *KIMI, over, shared=shared, residual=residual)


def test_every_slot_skipped_gives_shared_plus_residual():
    gemm2, e2p, w, nw, up, sh, res = make(4, *KIMI)
    got = kerngen.latent_tail(gemm2, torch.full_like(e2p, -1), w, nw, up, shared=sh, residual=res)
    assert torch.equal(got, (sh.float() + res.float()).to(BF))


def test_in_place_residual():
    gemm2, e2p, w, nw, up, sh, res = make(8, *KIMI)
    want = reference(gemm2, e2p, w, nw, up, sh, res)
    got = kerngen.latent_tail(gemm2, e2p, w, nw, up, shared=sh, residual=res, out=res)
    assert got is res
    close(got, want, 1e-2)


def check_in_a_graph(T, seed, rel):
    """kerngen.latent_tail captured in a CUDA graph (its first call outside), replayed on fresh inputs."""
    args = make(T, *KIMI, seed=seed)
    out = torch.empty(T, KIMI[2], dtype=BF, device="cuda")
    kerngen.latent_tail(*args[:5], shared=args[5], residual=args[6], out=out)   # first call: build, outside
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kerngen.latent_tail(*args[:5], shared=args[5], residual=args[6], out=out)
    fresh = make(T, *KIMI, seed=seed + 1)
    for dst, src in zip(args, fresh):
        dst.copy_(src)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    close(out, reference(*fresh), rel)


@pytest.mark.parametrize("T", [1, 8, 16, 32])
def test_inside_cuda_graph(T):
    check_in_a_graph(T, 7, 1e-2 if T <= 8 else 2e-2)


def test_after_the_first_call_the_signature_serves():
    args = make(4, *KIMI, seed=3)
    first = kerngen.latent_tail(*args[:5], shared=args[5], residual=args[6])
    assert len(kerngen.dispatch.calls("latent_tail")) >= 1
    k = next(v for v in kerngen.dispatch.calls("latent_tail").values() if v[1] == 4)[0]
    assert k is kimi_dispatch().kernel(4)
    assert type(k) is (lt.Split if lt.split(lt.spec(*KIMI[1:], KIMI[0], "float32", 4, target_arch())) else lt.Launcher)
    again = kerngen.latent_tail(*args[:5], shared=args[5], residual=args[6])
    torch.cuda.synchronize()
    assert torch.equal(first, again)   # deterministic: fixed reduction orders
    with pytest.raises(kerngen.InputError) as e:
        kerngen.latent_tail(*args[:5], shared=args[5][:, :64].contiguous())
    assert e.value.arg == "shared"
    with pytest.raises(kerngen.InputError) as e:   # a misaligned view of a signature seen before
        g = torch.empty(args[0].numel() + 8, dtype=BF, device="cuda")[1:1 + args[0].numel()].view_as(args[0])
        kerngen.latent_tail(g, *args[1:5])
    assert e.value.arg == "gemm2_out"


# ---------------------------------------------------------------------------------------------- split builds

@pytest.fixture
def split_tiers(tmp_path, monkeypatch):
    """kerngen.latent_tail dispatching kimi-k3's fused token counts to split builds (tests/test_latent_tail_cpu.py's
    tier file: the shipped rules' launch shapes with split = true)."""
    from tests.test_latent_tail_cpu import SPLIT_TIERS
    with user_tiers(tmp_path, monkeypatch, SPLIT_TIERS):
        yield


def dispatched_split(T, K=16, L=3584, H=7168):
    k = lt.dispatch(torch.cuda.current_device(), L=L, H=H, top_k=K, weights_dtype="float32").kernel(T)
    assert type(k) is lt.Split, T
    return k


@pytest.mark.parametrize("T", range(1, 17))
def test_split_is_bitwise_the_fused_kernel(T):
    """The same params with and without split: n is computed in the same order (the same cluster), the projection
    is the same code: the same bits."""
    args = make(T, *KIMI, seed=40 + T)
    one = run_fused({}, *args, torch.empty(T, KIMI[2], dtype=BF, device="cuda"))
    two = run_fused({"split": True}, *args, torch.empty(T, KIMI[2], dtype=BF, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(one, two)


SPLIT_SHAPES = [{"even_rows": True}, {"n_global": True}, {"even_rows": True, "n_global": True},
                {"n_global": True, "proj_registers": 112, "norm_loads": 8}, {"n_global": True, "l2_lines": 0},
                {"n_global": True, "l2_lines": 8}, {"n_global": True, "items_per_cta": 2},
                {"n_global": True, "items_per_cta": 3, "l2_lines": 16}, {"even_rows": True, "items_per_cta": 2},
                {"n_global": True, "l2_lines": 16, "weights_delay": 500}, {"even_rows": True, "beside_norm": True},
                {"n_global": True, "even_rows": True, "beside_norm": True, "l2_lines": 16},
                {"n_global": True, "norm_async": True}, {"norm_async": True, "norm_loads": 8},
                {"n_global": True, "norm_async": True, "l2_lines": 16, "even_rows": True, "beside_norm": True},
                {"n_global": True, "norm_async": True, "late_launch": 1},
                {"n_global": True, "norm_async": True, "late_launch": 2},
                {"n_global": True, "late_launch": 2, "l2_lines": 40, "beside_norm": True}]


@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=variant_id)
@pytest.mark.parametrize("early", [False, True])
@pytest.mark.parametrize("T", [1, 5, 8, 16])
def test_split_even_rows_and_n_global_keep_the_bits(T, early, shape):
    """even_rows: each projection CTA a contiguous share of up_proj's rows in tiles of 16 (rows past the share read
    as zeros); n_global: the steps read n from global memory, not a shared-memory copy. Each output column's dot
    product is the same sum in the same order: the same bits as the fused kernel."""
    args = make(T, *KIMI, seed=90 + T)
    one = run_fused({}, *args, torch.empty(T, KIMI[2], dtype=BF, device="cuda"))
    two = run_fused({"split": True, "early_weights": early, **shape}, *args,
                    torch.empty(T, KIMI[2], dtype=BF, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(one, two)


@pytest.mark.parametrize("T", [1, 3, 8, 9, 16])
def test_split_next_early_keeps_the_bits(T):
    """next_early: each warp loads the next item's first steps before the item's reduction and epilogue; the same
    sums in the same order, so the bits of the rule that serves T with it and without it."""
    args = make(T, *KIMI, seed=300 + T)
    L, H, K = args[3].shape[0], args[4].shape[0], args[1].shape[1]
    wd, arch = DTYPE_NAMES[args[2].dtype], target_arch()
    base = dict(lt.spec(L, H, K, wd, T, arch).params)
    assert base.get("split") and base.get("early_weights"), base
    outs = []
    for over in ({"next_early": False}, {"next_early": True}):
        s = spec_for(tiers.Rule(lt.OP, "fused", {}, {**base, **over}), *lt.tag_constants(L, H, K, wd), arch)
        outs.append(lt.run(lt.kernel(s, T, torch.cuda.current_device()), *args, 1e-6,
                           torch.empty(T, H, dtype=BF, device="cuda")))
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])


def run_split_rule(over, gemm2, e2p, w, nw, up, sh, res, out):
    """The split rule of one token at this shape (the 1-8 token rule's launch shape) with `over` laid over its
    params, launched directly at any T its max_tokens allows."""
    T, K = e2p.shape
    L, H, wd, arch = nw.shape[0], up.shape[0], DTYPE_NAMES[w.dtype], target_arch()
    base = dict(lt.spec(L, H, K, wd, 1, arch).params)
    assert base.get("split"), base
    s = spec_for(tiers.Rule(lt.OP, "fused", {}, {**base, **over}), *lt.tag_constants(L, H, K, wd), arch)
    return lt.run(lt.kernel(s, T, torch.cuda.current_device()), gemm2, e2p, w, nw, up, sh, res, 1e-6, out)


@pytest.mark.parametrize("shape", [(8, 1024, 2048, 8, torch.float32), (4, 1000, 1224, 0, BF), KIMI])
@pytest.mark.parametrize("T", [1, 8, 9, 16, 17, 24, 31, 32])
def test_split_builds_up_to_32_tokens(T, shape):
    """max_tokens 24 and 32 (split builds: up to four n-blocks of 8 tokens a step, n read from global memory): within
    the fused tolerance of the reference at every T they serve, and at T <= 16 the bits of the max_tokens 16 build
    (the n-blocks' sums do not see each other)."""
    K, L, H = shape[:3]
    pad, wdtype = (shape[3], shape[4]) if len(shape) > 3 else (0, torch.float32)
    args = make(T, K, L, H, pad=pad, wdtype=wdtype, seed=300 + T)
    outs = {}
    for mt in (16, 24, 32):
        if T > mt:
            continue
        out = torch.full((T, H), float("nan"), dtype=BF, device="cuda")
        outs[mt] = run_split_rule({"max_tokens": mt, "unroll": 2, "n_global": True}, *args, out)
    torch.cuda.synchronize()
    for mt, got in outs.items():
        close(got, reference(*args), 1e-2)
    if 16 in outs:
        assert all(torch.equal(outs[16], got) for got in outs.values())


@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=variant_id)
@pytest.mark.parametrize("H", [8, 200, 1000, 4104])
@pytest.mark.parametrize("early", [False, True])
def test_split_even_rows_small_shares(H, early, shape):
    """even_rows where the shares are short: one row a CTA (H at or below the grid), 3-4 rows, 15-16 rows, every
    output column written once and right (and the n_global builds at those widths, L not a multiple of 64)."""
    check(3, 8, 264, H, {"split": True, "early_weights": early, **shape}, seed=H)


@pytest.mark.parametrize("loads,vectors", [(1, 1), (3, 1), (8, 1), (8, 2), (4, 3)])
@pytest.mark.parametrize("T", [1, 5, 16])
def test_split_norm_loads_keep_the_bits(T, loads, vectors):
    """norm_loads batches the norm kernel's row loads differently, norm_vectors gives a thread several vectors; the
    adds stay in k order and each vector's sum of squares at its place: the same bits."""
    args = make(T, *KIMI, seed=70 + T)
    one = run_fused({}, *args, torch.empty(T, KIMI[2], dtype=BF, device="cuda"))
    two = run_fused({"split": True, "norm_loads": loads, "norm_vectors": vectors}, *args,
                    torch.empty(T, KIMI[2], dtype=BF, device="cuda"))
    torch.cuda.synchronize()
    assert torch.equal(one, two)


@pytest.mark.parametrize("T", [1, 3, 8, 9, 16])
def test_split_through_dispatch(T, split_tiers):
    check(T, *KIMI, seed=50 + T)
    dispatched_split(T)


@pytest.mark.parametrize("T", [1, 8, 16])
def test_split_inside_cuda_graph(T, split_tiers):
    args = make(T, *KIMI, seed=7)
    out = torch.empty(T, KIMI[2], dtype=BF, device="cuda")
    kerngen.latent_tail(*args[:5], shared=args[5], residual=args[6], out=out)   # first call: build, outside
    dispatched_split(T)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kerngen.latent_tail(*args[:5], shared=args[5], residual=args[6], out=out)
    for seed in (8, 9):   # replayed twice: the scratch buffer the graph holds is written and read again
        fresh = make(T, *KIMI, seed=seed)
        for dst, src in zip(args, fresh):
            dst.copy_(src)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        close(out, reference(*fresh), 1e-2)


def test_split_back_to_back_on_one_scratch_buffer(split_tiers):
    """Calls of different inputs and token counts in a row, no sync between: each norm kernel overwrites n only after
    the projection before it has finished (its wait), and each projection reads its own call's n."""
    calls = [make(T, *KIMI, seed=60 + i) for i, T in enumerate((8, 3, 16, 1, 8))]
    outs = [kerngen.latent_tail(*a[:5], shared=a[5], residual=a[6]) for a in calls]
    torch.cuda.synchronize()
    for a, got in zip(calls, outs):
        close(got, reference(*a), 1e-2)


def test_split_after_a_producer_that_lets_it_start_early(split_tiers):
    """gemm2_out written by kerngen.finalize (a PDL kernel that lets its dependents launch at its start), after a
    long sleep: the norm kernel lets the projection launch before its own wait, yet reads gemm2_out after it."""
    T, K, L, H = 8, *KIMI
    g = torch.Generator(device="cuda").manual_seed(70)
    src = torch.randn(T * K * 2, L, device="cuda", generator=g).to(BF)
    e2p0 = torch.arange(T * K * 2, device="cuda", dtype=torch.int32).view(T * K, 2)
    w0 = torch.rand(T * K, 2, device="cuda", generator=g)
    _, e2p, w, nw, up, sh, res = make(T, K, L, H, seed=71)
    rows = torch.zeros(T * K, L, dtype=BF, device="cuda")
    kerngen.finalize(src, e2p0, w0, out=rows)
    kerngen.latent_tail(rows, e2p, w, nw, up, shared=sh, residual=res)   # build both outside the timed chain
    torch.cuda.synchronize()
    rows.zero_()
    torch.cuda._sleep(50_000_000)
    kerngen.finalize(src, e2p0, w0, out=rows)
    got = kerngen.latent_tail(rows, e2p, w, nw, up, shared=sh, residual=res)
    torch.cuda.synchronize()
    close(got, reference(rows, e2p, w, nw, up, sh, res), 1e-2)


def test_split_in_place_residual(split_tiers):
    gemm2, e2p, w, nw, up, sh, res = make(12, *KIMI)
    want = reference(gemm2, e2p, w, nw, up, sh, res)
    got = kerngen.latent_tail(gemm2, e2p, w, nw, up, shared=sh, residual=res, out=res)
    assert got is res
    close(got, want, 1e-2)


def test_split_bad_inputs_are_named(split_tiers):
    gemm2, e2p, w, nw, up, sh, res = make(4, *KIMI)
    kerngen.latent_tail(gemm2, e2p, w, nw, up, shared=sh, residual=res)
    cases = [
        (dict(norm_weight=nw[:-8].contiguous()), "norm_weight"),                 # a norm weight of the wrong length
        (dict(up_proj=up[:, :-8].contiguous()), "up_proj"),                       # widths that do not match
        (dict(shared=sh[:, :-8].contiguous()), "shared"),
        (dict(gemm2_out=torch.empty(gemm2.numel() + 8, dtype=BF, device="cuda")[1:1 + gemm2.numel()].view_as(gemm2)),
         "gemm2_out"),                                                           # misaligned
        (dict(expanded_to_permuted=e2p.cpu()), "expanded_to_permuted"),          # devices that do not match
        (dict(expanded_to_permuted=e2p.long()), "expanded_to_permuted"),
    ]
    base = dict(gemm2_out=gemm2, expanded_to_permuted=e2p, topk_weights=w, norm_weight=nw, up_proj=up, shared=sh,
                residual=res)
    for over, arg in cases:
        with pytest.raises(kerngen.InputError) as e:
            kerngen.latent_tail(**{**base, **over})
        assert e.value.arg == arg, (over.keys(), e.value)
    far = torch.where(e2p >= 0, e2p + gemm2.shape[0], e2p).int()    # indices past the rows: skipped, as documented
    got = kerngen.latent_tail(gemm2, far, w, nw, up, shared=sh, residual=res)
    torch.cuda.synchronize()
    assert torch.equal(got, (sh.float() + res.float()).to(BF))


# ---------------------------------------------------------------------------------------------- norm_gemm
# latent_tail_norm, torch.mm into fp32, latent_tail_add: the fused kernel's arithmetic but the dot products' (the
# library's, which under torch's default allow_bf16_reduced_precision_reduction may add split-K partials in bf16):
# the unfused tolerance, 2e-2 of the RMS.

NORM_GEMM_TIERS = """schema = 1
[[tier]]
op = "latent_tail"
variant = "norm_gemm"
tokens = [1, 512]
params = { cluster = 8, pdl = true }
"""


def norm_gemm_spec(L, H, K, wd="float32", cluster=8, **extra):   # extra: more norm_gemm params
    return spec_for(tiers.Rule(lt.OP, "norm_gemm", {}, {"cluster": cluster, "pdl": True, **extra}),
                    *lt.tag_constants(L, H, K, wd), target_arch())


@pytest.mark.parametrize("shared,residual,extra", [(True, True, {}), (True, False, {}), (False, True, {}),
                                                    (False, False, {}), (True, True, {"norm_loads": 8}),
                                                    (True, True, {"gemm_bf16": True}),
                                                    (True, True, {"gemm_bf16": True, "norm_vectors": 4,
                                                                  "norm_loads": 4, "cluster": 1}),
                                                    (False, True, {"gemm_bf16": True, "cluster": 1}),
                                                    (True, True, {"gemm_bf16": True, "norm_loads": 2, "cluster": 1}),
                                                    (True, False, {"gemm_bf16": True, "norm_vectors": 2,
                                                                   "norm_loads": 4, "cluster": 1}),
                                                    (True, True, {"gemm_bf16": True, "addmm": True}),
                                                    (True, True, {"gemm_bf16": True, "addmm": True, "cluster": 1,
                                                                  "norm_loads": 8}),
                                                    (True, False, {"gemm_bf16": True, "addmm": True, "cluster": 1}),
                                                    (False, True, {"gemm_bf16": True, "addmm": True, "cluster": 2}),
                                                    (False, False, {"gemm_bf16": True, "addmm": True})])
@pytest.mark.parametrize("T", [1, 9, 17, 64, 300])
def test_norm_gemm_kimi_k3(T, shared, residual, extra):
    args = make(T, *KIMI, shared=shared, residual=residual, seed=T)
    out = torch.full((T, KIMI[2]), float("nan"), dtype=BF, device="cuda")
    k = lt.kernel(norm_gemm_spec(*KIMI[1:], KIMI[0], **{"cluster": 8, **extra}), T, torch.cuda.current_device())
    assert type(k) is lt.NormGemm
    got = lt.run(k, *args, 1e-6, out)
    torch.cuda.synchronize()
    assert got.data_ptr() == out.data_ptr()
    close(got, reference(*args), 2e-2)


@pytest.mark.parametrize("cluster,extra", [(8, {}), (4, {}), (2, {"gemm_bf16": True}), (4, {"norm_loads": 8}),
                                           (2, {"norm_vectors": 2, "norm_loads": 4})])
@pytest.mark.parametrize("T", [1, 9, 40, 300])
def test_norm_gemm_norm_async_keeps_the_bits(T, cluster, extra):
    """norm_async: the norm CTAs of a cluster hand over their sums by st.async into an mbarrier-counted slot each,
    added in rank order as the cluster barrier's version does: the same n, so the same output bits (fresh n
    scratch each run, poisoned outputs)."""
    args = make(T, *KIMI, seed=200 + T)
    dev = torch.cuda.current_device()
    outs = []
    for na in (False, True):
        na_ = {"norm_async": True} if na else {}
        k = lt.kernel(norm_gemm_spec(*KIMI[1:], KIMI[0], cluster=cluster, **extra, **na_), T, dev)
        out = torch.full((T, KIMI[2]), float("nan"), dtype=BF, device="cuda")
        outs.append(lt.run(k, *args, 1e-6, out))
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])
    close(outs[1], reference(*args), 2e-2)


@pytest.mark.parametrize("T", [1, 33])
@pytest.mark.parametrize("K,L,H,pad,wdtype,cluster", [(8, 1024, 2048, 8, torch.float32, 4), (4, 1000, 1224, 0, BF, 1)])
def test_norm_gemm_other_shapes(T, K, L, H, pad, wdtype, cluster):
    args = make(T, K, L, H, pad=pad, wdtype=wdtype, seed=3)
    out = torch.empty(T, H, dtype=BF, device="cuda")
    k = lt.kernel(norm_gemm_spec(L, H, K, DTYPE_NAMES[wdtype], cluster), T, torch.cuda.current_device())
    close(lt.run(k, *args, 1e-6, out), reference(*args), 2e-2)


def test_norm_gemm_unaligned_outputs_take_the_same_adds():
    gemm2, e2p, w, nw, up, sh, res = make(5, *KIMI, seed=5)
    k = lt.kernel(norm_gemm_spec(*KIMI[1:], KIMI[0]), 5, torch.cuda.current_device())
    out = torch.empty(5 * KIMI[2] + 4, dtype=BF, device="cuda")[4:].view(5, KIMI[2])   # 8 bytes off
    aligned = lt.run(k, gemm2, e2p, w, nw, up, sh, res, 1e-6, torch.empty(5, KIMI[2], dtype=BF, device="cuda"))
    assert torch.equal(lt.run(k, gemm2, e2p, w, nw, up, sh, res, 1e-6, out), aligned)


@pytest.mark.parametrize("T", [3, 64, 200])
def test_norm_gemm_addmm_in_place_and_unaligned(T):
    """addmm: the norm kernel writes bf16(shared + residual) into out and torch's GEMM adds h to it (two roundings,
    as gemm_bf16's): within 2^-7 relative of gemm_bf16's result (h rounded, then the adds in fp32), in place on
    residual too; outputs not 16-byte aligned take gemm_bf16's path (the same bits as the build without addmm)."""
    gemm2, e2p, w, nw, up, sh, res = make(T, *KIMI, seed=40 + T)
    dev = torch.cuda.current_device()
    fold = lt.kernel(norm_gemm_spec(*KIMI[1:], KIMI[0], cluster=1, gemm_bf16=True, addmm=True), T, dev)
    plain = lt.kernel(norm_gemm_spec(*KIMI[1:], KIMI[0], cluster=1, gemm_bf16=True), T, dev)
    want = lt.run(plain, gemm2, e2p, w, nw, up, sh, res, 1e-6, torch.empty(T, KIMI[2], dtype=BF, device="cuda"))
    got = lt.run(fold, gemm2, e2p, w, nw, up, sh, res, 1e-6, torch.full_like(want, float("nan")))
    in_place = res.clone()
    lt.run(fold, gemm2, e2p, w, nw, up, sh, in_place, 1e-6, in_place)
    torch.cuda.synchronize()
    assert torch.equal(in_place, got)
    scale = want.float().abs() + want.float().pow(2).mean(-1, keepdim=True).sqrt()
    assert ((got.float() - want.float()).abs() <= 2 ** -7 * scale).all()
    close(got, reference(gemm2, e2p, w, nw, up, sh, res), 2e-2)
    odd = torch.empty(T * KIMI[2] + 4, dtype=BF, device="cuda")[4:].view(T, KIMI[2])   # 8 bytes off
    assert torch.equal(lt.run(fold, gemm2, e2p, w, nw, up, sh, res, 1e-6, odd), want)


@pytest.fixture
def norm_gemm_tiers(tmp_path, monkeypatch):
    with user_tiers(tmp_path, monkeypatch, NORM_GEMM_TIERS):
        yield


@pytest.mark.parametrize("T", [4, 40, 512])
def test_norm_gemm_through_dispatch_in_place_and_in_a_graph(T, norm_gemm_tiers):
    gemm2, e2p, w, nw, up, sh, res = make(T, *KIMI, seed=11)
    want = reference(gemm2, e2p, w, nw, up, sh, res)
    assert type(kimi_dispatch().kernel(T)) is lt.NormGemm
    got = kerngen.latent_tail(gemm2, e2p, w, nw, up, shared=sh, residual=res, out=res)   # residual in place
    torch.cuda.synchronize()
    assert got is res
    close(got, want, 2e-2)
    check_in_a_graph(T, 12, 2e-2)


@pytest.mark.parametrize("T", [4, 40])
def test_own_scratch_gives_the_same_bits(T):
    """Buffers of the call's own (the torch op's) instead of the stream's: the same kernels, the same bits."""
    gemm2, e2p, w, nw, up, sh, res = make(T, *KIMI, seed=21)
    kept = kerngen.latent_tail(gemm2, e2p, w, nw, up, shared=sh, residual=res)
    own = kerngen.latent_tail(gemm2, e2p, w, nw, up, shared=sh, residual=res, own_scratch=True)
    torch.cuda.synchronize()
    assert torch.equal(kept, own)
