"""Dispatch once on the GPU: after the first call of a shape every public op, and a transformers MoE block with
kerngen enabled, run again with the filesystem, the tier table and the compiler made to fail."""
import pytest
import torch

import kerngen
from kerngen import dispatch, tiers
from kerngen.ops import permute
from tests.test_dispatch import hot_path_guard
from tests.test_integration_transformers import inputs, kt, moe_blocks, run_block, tiny

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]


def _calls():
    g = torch.Generator(device="cuda").manual_seed(0)
    m = tiers.load().model("kimi-k3")
    E, K, H, I, T = 128, 8, 2048, 768, 4
    logits = torch.randn(T, E, device="cuda", generator=g)
    kimi = torch.randn(T, m.num_experts, device="cuda", generator=g)
    bias = torch.randn(m.num_experts, device="cuda", generator=g)
    ws = kerngen.RoutingWorkspace(T, m.num_experts, m.top_k, 128)
    ws8 = kerngen.RoutingWorkspace(T, E, K, 8)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).int()
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    w13 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).bfloat16()
    r8 = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws8)
    rows = torch.empty(r8.permuted_to_token.shape[0], H, dtype=torch.bfloat16, device="cuda")
    w = torch.rand(T, K, device="cuda")
    out = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
    nw = torch.ones(H, dtype=torch.bfloat16, device="cuda")
    n = permute.max_rows(T, K, E, 8)
    sorted_ids, block_ids, post_pad = (torch.empty(m, dtype=torch.int32, device="cuda") for m in (n, -(-n // 8), 1))
    return {
        "route model= workspace=": lambda: kerngen.route(kimi, bias=bias, model="kimi-k3", tile=128, workspace=ws),
        "route model=": lambda: kerngen.route(kimi, bias=bias, model="kimi-k3", tile=128),
        "route explicit": lambda: kerngen.route(logits, top_k=K, method="softmax_topk", tile=8),
        "route without tile": lambda: kerngen.route(logits, top_k=K, method="softmax_topk"),
        "permute": lambda: kerngen.permute(ids, num_experts=E, tile=8),
        "permute_align_into": lambda: permute.permute_align_into(ids, E, 8, sorted_ids, block_ids, post_pad),
        "experts out=": lambda: kerngen.experts(x, r8, w13, w2, out=rows),
        "finalize out=": lambda: kerngen.finalize(rows, r8.expanded_to_permuted, w, out=out),
        "moe_tail": lambda: kerngen.moe_tail(rows, r8.expanded_to_permuted, w, nw, shared=x, residual=x),
    }


def _poisoned(monkeypatch, fns):
    def run():
        for fn in fns:
            fn()
        torch.cuda.synchronize()
    hot_path_guard(monkeypatch, run)


def test_every_op_after_its_first_call(monkeypatch):
    calls = _calls()
    for _ in range(2):   # (the second call of a small experts shape captures its eager graph: the guarded ones replay)
        for fn in calls.values():
            fn()
    torch.cuda.synchronize()
    built = set(dispatch.registry())
    _poisoned(monkeypatch, calls.values())
    assert set(dispatch.registry()) == built


@pytest.mark.parametrize("case", ["qwen3_moe", "deepseek_v3-grouped"])
def test_an_enabled_block_after_its_first_forward(monkeypatch, case):
    model = tiny(case).to("cuda", torch.bfloat16)
    kt.enable(model, graphs=False)   # (block graphs would replay without a dispatch at all)
    block = moe_blocks(model)[0]
    x = inputs(model, 4, torch.bfloat16).cuda()
    first = run_block(block, x)
    run_block(block, x)   # (captures the experts' eager graph)
    _poisoned(monkeypatch, [lambda: run_block(block, x)])
    torch.testing.assert_close(run_block(block, x), first, rtol=0, atol=0)
