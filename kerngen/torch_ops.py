"""torch custom ops: torch.ops.kerngen.<name> for each name a registered op declares (kerngen.ops.Op.torch: finalize,
route, route_permute, moe_align_block_size, moe_tail, latent_tail, moe_experts), defined in its <module>_torch
(kerngen/ops/finalize_torch.py, ...) and registered by importing this module.

They trace under torch.compile(fullgraph=True) (fake implementations give output shapes, after the op's own
checks: every argument on plain shapes, the ranks on symbolic ones) and capture in CUDA graphs. A CPU
implementation (the torch reference) lets pipelines run and be checked on the CPU.
Every tensor a call uses is its own (no workspace, scratch or prototype kept between calls): torch.compile's CUDA
graphs own the memory their calls allocate and reuse it once the call's outputs are dead.
Calling kerngen.finalize / route / moe_tail directly is cheaper on the host (no dispatcher).
"""
from __future__ import annotations

from importlib import import_module

from . import ops

for _op in ops.registered():
    if _op.torch:
        import_module(f"{_op.module_name}_torch")
