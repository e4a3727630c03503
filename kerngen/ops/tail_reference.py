"""tail's plain torch side: the fused tail of kerngen.ops.tail's docstring in fp32 and the fp8 output's per-token,
per-128-column quantization (kerngen.ops.tail re-exports them)."""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_BLOCK = 128      # columns per scale
FP8_MAX = 448.0      # largest finite e4m3fn
SCALE_FLOOR = 1e-12  # an all-zero block gets this amax (scale > 0, q = 0)


def quantize_fp8(n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] fp32 -> (q [T, H] float8_e4m3fn, scales [T, H // 128] fp32), per token and 128 columns."""
    T, H = n.shape
    blocks = n.float().view(T, H // FP8_BLOCK, FP8_BLOCK)
    scales = blocks.abs().amax(-1).clamp_min(SCALE_FLOOR) / FP8_MAX
    # n / scale exceeds 448 only by a rounding error; saturate explicitly, as the kernel's cvt.rn.satfinite
    # does, instead of relying on how a torch version casts values beyond 448 (round to nearest even below)
    q = (blocks / scales[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(T, H), scales


def reference(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, *, eps=1e-6, shared=None,
              residual=None, out_dtype=None):
    """fp32 torch math of the fused tail; returns (out, residual_out). Index -1 (or >= rows) is skipped.

    out is what moe_tail returns: a tensor, or (q, scales) for out_dtype=torch.float8_e4m3fn.
    out_dtype=torch.float32 gives n itself (the normalized row before any rounding)."""
    g, e2p = gemm2_out, expanded_to_permuted
    H = norm_weight.shape[0]
    rows = g.shape[0]
    idx = e2p.long()
    valid = (idx >= 0) & (idx < rows)
    x = g[idx.clamp(0, max(rows - 1, 0)), :H].float() if rows else torch.zeros(*idx.shape, H, device=g.device)
    w = torch.where(valid, topk_weights.float(), 0.0)
    y = torch.zeros(e2p.shape[0], H, dtype=torch.float32, device=g.device)
    for k in range(e2p.shape[1]):  # k ascending, like the kernel
        y = y + w[:, k, None] * torch.where(valid[:, k, None], x[:, k], 0.0)
    if shared is not None:
        y = y + shared.float()
    if residual is not None:
        y = y + residual.float()
    rstd = torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    n = y * rstd * norm_weight.float()
    out = quantize_fp8(n) if out_dtype == FP8 else n.to(out_dtype or g.dtype)
    return out, y.to(g.dtype)
