"""experts' plain torch side: the reference computation (fp32 weights, fp8 and MXFP4 ones dequantized) and the
activation quantizations the kernels' f16x and fp8-activation builds carry (kerngen.ops.experts re-exports them)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .experts_checks import E2M1, FP8, MX_GROUP, QBLOCK, infer_tile


def activate(h: torch.Tensor, I: int, activation: str, interleaved: bool, alpha: float = 1.702, limit: float = 7.0,
             beta: float = 1.0, linear_beta: float = 0.0) -> torch.Tensor:
    """ACT(gate, up) of fp32 rows h [.., 2I] in fp32. gelu is the tanh approximation (gelu_pytorch_tanh)."""
    g, u = (h[..., 0::2], h[..., 1::2]) if interleaved else (h[..., :I], h[..., I:])
    if activation == "silu":
        return F.silu(g) * u
    if activation == "gelu":
        return F.gelu(g, approximate="tanh") * u
    if activation == "gpt_oss":
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return (u + 1) * (g * torch.sigmoid(alpha * g))
    lin = linear_beta * torch.tanh(u / linear_beta) if linear_beta > 0 else u
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * lin


def dequantize(w: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """fp32 weights [.., N, K] of bf16 ones (scale None), of fp8 ones with their [.., N/128, K/128] block scales, or
    of MXFP4 blocks [.., N, K/32, 16] (two e2m1 values a byte, low nibble first) with their e8m0 scales
    [.., N, K/32] (2^(s - 127) each)."""
    if scale is None:   # contiguous fp32: the products' sums do not depend on how the weights are strided
        return w.float(memory_format=torch.contiguous_format)
    if w.dtype == torch.uint8:
        lut = torch.tensor(E2M1, dtype=torch.float32, device=w.device)
        vals = torch.stack([lut[(w & 15).long()], lut[(w >> 4).long()]], dim=-1).flatten(-2)   # [.., N, K/32, 32]
        vals = vals * torch.exp2(scale.float() - 127.0)[..., None]
        return vals.flatten(-2)
    return w.float() * scale.float().repeat_interleave(QBLOCK, -2).repeat_interleave(QBLOCK, -1)


def reference(x, routing, w13, w2, *, activation="silu", interleaved=False, b13=None, b2=None, input_weights=None,
              tile=None, alpha=1.702, limit=7.0, beta=1.0, linear_beta=0.0, w13_scale=None,
              w2_scale=None, fp8_activations=False) -> torch.Tensor:
    """Plain torch, row by row of the permutation, with fp32 weights (fp8 ones dequantized: w * block scale).
    Rounding points: xs = bf16(x * input_weights) (fp32 product);
    h = xs @ w13[e].T accumulated in fp32, b13 added in fp32, not rounded; the activation in fp32, rounded once to
    bf16 (the intermediate); out = a @ w2[e].T in fp32, b2 added in fp32, rounded to bf16. Padding rows are 0.
    fp8_activations: xs and the intermediate enter the products as quantize_fp8(.) dequantized (fp32)."""
    p2t, t2e = routing.permuted_to_token.long(), routing.tile_to_expert.long()
    tile = tile or getattr(routing, "tile", None) or infer_tile(routing)
    I, H = w2.shape[2] * (MX_GROUP if w2.dtype == torch.uint8 else 1), w2.shape[1]
    xs = x if input_weights is None else (x.float() * input_weights.float()[:, None]).to(x.dtype)
    out = torch.zeros(p2t.shape[0], H, dtype=x.dtype, device=x.device)
    rows = torch.nonzero(p2t >= 0).flatten()
    experts = t2e[rows // tile]
    for e in experts.unique().tolist():
        r = rows[experts == e]
        xe = fp8_round_trip(xs[p2t[r]]) if fp8_activations else xs[p2t[r]].float()
        h = xe @ dequantize(w13[e], None if w13_scale is None else w13_scale[e]).T
        if b13 is not None:
            h = h + b13[e].float()
        a = activate(h, I, activation, interleaved, alpha, limit, beta, linear_beta).to(x.dtype)
        y = (fp8_round_trip(a) if fp8_activations else a.float()) @ dequantize(w2[e], None if w2_scale is None
                                                                                else w2_scale[e]).T
        if b2 is not None:
            y = y + b2[e].float()
        out[r] = y.to(x.dtype)
    return out


def quantize_fp8(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows [.., K] (K a multiple of 128) as e4m3 values and fp32 scales [.., K/128], per row and 128 columns:
    s = max(amax, 1e-10) / 448, q = e4m3(v / s) (DeepSeek-V3's and vLLM's per-token-group activation quantization)."""
    g = v.float().unflatten(-1, (-1, QBLOCK))
    amax = g.abs().amax(-1).clamp(min=1e-10)
    s = amax / torch.full_like(amax, 448.0)   # a divided tensor: CUDA torch multiplies by 1 / 448 for a scalar
    return (g / s[..., None]).clamp(-448.0, 448.0).to(FP8).flatten(-2), s


def quantize_f16(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 rows [.., K] (K a multiple of 8) as f16 values and power-of-two fp32 scales [.., ceil(K/128)], per row and
    128 columns (the last group shorter where K % 128 != 0), as the f16x builds carry their activations: s = 2^(E - 15)
    for the group's largest magnitude in [2^E, 2^(E+1)) (E at least -111), q = f16(v / s). Every value within 2^29
    of its group's largest is exact; smaller ones round to f16 subnormals (within 2^-39 of it)."""
    K = v.shape[-1]
    pad = -K % QBLOCK
    g = F.pad(v.float(), (0, pad)).unflatten(-1, (-1, QBLOCK))
    e = (g.abs().amax(-1).view(torch.int32) >> 23).clamp(min=16)   # the largest's biased exponent
    s = ((e - 15) << 23).view(torch.float32)
    inv = ((269 - e) << 23).view(torch.float32)
    q = (g * inv[..., None]).to(torch.float16).flatten(-2)
    return q[..., :K], s


def fp8_round_trip(v: torch.Tensor) -> torch.Tensor:
    """The fp32 values fp8 activations stand for: quantize_fp8(v) dequantized."""
    q, s = quantize_fp8(v)
    return (q.float().unflatten(-1, (-1, QBLOCK)) * s[..., None]).flatten(-2)
