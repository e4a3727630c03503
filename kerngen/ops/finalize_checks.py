"""finalize's input checks, naming the argument, on the CUDA path and before the CPU reference of
torch.ops.kerngen.finalize (kerngen.ops.finalize re-exports them)."""
from __future__ import annotations

import torch

from ..errors import InputError
from ._common import check_aligned, check_gather_inputs, check_rows

OP = "finalize"
MAX_K = 64
_ACT = (torch.bfloat16, torch.float16)
_W = (torch.float32, torch.bfloat16)


def check_args(g, e2p, w, hidden, *, cuda: bool = True):
    """Full validation with a message naming the argument; runs on the first call of a shape or on any doubt,
    and (cuda=False) before the reference of torch.ops.kerngen.finalize on CPU tensors."""
    T, K = check_gather_inputs(OP, g, e2p, w, _ACT, _W, MAX_K, cuda=cuda)
    H = g.shape[1] if hidden is None else hidden
    if not isinstance(H, int) or H < 8 or H % 8 or H > g.shape[1]:
        raise InputError(OP, "hidden", f"a multiple of 8 in [8, {g.shape[1]}] (gemm2_out's width)", repr(H))
    check_rows(OP, g, H)
    check_aligned(OP, "gemm2_out", g)
