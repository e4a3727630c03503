"""torch.ops.kerngen.moe_experts: a block's routed experts (permute, kerngen.experts, finalize) as a torch custom op
(kerngen/torch_ops.py says how they behave)."""
from __future__ import annotations

import torch
from torch import Tensor

from ..dispatch import check_env
from ..errors import InputError
from . import _common
from . import experts as _ex
from . import finalize as _fin
from . import permute as _pm
from ._torch import concrete, dims, one_device


@torch.library.custom_op("kerngen::moe_experts", mutates_args=(), device_types="cuda")
def moe_experts(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor, activation: str,
                b13: Tensor | None = None, b2: Tensor | None = None, w13_scale: Tensor | None = None,
                w2_scale: Tensor | None = None, interleaved: bool = False, alpha: float = 1.702,
                limit: float = 7.0, fp8_activations: bool = False) -> Tensor:
    """A block's routed experts and their weighted sum, [T, H] bf16: the permutation of topk_ids at the tile of
    the experts kernels' rule for T tokens (1 where none serves), kerngen.experts, kerngen.finalize (fp32 sums,
    k ascending). Arguments as kerngen.experts takes them (x bf16, w13 [E, 2I, H], w2 [E, H, I], bf16 / fp8 /
    MXFP4 weights with their scales; bf16 ones may be the transposed views of [E, H, 2I] / [E, I, H]; gpt-oss's
    gate: interleaved, alpha, limit; fp8 weights: fp8_activations, the w8a8 path). fp8 and MXFP4 token counts no
    rule serves read which experts were hit on the host (not capturable)."""
    _dims(x, topk_ids, w13, w2)
    E, T = w13.shape[0], x.shape[0]
    ids = _ids(topk_ids, "topk_ids")
    _check_weights(topk_weights, ids, x)
    tile = _tile(x, w13, w2, activation, fp8_activations, ids.shape[1])
    # one allocation for the whole permutation (two fills: -1 and the ticket's 0), not one a view: its views stay
    # inside this op, and each fill is a kernel of its own in the caller's CUDA graph
    ws = _pm.RoutingWorkspace(max(T, 1), E, ids.shape[1], tile, device=x.device)
    r = _pm.permute(ids, num_experts=E, tile=tile, workspace=ws)
    rows = r.permuted_to_token.shape[0]
    g = x.new_empty((rows, x.shape[1]), dtype=torch.bfloat16)
    scratch = x.new_empty((rows, w13.shape[1] // 2), dtype=torch.bfloat16)   # [rows, I] in every format
    _ex.experts(x, r, w13, w2, activation=activation, b13=b13, b2=b2, w13_scale=w13_scale, w2_scale=w2_scale,
                interleaved=interleaved, alpha=alpha, limit=limit, out=g, scratch=scratch,
                fp8_activations=fp8_activations)
    return _fin.finalize(g, r.expanded_to_permuted, _weights(topk_weights))


def _dims(x, topk_ids, w13, w2) -> None:
    """The ranks every implementation reads shapes from (w13 / w2: [E, N, K] bf16 or fp8, [E, N, K / 32, 16] MXFP4);
    the rest is kerngen.experts' checks."""
    try:   # the common case in one expression (a host cost of each eager call)
        if x.dim() == 2 and topk_ids.dim() == 2 and 3 <= w13.dim() <= 4 and 3 <= w2.dim() <= 4:
            return
    except AttributeError:
        pass
    dims("moe_experts", x=(x, (2,)), topk_ids=(topk_ids, (2,)), w13=(w13, (3, 4)), w2=(w2, (3, 4)))


def _shape_routing(ids: Tensor, w: Tensor, E: int):
    """A tile-1 permutation of ids' shapes, its tensors empty: what kerngen.experts' checks read of a routing (they
    read no data), for the shape-only implementation."""
    T, K = ids.shape

    def empty(*shape):
        return ids.new_empty(shape, dtype=torch.int32)
    return _pm.Routing(ids, w, empty(E), empty(E + 1), empty(T, K), empty(T * K), empty(T * K), empty(), tile=1)


def _ids(topk_ids: Tensor, name: str) -> Tensor:
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise InputError("moe_experts", name, "int32 or int64 expert ids [T, K]", str(topk_ids.dtype))
    return topk_ids.to(torch.int32).contiguous()


def _check_weights(w, ids: Tensor, x: Tensor) -> None:
    """topk_weights: a floating [T, K] tensor like topk_ids, on x's device (the CPU and CUDA paths alike)."""
    if not isinstance(w, Tensor):
        raise InputError("moe_experts", "topk_weights", "a torch.Tensor", type(w).__name__)
    if not w.is_floating_point():
        raise InputError("moe_experts", "topk_weights", "a floating-point tensor (fp32 or bf16)", str(w.dtype))
    if tuple(w.shape) != tuple(ids.shape):
        raise InputError("moe_experts", "topk_weights", f"of shape {tuple(ids.shape)} like topk_ids",
                         f"shape {tuple(w.shape)}")
    if w.device != x.device:
        raise InputError("moe_experts", "topk_weights", f"on {x.device} (same device as x)", str(w.device))


def _weights(w: Tensor) -> Tensor:
    return (w if w.dtype in (torch.float32, torch.bfloat16) else w.float()).contiguous()


def _tile(x: Tensor, w13: Tensor, w2: Tensor, activation: str, a8: bool = False, top_k: int = 0) -> int:
    """The tile of the experts kernels' rule for these tokens, weights and top-k (1 where none serves them)."""
    if w13.dtype not in _ex.FORMATS or x.device.type not in _common.KERNEL_DEVICES:
        return 1
    a8 = a8 is True and _ex.FORMATS[w13.dtype] == "fp8"   # anything else is experts()' error to raise
    I = w13.shape[1] // 2   # w13 [E, 2I, ...] in every format (w2's last dims are I/32, 16 for MXFP4)
    fmt = _ex.FORMATS[w13.dtype]
    return _ex.tile_for(x.shape[1], I, activation, x.shape[0], x.get_device(), fmt,
                        _ex.weights_layout(w13, w2, fmt), a8, w13.shape[0], top_k) or 1


@moe_experts.register_kernel("cpu")
def _moe_experts_cpu(x, topk_ids, topk_weights, w13, w2, activation, b13=None, b2=None, w13_scale=None,
                     w2_scale=None, interleaved=False, alpha=1.702, limit=7.0, fp8_activations=False):
    check_env()
    _dims(x, topk_ids, w13, w2)
    ids = _ids(topk_ids, "topk_ids")
    _check_weights(topk_weights, ids, x)
    r = _pm.Routing(ids, topk_weights, **_pm.permute_reference(ids, w13.shape[0], 1), tile=1)
    kw = dict(activation=activation, b13=b13, b2=b2, w13_scale=w13_scale, w2_scale=w2_scale, interleaved=interleaved,
              alpha=alpha, limit=limit, fp8_activations=fp8_activations)
    _ex.check(x, r, w13, w2, cuda=False, **kw)   # kerngen.experts' checks, its device check aside
    g = _ex.reference(x, r, w13, w2, **kw)
    return _fin.reference(g, r.expanded_to_permuted, _weights(topk_weights))


@moe_experts.register_fake
def _moe_experts_fake(x, topk_ids, topk_weights, w13, w2, activation, b13=None, b2=None, w13_scale=None,
                      w2_scale=None, interleaved=False, alpha=1.702, limit=7.0, fp8_activations=False):
    _dims(x, topk_ids, w13, w2)
    one_device("experts", x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2, b13=b13, b2=b2,
               w13_scale=w13_scale, w2_scale=w2_scale)
    ids = _ids(topk_ids, "topk_ids")
    _check_weights(topk_weights, ids, x)
    if concrete(x, ids, w13, w2, b13, b2, w13_scale, w2_scale):
        _ex.check(x, _shape_routing(ids, topk_weights, w13.shape[0]), w13, w2, activation=activation, b13=b13, b2=b2,
                  w13_scale=w13_scale, w2_scale=w2_scale, interleaved=interleaved, alpha=alpha, limit=limit,
                  fp8_activations=fp8_activations, cuda=False)
    return x.new_empty((topk_ids.shape[0], x.shape[1]), dtype=torch.bfloat16)
