"""latent_tail's plain torch side: the reference of the op (kerngen.ops.latent_tail's docstring) in its three
steps (kerngen.ops.latent_tail re-exports them)."""
from __future__ import annotations

import torch


def latent_sum(gemm2_out, expanded_to_permuted, topk_weights, L: int) -> torch.Tensor:
    """y [T, L] fp32: finalize's sum before its rounding (k ascending, separate multiply and add)."""
    T, K = expanded_to_permuted.shape
    acc = torch.zeros(T, L, dtype=torch.float32, device=gemm2_out.device)
    rows = gemm2_out.shape[0]
    if not rows:
        return acc
    for k in range(K):
        idx = expanded_to_permuted[:, k].long()
        valid = (idx >= 0) & (idx < rows)
        x = gemm2_out[idx.clamp(0, rows - 1), :L].float()
        acc = torch.where(valid[:, None], acc + topk_weights[:, k].float()[:, None] * x, acc)
    return acc


def normalize(y: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """n = bf16(y * rstd(y) * norm_weight) from the fp32 latent rows y."""
    rstd = torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)
    return (y * rstd * norm_weight.float()).to(torch.bfloat16)


def project(n: torch.Tensor, up_proj: torch.Tensor, shared=None, residual=None) -> torch.Tensor:
    """bf16(n @ up_proj.T + shared + residual), all in fp32 (the reference's projection)."""
    h = n.float() @ up_proj.float().T
    if shared is not None:
        h = h + shared.float()
    if residual is not None:
        h = h + residual.float()
    return h.to(torch.bfloat16)


def reference(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, up_proj, *, shared=None, residual=None,
              eps: float = 1e-6) -> torch.Tensor:
    """Plain torch of the op (module docstring): out [T, H] bf16."""
    y = latent_sum(gemm2_out, expanded_to_permuted, topk_weights, norm_weight.shape[0])
    return project(normalize(y, norm_weight, eps), up_proj, shared, residual)
