"""PreRouting: routing on a router stream into a preallocated workspace, taken on the main stream.

The decode pattern of TensorRT-LLM for Kimi K3: the router GEMM and the routing kernel run on a stream of their
own while the shared expert runs on another, and the routed experts join on an event. There it saved ~0.4 ms
per decode step end to end with bit-identical MoE outputs; above ~8 tokens per rank the overlap contended with
the expert GEMMs and was slower, hence the default limit of 8 tokens.

A launch is `kerngen.route` into the object's workspace, so a pre-routed result has the bits of `kerngen.route`
on the same inputs; when take cannot use it, take calls `kerngen.route` itself on its own stream.
"""
from __future__ import annotations

import torch

from ..errors import DeviceError, InputError
from ..launch import current_stream
from ..tiers import MAX_EXPERTS
from . import routing as rt   # route's checks (check_args, model_args) are PreRouting's, under its own name
from ._common import check_int, check_local, require_gpu, table
from . import permute as permute_op
from .permute import Routing, RoutingWorkspace

OP = "PreRouting"
LAUNCH, TAKE = "PreRouting.launch", "PreRouting.take"
DEFAULT_MAX_TOKENS = 8
_WEIGHTS = (torch.float32, torch.bfloat16)
_OWN_TILE = object()   # take(tile=...) left out: the object's tile
_NOTHING = object()    # no event recorded since the last take


class PreRouting:
    """Routing launched on a router stream before its consumer needs it, taken on the main stream.

        pre = kerngen.PreRouting(model="kimi-k3", tile=16)          # once, outside any capture
        router = torch.cuda.Stream()

        def moe(x, residual):                                      # also inside torch.cuda.graph(...)
            main = torch.cuda.current_stream()
            router.wait_stream(main)         # fork: x is ready, and the last result's readers come first
            with torch.cuda.stream(router):
                logits = x.float() @ w_router.T
                pre.launch(logits, bias)     # kerngen.route into pre.workspace, then an event on `router`
            shared = shared_expert(x)        # runs beside the router stream (or on a third stream)
            r = pre.take(logits, bias)       # main waits on the event (join), then r is pre.workspace's
            ...                              # grouped GEMMs over r.permuted_to_token, kerngen.moe_tail

    Constants: `model=` (from the tier table) or `num_experts`, `top_k`, `method` and optionally `n_group`,
    `topk_group`, `routed_scaling_factor`, `renormalize`, all checked as `kerngen.route` checks them; `tile` and
    `local_experts=(start, count)` as route takes them; `max_tokens` (default 8) sizes the workspace and bounds
    what is pre-routed; `weights_dtype` is the workspace's (float32 or bfloat16); `device` a CUDA device
    (default the current one; "cpu" builds an object whose launch and take check their arguments, then raise
    DeviceError).

    `launch(logits, bias)` runs on the current stream (the router stream). It routes into `workspace` when the
    logits' shape was seen before (see below) and records `event` on that stream in any case, so a take that
    routes itself still reads logits the router stream wrote only after it wrote them.

    `take(logits, bias, tile=...)` runs on the consumer's stream. It makes that stream wait on the last launch's
    event (recorded in the same capture, or both outside one), then returns the pre-routed result if the last
    launch routed this shape (token count, dtypes, bias or not) at this tile; else it routes the logits itself
    with `kerngen.route` on its stream, into a workspace of its own. A pre-routed shape taken with logits or a
    bias that are not the launched tensors (data pointer, shape, strides, version counter) raises InputError:
    the result would belong to other logits. So does taking logits launched outside the capture that takes
    them: the router stream must wait on the capturing stream before the router GEMM (torch's fork/join under
    capture), and each launch in a capture needs a take in it (the join).

    A shape is pre-routed only after a take routed it itself: its kernels are then built and loaded, so a launch
    never compiles on the router stream or inside a capture. Token counts above `max_tokens` always route
    themselves (their launch records the event and nothing to take).

    The pre-routed result is a view of `workspace`, valid until the next launch. A launch overwrites the
    workspace on the router stream, so it must be ordered after every reader of the previous result: the fork
    above does that for one object shared by every layer.
    """

    def __init__(self, *, model: str | None = None, num_experts: int | None = None, top_k: int | None = None,
                 method: str | None = None, n_group: int = 1, topk_group: int = 1,
                 routed_scaling_factor: float = 1.0, renormalize: bool = True, tile: int | None = None,
                 local_experts: tuple[int, int] | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
                 weights_dtype: torch.dtype = torch.float32, device: torch.device | str | int | None = None):
        if num_experts is not None:   # the one constant route takes from its logits: checked here
            check_int(OP, "num_experts", num_experts, 1, MAX_EXPERTS)
        if model is not None:
            models = table().models
            if not isinstance(model, str) or model not in models:
                raise InputError(OP, "model", f"a model of the tier table ({', '.join(sorted(models))})", repr(model))
            m = models[model]
            if num_experts is not None and num_experts != m.num_experts:
                raise InputError(OP, "num_experts", f"{m.num_experts} as model '{model}' says (or left out)",
                                 repr(num_experts))
            num_experts = m.num_experts
            try:
                top_k, method, n_group, topk_group, routed_scaling_factor, renormalize = rt.model_args(
                    model, top_k, method, n_group, topk_group, routed_scaling_factor, renormalize)
            except InputError as e:
                raise _as(OP, e) from None
        if num_experts is None:
            raise InputError(OP, "num_experts", "given (or model=)", "None")
        try:   # route's checks of the constants, on a CPU stand-in for the logits
            rt.check_args(torch.empty((1, num_experts)), top_k, method, None, n_group, topk_group, renormalize,
                          tile, local_experts, routed_scaling_factor, cuda=False)
        except InputError as e:
            raise _as(OP, e) from None
        check_int(OP, "max_tokens", max_tokens, 1, 1 << 24)
        if not isinstance(weights_dtype, torch.dtype) or weights_dtype not in _WEIGHTS:
            raise InputError(OP, "weights_dtype", "torch.float32 or torch.bfloat16", repr(weights_dtype))
        try:   # an index names a GPU even where torch sees none (torch.device(0) would ask for one)
            dev = (torch.device("cuda") if device is None else torch.device("cuda", device)
                   if isinstance(device, int) and not isinstance(device, bool) else torch.device(device))
        except (RuntimeError, TypeError, ValueError):   # ValueError: an index past a long long
            dev = None
        if dev is None or dev.type not in ("cuda", "cpu"):
            raise InputError(OP, "device", "a CUDA device (e.g. 'cuda', 'cuda:1' or an index) or 'cpu'", repr(device))
        if dev.type == "cuda":
            require_gpu("kerngen.PreRouting")
        self.model, self.num_experts, self.top_k, self.method = model, num_experts, top_k, method
        self.n_group, self.topk_group, self.renormalize = n_group, topk_group, renormalize
        self.routed_scaling_factor, self.tile, self.max_tokens = float(routed_scaling_factor), tile, max_tokens
        self.local_experts = check_local(OP, local_experts, num_experts)
        self.weights_dtype = weights_dtype
        try:
            self.workspace = self._new_workspace(max_tokens, tile, dev)
        except InputError as e:
            raise _as(OP, e) from None
        self.device = self.workspace.device
        self._own = {tile: self._new_workspace(max_tokens, tile, self.device)}   # take's, for shapes it routes
        self.event = torch.cuda.Event() if self.device.type == "cuda" else None
        self._seen: set[tuple] = set()   # shapes a take routed itself: (T, logits dtype, bias dtype or None)
        self._pending = None             # (shape, logits' and bias' _ident, capture) of the last launch that routed
        self._recorded = _NOTHING        # capture of the last event record (None: outside a capture)

    def launch(self, logits: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Route logits [T, E] into the workspace on the current stream if T <= max_tokens and this shape was
        taken before; record the event on the current stream in any case."""
        shape = self._check(LAUNCH, logits, bias)
        dev = self._gpu(LAUNCH)
        capture = self._capture(dev)
        self._pending = None
        if shape[0] <= self.max_tokens and shape in self._seen:
            self._route(logits, bias, self.tile, self.workspace)
            self._pending = (shape, _ident(logits), _ident(bias), capture)
        self._record(dev)
        self._recorded = capture

    def take(self, logits: torch.Tensor, bias: torch.Tensor | None = None, *, tile=_OWN_TILE) -> Routing:
        """The routing of logits [T, E] at `tile` (default the object's) for the current stream: the pre-routed
        result after waiting on the launch's event, or kerngen.route's on this stream (see the class doc)."""
        shape = self._check(TAKE, logits, bias)
        if tile is _OWN_TILE:
            tile = self.tile
        elif tile is not None:
            check_int(TAKE, "tile", tile, 1, permute_op.MAX_TILE)
        dev = self._gpu(TAKE)
        capture = self._capture(dev)
        pending, recorded = self._pending, self._recorded
        self._pending, self._recorded = None, _NOTHING
        if recorded is not _NOTHING and recorded == capture:
            self._wait(dev)   # the join, before any read
        if pending is not None and pending[0] == shape and tile == self.tile:
            for name, t, launched in (("logits", logits, pending[1]), ("bias", bias, pending[2])):
                if _ident(t) != launched:
                    raise InputError(TAKE, name, f"the tensor launched for this shape ({_describe(launched)}), or "
                                     "launch these first: a pre-routed result of other inputs would be read "
                                     "unsynchronized", _describe(_ident(t)))
            if pending[3] != capture:
                raise InputError(TAKE, "logits", "launched in the CUDA graph capture that takes them (fork: the "
                                 "router stream waits on the capturing stream before the router GEMM and launch)",
                                 "logits launched " + ("outside a capture" if pending[3] is None
                                                       else "in another capture"))
            return self.workspace.result(shape[0], self.local_experts[1])
        T = shape[0]
        if T > self.max_tokens:
            ws = self._new_workspace(T, tile, self.device)
        else:
            ws = self._own.get(tile)
            if ws is None:
                ws = self._new_workspace(self.max_tokens, tile, self.device)
                if capture is None:   # memory of a capture belongs to its graph: kept only outside one
                    self._own[tile] = ws
            if tile == self.tile:
                self._seen.add(shape)
        return self._route(logits, bias, tile, ws)

    # ------------------------------------------------------------------------------------------- helpers
    def _route(self, logits, bias, tile, ws) -> Routing:
        return rt.route(logits, top_k=self.top_k, method=self.method, bias=bias, n_group=self.n_group,
                        topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor,
                        renormalize=self.renormalize, tile=tile, local_experts=self.local_experts, workspace=ws)

    def _new_workspace(self, tokens, tile, device) -> RoutingWorkspace:
        return RoutingWorkspace(tokens, self.num_experts, self.top_k, tile, local_experts=self.local_experts,
                                   weights_dtype=self.weights_dtype, device=device)

    def _check(self, op, logits, bias) -> tuple:
        """logits [T, E] and bias [E] (or None) as route checks them, on the object's device: (T, dtypes)."""
        if isinstance(logits, torch.Tensor):   # what route cannot know: the object's expert count and device
            if logits.dim() != 2 or logits.shape[1] != self.num_experts:
                raise InputError(op, "logits", f"[T, {self.num_experts}] (one column per expert)",
                                 f"shape {tuple(logits.shape)}")
            if logits.device != self.device:
                raise InputError(op, "logits", f"on {self.device} (the PreRouting's device)", str(logits.device))
        try:   # the rest as route checks it (bias on the logits' device)
            rt.check_args(logits, self.top_k, self.method, bias, self.n_group, self.topk_group, self.renormalize,
                          rsf=self.routed_scaling_factor, cuda=False)
        except InputError as e:
            raise _as(op, e) from None
        return logits.shape[0], logits.dtype, None if bias is None else bias.dtype

    # the CUDA calls, apart from route's (tests/test_prerouting_cpu.py replaces them to follow the bookkeeping)
    def _capture(self, dev: int) -> int | None:
        return _capture_id(current_stream(dev))

    def _record(self, dev: int) -> None:
        self.event.record(torch.cuda.current_stream(dev))

    def _wait(self, dev: int) -> None:
        torch.cuda.current_stream(dev).wait_event(self.event)

    def _gpu(self, op) -> int:
        """The CUDA device index; DeviceError for an object built for the CPU."""
        if self.device.type != "cuda":
            require_gpu(f"kerngen.{op}")
            raise DeviceError(f"kerngen.{op} needs a PreRouting built for a CUDA device; this one was built for "
                              "the CPU (device='cpu')")
        return self.device.index


def _as(op: str, e: InputError) -> InputError:
    """route's InputError (or RoutingWorkspace's) as `op`'s: the same argument, expectation and value."""
    return InputError(op, e.arg, e.expected, e.got)


def _ident(t) -> tuple | None:
    """What makes a tensor the launched one: its memory, layout and version counter (in-place writes bump it)."""
    return None if t is None else (t.data_ptr(), tuple(t.shape), t.stride(), t._version)


def _describe(ident) -> str:
    if ident is None:
        return "None"
    ptr, shape, stride, version = ident
    return f"data_ptr {ptr:#x}, shape {shape}, strides {stride}, version {version}"


def _capture_id(stream: int) -> int | None:
    """The id of the capture sequence `stream` records into (a forked stream shares its origin's), None outside."""
    from cuda.bindings import driver
    res = driver.cuStreamGetCaptureInfo(driver.CUstream(stream))
    if res[0] != driver.CUresult.CUDA_SUCCESS:
        raise DeviceError(f"cuStreamGetCaptureInfo failed: {driver.cuGetErrorName(res[0])[1]}")
    if res[1] != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
        return None
    return int(res[2])
