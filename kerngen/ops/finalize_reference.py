"""finalize's plain torch side: the weighted sum of kerngen.ops.finalize's docstring, which the kernels match bitwise
(kerngen.ops.finalize re-exports `reference`)."""
from __future__ import annotations

import torch


def reference(gemm2_out, expanded_to_permuted, topk_weights, hidden=None):
    """Plain torch: fp32, k ascending, separate multiply and add; the kernels match it bitwise."""
    H = hidden or gemm2_out.shape[1]
    T, K = expanded_to_permuted.shape
    acc = torch.zeros(T, H, dtype=torch.float32, device=gemm2_out.device)
    rows = gemm2_out.shape[0]
    if rows == 0:   # every index lies outside [0, rows): nothing contributes
        return acc.to(gemm2_out.dtype)
    for k in range(K):
        idx = expanded_to_permuted[:, k].long()
        valid = (idx >= 0) & (idx < rows)
        x = gemm2_out[idx.clamp(0, rows - 1), :H].float()
        acc = torch.where(valid[:, None], acc + topk_weights[:, k].float()[:, None] * x, acc)
    return acc.to(gemm2_out.dtype)
