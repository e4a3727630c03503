"""finalize: gather each token's top-k expert output rows, weight them, reduce in fp32 (k ascending).

    out[t, :] = sum_k  w[t, k] * gemm2_out[expanded_to_permuted[t, k], :H]      (index -1 skipped)

This module plans and launches; the reference is finalize_reference.py's, the input checks finalize_checks.py's
(both re-exported here).
"""
from __future__ import annotations

import torch

from .. import plan as plan_mod
from ..errors import InputError
from ..dispatch import Dispatch, OpDispatch, rule_spec
from ..launch import Launcher, Params, current_stream
from ..tiers import BACKENDS, Model, Table
from ._common import SHORT, DTYPE_NAMES, arch, check_buffer, resolve, table
# the reference and the checks live in modules of their own; re-exported here
from .finalize_checks import MAX_K, _ACT, _W, check_args  # noqa: F401
from .finalize_reference import reference  # noqa: F401

OP = "finalize"
CUTE_MAX_K = 32   # templates/finalize/cute.py keeps a token's indices and weights in registers
# struct Params of templates/finalize/_finalize.cuh.j2 (`in_`: the C field `in`, a Python keyword)
PARAMS = Params(("in_", "ptr"), ("idx", "ptr"), ("w", "ptr"), ("out", "ptr"), ("ld", "int"), ("rows", "int"),
                ("tokens", "int"))


def spec(hidden: int, top_k: int, dtype: str, weights_dtype: str, tokens: int, arch_: str,
         tbl: Table | None = None) -> plan_mod.KernelSpec:
    shape = {"hidden": hidden, "top_k": top_k, "tokens": tokens}
    return plan_mod.plan(tbl or table(), OP, shape, *tag_constants(hidden, top_k, dtype, weights_dtype), arch_)


def tag_constants(hidden: int, top_k: int, dtype: str, weights_dtype: str) -> tuple[str, dict]:
    """The readable tag and compile-time constants of a finalize kernel (the rule adds its params)."""
    return (f"H{hidden}-K{top_k}-{SHORT[dtype]}-w{SHORT[weights_dtype]}",
            {"H": hidden, "K": top_k, "DTYPE": dtype, "WDTYPE": weights_dtype})


def model_specs(model: Model, tbl: Table, arch_: str) -> list[plan_mod.KernelSpec]:
    """Every finalize kernel `model` can dispatch to over its token range."""
    shape = {"hidden": model.hidden, "top_k": model.top_k, "num_experts": model.num_experts, "arch": arch_}
    tag_consts = tag_constants(model.hidden, model.top_k, model.dtype, model.weights_dtype)
    return [plan_mod.spec_for(rule, *tag_consts, arch_) for rule in tbl.rules_for(OP, shape, model.tokens)]


def explain_spec(tbl: Table, arch_: str, *, hidden: int, top_k: int, tokens: int, dtype: str = "bfloat16",
                 weights_dtype: str = "float32", **_shape) -> plan_mod.KernelSpec:
    """The kernel `kerngen explain/warmup --op finalize` names; other shape keywords (experts, model) do not apply."""
    return spec(hidden, top_k, dtype, weights_dtype, tokens, arch_, tbl)


class _Cute:
    """A CuTe DSL finalize (templates/finalize/cute.py): a TVM-FFI function of tensors on torch's current stream."""
    __slots__ = ("fn",)

    def __init__(self, s: plan_mod.KernelSpec):
        self.fn = resolve(s)

    def run(self, g, e2p, w, out, H):
        if not g.shape[0]:   # no rows: every slot is skipped
            out.zero_()
        else:
            self.fn(g if g.shape[1] == H else g[:, :H], e2p, w, out)


def kernel(s: plan_mod.KernelSpec, tokens: int, device: int) -> Launcher | _Cute:
    """The kernel of spec `s` for `tokens` tokens: a driver Launcher (CUDA C++) or a CuTe DSL function."""
    c = dict(s.constants)
    if (s.variant == "cute") == BACKENDS[s.backend].jinja:   # the CuTe DSL variant, and only it, is a module
        raise InputError(OP, "tier variant", "cute with backend = \"cute\" (the others: nvrtc)", s.variant)
    if s.variant == "cute":
        if c["K"] > CUTE_MAX_K:
            raise InputError(OP, "top_k", f"at most {CUTE_MAX_K} for the CuTe DSL variant (tier {s.params})",
                             str(c["K"]))
        return _Cute(s)
    p = dict(s.params)
    vecs, k = c["H"] // 8, c["K"]
    if s.variant == "small_batch":
        bx, lpg = p["block_x"], p["loads_per_group"]
        grid, block = ((vecs + bx - 1) // bx, tokens, 1), (bx, (k + lpg - 1) // lpg, 1)
    elif s.variant == "large_batch":
        vpt = p["vectors_per_thread"]
        grid, block = (tokens, 1, 1), ((vecs + vpt - 1) // vpt, 1, 1)
    else:
        raise InputError(OP, "tier variant", "small_batch, large_batch or cute", s.variant)
    if block[0] * block[1] > 1024:
        raise InputError(OP, "tier params", "a block of at most 1024 threads", f"{block} from {s.params}")
    return Launcher(resolve(s), f"{OP}_{s.variant}", device, grid, block, PARAMS, pdl=bool(p.get("pdl", False)))


def _dispatch(device: int, *, hidden: int, top_k: int, dtype: str, weights_dtype: str) -> Dispatch:
    """The finalize kernels of this shape and dtypes on `device`, per token bucket of the tier table."""
    a = arch(device)
    return Dispatch(OP, {"hidden": hidden, "top_k": top_k},
                    rule_spec(tag_constants(hidden, top_k, dtype, weights_dtype), a), kernel, device, arch=a)


dispatch = OpDispatch(OP, _dispatch)
_calls = dispatch.calls   # full input signature -> (launcher, T, H, ld, rows, device)


def finalize(gemm2_out: torch.Tensor, expanded_to_permuted: torch.Tensor, topk_weights: torch.Tensor, *,
             hidden: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Weighted sum of each token's top-k expert rows; returns out [T, H] in gemm2_out's dtype. CUDA tensors
    only (on the CPU: `reference`, or torch.ops.kerngen.finalize).

    gemm2_out: [rows, ld] bf16/fp16 with ld >= H (padded rows allowed; last dim contiguous).
    expanded_to_permuted: [T, K] int32 row of gemm2_out per (token, k); -1 (or any value outside
    [0, rows)) contributes nothing. topk_weights: [T, K] fp32 or bf16.
    """
    g, e2p, w = gemm2_out, expanded_to_permuted, topk_weights
    try:  # the signature pins every property the checks establish, except the data_ptr alignment
        sig = (g.dtype, g.shape, g.stride(), e2p.dtype, e2p.shape, e2p.stride(), w.dtype, w.shape, w.stride(),
               g.get_device(), e2p.get_device(), w.get_device(), hidden)
        hit = _calls.get(sig)
    except (AttributeError, TypeError):   # not tensors, or an unhashable hidden: _prepare names the argument
        sig, hit = None, None
    g_ptr = g.data_ptr() if hit is not None else 1
    if g_ptr % 16:
        hit = _calls.remember(sig, _prepare(g, e2p, w, hidden))
        g_ptr = g.data_ptr()
    launcher, T, H, ld, rows, dev = hit
    if out is None:
        out = torch.empty((T, H), dtype=g.dtype, device=g.device)
    elif (out.dtype != g.dtype or out.shape != (T, H) or out.get_device() != dev or not out.is_contiguous()
          or out.data_ptr() % 16):
        check_buffer(OP, "out", out, g.dtype, (T, H), g.device, align=16)
    if T:
        if type(launcher) is Launcher:
            launcher.launch(current_stream(dev), in_=g_ptr, idx=e2p.data_ptr(), w=w.data_ptr(), out=out.data_ptr(),
                            ld=ld, rows=rows, tokens=T)
        else:
            launcher.run(g, e2p, w, out, H)
    return out


def bound(launcher: Launcher | _Cute, g, e2p, w, out, H: int):
    """A call of `launcher` on these tensors with nothing left to check: `call(stream)` (the stream is
    torch's current one for a CuTe function, whatever is passed)."""
    if type(launcher) is Launcher:
        return launcher.bind(in_=g.data_ptr(), idx=e2p.data_ptr(), w=w.data_ptr(), out=out.data_ptr(), ld=g.stride(0),
                             rows=g.shape[0], tokens=e2p.shape[0])
    return lambda stream: launcher.run(g, e2p, w, out, H)


class Prepared:
    """finalize of fixed tensors, validated once: `run()` launches on torch's current stream.

    For engines that reuse the same buffers every step (as CUDA graphs require anyway): a call costs the
    stream lookup and one driver launch (a CuTe DSL variant: one TVM-FFI call), with no per-call argument
    checks. The tensors are held here and must keep their storage (no resize_, no set_) for as long as this
    object is used.
    """
    __slots__ = ("out", "_tensors", "_bound", "_device", "_tokens")

    def __init__(self, g, e2p, w, hidden, out):
        launcher, T, H, _, _, dev = _prepare(g, e2p, w, hidden)
        if out is None:
            out = torch.empty((T, H), dtype=g.dtype, device=g.device)
        check_buffer(OP, "out", out, g.dtype, (T, H), g.device, align=16)
        self.out, self._tensors, self._device, self._tokens = out, (g, e2p, w), dev, T
        self._bound = bound(launcher, g, e2p, w, out, H)

    def run(self) -> torch.Tensor:
        if self._tokens:
            self._bound(current_stream(self._device))
        return self.out


def prepare(gemm2_out: torch.Tensor, expanded_to_permuted: torch.Tensor, topk_weights: torch.Tensor, *,
            hidden: int | None = None, out: torch.Tensor | None = None) -> Prepared:
    """Validate once and bind the kernel to these tensors; `prepared.run()` is then finalize(...) with the
    least host cost (see Prepared). Same arguments and errors as `finalize`."""
    return Prepared(gemm2_out, expanded_to_permuted, topk_weights, hidden, out)


def _prepare(g, e2p, w, hidden) -> tuple:
    check_args(g, e2p, w, hidden)
    T, K = e2p.shape
    H = g.shape[1] if hidden is None else hidden
    dev = g.get_device()
    d = dispatch(dev, hidden=H, top_k=K, dtype=DTYPE_NAMES[g.dtype], weights_dtype=DTYPE_NAMES[w.dtype])
    launcher = d.served(T)
    return launcher, T, H, g.stride(0), g.shape[0], dev
