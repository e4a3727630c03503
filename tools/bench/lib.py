"""Timing helpers shared by tools/bench: CUDA-graph timing, the floors (empty kernel, copy and read bandwidth)."""
from __future__ import annotations

import functools
import sys

import torch

from kerngen.timing import after_producer_us, elementwise_producer, graph_time_us  # noqa: F401  (re-exported)


def require_gpu(tool: str) -> None:
    """Exit with one line and status 2, not a traceback, where torch sees no CUDA GPU (`tool`: the command)."""
    if not torch.cuda.is_available():
        print(f"{tool}: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing was run.",
              file=sys.stderr)
        raise SystemExit(2)


def probe_kernel(source: str, name: str, grid_per_sm: int, block: int, fmt: str, smem: int = 0):
    """A standalone probe kernel (tools/diagnose): `source` compiled by NVRTC for this GPU and bound at `grid_per_sm`
    CTAs an SM of `block` threads, its by-value parameters packed as struct format `fmt` (without "<").
    Returns (launcher, compile log); call the launcher as launcher(stream, *fields)."""
    import torch

    from kerngen.compile import nvrtc_compile
    from kerngen.launch import Launcher, Module
    from kerngen.plan import target_arch
    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    cubin, log = nvrtc_compile(source, name, target_arch(dev), name, None)
    module = Module(cubin, f"{name}-{hash(source) & 0xFFFFFFFF:08x}")
    return Launcher(module, name, dev, (grid_per_sm * sms, 1, 1), (block, 1, 1), fmt, smem=smem), log


def empty_kernel_us() -> float:
    """One empty kernel per call inside a graph: the floor of any launch."""
    from kerngen.compile import nvrtc_compile
    from kerngen.launch import Launcher, Module, current_stream
    from kerngen.plan import target_arch
    dev = torch.cuda.current_device()
    cubin, _ = nvrtc_compile('extern "C" __global__ void empty(int) {}', "empty", target_arch(dev), "empty", None)
    launcher = Launcher(Module(cubin, "empty"), "empty", dev, (1, 1, 1), (32, 1, 1), "i4x")
    return graph_time_us(lambda: launcher(current_stream(dev), 0), calls=100)


def copy_bandwidth_tbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second, TB/s: the best of torch's copy_ on a
    stream (an SM copy kernel: 4.23 TB/s on the H200), the same inside a CUDA graph and the driver's
    cuMemcpyDtoDAsync (in a graph both become copy-engine transfers: 2.77 TB/s there)."""
    import ctypes

    from kerngen.launch import current_stream
    copy = ctypes.CDLL("libcuda.so.1").cuMemcpyDtoDAsync_v2
    copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    src = torch.randn(nbytes // 8, device="cuda")
    dst = torch.empty_like(src)
    dev = torch.cuda.current_device()
    for _ in range(20):   # a few hundred milliseconds of copies: the clocks are up before anything is timed
        dst.copy_(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        dst.copy_(src)
    b.record()
    b.synchronize()
    us = min(a.elapsed_time(b) * 100.0,
             graph_time_us(lambda: copy(dst.data_ptr(), src.data_ptr(), nbytes // 2, current_stream(dev)), calls=5,
                           replays=10),
             graph_time_us(lambda: dst.copy_(src), calls=5, replays=10))
    return nbytes / (us * 1e-6) / 1e12


_READ_SRC = r"""
struct ReadParams { const uint4* p; long long n; unsigned* sink; };   // one by-value block, as kerngen launches
extern "C" __global__ void __launch_bounds__(512) stream_read(const __grid_constant__ ReadParams a) {
    unsigned acc = 0;
    for (long long i = blockIdx.x * 512ll + threadIdx.x; i < a.n; i += (long long)gridDim.x * 512) {
        const uint4 v = __ldcs(a.p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) a.sink[0] = acc;   // never taken in practice; keeps the loads
}
"""


def stream_reader():
    """The streaming-read kernel of read_bandwidth_tbs on the current GPU (4 CTAs of 512 threads an SM): returns
    read(tensor), which launches it over the tensor's bytes (a multiple of 16) on torch's current stream. Built once
    a device (the benches ask for it at every case)."""
    return _stream_reader(torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _stream_reader(dev: int):
    from kerngen.compile import nvrtc_compile
    from kerngen.launch import Launcher, Module, current_stream
    from kerngen.plan import target_arch
    cubin, _ = nvrtc_compile(_READ_SRC, "stream_read", target_arch(dev), "stream_read", None)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    sink = torch.zeros(1, dtype=torch.int32, device=f"cuda:{dev}")
    launcher = Launcher(Module(cubin, "stream_read"), "stream_read", dev, (4 * sms, 1, 1), (512, 1, 1), "QqQ")
    return lambda t: launcher(current_stream(dev), t.data_ptr(), t.numel() * t.element_size() // 16,
                              sink.data_ptr())


def read_bandwidth_tbs(nbytes: int = 4 << 30) -> float:
    """Streaming-read bandwidth, TB/s: a kernel that only reads `nbytes` (16-byte streaming loads, a grid of 4 CTAs
    of 512 threads an SM) in a CUDA graph, best of its replays: the floor of a kernel that reads its weights once."""
    src = torch.randn(nbytes // 4, device="cuda")
    read = stream_reader()
    run = lambda: read(src)  # noqa: E731
    for _ in range(20):
        run()
    us = graph_time_us(run, calls=5, replays=10)
    return nbytes / (us * 1e-6) / 1e12


def host_us(fn, n: int = 2000) -> float:
    """Host µs per call (no graph): the caller's cost when the GPU keeps up."""
    import time
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n * 1e6


def add_tail_config_args(ap, threads="128,256,512", max_loads="32", branch_free="0,1") -> None:
    """The tail launch parameters a sweep ranges over (comma lists)."""
    ap.add_argument("--threads", default=threads)
    ap.add_argument("--max-loads", default=max_loads)
    ap.add_argument("--branch-free", default=branch_free)
    ap.add_argument("--async-reduce", default="0", help="0,1: also the clusters' sums by st.async (async_reduce)")


def tail_configs(hidden: int, top_k: int, arch: str, args, clusters=(1,)):
    """(label, spec) per tail configuration in `args` (see add_tail_config_args), with the shared expert and
    residual the shipped models pass."""
    import itertools

    from kerngen.ops import tail
    ints = lambda s: [int(x) for x in s.split(",")]
    for c, nt, ml, bf, ar in itertools.product(clusters, ints(args.threads), ints(args.max_loads),
                                              ints(args.branch_free), ints(getattr(args, "async_reduce", "0"))):
        if ar and c == 1:   # (no cluster: the same kernel)
            continue
        params = dict(backend="cute", branch_free=bool(bf), cluster=c, max_loads=ml, pdl=True, threads=nt,
                      **({"async_reduce": True} if ar else {}))
        label = f"c{c}/t{nt}/l{ml}/bf{bf}" + ("/ar" if ar else "")
        yield label, tail.params_spec(params, hidden, top_k, "bfloat16", "float32", "bfloat16", (True, True, False),
                                      arch)


def best_host_us(fn, repeats: int = 3, n: int = 2000) -> float:
    """The least of `repeats` host_us(fn, n): host µs per call with the least interference."""
    return min(host_us(fn, n) for _ in range(repeats))


def events_us(fn, n: int = 200, warmup: int = 5) -> float:
    """µs per call between two CUDA events around `n` back-to-back calls on the current stream (after `warmup`
    calls): the GPU's time per call where the GPU is the bottleneck, the host's where the host is."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) * 1000.0 / n


def timed(step, producer, chained: bool = False) -> float:
    """µs a call of `step` in a CUDA graph: back to back (chained), or each right behind a call of `producer`, less
    the producer's own time (kerngen.timing.after_producer_us)."""
    if chained:
        return graph_time_us(step, calls=20)
    return after_producer_us(step, producer)


def producer_timer(on: bool):
    """graph_time_us, or (with the producer) `timed` behind a 4 MB elementwise write that does not trigger early."""
    if not on:
        return graph_time_us
    producer = elementwise_producer()
    return lambda fn: timed(fn, producer)
