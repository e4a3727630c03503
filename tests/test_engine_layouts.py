"""The layouts engines consume, on the CPU: moe_align_block_size's (vLLM / SGLang) against a transcription of
vLLM's own algorithm (written from its fused_moe/moe_align_block_size.py, not from kerngen's permutation),
torch._grouped_mm's offs, the custom ops' schemas, and the align builds compiling for every shipped model."""
import pytest
import torch

import kerngen
import kerngen.torch_ops  # noqa: F401
from kerngen import adapters, jit, tiers
from kerngen.cache import DiskCache
from kerngen.ops import permute as pm
from kerngen.ops import routing as rt


def vllm_align(topk_ids, block_size, num_experts, expert_map=None, pad_sorted_ids=False):
    """vLLM's moe_align_block_size, step by step as its Triton stages do it (count, padded cumsum, expert per
    block, scatter by a running count), then expert_map applied to the zero-initialized expert_ids."""
    flat = topk_ids.flatten().tolist()
    numel = len(flat)
    max_padded = numel + num_experts * (block_size - 1)
    if pad_sorted_ids:
        max_padded = -(-max_padded // block_size) * block_size
    sorted_ids = [numel] * max_padded
    expert_ids = [0] * (-(-max_padded // block_size))
    counts = [0] * num_experts
    for x in flat:
        if 0 <= x < num_experts:
            counts[x] += 1
    cumsum = [0]
    for c in counts:
        cumsum.append(cumsum[-1] + -(-c // block_size) * block_size)
    for x in range(num_experts):
        for i in range(cumsum[x], cumsum[x + 1], block_size):
            expert_ids[i // block_size] = x
    seen = [0] * num_experts
    for i, x in enumerate(flat):
        if 0 <= x < num_experts:
            sorted_ids[cumsum[x] + seen[x]] = i
            seen[x] += 1
    expert_ids = torch.tensor(expert_ids, dtype=torch.int32)
    if expert_map is not None:
        expert_ids = expert_map[expert_ids.long()].to(torch.int32)
    return torch.tensor(sorted_ids, dtype=torch.int32), expert_ids, torch.tensor([cumsum[-1]], dtype=torch.int32)


def random_ids(T, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(torch.int32)


def test_the_example_of_vllms_docstring():
    ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]], dtype=torch.int32)
    s, e, n = adapters.moe_align_block_size(ids, 4, 5)
    assert s[:16].tolist() == [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert e[:4].tolist() == [1, 2, 3, 4] and int(n) == 16


@pytest.mark.parametrize("T,E,K,bs", [(1, 8, 2, 16), (5, 64, 6, 16), (33, 128, 8, 64), (7, 256, 8, 128),
                                      (300, 160, 8, 32), (2, 896, 16, 64)])
@pytest.mark.parametrize("pad", [False, True])
def test_align_matches_vllm_exactly(T, E, K, bs, pad):
    ids = random_ids(T, E, K, T * E)
    s, e, n = adapters.moe_align_block_size(ids, bs, E, pad_sorted_ids=pad)
    vs, ve, vn = vllm_align(ids, bs, E, pad_sorted_ids=pad)
    assert (s.dtype, e.dtype, n.dtype) == (torch.int32,) * 3
    assert s.shape == vs.shape and e.shape == ve.shape and n.shape == (1,)
    assert torch.equal(n, vn) and torch.equal(e, ve)
    assert torch.equal(s, vs)   # both take a block's entries in ascending expanded index


@pytest.mark.parametrize("local", [(0, 32), (32, 32), (100, 28)])
def test_expert_map_marks_other_ranks_blocks_minus_one(local):
    T, E, K, bs = 40, 128, 8, 16
    ids = random_ids(T, E, K, 7)
    emap = torch.full((E,), -1, dtype=torch.int32)
    emap[local[0]:local[0] + local[1]] = torch.arange(local[1], dtype=torch.int32)
    s, e, n = adapters.moe_align_block_size(ids, bs, E, expert_map=emap)
    vs, ve, vn = vllm_align(ids, bs, E, expert_map=emap)
    assert torch.equal(s, vs) and torch.equal(e, ve) and torch.equal(n, vn)
    assert (e == -1).any() and ((e >= -1) & (e < local[1])).all()


def test_ids_outside_the_experts_are_skipped_like_vllm():
    ids = torch.tensor([[0, 9], [3, 8]], dtype=torch.int32)        # 8 and 9 are not experts of E = 8
    s, e, n = adapters.moe_align_block_size(ids, 4, 8)
    vs, ve, vn = vllm_align(ids, 4, 8)
    assert torch.equal(s, vs) and torch.equal(e, ve) and int(n) == 8


@pytest.mark.parametrize("bad, arg", [
    (dict(expert_map=torch.tensor([1, 0, -1, -1], dtype=torch.int32)), "expert_map"),   # not a contiguous range
    (dict(expert_map=torch.zeros(3, dtype=torch.int32)), "expert_map"),
    (dict(expert_map=torch.tensor([0, 1, -1, -1], dtype=torch.int32), local_experts=(0, 2)), "local_experts"),
    (dict(topk_ids=torch.zeros(2, 2)), "topk_ids"),
    (dict(block_size=0), "block_size"),
])
def test_bad_arguments_are_named(bad, arg):
    args = dict(topk_ids=torch.zeros(2, 2, dtype=torch.int32), block_size=4, num_experts=4) | bad
    with pytest.raises(kerngen.InputError, match=arg):
        adapters.moe_align_block_size(**args)


def test_the_custom_op_writes_into_the_callers_buffers_on_cpu():
    ids = random_ids(9, 32, 4, 3)
    rows = 9 * 4 + 32 * 15
    s, e, n = (torch.empty(rows, dtype=torch.int32), torch.empty(-(-rows // 16), dtype=torch.int32),
               torch.empty(1, dtype=torch.int32))
    torch.ops.kerngen.moe_align_block_size(ids, 32, 16, s, e, n)
    vs, ve, vn = vllm_align(ids, 16, 32)
    assert torch.equal(s, vs) and torch.equal(e, ve) and torch.equal(n, vn)
    torch.library.opcheck(torch.ops.kerngen.moe_align_block_size.default, (ids, 32, 16, s, e, n))


@pytest.mark.parametrize("tile", [1, 16])
def test_route_permute_op_returns_the_whole_permutation(tile):
    logits = torch.randn(6, 64)
    out = torch.ops.kerngen.route_permute(logits, 4, "softmax_topk", tile)
    ids, w = rt.reference(logits, 4, "softmax_topk")
    p = pm.permute_reference(ids, 64, tile)
    assert torch.equal(out[0], ids) and torch.equal(out[5], p["permuted_to_token"])
    assert torch.equal(out[4], p["expanded_to_permuted"]) and int(out[7]) == int(p["num_permuted_rows"])
    torch.library.opcheck(torch.ops.kerngen.route_permute.default, (logits, 4, "softmax_topk", tile))


@pytest.mark.parametrize("tile", [1, 8, 128])
def test_grouped_mm_offs_are_each_experts_end_row(tile):
    ids = random_ids(20, 64, 6, tile)
    p = pm.permute_reference(ids, 64, tile, (8, 40))
    r = pm.Routing(ids, torch.zeros(20, 6), p["expert_counts"], p["expert_offsets"])
    offs = r.grouped_mm_offs
    assert offs.dtype == torch.int32 and offs.shape == (40,) and offs.data_ptr() == p["expert_offsets"][1:].data_ptr()
    starts = torch.cat([torch.zeros(1, dtype=torch.int32), offs[:-1]])
    assert ((offs - starts) >= p["expert_counts"]).all()            # each group holds its expert's rows
    if tile == 1:
        assert torch.equal(offs - starts, p["expert_counts"])          # unpadded
    e2p = p["expanded_to_permuted"].flatten()
    x = ids.flatten().long() - 8
    local = (x >= 0) & (x < 40)
    assert ((e2p[local] >= starts[x[local]]) & (e2p[local] < offs[x[local]])).all()


def align_specs():
    tbl = tiers.load()
    out = []
    for name, m in sorted(tbl.models.items()):
        for T in sorted({1, 8, 64, 512, 4096} & set(range(m.tokens[0], m.tokens[1] + 1))):
            s = pm.spec(m.num_experts, m.top_k, T, "sm_90a", tbl, align=True)
            if s not in out:
                out.append(s)
            tag, consts = rt.tag_constants(m.num_experts, m.top_k, m.routing, m.n_group, m.topk_group,
                                           m.renormalize, "float32", "float32", m.weights_dtype, True)
            rule = tbl.rule("routing", {"num_experts": m.num_experts, "top_k": m.top_k, "tokens": T})
            if rule.variant == "fused":
                from kerngen import plan
                s = plan.spec_for(rule, tag, consts, "sm_90a")
                if s not in out:
                    out.append(s)
    return out


@pytest.mark.parametrize("spec", align_specs(), ids=lambda s: f"{s.variant}-{s.tag}")
def test_every_shipped_models_align_builds_compile(spec, tmp_path):
    from tests.helpers import assert_no_spills
    built = jit.build(spec, store=DiskCache(tmp_path), strict=False)
    assert_no_spills(built.files)


def test_a_new_expert_map_at_a_freed_maps_address_is_read_again():
    ids = random_ids(6, 16, 2, 1)
    for start in (0, 8):   # the second map may reuse the first one's memory
        emap = torch.full((16,), -1, dtype=torch.int32)
        emap[start:start + 8] = torch.arange(8, dtype=torch.int32)
        _, e, _ = adapters.moe_align_block_size(ids, 4, 16, expert_map=emap)
        assert torch.equal(e, vllm_align(ids, 4, 16, expert_map=emap)[1])
        del emap


def test_the_readme_example_of_the_block_layout_runs():
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md")
    if not readme.is_file():
        pytest.skip("no README beside the tests")
    blocks = re.findall(r"```python\n(.*?)```", readme.read_text(), re.S)
    code = next(b for b in blocks if "moe_align_block_size" in b)
    exec(compile("\n".join(line[2:] if line.startswith("  ") else line for line in code.splitlines()),
                 "README.md", "exec"), {})
