"""experts' input checks: every argument of kerngen.experts, with an InputError naming it, and the weight formats
and layouts it accepts (kerngen.ops.experts re-exports them). `check` is the one check of kerngen.experts and of its
CPU entry points (torch.ops.kerngen.moe_experts, the transformers integration), which leave out the device check."""
from __future__ import annotations

import math

import torch

from .. import tiers
from ..errors import InputError
from . import permute as permute_op
from ._common import check_aligned, check_tensor

OP = "experts"
ACTIVATIONS = tiers.EXPERT_ACTIVATIONS
_BF16 = (torch.bfloat16,)
FP8 = torch.float8_e4m3fn
QBLOCK = 128   # fp8 weights: one fp32 scale per 128 x 128 block
FORMATS = {torch.bfloat16: "bf16", FP8: "fp8", torch.uint8: "mxfp4"}   # weight dtype -> its kernels' format
MX_GROUP = 32  # MXFP4: values per e8m0 scale; a group is 16 bytes of two e2m1 values each
MX_STEP = 64   # MXFP4: H and I multiples of it (the kernels' 64-wide steps)
QUANTUM = {"fp8": QBLOCK, "mxfp4": MX_STEP}   # what H and I must be multiples of, by weight format
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# How the weights lie in memory: "nk", w13 [E, 2I, H] and w2 [E, H, I] contiguous (vLLM, SGLang, most transformers
# families); "kn", the transposes of contiguous [E, H, 2I] and [E, I, H] (transformers' gpt-oss and Llama-4, passed as
# gate_up_proj.transpose(1, 2) and down_proj.transpose(1, 2)), read in place by kernels built for it (bf16 only).
LAYOUTS = tiers.EXPERT_LAYOUTS


def infer_tile(routing) -> int:
    """The tile of a Routing built by hand without one, from its buffer sizes: len(permuted_to_token) =
    T*K + num_local*(tile - 1). (kerngen's own routings carry their `tile`.)"""
    T, K = routing.expanded_to_permuted.shape
    nl = routing.expert_offsets.shape[0] - 1
    cap = routing.permuted_to_token.shape[0]
    tile = (cap - T * K) // nl + 1 if nl > 0 else 0
    if (nl < 1 or (cap - T * K) % nl or not 1 <= tile <= permute_op.MAX_TILE
            or routing.tile_to_expert.shape[0] != cap // tile):
        raise InputError(OP, "routing", "the Routing of kerngen.route(..., tile=...) or kerngen.permute (its "
                         "buffer sizes give the tile); or pass tile=", f"permuted_to_token of {cap} rows")
    return tile


def weights_layout(w13: torch.Tensor, w2: torch.Tensor, fmt: str) -> str:
    """"nk" for contiguous weights, "kn" for bf16 ones that are both transposes of contiguous tensors (LAYOUTS);
    anything else is an InputError naming the weight."""
    def layout(t: torch.Tensor) -> str | None:
        if t.is_contiguous():
            return "nk"
        return "kn" if fmt == "bf16" and t.dim() == 3 and t.transpose(-2, -1).is_contiguous() else None

    got = {}
    for name, t in (("w13", w13), ("w2", w2)):
        got[name] = layout(t)
        if got[name] is None:
            want = ("contiguous, or the transpose of a contiguous tensor (bf16: gate_up_proj.transpose(1, 2) of "
                    "[E, H, 2I], down_proj.transpose(1, 2) of [E, I, H])" if fmt == "bf16"
                    else f"contiguous ({fmt} weights in their checkpoint layout)")
            raise InputError(OP, name, want, f"strides {t.stride()}")
    if got["w13"] != got["w2"]:
        raise InputError(OP, "w2", "in w13's layout: " + ("contiguous" if got["w13"] == "nk" else
                         "the transpose of a contiguous [E, I, H] (down_proj.transpose(1, 2))"),
                         f"strides {w2.stride()}")
    return got["w13"]


def check(x, routing, w13, w2, *, activation="silu", interleaved=False, b13=None, b2=None, input_weights=None,
          tile=None, alpha=1.702, limit=7.0, beta=1.0, linear_beta=0.0, w13_scale=None, w2_scale=None,
          fp8_activations=False, cuda: bool = True) -> tuple[int, int, int, str, str]:
    """Every check of kerngen.experts' arguments (its buffers out= and scratch= aside), with an InputError naming the
    argument; returns (tile, H, I, format, layout). Every tensor must be on x's device; the check that x is a CUDA
    tensor comes last, and cuda=False leaves it out (the CPU entry points, which then run `reference`)."""
    tile, H, I, fmt, layout = check_args(x, routing, w13, w2, activation, interleaved, b13, b2, input_weights, tile,
                                         w13_scale, w2_scale)
    if not isinstance(fp8_activations, bool) or (fp8_activations and fmt != "fp8"):
        raise InputError(OP, "fp8_activations", "False, or True with fp8 weights",
                         f"{fp8_activations!r} with {fmt} weights")
    _check_act_params(activation, alpha, limit, beta, linear_beta)
    if cuda:
        check_tensor(OP, "x", x)
    return tile, H, I, fmt, layout


def check_args(x, routing, w13, w2, activation, interleaved, b13, b2, input_weights, tile, w13_scale=None,
               w2_scale=None) -> tuple[int, int, int, str, str]:
    """The tensors' checks of `check` (every tensor on x's device, whichever it is), with a message naming the
    argument; returns (tile, H, I, format, layout)."""
    dev = getattr(x, "device", None)
    check_tensor(OP, "x", x, dtypes=_BF16, ndim=2, device=dev, contiguous=True)
    if activation not in ACTIVATIONS:
        raise InputError(OP, "activation", f"one of {', '.join(ACTIVATIONS)}", repr(activation))
    if not isinstance(interleaved, bool):
        raise InputError(OP, "interleaved", "True or False", repr(interleaved))
    fields = ("expanded_to_permuted", "permuted_to_token", "tile_to_expert", "expert_offsets", "num_permuted_rows")
    if any(getattr(routing, f, None) is None for f in fields):
        raise InputError(OP, "routing", "a kerngen.Routing with the permutation (route(..., tile=...) or permute)",
                         type(routing).__name__ if not hasattr(routing, "topk_ids") else "a Routing without a tile")
    for f in fields:
        check_tensor(OP, f"routing.{f}", getattr(routing, f), dtypes=(torch.int32,), device=dev, contiguous=True)
    T, H = x.shape
    if routing.expanded_to_permuted.dim() != 2 or routing.expanded_to_permuted.shape[0] != T:
        raise InputError(OP, "routing", f"the routing of x's {T} tokens ([T, K] expanded_to_permuted)",
                         f"expanded_to_permuted of shape {tuple(routing.expanded_to_permuted.shape)}")
    nl = routing.expert_offsets.shape[0] - 1
    check_tensor(OP, "w13", w13, dtypes=tuple(FORMATS), device=dev)
    fmt = FORMATS[w13.dtype]
    mx = fmt == "mxfp4"
    check_tensor(OP, "w13", w13, ndim=4 if mx else 3, device=dev)
    check_tensor(OP, "w2", w2, dtypes=(w13.dtype,), ndim=4 if mx else 3, device=dev)
    layout = weights_layout(w13, w2, fmt)
    s13, s2 = tuple(w13.shape), tuple(w2.shape)
    if mx:   # the checkpoint's blocks [E, N, K/32, 16]: checked as the [E, N, K] values they hold
        for name, t in (("w13", w13), ("w2", w2)):
            if t.shape[3] != MX_GROUP // 2:
                raise InputError(OP, name, f"MXFP4 blocks [E, N, K/32, {MX_GROUP // 2}] (uint8, two values a byte)",
                                 f"shape {tuple(t.shape)}")
        s13, s2 = (*s13[:2], s13[2] * MX_GROUP), (*s2[:2], s2[2] * MX_GROUP)
    if s13[0] != nl:
        raise InputError(OP, "w13", f"[E, 2I, H] with E = {nl}, the routing's local experts", f"shape {s13}")
    I = s13[1] // 2
    if s13[1] % 2 or s13[2] != H or I < 1:
        raise InputError(OP, "w13", f"[{nl}, 2I, {H}] (gate_up_proj: 2I rows of x's width H = {H})",
                         f"shape {s13}" + (" (values)" if mx else ""))
    if s2 != (nl, H, I):
        raise InputError(OP, "w2", f"of shape {(nl, H, I)} (down_proj [E, H, I])",
                         f"shape {s2}" + (" (values)" if mx else ""))
    if H % 8 or I % 8:
        raise InputError(OP, "w13", "H and I multiples of 8 (16-byte vectors)", f"H = {H}, I = {I}")
    _check_scales(fmt, nl, H, I, w13_scale, w2_scale, dev)
    for name, b, shape in (("b13", b13, (nl, 2 * I)), ("b2", b2, (nl, H))):
        if b is not None:
            check_tensor(OP, name, b, dtypes=_BF16, ndim=2, device=dev, contiguous=True)
            if tuple(b.shape) != shape:
                raise InputError(OP, name, f"of shape {shape}", f"shape {tuple(b.shape)}")
    if input_weights is not None:
        check_tensor(OP, "input_weights", input_weights, dtypes=(torch.float32, torch.bfloat16), device=dev)
        if tuple(input_weights.shape) not in ((T,), (T, 1)):
            raise InputError(OP, "input_weights", f"of shape ({T},) (one weight per token, Llama-4)",
                             f"shape {tuple(input_weights.shape)}")
    if dev.type == "cuda":
        for name, t in (("x", x), ("w13", w13), ("w2", w2)):
            check_aligned(OP, name, t)
    if tile is None:
        tile = routing.tile if getattr(routing, "tile", None) is not None else infer_tile(routing)
    elif not isinstance(tile, int) or isinstance(tile, bool) or not 1 <= tile <= permute_op.MAX_TILE:
        raise InputError(OP, "tile", f"the routing's tile, an integer in [1, {permute_op.MAX_TILE}]",
                         f"a tensor of shape {tuple(tile.shape)}" if isinstance(tile, torch.Tensor) else repr(tile))
    elif getattr(routing, "tile", None) not in (None, tile):
        raise InputError(OP, "tile", f"the routing's tile ({routing.tile}) or None", repr(tile))
    if routing.tile_to_expert.shape[0] * tile > routing.permuted_to_token.shape[0]:
        raise InputError(OP, "tile", "the tile the routing was built with", f"{tile}")
    return tile, H, I, fmt, layout


def _check_scales(fmt, nl, H, I, w13_scale, w2_scale, dev) -> None:
    """fp8 weights take their block scales (fp32 [E, 2I/128, H/128] and [E, H/128, I/128]), MXFP4 ones their e8m0
    scales (uint8 [E, 2I, H/32] and [E, H, I/32]); bf16 ones none."""
    if fmt == "bf16":
        for name, t in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
            if t is not None:
                raise InputError(OP, name, "None for bf16 weights (scales go with fp8 or MXFP4 weights)",
                                 type(t).__name__)
        return
    if fmt == "fp8":
        if H % QBLOCK or I % QBLOCK:
            raise InputError(OP, "w13", f"H and I multiples of {QBLOCK} for fp8 weights (one scale per {QBLOCK} x "
                             f"{QBLOCK} block)", f"H = {H}, I = {I}")
        want = (("w13_scale", w13_scale, (nl, 2 * I // QBLOCK, H // QBLOCK), torch.float32),
                ("w2_scale", w2_scale, (nl, H // QBLOCK, I // QBLOCK), torch.float32))
        what = f"the fp32 block scales (one per {QBLOCK} x {QBLOCK} block)"
    else:
        if H % MX_STEP or I % MX_STEP:
            raise InputError(OP, "w13", f"H and I multiples of {MX_STEP} for MXFP4 weights (the kernels' "
                             f"{MX_STEP}-wide steps)", f"H = {H}, I = {I}")
        want = (("w13_scale", w13_scale, (nl, 2 * I, H // MX_GROUP), torch.uint8),
                ("w2_scale", w2_scale, (nl, H, I // MX_GROUP), torch.uint8))
        what = f"the e8m0 scales (uint8, one per {MX_GROUP} values)"
    for name, t, shape, dtype in want:
        if t is None:
            raise InputError(OP, name, f"{what} {shape} of the {fmt} weights", "None")
        check_tensor(OP, name, t, dtypes=(dtype,), ndim=3, device=dev, contiguous=True)
        if tuple(t.shape) != shape:
            raise InputError(OP, name, f"of shape {shape}: {what}", f"shape {tuple(t.shape)}")
        if fmt == "mxfp4" and dev.type == "cuda":   # (a row's groups even in number: H, I multiples of 64)
            check_aligned(OP, name, t, 2, "a lane's two scale bytes of a row by one 16-bit load")


def _check_act_params(activation, alpha, limit, beta, linear_beta):
    for name, v, positive in (("alpha", alpha, False), ("limit", limit, activation == "gpt_oss"),
                              ("beta", beta, activation == "situglu"), ("linear_beta", linear_beta, False)):
        if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or (positive and v <= 0)
                or (name == "linear_beta" and v < 0)):
            raise InputError(OP, name, "a finite number (limit, beta > 0; linear_beta >= 0)", repr(v))
