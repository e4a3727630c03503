"""The engine layouts on the GPU: moe_align_block_size from kerngen's kernels against the transcription of vLLM's
algorithm (and SGLang's own kernel where it is installed), route's layout="align" from the fused routing kernel,
a workspace reused through falling and rising T, CUDA graphs, and grouped_mm offs feeding torch._grouped_mm."""
import pytest
import torch

import kerngen
import kerngen.torch_ops  # noqa: F401
from kerngen import adapters, tiers
from kerngen.ops import permute as pm
from kerngen.ops import routing as rt
from tests.test_engine_layouts import vllm_align

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("gpu_cache")]


def ids_for(T, E, K, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).int()


def check_align(s, e, n, ids, bs, E, emap=None, pad=False):
    vs, ve, vn = vllm_align(ids.cpu(), bs, E, None if emap is None else emap.cpu(), pad)
    assert torch.equal(n.cpu(), vn) and torch.equal(e.cpu(), ve)
    assert torch.equal(s.cpu(), vs)


@pytest.mark.parametrize("T", [1, 4, 8, 16, 64, 333, 4096])
@pytest.mark.parametrize("E,K,bs", [(128, 8, 16), (256, 8, 64), (896, 16, 128), (8, 2, 16)])
def test_moe_align_block_size_matches_vllm(T, E, K, bs):
    ids = ids_for(T, E, K, T + E)
    check_align(*adapters.moe_align_block_size(ids, bs, E), ids, bs, E)
    check_align(*adapters.moe_align_block_size(ids, bs, E, pad_sorted_ids=True), ids, bs, E, pad=True)


@pytest.mark.parametrize("local", [(0, 64), (64, 64), (100, 28)])
def test_expert_map(local):
    E, K, bs, T = 128, 8, 16, 50
    ids = ids_for(T, E, K, 5)
    emap = torch.full((E,), -1, dtype=torch.int32, device="cuda")
    emap[local[0]:local[0] + local[1]] = torch.arange(local[1], dtype=torch.int32, device="cuda")
    check_align(*adapters.moe_align_block_size(ids, bs, E, expert_map=emap), ids, bs, E, emap)


def test_the_custom_op_writes_every_entry_of_reused_buffers():
    E, K, bs = 256, 8, 64
    cap = 64 * K + E * (bs - 1)
    s = torch.full((cap,), 12345, dtype=torch.int32, device="cuda")
    e = torch.full((-(-cap // bs),), 12345, dtype=torch.int32, device="cuda")
    n = torch.empty(1, dtype=torch.int32, device="cuda")
    for T in (64, 1, 17, 64, 3):
        ids = ids_for(T, E, K, T)
        rows = T * K + E * (bs - 1)
        torch.ops.kerngen.moe_align_block_size(ids, E, bs, s[:rows], e[:-(-rows // bs)], n)
        check_align(s[:rows], e[:-(-rows // bs)], n, ids, bs, E)


@pytest.mark.parametrize("name", ["kimi-k3", "deepseek-v3", "qwen3-30b-a3b", "mixtral-8x7b"])
@pytest.mark.parametrize("T", [1, 2, 8, 16, 64, 512])
def test_route_layout_align_from_the_routing_kernels(name, T):
    m = tiers.load().model(name)
    g = torch.Generator(device="cuda").manual_seed(T)
    logits = torch.randn(T, m.num_experts, device="cuda", generator=g)
    bias = torch.randn(m.num_experts, device="cuda", generator=g) * 0.05 if "bias" in m.routing else None
    for local in (None, (m.num_experts // 4, m.num_experts // 2)):
        r = kerngen.route(logits, bias=bias, model=name, tile=64, layout="align", local_experts=local)
        ids, _ = rt.reference(logits, m.top_k, m.routing, bias, m.n_group, m.topk_group, m.routed_scaling_factor,
                              m.renormalize)
        assert torch.equal(r.topk_ids, ids)
        emap = None
        if local is not None:
            emap = torch.full((m.num_experts,), -1, dtype=torch.int32)
            emap[local[0]:local[0] + local[1]] = torch.arange(local[1], dtype=torch.int32)
        check_align(r.sorted_token_ids, r.expert_ids, r.num_tokens_post_padded, ids, 64, m.num_experts, emap)


def test_align_inside_a_cuda_graph_through_changing_inputs():
    E, K, bs, T = 256, 8, 16, 8
    ws = pm.RoutingWorkspace(T, E, K, bs, layout="align")
    ids = ids_for(T, E, K, 0)
    kerngen.permute(ids, num_experts=E, tile=bs, workspace=ws, layout="align")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r = kerngen.permute(ids, num_experts=E, tile=bs, workspace=ws, layout="align")
    for seed in (1, 2, 3):
        ids.copy_(ids_for(T, E, K, seed))
        graph.replay()
        torch.cuda.synchronize()
        check_align(r.sorted_token_ids, r.expert_ids, r.num_tokens_post_padded, ids, bs, E)


@pytest.mark.parametrize("tile", [1, 16])
def test_grouped_mm_offs_feed_torch_grouped_mm(tile):
    E, K, T, H, N = 16, 2, 40, 64, 32
    ids = ids_for(T, E, K, 1)
    r = kerngen.permute(ids, num_experts=E, tile=tile)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(E, N, H, device="cuda", dtype=torch.bfloat16)
    rows = r.permuted_to_token.shape[0]
    a = x[r.permuted_to_token.clamp(min=0).long()]
    y = torch._grouped_mm(a, w.transpose(-1, -2), offs=r.grouped_mm_offs)
    e2p = r.expanded_to_permuted.long()
    for t in range(T):
        for k in range(K):
            want = (x[t].float() @ w[int(ids[t, k])].float().T)
            torch.testing.assert_close(y[e2p[t, k]].float(), want, rtol=2e-2, atol=2e-2)
    assert rows >= int(r.num_permuted_rows)


def test_against_sglangs_own_kernel_where_installed():
    moe_align = pytest.importorskip("sglang.kernels.ops.moe.moe_align", reason="SGLang's kernels not installed")
    E, K, bs, T = 256, 8, 128, 64
    ids = ids_for(T, E, K, 9)
    s, e, n = adapters.moe_align_block_size(ids, bs, E)
    # SGLang 0.5.23's signature: E + 1 buckets (bucket 0 for id -1), caller's buffers, padding filled with T * K
    numel = T * K
    pad = -(-(numel + (E + 1) * (bs - 1)) // 4) * 4
    ss = torch.empty(pad, dtype=torch.int32, device="cuda")
    se = torch.empty(-(-pad // bs), dtype=torch.int32, device="cuda")
    sn = torch.empty(1, dtype=torch.int32, device="cuda")
    cumsum = torch.empty(E + 2, dtype=torch.int32, device="cuda")
    moe_align.moe_align_block_size(ids.to(torch.int32), E + 1, bs, ss, se, sn, cumsum, True)
    assert int(n) == int(sn.flatten()[0])
    blocks = int(n) // bs
    assert torch.equal(e[:blocks].cpu(), se[:blocks].cpu())
    for b in range(blocks):   # the order inside a block is each kernel's own
        assert sorted(s[b * bs:(b + 1) * bs].tolist()) == sorted(ss[b * bs:(b + 1) * bs].tolist())


@pytest.mark.parametrize("T", [1, 8, 64, 600])
@pytest.mark.parametrize("E,K,tile,local", [(128, 8, 16, (0, 128)), (896, 16, 128, (0, 896)), (256, 8, 8, (64, 96))])
def test_route_permute_op_equals_route_on_a_workspace(T, E, K, tile, local):
    """torch.ops.kerngen.route_permute (a workspace of its own each call, each output its own allocation: ids and
    weights unfilled, the rest in their initial state) gives kerngen.route's permutation on a reused workspace,
    call after call."""
    g = torch.Generator(device="cuda").manual_seed(T + E)
    ws = kerngen.RoutingWorkspace(T, E, K, tile, local_experts=local)
    for _ in range(2):
        logits = torch.randn(T, E, device="cuda", generator=g)
        got = torch.ops.kerngen.route_permute(logits, K, "softmax_topk", tile, local_start=local[0],
                                              num_local=local[1])
        r = kerngen.route(logits, top_k=K, method="softmax_topk", tile=tile, local_experts=local, workspace=ws)
        want = (r.topk_ids, r.topk_weights, r.expert_counts, r.expert_offsets, r.expanded_to_permuted,
                r.permuted_to_token, r.tile_to_expert, r.num_permuted_rows)
        for name, a, b in zip(("ids", "weights", "counts", "offsets", "e2p", "p2t", "t2e", "rows"), got, want):
            assert torch.equal(a, b), name
