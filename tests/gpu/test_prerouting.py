"""kerngen.PreRouting on the GPU: with a router stream held back on purpose (torch.cuda._sleep before the logits
are written), what take returns on the main stream is bitwise kerngen.route's, eagerly and inside a CUDA graph
(fork/join captured); a changed tile or shape routes itself, other logits raise, large token counts route
themselves; the demo's three-stream layer matches its one-stream layer bit for bit."""
import pytest
import torch

import kerngen
from kerngen import tiers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("gpu_cache")]

MODELS = sorted(tiers.load().models)
SLEEP = 20_000_000   # cycles the router stream waits before writing the logits: ~10 ms at 2 GHz
FIELDS = ("topk_ids", "topk_weights", "expert_counts", "expert_offsets", "expanded_to_permuted", "permuted_to_token",
          "tile_to_expert", "num_permuted_rows")


def inputs(name, T, seed=0):
    m = tiers.load().model(name)
    g = torch.Generator(device="cuda").manual_seed(seed)
    src = torch.randn(T, m.num_experts, device="cuda", generator=g) * 2
    bias = (torch.randn(m.num_experts, device="cuda", generator=g) * 0.05 if "sigmoid_bias" in m.routing else None)
    return src, bias


def snapshot(r):
    """Copies of every field of a Routing, made on the current stream right away."""
    return {f: getattr(r, f).clone() for f in FIELDS if getattr(r, f) is not None}


def step(pre, router, src, bias, delay=SLEEP, **take):
    """One decode step: fork, the router stream (held back) writes logits = src and launches, the main stream
    takes and copies the result at once. Returns (logits, the Routing, its copies)."""
    router.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(router):
        if delay:
            torch.cuda._sleep(delay)
        logits = src.clone()
        pre.launch(logits, bias)
    r = pre.take(logits, bias, **take)
    return logits, r, snapshot(r)


def assert_routes_like_route(got, logits, bias, name, tile):
    torch.cuda.synchronize()
    want = snapshot(kerngen.route(logits, bias=bias, model=name, tile=tile))
    assert got.keys() == want.keys()
    for f in want:
        assert torch.equal(got[f], want[f]), f


def pre_routed(pre, r):
    return r.topk_ids.data_ptr() == pre.workspace.ids.data_ptr()


@pytest.mark.parametrize("T", [1, 4, 8])
@pytest.mark.parametrize("name", MODELS)
def test_pre_routed_is_route_bitwise_with_a_late_router_stream(name, T):
    pre, router = kerngen.PreRouting(model=name, tile=16), torch.cuda.Stream()
    src, bias = inputs(name, T)
    logits, r, got = step(pre, router, src, bias)               # first time: take routes (after the join)
    assert not pre_routed(pre, r)
    assert_routes_like_route(got, logits, bias, name, 16)
    for seed in (1, 2):
        src, _ = inputs(name, T, seed)
        pre.workspace.ids.fill_(-7)                             # what a read before the join would see
        logits, r, got = step(pre, router, src, bias)
        assert pre_routed(pre, r)
        assert_routes_like_route(got, logits, bias, name, 16)


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_without_a_tile_and_with_bf16_logits(weights_dtype):
    name = "kimi-k3"
    pre, router = kerngen.PreRouting(model=name, weights_dtype=weights_dtype), torch.cuda.Stream()
    src, bias = inputs(name, 5)
    src = src.bfloat16()
    step(pre, router, src, bias)
    logits, r, got = step(pre, router, src, bias)
    assert pre_routed(pre, r) and r.permuted_to_token is None and r.topk_weights.dtype == weights_dtype
    torch.cuda.synchronize()
    ws = kerngen.RoutingWorkspace(5, 896, 16, weights_dtype=weights_dtype)
    want = kerngen.route(logits, bias=bias, model=name, workspace=ws)
    assert torch.equal(got["topk_ids"], want.topk_ids) and torch.equal(got["topk_weights"], want.topk_weights)


@pytest.mark.parametrize("T", [1, 8])
@pytest.mark.parametrize("name", ["kimi-k3", "deepseek-v3"])
def test_pre_routed_inside_a_cuda_graph(name, T):
    """Two layers per step sharing one PreRouting, fork/join captured; replayed with new inputs."""
    pre, router = kerngen.PreRouting(model=name, tile=16), torch.cuda.Stream()
    src = [inputs(name, T, seed)[0] for seed in (0, 1)]
    _, bias = inputs(name, T)

    def layers():
        return [step(pre, router, s, bias) for s in src]

    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        layers()                                             # takes route: the shape is seen
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layers()
    assert all(pre_routed(pre, r) for _, r, _ in out)
    for seed in (10, 11, 12):
        for i, s in enumerate(src):
            s.copy_(inputs(name, T, seed + 100 * i)[0])
        pre.workspace.ids.fill_(-7)
        graph.replay()
        for logits, _, got in out:
            assert_routes_like_route(got, logits, bias, name, 16)


def test_a_fallback_inside_a_cuda_graph_still_joins_the_router_stream():
    name, T = "kimi-k3", 4
    pre, router = kerngen.PreRouting(model=name, tile=16), torch.cuda.Stream()
    src, bias = inputs(name, T)
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        step(pre, router, src, bias)
    torch.cuda.current_stream().wait_stream(warm)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits, r, got = step(pre, router, src, bias, tile=64)   # pre-routed at 16, taken at 64: routed here
    assert not pre_routed(pre, r)
    src.copy_(inputs(name, T, 5)[0])
    graph.replay()
    assert_routes_like_route(got, logits, bias, name, 64)


def test_a_changed_tile_or_shape_routes_itself():
    name = "deepseek-v3"
    pre, router = kerngen.PreRouting(model=name, tile=16), torch.cuda.Stream()
    src, bias = inputs(name, 4)
    step(pre, router, src, bias)
    for tile in (64, None):
        logits, r, got = step(pre, router, src, bias, tile=tile)
        assert not pre_routed(pre, r)
        assert_routes_like_route(got, logits, bias, name, tile)
    step(pre, router, src, bias)                               # pre-routed at T = 4 ...
    router.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(router):
        torch.cuda._sleep(SLEEP)
        logits = src.clone()
        pre.launch(logits, bias)
        fewer = logits[:2]                                     # ... taken at T = 2: routed here, after the join
    r = pre.take(fewer, bias)
    got = snapshot(r)
    assert not pre_routed(pre, r)
    assert_routes_like_route(got, fewer, bias, name, 16)


def test_a_first_shape_is_taken_after_the_router_stream_wrote_the_logits():
    """launch of a shape not seen yet routes nothing, but its event still orders take's own routing after the
    logits (a take that did not wait would route the zeros the logits held before)."""
    name = "kimi-k3"
    pre, router = kerngen.PreRouting(model=name, tile=16), torch.cuda.Stream()
    src, bias = inputs(name, 3)
    logits = torch.zeros_like(src)
    router.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(router):
        torch.cuda._sleep(SLEEP)
        logits.copy_(src)
        pre.launch(logits, bias)
    got = snapshot(pre.take(logits, bias))
    assert_routes_like_route(got, src, bias, name, 16)


def test_other_logits_of_a_pre_routed_shape_raise():
    name = "kimi-k3"
    pre, router = kerngen.PreRouting(model=name, tile=16), torch.cuda.Stream()
    src, bias = inputs(name, 4)
    logits, _, _ = step(pre, router, src, bias)
    step(pre, router, src, bias)
    router.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(router):
        logits = src.clone()
        pre.launch(logits, bias)
    with pytest.raises(kerngen.InputError, match="unsynchronized") as e:
        pre.take(src, bias)                                    # the same values, not the launched tensor
    assert e.value.arg == "logits"
    router.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(router):
        pre.launch(logits, bias)
    with pytest.raises(kerngen.InputError, match="bias"):
        pre.take(logits, bias.clone())
    logits, r, got = step(pre, router, src, bias)              # and the next step is pre-routed again
    assert pre_routed(pre, r)
    assert_routes_like_route(got, logits, bias, name, 16)


@pytest.mark.parametrize("max_tokens,T", [(8, 9), (8, 16), (16, 16), (1, 1), (1, 2)])
def test_the_token_limit(max_tokens, T):
    name = "kimi-k3"
    pre, router = kerngen.PreRouting(model=name, tile=16, max_tokens=max_tokens), torch.cuda.Stream()
    src, bias = inputs(name, T)
    for i in range(3):
        logits, r, got = step(pre, router, src, bias)
        assert pre_routed(pre, r) == (T <= max_tokens and i > 0)
        assert_routes_like_route(got, logits, bias, name, 16)


def test_the_demo_three_stream_layer_is_the_one_stream_layer_bit_for_bit():
    from tests.test_demo_cpu import demo
    for name in ("kimi-k3", "deepseek-v3"):
        m = kerngen.models()[name]
        w = demo.make_weights(m, 64)
        for T in (1, 8, 16):
            r = demo.run_case(m, w, T, tile=16, timed=False, schedules=("one", "three"))
            assert r["same_bits"] and r["ids_equal"] == 1.0 and r["max_rel"] <= demo.TOL, r
        del w
        torch.cuda.empty_cache()
