"""Tensor-parallel tail on GPUs, under torchrun (skipped anywhere else):

    torchrun --nproc-per-node 2 -m pytest -q -m gpu tests/gpu/test_tail_tp.py     (also 4, 8)

Each rank builds every rank's partial inputs from fixed seeds, runs moe_tail(..., group=WORLD) on its own, and
compares with the single-GPU kernel over all ranks' rows at once (the summed inputs). Tolerance: the partials
are rounded to bf16 before the collective, so 2e-2 of the row's RMS (the CPU orchestration test states why).
"""
import os

import pytest
import torch

import kerngen
from kerngen.ops import tail_tp

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")              # never NVLink multicast on shared machines
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(WORLD < 2 or not torch.cuda.is_available(), reason="needs torchrun with >= 2 GPUs")]


@pytest.fixture(scope="module")
def group():
    import torch.distributed as dist
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    yield dist.group.WORLD
    dist.destroy_process_group()


def partials(T, K, H, r, seed):
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + r)
    rows = T * K
    gemm2 = torch.randn(rows, H, device="cuda", generator=g).to(torch.bfloat16)
    e2p = torch.randperm(rows, device="cuda", generator=g).view(T, K).int()
    w = torch.rand(T, K, device="cuda", generator=g)
    shared = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
    return gemm2, e2p, w, shared


def summed(T, K, H, seed):
    parts = [partials(T, K, H, r, seed) for r in range(WORLD)]
    gemm2 = torch.cat([p[0] for p in parts])
    e2p = torch.cat([p[1] + r * T * K for r, p in enumerate(parts)], dim=1).int().contiguous()
    w = torch.cat([p[2] for p in parts], dim=1).contiguous()
    shared = sum(p[3].float() for p in parts).to(torch.bfloat16)
    return gemm2, e2p, w, shared


def common(T, H, seed):
    g = torch.Generator(device="cuda").manual_seed(seed * 1000 + 999)
    return (torch.rand(H, device="cuda", generator=g).to(torch.bfloat16),
            torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16))


def close(got, want):
    scale = want.float().pow(2).mean(-1, keepdim=True).sqrt()
    return ((got.float() - want.float()).abs() / (scale + want.float().abs())).max().item() < 2e-2


@pytest.mark.parametrize("T", [1, 8, 64, 512])
@pytest.mark.parametrize("K,H", [(16, 3584), (8, 7168)])
def test_tp_tail_equals_single_gpu_on_summed_inputs(group, T, K, H):
    rank = torch.distributed.get_rank()
    gemm2, e2p, w, shared = partials(T, K, H, rank, seed=T)
    nw, res = common(T, H, seed=T)
    res_out = torch.empty_like(res)
    out = kerngen.moe_tail(gemm2, e2p, w, nw, shared=shared, residual=res, residual_out=res_out, group=group)
    sg, se, sw, ss = summed(T, K, H, seed=T)
    assert close(out, kerngen.moe_tail(sg, se, sw, nw, shared=ss, residual=res))
    gathered = [torch.empty_like(out) for _ in range(WORLD)]
    torch.distributed.all_gather(gathered, out, group=group)
    assert all(torch.equal(g, out) for g in gathered)            # every rank holds the same output


@pytest.mark.parametrize("T", [1, 8])
def test_tp_tail_in_a_cuda_graph(group, T):
    K, H = 16, 3584
    rank = torch.distributed.get_rank()
    gemm2, e2p, w, shared = partials(T, K, H, rank, seed=50)
    nw, res = common(T, H, seed=50)
    out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
    kerngen.moe_tail(gemm2, e2p, w, nw, shared=shared, residual=res, out=out, group=group)   # warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kerngen.moe_tail(gemm2, e2p, w, nw, shared=shared, residual=res, out=out, group=group)
    g2, e2, w2, s2 = partials(T, K, H, rank, seed=51)
    gemm2.copy_(g2); e2p.copy_(e2); w.copy_(w2); shared.copy_(s2)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    sg, se, sw, ss = summed(T, K, H, seed=51)
    assert close(out, kerngen.moe_tail(sg, se, sw, nw, shared=ss, residual=res))


SYMM_TIERS = ('schema = 1\n\n[[tier]]\nop = "tail_tp"\nvariant = "allreduce"\ntokens = [1, 64]\n'
              'params = { allreduce = "symm_mem", max_tokens = 64 }\n')


def test_tp_tail_with_symmetric_memory(group, tmp_path, monkeypatch):
    """A tail_tp rule asking for symmetric memory: the buffer is exchanged once, kept by the dispatch object of the
    shape (every later call takes it again) and forgotten by clear() (which every rank's tiers.reload() calls)."""
    from tests.helpers import user_tiers
    T, K, H = 8, 16, 3584
    rank = torch.distributed.get_rank()
    gemm2, e2p, w, shared = partials(T, K, H, rank, seed=70)
    nw, res = common(T, H, seed=70)
    with user_tiers(tmp_path, monkeypatch, SYMM_TIERS):
        d = tail_tp.dispatch(torch.cuda.current_device(), hidden=H, world_size=WORLD)
        assert d.require(T).params["allreduce"] == "symm_mem"
        out = kerngen.moe_tail(gemm2, e2p, w, nw, shared=shared, residual=res, group=group)
        symm = [v for k, v in d.kept.items() if k[0] == "symm"]
        assert len(symm) == 1 and symm[0].shape == (64, H)
        again = kerngen.moe_tail(gemm2, e2p, w, nw, shared=shared, residual=res, group=group)
        assert [v for k, v in d.kept.items() if k[0] == "symm"][0] is symm[0] and close(again, out)
        sg, se, sw, ss = summed(T, K, H, seed=70)
        assert close(out, kerngen.moe_tail(sg, se, sw, nw, shared=ss, residual=res))
    assert not tail_tp.dispatch(torch.cuda.current_device(), hidden=H, world_size=WORLD).kept
