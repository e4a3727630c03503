"""tools/bench/experts.py on the CPU, no timing: the launch shapes --sweep tries for each weight format, the floor and
memory arithmetic against the bytes quantize() really writes, the command line, the printed line, and the Triton
fp8 peer's tolerance against an emulation of its w8a8 arithmetic."""
import itertools

import pytest
import torch

from kerngen import ops, tiers
from kerngen.ops import experts as ex
from tests.helpers import one_thread
from tools.bench import experts as bench


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def test_bf16_candidates_are_the_grid_and_two_tile_items():
    """The warps x unroll x CTAs x pdl grid, then items of two m16 weight tiles (mtiles), each a valid rule."""
    from kerngen import tiers
    from kerngen.ops import experts as ex
    grid = [dict(warps=w, unroll=u, blocks_per_sm=b, pdl=d) for w, u, b, d in
            itertools.product((4, 8), (2, 4), (4, 8), (False, True))]
    cands = bench.CANDIDATES["bf16"]
    assert cands[:len(grid)] == grid and all(c.get("mtiles") == 2 for c in cands[len(grid):])
    assert len(cands) > len(grid)
    for c in cands:
        ex.rule_spec(tiers.Rule("experts", "mma", {}, {"tile": 16, **c}), 2048, 768, "silu", "sm_90a")


@pytest.mark.parametrize("fmt, unrolls", [("fp8", {1, 2, 4}), ("mxfp4", {2, 4, 8})])
def test_quantized_candidates(fmt, unrolls):
    cands = bench.CANDIDATES[fmt]
    assert len(cands) == 2 * 3 * 3 * 2
    assert len({tuple(sorted(c.items())) for c in cands}) == len(cands)
    assert {c["warps"] for c in cands} == {4, 8} and {c["unroll"] for c in cands} == unrolls
    assert {c["blocks_per_sm"] for c in cands} == {2, 3, 4} and all(c["pdl"] is True for c in cands)
    bound = [c for c in cands if "min_blocks" in c]
    assert len(bound) == len(cands) // 2 and all(c["min_blocks"] == c["blocks_per_sm"] for c in bound)
    assert {frozenset(c.items()) for c in cands if "min_blocks" not in c} == \
        {frozenset((k, v) for k, v in c.items() if k != "min_blocks") for c in bound}


@pytest.mark.parametrize("fmt", bench.FORMATS)
def test_every_candidate_is_a_valid_experts_rule(fmt):
    known = "min_blocks" in ops.params("experts", "mma")
    unchecked = [c for c in bench.CANDIDATES[fmt] if "min_blocks" in c and not known]
    for c in bench.CANDIDATES[fmt]:
        if c not in unchecked:
            tiers.check_params(f"{fmt} candidate {c}", "experts", "mma", {"tile": 8, **c})
    if unchecked:
        pytest.skip(f"{len(unchecked)} {fmt} candidates with 'min_blocks' not checked: kerngen.ops.params"
                    "('experts', 'mma') has no 'min_blocks' yet (being added with the quantized kernels' rewrite)")


@pytest.mark.parametrize("fmt", bench.FORMATS)
def test_bytes_per_weight_are_what_quantize_writes(fmt):
    w = (torch.randn(3, 256, 384) * 0.05).to(torch.bfloat16)
    q, s = bench.quantize(w, fmt, chunk=2)
    written = q.nbytes + (0 if s is None else s.nbytes)
    assert written == w.numel() * bench.BYTES_PER_WEIGHT[fmt]


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_dequantize_in_chunks_is_kerngens_dequantize(fmt):
    w = (torch.randn(5, 128, 256) * 0.05).to(torch.bfloat16)
    q, s = bench.quantize(w, fmt)
    got = bench.dequantize(q, s, chunk=2)
    assert got.dtype == torch.bfloat16 and got.shape == w.shape
    assert torch.equal(got, ex.dequantize(q, s).to(torch.bfloat16))
    assert (got.float() - w.float()).abs().max() <= 0.25 * w.float().abs().max()   # e2m1 is coarse; fp8 far closer


def test_floor_per_format():
    # deepseek-v3, 8 active experts, 4.5 TB/s: 8 * 3 * 7168 * 2048 weights
    n = 8 * 3 * 7168 * 2048
    assert bench.floor_us(8, 7168, 2048, "bf16", 4.5) == pytest.approx(n * 2 / 4.5e6)   # 156.6 µs
    assert bench.floor_us(8, 7168, 2048, "fp8", 4.5) == pytest.approx(n * (1 + 4 / 128 ** 2) / 4.5e6)   # 78.3
    assert bench.floor_us(8, 7168, 2048, "mxfp4", 4.5) == pytest.approx(n * (0.5 + 1 / 32) / 4.5e6)   # 41.6
    assert bench.floor_us(8, 7168, 2048, "fp8", 4.5) == pytest.approx(78.31, abs=0.01)


def test_layers_count_the_bf16_copies_of_quantized_weights():
    H, I, E = 7168, 2048, 256   # deepseek-v3: 11.3 G weights a layer
    assert bench.layer_bytes(H, I, E, "bf16") == 3 * E * H * I * 2
    assert bench.layer_bytes(H, I, E, "fp8") == pytest.approx(3 * E * H * I * (3 + 4 / 128 ** 2))
    assert bench.fit_layers(4, 117e9, H, I, E, "bf16") == 2   # as before: 58.5 GB / 22.5 GB
    assert bench.fit_layers(4, 117e9, H, I, E, "fp8") == 1   # fp8 alone would be 4; with the bf16 copies 1
    assert bench.fit_layers(4, 1e9, H, I, E, "fp8") == 1   # at least one
    assert bench.fit_layers(4, 130e9, 2048, 768, 128, "mxfp4") == 4   # qwen3-30b-a3b: 1.5 GB a layer


def test_kimi_k2_shape():
    assert bench.SHAPES["kimi-k2"] == (7168, 2048, 384, 8, "silu", False)
    assert "kimi-k2" not in bench.DEFAULT   # the bf16 default set stays the five models it was


def test_arguments():
    a = bench.parse_args([])
    assert a.models == list(bench.DEFAULT) and a.tokens == [1, 2, 4, 8, 16, 32, 64]
    assert (a.format, a.layout, a.rule, a.peer, a.sweep, a.layers) == ("bf16", "nk", None, None, False, 4)
    a = bench.parse_args(["--format", "fp8", "--models", "deepseek-v3,kimi-k2", "--tokens", "1,8,64",
                          "--peer", ".peer", "--rule", "warps=4,unroll=2,blocks_per_sm=3,min_blocks=3,pdl=true"])
    assert a.models == ["deepseek-v3", "kimi-k2"] and a.tokens == [1, 8, 64] and a.peer == ".peer"
    assert a.rule == dict(warps=4, unroll=2, blocks_per_sm=3, min_blocks=3, pdl=True)
    assert bench.parse_args(["--rule", "warps=8,unroll=2,blocks_per_sm=4"]).rule == \
        dict(warps=8, unroll=2, blocks_per_sm=4)
    assert bench.parse_args(["--rule", "tile=32,warps=4,unroll=1,mtiles=2"]).rule == \
        dict(tile=32, warps=4, unroll=1, mtiles=2)   # its kernels read routings of their own tile


@pytest.mark.parametrize("argv", [
    ["--models", "no-such-model"],
    ["--tokens", "1,x"],
    ["--tokens", "0"],
    ["--format", "int4"],
    ["--format", "fp8", "--layout", "kn"],
    ["--rule", "warps=four,unroll=2"],
    ["--rule", "warps"],
    ["--rule", "warps=4,unroll=2,no_such_param=1"],
    ["--rule", "unroll=2"],   # warps is required
    ["--rule", "warps=4,unroll=2,min_blocks=0"],
    ["--rule", "tile=64,warps=4,unroll=2"],   # tiles of at most 32 rows
])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2 and "error:" in capsys.readouterr().err


ROW = dict(model="deepseek-v3", T=8, tile=8, kernel="tiers.toml: blocks_per_sm=4,unroll=2,warps=8", us=1154.04,
           grouped_us=1764.9, floor_us=1181.2, active=57.5, format="bf16", layers=4, layout="nk", peer_us=None,
           bf16_us=None, peer_cfg=None)


def test_bf16_line_is_unchanged():
    # the line the bench printed before quantized rows had their own (same row, the old f-string); the peer's
    # configs at its end
    assert bench.summary(ROW) == (
        "deepseek-v3      T=  8 tile= 8 active=  57.5 floor  1181.2 µs | kerngen  1154.0 ( 102%) [tiers.toml: "
        "blocks_per_sm=4,unroll=2,warps=8] | grouped_mm  1764.9 (  67%) | 1.53x | bf16 nk x4 layers")
    row = {**ROW, "peer_us": 1203.4, "peer_cfg": [(16, 64, 128, 4, 5), (16, 64, 128, 4, 4)]}
    assert bench.summary(row) == (
        "deepseek-v3      T=  8 tile= 8 active=  57.5 floor  1181.2 µs | kerngen  1154.0 ( 102%) [tiers.toml: "
        "blocks_per_sm=4,unroll=2,warps=8] | grouped_mm  1764.9 (  67%) | 1.53x | bf16 nk x4 layers | triton  1203.4 "
        "(  98%, 1.04x) [16,64,128,4,5;16,64,128,4,4]")
    # the configs as tools.diagnose.experts_alone --peer-configs takes them (the peer alone under a profiler)
    from tools.diagnose import experts_alone
    assert experts_alone.peer_configs(bench.peer_configs(row["peer_cfg"])) == row["peer_cfg"]
    for bad in ("16,64,128,4", "16,64,128,4,5", "a,b,c,d,e;1,2,3,4,5"):
        with pytest.raises(Exception, match="two configs of 5 integers"):
            experts_alone.peer_configs(bad)


def test_quantized_line():
    row = {**ROW, "format": "fp8", "floor_us": 571.8, "us": 691.5, "bf16_us": 1157.8, "peer_us": 606.1,
           "peer_cfg": [dict(block_n=64, stages=3, warps=4), dict(block_n=128, stages=4, warps=8)], "layers": 1}
    line = bench.summary(row)
    assert line == (
        "deepseek-v3      T=  8 tile= 8 active=  57.5 floor   571.8 µs | kerngen   691.5 (  83%) [tiers.toml: "
        "blocks_per_sm=4,unroll=2,warps=8] | kerngen bf16  1157.8 (1.67x) | triton fp8   606.1 (  94%, 0.88x) "
        "[block_n/stages/warps 64/3/4, 128/4/8] | grouped_mm  1764.9 | fp8 nk x1 layers")
    line = bench.summary({**row, "format": "mxfp4", "bf16_us": None, "peer_us": None, "peer_cfg": None})
    assert "| kerngen bf16 - | grouped_mm  1764.9 | mxfp4 nk x1 layers" in line and "triton" not in line
    # the read kernel's time over the floor's bytes, where the row has it
    assert bench.summary({**row, "read_us": 600.0}).startswith(
        "deepseek-v3      T=  8 tile= 8 active=  57.5 floor   571.8 µs read   600.0 ( 95%) | "
        "kerngen   691.5 (  83%,  87% of read)")


def test_prefix_reads_the_bytes_the_floor_counts():
    """The read kernel's spans: the first bytes of a weight tensor's storage (a transposed view's as it lies), whole
    16-byte vectors, never past its end."""
    w = torch.arange(2 * 64 * 32, dtype=torch.int16).view(2, 64, 32)
    p = bench.prefix(w, 1000.7)
    assert p.dtype == torch.uint8 and p.numel() == 992 and p.data_ptr() == w.data_ptr()
    assert bench.prefix(w, 1e12).numel() == w.numel() * 2
    t = w.transpose(1, 2)   # [E, N, K] view of [E, K, N] storage
    assert bench.prefix(t, 64).data_ptr() == w.data_ptr() and bench.prefix(t, 64).numel() == 64


def _w8a8(x, w13, w2, I):
    """The Triton fp8 peer's arithmetic (triton_fused_moe: quant_fp8_groups of its input, e4m3 x e4m3 in fp32, bf16
    out) on fp32 weights that hold e4m3 values times their block scales, one expert a row."""
    def groups(a):
        g = a.float().view(a.shape[0], -1, 128)
        s = g.abs().amax(-1).clamp(min=1e-10) / 448.0
        return ((g / s[..., None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * s[..., None]).view(a.shape)
    h = torch.einsum("rk,rnk->rn", groups(x), w13).to(torch.bfloat16)
    a = ex.activate(h.float(), I, "silu", False).to(torch.bfloat16)
    return torch.einsum("rk,rnk->rn", groups(a), w2).to(torch.bfloat16)


def test_the_fp8_peer_tolerance_passes_w8a8_and_fails_a_wrong_expert():
    H, I, R = 1024, 256, 16
    g = torch.Generator().manual_seed(0)
    w13 = (torch.randn(R, 2 * I, H, generator=g) * H ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(R, H, I, generator=g) * I ** -0.5).to(torch.bfloat16)
    (q13, s13), (q2, s2) = bench.quantize(w13, "fp8"), bench.quantize(w2, "fp8")
    d13, d2 = ex.dequantize(q13, s13), ex.dequantize(q2, s2)
    x = torch.randn(R, H, generator=g).to(torch.bfloat16)
    # the bench's reference: kerngen's, on the weights dequantized to bf16
    h = torch.einsum("rk,rnk->rn", x.float(), d13.to(torch.bfloat16).float())
    a = ex.activate(h, I, "silu", False).to(torch.bfloat16)
    ref = torch.einsum("rk,rnk->rn", a.float(), d2.to(torch.bfloat16).float()).to(torch.bfloat16).float()
    rel = ((_w8a8(x, d13, d2, I).float() - ref).abs().max() / ref.abs().max()).item()
    assert 1e-2 < rel <= bench.PEER_FP8_TOL / 1.5, rel   # a few percent: w8a8, not bf16 rounding
    wrong = _w8a8(x, d13.roll(1, 0), d2, I).float()   # each row through its neighbour's gate/up
    assert ((wrong - ref).abs().max() / ref.abs().max()).item() > 2 * bench.PEER_FP8_TOL


def test_launch_spec_is_kerngens_rule_spec_at_the_routings_tile_or_the_rules_own():
    """The bench, the sweep and experts_alone build a candidate's spec one way: kerngen's rule_spec (its checks),
    at the routing's tile unless the params name one, a fused_x rule serving at most fused_x tokens."""
    from kerngen.tiers import Rule
    p = dict(warps=4, unroll=1, blocks_per_sm=4, mtiles=2)
    assert bench.launch_spec(p, 16, 2048, 768, "silu", "sm_90a") == \
        ex.rule_spec(Rule("experts", "mma", {}, {**p, "tile": 16}), 2048, 768, "silu", "sm_90a")
    assert ex.tile_of(bench.launch_spec({**p, "tile": 32}, 16, 2048, 768, "silu", "sm_90a")) == 32
    with pytest.raises(tiers.TierError, match="sets mtiles"):
        bench.launch_spec(p, 16, 7168, 2048, "silu", "sm_90a", "fp8")   # fp8 takes mtiles with f16x only
    fused = dict(warps=4, unroll=1, blocks_per_sm=8, f16x=True, fused_x=2, prefetch=False)
    assert dict(bench.launch_spec(fused, 8, 2880, 2880, "gpt_oss", "sm_90a", "mxfp4").params)["fused_x"] == 2


def test_the_bf16_peer_sweeps_larger_blocks_where_experts_get_more_rows():
    """The Triton bf16 peer at its best: vLLM's decode sweep (block_m 16) always, and from 8 routed rows an expert on
    average blocks of 32 and 64 rows at 4 and 8 warps too (qwen3-30b-a3b: 128 experts, top 8, from 128 tokens), each
    GEMM then aligned at its own config's block size."""
    from tools.bench import experts as bench
    decode = [(16, bn, bk, 4, st) for bn in (32, 64, 128) for bk in (64, 128, 256) for st in (3, 4, 5)]
    assert bench.peer_bf16_configs(decode, 64, 8, 128) == decode
    wide = bench.peer_bf16_configs(decode, 128, 8, 128)
    assert wide[:len(decode)] == decode and len(wide) == len(set(wide)) == len(decode) + 32
    assert {c[0] for c in wide} == {16, 32, 64} and {c[3] for c in wide} == {4, 8}
    assert bench.peer_bf16_configs(decode, 255, 8, 256) == decode   # deepseek-v3: 2040 rows over 256 experts
