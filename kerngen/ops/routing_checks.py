"""routing's input checks, naming the argument, and the tier table's model arguments (kerngen.ops.routing re-exports
them; PreRouting and the CPU entry points run the same ones)."""
from __future__ import annotations

import torch

from ..errors import InputError
from ..tiers import MAX_EXPERTS, MAX_TOPK, METHODS
from . import permute as permute_op
from ._common import check_int, check_local, check_tensor, table
from .routing_reference import _SIGMOID_BIAS

OP = "routing"
_LOGITS = (torch.float32, torch.bfloat16)
_BIAS = (torch.float32, torch.bfloat16)


def check_args(logits, K, method, bias=None, n_group=1, topk_group=1, renormalize=True, tile=None,
               local_experts=None, rsf=1.0, *, cuda: bool = True) -> None:
    """Every check of `route`'s arguments, naming the argument; shape and scalar checks come before the device
    check (skipped with cuda=False: the CPU entry points that run the reference validate the same way)."""
    check_tensor(OP, "logits", logits, dtypes=_LOGITS, ndim=2, device=getattr(logits, "device", None))
    if logits.stride(1) != 1:
        raise InputError(OP, "logits", "row-major with a contiguous last dim", f"strides {logits.stride()}")
    T, E = logits.shape
    if not 1 <= E <= MAX_EXPERTS:
        raise InputError(OP, "logits", f"[T, E] with 1 <= E <= {MAX_EXPERTS}", f"E = {E}")
    if method not in METHODS:
        raise InputError(OP, "method", f"one of {', '.join(METHODS)} (or give model=)", repr(method))
    check_int(OP, "top_k", K, 1, min(MAX_TOPK, E))
    if method == "top1_sigmoid" and K != 1:
        raise InputError(OP, "top_k", "1 for method 'top1_sigmoid'", repr(K))
    check_int(OP, "n_group", n_group, 1, E)
    if E % n_group:
        raise InputError(OP, "n_group", f"a divisor of the expert count {E}", repr(n_group))
    check_int(OP, "topk_group", topk_group, 1, n_group)
    if method == "grouped_sigmoid_bias":
        if K > topk_group * (E // n_group):
            raise InputError(OP, "top_k", f"at most topk_group * E / n_group = {topk_group * (E // n_group)}", repr(K))
    elif n_group != 1 or topk_group != 1:
        raise InputError(OP, "n_group", "1 (and topk_group 1) unless method is 'grouped_sigmoid_bias'",
                         f"n_group={n_group}, topk_group={topk_group}")
    if not isinstance(renormalize, bool):
        raise InputError(OP, "renormalize", "True or False", repr(renormalize))
    if bias is not None:
        if method not in _SIGMOID_BIAS:
            raise InputError(OP, "bias", "None for method " + repr(method), "a tensor")
        check_tensor(OP, "bias", bias, dtypes=_BIAS, ndim=1, device=logits.device, contiguous=True)
        if bias.shape[0] != E:
            raise InputError(OP, "bias", f"of length {E} (one per expert)", f"length {bias.shape[0]}")
    _check_unkeyed(tile, local_experts, rsf, E)
    if T * K >= 2**31 - 1:
        raise InputError(OP, "logits", "fewer than 2**31 / K tokens", f"T = {T}")
    if cuda:
        check_tensor(OP, "logits", logits)


def _check_unkeyed(tile, local_experts, rsf, E) -> tuple[int, int]:
    """The arguments route's kernel cache does not key on, so checked on every call; (local_start, num_local)."""
    if tile is not None and (type(tile) is not int or not 1 <= tile <= permute_op.MAX_TILE):
        check_int(OP, "tile", tile, 1, permute_op.MAX_TILE)
    ls_nl = (0, E) if local_experts is None else check_local(OP, local_experts, E)
    if not (isinstance(rsf, (int, float)) and not isinstance(rsf, bool) and 0 < rsf < float("inf")):
        raise InputError(OP, "routed_scaling_factor", "a positive finite number", repr(rsf))
    return ls_nl


_KINDS = {"top_k": int, "method": str, "n_group": int, "topk_group": int, "routed_scaling_factor": (int, float),
          "renormalize": bool}   # what model_args compares with the model's value (only renormalize a bool)


def model_args(name, top_k, method, n_group, topk_group, rsf, renormalize, logits=None) -> tuple:
    """route's (top_k, method, n_group, topk_group, routed_scaling_factor, renormalize) from model `name` of
    the tier table; an explicit value that disagrees with the model is an InputError, and so are `logits` whose
    expert count is not the model's."""
    if not isinstance(name, str):
        raise InputError(OP, "model", "a model name of the tier table (a str)", repr(name))
    m = table().model(name)
    given = {"top_k": (top_k, m.top_k, None), "method": (method, m.routing, None),
             "n_group": (n_group, m.n_group, 1), "topk_group": (topk_group, m.topk_group, 1),
             "routed_scaling_factor": (rsf, m.routed_scaling_factor, 1.0),
             "renormalize": (renormalize, m.renormalize, True)}
    for arg, (v, want, default) in given.items():   # of the value's kind first: a tensor is not compared
        if v is not None and (not isinstance(v, _KINDS[arg]) or isinstance(v, bool) != (arg == "renormalize")
                              or v != default and v != want):
            raise InputError(OP, arg, f"{want!r} as model '{name}' says (or left out)", repr(v))
    if isinstance(logits, torch.Tensor) and logits.dim() == 2 and logits.shape[1] != m.num_experts:
        raise InputError(OP, "logits", f"[T, {m.num_experts}] (model '{name}' has {m.num_experts} experts)",
                         f"shape {tuple(logits.shape)}")
    return m.top_k, m.routing, m.n_group, m.topk_group, m.routed_scaling_factor, m.renormalize
