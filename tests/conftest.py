import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """A fresh, empty kernel cache for this test."""
    d = tmp_path / "cache"
    monkeypatch.setenv("KERNGEN_CACHE_DIR", str(d))
    return d


@pytest.fixture(scope="session")
def gpu_cache(tmp_path_factory):
    """One cache shared by the GPU tests of a session (kernels compile once)."""
    import os
    d = tmp_path_factory.mktemp("gpu-cache")
    old = os.environ.get("KERNGEN_CACHE_DIR")
    os.environ["KERNGEN_CACHE_DIR"] = str(d)
    yield d
    if old is None:
        os.environ.pop("KERNGEN_CACHE_DIR", None)
    else:
        os.environ["KERNGEN_CACHE_DIR"] = old


def assert_no_spills(files: dict) -> None:
    """Every kernel of a compiled artifact keeps its values in registers (spills are a performance bug that
    compiles and runs correctly, so only this catches them without a GPU)."""
    from kerngen import resources
    for function, use in resources.usage(files):
        assert use.get("STACK", 0) == 0, f"{function[:80]} spills: {use}"


# A user tiers file that sends every finalize to the CuTe DSL variant (few tokens: 16 CTAs per token).
CUTE_FINALIZE_TIERS = """schema = 1

[[tier]]
op = "finalize"
variant = "cute"
tokens = [1, 16]
params = { backend = "cute", ctas = 16, threads = 128, max_loads = 16, pdl = true }

[[tier]]
op = "finalize"
variant = "cute"
params = { backend = "cute", ctas = 1, threads = 256, max_loads = 8, pdl = true }
"""
