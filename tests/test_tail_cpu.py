"""The fused tail on a CPU box: every tail tier compiles to an sm_90a CuTe object, the object loads from the
cache in a new process with zero compiles, compile errors and bad inputs are reported by name."""
import subprocess
import sys

import pytest
import torch

import kerngen
from kerngen import jit, tiers
from kerngen.cache import DiskCache
from kerngen.errors import CompileError
from kerngen.ops import tail
from kerngen.plan import KernelSpec


def all_tail_specs():
    t = tiers.load()
    specs = []
    for m in t.models.values():
        specs += [s for s in tail.model_specs(m, t, "sm_90a") if s not in specs]
    for H, K, dt, wdt, flags in ((2880, 22, "float16", "bfloat16", (False, False, False)),
                                 (8, 1, "bfloat16", "float32", (True, False, True)),
                                 (7168, 32, "bfloat16", "float32", (False, True, True))):
        for T in (1, 8192):
            s = tail.spec(H, K, dt, wdt, dt, flags, T, "sm_90a", t)
            if s not in specs:
                specs.append(s)
    return specs


def finalize_cute_spec(H=3584, K=16):
    return KernelSpec(op="finalize", variant="cute", backend="cute", tag=f"H{H}-K{K}-bf16-wf32",
                      constants=(("DTYPE", "bfloat16"), ("H", H), ("K", K), ("WDTYPE", "float32")),
                      params=(("pdl", True), ("threads", 256)), arch="sm_90a")


def _is_object(data: bytes) -> bool:
    return data[:4] == b"\x7fELF" and data[16] == 1  # ET_REL: a relocatable object with the cubin inside


@pytest.mark.parametrize("spec", all_tail_specs(), ids=lambda s: f"{dict(s.params).get('cluster')}-{s.tag}")
def test_every_tail_tier_compiles_to_sm90a_object(spec, tmp_path):
    built = jit.build(spec, store=DiskCache(tmp_path))
    assert built.status == "compiled" and _is_object(built.files["kernel.o"])
    assert spec.backend == "cute" and built.key.startswith(f"tail-tail-{spec.tag}-sm_90a-")
    assert b"sm_90a" in built.files["kernel.o"]


def test_finalize_cute_variant_compiles(tmp_path):
    built = jit.build(finalize_cute_spec(), store=DiskCache(tmp_path))
    assert built.status == "compiled" and _is_object(built.files["kernel.o"])


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
def no_compile(*a, **k):
    raise AssertionError("compiled in the loading process")
jit._compile = no_compile
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
