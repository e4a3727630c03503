"""latent_tail's input checks: every argument, with an InputError naming it, on the CUDA path and before the CPU
reference of torch.ops.kerngen.latent_tail (kerngen.ops.latent_tail re-exports them)."""
from __future__ import annotations

import torch

from ..errors import InputError
from ._common import check_aligned, check_eps, check_gather_inputs, check_rows, check_tensor

OP = "latent_tail"
MAX_K = 64
_BF16 = (torch.bfloat16,)
_W = (torch.float32, torch.bfloat16)


def check_args(g, e2p, w, nw, up, shared, residual, eps, *, cuda: bool = True) -> tuple[int, int, int]:
    """Full validation with a message naming the argument; returns (T, L, H). Runs on the first call of a shape or
    on any doubt, and (cuda=False: tensors on any one device) before the reference of torch.ops.kerngen.latent_tail
    on CPU tensors: the same checks and errors on both devices but the device's."""
    T, K = check_gather_inputs(OP, g, e2p, w, _BF16, _W, MAX_K, cuda=cuda)
    dev = g.device
    check_tensor(OP, "norm_weight", nw, dtypes=_BF16, ndim=1, device=dev, contiguous=True)
    L = nw.shape[0]
    if L < 8 or L % 8 or L > g.shape[1]:
        raise InputError(OP, "norm_weight", f"of length L, a multiple of 8 in [8, {g.shape[1]}] (gemm2_out's width)",
                         f"length {L}")
    check_rows(OP, g, L)
    check_tensor(OP, "up_proj", up, dtypes=_BF16, ndim=2, device=dev, contiguous=True)
    H = up.shape[0]
    if up.shape[1] != L and up.shape[1] == g.shape[1]:   # up_proj spans gemm2_out's rows: the norm weight is off
        raise InputError(OP, "norm_weight", f"of length {up.shape[1]} (up_proj's and gemm2_out's width)",
                         f"length {L}")
    if up.shape[1] != L or H < 8 or H % 8:
        raise InputError(OP, "up_proj", f"[H, {L}] with H a multiple of 8 (L = {L}, norm_weight's length)",
                         f"shape {tuple(up.shape)}")
    if T * H >= 2**31:
        raise InputError(OP, "up_proj", f"fewer than 2**31 // {T} rows (T * H output elements)", f"shape {tuple(up.shape)}")
    for name, t in (("shared", shared), ("residual", residual)):
        if t is not None:
            check_tensor(OP, name, t, dtypes=_BF16, ndim=2, device=dev, contiguous=True)
            if tuple(t.shape) != (T, H):
                raise InputError(OP, name, f"of shape {(T, H)} (tokens, up_proj's rows)", f"shape {tuple(t.shape)}")
    check_eps(OP, eps)
    for name, t in (("gemm2_out", g), ("norm_weight", nw), ("up_proj", up)):
        check_aligned(OP, name, t)
    return T, L, H
