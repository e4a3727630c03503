"""Load cubins with the CUDA driver and launch them on torch's current stream.

Every CUDA C++ kernel of kerngen takes one by-value parameter struct (`__grid_constant__ const Params p`),
so a launch packs its arguments into one preallocated buffer with `struct.pack_into` and hands the driver a
pointer to it: no per-argument Python objects. A `Params` names that struct's fields in order; it gives the
packing (C's natural alignment) and the by-name launch, and tests/test_params_layout.py checks it against the
C struct. The driver copies the parameters at launch (and at graph
capture), so the buffer may be reused at once; it is per thread. Launch goes through ctypes to the
driver's cuLaunchKernelEx with prebuilt C structs: most of a launch's host cost is then the driver's own.
`resolve(spec)` is where a KernelSpec becomes a loaded kernel (built or fetched by jit, loaded by its backend's
loader), once per process.
"""
from __future__ import annotations

import ctypes
import itertools
import keyword
import re
import struct
import threading
import warnings
from importlib import import_module
from types import MethodType

import torch

from . import jit
from .errors import DeviceError
from .plan import KernelSpec
from .tiers import BACKENDS

_driver = None


def _drv():
    global _driver
    if _driver is None:
        from cuda.bindings import driver
        _driver = driver
    return _driver


def _ok(result, what: str):
    drv = _drv()
    err = result[0] if isinstance(result, tuple) else result
    if err != drv.CUresult.CUDA_SUCCESS:
        name = drv.cuGetErrorName(err)[1]
        raise DeviceError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")
    return result[1] if isinstance(result, tuple) and len(result) > 1 else None


C_TYPES = {"ptr": "Q", "int": "i", "unsigned": "I", "float": "f"}   # field type -> struct code (size = alignment)


class Params:
    """One kernel's by-value `struct Params`, as its ordered (name, C type) fields ("ptr", "int", "unsigned",
    "float"). Every field sits at a multiple of its size and the struct's size is a multiple of the largest,
    as C lays it out; `format` is that packing for the struct module, `offsets` each field's byte offset."""

    def __init__(self, *fields: tuple[str, str]):
        for name, ctype in fields:
            if not re.fullmatch(r"[a-z_][a-z0-9_]*", name) or keyword.iskeyword(name) or ctype not in C_TYPES:
                raise ValueError(f"Params field {name!r} of type {ctype!r}: a C identifier of one of {list(C_TYPES)}")
        self.fields, self.names = tuple(fields), tuple(n for n, _ in fields)
        if len(set(self.names)) != len(self.names):
            raise ValueError(f"Params fields named twice: {self.names}")
        # the C names: a trailing '_' marks a C field named as a Python keyword (finalize's `in`)
        self.c_names = tuple(n[:-1] if n.endswith("_") and keyword.iskeyword(n[:-1]) else n for n in self.names)
        codes, offsets, at, align = [], {}, 0, 1
        for name, ctype in fields:
            size = struct.calcsize(C_TYPES[ctype])
            codes += ["x"] * (-at % size)
            at += -at % size
            offsets[name], at, align = at, at + size, max(align, size)
            codes.append(C_TYPES[ctype])
        codes += ["x"] * (-at % align)
        self.offsets, self.size = offsets, at + -at % align
        runs = [(code, len(list(run))) for code, run in itertools.groupby(codes)]
        self.format = "".join(f"{n}{code}" if n > 1 else code for code, n in runs)   # e.g. "10Qf6i4x"
        # by-name launch and bind, generated once per struct (as Triton derives its launcher from the signature):
        # keyword arguments straight into pack_into, no per-call dict; a field left out packs as 0
        sig, names = ", ".join(f"{n}=0" for n in self.names), ", ".join(self.names)
        code = (f"def launch(self, stream, *, {sig}):\n"
                f"    st = self._states.get(get_ident()) or self._state()\n"
                f"    self.pack.pack_into(st.buf, 0, {names})\n"
                f"    st.cfg.stream = stream\n"
                f"    err = self._launch(st.cfg_p, self._fn_p, st.argv_p, None)\n"
                f"    if err:\n"
                f"        self._failed(err)\n"
                f"def bind(self, *, {sig}):\n"
                f"    return self._bound({names})\n")
        scope = {"get_ident": threading.get_ident}
        exec(code, scope)
        self.launch, self.bind = scope["launch"], scope["bind"]


class Module:
    """A cubin, loaded lazily once per device (the driver's context-independent library API)."""

    def __init__(self, cubin: bytes, key: str):
        self.cubin, self.key = cubin, key
        self._functions: dict[tuple[int, str], object] = {}
        self._library = None
        self._mutex = threading.Lock()

    def load(self, device: int) -> None:
        """Load the library now (start-up) rather than on the first launch."""
        with self._mutex:
            if self._library is None:
                torch.cuda.init()
                self._library = _ok(_drv().cuLibraryLoadData(self.cubin, None, None, 0, None, None, 0),
                                    f"loading {self.key}")

    def function(self, name: str, device: int):
        fn = self._functions.get((device, name))
        if fn is None:
            with self._mutex:
                drv = _drv()
                torch.cuda.init()
                if self._library is None:
                    self._library = _ok(drv.cuLibraryLoadData(self.cubin, None, None, 0, None, None, 0),
                                        f"loading {self.key}")
                kernel = _ok(drv.cuLibraryGetKernel(self._library, name.encode()), f"finding {name} in {self.key}")
                with torch.cuda.device(device):
                    torch.cuda.current_stream()  # makes torch's primary context current on this thread
                    fn = _ok(drv.cuKernelGetFunction(kernel), f"binding {name} to cuda:{device}")
                self._functions[(device, name)] = fn
        return fn


class _LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_cuda_fns: dict[str, object] = {}


def _cuda_fn(name: str, *argtypes):
    """Driver function `name` of the library torch already loaded, called through ctypes (a CUresult back)."""
    fn = _cuda_fns.get(name)
    if fn is None:
        fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
        fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
        _cuda_fns[name] = fn
    return fn


def _launch_fn():
    """cuLaunchKernelEx through ctypes: the argument block and launch config are prebuilt C structs, so a launch
    costs one foreign call."""
    return _cuda_fn("cuLaunchKernelEx", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)


def needs_smem_optin(static: int, dynamic: int) -> bool:
    """Whether a launch must raise the function's dynamic shared memory limit first: a CTA may use more than
    48 KiB only by opting in, and the 48 KiB count static and dynamic shared memory together."""
    return static + dynamic > 48 * 1024


def allow_smem(fn, dynamic: int) -> None:
    """Raise the function's dynamic shared memory limit to `dynamic` bytes where a launch with them needs it."""
    if not dynamic:
        return
    drv = _drv()
    attr = drv.CUfunction_attribute
    static = int(_ok(drv.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, fn),
                     "reading the kernel's static shared memory"))
    if needs_smem_optin(static, dynamic):
        _ok(drv.cuFuncSetAttribute(fn, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic),
            "raising the dynamic shared memory limit")


def resident(fn, threads: int, dynamic: int = 0) -> int:
    """CTAs of `threads` threads with `dynamic` bytes of dynamic shared memory that one SM of the function's device
    holds at once: the driver's occupancy calculator (registers, shared memory, warp and CTA slots; kerngen.occupancy
    is the same arithmetic without a GPU). The shared memory limit is raised first where `dynamic` needs it."""
    allow_smem(fn, dynamic)
    return int(_ok(_drv().cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, dynamic),
                   "asking the driver how many CTAs an SM holds"))


class Launcher:
    """One kernel at one grid/block on one device; `launcher.launch(stream, field=value, ...)` packs the
    fields of its `Params` by name (0 for a field left out) and launches; `launcher(stream, *values)` takes
    them in field order.

    `params` is the kernel's Params (or a bare struct-module format: positional calls only).
    With `pdl`, the launch allows programmatic dependent launch (the kernel must griddepcontrol.wait
    before reading anything its predecessors wrote).
    """

    def __init__(self, module: Module, name: str, device: int, grid, block, params: Params | str, smem: int = 0,
                 pdl: bool = False):
        self.fn = module.function(name, device)
        self.params = params if isinstance(params, Params) else None
        self.pack = struct.Struct("<" + (params.format if self.params else params))
        if self.params:
            self.launch, self.bind = MethodType(params.launch, self), MethodType(params.bind, self)
        self.grid, self.block, self.smem, self.pdl = tuple(grid), tuple(block), smem, pdl
        self.name = name
        self._fn_p = ctypes.c_void_p(int(self.fn))
        self._launch = _launch_fn()
        self._states: dict[int, _LaunchState] = {}
        allow_smem(self.fn, smem)

    def _state(self, register: bool = True):
        """Launch state: parameter buffer and launch config, reused on every call (per thread, or per bind)."""
        st = _LaunchState()
        st.buf = ctypes.create_string_buffer(max(self.pack.size, 8))
        st.argv = (ctypes.c_void_p * 1)(ctypes.addressof(st.buf))
        st.attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        st.attr.value = (1).to_bytes(4, "little")
        st.cfg = _LaunchConfig(grid=(ctypes.c_uint * 3)(*self.grid), block=(ctypes.c_uint * 3)(*self.block),
                               smem=self.smem, attrs=ctypes.pointer(st.attr), num_attrs=1 if self.pdl else 0)
        st.cfg_p, st.argv_p = ctypes.c_void_p(ctypes.addressof(st.cfg)), ctypes.c_void_p(ctypes.addressof(st.argv))
        if register:
            self._states[threading.get_ident()] = st
        return st

    def __call__(self, stream: int, *args) -> None:
        st = self._states.get(threading.get_ident()) or self._state()
        self.pack.pack_into(st.buf, 0, *args)
        st.cfg.stream = stream
        err = self._launch(st.cfg_p, self._fn_p, st.argv_p, None)
        if err:
            self._failed(err)

    def _failed(self, err: int):
        _ok(_drv().CUresult(err), f"launching {self.name} grid={self.grid} block={self.block}")

    def _bound(self, *args) -> "BoundLaunch":
        """These arguments packed once (`bind(field=value, ...)`): the returned call costs the stream lookup
        and the driver launch."""
        st = self._state(register=False)
        self.pack.pack_into(st.buf, 0, *args)
        return BoundLaunch(self, st)


class BoundLaunch:
    """A launch with its arguments packed; `bound(stream)` launches. Not for concurrent use from threads."""
    __slots__ = ("_launcher", "_st", "_fn_p", "_launch", "_cfg_p", "_argv_p", "_cfg")

    def __init__(self, launcher: Launcher, st: "_LaunchState"):
        self._launcher, self._st, self._fn_p, self._launch = launcher, st, launcher._fn_p, launcher._launch
        self._cfg, self._cfg_p, self._argv_p = st.cfg, st.cfg_p, st.argv_p

    def __call__(self, stream: int) -> None:
        self._cfg.stream = stream
        err = self._launch(self._cfg_p, self._fn_p, self._argv_p, None)
        if err:
            _ok(_drv().CUresult(err), f"launching {self._launcher.name}")


class _LaunchState:
    __slots__ = ("buf", "argv", "attr", "cfg", "cfg_p", "argv_p")


def current_stream(device: int) -> int:
    """torch's current stream on `device` as a raw handle (cheap: no Stream object)."""
    return torch._C._cuda_getCurrentRawStream(device)


def load(files: dict[str, bytes], key: str) -> Module:
    """A built CUDA C++ kernel's module, its library loaded now (the backend table's loader for nvrtc)."""
    module = Module(files["kernel.cubin"], key)
    module.load(torch.cuda.current_device())
    return module


def resolve(spec: KernelSpec):
    """The loaded kernel of a spec, built or fetched from the cache (jit.build) and loaded by its backend's loader
    (tiers.BACKENDS) once per process: a Module for CUDA C++, a TVM-FFI function for CuTe DSL."""
    mod = _resolved.get(spec)
    if mod is None:
        built = jit.build(spec)
        mod = _resolved[spec] = import_module(f".{BACKENDS[spec.backend].loader}", __package__).load(built.files,
                                                                                                     built.key)
    return mod


# Keyed by KernelSpec, not by shape: a spec is one binary whichever shape or tier table asked for it, so
# dispatch.clear() leaves these loaded (the dispatch objects of a new table find them again; CuTe's JIT engine keeps
# its code alive anyway).
_resolved: dict[KernelSpec, object] = {}


def graph_launch(handle: int, stream: int) -> None:
    """cuGraphLaunch of an instantiated graph (its raw handle) on a raw stream."""
    err = _cuda_fn("cuGraphLaunch", ctypes.c_void_p, ctypes.c_void_p)(handle, stream)
    if err:
        _ok(_drv().CUresult(err), "launching a CUDA graph")


def stream_capturing(stream: int) -> bool:
    """Whether a raw stream is capturing into a graph (cuStreamIsCapturing; an invalidated capture counts)."""
    status = ctypes.c_int(0)
    err = _cuda_fn("cuStreamIsCapturing", ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))(stream, ctypes.byref(status))
    if err:
        _ok(_drv().CUresult(err), "asking whether the stream is capturing")
    return status.value != 0


class EagerGraphs:
    """One op shape's launch sequences replayed from CUDA graphs in eager calls (KERNGEN_EAGER_GRAPHS): a sequence
    whose launch fields (every pointer and count) were seen before is captured on a stream of its own into a graph
    the second time, and from then on a call with the same fields launches that graph: one driver call, not one a
    kernel. Never while the caller's stream is capturing (its own graph takes the kernels). At most `size` graphs
    (the oldest go first); off for the shape once `size` captures have been made and fewer calls hit them than that.
    The kernels read their buffers when they run, so a replay is the launches themselves."""

    def __init__(self, device: int, size: int = 64):
        self.device, self.size = device, size
        self._graphs: dict[tuple, int] = {}   # fields -> CUgraphExec (raw handle)
        self._seen: dict[tuple, None] = {}    # fields met once
        self._execs: dict[int, object] = {}   # raw handle -> the driver's CUgraphExec object (destroyed on eviction)
        self.captures = self.hits = 0
        self.off = False
        self._stream = None
        self._mutex = threading.Lock()

    def launch(self, stream: int, launches, fields: tuple) -> bool:
        """Launch `launches` (Launchers taking `fields`) on `stream` from a graph if this sequence has one or is
        now met for the second time; False where the caller launches them itself."""
        if self.off:
            return False
        g = self._graphs.get(fields)
        if g is None and fields not in self._seen:   # met for the first time: the caller launches (no driver call)
            if len(self._seen) >= 4 * self.size:
                self._seen.pop(next(iter(self._seen), None), None)
            self._seen[fields] = None
            return False
        if stream_capturing(stream):
            return False
        if g is None:
            try:
                g = self._capture(launches, fields)
            except DeviceError as e:   # the launches themselves still work: plain ones from now on, said once
                self.off = True
                warnings.warn(f"kerngen: eager CUDA graphs turned off for this shape ({e})", RuntimeWarning,
                              stacklevel=3)
                return False
        else:
            self.hits += 1
        graph_launch(g, stream)
        return True

    def _capture(self, launches, fields: tuple) -> int:
        """Capture and instantiate this sequence (the oldest graph goes past `size`); its raw handle."""
        with self._mutex:
            handle = self._instantiate(launches, fields)
            if len(self._graphs) >= self.size:
                self._destroy(self._graphs.pop(next(iter(self._graphs))))
            self._graphs[fields] = handle
            self._seen.pop(fields, None)
            self.captures += 1
            if self.captures >= self.size and self.hits < self.captures:
                self.off = True   # the shape's pointers do not repeat: plain launches from now on
            return handle

    def _instantiate(self, launches, fields: tuple) -> int:
        """The launches captured on this object's own stream into a graph, instantiated: its raw handle."""
        drv = _drv()
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)   # (in torch's context for the device)
        side = self._stream.cuda_stream
        _ok(drv.cuStreamBeginCapture(side, drv.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
            "beginning a capture")
        try:
            for launch in launches:
                launch(side, *fields)
        finally:
            graph = _ok(drv.cuStreamEndCapture(side), "ending a capture")
        try:
            exec_ = _ok(drv.cuGraphInstantiate(graph, 0), "instantiating a CUDA graph")
        finally:
            _ok(drv.cuGraphDestroy(graph), "destroying a captured graph")
        self._execs[int(exec_)] = exec_
        return int(exec_)

    def _destroy(self, handle: int) -> None:
        _ok(_drv().cuGraphExecDestroy(self._execs.pop(handle)), "destroying a CUDA graph")
