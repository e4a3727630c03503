"""The GPU tools (tools/bench, tools/diagnose) without a GPU: `--help` works, and a run says in one line that it
needs a CUDA GPU and exits with status 2 instead of a traceback."""
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
GPU_TOOLS = ["tools.bench.__main__", "tools.bench.routing", "tools.bench.routing_peers", "tools.bench.tail_tp",
             "tools.bench.moe_layer_demo", "tools.bench.moe_block", "tools.diagnose.routing_phases",
             "tools.diagnose.sanitize_run", "tools.bench.experts", "tools.bench.latent_tail", "tools.sweep.finalize",
             "tools.sweep.tail", "tools.sweep.experts fp8 deepseek-v3 1", "tools.diagnose.experts_alone",
             "tools.diagnose.pdl_cost", "tools.diagnose.read_pattern", "tools.diagnose.wgmma_fp4",
             "tools.diagnose.wgmma_smem", "tools.diagnose.experts_phases", "tools.diagnose.latent_phases"]


@pytest.mark.parametrize("command", GPU_TOOLS)
def test_a_gpu_tool_without_a_gpu_says_so_in_one_line(command, monkeypatch, capsys):
    module, *args = command.split()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", [module, *args])
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main()
    err = capsys.readouterr().err
    assert e.value.code == 2 and "needs a CUDA GPU" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("args", [["tools.bench"], ["tools.diagnose.sanitize_run"],
                                  ["tools.diagnose.sanitize_run", "--help"]])
def test_python_m_prints_no_traceback_without_a_gpu(args):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}   # no GPU, where the test machine has one
    r = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=300)
    assert "Traceback" not in r.stderr, r.stderr
    if "--help" in args:
        assert r.returncode == 0 and "compute-sanitizer" in r.stdout
    else:
        assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr


def test_the_experts_sweep_without_arguments_prints_its_usage(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["tools.sweep.experts"])
    with pytest.raises(SystemExit) as e:
        importlib.import_module("tools.sweep.experts").main()
    assert e.value.code == 2 and "FORMAT MODELS TOKENS" in capsys.readouterr().err


@pytest.mark.parametrize("wait,trigger", [(False, False), (True, False), (True, True)])
def test_the_pdl_probe_compiles_with_and_without_the_grid_dependency_instructions(wait, trigger):
    """tools/diagnose/pdl_cost.py's kernels compile for sm_90a; the chased kernel holds griddepcontrol.wait only in
    its waiting build, the producer launch_dependents only in its triggering one."""
    from kerngen.compile import nvrtc_compile
    from kerngen.resources import sass
    from tools.diagnose import pdl_cost
    cubin, _ = nvrtc_compile(pdl_cost.source(wait, trigger), "pdl_cost", "sm_90a", "pdl_cost", None)
    fns = {part.split()[0]: part for part in sass({"kernel.cubin": cubin}).split("Function : ")[1:]}
    assert ("ACQBULK" in fns["chase"]) == wait and ("PREEXIT" in fns["chase"]) == wait
    assert ("PREEXIT" in fns["produce"]) == trigger and "ACQBULK" not in fns["produce"]


@pytest.mark.parametrize("chunk,unroll,spin", [(16, 1, 0), (32, 2, 128), (64, 4, 64)])
def test_the_read_pattern_probe_loads_its_steps_and_spins(chunk, unroll, spin):
    """tools/diagnose/read_pattern.py's kernel compiles for sm_90a with `unroll` steps of two rows' `chunk` bytes a lane
    in its loop (16-byte streaming loads) and about `spin` more instructions a step; a chunk that is not whole 16-byte
    vectors is refused."""
    from kerngen.compile import nvrtc_compile
    from kerngen.resources import mma_loop, sass
    from tools.diagnose import read_pattern
    cubin, _ = nvrtc_compile(read_pattern.source(chunk, unroll, spin), "read_pattern", "sm_90a", "read_pattern", None)
    text = sass({"kernel.cubin": cubin})
    assert text.count("LDG.E.EF.128") >= 2 * unroll * chunk // 16
    assert "SHF.L" in text or "SHF.R" in text or spin == 0
    with pytest.raises(ValueError, match="chunk"):
        read_pattern.source(24, 1, 0)
    assert mma_loop(text, "read_pattern") is None   # (no tensor cores: only loads)


@pytest.mark.parametrize("columns,unroll,spin", [(64, 1, 0), (128, 2, 0), (256, 2, 64)])
def test_the_read_pattern_column_strips_load_8_vectors_a_lane_and_step(columns, unroll, spin):
    """read_pattern's `--columns` kernel (the transposed weights' column strips) compiles for sm_90a with `unroll` steps
    of 8 streaming 16-byte loads a lane and about `spin` more instructions a step; a strip that does not split a warp
    into whole 16-byte lanes is refused."""
    from kerngen.compile import nvrtc_compile
    from kerngen.resources import opcodes
    from tools.diagnose import read_pattern
    cubin, _ = nvrtc_compile(read_pattern.columns_source(columns, unroll, spin), "read_columns", "sm_90a",
                             "read_columns", None)
    ops = opcodes({"kernel.cubin": cubin})
    assert ops.count("LDG.E.EF.128") >= 8 * unroll and "HMMA.16816.F32.BF16" not in ops
    assert sum(o.startswith("SHF.L.W") for o in ops) >= spin
    for bad in (48, 1024):
        with pytest.raises(ValueError, match="columns"):
            read_pattern.columns_source(bad, 1, 0)


@pytest.mark.parametrize("bulk,row_chunk,stages,spin", [(4096, 0, 4, 0), (8192, 0, 8, 64), (16384, 0, 2, 128),
                                                         (0, 256, 4, 0), (0, 192, 8, 128)])
def test_the_read_pattern_bulk_ring_copies_by_tma_and_reads_shared_memory(bulk, row_chunk, stages, spin):
    """read_pattern's `--bulk` / `--row-chunk` kernel compiles for sm_90a: bulk copies (UBLKCP) counted by an
    mbarrier, the consumers' 16-byte shared loads, their waits and releases, and about `spin` more instructions; a
    row chunk's slot pads each row to 16 words past a multiple of 32 (no bank conflicts); a piece that is not whole
    16-byte vectors, a row chunk that is not whole 64-byte steps, or a ring of no slots, is refused."""
    from kerngen.compile import nvrtc_compile
    from kerngen.resources import opcodes
    from tools.diagnose import read_pattern
    cubin, _ = nvrtc_compile(read_pattern.bulk_source(bulk, stages, spin, 4, row_chunk), "read_bulk", "sm_90a",
                             "read_bulk", None)
    ops = opcodes({"kernel.cubin": cubin})
    assert "UBLKCP.S.G" in ops and "LDS.128" in ops and "LDG.E.EF.128" not in ops
    assert any(o.startswith("SYNCS.PHASECHK") for o in ops) and any(o.startswith("SYNCS.ARRIVE") for o in ops)
    assert sum(o.startswith("SHF.L.W") for o in ops) >= spin
    slot = read_pattern.slot_bytes(bulk, row_chunk)
    if row_chunk:
        assert slot % 16 == 0 and slot // 16 >= row_chunk and slot // 16 // 4 % 32 == 16
    else:
        assert slot == bulk
    with pytest.raises(ValueError, match="bulk"):
        read_pattern.bulk_source(1000, 4, 0)
    with pytest.raises(ValueError, match="row-chunk"):
        read_pattern.bulk_source(0, 4, 0, 4, 100)
    with pytest.raises(ValueError, match="stages"):
        read_pattern.bulk_source(4096, 0, 0)


@pytest.mark.parametrize("k_bytes,unroll,loads,gps,wg,split,ncol", [
    (1440, 2, 32, 2, 1, False, 8), (1440, 2, 64, 2, 1, False, 8), (3584, 2, 32, 4, 2, False, 8),
    (1440, 4, 64, 2, 2, True, 8), (1440, 4, 64, 2, 1, False, 16), (3584, 2, 64, 4, 1, False, 16),
    (1440, 8, 128, 2, 1, False, 8), (3584, 4, 128, 4, 2, True, 16)])
def test_the_wgmma_fp4_probe_builds_fp8_wgmmas_from_registers(k_bytes, unroll, loads, gps, wg, split, ncol):
    """tools/diagnose/wgmma_fp4.py's kernel compiles for sm_90a: its K loop holds one register-sourced fp8 wgmma a
    group (QGMMA), no spills, and ptxas does not serialize the wgmmas; with 128-bit loads the weights go by cp.async
    and ldmatrix; groups a step that do not divide a row's are refused at compile time."""
    from kerngen.compile import nvrtc_compile
    from kerngen.errors import CompileError
    from kerngen.resources import mma_loop, sass, usage
    from tools.diagnose import wgmma_fp4
    cubin, log = nvrtc_compile(wgmma_fp4.source(k_bytes, unroll, loads, gps, wg, split, ncol), "wgmma_fp4",
                               "sm_90a", "wgmma_fp4", None)
    assert "serialized" not in log, log
    files = {"kernel.cubin": cubin}
    text = sass(files)
    assert text.count(f"QGMMA.64x{ncol}x32.F32.E4M3.E4M3") >= unroll * gps
    if loads == 128:   # the weights by cp.async into shared memory, handed out by ldmatrix
        assert "LDGSTS.E.BYPASS.128" in text and "LDSM.16.M88.4" in text
    assert dict(usage(files))["wgmma_fp4"]["STACK"] == 0
    loop = mma_loop(text, "wgmma_fp4")
    assert loop is not None and not loop[1]
    with pytest.raises(CompileError, match="divisor"):
        nvrtc_compile(wgmma_fp4.source(1440, 2, 32, 4), "wgmma_fp4", "sm_90a", "wgmma_fp4", None)   # 90 groups
    with pytest.raises(ValueError, match="loads"):
        wgmma_fp4.source(1440, 2, 16)


def test_the_wgmma_fp4_probe_refuses_groups_a_step_that_do_not_divide_a_row(capsys):
    """The probe's command line refuses --gps values that do not divide K / 32 before it needs a GPU (its default
    of 4 did not divide gpt-oss-120b's 90 groups a row: every configuration then failed to build)."""
    from tools.diagnose import wgmma_fp4
    with pytest.raises(SystemExit):
        wgmma_fp4.main(["--gps", "4"])
    assert "--gps: divisors of the 90 groups a row of --k 2880" in capsys.readouterr().err


def test_the_wgmma_fp4_layouts_compute_the_dequantized_product():
    """The probe's layouts on the CPU: every e2m1 byte placed by its bit operations is the two values times 2^-6 as
    e4m3, and emulate() (its fragments, its shared-memory B, a fresh sum a group times the scale, the two terms) is
    the product with weights an fp32 reference dequantizes itself, within 2e-3 of the largest output (the two e4m3
    terms of an activation keep about 8 bits), for 1-8 tokens (B of 8 columns to 4 tokens, 16 to 8), signed zeros,
    extreme scales."""
    from tools.diagnose.wgmma_fp4 import columns, dequant, emulate
    assert [columns(t) for t in (1, 4, 5, 8)] == [8, 8, 16, 16]
    with pytest.raises(ValueError, match="tokens"):
        columns(9)
    w = torch.arange(256, dtype=torch.uint8).reshape(1, 256).repeat(64, 1)[:, :160]   # every byte (and a group's 16)
    word = w[:1].contiguous().view(torch.int32).long() & 0xFFFFFFFF
    lo = ((word << 4) & 0x80808080) | ((word << 2) & 0x1C1C1C1C)
    hi = (word & 0x80808080) | ((word >> 2) & 0x1C1C1C1C)
    as_e4m3 = lambda v: torch.stack([(v >> (8 * i)) & 0xFF for i in range(4)], -1).to(torch.uint8).reshape(-1) \
        .view(torch.float8_e4m3fn).float()
    lut = dequant(w[:1], torch.full((1, 10), 127, dtype=torch.uint8), torch).reshape(-1)
    assert torch.equal(as_e4m3(lo) * 64, lut[0::2]) and torch.equal(as_e4m3(hi) * 64, lut[1::2])
    g = torch.Generator().manual_seed(1)
    for t, k, lo_s, hi_s in [(1, 2880, 118, 128), (2, 512, 100, 140), (4, 2880, 120, 125), (3, 7168, 127, 128),
                             (5, 2880, 118, 128), (8, 1024, 110, 130)]:
        w = torch.randint(0, 256, (64, k // 2), dtype=torch.uint8, generator=g)
        s = torch.randint(lo_s, hi_s, (64, k // 32), dtype=torch.uint8, generator=g)
        x = (torch.randn(t, k, generator=g) * torch.rand(t, k, generator=g) ** 4).to(torch.bfloat16)
        ref = x.float() @ dequant(w, s, torch).T
        err = ((emulate(w, s, x, torch) - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-3, (t, k, err)


@pytest.mark.parametrize("dtype,k,ncol,stages", [("e4m3", 7168, 8, 4), ("e4m3", 2048, 32, 6), ("e4m3", 7168, 64, 3),
                                                 ("bf16", 2048, 8, 4), ("bf16", 7168, 64, 3), ("bf16t", 2880, 16, 4)])
def test_the_wgmma_smem_probe_reads_both_operands_from_shared_memory(dtype, k, ncol, stages):
    """tools/diagnose/wgmma_smem.py's kernel compiles for sm_90a: four shared-memory wgmmas of n`ncol` a 128-byte K
    block (e4m3 k32, each block a fresh sum; bf16 k16, one running sum across the blocks), the weights by cp.async, no
    spills, no serialized wgmmas; a K that is not whole blocks, columns past 64 or another dtype are refused."""
    from kerngen.compile import nvrtc_compile
    from kerngen.resources import sass, usage
    from tools.diagnose import wgmma_smem
    cubin, log = nvrtc_compile(wgmma_smem.source(k, ncol, stages, dtype=dtype), "wgmma_smem", "sm_90a", "wgmma_smem",
                               None)
    assert "serialized" not in log, log
    files = {"kernel.cubin": cubin}
    text = sass(files)
    op = f"QGMMA.64x{ncol}x32.F32.E4M3.E4M3" if dtype == "e4m3" else f"HGMMA.64x{ncol}x16.F32.BF16"
    assert ("tnspA" in text) == (dtype == "bf16t")   # (the transposed A of the weights stored [K, rows])
    # e4m3: four a block (the first a fresh sum); bf16: one running sum, the item's first wgmma fresh (one more)
    assert text.count(op) == (4 if dtype == "e4m3" else 5) and "LDGSTS.E.BYPASS.128" in text, text.count(op)
    assert dict(usage(files))["wgmma_smem"]["STACK"] == 0
    for bad in ((7000, 8, 4), (7168, 72, 4)):
        with pytest.raises(ValueError):
            wgmma_smem.source(*bad)
    with pytest.raises(ValueError, match="dtype"):
        wgmma_smem.source(7168, 8, 4, dtype="f16")


@pytest.mark.parametrize("dtype", ["e4m3", "bf16", "bf16t"])
def test_the_wgmma_smem_layouts_compute_the_dequantized_product(dtype):
    """The shared-memory probe's layouts on the CPU: emulate() (B read back from its shared-memory bytes, a fresh fp32
    sum a 128-byte K block times its scale, a token's columns added) is the product with weights an fp32 reference
    dequantizes itself (e4m3 times its block scales, or bf16, also stored transposed), within 2e-3 of the largest
    output (e4m3's two terms keep about 8 bits of an activation; bf16's are exact), for 1-32 (e4m3) or 1-64 (bf16)
    tokens."""
    from tools.diagnose.wgmma_smem import columns, dequant, emulate, weights
    assert [columns(t) for t in (1, 4, 5, 12, 32)] == [8, 8, 16, 24, 64]
    assert [columns(t, "bf16") for t in (1, 8, 9, 64)] == [8, 8, 16, 64]
    with pytest.raises(ValueError, match="tokens"):
        columns(33)
    g = torch.Generator().manual_seed(2)
    for t, k in [(1, 7168), (3, 512), (12, 1024), (32, 256)] + ([(64, 256)] if dtype != "e4m3" else []):
        w, ws = weights(256, k, dtype, torch, generator=g)
        x = (torch.randn(t, k, generator=g) * torch.rand(t, k, generator=g) ** 4).to(torch.bfloat16)
        ref = x.float() @ dequant(w, ws, torch, dtype).T
        err = ((emulate(w, ws, x, torch, dtype) - ref).abs().max() / ref.abs().max()).item()
        assert err < (2e-3 if dtype == "e4m3" else 1e-5), (t, k, err)


def test_experts_alone_builds_a_fused_x_rule_for_the_tokens_it_serves():
    """--rule with fused_x (profiling the 1-2 token shapes): the spec (tools.bench.experts.launch_spec, which
    experts_alone, the bench and the sweep share) serves at most fused_x tokens, as a tier rule of that token range
    does; without it, any count."""
    from kerngen.ops import experts as ex
    from tools.bench.experts import launch_spec as rule_spec
    params = dict(warps=4, unroll=1, blocks_per_sm=8, min_blocks=8, pdl=True, prefetch=False, f16x=True, fused_x=2,
                  act_f16=False)
    s = rule_spec(params, 8, 2880, 2880, "gpt_oss", "sm_90a", "mxfp4")
    assert dict(s.params)["fused_x"] == 2 and "experts_quant_x" not in ex.persistent(s)
    s = rule_spec(dict(warps=4, unroll=1, blocks_per_sm=4, pdl=True), 8, 2880, 2880, "gpt_oss", "sm_90a", "mxfp4")
    assert "fused_x" not in dict(s.params)


def test_the_finalize_sweeps_wide_slices_are_refused_by_the_kernels_own_check_where_they_cannot_launch():
    """The sweep's 256-vector slices exist, and at K 22 with one load a group (a 256 x 22 block) finalize.kernel
    refuses them before building anything, the InputError the sweep skips a candidate on."""
    from kerngen.errors import InputError
    from kerngen.ops import finalize as fin
    from kerngen.plan import spec_for
    from kerngen.tiers import Rule
    from tools.sweep import finalize as sw
    wide = [p for v, p in sw.candidates() if v == "small_batch" and p["block_x"] == 256]
    assert wide and {p["loads_per_group"] for p in wide} == {1, 2, 4, 8, 32}
    rule = Rule(op="finalize", variant="small_batch", ranges={}, params=wide[0] | dict(loads_per_group=1))
    with pytest.raises(InputError, match="at most 1024 threads"):
        fin.kernel(spec_for(rule, *fin.tag_constants(2048, 22, "bfloat16", "float32"), "sm_90a"), 1, 0)


def test_no_name_is_read_unbound_in_the_package_tools_or_tests():
    """pyflakes over kerngen/, tools/ and tests/: no name read before any binding of it (the GPU tools and tests run
    only on a GPU, where such a slip would first fail, at the cost of device time)."""
    import ast
    from pathlib import Path
    from pyflakes import checker, messages
    root = Path(__file__).resolve().parents[1]
    bad = (messages.UndefinedName, messages.UndefinedLocal, messages.UndefinedExport)
    found = []
    for path in sorted(p for d in ("kerngen", "tools", "tests") for p in (root / d).rglob("*.py")):
        w = checker.Checker(ast.parse(path.read_text(), str(path)), filename=str(path.relative_to(root)))
        found += [str(m) for m in w.messages if isinstance(m, bad)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("one", [False, True])
def test_the_experts_phase_probe_marks_every_item_and_compiles(one):
    """tools/diagnose/experts_phases.py finds each kernel's entry and end and each GEMM1 / GEMM2 item (and with
    one_launch each GEMM2 item's wait on its tile) in gpt-oss-120b's one-token MXFP4 build (its anchors are template
    text: this fails when they drift), the instrumented source compiles for sm_90a, and its report reads a timeline
    of known events."""
    from kerngen import tiers
    from kerngen.compile import nvrtc_compile
    from kerngen.ops import experts as ex
    from kerngen.render import render
    from tools.diagnose import experts_phases as probe
    s = ex.spec(2880, 2880, None, "gpt_oss", 1, "sm_90a", fmt="mxfp4", experts=128, top_k=4)
    if one:
        p = {k: v for k, v in dict(s.params, one_launch=True).items() if k != "backend"}
        s = ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 1)}, {**p, "tile": 8}), 2880, 2880, "gpt_oss",
                         "sm_90a", "mxfp4")
    src = probe.instrument(render(s))
    kernels = (2,) if one else (0, 1)
    for k in kernels:
        assert src.count(f"kg_event({k}, 0, 0)") == 1 and src.count(f"kg_event({k}, 4, 0)") == 1
    assert src.count(f"kg_event({kernels[0]}, 1, item)") == 1 and src.count(f"kg_event({kernels[-1]}, 2, item)") == 1
    assert src.count("kg_event(2, 3, item)") == (1 if one else 0)
    cubin, _ = nvrtc_compile(src, "experts_phases", "sm_90a", "experts_phases", None)
    assert cubin[:4] == b"\x7fELF" and b"kg_ev" in cubin
    # two CTAs of one launch: CTA 0 runs GEMM1 item 0 (0-4 µs), then GEMM2 item 0 which waits until 6 µs and ends at
    # 9; CTA 1 runs GEMM1 item 1 (1-5 µs) and ends
    us = 1000
    ev = [(0, 2, 0, 0, 0), (0, 2, 1, 0, 0), (4 * us, 2, 2, 0, 0), (6 * us, 2, 3, 0, 0), (9 * us, 2, 4, 0, 0),
          (1 * us, 2, 0, 0, 1), (1 * us, 2, 1, 1, 1), (5 * us, 2, 4, 0, 1)]
    text = probe.summary(ev)
    assert "span 9.00" in text and "(2 CTAs)" in text
    assert "gemm1 items: 2, start 0.00 / 0.50 / 1.00, length 4.00 / 4.00 / 4.00" in text
    assert "gemm2 items: 1, start 4.00 / 4.00 / 4.00, length 5.00 / 5.00 / 5.00" in text
    assert "gemm2 waits on their tiles: 2.00 / 2.00 / 2.00 (1 over 0.5 µs)" in text


def test_the_experts_phase_probe_takes_a_rule_of_a_few_params():
    """--rule one_launch=true is laid over the tier rule's params (the probe's documented call), so it parses alone;
    a name or value that is not a param's form is still refused."""
    from tools.diagnose import experts_phases as probe
    a = probe.parse_args(["--model", "gpt-oss-120b", "--tokens", "1", "--rule", "one_launch=true"])
    assert a.rule == {"one_launch": True} and a.tokens == "1"
    with pytest.raises(SystemExit):
        probe.parse_args(["--rule", "one_launch"])


FAKE_SGLANG = {   # SGLang's routers as their docstrings define them, in torch, recording the flags they were given
    "moe_fused_gate": '''
import torch
CALLS = []
def moe_fused_gate(x, bias, k, scoring_func, renormalize, routed_scaling_factor,
                   apply_routed_scaling_factor_on_output, num_expert_group, topk_group):
    CALLS.append(dict(renormalize=renormalize, rsf=routed_scaling_factor, groups=(num_expert_group, topk_group)))
    s = torch.sigmoid(x.float())
    key = s + bias.float()
    T, E = key.shape
    g = key.view(T, num_expert_group, -1).topk(2, -1).values.sum(-1)
    keep = torch.zeros_like(g).scatter(1, g.topk(topk_group, -1).indices, 1.0)
    key = key.masked_fill(keep.repeat_interleave(E // num_expert_group, 1) == 0, float("-inf"))
    ids = key.topk(k, -1).indices
    w = s.gather(-1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w * routed_scaling_factor, ids.int()
''',
    "moe_topk_softmax": '''
import torch
from sglang.srt.utils.custom_op import register_custom_op
CALLS = []
@register_custom_op(op_name="moe_topk_softmax_out", mutates_args=["topk_weights", "topk_ids", "workspace"])
def moe_topk_softmax_out(topk_weights, topk_ids, gating_output, workspace, renormalize, moe_softcapping,
                         correction_bias):
    CALLS.append(dict(renormalize=renormalize, workspace=workspace.numel()))
    p = gating_output.float().softmax(-1)
    w, ids = p.topk(topk_ids.shape[1], -1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    topk_weights.copy_(w)
    topk_ids.copy_(ids)
''',
    "moe_topk_sigmoid": '''
import torch
from sglang.srt.utils.custom_op import register_custom_op
CALLS = []
@register_custom_op(op_name="moe_topk_sigmoid_out", mutates_args=["topk_weights", "topk_ids"])
def moe_topk_sigmoid_out(gating_output, topk_weights, topk_ids, workspace, renormalize, correction_bias,
                         routed_scaling_factor, num_fused_shared_experts):
    CALLS.append(dict(renormalize=renormalize))
    w, ids = torch.sigmoid(gating_output.float()).topk(topk_ids.shape[1], -1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    topk_weights.copy_(w * routed_scaling_factor)
    topk_ids.copy_(ids)
''',
}


def test_routing_peers_give_each_model_the_router_of_its_method(tmp_path, monkeypatch):
    """tools.bench.routing_peers hands every model of the tier table to SGLang's router for its method, with the
    flags under which that router's documented result is kerngen's routing (checked here against kerngen's
    reference, the routers written in torch as their docstrings define them): SGLang's JIT routers import a
    custom-op registry that its kernels package lacks, which the bench stands in for."""
    import kerngen
    from kerngen.ops import routing as rt
    from tools.bench import routing_peers as rp
    moe, utils = tmp_path / "sglang" / "kernels" / "ops" / "moe", tmp_path / "sglang" / "srt" / "utils"
    moe.mkdir(parents=True)
    utils.mkdir(parents=True)   # as in the peers' tarball: sglang.srt.utils without custom_op
    for d in (tmp_path / "sglang", tmp_path / "sglang" / "kernels", tmp_path / "sglang" / "kernels" / "ops", moe,
              utils.parent, utils):
        (d / "__init__.py").write_text("")
    for name, src in FAKE_SGLANG.items():
        (moe / f"{name}.py").write_text(src)
    for mod in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        _check_peers(kerngen, rt, rp)
    finally:   # the fake package and the stand-in leave with the test
        for mod in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[mod]


def _check_peers(kerngen, rt, rp):
    models = rp.default_models().split(",")
    assert set(models) == set(kerngen.models())   # every routing method has its peer
    gen = torch.Generator().manual_seed(3)
    for name in models:
        m = kerngen.models()[name]
        logits = torch.randn(5, m.num_experts, generator=gen)
        bias = torch.randn(m.num_experts, generator=gen) * 0.05 if rp.PEERS[m.routing] == "moe_fused_gate" else None
        w, ids = rp.peer_gate(m, logits, bias)()
        rids, rw = rt.reference(logits, m.top_k, m.routing, bias, m.n_group, m.topk_group, m.routed_scaling_factor,
                                m.renormalize)
        ours, order = rids.long().sort(-1)
        peer, porder = ids.long().sort(-1)
        assert torch.equal(ours, peer), name
        torch.testing.assert_close(w.float().gather(-1, porder), rw.gather(-1, order), rtol=1e-5, atol=1e-6,
                                   msg=name)
    assert sys.modules[rp.CUSTOM_OP].register_custom_op.__module__ == rp.__name__   # the stand-in was needed


def test_routing_peers_prints_the_docs_table():
    """--markdown prints the rows as docs/benchmarks.md's SGLang table: its header, and per row the two settings'
    times and SGLang / kerngen ratios."""
    from tools.bench import routing_peers as rp
    row = dict(model="kimi-k3", T=1, topk_us=2.31, topk_chained_us=2.20, gate_us=2.57, gate_chained_us=2.30,
               perm_us=4.25, perm_chained_us=3.72, gate_align_us=3.92, gate_align_chained_us=3.79)
    text = rp.markdown([row]).splitlines()
    docs = (ROOT / "docs" / "benchmarks.md").read_text()
    assert text[0] in docs and text[1] == "|---|---|---|---|---|---|---|---|"
    assert text[2] == ("| kimi-k3 | 1 | 2.31 / 2.20 | 2.57 / 2.30 | 1.11× / 1.05× | 4.25 / 3.72 | 3.92 / 3.79 | "
                       "0.92× / 1.02× |")
    assert text[2] in docs   # the H100 row of 2026-12-08, as the docs have it
