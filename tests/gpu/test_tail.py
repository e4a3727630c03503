"""moe_tail on the GPU against the fp32 torch reference: shapes, flags, dtypes, -1 rows and CUDA graphs.

Tolerance: the kernel and the reference both compute y in fp32 (the kernel with FMA, the reference with
separate multiply and add, and a different sum-of-squares order), then round once to bf16/fp16. So outputs
agree to about one rounding step: |got - ref| <= 1e-2 + 1e-2 * |ref| after normalization (unit RMS), i.e.
1-2 bf16 ulps; residual_out (y itself, magnitudes up to ~10) within 2e-2 + 1e-2 * |ref|.

fp8 output (per token and 128 columns, see kerngen/ops/tail.py): kernel and reference quantize the same way
(amax, IEEE fp32 division by the scale, round to nearest even, saturate), so differences come only from
their fp32 n, ~1e-7 relative (a CPU simulation of FMA accumulation and another sum-of-squares order measured
at most 4.7e-7 on the scales). Checked: scales within 2e-6 relative; every value within half an e4m3 step of
the reference's n / scale (plus 2e-6 relative and 1e-5 / scale absolute for the n difference); at least
99.9% of the bytes bitwise equal (they differ only where n / scale lies at a rounding boundary); each
nonzero block's largest |value| exactly 448; no NaN.
"""
import pytest
import torch

import kerngen
from kerngen.ops.tail import reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]
RTOL, ATOL = 1e-2, 1e-2
FP8 = torch.float8_e4m3fn
SCALE_RTOL = 2e-6


def make(T, K, H, *, dtype=torch.bfloat16, wdtype=torch.float32, pad=0, skip=0.1, seed=0, rows=None,
         shared=True, residual=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = rows or max(T * K, 1)
    gemm2 = torch.randn(rows, H + pad, device="cuda", generator=g).to(dtype)
    if rows >= T * K:
        e2p = torch.randperm(rows, device="cuda", generator=g)[: T * K].view(T, K).int()
    else:
        e2p = torch.randint(0, rows, (T, K), device="cuda", generator=g, dtype=torch.int32)
    e2p = torch.where(torch.rand(T, K, device="cuda", generator=g) < skip, -1, e2p).int().contiguous()
    w = torch.rand(T, K, device="cuda", generator=g).to(wdtype)
    nw = (0.5 + torch.rand(H, device="cuda", generator=g)).to(dtype)
    sh = torch.randn(T, H, device="cuda", generator=g).to(dtype) if shared else None
    res = (3 * torch.randn(T, H, device="cuda", generator=g)).to(dtype) if residual else None
    return gemm2, e2p, w, nw, sh, res


def close(got, ref, atol=ATOL, what="out"):
    diff = (got.float() - ref.float()).abs()
    bad = diff > atol + RTOL * ref.float().abs()
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off, max abs diff {diff.max().item():.4g}"
    assert torch.isfinite(got.float()).all()


def check(gemm2, e2p, w, nw, sh, res, *, residual_out=False, out_dtype=None, eps=1e-6):
    T, H = e2p.shape[0], nw.shape[0]
    odt = out_dtype or gemm2.dtype
    out = torch.full((T, H), float("nan"), dtype=odt, device="cuda")  # poisoned
    ro = torch.full((T, H), float("nan"), dtype=gemm2.dtype, device="cuda") if residual_out else None
    got = kerngen.moe_tail(gemm2, e2p, w, nw, eps=eps, shared=sh, residual=res, residual_out=ro, out=out,
                           out_dtype=out_dtype)
    ref, y = reference(gemm2, e2p, w, nw, eps=eps, shared=sh, residual=res, out_dtype=out_dtype)
    assert got.data_ptr() == out.data_ptr()
    close(got, ref)
    if residual_out:
        close(ro, y, atol=2e-2, what="residual_out")


@pytest.mark.parametrize("K", [1, 4, 8, 10, 16, 22])
@pytest.mark.parametrize("T", [1, 3, 8, 64, 65, 513, 4096])
def test_vs_reference_kimi_width(T, K):
    check(*make(T, K, 3584, seed=T * 100 + K))


@pytest.mark.parametrize("H", [2048, 2880, 3584, 4096, 5120, 7168])
@pytest.mark.parametrize("T", [1, 8, 64, 1024, 8192])
def test_hidden_sizes(H, T):
    check(*make(T, 8, H, seed=H + T, rows=min(T * 8, 20000)))


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("residual_out", [False, True])
@pytest.mark.parametrize("T", [2, 300])
def test_flags(shared, residual, residual_out, T):
    check(*make(T, 8, 7168, seed=T, shared=shared, residual=residual), residual_out=residual_out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16, torch.float16])
def test_dtypes(dtype, wdtype, out_dtype):
    check(*make(33, 16, 2048, dtype=dtype, wdtype=wdtype, seed=5), out_dtype=out_dtype, residual_out=True)


def test_padded_gemm2_rows_and_out_of_range_index():
    gemm2, e2p, w, nw, sh, res = make(5, 8, 2880, pad=64, seed=7, skip=0.0)
    e2p[0, 3] = gemm2.shape[0]
    e2p[1, 0] = 2**31 - 1
    check(gemm2, e2p, w, nw, sh, res)


def test_all_rows_skipped_and_nan_weights_on_skipped_slots():
    gemm2, e2p, w, nw, sh, res = make(6, 8, 1024, skip=0.0, seed=9)
    e2p[:, ::2] = -1
    w[:, ::2] = float("nan")
    check(gemm2, e2p, w, nw, sh, res)
    e2p.masked_fill_(e2p == 0, -1)
    gemm2[0] = float("nan")  # skipped slots read row 0 as a stand-in; it must not leak
    check(gemm2, e2p, w, nw, sh, res)
    e2p.fill_(-1)
    check(gemm2, e2p, w, nw, sh, res)


def test_empty_gemm2_out():
    _, _, w, nw, sh, res = make(3, 4, 1024)
    gemm2 = torch.empty(0, 1024, dtype=torch.bfloat16, device="cuda")
    e2p = torch.full((3, 4), -1, dtype=torch.int32, device="cuda")
    check(gemm2, e2p, w, nw, sh, res)


def test_residual_updated_in_place():
    gemm2, e2p, w, nw, sh, res = make(40, 8, 4096, seed=4)
    ref, y = reference(gemm2, e2p, w, nw, shared=sh, residual=res)
    got = kerngen.moe_tail(gemm2, e2p, w, nw, shared=sh, residual=res, residual_out=res)
    close(got, ref)
    close(res, y, atol=2e-2, what="residual (in place)")


@pytest.mark.parametrize("T", [1, 8, 64, 4096])
@pytest.mark.parametrize("H,K", [(3584, 16), (7168, 8)])
def test_inside_cuda_graph(T, H, K):
    gemm2, e2p, w, nw, sh, res = make(T, K, H, seed=11)
    out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
    ro = torch.empty_like(out)
    kerngen.moe_tail(gemm2, e2p, w, nw, shared=sh, residual=res, residual_out=ro, out=out)  # build outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kerngen.moe_tail(gemm2, e2p, w, nw, shared=sh, residual=res, residual_out=ro, out=out)
    for seed in range(3):  # new inputs in the same buffers, replayed
        new = make(T, K, H, seed=100 + seed)
        for dst, src in zip((gemm2, e2p, w, nw, sh, res), new):
            dst.copy_(src)
        out.fill_(float("nan")); ro.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref, y = reference(gemm2, e2p, w, nw, shared=sh, residual=res)
        close(out, ref)
        close(ro, y, atol=2e-2, what="residual_out")


def test_slow_producer_before_tail():
    """A busy kernel writes the indices right before the tail (which may launch early with PDL)."""
    gemm2, e2p, w, nw, sh, res = make(8, 16, 3584, seed=5, skip=0.0)
    late = torch.full_like(e2p, -1)
    for _ in range(3):
        late.fill_(-1)
        torch.cuda._sleep(2_000_000)
        late.copy_(e2p)
        got = kerngen.moe_tail(gemm2, late, w, nw, shared=sh, residual=res)
        close(got, reference(gemm2, e2p, w, nw, shared=sh, residual=res)[0])


def test_zero_tokens():
    gemm2, _, _, nw, _, _ = make(1, 8, 1024)
    e2p = torch.empty(0, 8, dtype=torch.int32, device="cuda")
    assert kerngen.moe_tail(gemm2, e2p, torch.empty(0, 8, device="cuda"), nw).shape == (0, 1024)


def test_bad_inputs_raise_named_errors():
    gemm2, e2p, w, nw, sh, res = make(4, 8, 1024)
    cases = [
        ((gemm2.float(), e2p, w, nw), {}, "gemm2_out"),
        ((gemm2, e2p.long(), w, nw), {}, "expanded_to_permuted"),
        ((gemm2, e2p, w[:, :4].contiguous(), nw), {}, "topk_weights"),
        ((gemm2, e2p, w.double(), nw), {}, "topk_weights"),
        ((gemm2, e2p.cpu(), w, nw), {}, "expanded_to_permuted"),
        ((gemm2.t(), e2p, w, nw), {}, "gemm2_out"),
        ((gemm2, e2p, w, nw.half()), {}, "norm_weight"),
        ((gemm2, e2p, w, nw[:1020]), {}, "norm_weight"),
        ((gemm2, e2p, w, torch.ones(1032, dtype=torch.bfloat16, device="cuda")), {}, "norm_weight"),
        ((gemm2, torch.zeros(4, 33, dtype=torch.int32, device="cuda"), torch.zeros(4, 33, device="cuda"), nw), {},
         "expanded_to_permuted"),
        ((gemm2, e2p, w, nw), {"shared": sh[:3]}, "shared"),
        ((gemm2, e2p, w, nw), {"residual": res.half()}, "residual"),
        ((gemm2, e2p, w, nw), {"residual": res.t().contiguous().t()}, "residual"),
        ((gemm2, e2p, w, nw), {"residual_out": torch.empty(4, 1000, dtype=torch.bfloat16, device="cuda")},
         "residual_out"),
        ((gemm2, e2p, w, nw), {"out_dtype": torch.float32}, "out_dtype"),
        ((gemm2, e2p, w, nw), {"out": torch.empty(4, 1000, dtype=torch.bfloat16, device="cuda")}, "out"),
        ((gemm2, e2p, w, nw), {"out": torch.empty(4, 1024, dtype=torch.float16, device="cuda")}, "out"),
        ((gemm2, e2p, w, nw), {"out": torch.empty(4 * 1024 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(4, 1024)},
         "out"),
    ]
    for args, kw, name in cases:
        with pytest.raises(kerngen.InputError, match=name):
            kerngen.moe_tail(*args, **kw)


# ------------------------------------------------------------------------------------------ fp8 output
def e4m3_step(x):
    """Spacing of e4m3fn values at |x| (3 mantissa bits; subnormal spacing 2^-9 below 2^-6)."""
    return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -6))) - 3)


def close_fp8(got, got_scales, n, ref_q, ref_scales):
    """got/got_scales: the kernel's; n: the reference's fp32 normalized rows; ref_q/ref_scales: its quantization."""
    T, H = n.shape
    assert got.dtype == FP8 and got.shape == (T, H) and got.is_contiguous()
    assert got_scales.dtype == torch.float32 and got_scales.shape == (T, H // 128) and got_scales.is_contiguous()
    assert torch.isfinite(got_scales).all() and (got_scales > 0).all(), "scales: NaN, inf or <= 0"
    srel = ((got_scales - ref_scales).abs() / ref_scales).max().item()
    assert srel <= SCALE_RTOL, f"scales: max relative diff {srel:.3g}"
    q = got.float().view(T, H // 128, 128)
    assert not torch.isnan(q).any(), "out: NaN bytes (unwritten or not saturated)"
    s = got_scales[..., None]
    x = n.view(T, H // 128, 128) / s  # the reference's values in the kernel's scale
    err = (q - x).abs()
    tol = 0.5 * e4m3_step(x) + 2e-6 * x.abs() + 1e-5 / s
    bad = err > tol
    assert not bad.any(), f"out: {int(bad.sum())} values off by more than half an e4m3 step, max {err.max().item():.4g}"
    same = (got.view(torch.uint8) == ref_q.view(torch.uint8)).float().mean().item()
    assert same >= 0.999, f"out: only {same:.5f} of the bytes equal the reference's"
    block_max = q.abs().amax(-1)
    zero = n.view(T, H // 128, 128).abs().amax(-1) == 0
    assert ((block_max == 448) | (zero & (block_max == 0))).all(), "a block's largest value is not 448"


def check_fp8(gemm2, e2p, w, nw, sh, res, *, residual_out=False, eps=1e-6, buffers=True):
    T, H = e2p.shape[0], nw.shape[0]
    out = scales = ro = None
    if buffers:  # poisoned: NaN bytes and NaN scales
        out = torch.empty(T, H, dtype=FP8, device="cuda")
        out.view(torch.uint8).fill_(0x7F)
        scales = torch.full((T, H // 128), float("nan"), device="cuda")
    if residual_out:
        ro = torch.full((T, H), float("nan"), dtype=gemm2.dtype, device="cuda")
    got, got_scales = kerngen.moe_tail(gemm2, e2p, w, nw, eps=eps, shared=sh, residual=res, residual_out=ro,
                                       out=out, out_dtype=FP8, out_scales=scales)
    if buffers:
        assert got.data_ptr() == out.data_ptr() and got_scales.data_ptr() == scales.data_ptr()
    (ref_q, ref_scales), y = reference(gemm2, e2p, w, nw, eps=eps, shared=sh, residual=res, out_dtype=FP8)
    n, _ = reference(gemm2, e2p, w, nw, eps=eps, shared=sh, residual=res, out_dtype=torch.float32)
    close_fp8(got, got_scales, n, ref_q, ref_scales)
    if residual_out:
        close(ro, y, atol=2e-2, what="residual_out")


@pytest.mark.parametrize("extras", [False, True], ids=["plain", "shared+residual"])
@pytest.mark.parametrize("K", [8, 16])
@pytest.mark.parametrize("H", [2048, 3584, 7168])
@pytest.mark.parametrize("T", [1, 8, 64, 512])
def test_fp8_vs_reference(T, H, K, extras):
    check_fp8(*make(T, K, H, seed=T * 31 + H + K, shared=extras, residual=extras))


@pytest.mark.parametrize("shared,residual", [(True, False), (False, True)])
@pytest.mark.parametrize("residual_out", [False, True])
@pytest.mark.parametrize("T", [5, 300])
def test_fp8_flags(shared, residual, residual_out, T):
    check_fp8(*make(T, 8, 7168, seed=T, shared=shared, residual=residual), residual_out=residual_out)


@pytest.mark.parametrize("dtype,wdtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_fp8_from_other_input_dtypes(dtype, wdtype):
    check_fp8(*make(33, 16, 2048, dtype=dtype, wdtype=wdtype, seed=6), residual_out=True)


def test_fp8_allocates_out_and_scales():
    check_fp8(*make(9, 8, 4096, seed=2), buffers=False)


def test_fp8_zero_rows_skipped_slots_and_padded_gemm2():
    gemm2, e2p, w, nw, _, _ = make(6, 8, 1024, pad=128, skip=0.0, seed=9)
    e2p[:, ::2] = -1
    w[:, ::2] = float("nan")
    e2p[5] = -1  # no expert and no shared/residual: y = 0, every scale is 1e-12 / 448, every value 0
    check_fp8(gemm2, e2p, w, nw, None, None)
    got, scales = kerngen.moe_tail(gemm2, e2p, w, nw, out_dtype=FP8)
    assert (got[5].float() == 0).all() and (scales[5] == torch.tensor(1e-12) / 448).all()


@pytest.mark.parametrize("T", [1, 512])
def test_fp8_inside_cuda_graph(T):
    H, K = 7168, 8
    gemm2, e2p, w, nw, sh, res = make(T, K, H, seed=12)
    out = torch.empty(T, H, dtype=FP8, device="cuda")
    scales = torch.empty(T, H // 128, device="cuda")
    kw = dict(shared=sh, residual=res, out=out, out_dtype=FP8, out_scales=scales)
    kerngen.moe_tail(gemm2, e2p, w, nw, **kw)  # build outside
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kerngen.moe_tail(gemm2, e2p, w, nw, **kw)
    for seed in range(3):  # new inputs in the same buffers, replayed
        for dst, src in zip((gemm2, e2p, w, nw, sh, res), make(T, K, H, seed=200 + seed)):
            dst.copy_(src)
        out.view(torch.uint8).fill_(0x7F); scales.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        (ref_q, ref_scales), _ = reference(gemm2, e2p, w, nw, shared=sh, residual=res, out_dtype=FP8)
        n, _ = reference(gemm2, e2p, w, nw, shared=sh, residual=res, out_dtype=torch.float32)
        close_fp8(out, scales, n, ref_q, ref_scales)


def test_fp8_bad_inputs_raise_named_errors():
    gemm2, e2p, w, nw, sh, res = make(4, 8, 1024)
    fp8 = {"out_dtype": FP8}
    g2880, e2880, w2880, nw2880, _, _ = make(4, 8, 2880)
    cases = [
        ((g2880, e2880, w2880, nw2880), fp8, "norm_weight"),  # H not a multiple of 128
        ((gemm2, e2p, w, nw), {**fp8, "out": torch.empty(4, 1024, dtype=torch.bfloat16, device="cuda")}, "out"),
        ((gemm2, e2p, w, nw), {**fp8, "out": torch.empty(4 * 1024 + 1, dtype=FP8, device="cuda")[1:].view(4, 1024)},
         "out"),
        ((gemm2, e2p, w, nw), {**fp8, "out_scales": torch.empty(4, 8, dtype=torch.float16, device="cuda")},
         "out_scales"),
        ((gemm2, e2p, w, nw), {**fp8, "out_scales": torch.empty(4, 16, device="cuda")}, "out_scales"),
        ((gemm2, e2p, w, nw), {**fp8, "out_scales": torch.empty(8, 4, device="cuda").t()}, "out_scales"),
        ((gemm2, e2p, w, nw), {**fp8, "out_scales": torch.empty(4, 8)}, "out_scales"),
        ((gemm2, e2p, w, nw), {"out_scales": torch.empty(4, 8, device="cuda")}, "out_scales"),
    ]
    for args, kw, name in cases:
        with pytest.raises(kerngen.InputError, match=f"argument '{name}'"):
            kerngen.moe_tail(*args, **kw)


# --------------------------------------------------------------------------- configurations beyond the tiers
TUNED_CONFIGS = [dict(threads=1024, branch_free=False), dict(threads=512, branch_free=True),
                 dict(threads=256, branch_free=False)]


def tail_function(H, K, params, odtype="bfloat16", flags=(True, True, True)):
    """The tail kernel for launch parameters `kerngen tune` may pick, as tune builds it."""
    from kerngen.ops import tail
    from kerngen.plan import target_arch
    params = {"backend": "cute", "cluster": 1, "max_loads": 32, "pdl": True, **params}
    return tail.kernel(tail.params_spec(params, H, K, "bfloat16", "float32", odtype, flags, target_arch()))


@pytest.mark.parametrize("params", TUNED_CONFIGS, ids=lambda p: f"t{p['threads']}-bf{int(p['branch_free'])}")
@pytest.mark.parametrize("H,K", [(3584, 16), (7168, 8), (2880, 4)])
@pytest.mark.parametrize("T", [1, 3, 130])
def test_configurations_tune_may_pick(params, H, K, T):
    """Thread counts and branch modes beyond the shipped rules, against the reference, with -1 slots,
    residual_out and, where H allows, the fp8 output."""
    gemm2, e2p, w, nw, sh, res = make(T, K, H, seed=T * 7 + H + K, skip=0.2)
    out = torch.full((T, H), float("nan"), dtype=gemm2.dtype, device="cuda")
    ro = torch.full((T, H), float("nan"), dtype=gemm2.dtype, device="cuda")
    tail_function(H, K, params)(gemm2, e2p, w, sh, res, nw, out, None, ro, 1e-6)
    torch.cuda.synchronize()
    ref, y = reference(gemm2, e2p, w, nw, eps=1e-6, shared=sh, residual=res)
    close(out, ref)
    close(ro, y, atol=2e-2, what="residual_out")
    if H % 128 == 0:
        out8 = torch.full((T, H), float("nan"), dtype=FP8, device="cuda")
        scales = torch.full((T, H // 128), float("nan"), device="cuda")
        tail_function(H, K, params, "float8_e4m3fn", (True, True, False))(gemm2, e2p, w, sh, res, nw, out8, scales,
                                                                           None, 1e-6)
        torch.cuda.synchronize()
        (ref_q, ref_scales), _ = reference(gemm2, e2p, w, nw, shared=sh, residual=res, out_dtype=FP8)
        n, _ = reference(gemm2, e2p, w, nw, shared=sh, residual=res, out_dtype=torch.float32)
        close_fp8(out8, scales, n, ref_q, ref_scales)


@pytest.mark.parametrize("cluster,threads,max_loads", [(8, 128, 32), (4, 128, 32), (2, 128, 16), (4, 128, 8)])
@pytest.mark.parametrize("H,K", [(3584, 16), (7168, 8), (5120, 1), (2880, 4)])
@pytest.mark.parametrize("T", [1, 5, 130])
def test_async_reduce_keeps_the_bits(cluster, threads, max_loads, H, K, T):
    """async_reduce: the cluster's partial sums by st.async into mbarrier-counted slots, added in rank order as
    the cluster-barrier build adds them: the same output, residual_out and fp8 bits (poisoned outputs)."""
    gemm2, e2p, w, nw, sh, res = make(T, K, H, seed=T * 5 + H + K + cluster, skip=0.2)
    got = []
    for fast in (False, True):
        params = dict(cluster=cluster, threads=threads, max_loads=max_loads, branch_free=True,
                      **({"async_reduce": True} if fast else {}))
        out = torch.full((T, H), float("nan"), dtype=gemm2.dtype, device="cuda")
        ro = torch.full((T, H), float("nan"), dtype=gemm2.dtype, device="cuda")
        tail_function(H, K, params)(gemm2, e2p, w, sh, res, nw, out, None, ro, 1e-6)
        got += [out, ro]
        if H % 128 == 0:
            out8 = torch.full((T, H), float("nan"), dtype=FP8, device="cuda")
            scales = torch.full((T, H // 128), float("nan"), device="cuda")
            tail_function(H, K, params, "float8_e4m3fn", (True, True, False))(gemm2, e2p, w, sh, res, nw, out8,
                                                                               scales, None, 1e-6)
            got += [out8.view(torch.uint8), scales]
    torch.cuda.synchronize()
    half = len(got) // 2
    for a, b in zip(got[:half], got[half:]):
        assert torch.equal(a, b)
    close(got[half], reference(gemm2, e2p, w, nw, eps=1e-6, shared=sh, residual=res)[0])
