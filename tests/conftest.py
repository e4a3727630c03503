import gc

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


@pytest.fixture(autouse=True, scope="module")
def _gpu_memory_back_after_each_module():
    """Cached blocks go back to the driver after each test module: GPU tests run in parallel workers
    (pytest -n) share one card, and a worker's idle cache would otherwise starve the others' large tests."""
    yield
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()
        torch.cuda.empty_cache()
