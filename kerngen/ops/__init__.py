"""The ops: each validates its inputs, asks its dispatch object for a kernel, packs arguments and launches.

OPS is the one registry of ops with kernels. Each op module offers the same seam, which warmup, the CLI
(`explain`), the tuner and the tests iterate over:
    model_specs(model, table, arch) -> [KernelSpec]   every kernel a model can dispatch to
    explain_spec(table, arch, *, experts, top_k, hidden, tokens, model=None, ...) -> KernelSpec
    kernel(spec, tokens, device)                       the launch object of one spec
    dispatch(device, **static shape) -> Dispatch       the shape's kernels, resolved once (keywords after device)
and keeps the calls it resolved in kerngen.dispatch.calls(op) (input signature -> launch object and arguments) and
what its calls reuse (scratch buffers) in its dispatch objects (`Dispatch.kept`): no cache of its own, so
kerngen.clear() forgets it all,
and TORCH_OPS, the names of its torch.ops.kerngen ops (registered in kerngen/torch_ops.py), and optionally
SHAPE_FLAGS, the shape fields its explain_spec needs (default ("top_k", "hidden"); the CLI checks
them), MAX_K, its largest top_k; the ops with persistent grids (experts, latent_tail) one more, which explain,
warmup and the tests read:
    persistent(spec) -> {function: occupancy.Launch}   each kernel's CTA and the CTAs an SM its rule asks for
"""
from __future__ import annotations

from importlib import import_module

OPS = ("routing", "permute", "finalize", "tail", "experts", "latent_tail")


def op_module(op: str):
    """kerngen.ops.<op>, one of OPS."""
    if op not in OPS:
        raise KeyError(f"unknown op {op!r}; kerngen's ops are {', '.join(OPS)}")
    return import_module(f".{op}", __package__)
