"""kerngen.experts' one_launch (no GPU): both GEMMs in one launch, experts_gemm12, whose CTAs take tickets (GEMM1's
items, then GEMM2's, each waiting on its tile's GEMM1 items). Every shipped model's decode rule builds it within its
register bound and without local memory; its struct Params is the two-launch one plus the tickets' buffer; the
builds it cannot serve fall back to two launches (transposed weights, intermediate rows that are not whole 128-byte
lines) or are refused (quantizing launches, early_l2, stage_act). The GPU tests (tests/gpu/test_experts_one_launch.py)
check its bits against the two launches."""
import pytest

from kerngen import jit, render, resources, tiers
from kerngen.cache import DiskCache
from kerngen.errors import TierError
from kerngen.ops import experts as ex


def decode_rules():
    """(model, format, its experts rule at one token with one_launch) of every shipped model with experts; fp8's
    with x quantized by experts_gemm1 and the bf16 intermediate (its rule has quantizing launches)."""
    t = tiers.load()
    for m in sorted(t.models.values(), key=lambda m: m.name):
        if not m.intermediate:
            continue
        for fmt in dict.fromkeys(("bf16", m.experts_format or "bf16")):
            rule = t.rule("experts", {"hidden": m.hidden, "tokens": 1, "arch": "sm_90a", "format": fmt})
            p = dict(rule.params, one_launch=True)
            if fmt == "fp8":
                p.update(fused_x=2, act_f16=False, prefetch=False, prefetch_x=False, lean=True, unroll=1,
                         blocks_per_sm=6, min_blocks=6)   # (at 8 CTAs its experts_gemm1 spills in the loop)
            yield m, fmt, tiers.Rule("experts", "mma", {"tokens": (1, 2)}, p)


def spec(m, fmt, rule, layout="nk"):
    return ex.rule_spec(rule, m.hidden, m.intermediate, m.activation, "sm_90a", fmt, layout)


def test_every_shipped_decode_rule_builds_one_launch_within_its_registers(tmp_path):
    store, seen = DiskCache(tmp_path), set()
    for m, fmt, rule in decode_rules():
        s = spec(m, fmt, rule)
        assert ex.one_launch(s), m.name
        launch = ex.persistent(s)
        assert set(launch) == {"experts_gemm12"}
        files = jit.build(s, store=store).files
        use = dict(resources.usage(files))
        assert set(use) == {"experts_gemm12"}, (m.name, fmt, set(use))   # no two-launch kernels built beside it
        threads, per_sm = launch["experts_gemm12"].threads, launch["experts_gemm12"].per_sm
        assert use["experts_gemm12"]["REG"] * threads * per_sm <= 65536, (m.name, fmt)
        assert use["experts_gemm12"].get("STACK", 0) <= 32, (m.name, fmt)   # a few words an item, outside the loop
        loop = resources.mma_loop(resources.sass(files), "experts_gemm12")
        assert loop is not None and not loop[1], f"{m.name} {fmt}: local memory in the K-step loop"
        assert ex.params_struct(s).names[-1] == "sync"
        assert ex.params_struct(s).names[:-1] == ex.params_struct(spec(m, fmt, tiers.Rule(
            "experts", "mma", rule.ranges, {k: v for k, v in rule.params.items() if k != "one_launch"}))).names
        seen.add(fmt)
    assert seen == {"bf16", "fp8", "mxfp4"}


def test_without_one_launch_the_source_is_the_two_launches_alone():
    for m, fmt, rule in decode_rules():
        plain = {k: v for k, v in rule.params.items() if k != "one_launch"}
        src = render.render(spec(m, fmt, tiers.Rule("experts", "mma", rule.ranges, plain)))
        assert "experts_gemm12" not in src and "kg_take_ticket" not in src and "sync;" not in src
        one = render.render(spec(m, fmt, rule))
        assert "experts_gemm12" in one and "experts_gemm1(" not in one and "experts_gemm2(" not in one


def test_shapes_it_cannot_serve_run_two_launches():
    t = tiers.load()
    m = t.models["gpt-oss-120b"]
    rule = tiers.Rule("experts", "mma", {}, dict(tile=8, warps=8, unroll=2, blocks_per_sm=4, one_launch=True))
    assert ex.one_launch(spec(m, "bf16", rule))
    kn = spec(m, "bf16", rule, "kn")   # transposed weights
    odd = ex.rule_spec(rule, 1000, 200, "silu", "sm_90a")   # intermediate rows of 400 bytes: not whole lines
    for s in (kn, odd):
        assert not ex.one_launch(s) and set(ex.persistent(s)) == {"experts_gemm1", "experts_gemm2"}
        assert "experts_gemm12" not in render.render(s)


@pytest.mark.parametrize("params,a8", [
    (dict(f16x=True), False),                                         # experts_quant_x and experts_quant_act
    (dict(f16x=True, fused_x=2), False),                              # experts_quant_act
    (dict(f16x=True, fused_x=2, act_f16=False, early_l2=True), False),
    (dict(f16x=True, fused_x=2, stage_act=True), False),
    (dict(), True),                                                   # fp8 activations
])
def test_builds_with_quantizing_launches_are_refused(params, a8):
    rule = tiers.Rule("experts", "mma", {"tokens": (1, 2)}, dict(tile=8, warps=4, unroll=1, one_launch=True, **params))
    with pytest.raises(TierError, match="one_launch"):
        ex.rule_spec(rule, 1024, 256, "silu", "sm_90a", "fp8", "nk", a8)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_one_launch_fields_and_its_tickets_buffer(monkeypatch, fmt):
    """Through stub launchers on CPU tensors: one launch, experts_gemm12, with the two-launch struct's fields and the
    stream's tickets buffer (zeroed int32, a 128-byte line for each counter: tickets, CTAs done, each tile), the same
    buffer call after call on a stream, another on another stream, a larger one for more tiles; the grid at most the
    CTAs the rule's SMs hold and the items of both GEMMs."""
    import torch

    from tests.test_experts_quantized_cpu import FORMATS, stub_launches
    launches = stub_launches(monkeypatch)
    a = FORMATS[fmt][1]()
    H, I = a["x"].shape[1], a["w2"].shape[-1] * (32 if fmt == "mxfp4" else 1)
    rule = tiers.Rule("experts", "mma", {"tokens": (1, 2)}, dict(tile=8, warps=4, unroll=1, blocks_per_sm=4,
                                                                 f16x=True, fused_x=2, act_f16=False, one_launch=True))
    k = ex.Kernels(ex.rule_spec(rule, H, I, "silu", "sm_90a", fmt), -1)
    assert k.one and I % 64 == 0
    r, x, kw = a["routing"], a["x"][:2], dict(w13_scale=a["w13_scale"], w2_scale=a["w2_scale"])
    tiles = r.tile_to_expert.shape[0]
    k(x, r, a["w13"], a["w2"], ex.reference(**a), **kw)
    k(x, r, a["w13"], a["w2"], ex.reference(**a), **kw)
    assert [n for n, _, _ in launches] == ["experts_gemm12"] * 2
    f0, f1 = launches[0][2], launches[1][2]
    assert list(f0)[-1] == "sync" and f0["sync"] == f1["sync"] and f0["x"] == x.data_ptr()
    sync = k._sync[0]
    assert sync.dtype == torch.int32 and sync.numel() == ex.SYNC_LINE * (2 + tiles) and not sync.any()
    assert ex.SYNC_LINE * 4 == 128
    monkeypatch.setattr(ex, "current_stream", lambda dev: 7)   # another stream: its own counters
    k(x, r, a["w13"], a["w2"], ex.reference(**a), **kw)
    assert launches[-1][2]["sync"] != f0["sync"] and set(k._sync) == {0, 7}
    old = k._sync[7]
    # grown for more tiles, to a power of two; the outgrown buffer kept (a CUDA graph captured before reads it)
    assert k.sync(7, tiles + 5, x.device).numel() == ex.SYNC_LINE * (2 + ex._pow2(tiles + 5)) > old.numel()
    assert any(t is old for t in k._kept)
    grid = k.launchers(tiles)[0].grid[0]
    assert grid == min(4 * tiers.SMS, tiles * sum(k._per_tile))


def test_mxfp4_at_one_token_takes_one_launch_from_eight_experts_a_token():
    """The shipped MXFP4 rules at one token: one launch where a token names 8 or more experts (kimi-k3's 16 tiles),
    two launches below (gpt-oss-120b's 4: GEMM2 would wait on GEMM1's last round) and where top_k is not known;
    kimi-k3's warmup builds experts_gemm12 for it."""
    def one(top_k, H=3584, I=2048, act="situglu"):
        s = ex.spec(H, I, None, act, 1, "sm_90a", fmt="mxfp4", experts=128, top_k=top_k)
        return set(ex.persistent(s)) == {"experts_gemm12"}
    assert one(16) and one(8) and not one(4) and not one(0)
    assert not one(4, 2880, 2880, "gpt_oss")
    t = tiers.load()
    m = t.model("kimi-k3")
    first = ex.spec(m.hidden, m.intermediate, None, m.activation, 1, "sm_90a", fmt="mxfp4", experts=m.num_experts,
                    top_k=m.top_k)
    assert set(ex.persistent(first)) == {"experts_gemm12"} and first in ex.model_specs(m, t, "sm_90a")
