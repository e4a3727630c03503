"""kerngen.experts' tail_split (no GPU): experts_gemm1 of the gcol builds (MXFP4, 1-2 tokens, two launches) splits
the items of its last partial round along K, each part's sums into a per-stream buffer, the item's last part adding
them in order. The builds compile without local memory and within the rule's registers, the source without the param
is the plain rule's, the launch fields gain the buffer (zeroed, sized for experts_gemm1's grid; a caller's scratch
gets one of its own), and the builds it does not serve are refused. tests/gpu/test_experts_quantized.py checks it
against the reference."""
import pytest

from kerngen import jit, render, resources, tiers
from kerngen.cache import DiskCache
from kerngen.errors import TierError
from kerngen.occupancy import resident
from kerngen.ops import experts as ex

RULE = dict(tile=8, warps=4, unroll=1, blocks_per_sm=8, min_blocks=8, pdl=True, prefetch=False, f16x=True, fused_x=2,
            act_f16=False, lean=True, gcol=True)   # the MXFP4 one-token rule's shape


def spec(H, I, act, **extra):
    return ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 2)}, dict(RULE, **extra)), H, I, act, "sm_90a",
                        "mxfp4")


@pytest.mark.parametrize("split", [2, 3])
@pytest.mark.parametrize("H,I,act", [(2880, 2880, "gpt_oss"), (3584, 2048, "situglu")])
def test_tail_split_builds_fit_and_join_their_parts(H, I, act, split, tmp_path):
    s = spec(H, I, act, tail_split=split)
    assert ex.tail_split(s) and ex.params_struct(s).names[-1] == "sync"
    assert ex.params_struct(s).names[:-1] == ex.params_struct(spec(H, I, act)).names
    files = jit.build(s, store=DiskCache(tmp_path)).files
    use = dict(resources.usage(files))
    for name, launch in ex.persistent(s).items():
        assert use[name].get("STACK", 0) == 0 and use[name]["LOCAL"] == 0, (name, use[name])
        assert resident("sm_90a", use[name]["REG"], launch.threads, use[name]["SHARED"] + launch.dynamic_smem) >= 8
    src = render.render(s)
    assert f"min({split}, (int)gridDim.x / tail)" in src and "tail_join(p, unit - full" in src
    assert f"constexpr int TAIL_COUNTS = {ex.TAIL_COUNTS};" in src   # the host sizes the buffer by the same place
    plain = render.render(spec(H, I, act))
    assert "tail_join" not in plain and "sbeg" not in plain


def test_the_launch_passes_a_zeroed_buffer_for_the_grid(monkeypatch):
    """Through stub launchers on CPU tensors: the two launches get the stream's tail buffer (tail_ints of
    experts_gemm1's grid, zeroed, the same call after call), a caller's scratch a fresh one."""
    import torch

    from tests.test_experts_quantized_cpu import FORMATS, stub_launches
    launches = stub_launches(monkeypatch)
    a = FORMATS["mxfp4"][1]()
    H, I = a["x"].shape[1], a["w2"].shape[-1] * 32
    k = ex.Kernels(spec(H, I, "silu", tail_split=2), -1)
    assert k.split and not k.one
    kw = dict(w13_scale=a["w13_scale"], w2_scale=a["w2_scale"])
    r, x = a["routing"], a["x"][:2]
    for _ in range(2):
        k(x, r, a["w13"], a["w2"], ex.reference(**a), **kw)
    assert [n for n, _, _ in launches] == ["experts_gemm1", "experts_gemm2"] * 2
    assert launches[0][2]["sync"] == launches[1][2]["sync"] == launches[2][2]["sync"]
    buf = k._sync[0]
    assert buf.dtype == torch.int32 and buf.numel() == ex.tail_ints(k._ctas["experts_gemm1"])
    assert not buf[:ex.TAIL_COUNTS].any()   # the counts zeroed (the partial sums are written before they are read)
    act = torch.empty(r.tile_to_expert.shape[0] * 8, I, dtype=torch.bfloat16)
    k(x, r, a["w13"], a["w2"], ex.reference(**a), act, **kw)
    assert launches[-1][2]["sync"] != launches[0][2]["sync"]


@pytest.mark.parametrize("extra", [
    dict(tail_split=2, gcol=False),                  # not gcol
    dict(tail_split=2, one_launch=True),             # one launch
    dict(tail_split=2, gemm1_unroll=2),              # two steps a load batch in experts_gemm1
])
def test_tail_split_outside_its_builds_is_refused(extra):
    with pytest.raises(TierError, match="tail_split"):
        spec(2880, 2880, "gpt_oss", **extra)
