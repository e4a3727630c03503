"""tail's input checks, naming the argument, on the CUDA path and before the CPU reference of
torch.ops.kerngen.moe_tail (kerngen.ops.tail re-exports them)."""
from __future__ import annotations

import torch

from ..errors import InputError
from ._common import check_aligned, check_gather_inputs, check_rows, check_tensor
from .tail_reference import FP8, FP8_BLOCK

OP = "tail"
MAX_K = 32
_ACT = (torch.bfloat16, torch.float16)
_W = (torch.float32, torch.bfloat16)
_OUT = _ACT + (FP8,)


def check_args(g, e2p, w, nw, shared=None, residual=None, residual_out=None, out_dtype=None, *, cuda: bool = True):
    """Full validation with a message naming the argument; runs on the first call of a signature, and
    (cuda=False) before the reference of torch.ops.kerngen.moe_tail on CPU tensors."""
    T, K = check_gather_inputs(OP, g, e2p, w, _ACT, _W, MAX_K, cuda=cuda)
    dev = g.device
    check_tensor(OP, "norm_weight", nw, dtypes=(g.dtype,), ndim=1, device=dev, contiguous=True)
    H = nw.shape[0]
    if H < 8 or H % 8 or H > g.shape[1]:
        raise InputError(OP, "norm_weight", f"of length H, a multiple of 8 in [8, {g.shape[1]}] (gemm2_out's width)",
                         f"length {H}")
    check_rows(OP, g, H)
    for name, t in (("shared", shared), ("residual", residual), ("residual_out", residual_out)):
        if t is not None:
            check_tensor(OP, name, t, dtypes=(g.dtype,), ndim=2, device=dev, contiguous=True)
            if tuple(t.shape) != (T, H):
                raise InputError(OP, name, f"of shape {(T, H)}", f"{tuple(t.shape)}")
            check_aligned(OP, name, t)
    if out_dtype is not None and out_dtype not in _OUT:
        raise InputError(OP, "out_dtype", "torch.bfloat16, torch.float16, torch.float8_e4m3fn or None", str(out_dtype))
    if out_dtype == FP8 and H % FP8_BLOCK:
        raise InputError(OP, "norm_weight", f"of length H, a multiple of {FP8_BLOCK}, for out_dtype="
                         "torch.float8_e4m3fn (one scale per 128 columns); use a bf16/fp16 out_dtype", f"length {H}")
    for name, t in (("gemm2_out", g), ("expanded_to_permuted", e2p), ("topk_weights", w), ("norm_weight", nw)):
        check_aligned(OP, name, t)
