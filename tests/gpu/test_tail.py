"""moe_tail on the GPU against the fp32 torch reference: shapes, flags, dtypes, -1 rows and CUDA graphs.

Tolerance: the kernel and the reference both compute y in fp32 (the kernel with FMA, the reference with
separate multiply and add, and a different sum-of-squares order), then round once to bf16/fp16. So outputs
agree to about one rounding step: |got - ref| <= 1e-2 + 1e-2 * |ref| after normalization (unit RMS), i.e.
1-2 bf16 ulps; residual_out (y itself, magnitudes up to ~10) within 2e-2 + 1e-2 * |ref|.
"""
import pytest
import torch

import kerngen
from kerngen.ops.tail import reference

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]
RTOL, ATOL = 1e-2, 1e-2


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
