"""kerngen.PreRouting without a GPU: every argument check names its argument, CUDA calls raise DeviceError, and
the bookkeeping (which shape is pre-routed, when take waits, falls back or raises) followed with the stream and
event calls recorded instead of made."""
import random

import pytest
import torch

import kerngen
from kerngen.ops import prerouting as pr
from kerngen.ops import permute as pm
from kerngen.ops import routing as rt

E, K = 896, 16   # kimi-k3


def logits(T=2, dtype=torch.float32):
    return torch.randn(T, E, dtype=dtype)


def bias():
    return torch.randn(E)


def cpu(**kw):
    return kerngen.PreRouting(**{"model": "kimi-k3", "tile": 16, "device": "cpu", **kw})


# ------------------------------------------------------------------------------------------- constructor
def test_model_fills_the_constants_and_the_workspace():
    p = cpu()
    assert (p.num_experts, p.top_k, p.method, p.routed_scaling_factor) == (E, K, "sigmoid_bias", 2.5)
    assert p.max_tokens == pr.DEFAULT_MAX_TOKENS == 8 and p.local_experts == (0, E) and p.tile == 16
    ws = p.workspace
    assert isinstance(ws, kerngen.RoutingWorkspace) and ws.max_tokens == 8 and ws.tile == 16
    assert ws.ids.shape == (8, K) and ws.max_rows == pm.max_rows(8, K, E, 16)
    assert p.event is None   # no CUDA event for an object built for the CPU


def test_explicit_constants_and_an_expert_parallel_range():
    p = kerngen.PreRouting(num_experts=256, top_k=8, method="grouped_sigmoid_bias", n_group=8, topk_group=4,
                           routed_scaling_factor=2.5, tile=128, local_experts=(32, 32), max_tokens=4,
                           weights_dtype=torch.bfloat16, device="cpu")
    assert (p.n_group, p.topk_group, p.local_experts, p.weights_dtype) == (8, 4, (32, 32), torch.bfloat16)
    assert p.workspace.weights.dtype == torch.bfloat16 and p.workspace.max_rows == pm.max_rows(4, 8, 32, 128)


BAD_CONSTRUCTOR = [
    (dict(model="no-such-model"), "model"),
    (dict(model=["kimi-k3"]), "model"),
    (dict(model="kimi-k3", num_experts=64), "num_experts"),
    (dict(model="kimi-k3", top_k=8), "top_k"),
    (dict(model="kimi-k3", method="softmax_topk"), "method"),
    (dict(model="kimi-k3", routed_scaling_factor=1.5), "routed_scaling_factor"),
    (dict(model="kimi-k3", top_k=torch.zeros(3)), "top_k"),
    (dict(model="kimi-k3", renormalize=1), "renormalize"),
    (dict(model=None), "num_experts"),
    (dict(model=None, num_experts=0, top_k=2, method="softmax_topk"), "num_experts"),
    (dict(model=None, num_experts=4096, top_k=2, method="softmax_topk"), "num_experts"),
    (dict(model=None, num_experts=64, method="softmax_topk"), "top_k"),
    (dict(model=None, num_experts=64, top_k=65, method="softmax_topk"), "top_k"),
    (dict(model=None, num_experts=64, top_k=2), "method"),
    (dict(model=None, num_experts=64, top_k=2, method="softmax"), "method"),
    (dict(model=None, num_experts=64, top_k=2, method="top1_sigmoid"), "top_k"),
    (dict(model=None, num_experts=64, top_k=2, method="grouped_sigmoid_bias", n_group=5), "n_group"),
    (dict(model=None, num_experts=64, top_k=2, method="grouped_sigmoid_bias", n_group=8, topk_group=9),
     "topk_group"),
    (dict(model=None, num_experts=64, top_k=2, method="softmax_topk", n_group=2), "n_group"),
    (dict(model=None, num_experts=64, top_k=2, method="softmax_topk", routed_scaling_factor=0.0),
     "routed_scaling_factor"),
    (dict(model=None, num_experts=64, top_k=2, method="softmax_topk", routed_scaling_factor=float("inf")),
     "routed_scaling_factor"),
    (dict(model=None, num_experts=64, top_k=2, method="softmax_topk", routed_scaling_factor=True),
     "routed_scaling_factor"),
    (dict(tile=0), "tile"),
    (dict(tile=2048), "tile"),
    (dict(tile=16.0), "tile"),
    (dict(local_experts=(0, 0)), "local_experts"),
    (dict(local_experts=(890, 7)), "local_experts"),
    (dict(local_experts=5), "local_experts"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=8.0), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(weights_dtype=torch.float16), "weights_dtype"),
    (dict(weights_dtype="float32"), "weights_dtype"),
    (dict(device="tpu"), "device"),
    (dict(device="meta"), "device"),
    (dict(device="not a device"), "device"),
    (dict(device=2.5), "device"),
]


@pytest.mark.parametrize("kw,arg", BAD_CONSTRUCTOR, ids=lambda v: v if isinstance(v, str) else None)
def test_constructor_arguments_are_checked_naming_them(kw, arg):
    with pytest.raises(kerngen.InputError) as e:
        cpu(**kw)
    assert e.value.op == "PreRouting" and e.value.arg == arg, e.value


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
@pytest.mark.parametrize("device", [None, "cuda", "cuda:0", 0])
def test_a_cuda_prerouting_without_a_gpu_is_a_device_error(device):
    with pytest.raises(kerngen.DeviceError, match="kerngen.PreRouting needs a CUDA GPU"):
        kerngen.PreRouting(model="kimi-k3", device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_arguments_are_checked_before_the_gpu():
    with pytest.raises(kerngen.InputError, match="max_tokens"):
        kerngen.PreRouting(model="kimi-k3", max_tokens=0)


# ------------------------------------------------------------------------------------------- launch / take
BAD_CALL = [
    (dict(logits=None), "logits", "torch.Tensor"),
    (dict(logits=[[0.0] * E]), "logits", "torch.Tensor"),
    (dict(logits=torch.zeros(2, E, dtype=torch.int64)), "logits", "dtype"),
    (dict(logits=torch.zeros(2, E, dtype=torch.float16)), "logits", "dtype"),
    (dict(logits=torch.zeros(E)), "logits", "896"),
    (dict(logits=torch.zeros(2, 64)), "logits", "896"),
    (dict(logits=torch.zeros(1, 2, E)), "logits", "896"),
    (dict(logits=torch.zeros(E, 2).t()), "logits", "contiguous last dim"),
    (dict(logits=torch.zeros(2, E, device="meta")), "logits", "cpu"),
    (dict(bias=[0.0] * E), "bias", "torch.Tensor"),
    (dict(bias=torch.zeros(E, dtype=torch.int32)), "bias", "dtype"),
    (dict(bias=torch.zeros(E - 1)), "bias", "896"),
    (dict(bias=torch.zeros(1, E)), "bias", "896"),
    (dict(bias=torch.zeros(2 * E)[::2]), "bias", "contiguous"),
    (dict(bias=torch.zeros(E, device="meta")), "bias", "cpu"),
]


@pytest.mark.parametrize("verb", ["launch", "take"])
@pytest.mark.parametrize("kw,arg,says", BAD_CALL, ids=lambda v: None if isinstance(v, dict) else v)
def test_launch_and_take_check_logits_and_bias(verb, kw, arg, says):
    args = {"logits": logits(), "bias": bias(), **kw}
    with pytest.raises(kerngen.InputError, match=says) as e:
        getattr(cpu(), verb)(args["logits"], args["bias"])
    assert e.value.op == f"PreRouting.{verb}" and e.value.arg == arg, e.value


ROUTE_CHECKED = [kw for kw, arg, says in BAD_CALL
                 if "896" not in says and not (arg == "logits" and says == "cpu")]   # E and device are its own


@pytest.mark.parametrize("verb", ["launch", "take"])
@pytest.mark.parametrize("kw", ROUTE_CHECKED, ids=[f"{next(iter(kw))}-{i}" for i, kw in enumerate(ROUTE_CHECKED)])
def test_launch_and_take_say_what_route_says(verb, kw, monkeypatch):
    """PreRouting checks its tensors with route's own checks (rt.check_args), named as its own."""
    p = cpu()
    args = {"logits": logits(), "bias": bias(), **kw}
    with pytest.raises(kerngen.InputError) as route_says:
        rt.check_args(args["logits"], p.top_k, p.method, args["bias"], p.n_group, p.topk_group, p.renormalize,
                      rsf=p.routed_scaling_factor, cuda=False)
    calls, route_check = [], rt.check_args
    monkeypatch.setattr(rt, "check_args", lambda *a, **k: calls.append(a) or route_check(*a, **k))
    with pytest.raises(kerngen.InputError) as e:
        getattr(p, verb)(args["logits"], args["bias"])
    assert len(calls) == 1 and e.value.op == f"PreRouting.{verb}"
    assert (e.value.arg, e.value.expected, e.value.got) == (route_says.value.arg, route_says.value.expected,
                                                            route_says.value.got)


def test_model_constants_of_the_wrong_kind_are_input_errors_for_route_too():
    """route(model=...) checks a constant's kind before comparing it with the model's (PreRouting relies on it)."""
    for kw in (dict(top_k=torch.zeros(3)), dict(n_group=torch.zeros(2, 2)), dict(renormalize=1), dict(top_k=16.0),
               dict(routed_scaling_factor=True)):
        with pytest.raises(kerngen.InputError) as e:
            kerngen.route(logits(), model="kimi-k3", **kw)
        assert e.value.op == "routing" and e.value.arg == next(iter(kw)), e.value


@pytest.mark.parametrize("verb", ["launch", "take"])
def test_a_bias_is_refused_for_a_method_without_one(verb):
    p = kerngen.PreRouting(num_experts=64, top_k=2, method="softmax_topk", device="cpu")
    with pytest.raises(kerngen.InputError, match="None for method 'softmax_topk'") as e:
        getattr(p, verb)(torch.zeros(1, 64), torch.zeros(64))
    assert e.value.arg == "bias"


@pytest.mark.parametrize("tile", [0, 1025, 16.0, "16", True])
def test_take_checks_the_tile(tile):
    with pytest.raises(kerngen.InputError) as e:
        cpu().take(logits(), bias(), tile=tile)
    assert e.value.op == "PreRouting.take" and e.value.arg == "tile"


@pytest.mark.parametrize("verb", ["launch", "take"])
@pytest.mark.parametrize("T", [0, 1, 8, 9])
def test_launch_and_take_without_a_gpu_are_device_errors(verb, T):
    with pytest.raises(kerngen.DeviceError, match=f"kerngen.PreRouting.{verb}"):
        getattr(cpu(), verb)(logits(T), bias())
    with pytest.raises(kerngen.DeviceError):
        getattr(cpu(tile=None), verb)(logits(T, torch.bfloat16), None)


JUNK = [None, [2], (1, 2, 3), "x", "", 2.5, float("nan"), float("inf"), -1, 0, 10**30, True, {}, object(),
        torch.tensor(2), torch.zeros(3), torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, 2)]
CONSTRUCTOR = dict(model=lambda: "kimi-k3", num_experts=lambda: None, top_k=lambda: None, method=lambda: None,
                   n_group=lambda: 1, topk_group=lambda: 1, routed_scaling_factor=lambda: 1.0,
                   renormalize=lambda: True, tile=lambda: 16, local_experts=lambda: None, max_tokens=lambda: 8,
                   weights_dtype=lambda: torch.float32, device=lambda: "cpu")


@pytest.mark.parametrize("seed", range(60))
def test_wrong_arguments_anywhere_are_kerngen_errors(seed):
    """Seeded junk in one or two constructor arguments, then in launch's and take's: a kerngen error each time
    (never a TypeError or RuntimeError from underneath)."""
    rnd = random.Random(f"prerouting-{seed}")
    args = {k: make() for k, make in CONSTRUCTOR.items()}
    for k in rnd.sample(sorted(args), rnd.randint(1, 2)):
        args[k] = rnd.choice(JUNK)
    try:
        kerngen.PreRouting(**args)
    except kerngen.KerngenError:
        pass
    p = cpu()
    call = {"logits": logits(), "bias": bias(), "tile": 16}
    for k in rnd.sample(sorted(call), rnd.randint(1, 2)):
        call[k] = rnd.choice(JUNK)
    with pytest.raises(kerngen.KerngenError):
        p.launch(call["logits"], call["bias"])
    with pytest.raises(kerngen.KerngenError):
        p.take(call["logits"], call["bias"], tile=call["tile"])


# ------------------------------------------------------------------------------------------- bookkeeping
class RecordedStreams(kerngen.PreRouting):
    """A CPU PreRouting whose stream and event calls are recorded in `calls` instead of made, routing with the
    torch reference; `capture` is the capture id the current stream would report (None: not capturing)."""

    def __init__(self, **kw):
        super().__init__(**{"model": "kimi-k3", "tile": 16, "device": "cpu", **kw})
        self.capture, self.calls = None, []

    def _gpu(self, op):
        return 0

    def _capture(self, dev):
        return self.capture

    def _record(self, dev):
        self.calls.append(("record", self.capture))

    def _wait(self, dev):
        self.calls.append(("wait", self.capture))

    def _route(self, logits, bias, tile, ws):
        self.calls.append(("route", ws is self.workspace, tile, logits.shape[0]))
        ids, w = rt.reference(logits, self.top_k, self.method, bias, routed_scaling_factor=self.routed_scaling_factor)
        T = logits.shape[0]
        ws.ids[:T], ws.weights[:T] = ids, w
        return ws.result(T, self.local_experts[1])


def step(p, x, b, **take):
    """One decode step: launch then take; the calls it made and the result."""
    p.calls.clear()
    p.launch(x, b)
    r = p.take(x, b, **take)
    return list(p.calls), r


def test_a_shape_is_pre_routed_only_after_a_take_routed_it():
    p, x, b = RecordedStreams(), logits(4), bias()
    calls, r = step(p, x, b)
    assert calls == [("record", None), ("wait", None), ("route", False, 16, 4)]   # first time: take routes
    assert r.topk_ids.data_ptr() != p.workspace.ids.data_ptr()
    calls, r = step(p, x, b)
    assert calls == [("route", True, 16, 4), ("record", None), ("wait", None)]    # then: launch routes
    assert r.topk_ids.data_ptr() == p.workspace.ids.data_ptr() and r.topk_ids.shape == (4, K)
    assert r.permuted_to_token.shape == (pm.max_rows(4, K, E, 16),)
    ids, _ = rt.reference(x, K, "sigmoid_bias", b, routed_scaling_factor=2.5)
    assert torch.equal(r.topk_ids, ids)
    x2 = logits(4)   # another step, new logits of the same shape
    calls, r = step(p, x2, b)
    assert calls[0] == ("route", True, 16, 4) and r.topk_ids.data_ptr() == p.workspace.ids.data_ptr()


def test_each_shape_is_recorded_on_its_own():
    p, b = RecordedStreams(), bias()
    step(p, logits(4), b)
    calls, _ = step(p, logits(2), b)                      # T = 2 not seen yet
    assert ("route", False, 16, 2) in calls
    calls, _ = step(p, logits(4, torch.bfloat16), b)      # nor bf16 logits
    assert ("route", False, 16, 4) in calls
    calls, _ = step(p, logits(4), None)                   # nor no bias
    assert ("route", False, 16, 4) in calls
    calls, _ = step(p, logits(4), b)
    assert calls[0] == ("route", True, 16, 4)


def test_other_logits_or_bias_of_a_pre_routed_shape_raise():
    p, x, b = RecordedStreams(), logits(4), bias()
    step(p, x, b)
    for other, arg in ((dict(logits=logits(4)), "logits"), (dict(bias=bias()), "bias"),
                       (dict(logits=x.clone()), "logits")):
        p.launch(x, b)
        with pytest.raises(kerngen.InputError, match="unsynchronized") as e:
            p.take(other.get("logits", x), other.get("bias", b))
        assert e.value.op == "PreRouting.take" and e.value.arg == arg
    p.launch(x, b)
    x.add_(1.0)   # written in place after the launch: its version counter moved
    with pytest.raises(kerngen.InputError, match="version"):
        p.take(x, b)
    p.launch(x, b)
    assert p.take(x[:], b).topk_ids.data_ptr() == p.workspace.ids.data_ptr()   # a view of the same memory is


def test_another_tile_routes_itself_into_its_own_workspace():
    p, x, b = RecordedStreams(), logits(4), bias()
    step(p, x, b)
    calls, r = step(p, x, b, tile=128)
    assert calls == [("route", True, 16, 4), ("record", None), ("wait", None), ("route", False, 128, 4)]
    assert r.permuted_to_token.shape == (pm.max_rows(4, K, E, 128),) and 128 in p._own
    calls, r = step(p, logits(4), b, tile=None)            # a tile change is a fallback, not an error
    assert calls[-1] == ("route", False, None, 4) and r.permuted_to_token is None


def test_token_counts_above_the_limit_always_route_themselves():
    p, b = RecordedStreams(max_tokens=8), bias()
    for T in (9, 16):
        for _ in range(3):
            calls, r = step(p, logits(T), b)
            assert calls == [("record", None), ("wait", None), ("route", False, 16, T)]
            assert r.topk_ids.shape == (T, K) and r.topk_ids.data_ptr() != p.workspace.ids.data_ptr()
    assert p._seen == set()
    step(p, logits(8), b)
    calls, _ = step(p, logits(8), b)
    assert calls[0] == ("route", True, 16, 8)


def test_take_without_a_launch_waits_on_nothing_and_routes():
    p = RecordedStreams()
    r = p.take(logits(3), bias())
    assert p.calls == [("route", False, 16, 3)] and r.topk_ids.shape == (3, K)


def test_a_launch_supersedes_the_previous_one():
    p, b = RecordedStreams(), bias()
    x4, x2 = logits(4), logits(2)
    step(p, x4, b)
    p.launch(x4, b)
    p.launch(x2, b)   # T = 2 not seen: records the event and nothing to take
    p.calls.clear()
    p.take(x4, b)     # not the last launch's shape: routed here, no error
    assert p.calls == [("wait", None), ("route", False, 16, 4)]


def test_under_capture_the_join_and_the_result_stay_in_one_capture():
    p, x, b = RecordedStreams(), logits(4), bias()
    step(p, x, b)                          # warm-up outside the capture
    p.capture = 7
    calls, r = step(p, x, b)               # launch and take in capture 7: joined, pre-routed
    assert calls == [("route", True, 16, 4), ("record", 7), ("wait", 7)]
    p.capture = None
    p.launch(x, b)                         # launched outside (the router stream not forked into the capture)
    p.capture, p.calls = 7, []
    with pytest.raises(kerngen.InputError, match="fork"):
        p.take(x, b)
    assert p.calls == []                   # an event recorded outside the capture is not waited on inside it
    p.capture = 7
    p.launch(x, b)
    p.capture = None
    with pytest.raises(kerngen.InputError, match="another capture"):
        p.take(x, b)


def test_a_workspace_made_inside_a_capture_is_not_kept():
    p, x, b = RecordedStreams(), logits(4), bias()
    p.capture = 3
    p.take(x, b, tile=64)
    assert 64 not in p._own                # its memory belongs to the graph being captured
    p.capture = None
    p.take(x, b, tile=64)
    assert 64 in p._own


def test_identity_of_a_tensor():
    t = torch.zeros(4, 8)
    assert pr._ident(t) == pr._ident(t[:]) == pr._ident(t.view(4, 8))
    assert pr._ident(t) != pr._ident(t[:2]) and pr._ident(t) != pr._ident(t.clone())
    before = pr._ident(t)
    t.mul_(2)
    assert pr._ident(t) != before and pr._ident(None) is None
