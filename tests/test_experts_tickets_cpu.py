"""kerngen.experts' tickets (no GPU): the two GEMM launches' CTAs take their items from a counter in the stream's sync
buffer (GEMM1's on line 0, GEMM2's on line 2) instead of a fixed grid stride, the last CTA out of each kernel zeroing
its lines. The shipped rules' shapes build with it within their register bounds and without local memory in the
K-step loop; its struct Params is the rule's plus the sync buffer; without it the source has no tickets (the shipped
kernels' SASS is unchanged: `python3 -m tools.diagnose.same_sass --ops experts`); it is refused beside one_launch and
early_l2. The GPU tests (tests/gpu/test_experts_quantized.py -k tickets) check its bits against the reference."""
import pytest

from kerngen import jit, render, resources, tiers
from kerngen.cache import DiskCache
from kerngen.errors import TierError
from kerngen.ops import experts as ex

# (format, tokens) of the shipped two-launch rules it is meant for, whose items take many rounds of the grid: bf16's
# 17-256-token rule, the quantized formats' 3-128-token f16x rules (two m16 tiles an item; MXFP4's from 16 tokens and
# fp8's from 8 ship with tickets, `plain` below is that rule without them)
CASES = [("bf16", 64), ("bf16", 128), ("fp8", 8), ("fp8", 64), ("mxfp4", 8), ("mxfp4", 64)]


def shipped(fmt: str, T: int, model: str = "kimi-k3"):
    """(model, its shipped experts rule for `fmt` at T, the same with tickets and the rule's CTAs an SM as its
    register bound, so that the grid stays the rule's)."""
    t = tiers.load()
    m = t.models[model]
    rule = t.rule("experts", {"hidden": m.hidden, "tokens": T, "arch": "sm_90a", "format": fmt,
                              "num_experts": m.num_experts, "top_k": m.top_k})
    plain = {k: v for k, v in rule.params.items() if k not in ("one_launch", "tickets")}
    return m, tiers.Rule("experts", "mma", rule.ranges, plain), tiers.Rule("experts", "mma", rule.ranges,
                                                                              dict(plain, tickets=True,
                                                                                   min_blocks=plain.get(
                                                                                       "min_blocks",
                                                                                       plain["blocks_per_sm"])))


def spec(m, fmt, rule):
    return ex.rule_spec(rule, m.hidden, m.intermediate, m.activation, "sm_90a", fmt, "nk")


@pytest.mark.parametrize("fmt,T", CASES)
def test_shipped_rules_build_tickets_within_their_registers(fmt, T, tmp_path):
    m, plain, with_t = shipped(fmt, T)
    s = spec(m, fmt, with_t)
    assert ex.tickets(s) and ex.uses_sync(s) and not ex.one_launch(s)
    launch = ex.persistent(s)
    assert {"experts_gemm1", "experts_gemm2"} <= set(launch)
    files = jit.build(s, store=DiskCache(tmp_path)).files
    use, sass = dict(resources.usage(files)), resources.sass(files)
    for name in ("experts_gemm1", "experts_gemm2"):
        threads, per_sm = launch[name].threads, launch[name].per_sm
        assert use[name]["REG"] * threads * per_sm <= 65536, (fmt, T, name, use[name])
        loop = resources.mma_loop(sass, name)
        assert loop is not None and not loop[1], f"{fmt} T={T} {name}: local memory in the K-step loop"
        body = resources.function_sass(sass, name)
        assert "ATOMG.E.ADD" in body or "ATOM.E.ADD" in body, (fmt, T, name)   # the tickets
        assert "ATOMG.E.ADD.STRONG.GPU" in body or ".STRONG.GPU" in body   # the acq_rel count of CTAs out
    assert ex.params_struct(s).names == ex.params_struct(spec(m, fmt, plain)).names + ("sync",)


@pytest.mark.parametrize("fmt,T", CASES[:3])
def test_without_tickets_the_source_strides_the_grid(fmt, T):
    m, plain, with_t = shipped(fmt, T)
    src = render.render(spec(m, fmt, plain))
    assert "kg_take_ticket" not in src and "sync;" not in src and "item += gridDim.x" in src
    src = render.render(spec(m, fmt, with_t))
    assert src.count("kg_take_ticket(p, 0)") == 1 and src.count("kg_take_ticket(p, 2)") == 1
    assert "kg_exit(p, 0);" in src and "kg_exit(p, 2);" in src and "item += gridDim.x" not in src
    assert "kg_wait_tile" not in src and "experts_gemm12" not in src


@pytest.mark.parametrize("extra", [dict(one_launch=True), dict(early_l2=True)])
def test_tickets_beside_one_launch_or_early_l2_are_refused(extra):
    rule = tiers.Rule("experts", "mma", {"tokens": (1, 8)}, dict(tile=8, warps=8, unroll=2, blocks_per_sm=4,
                                                                  tickets=True, **extra))
    with pytest.raises(TierError, match="tickets"):
        ex.rule_spec(rule, 2048, 768, "silu", "sm_90a")


def test_tickets_launch_fields_and_the_sync_buffer(monkeypatch):
    """Through stub launchers on CPU tensors: two GEMM launches whose struct ends in the stream's sync buffer (zeroed
    int32, at least four 128-byte lines: GEMM1's tickets and CTAs out, GEMM2's), the same buffer call after call;
    with the caller's scratch a buffer of the call's own."""
    import torch

    from tests.test_experts_quantized_cpu import FORMATS, stub_launches
    launches = stub_launches(monkeypatch)
    a = FORMATS["mxfp4"][1]()
    H, I = a["x"].shape[1], a["w2"].shape[-1] * 32
    rule = tiers.Rule("experts", "mma", {"tokens": (3, 128)}, dict(tile=8, warps=4, unroll=1, blocks_per_sm=4,
                                                                   f16x=True, mtiles=2, prefetch_x=True,
                                                                   tickets=True))
    k = ex.Kernels(ex.rule_spec(rule, H, I, "silu", "sm_90a", "mxfp4"), -1)
    assert k.sync_buf and not k.one
    r, x, kw = a["routing"], a["x"], dict(w13_scale=a["w13_scale"], w2_scale=a["w2_scale"])
    k(x, r, a["w13"], a["w2"], ex.reference(**a), **kw)
    k(x, r, a["w13"], a["w2"], ex.reference(**a), **kw)
    names = [n for n, _, _ in launches]
    assert names.count("experts_gemm1") == 2 and names.count("experts_gemm2") == 2
    syncs = {f["sync"] for _, _, f in launches if "sync" in f}
    assert len(syncs) == 1 and all(list(f)[-1] == "sync" for _, _, f in launches)
    sync = k._sync[0]
    assert sync.dtype == torch.int32 and sync.numel() >= 4 * ex.SYNC_LINE and not sync.any()
    assert ex.sync_ints(1) >= 4 * ex.SYNC_LINE
    act = torch.empty(r.tile_to_expert.shape[0] * 8, I, dtype=torch.bfloat16)
    out = torch.empty(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16)
    k(x, r, a["w13"], a["w2"], out, act, **kw)   # the caller's scratch: counters of the call's own
    assert launches[-1][2]["sync"] not in syncs
