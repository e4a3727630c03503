#!/usr/bin/env python3
"""What programmatic dependent launch (PDL) costs and saves a latency-bound kernel, behind a producer that does not
trigger early and behind one that does.

    python3 -m tools.diagnose.pdl_cost [--ctas 40] [--threads 64]

A small kernel (`--ctas` CTAs of `--threads` threads: each thread one dependent pair of loads, an index then the
value it names, and a store: finalize's shape at few tokens) is timed in a CUDA graph right behind a producer, in
four builds: with and without the programmatic-serialization launch attribute, and with and without
`griddepcontrol.wait` / `griddepcontrol.launch_dependents` in its code. Two producers: a 4 MB elementwise write
that never triggers (torch's `mul_`, tools.bench's `--producer`), and the same write by a kernel of kerngen's own
that triggers its dependents first (as kerngen's expert GEMMs do). Each time is the graph's less the producer's
alone. It answers whether the ~0.25 µs small-K finalize loses behind a non-triggering producer comes from the
launch attribute or from the wait instruction. Needs a GPU; `source(wait)` runs anywhere.
"""
from __future__ import annotations

import argparse

SRC = r"""
struct P { const int* idx; const float* val; float* out; int n; };
extern "C" __global__ void chase(const __grid_constant__ P p) {
{% if wait %}    asm volatile("griddepcontrol.launch_dependents;" :::);
    asm volatile("griddepcontrol.wait;" ::: "memory");
{% endif %}    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < p.n) p.out[i] = p.val[p.idx[i]] * 2.f;
}
struct W { float* buf; long long n; };
extern "C" __global__ void produce(const __grid_constant__ W w) {
{% if trigger %}    asm volatile("griddepcontrol.launch_dependents;" :::);
{% endif %}    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < w.n; i += (long long)gridDim.x * blockDim.x)
        w.buf[i] = w.buf[i] * 1.f;
}
"""


def source(wait: bool, trigger: bool = False) -> str:
    """The CUDA C++ of the chased kernel (with or without the grid-dependency instructions) and of the producer
    (triggering its dependents first or not)."""
    import jinja2
    return jinja2.Template(SRC).render(wait=wait, trigger=trigger)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctas", type=int, default=40)
    ap.add_argument("--threads", type=int, default=64)
    a = ap.parse_args(argv)
    from ..bench.lib import graph_time_us, require_gpu
    require_gpu("python3 -m tools.diagnose.pdl_cost")
    import torch

    from kerngen.compile import nvrtc_compile
    from kerngen.launch import Launcher, Module, current_stream
    from kerngen.plan import target_arch
    dev, n = torch.cuda.current_device(), a.ctas * a.threads
    idx = torch.randperm(n, device="cuda").int()
    val = torch.randn(n, device="cuda")
    out = torch.empty(n, device="cuda")
    buf = torch.ones(1 << 20, device="cuda")   # 4 MB
    arch = target_arch(dev)

    def module(wait: bool, trigger: bool):
        cubin, _ = nvrtc_compile(source(wait, trigger), "pdl_cost", arch, "pdl_cost", None)
        return Module(cubin, f"pdl_cost-{wait}-{trigger}")

    def stream():   # read at each call: graph_time_us captures on a stream of its own
        return current_stream(dev)

    for trigger in (False, True):
        prod = Launcher(module(False, trigger), "produce", dev, (264, 1, 1), (256, 1, 1), "Qq")
        base = graph_time_us(lambda: prod(stream(), buf.data_ptr(), buf.numel()), calls=20)
        print(f"producer ({'triggers its dependents first' if trigger else 'does not trigger'}): {base:.2f} µs")
        for wait in (False, True):
            for pdl in (False, True):
                if pdl and not wait:
                    continue   # a PDL launch must wait before reading what its predecessor wrote
                k = Launcher(module(wait, trigger), "chase", dev, (a.ctas, 1, 1), (a.threads, 1, 1), "QQQi4x", pdl=pdl)
                both = graph_time_us(lambda: (prod(stream(), buf.data_ptr(), buf.numel()),
                                              k(stream(), idx.data_ptr(), val.data_ptr(), out.data_ptr(), n)), calls=20)
                torch.cuda.synchronize()
                assert torch.equal(out, val[idx.long()] * 2)
                print(f"  chase: griddepcontrol {'in' if wait else 'out'}, launch attribute {'on' if pdl else 'off'}: "
                      f"{both - base:.2f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
