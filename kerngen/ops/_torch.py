"""What the ops' torch custom ops (kerngen/ops/<op>_torch.py) share."""
from __future__ import annotations

from . import _common


def one_device(op: str, **tensors) -> None:
    """The shape-only implementations (torch.compile's tracing, meta tensors) see the call's devices: tensors on two
    devices (a meta tensor beside CPU ones, say) are the kernels' own InputError (check_tensor's device check) naming
    the first that differs, instead of an output of no device's making."""
    given = [(name, t) for name, t in tensors.items() if t is not None]
    for name, t in given[1:]:
        _common.check_tensor(op, name, t, device=given[0][1].device)
