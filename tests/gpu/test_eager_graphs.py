"""KERNGEN_EAGER_GRAPHS on the GPU: repeated eager kerngen.experts calls on the same buffers replay their launches
from a CUDA graph and still read the inputs of each call (bf16, and MXFP4 with its four launches); unset, only calls
of at most 4 tokens do; under a graph torch captures, the kernels go into that graph and replay right."""
import pytest
import torch

import kerngen
from kerngen.ops import experts as ex
from tests.gpu.test_experts_quantized import check_rows, make

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("gpu_cache")]


@pytest.fixture
def graphs_on(monkeypatch):
    monkeypatch.setenv("KERNGEN_EAGER_GRAPHS", "1")
    kerngen.clear()   # the shapes' kernels read the flag when first built
    yield
    kerngen.clear()


def case(fmt, T, E=16, K=4, H=1024, I=256, seed=0):
    if fmt == "bf16":
        g = torch.Generator(device="cuda").manual_seed(seed)
        x = (torch.randn(T, H, device="cuda", generator=g) * 0.3).to(torch.bfloat16)
        logits = torch.randn(T, E, device="cuda", generator=g)
        w = tuple((torch.randn(E, n, k, device="cuda", generator=g) * 0.05).to(torch.bfloat16)
                  for n, k in ((2 * I, H), (H, I)))
        return x, logits, w, {}
    return make(fmt, T, K, E, H, I, seed=seed)


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp4"])
@pytest.mark.parametrize("T", [1, 8])
def test_repeated_calls_replay_and_read_each_calls_inputs(graphs_on, fmt, T):
    k = repeated(fmt, T)
    assert k.graphs is not None and k.graphs.captures == 1 and k.graphs.hits >= 2


@pytest.fixture
def graphs_unset(monkeypatch):
    monkeypatch.delenv("KERNGEN_EAGER_GRAPHS", raising=False)
    kerngen.clear()
    yield
    kerngen.clear()


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("T", [1, 4, 8])
def test_unset_replays_decode_calls_only(graphs_unset, fmt, T):
    """The default: calls of at most EAGER_GRAPH_TOKENS tokens replay, larger ones launch their kernels each time;
    the rows are right either way."""
    k = repeated(fmt, T)
    assert k.graphs is not None
    assert (k.graphs.captures, k.graphs.hits >= 2) == ((1, True) if T <= ex.EAGER_GRAPH_TOKENS else (0, False))


def repeated(fmt, T):
    """Five calls on the same buffers with new values in them, each checked; the kernels object that served them."""
    x, logits, w, s = case(fmt, T)
    ws = kerngen.RoutingWorkspace(T, 16, 4, 8)
    out = None
    for step in range(5):   # the same buffers every call, new values in them
        x.copy_((torch.randn_like(x, dtype=torch.float32) * 0.3).to(x.dtype))
        logits.copy_(torch.randn_like(logits))
        r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8, workspace=ws)
        if out is None:
            out = torch.empty(r.permuted_to_token.shape[0], x.shape[1], dtype=torch.bfloat16, device="cuda")
        kerngen.experts(x, r, *w, out=out, **s)
        check_rows(out, ex.reference(x, r, *w, **s), r)
    I = w[1].shape[-2] * 32 if fmt == "mxfp4" else w[1].shape[-1]   # (MXFP4 w2: [E, H, I / 32, 16] bytes)
    return ex.dispatch(x.get_device(), H=x.shape[1], I=I, activation="silu", fmt=fmt, experts=w[0].shape[0],
                       top_k=4).kernel(T)


def test_inside_a_graph_torch_captures(graphs_on):
    T = 4
    x, logits, w, s = case("mxfp4", T, seed=3)
    ws = kerngen.RoutingWorkspace(T, 16, 4, 8)
    run = lambda: kerngen.experts(x, kerngen.route(logits, top_k=4, method="softmax_topk", tile=8,  # noqa: E731
                                                   workspace=ws), *w, **s)
    run()
    run()   # (a graph of its own captured here, eagerly)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    x.copy_((torch.randn_like(x, dtype=torch.float32) * 0.3).to(x.dtype))
    graph.replay()
    torch.cuda.synchronize()
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    check_rows(out, ex.reference(x, r, *w, **s), r)


def test_a_graph_captured_small_survives_larger_calls_on_its_stream():
    """Captured at 2 tokens on a stream, then eager calls of 16 tokens (the same rule, more tiles) on that same
    stream outgrow its per-stream scratch: the graph still reads live buffers and replays right."""
    side = torch.cuda.Stream()
    x, logits, w, s = case("bf16", 2, seed=5)
    ws = kerngen.RoutingWorkspace(2, 16, 4, 8)
    run = lambda xx, ll, wsp: kerngen.experts(xx, kerngen.route(ll, top_k=4, method="softmax_topk",  # noqa: E731
                                                                tile=8, workspace=wsp), *w, **s)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(x, logits, ws)   # (its kernels built and its scratch made outside the capture)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            out = run(x, logits, ws)
        big, big_logits, _, _ = case("bf16", 16, seed=6)
        run(big, big_logits, kerngen.RoutingWorkspace(16, 16, 4, 8))
    torch.cuda.current_stream().wait_stream(side)
    k = ex.dispatch(x.get_device(), H=x.shape[1], I=w[1].shape[-1], activation="silu", experts=16, top_k=4)
    assert k.kernel(2) is k.kernel(16) and k.kernel(2)._kept   # the same kernels: their scratch outgrown, kept
    for seed in (7, 8):
        x2, logits2, _, _ = case("bf16", 2, seed=seed)
        x.copy_(x2)
        logits.copy_(logits2)
        graph.replay()
        torch.cuda.synchronize()
        r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
        check_rows(out, ex.reference(x, r, *w, **s), r)
