"""The CuTe DSL finalize on a CPU box: a tiers file can pick it, it compiles for sm_90a, and its SASS keeps every
product and sum separately rounded (FMUL + FADD, never FFMA), which is what makes it bitwise equal to the CUDA
C++ variants and the torch reference (checked on the GPU by tests/gpu/test_finalize.py)."""
import pytest

from kerngen import jit, resources, tiers
from kerngen.ops import finalize as fin
from kerngen.plan import spec_for
from tests.helpers import CUTE_FINALIZE_TIERS, assert_no_spills



def cute_spec(H, K, dtype="bfloat16", wdtype="float32", **params):
    p = {"backend": "cute", "ctas": 1, "threads": 128, "max_loads": 16, "pdl": True, **params}
    return spec_for(tiers.Rule(op="finalize", variant="cute", ranges={}, params=p),
                    f"H{H}-K{K}-{dtype}-w{wdtype}", {"H": H, "K": K, "DTYPE": dtype, "WDTYPE": wdtype}, "sm_90a")


def instructions(files) -> dict:
    base = [op.split(".")[0] for op in resources.opcodes(files)]
    return {op: base.count(op) for op in ("FFMA", "FMUL", "FADD")}


@pytest.mark.parametrize("H,K,dtype,wdtype,params", [
    (3584, 16, "bfloat16", "float32", dict(ctas=4)),
    (2048, 22, "float16", "bfloat16", dict(ctas=16, threads=256)),
    (2880, 4, "bfloat16", "float32", dict(threads=256, max_loads=8)),
    (7168, 8, "bfloat16", "float32", dict(threads=256)),
    (3584, 32, "bfloat16", "float32", dict(threads=256)),
    (8, 1, "bfloat16", "bfloat16", dict(ctas=4)),
])
def test_compiles_with_separately_rounded_products_and_sums(cache_dir, H, K, dtype, wdtype, params):
    built = jit.build(cute_spec(H, K, dtype, wdtype, **params))
    assert set(built.files) == {"kernel.o"}
    n = instructions(built.files)
    assert n["FFMA"] == 0, n
    assert n["FMUL"] >= 8 * K and n["FADD"] >= 8 * K, n   # 8 columns of a 16-byte vector, K rows each
    assert_no_spills(built.files)


def test_a_tiers_file_picks_the_cute_variant_by_tokens(cache_dir, tmp_path):
    path = tmp_path / "cute.toml"
    path.write_text(CUTE_FINALIZE_TIERS)
    tbl = tiers.load(path)
    small = fin.spec(3584, 16, "bfloat16", "float32", 8, "sm_90a", tbl)
    large = fin.spec(3584, 16, "bfloat16", "float32", 4096, "sm_90a", tbl)
    assert (small.variant, small.backend, dict(small.params)["ctas"]) == ("cute", "cute", 16)
    assert (large.variant, large.backend, dict(large.params)["ctas"]) == ("cute", "cute", 1)
    assert dict(large.params)["max_loads"] == 8
    assert jit.build(small).status == "compiled" and jit.build(small).status == "cached"


def test_the_cute_variant_needs_the_cute_backend():
    spec = spec_for(tiers.Rule(op="finalize", variant="small_batch", ranges={}, params={"backend": "cute"}),
                    "H64-K2-bfloat16-wfloat32", {"H": 64, "K": 2, "DTYPE": "bfloat16", "WDTYPE": "float32"}, "sm_90a")
    with pytest.raises(fin.InputError, match="tier variant"):
        fin.kernel(spec, 1, 0)


def test_top_k_beyond_32_is_refused_by_name():
    with pytest.raises(fin.InputError, match="argument 'top_k'"):
        fin.kernel(cute_spec(1024, 33), 1, 0)


def test_every_shipped_model_builds_the_cute_variant_without_spills(cache_dir, tmp_path):
    """With the CuTe rules layered over the shipped ones, a warmup of each model's finalize kernels compiles
    them for sm_90a, with no register spills and no fused multiply-add."""
    path = tmp_path / "cute.toml"
    path.write_text(CUTE_FINALIZE_TIERS)
    tbl = tiers.load(path)
    specs = {s for m in tbl.models.values() for s in fin.model_specs(m, tbl, "sm_90a")}
    assert specs and all(s.backend == "cute" for s in specs)
    assert_builds_clean(specs)


def test_the_shipped_table_sends_thousands_of_tokens_at_k_up_to_16_to_cute(cache_dir):
    tbl = tiers.load()
    assert fin.spec(3584, 16, "bfloat16", "float32", 4096, "sm_90a", tbl).backend == "cute"
    assert fin.spec(3584, 16, "bfloat16", "float32", 4095, "sm_90a", tbl).variant == "large_batch"
    assert fin.spec(2048, 22, "bfloat16", "float32", 8192, "sm_90a", tbl).variant == "large_batch"
    specs = {s for m in tbl.models.values() for s in fin.model_specs(m, tbl, "sm_90a") if s.backend == "cute"}
    assert {dict(s.constants)["K"] for s in specs} and all(dict(s.constants)["K"] <= 16 for s in specs)
    assert_builds_clean(specs)


def assert_builds_clean(specs):
    """Each spec compiles for sm_90a with no register spills and no fused multiply-add."""
    for s in sorted(specs, key=lambda s: s.tag):
        built = jit.build(s)
        assert instructions(built.files)["FFMA"] == 0, s.tag
        assert_no_spills(built.files)
