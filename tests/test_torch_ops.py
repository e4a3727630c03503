"""The torch custom ops: schema, fake tensors and dispatch checked by torch.library.opcheck on the CPU."""
import pytest
import torch

import kerngen.torch_ops  # noqa: F401  (registers torch.ops.kerngen.*)
from kerngen.ops import finalize as fin
from kerngen.ops import routing as rt
from kerngen.ops import tail


def finalize_args(T=5, K=4, H=64, rows=40):
    g = torch.randn(rows, H).to(torch.bfloat16)
    e2p = torch.randint(-1, rows, (T, K), dtype=torch.int32)
    return g, e2p, torch.rand(T, K)


def test_finalize_opcheck():
    torch.library.opcheck(torch.ops.kerngen.finalize.default, finalize_args())
    torch.library.opcheck(torch.ops.kerngen.finalize.default, finalize_args(), {"hidden": 32})


@pytest.mark.parametrize("method, extra", [
    ("softmax_topk", {}), ("topk_softmax", {}), ("sigmoid_bias", {"routed_scaling_factor": 2.5}),
    ("grouped_sigmoid_bias", {"n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5}),
])
def test_route_opcheck(method, extra):
    logits = torch.randn(6, 32)
    bias = torch.randn(32) if "sigmoid" in method else None
    torch.library.opcheck(torch.ops.kerngen.route.default, (logits, 4, method, bias), extra)


def test_moe_tail_opcheck():
    g, e2p, w = finalize_args(H=128)
    nw = torch.rand(128).to(torch.bfloat16)
    shared = torch.randn(5, 128).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.kerngen.moe_tail.default, (g, e2p, w, nw), {"shared": shared})


def test_cpu_kernels_are_the_references():
    g, e2p, w = finalize_args()
    assert torch.equal(torch.ops.kerngen.finalize(g, e2p, w), fin.reference(g, e2p, w))
    logits = torch.randn(3, 16)
    ids, wt = torch.ops.kerngen.route(logits, 2, "softmax_topk")
    rids, rw = rt.reference(logits, 2, "softmax_topk")
    assert torch.equal(ids, rids) and torch.equal(wt, rw)
    nw = torch.ones(64).to(torch.bfloat16)
    assert torch.equal(torch.ops.kerngen.moe_tail(g, e2p, w, nw), tail.reference(g, e2p, w, nw)[0])


def test_fullgraph_compile_has_no_graph_breaks():
    def layer(logits, g, e2p, nw):
        ids, w = torch.ops.kerngen.route(logits, 4, "softmax_topk")
        y = torch.ops.kerngen.finalize(g, e2p, w)
        return torch.ops.kerngen.moe_tail(g, e2p, w, nw), y, ids
    g, e2p, _ = finalize_args(T=5, K=4, H=64)
    args = (torch.randn(5, 16), g, e2p, torch.rand(64).to(torch.bfloat16))
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    for a, b in zip(compiled(*args), layer(*args)):
        assert torch.equal(a, b)


def test_finalize_prepare_checks_inputs_on_the_cpu_too():
    g, e2p, w = finalize_args()
    with pytest.raises(kerngen.InputError, match="gemm2_out"):
        kerngen.finalize_prepare(g, e2p, w)   # CPU tensors: the kernels need CUDA


@pytest.mark.parametrize("args, arg", [
    ((0, "softmax_topk"), "top_k"), ((65, "softmax_topk"), "top_k"), ((4, "nope"), "method"),
    ((4, "grouped_sigmoid_bias", None, 8, 9), "topk_group"), ((4, "grouped_sigmoid_bias", None, 7, 1), "n_group"),
    ((4, "softmax_topk", None, 1, 1, 0.0), "routed_scaling_factor"),
    ((4, "softmax_topk", None, 1, 1, float("nan")), "routed_scaling_factor"),
    ((4, "sigmoid_bias", torch.zeros(5)), "bias"),
])
def test_route_on_cpu_checks_its_arguments_as_the_kernels_do(args, arg):
    with pytest.raises(kerngen.InputError, match=arg):
        torch.ops.kerngen.route(torch.randn(3, 64), *args)
