"""Tensor-parallel tail on the CPU: two gloo ranks run moe_tail(..., group=...) with the torch references standing
in for the CUDA kernels, so what is checked here is the orchestration: the partial sums (routed + shared) meet
in one collective before the norm, every rank gets the single-GPU result on the summed inputs, and bad
arguments raise named errors. The kernels themselves run under torchrun in tests/gpu/test_tail_tp.py."""
import pytest
import torch
import torch.distributed as dist

import kerngen
from tests.helpers import gloo_world
from kerngen.ops import finalize as fin
from kerngen.ops import tail, tail_tp

WORLD = 2
T, K, H = 5, 4, 256


def rank_inputs(rank: int, seed: int = 0):
    """Rank r's partials: its own gemm2_out rows, indices into them, weights and a shared-expert partial."""
    g = torch.Generator().manual_seed(seed * 100 + rank)
    rows = T * K
    gemm2 = torch.randn(rows, H, generator=g).to(torch.bfloat16)
    e2p = torch.randperm(rows, generator=g)[: T * K].view(T, K).int()
    e2p[0, 1] = -1                                            # a skipped slot
    w = torch.rand(T, K, generator=g)
    shared = torch.randn(T, H, generator=g).to(torch.bfloat16)
    return gemm2, e2p, w, shared


def common_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed * 100 + 99)
    return torch.rand(H, generator=g).to(torch.bfloat16), torch.randn(T, H, generator=g).to(torch.bfloat16)


def single_gpu_expected(seed: int = 0):
    """The single-GPU tail over every rank's rows at once (the definition the TP path must match)."""
    parts = [rank_inputs(r, seed) for r in range(WORLD)]
    nw, res = common_inputs(seed)
    gemm2 = torch.cat([p[0] for p in parts])
    e2p = torch.cat([torch.where(p[1] >= 0, p[1] + r * T * K, -1) for r, p in enumerate(parts)], dim=1).int()
    w = torch.cat([p[2] for p in parts], dim=1)
    shared = sum(p[3].float() for p in parts).to(torch.bfloat16)
    out, res_out = tail.reference(gemm2, e2p, w, nw, shared=shared, residual=res)
    return out, res_out


def _reference_finalize(g, e2p, w, *, hidden=None, out=None):
    return out.copy_(fin.reference(g, e2p, w, hidden))


def _reference_tail(g, e2p, w, nw, *, eps, residual, residual_out, out, out_dtype, out_scales, shared=None):
    y, r = tail.reference(g, e2p, w, nw, eps=eps, shared=shared, residual=residual, out_dtype=out_dtype)
    if residual_out is not None:
        residual_out.copy_(r)
    return y


def _worker(rank: int, init: str, results):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=WORLD)
    try:
        tail_tp.finalize = _reference_finalize
        gemm2, e2p, w, shared = rank_inputs(rank)
        nw, res = common_inputs()
        res_out = torch.empty(T, H, dtype=torch.bfloat16)
        out = tail_tp.moe_tail_tp(gemm2, e2p, w, nw, group=dist.group.WORLD, local_tail=_reference_tail,
                                  shared=shared, residual=res, residual_out=res_out)
        d = tail_tp.dispatch(-1, hidden=H, world_size=WORLD)   # the rules read once; the identity rows kept there
        ident = d.kept[("identity", T)][0]
        tail_tp.moe_tail_tp(gemm2, e2p, w, nw, group=dist.group.WORLD, local_tail=_reference_tail, shared=shared)
        kept = [list(d.kept), d.kept[("identity", T)][0] is ident]
        kerngen.clear()
        kept.append(tail_tp.dispatch(-1, hidden=H, world_size=WORLD).kept == {})
        errors = []
        for kwargs, name in ((dict(group="not a group"), "group"),
                             (dict(group=dist.group.WORLD, shared=shared[:, :8]), "shared")):
            try:
                tail_tp.moe_tail_tp(gemm2, e2p, w, nw, local_tail=_reference_tail, **kwargs)
            except kerngen.InputError as e:
                errors.append(f"'{name}'" in str(e))
        results[rank] = (out, res_out, errors, kept)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    return gloo_world(_worker, tmp_path_factory.mktemp("tp"), WORLD)


def test_every_rank_gets_the_single_gpu_result_on_the_summed_inputs(tp_results):
    expected, expected_res = single_gpu_expected()
    scale = expected.float().pow(2).mean(-1, keepdim=True).sqrt()
    for rank in range(WORLD):
        out, res_out, *_ = tp_results[rank]
        # partials round to bf16 before the collective (as engines all-reduce): tolerance 2e-2 of the row RMS
        assert ((out.float() - expected.float()).abs() / (scale + out.float().abs())).max() < 2e-2, rank
        assert ((res_out.float() - expected_res.float()).abs().max() / expected_res.float().abs().max()) < 2e-2
    assert torch.equal(tp_results[0][0], tp_results[1][0])        # every rank holds the same output


def test_normalizing_partials_would_be_detected(tp_results):
    """The check above can fail: the sum of per-rank normalized partials is far from the right answer."""
    expected, _ = single_gpu_expected()
    nw, res = common_inputs()
    wrong = sum(tail.reference(*rank_inputs(r)[:3], nw, shared=rank_inputs(r)[3], residual=res)[0].float()
                for r in range(WORLD))
    scale = expected.float().pow(2).mean(-1, keepdim=True).sqrt()
    assert ((wrong - expected.float()).abs() / (scale + wrong.abs())).max() > 2e-2


def test_bad_arguments_name_the_argument(tp_results):
    for rank in range(WORLD):
        assert tp_results[rank][2] == [True, True]


def test_the_dispatch_object_keeps_the_identity_rows_until_clear(tp_results):
    for rank in range(WORLD):
        assert tp_results[rank][3] == [[("identity", T)], True, True]


def test_without_torch_distributed_the_group_is_rejected():
    assert not dist.is_initialized()
    gemm2, e2p, w, shared = rank_inputs(0)
    nw, _ = common_inputs()
    with pytest.raises(kerngen.InputError, match="'group'"):
        kerngen.moe_tail(gemm2, e2p, w, nw, group=object())


def test_tier_picks_the_collective(tmp_path):
    assert tail_tp.allreduce_params(8, 7168, 2) == {"allreduce": "nccl"}
    user = tmp_path / "tp.toml"
    user.write_text('schema = 1\n\n[[tier]]\nop = "tail_tp"\nvariant = "allreduce"\ntokens = [1, 64]\n'
                    'world_size = [2, 8]\nparams = { allreduce = "symm_mem", max_tokens = 64 }\n')
    tbl = kerngen.tiers.load(user)
    assert tail_tp.allreduce_params(64, 7168, 8, tbl)["allreduce"] == "symm_mem"
    assert tail_tp.allreduce_params(65, 7168, 8, tbl)["allreduce"] == "nccl"      # past the rule: shipped NCCL
    assert tail_tp.allreduce_params(8, 7168, 16, tbl)["allreduce"] == "nccl"
    small = tmp_path / "tp-small.toml"   # (tables are cached per file)
    small.write_text(user.read_text().replace("max_tokens = 64", "max_tokens = 32"))
    with pytest.raises(kerngen.InputError, match="max_tokens >= 64"):
        tail_tp.allreduce_params(64, 7168, 2, kerngen.tiers.load(small))
