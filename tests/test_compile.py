"""Rendering and NVRTC compilation of every finalize tier, for sm_90a, with no GPU."""
import jinja2
import pytest

from kerngen import jit, render, tiers
from kerngen.cache import DiskCache
from kerngen.errors import CompileError
from kerngen.ops import finalize as fin
from kerngen.plan import KernelSpec
from tests.helpers import assert_no_spills


def all_finalize_specs():
    """Every CUDA C++ finalize the tiers can pick (the CuTe DSL ones: tests/test_finalize_cute_cpu.py)."""
    t = tiers.load()
    specs = []
    for m in t.models.values():
        specs += [s for s in fin.model_specs(m, t, "sm_90a") if s not in specs]
    for H, K in ((2880, 22), (8, 1), (7168, 32), (1024, 64)):  # generic shapes beyond the shipped models
        for T in (1, 2048, 8192):
            s = fin.spec(H, K, "float16", "bfloat16", T, "sm_90a", t)
            if s not in specs:
                specs.append(s)
    return [s for s in specs if s.backend == "nvrtc"]


@pytest.mark.parametrize("spec", all_finalize_specs(), ids=lambda s: f"{s.variant}-{s.tag}")
def test_every_finalize_tier_compiles_to_sm90a_cubin(spec, tmp_path):
    built = jit.build(spec, store=DiskCache(tmp_path))
    cubin = built.files["kernel.cubin"]
    assert built.status == "compiled" and cubin[:4] == b"\x7fELF"
    assert f"finalize_{spec.variant}".encode() in cubin  # the entry point launch looks up
    assert_no_spills(built.files)


@pytest.mark.parametrize("wdtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("H,K", [(5120, 1), (4096, 2), (2880, 4), (7168, 8)])
def test_small_k_finalize_issues_every_load_before_it_waits_on_a_row(H, K, wdtype, tmp_path):
    """The small-K rules' finalize (small_batch, one group of loads): a thread's K weights are read with its K
    indices, so after those two round trips its row loads are the only ones left: in the SASS every global load
    comes before the first instruction that reads a row's bits (the PRMT that splits a bf16 pair)."""
    import re
    from kerngen import resources
    s = fin.spec(H, K, "bfloat16", wdtype, 1, "sm_90a")
    assert s.variant == "small_batch" and dict(s.params)["loads_per_group"] >= K
    ops = [m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?P\d\s+)?([A-Z0-9_.]+)",
                                           resources.sass(jit.build(s, store=DiskCache(tmp_path)).files))]
    first_use = ops.index("PRMT")
    loads = [i for i, op in enumerate(ops) if op.startswith("LDG")]
    assert len(loads) == 2 * K + K and max(loads) < first_use, (loads, first_use)


def test_render_is_strict_about_missing_values():
    spec = KernelSpec(op="finalize", variant="large_batch", backend="nvrtc", tag="t",
                      constants=(("H", 64), ("K", 2), ("DTYPE", "bfloat16"), ("WDTYPE", "float32")),
                      params=(("unroll", 2),), arch="sm_90a")  # vectors_per_thread missing
    with pytest.raises(jinja2.UndefinedError, match="vectors_per_thread"):
        render.render(spec)


def test_key_is_readable_and_content_addressed():
    a = fin.spec(3584, 16, "bfloat16", "float32", 1, "sm_90a")
    b = fin.spec(3584, 16, "bfloat16", "float32", 2, "sm_90a")  # same tier: same kernel
    c = fin.spec(3584, 16, "bfloat16", "float32", 1, "sm_100a")
    ka, kb, kc = jit.key_of(a), jit.key_of(b), jit.key_of(c)
    assert ka.startswith("finalize-small_batch-H3584-K16-bf16-wf32-sm_90a-") and ka == kb and ka != kc
    assert len(ka.rsplit("-", 1)[1]) == 12


def test_compile_error_shows_log_and_source_path(tmp_path, monkeypatch):
    spec = fin.spec(64, 2, "bfloat16", "float32", 1, "sm_90a")
    monkeypatch.setattr(jit, "render", lambda s: "this is not C++;\n")
    with pytest.raises(CompileError) as e:
        jit.build(spec, store=DiskCache(tmp_path))
    msg = str(e.value)
    assert "error" in msg and e.value.source_path and e.value.source_path in msg
    assert open(e.value.source_path).read() == "this is not C++;\n"
    assert DiskCache(tmp_path).keys() == [] or all(DiskCache(tmp_path).get(k) is None
                                                    for k in DiskCache(tmp_path).keys())


def test_spill_check_sees_a_stack_frame():
    """The no-spill assertion of the compile tests reads something that can be nonzero: a local array indexed
    at run time lives in a stack frame."""
    from kerngen import resources
    from kerngen.compile import nvrtc_compile
    src = ('extern "C" __global__ void spill(int* o, int i) {\n'
           '    int a[256];\n'
           '    a[0] = o[0];\n'
           '    for (int j = 1; j < 256; ++j) a[j] = a[j - 1] * 3 + o[j];\n'
           '    o[0] = a[i & 255] + a[(i >> 8) & 255];\n'
           '}\n')
    cubin, _ = nvrtc_compile(src, "spill", "sm_90a", "spill", None)
    [(name, use)] = resources.usage({"kernel.cubin": cubin})
    assert name == "spill" and use["STACK"] >= 1024
    with pytest.raises(AssertionError, match="spills"):
        assert_no_spills({"kernel.cubin": cubin})


def test_a_compile_with_an_empty_log_leaves_the_interpreter_s_bytes_alone():
    """NVRTC writes its log into the buffer it is handed; an empty log is one byte, and b" " * 1 is the interpreter's
    shared b" ": once overwritten, every b" " (and, on Python 3.12, the space torch's schema strings are built with)
    reads as a NUL for the rest of the process."""
    from kerngen.compile import nvrtc_compile
    cubin, log = nvrtc_compile('extern "C" __global__ void k() {}', "k", "sm_90a", "empty-log", None)
    assert log == "" and cubin[:4] == b"\x7fELF"
    assert b" "[0] == 32 and (b" " * 1)[0] == 32 and " ".encode()[0] == 32 and "a b".split() == ["a", "b"]


def test_finalize_stream_false_reads_rows_with_the_default_cache_policy(tmp_path):
    """small_batch's row loads are evict-first (LDG.E.EF) by default; stream = false reads them with the default
    policy (no EF), the index and weight loads unchanged, and the default build's source has no trace of it."""
    from kerngen import resources
    from kerngen.plan import spec_for
    from kerngen.tiers import Rule

    def spec(**extra):
        rule = Rule(op="finalize", variant="small_batch", ranges={},
                    params=dict(block_x=32, loads_per_group=8, pdl=False, early_read=False, **extra))
        return spec_for(rule, *fin.tag_constants(2880, 4, "bfloat16", "float32"), "sm_90a")

    assert "kg_ldg_keep" not in render.render(spec()) and render.render(spec()) == render.render(spec(stream=True))
    loads = {s: [o for o in resources.opcodes(jit.build(spec(stream=s), store=DiskCache(tmp_path)).files)
                 if o.startswith("LDG")] for s in (True, False)}
    assert sum(".EF." in o for o in loads[True]) == 4 and not any(".EF" in o for o in loads[False])
    assert len(loads[True]) == len(loads[False])
