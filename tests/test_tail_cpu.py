"""The fused tail on a CPU box: every tail tier compiles to an sm_90a CuTe object, the object loads from the
cache in a new process with zero compiles, compile errors and bad inputs are reported by name; the fp8
output's reference quantization, argument checks and instruction selection."""
import math
import os
import struct
import subprocess
import sys

import pytest
import torch

import kerngen
from kerngen import jit, resources, tiers
from kerngen.cache import DiskCache
from kerngen.errors import CompileError
from kerngen.ops import tail, tail_checks
from tests.helpers import assert_no_spills


def shipped_tail_specs():
    t = tiers.load()
    specs = []
    for m in t.models.values():
        specs += [s for s in tail.model_specs(m, t, "sm_90a") if s not in specs]
    return specs


def all_tail_specs():
    t = tiers.load()
    specs = shipped_tail_specs()
    for H, K, dt, wdt, flags in ((2880, 22, "float16", "bfloat16", (False, False, False)),
                                 (8, 1, "bfloat16", "float32", (True, False, True)),
                                 (7168, 32, "bfloat16", "float32", (False, True, True))):
        for T in (1, 8192):
            s = tail.spec(H, K, dt, wdt, dt, flags, T, "sm_90a", t)
            if s not in specs:
                specs.append(s)
    for H, K, dt, wdt, flags, tokens in FP8_CASES:  # fp8 output: cluster 8, 4 and 1 rules
        for T in tokens:
            s = tail.spec(H, K, dt, wdt, "float8_e4m3fn", flags, T, "sm_90a", t)
            if s not in specs:
                specs.append(s)
    return specs


FP8_CASES = ((7168, 8, "bfloat16", "float32", (True, True, False), (1, 8192)),
             (3584, 16, "bfloat16", "float32", (True, True, True), (1, 32, 8192)),
             (2048, 8, "float16", "bfloat16", (False, False, False), (8192,)))


SHIPPED = shipped_tail_specs()


def _is_object(data: bytes) -> bool:
    return data[:4] == b"\x7fELF" and data[16] == 1  # ET_REL: a relocatable object with the cubin inside


@pytest.mark.parametrize("spec", all_tail_specs(), ids=lambda s: f"{dict(s.params).get('cluster')}-{s.tag}")
def test_every_tail_tier_compiles_to_sm90a_object(spec, tmp_path):
    built = jit.build(spec, store=DiskCache(tmp_path))
    assert built.status == "compiled" and _is_object(built.files["kernel.o"])
    assert spec.backend == "cute" and built.key.startswith(f"tail-tail-{spec.tag}-sm_90a-")
    assert b"sm_90a" in built.files["kernel.o"]
    # No kernel of a shipped model spills. The generic K=32 shapes do (152-184 bytes): every thread holds the
    # K loads of a vector in flight, so K=32 needs 128 registers for them alone.
    if spec in SHIPPED:
        assert_no_spills(built.files)


def test_key_carries_cute_toolchain():
    tc = jit.toolchain("cute")
    assert set(tc) == {"cutlass-dsl", "tvm-ffi", "torch", "cuda"}
    s = tail.spec(3584, 16, "bfloat16", "float32", "bfloat16", (True, True, False), 8, "sm_90a")
    assert jit.key_of(s) != jit.key_of(tail.spec(3584, 16, "bfloat16", "float32", "bfloat16",
                                                 (True, True, True), 8, "sm_90a"))


ROUND_TRIP = """
import sys, kerngen.jit as jit, kerngen.cute_backend as cb
from kerngen import tiers
from kerngen.cache import DiskCache
from kerngen.ops import tail
t = tiers.load()
specs = tail.model_specs(t.model("kimi-k3"), t, "sm_90a")
for s in specs:
    b = jit.build(s, store=DiskCache(sys.argv[1]), strict=True)
    fn = cb.load(b.files, b.key)
    assert b.status == "cached" and callable(fn), (b.status, fn)
    print(b.key, type(fn).__name__)
"""


def test_cute_artifact_round_trip_in_new_process(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kerngen", "warmup", "--model", "kimi-k3", "--ops", "tail",
                        "--arch", "sm_90a", "--quiet"], env={**__import__("os").environ,
                                                             "KERNGEN_CACHE_DIR": str(tmp_path)},
                       capture_output=True, text=True)
    t = tiers.load()
    n = len(tail.model_specs(t.model("kimi-k3"), t, "sm_90a"))
    assert r.returncode == 0 and f"{n} compiled" in r.stdout, r.stdout + r.stderr
    p = subprocess.run([sys.executable, "-c", ROUND_TRIP, str(tmp_path)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.strip().splitlines()
    assert len(lines) == n and all(line.endswith("Function") for line in lines)


def test_import_kerngen_does_not_import_cutlass():
    code = "import sys, kerngen; kerngen.moe_tail; assert 'cutlass' not in sys.modules and 'tvm_ffi' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def tuned_spec(H, K, odtype="bfloat16", **params):
    """A tail spec outside the shipped tiers (as `kerngen tune` builds them)."""
    params = {"backend": "cute", "cluster": 1, "max_loads": 32, "pdl": True, "branch_free": False, **params}
    return tail.params_spec(params, H, K, "bfloat16", "float32", odtype, (True, True, True), "sm_90a")


@pytest.mark.parametrize("H,K,odtype,params", [
    (3584, 16, "bfloat16", dict(threads=1024)),
    (3584, 16, "float8_e4m3fn", dict(threads=512, branch_free=True)),
    (2880, 4, "bfloat16", dict(threads=1024)),
], ids=["k3-1024", "k3-fp8-512", "H2880-1024"])
def test_tails_beyond_the_tiers_compile(H, K, odtype, params, tmp_path):
    built = jit.build(tuned_spec(H, K, odtype, **params), store=DiskCache(tmp_path))
    assert _is_object(built.files["kernel.o"])


def test_split_k_is_no_tail_param():
    with pytest.raises(kerngen.TierError, match="split_k"):
        tiers.check_params("a rule", "tail", "tail", {"backend": "cute", "threads": 1024, "split_k": 2})


def test_cute_compile_error_shows_log_and_source_path(tmp_path, monkeypatch):
    s = tail.spec(64, 2, "bfloat16", "float32", "bfloat16", (False, False, False), 1, "sm_90a")
    monkeypatch.setattr(jit, "render", lambda spec: "def compile_kernel(**values):\n    raise ValueError('bad tile')\n")
    with pytest.raises(CompileError) as e:
        jit.build(s, store=DiskCache(tmp_path))
    assert "bad tile" in str(e.value) and e.value.source_path in str(e.value)
    assert "compile_kernel" in open(e.value.source_path).read()


def test_bad_inputs_raise_named_errors_on_cpu():
    g = torch.zeros(16, 64, dtype=torch.bfloat16)
    e2p = torch.zeros(2, 8, dtype=torch.int32)
    w = torch.zeros(2, 8)
    nw = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(kerngen.InputError, match="gemm2_out.*CUDA"):
        kerngen.moe_tail(g, e2p, w, nw)
    with pytest.raises(kerngen.InputError, match="gemm2_out"):
        kerngen.moe_tail(g.float(), e2p, w, nw)
    with pytest.raises(kerngen.InputError, match="gemm2_out"):
        kerngen.moe_tail("not a tensor", e2p, w, nw)


def test_reference_matches_plain_formula():
    torch.manual_seed(0)
    g = torch.randn(12, 40).to(torch.bfloat16)
    e2p = torch.tensor([[0, 5, -1], [11, 3, 2], [-1, -1, 7], [12, 1, 4]], dtype=torch.int32)  # 12: out of range
    w = torch.rand(4, 3)
    sh, res = torch.randn(4, 40).to(torch.bfloat16), torch.randn(4, 40).to(torch.bfloat16)
    nw = torch.rand(40).to(torch.bfloat16)
    out, y_cast = tail.reference(g, e2p, w, nw, eps=1e-5, shared=sh, residual=res)
    y = torch.zeros(4, 40)
    for t in range(4):
        for k in range(3):
            i = int(e2p[t, k])
            if 0 <= i < 12:
                y[t] += w[t, k] * g[i].float()
    y += sh.float() + res.float()
    want = (y / torch.sqrt((y * y).mean(-1, keepdim=True) + 1e-5) * nw.float()).to(torch.bfloat16)
    assert torch.allclose(out.float(), want.float(), rtol=1e-2, atol=1e-2)
    assert torch.equal(y_cast, y.to(torch.bfloat16))


# ------------------------------------------------------------------------------------------ fp8 output
E4M3 = torch.arange(127, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float().tolist()  # +0 .. 448


def f32(x: float) -> float:
    """x rounded to float32 (a float32 quotient computed in double and rounded once is the IEEE float32 one)."""
    return struct.unpack("f", struct.pack("f", x))[0]


def naive_e4m3(x: float) -> int:
    """Code of x in e4m3fn: the nearest finite magnitude (ties to the even code, i.e. even mantissa; beyond 448
    it is 448) with x's sign."""
    mag = min(range(127), key=lambda code: (abs(E4M3[code] - abs(x)), code % 2))
    return mag | (0x80 if math.copysign(1.0, x) < 0 else 0)


def naive_quantize(n: torch.Tensor):
    """Per token, per 128 columns, one element at a time in float32 arithmetic."""
    T, H = n.shape
    q = torch.zeros(T, H, dtype=torch.uint8)
    scales = torch.zeros(T, H // 128)
    for t in range(T):
        for b in range(H // 128):
            block = n[t, 128 * b:128 * (b + 1)].tolist()
            scale = f32(max(max(abs(v) for v in block), f32(1e-12)) / 448.0)
            scales[t, b] = scale
            for c, v in enumerate(block):
                q[t, 128 * b + c] = naive_e4m3(f32(v / scale))
    return q, scales


def test_fp8_quantize_rounds_to_nearest_even_saturates_and_floors_zero_blocks():
    n = torch.zeros(2, 256)
    n[0, 0] = 448.0  # amax 448: scale 1, so q is n rounded
    n[0, 1:10] = torch.tensor([1.0625, 1.1875, -1.0625, 2 ** -9 * 1.5, 2 ** -10, 2 ** -10 * 1.01, 447.9, 17.0,
                               -2 ** -11])
    n[0, 128:] = torch.linspace(-3, 5, 128)  # second block: its own scale ...
    n[0, 255] = 62.387298583984375  # ... from this amax, and amax / scale = 448.00003 saturates to 448
    n[1, :128] = 0.0  # all-zero block: scale 1e-12 / 448, q = 0
    n[1, 128:] = torch.randn(128) * 1e-9  # tiny values (amax above the 1e-12 floor) still span the e4m3 range
    q, scales = tail.quantize_fp8(n)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (2, 256)
    assert scales.dtype == torch.float32 and scales.shape == (2, 2) and scales.is_contiguous()
    assert q[0, :10].float().tolist() == [448.0, 1.0, 1.25, -1.0, 2 ** -8, 0.0, 2 ** -9, 448.0, 16.0, 0.0]
    assert q[0, 9].view(torch.uint8).item() == 0x80  # -0: the sign survives rounding to zero
    assert scales[0, 0].item() == 1.0 and scales[1, 0].item() == f32(f32(1e-12) / 448)
    assert (q[1, :128].float() == 0).all()
    assert f32(f32(n[0, 255].item()) / scales[0, 1].item()) > 448 and q[0, 255].float().item() == 448.0
    for t, b in ((0, 1), (1, 1)):  # the block's amax element maps to +-448 exactly
        assert q[t, 128 * b:128 * (b + 1)].float().abs().max().item() == 448.0
    want_q, want_s = naive_quantize(n)
    assert torch.equal(q.view(torch.uint8), want_q) and torch.equal(scales, want_s)


def test_fp8_reference_is_quantized_fp32_norm_and_matches_naive():
    torch.manual_seed(1)
    T, K, H, rows = 3, 4, 256, 10
    g = torch.randn(rows, H + 16).to(torch.bfloat16)
    e2p = torch.tensor([[0, 5, -1, 9], [11, 3, 2, 1], [-1, -1, -1, -1]], dtype=torch.int32)
    w = torch.rand(T, K)
    sh, res = torch.randn(T, H).to(torch.bfloat16), (3 * torch.randn(T, H)).to(torch.bfloat16)
    nw = (0.5 + torch.rand(H)).to(torch.bfloat16)
    (q, scales), y = tail.reference(g, e2p, w, nw, shared=sh, residual=res, out_dtype=torch.float8_e4m3fn)
    n, y32 = tail.reference(g, e2p, w, nw, shared=sh, residual=res, out_dtype=torch.float32)
    bf, _ = tail.reference(g, e2p, w, nw, shared=sh, residual=res)
    assert torch.equal(bf, n.to(torch.bfloat16)) and torch.equal(y, y32)  # same n as the bf16 output
    want_q, want_s = naive_quantize(n)  # from fp32 n, not from bf16(n)
    assert torch.equal(q.view(torch.uint8), want_q) and torch.equal(scales, want_s)
    deq = q.float().view(T, 2, 128) * scales[..., None]
    assert torch.allclose(deq.view(T, H), n, rtol=2 ** -4, atol=1e-6)  # e4m3: 3 mantissa bits


@pytest.fixture
def cpu_moe_tail(monkeypatch):
    """moe_tail on CPU tensors past the device check, with a stand-in for the kernel that records its call."""
    calls = []
    kerngen.dispatch.calls("tail").clear()
    monkeypatch.setattr(tail_checks, "check_gather_inputs", lambda op, g, e2p, w, *a, **kw: tuple(e2p.shape))
    monkeypatch.setattr(tail, "arch", lambda dev: "sm_90a")
    monkeypatch.setattr(tail, "kernel", lambda s, *a: lambda *args: calls.append((s, args)))

    def inputs(T=4, K=8, H=1024):
        return (torch.zeros(16, H, dtype=torch.bfloat16), torch.zeros(T, K, dtype=torch.int32), torch.zeros(T, K),
                torch.ones(H, dtype=torch.bfloat16))
    yield inputs, calls
    kerngen.dispatch.calls("tail").clear()   # the signatures seen here hold the stand-in


def test_fp8_moe_tail_returns_out_and_scales_from_one_kernel_call(cpu_moe_tail):
    inputs, calls = cpu_moe_tail
    args = inputs(T=4, H=1024)
    out, scales = kerngen.moe_tail(*args, out_dtype=torch.float8_e4m3fn)
    assert out.dtype == torch.float8_e4m3fn and out.shape == (4, 1024)
    assert scales.dtype == torch.float32 and scales.shape == (4, 8) and scales.is_contiguous()
    s, kargs = calls[-1]
    assert "-oe4m3-" in s.tag and dict(s.constants)["ODTYPE"] == "float8_e4m3fn"
    assert kargs[6] is out and kargs[7] is scales and kargs[8] is None and len(kargs) == 10
    buf, sbuf = torch.empty(4, 1024, dtype=torch.float8_e4m3fn), torch.empty(4, 8)
    got = kerngen.moe_tail(*args, out_dtype=torch.float8_e4m3fn, out=buf, out_scales=sbuf)
    assert got[0] is buf and got[1] is sbuf and calls[-1][1][7] is sbuf
    plain = kerngen.moe_tail(*args)  # bf16 output: one tensor, no scales
    assert isinstance(plain, torch.Tensor) and calls[-1][1][7] is None and "-obf16-" in calls[-1][0].tag


def test_fp8_bad_arguments_raise_named_errors(cpu_moe_tail):
    inputs, _ = cpu_moe_tail
    fp8 = {"out_dtype": torch.float8_e4m3fn}
    with pytest.raises(kerngen.InputError, match="norm_weight.*multiple of 128.*out_dtype"):
        kerngen.moe_tail(*inputs(H=1000), **fp8)  # H % 8 == 0 but H % 128 != 0
    with pytest.raises(kerngen.InputError, match="out_dtype"):
        kerngen.moe_tail(*inputs(), out_dtype=torch.float32)
    with pytest.raises(kerngen.InputError, match="out_dtype"):
        kerngen.moe_tail(*inputs(), out_dtype=torch.float8_e5m2)
    args = inputs(T=4, H=1024)
    bad = [({"out": torch.empty(4, 1024, dtype=torch.bfloat16)}, "out"),
           ({"out": torch.empty(4, 1152, dtype=torch.float8_e4m3fn)}, "out"),
           ({"out_scales": torch.empty(4, 8, dtype=torch.bfloat16)}, "out_scales"),
           ({"out_scales": torch.empty(4, 9)}, "out_scales"),
           ({"out_scales": torch.empty(8, 4).t()}, "out_scales"),
           ({"out_scales": torch.empty(4 * 8)}, "out_scales"),
           ({"out_scales": torch.empty(4, 8, device="meta")}, "out_scales")]
    for kw, name in bad:
        with pytest.raises(kerngen.InputError, match=f"argument '{name}'"):
            kerngen.moe_tail(*args, **fp8, **kw)
    with pytest.raises(kerngen.InputError, match="argument 'out_scales'.*float8_e4m3fn"):
        kerngen.moe_tail(*args, out_scales=torch.empty(4, 8))  # scales without fp8 output


def test_fp8_output_has_its_own_kernel_key():
    args = (3584, 16, "bfloat16", "float32")
    bf = tail.spec(*args, "bfloat16", (True, True, False), 8, "sm_90a")
    f8 = tail.spec(*args, "float8_e4m3fn", (True, True, False), 8, "sm_90a")
    assert f8.tag == "H3584-K16-bf16-wf32-oe4m3-s1r1ro0" and jit.key_of(f8) != jit.key_of(bf)


def test_fp8_tail_sass_keeps_128bit_loads_and_stores_e4m3_in_64bit_words(tmp_path):
    """H=7168 on one CTA per token of 224 threads, 4 vectors per thread: saturating RNE e4m3 conversion,
    NaN-propagating max, a 16-lane butterfly per vector, 64-bit stores of fp8 and one scale store per vector."""
    params = dict(backend="cute", cluster=1, threads=256, max_loads=32, branch_free=False, pdl=True)
    s = tail.params_spec(params, 7168, 8, "bfloat16", "float32", "float8_e4m3fn", (True, True, False), "sm_90a")
    built = jit.build(s, store=DiskCache(tmp_path))
    assert len(resources.cubins(built.files)) == 1
    ops = resources.opcodes(built.files)
    count = ops.count
    assert count("F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C") == 4 * 4  # 4 vectors x 4 pairs
    assert count("STG.E.64") == 4 and count("STG.E") == 4  # 8 fp8 per vector; one scale per vector
    assert count("SHFL.BFLY") == 4 * 4 + 5  # 16-lane amax per vector + the warp's sum of squares
    assert count("FMNMX.NAN") > 0 and not any(op.startswith("STG.E.128") for op in ops)
    assert all(op == "LDG.E.128" for op in ops if op.startswith("LDG"))


@pytest.mark.parametrize("H,K,cluster,odtype", [(7168, 8, 8, "bfloat16"), (3584, 16, 4, "bfloat16"),
                                                (7168, 8, 4, "float8_e4m3fn"), (5120, 1, 2, "bfloat16")])
def test_async_reduce_drops_the_second_cluster_barrier(H, K, cluster, odtype, tmp_path):
    """async_reduce (clusters): the partial sums travel by st.async counted by each CTA's mbarrier (SASS: STAS,
    SYNCS), so the kernel has no MEMBAR.ALL.GPU (the second cluster barrier's release) and one cluster arrive
    fewer; no spills; at cluster 1 it is the same kernel."""
    params = dict(backend="cute", cluster=cluster, threads=128, max_loads=32, branch_free=True, pdl=True)

    def ops(**over):
        s = tail.params_spec({**params, **over}, H, K, "bfloat16", "float32", odtype, (True, True, False),
                             "sm_90a")
        b = jit.build(s, store=DiskCache(tmp_path))
        assert_no_spills(b.files)
        return resources.opcodes(b.files)

    plain, fast = ops(), ops(async_reduce=True)
    assert "MEMBAR.ALL.GPU" in plain and "STAS" not in plain
    assert "MEMBAR.ALL.GPU" not in fast and "STAS" in fast and any(o.startswith("SYNCS") for o in fast)
    assert fast.count("UCGABAR_ARV") == plain.count("UCGABAR_ARV") - 1
    one = dict(cluster=1, threads=256)
    assert ops(**one) == ops(**one, async_reduce=True)


def test_async_reduce_is_a_tail_flag():
    with pytest.raises(kerngen.TierError, match="async_reduce"):
        tiers.check_params("a rule", "tail", "tail", {"backend": "cute", "threads": 128, "async_reduce": 2})
