"""tail: the fused MoE layer tail, one CuTe DSL kernel (templates/tail/tail.py).

    y            = finalize(gemm2_out, expanded_to_permuted, topk_weights)  (fp32, never written)
                   + shared (optional) + residual (optional)
    residual_out = y.to(dtype)                                              (optional)
    n            = y * rstd(y) * norm_weight,  rstd(y) = rsqrt(mean(y^2) + eps)  (fp32)
    out          = n.to(out_dtype)                                        (bf16 / fp16)

fp8 output (out_dtype=torch.float8_e4m3fn) is the per-token, per-128-column activation quantization of
DeepSeek-V3 (what its fp8 GEMMs consume). H must be a multiple of 128. For token t and block b (columns
128b .. 128b+127), quantized from the fp32 n itself (n is NOT rounded to bf16 first):

    scales[t, b] = max(amax(|n[t, block b]|), 1e-12) / 448                           (fp32)
    out[t, c]    = (n[t, c] / scales[t, b]) -> float8_e4m3fn, round to nearest even, saturated to +-448

so out * scales (broadcast over each block) dequantizes. scales is [T, H // 128] fp32, row-major, the layout
DeepSeek-V3's act_quant produces (DeepGEMM takes it transposed to a column-major, TMA-aligned copy).
The kernel divides with IEEE fp32 division, as the reference does, so the two differ only where their n
differ (FMA and summation order, ~1e-7 relative): scales agree to a few 1e-7 relative, and q bitwise except
where n / scale lies that close to an e4m3 rounding boundary (one e4m3 step apart there). A NaN in y makes
the row's rstd, scales and values NaN, as it makes the bf16 output NaN.

This module plans and launches; the reference is tail_reference.py's, the input checks tail_checks.py's (both
re-exported here).
"""
from __future__ import annotations

import torch

from .. import plan as plan_mod
from ..errors import InputError
from ..dispatch import Dispatch, OpDispatch
from ..tiers import Model, Rule, Table
from ._common import DTYPE_NAMES, SHORT, arch, check_aligned, check_buffer, check_eps, resolve, table
# the reference and the checks live in modules of their own; re-exported here
from .tail_checks import MAX_K, _ACT, _OUT, _W, check_args  # noqa: F401
from .tail_reference import FP8, FP8_BLOCK, FP8_MAX, SCALE_FLOOR, quantize_fp8, reference  # noqa: F401
from .tail_tp import moe_tail_tp

OP = "tail"
_NAMES = {**DTYPE_NAMES, FP8: "float8_e4m3fn"}
_SHORT = {**SHORT, "float8_e4m3fn": "e4m3"}
# Flag sets `kerngen warmup` builds for every model: (shared, residual, residual_out). The pre-norm residual
# stream of DeepSeek/Kimi/GLM/Qwen3-Next/Llama-4 (shared expert + residual, with and without writing the
# new residual), with the model's dtype as output. Other combinations, fp8 output among them, compile on
# first use (fp8 variants for every model would double warmup's compile time).
WARMUP_FLAGS = ((True, True, False), (True, True, True))


def _tag(H, K, dtype, wdtype, odtype, flags):
    s, r, ro = (int(f) for f in flags)
    return f"H{H}-K{K}-{SHORT[dtype]}-w{SHORT[wdtype]}-o{_SHORT[odtype]}-s{s}r{r}ro{ro}"


def _constants(H, K, dtype, wdtype, odtype, flags):
    return {"H": H, "K": K, "DTYPE": dtype, "WDTYPE": wdtype, "ODTYPE": odtype, "SHARED": bool(flags[0]),
            "RESIDUAL": bool(flags[1]), "RESIDUAL_OUT": bool(flags[2])}


def spec(hidden: int, top_k: int, dtype: str, weights_dtype: str, out_dtype: str, flags: tuple, tokens: int,
         arch_: str, tbl: Table | None = None) -> plan_mod.KernelSpec:
    """flags = (has_shared, has_residual, has_residual_out)."""
    shape = {"hidden": hidden, "top_k": top_k, "tokens": tokens}
    return plan_mod.plan(tbl or table(), OP, shape, _tag(hidden, top_k, dtype, weights_dtype, out_dtype, flags),
                         _constants(hidden, top_k, dtype, weights_dtype, out_dtype, flags), arch_)


def rule_spec(rule: Rule, hidden: int, top_k: int, dtype: str, weights_dtype: str, out_dtype: str, flags: tuple,
              arch_: str) -> plan_mod.KernelSpec:
    """The tail kernel of `rule` (a tier rule, or launch parameters the tuner or a sweep tries) for this shape."""
    args = (hidden, top_k, dtype, weights_dtype, out_dtype, flags)
    return plan_mod.spec_for(rule, _tag(*args), _constants(*args), arch_)


def params_spec(params: dict, hidden: int, top_k: int, dtype: str, weights_dtype: str, out_dtype: str, flags: tuple,
                arch_: str) -> plan_mod.KernelSpec:
    """The tail kernel with explicit launch parameters, outside the tier table."""
    return rule_spec(Rule(op=OP, variant="tail", ranges={}, params=params), hidden, top_k, dtype, weights_dtype,
                     out_dtype, flags, arch_)


def model_specs(model: Model, tbl: Table, arch_: str) -> list[plan_mod.KernelSpec]:
    """The tail kernels of `model` over its token range, for each flag set of WARMUP_FLAGS."""
    shape = {"hidden": model.hidden, "top_k": model.top_k, "num_experts": model.num_experts, "arch": arch_}
    return [rule_spec(rule, model.hidden, model.top_k, model.dtype, model.weights_dtype, model.dtype, flags, arch_)
            for rule in tbl.rules_for(OP, shape, model.tokens) for flags in WARMUP_FLAGS]


def explain_spec(tbl: Table, arch_: str, *, hidden: int, top_k: int, tokens: int, dtype: str = "bfloat16",
                 weights_dtype: str = "float32", **_shape) -> plan_mod.KernelSpec:
    """`kerngen explain --op tail`: the shared + residual kernel (no residual_out) of that shape, output in
    `dtype`; other shape keywords (experts, model) do not apply."""
    return spec(hidden, top_k, dtype, weights_dtype, dtype, (True, True, False), tokens, arch_, tbl)


def kernel(s: plan_mod.KernelSpec, tokens: int = 0, device: int | None = None):
    """The CuTe DSL function of spec `s` (TVM-FFI, on tensors of any token count, torch's current stream);
    `tokens` and `device` complete the ops' common signature and change nothing here."""
    return resolve(s)


def _dispatch(device: int, *, hidden: int, top_k: int, dtype: str, weights_dtype: str, out_dtype: str,
              flags: tuple) -> Dispatch:
    """The tail kernels of this shape, dtypes and flags on `device`, per token bucket of the tier table."""
    args, a = (hidden, top_k, dtype, weights_dtype, out_dtype, flags), arch(device)
    return Dispatch(OP, {"hidden": hidden, "top_k": top_k}, lambda rule: rule_spec(rule, *args, a), kernel, device,
                    arch=a, per_token=False)


dispatch = OpDispatch(OP, _dispatch)
_calls = dispatch.calls   # input signature -> (function, T, H, out dtype, g stand-in, device, fp8 blocks)


def _sig(t):
    return None if t is None else (t.dtype, t.shape, t.stride(), t.device)


def moe_tail(gemm2_out: torch.Tensor, expanded_to_permuted: torch.Tensor, topk_weights: torch.Tensor,
             norm_weight: torch.Tensor, *, eps: float = 1e-6, shared: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, residual_out: torch.Tensor | None = None,
             out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
             out_scales: torch.Tensor | None = None,
             group=None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """finalize + shared + residual + RMSNorm in one kernel (CUDA tensors only; on the CPU: `reference`, or
    torch.ops.kerngen.moe_tail); returns out [T, H] (out_dtype, default gemm2_out's),
    or (out, scales) for out_dtype=torch.float8_e4m3fn (semantics and scale layout: module docstring).

    gemm2_out: [rows, ld] bf16/fp16, ld >= H (padded rows allowed, last dim contiguous, 16-byte aligned).
    expanded_to_permuted: [T, K] int32 (K <= 32); -1 or any value outside [0, rows) contributes nothing.
    topk_weights: [T, K] fp32 or bf16. norm_weight: [H] in gemm2_out's dtype; H = norm_weight's length.
    shared, residual: optional [T, H] contiguous, gemm2_out's dtype. residual_out: optional [T, H] buffer that
    receives y (the pre-norm sum) in gemm2_out's dtype; it may be `residual` itself (updated in place).
    out_dtype: None, torch.bfloat16, torch.float16, or torch.float8_e4m3fn (H a multiple of 128).
    out: optional [T, H] contiguous buffer of out_dtype. out_scales: optional [T, H // 128] contiguous fp32
    buffer for the fp8 scales (fp8 output only). Both are returned as given (use them in CUDA graphs).
    group: a torch.distributed ProcessGroup for tensor parallelism: gemm2_out / topk_weights / shared are this
    rank's partials, summed over the group before the norm (kerngen/ops/tail_tp.py); every rank gets `out`.
    All of it is CUDA-graph capturable; the kernel runs on torch's current stream.
    """
    if group is not None:
        return moe_tail_tp(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, group=group,
                           local_tail=moe_tail, eps=eps, shared=shared, residual=residual, residual_out=residual_out,
                           out=out, out_dtype=out_dtype, out_scales=out_scales)
    g, e2p, w, nw = gemm2_out, expanded_to_permuted, topk_weights, norm_weight
    if eps.__class__ is not float or not 0.0 <= eps < _INF:   # (a float in range passes with one test)
        check_eps(OP, eps)
    try:  # the signature pins everything the full checks establish, except alignment (the kernel checks it)
        sig = (g.dtype, g.shape, g.stride(), g.device, e2p.dtype, e2p.shape, e2p.stride(), e2p.device,
               w.dtype, w.shape, w.stride(), w.device, nw.dtype, nw.shape, nw.stride(), nw.device,
               _sig(shared), _sig(residual), _sig(residual_out), out_dtype)
        hit = _calls.get(sig)
    except (AttributeError, TypeError):   # not tensors, or an unhashable out_dtype: _prepare names the argument
        sig, hit = None, None
    if hit is None:
        hit = _calls.remember(sig, _prepare(g, e2p, w, nw, shared, residual, residual_out, out_dtype))
    fn, T, H, odt, g_arg, dev, blocks = hit
    if out is None:
        out = torch.empty((T, H), dtype=odt, device=g.device)
    elif out.dtype != odt or out.shape != (T, H) or not out.is_contiguous() or out.device != g.device:
        check_buffer(OP, "out", out, odt, (T, H), g.device)
    scales = out_scales
    if blocks:
        if scales is None:
            scales = torch.empty((T, blocks), dtype=torch.float32, device=g.device)
        elif (scales.dtype != torch.float32 or scales.shape != (T, blocks) or not scales.is_contiguous()
              or scales.device != g.device):
            check_buffer(OP, "out_scales", scales, torch.float32, (T, blocks), g.device)
    elif scales is not None:
        raise InputError(OP, "out_scales", "None unless out_dtype is torch.float8_e4m3fn",
                         f"a {type(scales).__name__} with out_dtype {odt}")
    if T:
        try:
            fn(g if g_arg is None else (g_arg if g_arg is not True else g[:, :H]), e2p, w, shared, residual, nw, out,
               scales, residual_out, eps)
        except (ValueError, TypeError, RuntimeError):
            for name, t in (("gemm2_out", g), ("expanded_to_permuted", e2p), ("topk_weights", w),
                            ("norm_weight", nw), ("shared", shared), ("residual", residual), ("out", out),
                            ("residual_out", residual_out)):
                if t is not None:
                    check_aligned(OP, name, t)
            if scales is not None:
                check_aligned(OP, "out_scales", scales, 4)
            raise
    return (out, scales) if blocks else out


def _prepare(g, e2p, w, nw, shared, residual, residual_out, out_dtype) -> tuple:
    check_args(g, e2p, w, nw, shared, residual, residual_out, out_dtype)
    T, K = e2p.shape
    H = nw.shape[0]
    odt = out_dtype or g.dtype
    dev = g.get_device()
    flags = (shared is not None, residual is not None, residual_out is not None)
    d = dispatch(dev, hidden=H, top_k=K, dtype=_NAMES[g.dtype], weights_dtype=_NAMES[w.dtype], out_dtype=_NAMES[odt],
                 flags=flags)
    fn = d.served(T)
    # the kernel loads row 0 for skipped slots (no branch around loads): give it a row when gemm2_out has none
    g_arg = torch.zeros(1, H, dtype=g.dtype, device=g.device) if not g.shape[0] else (True if g.shape[1] != H else None)
    return fn, T, H, odt, g_arg, dev, H // FP8_BLOCK if odt == FP8 else 0


_INF = float("inf")
