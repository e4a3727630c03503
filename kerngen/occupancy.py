"""Resident CTAs: how many CTAs of a kernel one SM holds at once, from what a CTA uses (registers per thread,
threads, shared memory). No GPU needed: the arithmetic of CUDA's standalone occupancy calculator (cuda_occupancy.h,
cudaOccMaxActiveBlocksPerMultiprocessor) with each target's limits. On a GPU the launchers ask the driver instead
(launch.resident); explain, warmup and the tests use this, on the registers and shared memory of the built cubin
(resources.usage).

A persistent grid of more CTAs than an SM holds runs as two waves: the launchers cap a rule's blocks_per_sm at the
count (kerngen.ops._common.persistent_ctas).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from . import resources
from .errors import InputError


@dataclass(frozen=True)
class Limits:
    """What one SM of a target offers a kernel."""
    regs: int                  # 32-bit registers an SM, and the most a CTA may hold
    reg_unit: int              # registers go to a warp in units of this many (so a thread's count rounds up to 8)
    sub_partitions: int        # the register file is split in these; a warp's registers lie in one
    max_regs_per_thread: int
    max_threads_per_cta: int
    warps: int                 # resident warps an SM
    ctas: int                  # resident CTAs an SM
    smem: int                  # shared memory an SM (bytes)
    smem_per_cta: int          # the most one CTA may use, static + dynamic (past 48 KiB by the opt-in)
    smem_reserved: int         # the driver's own shared memory per CTA (sm_80 and later)
    smem_unit: int             # shared memory goes to a CTA in units of this many bytes


# CUDA C++ Programming Guide, "Technical Specifications per Compute Capability" (9.0 and 10.0 read the same):
# 64K registers an SM and a CTA, 255 a thread, 1024 threads a CTA, 64 warps (2048 threads) and 32 CTAs an SM,
# 228 KiB shared memory an SM, 227 KiB a CTA. The allocation units, the four register sub-partitions and the 1 KiB
# reserved a CTA: cuda_occupancy.h (CUDA 13), cudaOccRegAllocationGranularity, cudaOccSubPartitionsPerMultiprocessor,
# cudaOccSMemAllocationGranularity, and cudaDeviceProp.reservedSharedMemPerBlock.
SM90 = Limits(regs=64 * 1024, reg_unit=256, sub_partitions=4, max_regs_per_thread=255, max_threads_per_cta=1024,
              warps=64, ctas=32, smem=228 * 1024, smem_per_cta=227 * 1024, smem_reserved=1024, smem_unit=128)
LIMITS = {"sm_90a": SM90, "sm_100a": SM90}   # a B200 SM offers a kernel what an H100 SM does


def limits(arch: str) -> Limits:
    if arch not in LIMITS:
        raise InputError("occupancy", "arch", f"one of {', '.join(LIMITS)} (the targets whose limits are known)",
                         repr(arch))
    return LIMITS[arch]


def _up(n: int, unit: int) -> int:
    return -(-n // unit) * unit


def resident(arch: str, regs: int, threads: int, smem: int) -> int:
    """CTAs of `threads` threads, `regs` registers a thread and `smem` bytes of shared memory (static + dynamic) one
    SM of `arch` holds at once: the least of what its registers, shared memory, warp slots and CTA slots allow;
    0 where a single CTA does not fit."""
    lim = limits(arch)
    warps = -(-threads // 32)
    if not 1 <= threads <= lim.max_threads_per_cta or regs > lim.max_regs_per_thread or smem > lim.smem_per_cta:
        return 0
    warp_regs = _up(regs * 32, lim.reg_unit)
    warps_a_sub_partition = lim.regs // lim.sub_partitions // warp_regs if warp_regs else lim.warps
    by_regs = warps_a_sub_partition * lim.sub_partitions // warps
    by_smem = lim.smem // _up(smem + lim.smem_reserved, lim.smem_unit)
    return min(lim.ctas, lim.warps // warps, by_regs, by_smem)


class Launch(NamedTuple):
    """A kernel function's persistent launch: its CTA (threads, dynamic shared memory bytes) and the CTAs an SM its
    tier rule asks for (blocks_per_sm)."""
    threads: int
    dynamic_smem: int
    per_sm: int


@dataclass(frozen=True)
class Usage:
    """What one kernel function of a built artifact uses, and (with its launch known) the CTAs an SM holds."""
    function: str
    regs: int
    shared: int                # static shared memory bytes
    stack: int                 # spill stack bytes a thread (resources: nonzero means spills)
    resident: int | None       # None: no persistent launch known for this function
    per_sm: int | None
    dynamic_smem: int = 0      # the launch's dynamic shared memory bytes

    def line(self) -> str:
        name = self.function if len(self.function) <= 60 else self.function[:57] + "..."   # CuTe DSL's run long
        text = f"{name}  {self.regs} regs  {self.shared} B shared" + (
            f" + {self.dynamic_smem} B dynamic" if self.dynamic_smem else "")
        if self.stack:
            text += f"  SPILLS ({self.stack} B stack)"
        if self.resident is not None:
            text += f"  {self.resident} CTAs/SM fit, blocks_per_sm {self.per_sm}"
            if self.per_sm > self.resident:
                text += f" (grid capped at {self.resident})"
        return text


def of_artifact(files: dict[str, bytes], arch: str, launches: dict[str, Launch]) -> list[Usage]:
    """Every kernel function of a built artifact (cuobjdump's REG, SHARED, STACK), with the CTAs an SM holds for
    those `launches` names (their dynamic shared memory added to the static)."""
    rows = []
    for name, use in resources.usage(files):
        regs, shared, stack, launch = use["REG"], use.get("SHARED", 0), use.get("STACK", 0), launches.get(name)
        if launch is None:
            rows.append(Usage(name, regs, shared, stack, None, None))
        else:
            fits = resident(arch, regs, launch.threads, shared + launch.dynamic_smem)
            rows.append(Usage(name, regs, shared, stack, fits, launch.per_sm, launch.dynamic_smem))
    return sorted(rows, key=lambda u: u.function)
