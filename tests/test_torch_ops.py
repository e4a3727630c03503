"""The torch custom ops: schema, fake tensors and dispatch checked by torch.library.opcheck on the CPU."""
import pytest
import torch

import kerngen
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


def _bad_gather_inputs():
    g, e2p, w = finalize_args(T=4, K=2, H=64, rows=8)
    return [
        ((g, e2p, torch.rand(4, 3)), "topk_weights"),          # K + 1 columns
        ((g, e2p, torch.rand(3, 2)), "topk_weights"),
        ((g, e2p, w.double()), "topk_weights"),
        ((g.double(), e2p, w), "gemm2_out"),
        ((g[:, :4], e2p, w), "norm_weight|hidden|gemm2_out"),
        ((g, e2p.long(), w), "expanded_to_permuted"),
        ((g, e2p.flatten(), w), "expanded_to_permuted"),
        ((g, e2p[:, :0], w[:, :0]), "expanded_to_permuted"),
        ((g, e2p.t(), w.t()), "expanded_to_permuted"),         # not contiguous
    ]


@pytest.mark.parametrize("case", range(len(_bad_gather_inputs())))
@pytest.mark.parametrize("op", ["finalize", "moe_tail"])
def test_finalize_and_moe_tail_on_cpu_check_their_inputs_as_the_kernels_do(op, case):
    args, arg = _bad_gather_inputs()[case]
    extra = (torch.ones(64, dtype=torch.bfloat16),) if op == "moe_tail" else ()
    with pytest.raises(kerngen.InputError, match=arg):
        getattr(torch.ops.kerngen, op)(*args, *extra)


def test_moe_tail_on_cpu_checks_norm_weight_shared_and_residual():
    g, e2p, w = finalize_args(T=4, K=2, H=64, rows=8)
    nw = torch.ones(64, dtype=torch.bfloat16)
    for kw, arg in (({"norm_weight": nw.float()}, "norm_weight"), ({"norm_weight": nw[:60]}, "norm_weight"),
                    ({"shared": torch.zeros(3, 64, dtype=torch.bfloat16)}, "shared"),
                    ({"residual": torch.zeros(4, 64)}, "residual")):
        with pytest.raises(kerngen.InputError, match=arg):
            torch.ops.kerngen.moe_tail(g, e2p, w, kw.pop("norm_weight", nw), **kw)


def test_finalize_on_cpu_checks_hidden():
    g, e2p, w = finalize_args(T=4, K=2, H=64, rows=8)
    for hidden in (4, 65, 72):
        with pytest.raises(kerngen.InputError, match="hidden"):
            torch.ops.kerngen.finalize(g, e2p, w, hidden)


def _align_buffers(T, K, E, block):
    rows = T * K + E * (block - 1)
    i32 = dict(dtype=torch.int32)
    return torch.empty(rows, **i32), torch.empty(-(-rows // block), **i32), torch.empty(1, **i32)


@pytest.mark.parametrize("change, arg", [
    (lambda a: a.update(ids=a["ids"].long()), "topk_ids"),
    (lambda a: a.update(E=0), "num_experts"),
    (lambda a: a.update(block=0), "block_size"),
    (lambda a: a.update(sorted=a["sorted"][:4]), "sorted_token_ids"),
    (lambda a: a.update(sorted=a["sorted"].long()), "sorted_token_ids"),
    (lambda a: a.update(experts=a["experts"][:1]), "expert_ids"),
    (lambda a: a.update(post=torch.empty(1, 2, dtype=torch.int32)), "num_tokens_post_pad"),
])
def test_moe_align_block_size_on_cpu_checks_its_arguments_as_the_kernel_does(change, arg):
    ids = torch.tensor([[2, 3, 4], [1, 2, 4]], dtype=torch.int32)
    s, e, n = _align_buffers(2, 3, 5, 4)
    a = dict(ids=ids, E=5, block=4, sorted=s, experts=e, post=n)
    change(a)
    with pytest.raises(kerngen.InputError, match=arg):
        torch.ops.kerngen.moe_align_block_size(a["ids"], a["E"], a["block"], a["sorted"], a["experts"], a["post"])


def test_moe_align_block_size_skips_ids_outside_the_experts_on_cpu_as_the_kernel_does():
    from kerngen.adapters import moe_align_block_size
    ids = torch.tensor([[2, 7], [-1, 2]], dtype=torch.int32)    # 7 and -1 name no expert of 5
    s, e, n = _align_buffers(2, 2, 5, 4)
    torch.ops.kerngen.moe_align_block_size(ids, 5, 4, s, e, n)
    assert n.tolist() == [4] and s[:4].tolist() == [0, 3, 4, 4] and e[0] == 2
    assert [t.tolist() for t in moe_align_block_size(ids, 4, 5)][2] == [4]


def test_finalize_on_cpu_with_no_rows_sums_nothing():
    """gemm2_out with no rows: every index lies outside [0, rows), so every slot is skipped (zeros), as the kernel
    skips them; the reference does not index an empty tensor."""
    _, e2p, w = finalize_args(T=4, K=2, H=64, rows=8)
    g = torch.empty(0, 64, dtype=torch.bfloat16)
    out = torch.ops.kerngen.finalize(g, e2p, w)
    assert out.shape == (4, 64) and out.dtype == torch.bfloat16 and not out.any()
    assert torch.equal(fin.reference(g, e2p, w), out)


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf"), "1e-6", True])
def test_moe_tail_checks_eps_on_cpu_and_before_any_launch(eps):
    """eps: a finite number >= 0, in torch.ops.kerngen.moe_tail on CPU tensors and in kerngen.moe_tail (checked
    before the tensors, so no GPU is needed to see it), as latent_tail does; a bool is not a number here."""
    g, e2p, w = finalize_args(T=4, K=2, H=64, rows=8)
    nw = torch.ones(64, dtype=torch.bfloat16)
    if isinstance(eps, float):   # (torch's schema itself refuses a str for the op's float argument)
        with pytest.raises(kerngen.InputError, match="eps"):
            torch.ops.kerngen.moe_tail(g, e2p, w, nw, eps)
    with pytest.raises(kerngen.InputError, match="eps"):
        kerngen.moe_tail(g, e2p, w, nw, eps=eps)
    torch.ops.kerngen.moe_tail(g, e2p, w, nw, 0)   # an int is a number


def _experts_args(T=3, K=2, E=4, H=64, I=32):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).int()
    w = torch.rand(T, K, generator=gen)
    w13 = (torch.randn(E, 2 * I, H, generator=gen) / 8).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, generator=gen) / 8).to(torch.bfloat16)
    return x, ids, w, w13, w2


@pytest.mark.parametrize("bad", ["wide", "tall", "flat", "ints"])
def test_moe_experts_on_cpu_checks_topk_weights(bad):
    """torch.ops.kerngen.moe_experts names topk_weights when it is not a floating [T, K] tensor like topk_ids (a K + 1
    column was once read as if it were not there, a wrong T raised torch's own error); the same check runs on the
    CUDA path, before any launch."""
    x, ids, w, w13, w2 = _experts_args()
    ok = torch.ops.kerngen.moe_experts(x, ids, w, w13, w2, "silu")
    assert ok.shape == (3, 64)
    bad_w = {"wide": torch.rand(3, 3), "tall": torch.rand(4, 2), "flat": torch.rand(6),
             "ints": torch.ones(3, 2, dtype=torch.int32)}[bad]
    with pytest.raises(kerngen.InputError, match="topk_weights"):
        torch.ops.kerngen.moe_experts(x, ids, bad_w, w13, w2, "silu")


def test_one_cpu_rule_for_every_op_that_launches_kernels():
    """Every kernel op refuses a CPU tensor with the same InputError: the argument named, a CUDA tensor expected, and
    its CPU entry points named (_common.CPU_ENTRY), each of which exists."""
    import importlib
    import re
    from kerngen.ops import OPS, _common
    from kerngen.ops import permute as pm
    assert set(OPS) <= set(_common.CPU_ENTRY)
    for op, text in _common.CPU_ENTRY.items():
        for name in re.findall(r"(?:torch\.ops\.kerngen|kerngen)\.[\w.]+", text):
            if name.startswith("torch.ops.kerngen."):
                assert callable(getattr(torch.ops.kerngen, name.split(".")[-1])), (op, name)
                continue
            module, attr = name.rsplit(".", 1)
            assert callable(getattr(importlib.import_module(module), attr)), (op, name)
    assert pm.reference is pm.permute_reference
    x, ids, w, w13, w2 = _experts_args()
    r = kerngen.Routing(ids, w, **pm.permute_reference(ids, w13.shape[0], 1), tile=1)
    g, e2p, tw = finalize_args()
    nw, up = torch.ones(64, dtype=torch.bfloat16), torch.zeros(128, 64, dtype=torch.bfloat16)
    calls = {"routing": ("logits", lambda: kerngen.route(torch.randn(3, 8), top_k=2, method="softmax_topk")),
             "permute": ("topk_ids", lambda: kerngen.permute(ids, num_experts=4, tile=16)),
             "moe_align_block_size": ("topk_ids", lambda: pm.permute_align_into(
                 ids, 4, 4, *(torch.empty(n, dtype=torch.int32) for n in (32, 8, 1)))),
             "experts": ("x", lambda: kerngen.experts(x, r, w13, w2)),
             "finalize": ("gemm2_out", lambda: kerngen.finalize(g, e2p, tw)),
             "tail": ("gemm2_out", lambda: kerngen.moe_tail(g, e2p, tw, nw)),
             "latent_tail": ("gemm2_out", lambda: kerngen.latent_tail(g, e2p, tw, nw, up))}
    for op, (arg, call) in calls.items():
        with pytest.raises(kerngen.InputError) as e:
            call()
        where = _common.CPU_ENTRY[op]
        assert (e.value.op, e.value.arg, e.value.got) == (op, arg, "a tensor on cpu"), op
        assert e.value.expected == f"a CUDA tensor (kerngen's kernels run on the GPU; on the CPU: {where})"


@pytest.mark.parametrize("op", ["finalize", "moe_tail", "latent_tail"])
@pytest.mark.parametrize("meta", ["gemm2_out", "topk_weights"])
def test_shape_only_calls_refuse_tensors_on_two_devices(op, meta):
    """A meta tensor beside CPU ones reaches the shape-only implementation: an InputError naming the argument whose
    device differs (torch's own ops refuse such a call too), never an output of no device's making."""
    T, K, H, L = 4, 2, 64, 32
    a = dict(gemm2_out=torch.randn(T * K, L if op == "latent_tail" else H, dtype=torch.bfloat16),
             expanded_to_permuted=torch.arange(T * K, dtype=torch.int32).view(T, K), topk_weights=torch.rand(T, K))
    if op != "finalize":
        a["norm_weight"] = torch.ones(L if op == "latent_tail" else H, dtype=torch.bfloat16)
    if op == "latent_tail":
        a["up_proj"] = torch.randn(H, L, dtype=torch.bfloat16)
    a[meta] = a[meta].to("meta")
    with pytest.raises(kerngen.InputError, match="same device as the other inputs"):
        getattr(torch.ops.kerngen, op)(*a.values())
    out = getattr(torch.ops.kerngen, op)(*(t.to("meta") for t in a.values()))   # all on one device: its shape
    assert out.device.type == "meta" and tuple(out.shape) == (T, H)


def test_latent_tail_route_permute_and_moe_experts_opcheck():
    """The other ops' schema, fake and dynamic-shape implementations (the fakes run the ops' checks on plain shapes
    and only the ranks on symbolic ones)."""
    g, e2p, w = finalize_args(H=64)
    nw, up = torch.rand(64).to(torch.bfloat16), torch.randn(96, 64).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.kerngen.latent_tail.default, (g, e2p, w, nw, up))
    torch.library.opcheck(torch.ops.kerngen.route_permute.default, (torch.randn(6, 32), 4, "softmax_topk", 8))
    x, ids, tw, w13, w2 = _experts_args()
    torch.library.opcheck(torch.ops.kerngen.moe_experts.default, (x, ids, tw, w13, w2, "silu"))


def _fake_cuda(mode, t):
    """t as a FakeTensor on cuda:0 (what torch.compile's tracing of a GPU model hands the shape-only
    implementations), made without a GPU."""
    from torch._subclasses.fake_tensor import FakeTensor
    return FakeTensor(mode, t.to("meta"), torch.device("cuda", 0))


def test_shape_only_calls_on_gpu_fakes_check_and_read_no_address(recwarn):
    """On fake CUDA tensors the shape-only implementations give each output's shape, name a wrong argument as the
    kernels do (the alignment checks skipped: a fake has no address), and never touch a data pointer (torch warns
    then, and will raise)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from kerngen.ops import experts_torch, finalize_torch, latent_tail_torch, routing_torch, tail_torch
    mode = FakeTensorMode()
    f = lambda t: _fake_cuda(mode, t)   # noqa: E731
    x, ids, tw, w13, w2 = (f(t) for t in _experts_args())
    g, e2p, w = (f(t) for t in finalize_args(T=3, K=2, H=64, rows=6))
    nw, up = f(torch.ones(64, dtype=torch.bfloat16)), f(torch.zeros(96, 64, dtype=torch.bfloat16))
    with mode:
        assert tuple(experts_torch._moe_experts_fake(x, ids, tw, w13, w2, "silu").shape) == (3, 64)
        assert tuple(finalize_torch._finalize_fake(g, e2p, w).shape) == (3, 64)
        assert tuple(tail_torch._moe_tail_fake(g, e2p, w, nw).shape) == (3, 64)
        assert tuple(latent_tail_torch._latent_tail_fake(g, e2p, w, nw, up).shape) == (3, 96)
        ids_out, _ = routing_torch._route_fake(f(torch.randn(3, 16)), 2, "softmax_topk")
        assert tuple(ids_out.shape) == (3, 2)
        with pytest.raises(kerngen.InputError, match="'w2' must be of shape"):
            experts_torch._moe_experts_fake(x, ids, tw, w13, f(torch.zeros(8, 64, 16, dtype=torch.bfloat16)), "silu")
        with pytest.raises(kerngen.InputError, match="'up_proj'"):
            latent_tail_torch._latent_tail_fake(g, e2p, w, nw, f(torch.zeros(96, 32, dtype=torch.bfloat16)))
        with pytest.raises(kerngen.InputError, match="'top_k'"):
            routing_torch._route_permute_fake(f(torch.randn(3, 16)), 17, "softmax_topk", 8)
    assert not [m for m in recwarn if "data pointer" in str(m.message)]


@pytest.mark.parametrize("op, args", [
    ("moe_experts", lambda: (lambda a: (a[0], a[1][None], a[2][None], *a[3:], "silu"))(_experts_args())),
    ("moe_experts", lambda: (None, *_experts_args()[1:], "silu")),
    ("route_permute", lambda: (torch.randn(16), 2, "softmax_topk", 4)),
    ("route", lambda: (torch.randn(16), 2, "softmax_topk")),
    ("finalize", lambda: (torch.randn(64).to(torch.bfloat16), *finalize_args()[1:])),
])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_wrong_ranks_and_missing_tensors_are_input_errors(op, args, device):
    """A tensor of the wrong rank (3-D top-k ids, 1-D logits or rows) or None where a tensor goes is the op's
    InputError naming it, on the CPU and shape-only paths alike (they once read the shape first: ValueError,
    IndexError, AttributeError)."""
    a = [t.to(device) if isinstance(t, torch.Tensor) else t for t in args()]
    with pytest.raises(kerngen.InputError, match="must be (a torch.Tensor|2-dimensional)"):
        getattr(torch.ops.kerngen, op)(*a)
