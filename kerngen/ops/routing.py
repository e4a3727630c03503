"""routing: top-k expert selection, and with a tile the permutation of kerngen/ops/permute.py.

Semantics every kernel matches (and `reference` computes in plain torch):
- All math in fp32; a NaN logit counts as -inf.
- Each method ranks experts by a selection key, score descending, the lower expert index first on equal
  keys (a stable descending sort). An expert whose logit is -inf (or NaN) always has key -inf, so it is never
  picked while finite keys remain; when fewer than K keys are finite the rest are the lowest-index -inf
  experts (their weights are 0).
    softmax_topk, topk_softmax, top1_sigmoid: key = the logit (softmax is monotone).
    sigmoid_bias, grouped_sigmoid_bias: key = sigmoid(s) + bias, sigmoid(s) = 1 / (1 + exp(-s)) rounded
    step by step (exp, add, reciprocal) exactly as the kernels do, so ids are bitwise equal.
- Weights (fp32, within 1e-6 relative of the reference; the sum orders differ):
    softmax_topk:  p = softmax(s) over all E (0 for a row without finite logits); renormalize: p / sum(p_topk)
    topk_softmax:  softmax over the K picked logits (0 if they are all -inf)
    sigmoid(_grouped)_bias: g = sigmoid(s); renormalize: g * rsf / (sum g + 1e-20), else g * rsf
    top1_sigmoid:  sigmoid(s)
  every method multiplies by routed_scaling_factor (rsf) last (1.0 by default).
- grouped_sigmoid_bias: group score = sum of the finite keys among the top-2 of each of n_group groups (the
  best key alone when the second is -inf or the group has one expert; -inf only for a group without a finite
  key), so a group that holds a finite expert always outranks one that holds none. The topk_group best groups
  (lower group index on ties) keep their keys, the others get -inf; a -inf expert is picked only when the kept
  groups hold fewer than K finite keys (transformers and vLLM score such a group -inf and drop it).

With `tile` the same call permutes (kerngen/ops/permute.py states the layout): the fused variant in its own
kernel, the topk variant through permute's launches.
"""
from __future__ import annotations

import torch

from .. import env
from .. import plan as plan_mod
from ..errors import InputError
from ..dispatch import Dispatch, OpDispatch, rule_spec
from ..launch import Launcher, Params, current_stream
from ..tiers import SMS, Model, Table
from . import permute as permute_op
from ._common import SHORT, DTYPE_NAMES, arch, check_local, resolve, table
from .permute import Routing, RoutingWorkspace, check_layout, check_workspace, with_align
# the reference and the checks live in modules of their own; re-exported here
from .routing_checks import check_args, model_args  # noqa: F401
from .routing_reference import _SIGMOID_BIAS, reference  # noqa: F401

OP = "routing"
_SHORT_METHOD = {"softmax_topk": "smk", "topk_softmax": "tks", "sigmoid_bias": "sgb",
                 "grouped_sigmoid_bias": "gsb", "top1_sigmoid": "t1s"}
# struct Params of templates/routing/_routing.cuh.j2 (topk and fused kernels)
PARAMS = Params(("logits", "ptr"), ("bias", "ptr"), ("ids", "ptr"), ("weights", "ptr"), ("counts", "ptr"),
                ("offsets", "ptr"), ("e2p", "ptr"), ("p2t", "ptr"), ("t2e", "ptr"), ("num_rows", "ptr"),
                ("rsf", "float"), ("tokens", "int"), ("ld", "int"), ("tile", "int"), ("local_start", "int"),
                ("num_local", "int"), ("max_rows", "int"))


# ----------------------------------------------------------------------------------------------- planning
def tag_constants(E, K, method, n_group, topk_group, renormalize, ldtype, bdtype, wdtype,
                  align=False) -> tuple[str, dict]:
    """The readable tag and compile-time constants of a routing kernel (the rule adds its params)."""
    renorm = bool(renormalize) if method in ("softmax_topk", *_SIGMOID_BIAS) else True
    grouped = method == "grouped_sigmoid_bias"
    consts = {"E": E, "K": K, "METHOD": method, "N_GROUP": n_group if grouped else 1,
              "TOPK_GROUP": topk_group if grouped else 1, "RENORM": renorm, "LDTYPE": ldtype,
              "BDTYPE": bdtype if method in _SIGMOID_BIAS else "none", "WDTYPE": wdtype}
    tag = (f"E{E}-K{K}-{_SHORT_METHOD[method]}" + (f"-g{n_group}x{topk_group}" if grouped else "")
           + ("" if renorm else "-norenorm") + f"-{SHORT[ldtype]}"
           + (f"-b{SHORT[consts['BDTYPE']]}" if consts["BDTYPE"] != "none" else "") + f"-w{SHORT[wdtype]}")
    if env.racecheck():   # builds for compute-sanitizer's racecheck: idle token groups meet their barriers
        consts["IDLE_SYNCS"] = True
        tag += "-rc"
    return with_align(tag, consts, align)


def spec(E: int, K: int, method: str, tokens: int, arch_: str, *, n_group: int = 1, topk_group: int = 1,
         renormalize: bool = True, ldtype: str = "float32", bdtype: str = "none", wdtype: str = "float32",
         tbl: Table | None = None) -> plan_mod.KernelSpec:
    tag, consts = tag_constants(E, K, method, n_group, topk_group, renormalize, ldtype, bdtype, wdtype)
    return plan_mod.plan(tbl or table(), OP, {"num_experts": E, "top_k": K, "tokens": tokens}, tag, consts, arch_)


def model_specs(model: Model, tbl: Table, arch_: str) -> list[plan_mod.KernelSpec]:
    """Every routing and permute kernel `model` can dispatch to over its token range (fp32 and bf16 logits,
    fp32 bias for the bias methods, the model's weight dtype)."""
    E, K = model.num_experts, model.top_k
    shape = {"num_experts": E, "top_k": K, "hidden": model.hidden, "arch": arch_}
    out: list[plan_mod.KernelSpec] = []
    rules = tbl.rules_for(OP, shape, model.tokens)   # with a tile, then the rules of calls without one
    for rule in rules + [r for r in tbl.rules_for(OP, {**shape, "permute": False}, model.tokens) if r not in rules]:
        for ldtype in ("float32", "bfloat16"):
            tag, consts = tag_constants(E, K, model.routing, model.n_group, model.topk_group, model.renormalize,
                                        ldtype, "float32", model.weights_dtype)
            out.append(plan_mod.spec_for(rule, tag, consts, arch_))
    return out + permute_op.model_specs(model, tbl, arch_)


def explain_spec(tbl: Table, arch_: str, *, experts: int, top_k: int, tokens: int, model: str | None = None,
                 **_shape) -> plan_mod.KernelSpec:
    """The routing kernel `kerngen explain --op routing` shows (fp32 logits, fp32 bias; the method and its
    constants from `model`, else softmax_topk). Other shape keywords (hidden, dtype) do not apply."""
    m = tbl.model(model) if model else None
    method = m.routing if m else "softmax_topk"
    return spec(experts, top_k, method, tokens, arch_, n_group=m.n_group if m else 1,
                topk_group=m.topk_group if m else 1, renormalize=m.renormalize if m else True,
                bdtype="float32", wdtype=m.weights_dtype if m else "float32", tbl=tbl)


# ----------------------------------------------------------------------------------------------- launching
class Route:
    """The launches of one (shape, method, dtypes, T, permutation on/off) on one device."""

    def __init__(self, s: plan_mod.KernelSpec, T: int, dev: int, permute: bool):
        p, consts = dict(s.params), dict(s.constants)
        warps, wpt = int(p.get("warps", 4)), int(p.get("warps_per_token", 1))
        if warps < 1 or wpt < 1 or warps % wpt or warps * 32 > 1024:
            raise InputError(OP, "tier params", "warps in [1, 32], a multiple of warps_per_token", str(s.params))
        self.fused = s.variant == "fused"
        pdl = bool(p.get("pdl", True))   # (false: a producer that never triggers, a router GEMM, is only delayed by it)
        if self.fused:
            if T > int(p["max_tokens"]):
                raise InputError(OP, "tier params", f"max_tokens >= {T} for the fused variant", str(s.params))
            ctas, clusters = int(p.get("ctas", 1)), int(p.get("clusters", 1))
            if not (1 <= ctas <= 8 and 1 <= clusters <= SMS // ctas):
                raise InputError(OP, "tier params", f"ctas in [1, 8] (a portable cluster), ctas * clusters <= {SMS}",
                                 str(s.params))
            mod = resolve(s)
            self.topk = Launcher(mod, "routing_fused", dev, (ctas * clusters, 1, 1), (warps * 32, 1, 1), PARAMS,
                                 pdl=pdl)
            # ids and weights only: one cluster (the others exist to share the permutation's stores)
            self.ids_only = Launcher(mod, "routing_fused", dev, (ctas, 1, 1), (warps * 32, 1, 1), PARAMS,
                                     pdl=pdl)
            self.permute = None
        elif s.variant == "topk":
            groups = warps // wpt
            self.topk = Launcher(resolve(s), "routing_topk", dev, (max(1, -(-T // groups)), 1, 1),
                                 (warps * 32, 1, 1), PARAMS, pdl=pdl)
            self.ids_only = self.topk
            self.permute = (permute_op.dispatch(dev, E=consts["E"], K=consts["K"], align=consts.get("ALIGN", False))
                            .served(T) if permute else None)
        else:
            raise InputError(OP, "tier variant", "fused or topk", s.variant)

    def run(self, stream: int, logits, bias, ws: RoutingWorkspace, T: int, tile: int | None, ls: int, nl: int,
            rsf: float) -> None:
        """The launches of one routing call (checked inputs; the tuner times candidates through it too)."""
        bias_ptr = 0 if bias is None else bias.data_ptr()
        if tile is None:   # tile 0: ids and weights only, the permutation's fields unused
            self.ids_only.launch(stream, logits=logits.data_ptr(), bias=bias_ptr, ids=ws.ids.data_ptr(),
                                 weights=ws.weights.data_ptr(), rsf=rsf, tokens=T, ld=logits.stride(0),
                                 local_start=ls, num_local=nl)
        elif self.fused:
            self.topk.launch(stream, logits=logits.data_ptr(), bias=bias_ptr, ids=ws.ids.data_ptr(),
                             weights=ws.weights.data_ptr(), counts=ws.counts.data_ptr(), offsets=ws.offsets.data_ptr(),
                             e2p=ws.e2p.data_ptr(), p2t=ws.p2t.data_ptr(), t2e=ws.t2e.data_ptr(),
                             num_rows=ws.num_rows.data_ptr(), rsf=rsf, tokens=T, ld=logits.stride(0), tile=tile,
                             local_start=ls, num_local=nl, max_rows=ws.max_rows)
        else:
            if T:
                self.topk.launch(stream, logits=logits.data_ptr(), bias=bias_ptr, ids=ws.ids.data_ptr(),
                                 weights=ws.weights.data_ptr(), rsf=rsf, tokens=T, ld=logits.stride(0),
                                 local_start=ls, num_local=nl)
            self.permute(stream, ws.ids.data_ptr(), ws, T, tile, ls, nl)


def kernel(s: plan_mod.KernelSpec, tokens: int, device: int, *, permute: bool = True) -> Route:
    """The launches of routing spec `s` for `tokens` tokens on `device`; with `permute` (a tile given) the topk
    variant also gets permute's launches."""
    return Route(s, tokens, device, permute)


def _dispatch(device: int, *, E: int, K: int, method: str, n_group: int, topk_group: int, renormalize: bool,
              ldtype: str, bdtype: str, wdtype: str, align: bool, permute: bool) -> Dispatch:
    """The routing launches of this shape, method and dtypes on `device`, per token bucket of the tier table."""
    a = arch(device)
    return Dispatch(
        OP, {"num_experts": E, "top_k": K, "permute": permute},
        rule_spec(tag_constants(E, K, method, n_group, topk_group, renormalize, ldtype, bdtype, wdtype, align), a),
        lambda s, T, dev: Route(s, T, dev, permute), device, arch=a)


dispatch = OpDispatch(OP, _dispatch)
_calls = dispatch.calls   # signature -> (Route, prototype of fresh buffers or None, T, tile, ls, nl, rsf, dev)


def route(logits: torch.Tensor, *, top_k: int | None = None, method: str | None = None,
          bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
          routed_scaling_factor: float = 1.0, renormalize: bool = True, tile: int | None = None,
          local_experts: tuple[int, int] | None = None, model: str | None = None,
          workspace: RoutingWorkspace | None = None, layout: str = "kerngen") -> Routing:
    """Top-k routing of CUDA logits [T, E] (fp32 or bf16) and, with `tile`, the permutation; see the module doc.

    model="kimi-k3" fills top_k, method and constants from the tier table; explicit values must agree.
    local_experts=(start, count) restricts the permutation to an expert-parallel range. With `workspace`
    the outputs are written into it (no allocation; CUDA-graph and side-stream friendly).
    layout="align" (with tile = the block size) writes moe_align_block_size's sorted_token_ids / expert_ids /
    num_tokens_post_padded from the same launch instead of permuted_to_token / tile_to_expert (align_reference).
    CPU tensors: `reference` (the same semantics in plain torch), or torch.ops.kerngen.route / select_experts.
    """
    try:   # the signature pins everything the checks establish
        sig = (logits.dtype, logits.shape, logits.stride(), logits.get_device(),
               None if bias is None else (bias.dtype, bias.shape, bias.stride(), bias.get_device()),
               top_k, method, n_group, topk_group, routed_scaling_factor, renormalize, tile, local_experts, model,
               layout, None if workspace is None else workspace.signature,
               type(top_k), type(tile), type(renormalize))   # 8 == 8.0 == True: the kinds are pinned too
        hit = _calls.get(sig)
    except (AttributeError, TypeError):   # a wrong type or an unhashable value: the checks name it
        sig, hit = None, None
    if hit is None:
        hit = _calls.remember(sig, _prepare(logits, top_k, method, bias, n_group, topk_group, routed_scaling_factor,
                                            renormalize, tile, local_experts, model, workspace, layout))
    r, proto, T, tile, ls, nl, rsf, dev = hit
    stream = current_stream(dev)
    ws = proto.fresh(T, stream) if workspace is None else workspace
    r.run(stream, logits, bias, ws, T, tile, ls, nl, rsf)
    return ws.result(T, nl)


def _prepare(logits, top_k, method, bias, n_group, topk_group, rsf, renormalize, tile, local_experts, model,
             workspace, layout) -> tuple:
    """Every check of route's arguments, then its launches and the prototype of a fresh workspace."""
    if model is not None:
        top_k, method, n_group, topk_group, rsf, renormalize = model_args(model, top_k, method, n_group, topk_group,
                                                                          rsf, renormalize, logits)
    check_args(logits, top_k, method, bias, n_group, topk_group, renormalize, tile, local_experts, rsf)
    if check_layout(OP, layout) and tile is None:
        raise InputError(OP, "tile", "the block size (an integer) for layout 'align'", "None")
    T, E = logits.shape
    ls, nl = check_local(OP, local_experts, E)
    proto = None
    if workspace is None:
        proto = permute_op.prototype(max(T, 1), E, top_k, tile, (ls, nl), logits.device, layout)
    else:   # before any kernel is built for it
        check_workspace(OP, workspace, T, E, top_k, tile, nl, logits.device, layout)
    wdt = workspace.weights_dtype if workspace is not None else torch.float32
    dev = logits.get_device()
    d = dispatch(dev, E=E, K=top_k, method=method, n_group=n_group, topk_group=topk_group, renormalize=renormalize,
                 ldtype=DTYPE_NAMES[logits.dtype], bdtype="none" if bias is None else DTYPE_NAMES[bias.dtype],
                 wdtype=DTYPE_NAMES[wdt], align=layout == "align", permute=tile is not None)
    r = d.served(T)
    return r, proto, T, tile, ls, nl, float(rsf), dev
