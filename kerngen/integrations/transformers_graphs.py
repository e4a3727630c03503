"""Eager decode forwards of an enabled transformers MoE block replayed from CUDA graphs (KERNGEN_BLOCK_GRAPHS).

At batch 1 an eager decode step is bound by the host: the block's router, permutation, expert GEMMs and weighted
sum are a dozen launches, each a Python call and a driver call. A block's inference forward of at most
GRAPH_TOKENS bf16 tokens met a second time with the same input shape and mode is captured into a CUDA graph on
kerngen's capture stream, and from then on a call of that shape copies its input into the graph's, replays it on
the caller's stream and returns copies of the graph's outputs: three launches from the host.

A call runs the block's own forward instead where a replay could differ from it: gradients enabled or training
mode, under torch.compile or inside a capture of the caller's, a CPU, non-bf16 or non-contiguous input, more
tokens, arguments besides the hidden states, a hook on a module inside the block (transformers' output-recording
hooks count only while an output is being recorded) or a global module hook. The graphs of a block are dropped
when one of its parameters, buffers or submodules is replaced (values written in place are read by the replay) and
when kerngen.clear() forgets the resolved kernels. A capture that fails turns the block's graphs off, said once.

The graphs of all blocks share one memory pool a device and kerngen's scratch buffers of the capture stream:
their replays must not overlap in time (one stream, or streams ordered between the calls), as a model's layers
never do.
"""
from __future__ import annotations

import contextlib
import threading
import warnings

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from kerngen import dispatch as _dispatch
from kerngen import env, tiers
from kerngen.launch import _drv, _ok

GRAPH_TOKENS = 16   # KERNGEN_BLOCK_GRAPHS unset: forwards of at most so many tokens (decode, and short prompts)
_RECORDER = "output_capturing_hook"   # transformers' output-recording hooks (utils/output_capturing.py)
_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
_capture_streams: dict[int, torch.cuda.Stream] = {}   # device -> kerngen's capture stream (kept for the process)
_pools: dict[int, tuple] = {}                         # device -> (the graphs' memory pool, its anchor graph)
_mutex = threading.Lock()


def _collector():
    """transformers' active output collector (a dict of the outputs being recorded), or None."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:
        return None
    return _active_collector.get()


def capture_stream(device: int) -> torch.cuda.Stream:
    """kerngen's capture stream on `device`: a stream of its own (no other code queues work on it, so the scratch
    buffers kerngen keeps for it serve the graphs alone), made once."""
    s = _capture_streams.get(device)
    if s is None:
        with _mutex:
            s = _capture_streams.get(device)
            if s is None:
                drv = _drv()
                with torch.cuda.device(device):
                    torch.cuda.current_stream()   # torch's primary context current on this thread
                    raw = _ok(drv.cuStreamCreate(drv.CUstream_flags.CU_STREAM_NON_BLOCKING), "creating a stream")
                s = _capture_streams[device] = torch.cuda.ExternalStream(int(raw), device=device)
                s._kerngen_raw = raw   # (the driver's handle object, kept with it)
    return s


@contextlib.contextmanager
def _on_capture_stream(device: int):
    """The capture stream current, ordered after the caller's stream's work and before its next."""
    side, here = capture_stream(device), torch.cuda.current_stream(device)
    side.wait_stream(here)
    try:
        with torch.cuda.stream(side):
            yield side
    finally:
        here.wait_stream(side)


def _pool(device: int) -> tuple:
    """The graphs' memory pool on `device`, held by an anchor graph of one small launch for the process: the
    caching allocator forgets a pool whose graphs are all gone only once its memory is free, and refuses a capture
    into it in between (an internal assert that leaves the RNG's capture state half set), so its graph count never
    drops to zero."""
    p = _pools.get(device)
    if p is None:
        handle, anchor = torch.cuda.graph_pool_handle(), torch.cuda.CUDAGraph()
        with _on_capture_stream(device):
            anchor.capture_begin(pool=handle, capture_error_mode="thread_local")
            try:
                torch.zeros(1, device=f"cuda:{device}")
            finally:
                anchor.capture_end()
        p = _pools[device] = (handle, anchor)
    return p[0]


def _clear_library_workspaces() -> None:
    """Drop torch's cached cuBLAS workspaces (each stream's, made on its first GEMM), as torch.compile's CUDA graphs
    do around each recording: a GEMM captured afterwards takes a workspace from the graph's pool, which outlives
    the capture as the pool's memory does. A workspace made before the capture and captured would be freed the
    next time anyone clears them, and its memory handed to other tensors while the graph still writes it."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def global_hooks() -> bool:
    """A module hook registered for every module (torch.nn.modules.module.register_module_forward_hook, ...)."""
    return any(getattr(_torch_module, name, None) for name in _GLOBAL_HOOKS)


def _recording_only(m: nn.Module) -> bool:
    """m's hooks are transformers' output recorders and nothing is being recorded (they would do nothing)."""
    return (not m._forward_pre_hooks and not _collector()
            and all(getattr(h, "__name__", "") == _RECORDER for h in m._forward_hooks.values()))


class _Graph:
    __slots__ = ("graph", "x", "out")

    def __init__(self, graph, x, out):
        self.graph, self.x, self.out = graph, x, out


def _copies(out):
    """The graph's outputs copied (a tensor, or a tuple / list of them and other values)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, (tuple, list)):
        return type(out)(_copies(o) for o in out)
    return out


class BlockGraphs:
    """One block's captured forwards by input (shape, dtype, inference mode); `forward` runs the block eagerly.
    A shape is captured the second time it is met (the first call compiles kerngen's kernels for it and grows the
    block's workspaces outside the graph)."""

    def __init__(self, block: nn.Module, forward, max_tokens: int):
        self.block, self.forward, self.max_tokens = block, forward, max_tokens
        self._graphs: dict[tuple, _Graph] = {}
        self._seen: set[tuple] = set()
        self._weights: tuple = ()
        self._generation = _dispatch.generation()
        self.off = False
        self.captures = self.replays = 0

    def __call__(self, *args, **kwargs):
        if torch.compiler.is_compiling() or self.off or kwargs or len(args) != 1 or not self.eligible(args[0]):
            return self.forward(*args, **kwargs)
        x = args[0]
        weights = self._walk()
        if weights is None:
            return self.forward(x)
        if weights != self._weights or self._generation != _dispatch.generation():
            self._graphs.clear()
            self._seen.clear()
            self._weights, self._generation = weights, _dispatch.generation()
        key = (x.shape, x.dtype, x.get_device(), torch.is_inference_mode_enabled())
        g = self._graphs.get(key)
        if g is None:
            if key not in self._seen:
                self._seen.add(key)
                return self.forward(x)
            g = self._capture(x, key)
            if g is None:
                return self.forward(x)
        g.x.copy_(x)
        g.graph.replay()
        self.replays += 1
        return _copies(g.out)

    def eligible(self, x) -> bool:
        """Whether a replay at x would be the forward's own result: a contiguous CUDA bf16 input of at most
        max_tokens tokens (bf16: the dtype kerngen's kernels and the grouped GEMM run without a host sync), inference
        (no gradients, eval mode), no capture of the caller's under way and no global module hook (a hook inside the
        block: _walk)."""
        return (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype == torch.bfloat16 and x.dim() >= 2
                and x.numel() <= self.max_tokens * x.shape[-1] and not torch.is_grad_enabled()
                and not self.block.training and x.is_contiguous() and not torch.cuda.is_current_stream_capturing()
                and not global_hooks())

    def _walk(self) -> tuple | None:
        """The block's modules (each by identity: a submodule replaced is seen) and the data pointers of their
        parameters and buffers, walked afresh each call; None where a hook would run inside the block (the block's
        own run around the replay as around the forward; transformers' recorders count only while recording)."""
        block = self.block
        out, todo = [], [block]
        for m in todo:   # (the list grows as the walk goes)
            if m is None:
                continue
            if (m._forward_pre_hooks or m._forward_hooks) and m is not block and not _recording_only(m):
                return None
            out.append(id(m))
            out.extend(t.data_ptr() for t in m._parameters.values() if t is not None)
            out.extend(t.data_ptr() for t in m._buffers.values() if t is not None)
            todo.extend(m._modules.values())
        return tuple(out)

    def _capture(self, x: torch.Tensor, key: tuple) -> _Graph | None:
        """Capture the forward at x's shape on the capture stream, or None and the block's graphs off where it
        cannot be captured. One run there first makes kerngen's buffers of that stream outside the graph (kept for
        good); torch's cuBLAS workspaces are dropped around the capture, so a captured GEMM's is the pool's."""
        device = x.get_device()
        xs = torch.empty_like(x)
        xs.copy_(x)
        graph = torch.cuda.CUDAGraph()
        try:
            pool = _pool(device)
            with _on_capture_stream(device):
                self.forward(xs)
                _clear_library_workspaces()
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    out = self.forward(xs)
                finally:
                    graph.capture_end()
                    _clear_library_workspaces()
        except Exception as e:   # (a host sync or other uncapturable work in the forward): eager from now on
            self.off = True
            warnings.warn(f"kerngen: CUDA graphs turned off for {type(self.block).__name__} ({type(e).__name__}: "
                          f"{e})", RuntimeWarning, stacklevel=3)
            return None
        g = self._graphs[key] = _Graph(graph, xs, out)
        self._seen.discard(key)
        self.captures += 1
        return g


def graphed(block: nn.Module, forward, max_tokens: int):
    """A forward for `block` that replays `forward` from CUDA graphs where BlockGraphs allows (its BlockGraphs
    as the function's `graphs` attribute)."""
    graphs = BlockGraphs(block, forward, max_tokens)

    def block_forward(*args, **kwargs):
        return graphs(*args, **kwargs)
    block_forward._kerngen = True
    block_forward.graphs = graphs
    return block_forward


def tokens_bound(on: bool | None) -> int:
    """The most tokens a graphed forward takes: `on` True every count, False none, None (the default:
    KERNGEN_BLOCK_GRAPHS, unset meaning decode sizes) GRAPH_TOKENS."""
    if on is None:
        on = env.block_graphs()
        if on is None:
            return GRAPH_TOKENS
    return tiers.INT32_MAX if on else 0
