"""Load cubins with the CUDA driver and launch them on torch's current stream.

Every CUDA C++ kernel of kerngen takes one by-value parameter struct (`__grid_constant__ const Params p`),
so a launch packs its arguments into one preallocated buffer with `struct.pack_into` and hands the driver a
pointer to it: no per-argument Python objects. The driver copies the parameters at launch (and at graph
capture), so the buffer may be reused at once; it is per thread.
"""
from __future__ import annotations

import ctypes
import struct
import threading

import torch

from .errors import DeviceError

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


class Module:
    """A cubin, loaded lazily once per device (the driver's context-independent library API)."""

    def __init__(self, cubin: bytes, key: str):
        self.cubin, self.key = cubin, key
        self._functions: dict[tuple[int, str], object] = {}
        self._library = None
        self._mutex = threading.Lock()

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


class Launcher:
    """One kernel at one grid/block on one device; `launcher(stream, *args)` packs args and launches.

    `fmt` is the struct-module format of the kernel's Params struct (pointers 'Q', int32 'i', float 'f',
    explicit 'x' padding), native alignment disabled ('<'): the C struct must be laid out to match.
    """

    def __init__(self, module: Module, name: str, device: int, grid, block, fmt: str, smem: int = 0,
                 pdl: bool = False):
        drv = _drv()
        self.fn = module.function(name, device)
        self.pack = struct.Struct("<" + fmt)
        self.grid, self.block, self.smem, self.pdl = tuple(grid), tuple(block), smem, pdl
        self._tls = threading.local()
        if smem > 48 * 1024:
            _ok(drv.cuFuncSetAttribute(self.fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                       smem), "raising the dynamic shared memory limit")
        if pdl:
            attr = drv.CUlaunchAttribute()
            attr.id = drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
            attr.value.programmaticStreamSerializationAllowed = 1
            self._attr = attr

    def _buffers(self):
        tls = self._tls
        if not hasattr(tls, "buf"):
            tls.buf = ctypes.create_string_buffer(max(self.pack.size, 8))
            tls.argv = (ctypes.c_void_p * 1)(ctypes.addressof(tls.buf))
            tls.argv_addr = ctypes.addressof(tls.argv)
            if self.pdl:
                drv = _drv()
                cfg = drv.CUlaunchConfig()
                cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = self.grid
                cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = self.block
                cfg.sharedMemBytes = self.smem
                cfg.attrs = [self._attr]
                cfg.numAttrs = 1
                tls.cfg = cfg
        return tls

    def __call__(self, stream: int, *args) -> None:
        tls = self._buffers()
        self.pack.pack_into(tls.buf, 0, *args)
        drv = _driver
        if self.pdl:
            tls.cfg.hStream = stream
            err = drv.cuLaunchKernelEx(tls.cfg, self.fn, tls.argv_addr, 0)[0]
        else:
            g, b = self.grid, self.block
            err = drv.cuLaunchKernel(self.fn, g[0], g[1], g[2], b[0], b[1], b[2], self.smem, stream,
                                     tls.argv_addr, 0)[0]
        if err != drv.CUresult.CUDA_SUCCESS:
            _ok(err, f"launching {self.pack.format} kernel")


def current_stream(device: int) -> int:
    """torch's current stream on `device` as a raw handle (cheap: no Stream object)."""
    return torch._C._cuda_getCurrentRawStream(device)
