"""tools/bench/moe_layer_demo.py on the GPU: one decode step of kimi-k3 and deepseek-v3 through kerngen (route,
kerngen.experts or the stand-in, moe_tail) inside a CUDA graph matches the torch layer within the demo's tolerance, with the same expert ids."""
import pytest
import torch

import kerngen
from tests.test_demo_cpu import demo

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("gpu_cache")]

INTER = 64


@pytest.fixture(scope="module", params=["kimi-k3", "deepseek-v3"])
def layer(request):
    m = kerngen.models()[request.param]
    yield m, demo.make_weights(m, INTER)
    torch.cuda.empty_cache()


@pytest.mark.parametrize("experts", ["kerngen", "torch"])
@pytest.mark.parametrize("T", [1, 8])
def test_kerngen_layer_matches_torch_layer_in_a_graph(layer, T, experts):
    m, w = layer
    r = demo.run_case(m, w, T, tile=16, timed=False, experts=experts)
    assert r["ids_equal"] == 1.0
    assert r["max_rel"] <= demo.TOL, r
