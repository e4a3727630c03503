"""torch custom ops: kerngen::finalize, kerngen::route, kerngen::route_permute, kerngen::moe_align_block_size,
kerngen::moe_tail, kerngen::latent_tail, kerngen::moe_experts.

They trace under torch.compile(fullgraph=True) (fake implementations give output shapes) and capture in
CUDA graphs. A CPU implementation (the torch reference) lets pipelines run and be checked on the CPU.
Every tensor a call uses is its own (no workspace, scratch or prototype kept between calls): torch.compile's CUDA
graphs own the memory their calls allocate and reuse it once the call's outputs are dead.
Calling kerngen.finalize / route / moe_tail directly is cheaper on the host (no dispatcher).
"""
from __future__ import annotations

import torch
from torch import Tensor

from .dispatch import check_env
from .errors import InputError
from .ops import _common
from .ops import experts as _ex
from .ops import finalize as _fin
from .ops import latent_tail as _lt
from .ops import permute as _pm
from .ops import routing as _rt
from .ops import tail as _tail


def _one_device(op: str, **tensors) -> None:
    """The shape-only implementations (torch.compile's tracing, meta tensors) see the call's devices: tensors on two
    devices (a meta tensor beside CPU ones, say) are the kernels' own InputError (check_tensor's device check) naming
    the first that differs, instead of an output of no device's making."""
    given = [(name, t) for name, t in tensors.items() if t is not None]
    for name, t in given[1:]:
        _common.check_tensor(op, name, t, device=given[0][1].device)


# ------------------------------------------------------------------------------------------------ finalize
@torch.library.custom_op("kerngen::finalize", mutates_args=(), device_types="cuda")
def finalize(gemm2_out: Tensor, expanded_to_permuted: Tensor, topk_weights: Tensor,
             hidden: int | None = None) -> Tensor:
    return _fin.finalize(gemm2_out, expanded_to_permuted, topk_weights, hidden=hidden)


@finalize.register_kernel("cpu")
def _finalize_cpu(gemm2_out, expanded_to_permuted, topk_weights, hidden=None):
    check_env()
    _fin.check_args(gemm2_out, expanded_to_permuted, topk_weights, hidden, cuda=False)
    return _fin.reference(gemm2_out, expanded_to_permuted, topk_weights, hidden)


@finalize.register_fake
def _finalize_fake(gemm2_out, expanded_to_permuted, topk_weights, hidden=None):
    _one_device("finalize", gemm2_out=gemm2_out, expanded_to_permuted=expanded_to_permuted, topk_weights=topk_weights)
    H = gemm2_out.shape[1] if hidden is None else hidden
    return gemm2_out.new_empty((expanded_to_permuted.shape[0], H))


# ------------------------------------------------------------------------------------------------- routing
@torch.library.custom_op("kerngen::route", mutates_args=(), device_types="cuda")
def route(logits: Tensor, top_k: int, method: str, bias: Tensor | None = None, n_group: int = 1,
          topk_group: int = 1, routed_scaling_factor: float = 1.0, renormalize: bool = True) -> tuple[Tensor, Tensor]:
    # a workspace of this call's own, one allocation a view: a custom op's outputs may not alias each other
    ws = _pm.RoutingWorkspace(max(logits.shape[0], 1), logits.shape[1], top_k, None, device=logits.device,
                              separate=True)
    r = _rt.route(logits, top_k=top_k, method=method, bias=bias, n_group=n_group, topk_group=topk_group,
                  routed_scaling_factor=routed_scaling_factor, renormalize=renormalize, workspace=ws)
    return r.topk_ids, r.topk_weights


@route.register_kernel("cpu")
def _route_cpu(logits, top_k, method, bias=None, n_group=1, topk_group=1, routed_scaling_factor=1.0,
               renormalize=True):
    check_env()
    _rt.check_args(logits, top_k, method, bias, n_group, topk_group, renormalize, rsf=routed_scaling_factor,
                   cuda=False)
    ids, w = _rt.reference(logits, top_k, method, bias, n_group, topk_group, routed_scaling_factor, renormalize)
    return ids, w


@route.register_fake
def _route_fake(logits, top_k, method, bias=None, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                renormalize=True):
    _one_device("route", logits=logits, bias=bias)
    T = logits.shape[0]
    return (logits.new_empty((T, top_k), dtype=torch.int32), logits.new_empty((T, top_k), dtype=torch.float32))


# ------------------------------------------------------------------------------------- route + permutation
@torch.library.custom_op("kerngen::route_permute", mutates_args=(), device_types="cuda")
def route_permute(logits: Tensor, top_k: int, method: str, tile: int, bias: Tensor | None = None, n_group: int = 1,
                  topk_group: int = 1, routed_scaling_factor: float = 1.0, renormalize: bool = True,
                  local_start: int = 0, num_local: int = -1) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                       Tensor, Tensor]:
    """route with the whole permutation: (topk_ids, topk_weights, expert_counts, expert_offsets,
    expanded_to_permuted, permuted_to_token, tile_to_expert, num_permuted_rows); num_local = -1: all experts."""
    E = logits.shape[1]
    local = (local_start, E - local_start if num_local < 0 else num_local)
    ws = _pm.RoutingWorkspace(max(logits.shape[0], 1), E, top_k, tile, local_experts=local, device=logits.device,
                              separate=True)
    r = _rt.route(logits, top_k=top_k, method=method, bias=bias, n_group=n_group, topk_group=topk_group,
                  routed_scaling_factor=routed_scaling_factor, renormalize=renormalize, tile=tile,
                  local_experts=local, workspace=ws)
    return _permutation(r)


def _permutation(r) -> tuple:
    return (r.topk_ids, r.topk_weights, r.expert_counts, r.expert_offsets, r.expanded_to_permuted,
            r.permuted_to_token, r.tile_to_expert, r.num_permuted_rows)


@route_permute.register_kernel("cpu")
def _route_permute_cpu(logits, top_k, method, tile, bias=None, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                       renormalize=True, local_start=0, num_local=-1):
    check_env()
    E = logits.shape[1]
    local = (local_start, E - local_start if num_local < 0 else num_local)
    _rt.check_args(logits, top_k, method, bias, n_group, topk_group, renormalize, tile, local,
                   rsf=routed_scaling_factor, cuda=False)
    ids, w = _rt.reference(logits, top_k, method, bias, n_group, topk_group, routed_scaling_factor, renormalize)
    p = _pm.permute_reference(ids, E, tile, local)
    return (ids, w, p["expert_counts"], p["expert_offsets"], p["expanded_to_permuted"], p["permuted_to_token"],
            p["tile_to_expert"], p["num_permuted_rows"])


@route_permute.register_fake
def _route_permute_fake(logits, top_k, method, tile, bias=None, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                        renormalize=True, local_start=0, num_local=-1):
    _one_device("route", logits=logits, bias=bias)
    T, E = logits.shape
    nl = E - local_start if num_local < 0 else num_local
    rows = _pm.max_rows(T, top_k, nl, tile)
    i32 = dict(dtype=torch.int32)
    return (logits.new_empty((T, top_k), **i32), logits.new_empty((T, top_k), dtype=torch.float32),
            logits.new_empty((nl,), **i32), logits.new_empty((nl + 1,), **i32), logits.new_empty((T, top_k), **i32),
            logits.new_empty((rows,), **i32), logits.new_empty((rows // tile,), **i32), logits.new_empty((), **i32))


# ---------------------------------------------------------------------------- moe_align_block_size (vLLM's)
@torch.library.custom_op("kerngen::moe_align_block_size",
                         mutates_args=("sorted_token_ids", "expert_ids", "num_tokens_post_pad"), device_types="cuda")
def moe_align_block_size(topk_ids: Tensor, num_experts: int, block_size: int, sorted_token_ids: Tensor,
                         expert_ids: Tensor, num_tokens_post_pad: Tensor) -> None:
    """vLLM's `ops.moe_align_block_size`: writes the block layout into the given buffers (one launch). Ids
    outside [0, num_experts) are skipped on every device (the kernel cannot raise without a host sync)."""
    _pm.permute_align_into(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_pad)


@moe_align_block_size.register_kernel("cpu")
def _moe_align_block_size_cpu(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_pad):
    check_env()
    _pm.check_align_into("moe_align_block_size", topk_ids, num_experts, block_size, sorted_token_ids, expert_ids,
                         num_tokens_post_pad, cuda=False)
    s, e, n = _pm.align_reference(topk_ids, block_size, num_experts)
    sorted_token_ids.fill_(topk_ids.numel())
    sorted_token_ids[:s.shape[0]].copy_(s)
    expert_ids.fill_(0)
    expert_ids[:e.shape[0]].copy_(e)
    num_tokens_post_pad.copy_(n)


@moe_align_block_size.register_fake
def _moe_align_block_size_fake(topk_ids, num_experts, block_size, sorted_token_ids, expert_ids, num_tokens_post_pad):
    _one_device("moe_align_block_size", topk_ids=topk_ids, sorted_token_ids=sorted_token_ids, expert_ids=expert_ids,
                num_tokens_post_pad=num_tokens_post_pad)
    return None


# --------------------------------------------------------------------------------------------------- tail
@torch.library.custom_op("kerngen::moe_tail", mutates_args=(), device_types="cuda")
def moe_tail(gemm2_out: Tensor, expanded_to_permuted: Tensor, topk_weights: Tensor, norm_weight: Tensor,
             eps: float = 1e-6, shared: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
    return _tail.moe_tail(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, eps=eps, shared=shared,
                          residual=residual)


@moe_tail.register_kernel("cpu")
def _moe_tail_cpu(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, eps=1e-6, shared=None,
                  residual=None):
    check_env()
    _tail.check_args(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, shared, residual, cuda=False)
    _common.check_eps(_tail.OP, eps)
    return _tail.reference(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, eps=eps, shared=shared,
                           residual=residual)[0]


@moe_tail.register_fake
def _moe_tail_fake(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, eps=1e-6, shared=None,
                   residual=None):
    _one_device("moe_tail", gemm2_out=gemm2_out, expanded_to_permuted=expanded_to_permuted,
                topk_weights=topk_weights, norm_weight=norm_weight, shared=shared, residual=residual)
    return gemm2_out.new_empty((expanded_to_permuted.shape[0], norm_weight.shape[0]))


# --------------------------------------------------------------------------------------------- latent tail
@torch.library.custom_op("kerngen::latent_tail", mutates_args=(), device_types="cuda")
def latent_tail(gemm2_out: Tensor, expanded_to_permuted: Tensor, topk_weights: Tensor, norm_weight: Tensor,
                up_proj: Tensor, eps: float = 1e-6, shared: Tensor | None = None,
                residual: Tensor | None = None) -> Tensor:
    return _lt.latent_tail(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, up_proj, eps=eps, shared=shared,
                           residual=residual, own_scratch=True)


@latent_tail.register_kernel("cpu")
def _latent_tail_cpu(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, up_proj, eps=1e-6, shared=None,
                     residual=None):
    check_env()
    _lt.check_args(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, up_proj, shared, residual, eps,
                   cuda=False)
    return _lt.reference(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, up_proj, shared=shared,
                         residual=residual, eps=eps)


@latent_tail.register_fake
def _latent_tail_fake(gemm2_out, expanded_to_permuted, topk_weights, norm_weight, up_proj, eps=1e-6, shared=None,
                      residual=None):
    _one_device("latent_tail", gemm2_out=gemm2_out, expanded_to_permuted=expanded_to_permuted,
                topk_weights=topk_weights, norm_weight=norm_weight, up_proj=up_proj, shared=shared, residual=residual)
    return gemm2_out.new_empty((expanded_to_permuted.shape[0], up_proj.shape[0]))


# ------------------------------------------------------------------------- the routed experts of a block
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
    E, T = w13.shape[0], x.shape[0]
    ids = _ids(topk_ids, "topk_ids")
    _check_weights(topk_weights, ids, x)
    tile = _tile(x, w13, w2, activation, fp8_activations)
    ws = _pm.RoutingWorkspace(max(T, 1), E, ids.shape[1], tile, device=x.device, separate=True)
    r = _pm.permute(ids, num_experts=E, tile=tile, workspace=ws)
    rows = r.permuted_to_token.shape[0]
    g = x.new_empty((rows, x.shape[1]), dtype=torch.bfloat16)
    scratch = x.new_empty((rows, w13.shape[1] // 2), dtype=torch.bfloat16)   # [rows, I] in every format
    _ex.experts(x, r, w13, w2, activation=activation, b13=b13, b2=b2, w13_scale=w13_scale, w2_scale=w2_scale,
                interleaved=interleaved, alpha=alpha, limit=limit, out=g, scratch=scratch,
                fp8_activations=fp8_activations)
    return _fin.finalize(g, r.expanded_to_permuted, _weights(topk_weights))


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


def _tile(x: Tensor, w13: Tensor, w2: Tensor, activation: str, a8: bool = False) -> int:
    """The tile of the experts kernels' rule for these tokens and weights (1 where none serves them)."""
    if w13.dtype not in _ex.FORMATS or x.device.type not in _common.KERNEL_DEVICES:
        return 1
    a8 = a8 is True and _ex.FORMATS[w13.dtype] == "fp8"   # anything else is experts()' error to raise
    I = w13.shape[1] // 2   # w13 [E, 2I, ...] in every format (w2's last dims are I/32, 16 for MXFP4)
    fmt = _ex.FORMATS[w13.dtype]
    return _ex.tile_for(x.shape[1], I, activation, x.shape[0], x.get_device(), fmt,
                        _ex.weights_layout(w13, w2, fmt), a8) or 1


@moe_experts.register_kernel("cpu")
def _moe_experts_cpu(x, topk_ids, topk_weights, w13, w2, activation, b13=None, b2=None, w13_scale=None,
                     w2_scale=None, interleaved=False, alpha=1.702, limit=7.0, fp8_activations=False):
    check_env()
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
    _one_device("experts", x=x, topk_ids=topk_ids, topk_weights=topk_weights, w13=w13, w2=w2, b13=b13, b2=b2,
                w13_scale=w13_scale, w2_scale=w2_scale)
    return x.new_empty((topk_ids.shape[0], x.shape[1]), dtype=torch.bfloat16)
