"""Tensor-parallel fused tail: each rank holds a partial routed output (and a partial shared-expert output);
the sum over ranks must be formed before RMSNorm (normalizing partials, then summing, is wrong).

    partial_r = finalize(gemm2_out_r, expanded_to_permuted_r, topk_weights_r) + shared_r     (our kernel, dtype)
    z         = all_reduce_sum(partial_r)                                                   (one collective)
    out       = moe_tail(z, identity, 1, norm_weight, residual=residual, ...)              (our kernel)

The shared-expert partial rides in the same collective as the routed partial. The last step is the fused tail
kernel with K = 1 (row t of z, weight 1.0: y = z[t] exactly), so residual add, residual_out and RMSNorm (or
fp8 output) stay fused. Every rank ends with the same `out`. The partials are rounded to the activation dtype
before the collective (bf16 all-reduce, as engines do), so the result matches the single-GPU tail on the
summed inputs within bf16 rounding of the partials: tolerance 2e-2 relative to the row's RMS.

The collective is chosen by the `tail_tp` tier rule matching (tokens, hidden, world_size): params.allreduce is
  "nccl"      torch.distributed.all_reduce on `group` (NCCL on GPUs), in place;
  "symm_mem"  torch symmetric memory one-shot all-reduce (a symmetric buffer per group and dtype, sized by
              params.max_tokens and exchanged once; NVLink multicast is never used by this op).
Both are CUDA-graph capturable once warm (first call outside capture: it compiles kernels and, for
symm_mem, allocates and exchanges the buffer). Every rank must call with the same T and H.
The rules are read once per (hidden, world_size, device) into a dispatch object (`dispatch`), which also keeps the
symmetric buffers and the identity rows of the summed tail; kerngen.clear() forgets them, so a symmetric buffer is
exchanged again on its next use: a collective, so clear on every rank of the group (as tiers.reload() on each does).
"""
from __future__ import annotations

import torch

from ..dispatch import Dispatch, OpDispatch
from ..errors import InputError
from ..tiers import Rule, Table
from . import _common
from ._common import check_tensor, table
from .finalize import finalize

OP = "tail"
TP_OP = "tail_tp"
METHODS = ("nccl", "symm_mem")


def allreduce_params(tokens: int, hidden: int, world: int, tbl: Table | None = None) -> dict:
    """The `tail_tp` rule's params for this call: {"allreduce": "nccl" | "symm_mem", ...}."""
    rule = _checked((tbl or table()).rule(TP_OP, {"tokens": tokens, "hidden": hidden, "world_size": world}))
    _check_tokens(rule, tokens)
    return dict(rule.params)


def _checked(rule: Rule) -> Rule:
    """A `tail_tp` rule whose allreduce is one of METHODS (a bucket's spec in the dispatch object)."""
    if rule.params.get("allreduce") not in METHODS:
        raise InputError(TP_OP, "tier params", f"allreduce one of {', '.join(METHODS)}", str(rule.params))
    return rule


def _check_tokens(rule: Rule, tokens: int) -> None:
    if rule.params["allreduce"] == "symm_mem" and tokens > int(rule.params.get("max_tokens", 0)):
        raise InputError(TP_OP, "tier params", f"max_tokens >= {tokens} for allreduce = \"symm_mem\"",
                         str(rule.params))


def model_specs(model, tbl: Table, arch_: str) -> list:
    """No kernels of its own: the tensor-parallel tail runs finalize's and tail's, which warmup builds."""
    return []


def _dispatch(device: int, *, hidden: int, world_size: int) -> Dispatch:
    """The tensor-parallel tail of this width and world size on `device`: the `tail_tp` rules per token bucket (each
    bucket's spec is its Rule), and `kept`, the symmetric buffers per (group, dtype) and the identity rows per T."""
    return Dispatch(TP_OP, {"hidden": hidden, "world_size": world_size}, _checked, lambda rule, T, dev: rule, device)


dispatch = OpDispatch(TP_OP, _dispatch)


def _partial_buffer(d: Dispatch, group, p: dict, T: int, H: int, dtype, device) -> torch.Tensor:
    if p["allreduce"] == "nccl":
        return torch.empty((T, H), dtype=dtype, device=device)
    import torch.distributed._symmetric_memory as symm_mem
    key = ("symm", group.group_name, dtype, int(p["max_tokens"]))
    buf = d.kept.get(key)
    if buf is None:
        buf = symm_mem.empty(int(p["max_tokens"]), H, dtype=dtype, device=device)
        symm_mem.rendezvous(buf, group.group_name)
        d.kept[key] = buf
    return buf[:T]


def _all_reduce(partial: torch.Tensor, group, p: dict) -> torch.Tensor:
    import torch.distributed as dist
    if p["allreduce"] == "nccl":
        dist.all_reduce(partial, op=dist.ReduceOp.SUM, group=group)
        return partial
    return torch.ops.symm_mem.one_shot_all_reduce(partial, "sum", group.group_name)


def moe_tail_tp(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, *, group, local_tail, eps=1e-6,
                shared=None, residual=None, residual_out=None, out=None, out_dtype=None, out_scales=None):
    """moe_tail over a tensor-parallel group (module docstring); same arguments as moe_tail plus `group`, and
    `local_tail`, the single-GPU tail that runs on the summed rows (kerngen.ops.tail.moe_tail passes itself: the
    pipeline runs tail -> tail_tp, never back)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise InputError(OP, "group", "a process group of an initialized torch.distributed", "no default group")
    if not isinstance(group, dist.ProcessGroup):
        raise InputError(OP, "group", "a torch.distributed.ProcessGroup", type(group).__name__)
    check_tensor(OP, "norm_weight", norm_weight, ndim=1, device=getattr(gemm2_out, "device", None))
    check_tensor(OP, "expanded_to_permuted", expanded_to_permuted, dtypes=(torch.int32,), ndim=2,
                 device=norm_weight.device, contiguous=True)
    T, H = expanded_to_permuted.shape[0], norm_weight.shape[0]
    check_tensor(OP, "gemm2_out", gemm2_out, dtypes=(torch.bfloat16, torch.float16), ndim=2, device=norm_weight.device)
    if shared is not None:
        check_tensor(OP, "shared", shared, dtypes=(gemm2_out.dtype,), ndim=2, device=gemm2_out.device)
        if tuple(shared.shape) != (T, H):
            raise InputError(OP, "shared", f"of shape {(T, H)}", f"{tuple(shared.shape)}")
    d = dispatch(gemm2_out.get_device(), hidden=H, world_size=dist.get_world_size(group))
    rule = d.require(max(T, 1))
    _check_tokens(rule, max(T, 1))
    p = rule.params
    partial = _partial_buffer(d, group, p, T, H, gemm2_out.dtype, gemm2_out.device)
    finalize(gemm2_out, expanded_to_permuted, topk_weights, hidden=H, out=partial)
    if shared is not None:
        partial.add_(shared)
    z = _all_reduce(partial, group, p)
    ident, ones = _common.identity_rows(d.kept, T, gemm2_out.device)
    return local_tail(z, ident, ones, norm_weight, eps=eps, residual=residual, residual_out=residual_out, out=out,
                      out_dtype=out_dtype, out_scales=out_scales)
