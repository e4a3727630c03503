"""finalize on the GPU against the torch reference: bitwise, over shapes, dtypes, -1 rows and graphs."""
import pytest
import torch

import kerngen
from kerngen.ops.finalize import reference
from tests.helpers import CUTE_FINALIZE_TIERS

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]


def make(T, K, H, *, dtype=torch.bfloat16, wdtype=torch.float32, pad=0, skip=0.1, seed=0, rows=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = rows or max(T * K, 1)
    gemm2 = torch.randn(rows, H + pad, device="cuda", generator=g).to(dtype)
    e2p = torch.randperm(rows, device="cuda", generator=g)[: T * K].view(T, K).int() if rows >= T * K else \
        torch.randint(0, rows, (T, K), device="cuda", generator=g, dtype=torch.int32)
    e2p = torch.where(torch.rand(T, K, device="cuda", generator=g) < skip, -1, e2p).int().contiguous()
    w = torch.rand(T, K, device="cuda", generator=g).to(wdtype)
    return gemm2, e2p, w


def check(gemm2, e2p, w, H=None):
    H = H or gemm2.shape[1]
    out = torch.full((e2p.shape[0], H), float("nan"), dtype=gemm2.dtype, device="cuda")  # poisoned
    got = kerngen.finalize(gemm2, e2p, w, hidden=H, out=out)
    ref = reference(gemm2, e2p, w, H)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), \
        f"max abs diff {(got.float() - ref.float()).abs().max().item()}"


@pytest.mark.parametrize("K", [1, 2, 4, 6, 8, 10, 16, 22, 32])
@pytest.mark.parametrize("T", [1, 3, 8, 33, 257, 4096])
def test_bitwise_vs_reference(T, K):
    check(*make(T, K, 3584, seed=T * 100 + K))


@pytest.mark.parametrize("H", [8, 1024, 2048, 2880, 4096, 5120, 7168])
@pytest.mark.parametrize("T", [1, 16, 64, 1024, 8192])
def test_hidden_sizes(H, T):
    K = 8
    check(*make(T, K, H, seed=H + T, rows=min(T * K, 20000)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [2, 512])
def test_dtypes(dtype, wdtype, T):
    check(*make(T, 16, 2048, dtype=dtype, wdtype=wdtype, seed=T))


@pytest.mark.parametrize("T", [1, 100])
def test_padded_stride_and_explicit_hidden(T):
    gemm2, e2p, w = make(T, 8, 2880, pad=64, seed=7)
    check(gemm2, e2p, w)               # H = width
    check(gemm2, e2p, w, H=2880)       # H < width: only the first H columns are read


def test_all_rows_skipped_gives_zero():
    gemm2, e2p, w = make(5, 8, 1024, skip=1.0)
    got = kerngen.finalize(gemm2, e2p, w)
    assert torch.equal(got, torch.zeros_like(got))


def test_out_of_range_index_is_skipped_not_a_fault():
    gemm2, e2p, w = make(4, 8, 1024, skip=0.0)
    e2p[0, 3] = gemm2.shape[0]
    e2p[1, 0] = 2**31 - 1
    check(gemm2, e2p, w)
    torch.cuda.synchronize()


def test_stable_across_runs():
    gemm2, e2p, w = make(777, 16, 3584, seed=3)
    a = kerngen.finalize(gemm2, e2p, w)
    for _ in range(3):
        assert torch.equal(kerngen.finalize(gemm2, e2p, w).view(torch.int16), a.view(torch.int16))


@pytest.mark.parametrize("T", [1, 8, 4096])
def test_inside_cuda_graph(T):
    gemm2, e2p, w = make(T, 16, 3584, seed=11)
    out = torch.empty(T, 3584, dtype=torch.bfloat16, device="cuda")
    kerngen.finalize(gemm2, e2p, w, out=out)  # compile + load outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kerngen.finalize(gemm2, e2p, w, out=out)
    for seed in range(3):  # new inputs in the same buffers, replayed
        g2, e2, w2 = make(T, 16, 3584, seed=100 + seed)
        gemm2.copy_(g2); e2p.copy_(e2); w.copy_(w2)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), reference(gemm2, e2p, w).view(torch.int16))


def test_pdl_chain_with_slow_producer():
    """A slow kernel writes the indices right before finalize: finalize must wait for it (PDL safety)."""
    T, K, H = 8, 16, 3584
    gemm2, e2p, w = make(T, K, H, seed=5, skip=0.0)
    e2p_late = torch.full_like(e2p, -1)
    for _ in range(5):
        e2p_late.fill_(-1)
        torch.cuda._sleep(2_000_000)              # the producer is busy for ~1 ms...
        e2p_late.copy_(e2p)                       # ...then writes the routing data
        got = kerngen.finalize(gemm2, e2p_late, w)
        assert torch.equal(got.view(torch.int16), reference(gemm2, e2p, w).view(torch.int16))


def test_bad_inputs_raise_named_errors():
    gemm2, e2p, w = make(4, 8, 1024)
    cases = [
        ((gemm2.float(), e2p, w), "gemm2_out"),
        ((gemm2, e2p.long(), w), "expanded_to_permuted"),
        ((gemm2, e2p, w[:, :4].contiguous()), "topk_weights"),
        ((gemm2, e2p, w.double()), "topk_weights"),
        ((gemm2, e2p.cpu(), w), "expanded_to_permuted"),
        ((gemm2[:, 1:], e2p, w), "gemm2_out"),
        ((gemm2.t(), e2p, w), "gemm2_out"),
        ((gemm2, e2p[:, ::2], w[:, ::2]), "expanded_to_permuted"),
        ((gemm2, torch.zeros(4, 65, dtype=torch.int32, device="cuda"), torch.zeros(4, 65, device="cuda")),
         "expanded_to_permuted"),
    ]
    for args, name in cases:
        with pytest.raises(kerngen.InputError, match=name):
            kerngen.finalize(*args)
    with pytest.raises(kerngen.InputError, match="hidden"):
        kerngen.finalize(gemm2, e2p, w, hidden=1030)
    with pytest.raises(kerngen.InputError, match="out"):
        kerngen.finalize(gemm2, e2p, w, out=torch.empty(4, 1000, dtype=torch.bfloat16, device="cuda"))
    with pytest.raises(kerngen.InputError, match="out"):
        kerngen.finalize(gemm2, e2p, w, out=torch.empty(4, 1024, dtype=torch.float16, device="cuda"))


def test_zero_tokens():
    gemm2, _, _ = make(1, 8, 1024)
    e2p = torch.empty(0, 8, dtype=torch.int32, device="cuda")
    assert kerngen.finalize(gemm2, e2p, torch.empty(0, 8, device="cuda")).shape == (0, 1024)


def test_pdl_back_to_back_kernels():
    """Two PDL launches in a row: the second reads what the first writes, so it must wait for it."""
    T, K, H = 16, 8, 2048
    for seed in range(5):
        gemm2, e2p, w = make(T, K, H, seed=seed, skip=0.0)
        idx2 = torch.randint(0, T, (T, 4), device="cuda", dtype=torch.int32)
        w2 = torch.rand(T, 4, device="cuda")
        torch.cuda._sleep(1_000_000)
        mid = kerngen.finalize(gemm2, e2p, w)
        got = kerngen.finalize(mid, idx2, w2)
        ref = reference(reference(gemm2, e2p, w), idx2, w2)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


@pytest.mark.parametrize("T,K,H", [(1, 16, 3584), (8, 8, 7168), (600, 22, 2048)])
def test_prepared_run_matches_and_follows_the_buffers(T, K, H):
    """finalize_prepare binds the tensors once; run() sees new contents of the same buffers, also in a graph."""
    gemm2, e2p, w = make(T, K, H, seed=21)
    prepared = kerngen.finalize_prepare(gemm2, e2p, w)
    assert prepared.out.shape == (T, H) and prepared.out.dtype == gemm2.dtype
    assert torch.equal(prepared.run().view(torch.int16), reference(gemm2, e2p, w).view(torch.int16))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        prepared.run()
    g2, e2, w2 = make(T, K, H, seed=22)
    gemm2.copy_(g2); e2p.copy_(e2); w.copy_(w2)
    prepared.out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(prepared.out.view(torch.int16), reference(gemm2, e2p, w).view(torch.int16))


def test_prepare_rejects_bad_inputs_like_finalize():
    gemm2, e2p, w = make(4, 8, 256)
    with pytest.raises(kerngen.InputError, match="topk_weights"):
        kerngen.finalize_prepare(gemm2, e2p, w[:, :4].contiguous())
    with pytest.raises(kerngen.InputError, match="'out'"):
        kerngen.finalize_prepare(gemm2, e2p, w, out=torch.empty(4, 255, dtype=gemm2.dtype, device="cuda"))


# --------------------------------------------------------------------------- the CuTe DSL variant
@pytest.fixture
def cute_tiers(tmp_path, monkeypatch):
    """Every finalize of the test goes through templates/finalize/cute.py (a user tiers file picks it)."""
    from kerngen.ops import finalize as fin
    path = tmp_path / "cute.toml"
    path.write_text(CUTE_FINALIZE_TIERS)
    monkeypatch.setenv("KERNGEN_TIERS", str(path))
    kerngen.clear()
    yield fin
    kerngen.clear()


def uses_cute(fin):
    """finalize dispatches to the CuTe DSL kernel under the active tiers: its kernel for kimi-k3's shape is one."""
    from kerngen.plan import target_arch
    spec = fin.spec(3584, 16, "bfloat16", "float32", 1, target_arch())
    return spec.variant == "cute" and type(fin.kernel(spec, 1, torch.cuda.current_device())).__name__ == "_Cute"


@pytest.mark.parametrize("K", [1, 4, 8, 16, 22, 32])
@pytest.mark.parametrize("T", [1, 3, 16, 17, 300])
def test_cute_variant_is_bitwise_equal_to_the_reference(cute_tiers, T, K):
    check(*make(T, K, 3584, seed=T * 31 + K))
    assert uses_cute(cute_tiers)


@pytest.mark.parametrize("H", [8, 2048, 2880, 7168])
@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
def test_cute_variant_shapes_and_dtypes(cute_tiers, H, dtype, wdtype):
    for T in (1, 40):
        check(*make(T, 8, H, dtype=dtype, wdtype=wdtype, seed=H + T))
    gemm2, e2p, w = make(5, 8, H, pad=64, seed=3)   # padded row stride, explicit hidden
    check(gemm2, e2p, w, H=H)
    assert uses_cute(cute_tiers)


def test_cute_variant_matches_the_cuda_kernels_and_skips_bad_rows(cute_tiers, monkeypatch):
    gemm2, e2p, w = make(64, 16, 3584, seed=9, skip=0.3)
    e2p[0, 0], e2p[1, 3] = gemm2.shape[0], 1 << 30   # out of range: skipped, never a fault
    got = kerngen.finalize(gemm2, e2p, w)
    assert uses_cute(cute_tiers)
    kerngen.clear()
    monkeypatch.delenv("KERNGEN_TIERS")   # the shipped CUDA C++ rules
    cuda = kerngen.finalize(gemm2, e2p, w)
    assert not uses_cute(cute_tiers)
    assert torch.equal(got.view(torch.int16), cuda.view(torch.int16))
    assert torch.equal(got.view(torch.int16), reference(gemm2, e2p, w).view(torch.int16))


def test_cute_variant_no_rows_and_no_tokens(cute_tiers):
    gemm2 = torch.empty(0, 256, dtype=torch.bfloat16, device="cuda")
    e2p = torch.full((3, 4), -1, dtype=torch.int32, device="cuda")
    w = torch.rand(3, 4, device="cuda")
    assert torch.equal(kerngen.finalize(gemm2, e2p, w), torch.zeros(3, 256, dtype=torch.bfloat16, device="cuda"))
    empty = kerngen.finalize(*make(1, 4, 256)[:1], torch.empty(0, 4, dtype=torch.int32, device="cuda"),
                             torch.empty(0, 4, device="cuda"))
    assert empty.shape == (0, 256)


@pytest.mark.parametrize("T", [1, 4096])
def test_cute_variant_in_a_graph_and_prepared(cute_tiers, T):
    gemm2, e2p, w = make(T, 16, 3584, seed=13)
    prepared = kerngen.finalize_prepare(gemm2, e2p, w)
    out = torch.empty(T, 3584, dtype=torch.bfloat16, device="cuda")
    kerngen.finalize(gemm2, e2p, w, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kerngen.finalize(gemm2, e2p, w, out=out)
        prepared.run()
    g2, e2, w2 = make(T, 16, 3584, seed=14)
    gemm2.copy_(g2); e2p.copy_(e2); w.copy_(w2)
    out.fill_(float("nan"))
    prepared.out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = reference(gemm2, e2p, w).view(torch.int16)
    assert torch.equal(out.view(torch.int16), ref) and torch.equal(prepared.out.view(torch.int16), ref)
    assert uses_cute(cute_tiers)


@pytest.mark.parametrize("params", [dict(block_x=32, loads_per_group=8), dict(block_x=16, loads_per_group=2),
                                    dict(block_x=8, loads_per_group=1)])
@pytest.mark.parametrize("K", [1, 4, 16])
@pytest.mark.parametrize("T", [1, 8, 40])
def test_small_batch_rows_with_the_default_cache_policy_give_the_same_bits(params, K, T):
    """stream = false (rows read without the evict-first hint) is the same kernel otherwise: the reference's bits."""
    from kerngen.launch import current_stream
    from kerngen.ops import finalize as fin
    from kerngen.plan import spec_for, target_arch
    from kerngen.tiers import Rule
    g, e2p, w = make(T, K, 2880, seed=T * 10 + K)
    rule = Rule(op="finalize", variant="small_batch", ranges={}, params=dict(pdl=False, early_read=False, stream=False,
                                                                              **params))
    spec = spec_for(rule, *fin.tag_constants(2880, K, "bfloat16", "float32"), target_arch(0))
    out = torch.full((T, 2880), float("nan"), dtype=torch.bfloat16, device="cuda")
    fin.bound(fin.kernel(spec, T, 0), g, e2p, w, out, 2880)(current_stream(0))
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), reference(g, e2p, w).view(torch.int16))
