"""What the ops' torch custom ops (kerngen/ops/<op>_torch.py) share."""
from __future__ import annotations

import torch

from ..errors import InputError
from . import _common


def dims(op: str, **tensors: tuple) -> None:
    """name=(t, ndims): each a torch.Tensor of one of those numbers of dimensions, checked before an implementation
    (CUDA, CPU or shape-only) reads a shape from it, so that a wrong rank or a None is the op's InputError naming the
    argument (under torch.compile too), not an IndexError from underneath."""
    for name, (t, ndims) in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise InputError(op, name, "a torch.Tensor", type(t).__name__)
        if t.dim() not in ndims:
            raise InputError(op, name, " or ".join(f"{n}-dimensional" for n in ndims), f"shape {tuple(t.shape)}")


def concrete(*tensors) -> bool:
    """Whether every given tensor's shape is plain ints: the shape-only implementations run the ops' full checks
    then (torch.compile's first, static trace; meta tensors), and only the ranks on symbolic shapes (a dynamic trace
    reasons about sizes the call will check when it runs)."""
    return all(isinstance(d, int) for t in tensors if isinstance(t, torch.Tensor) for d in t.shape)


def one_device(op: str, **tensors) -> None:
    """The shape-only implementations (torch.compile's tracing, meta tensors) see the call's devices: tensors on two
    devices (a meta tensor beside CPU ones, say) are the kernels' own InputError (check_tensor's device check) naming
    the first that differs, instead of an output of no device's making."""
    given = [(name, t) for name, t in tensors.items() if t is not None]
    for name, t in given[1:]:
        _common.check_tensor(op, name, t, device=given[0][1].device)
