#!/usr/bin/env python3
"""Break down the host cost of one kerngen.finalize call (no graph) against x.add_(1) in the same process."""


import torch

import kerngen
from .lib import host_us
from kerngen.launch import current_stream
from kerngen.ops import finalize as fin
from kerngen.plan import target_arch

g = torch.randn(16, 3584, device="cuda").to(torch.bfloat16)
e2p = torch.randperm(16, device="cuda").view(1, 16).int()
w = torch.rand(1, 16, device="cuda")
out = torch.empty(1, 3584, dtype=torch.bfloat16, device="cuda")
x = torch.zeros(1, device="cuda")
kerngen.finalize(g, e2p, w, out=out)
launcher = fin.kernel(fin.spec(3584, 16, "bfloat16", "float32", 1, target_arch()), 1, 0)
import ctypes
from kerngen.launch import Launcher

nolaunch = ctypes.CDLL("libcuda.so.1").cuDriverGetVersion
nolaunch.argtypes = [ctypes.c_void_p]
ver = ctypes.c_int()
ver_p = ctypes.addressof(ver)
pdl_off = Launcher.__new__(Launcher)
pdl_off.__dict__.update({**launcher.__dict__, "pdl": False, "_states": {}})
launcher(current_stream(0), g.data_ptr(), e2p.data_ptr(), w.data_ptr(), out.data_ptr(), 3584, 16, 1)
tls = launcher._states[__import__("threading").get_ident()]
cfg_p, fn_p, argv_p = tls.cfg_p, launcher._fn_p, tls.argv_p
raw = launcher._launch
plain = ctypes.CDLL("libcuda.so.1").cuLaunchKernel
plain.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
gx, bx = launcher.grid, launcher.block
prepared = kerngen.finalize_prepare(g, e2p, w, out=out)
rows = {
    "x.add_(1)": lambda: x.add_(1),
    "torch.empty(1, 3584)": lambda: torch.empty((1, 3584), dtype=torch.bfloat16, device=g.device),
    "current_stream": lambda: current_stream(0),
    "ctypes no-op driver call": lambda: nolaunch(ver_p),
    "raw cuLaunchKernelEx": lambda: raw(cfg_p, fn_p, argv_p, None),
    "raw cuLaunchKernel": lambda: plain(fn_p, gx[0], gx[1], gx[2], bx[0], bx[1], bx[2], 0, None, argv_p, None),
    "pack_into": lambda: launcher.pack.pack_into(tls.buf, 0, 1, 2, 3, 4, 3584, 16, 1),
    "launcher(...) only": lambda: launcher(current_stream(0), g.data_ptr(), e2p.data_ptr(), w.data_ptr(),
                                           out.data_ptr(), 3584, 16, 1),
    "launcher without PDL": lambda: pdl_off(current_stream(0), g.data_ptr(), e2p.data_ptr(), w.data_ptr(),
                                            out.data_ptr(), 3584, 16, 1),
    "finalize(out=out)": lambda: kerngen.finalize(g, e2p, w, out=out),
    "finalize_prepare().run()": prepared.run,
    "finalize() allocating": lambda: kerngen.finalize(g, e2p, w),
}
base = None
for name, fn in rows.items():
    us = min(host_us(fn) for _ in range(3))
    base = base or us
    print(f"{name:24s} {us:6.2f} µs  {us / base:5.2f}x of x.add_(1)")
