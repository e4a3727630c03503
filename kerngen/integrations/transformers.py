"""kerngen inside Hugging Face transformers 5 MoE blocks: routing, permutation, grouped expert GEMMs, finalize.

    import kerngen.integrations.transformers as kt
    kt.enable(model)     # every MoE block of a loaded model; returns the names of the modules it patched
    kt.disable(model)    # transformers' own code again

Per MoE block:
- experts: the "kerngen" experts implementation (registered in transformers' ExpertsInterface when this module
  is imported, so `from_pretrained(..., experts_implementation="kerngen")` works too). The top-k ids are
  permuted by kerngen (`kerngen.permute`, or the permutation the kerngen router already built). Where
  `kerngen.experts`' kernels serve the block (CUDA bf16, gate and up concatenated as [E, 2I, H], SiLU or tanh-GeLU
  gate, the tokens of its tier rules: decode sizes), they run both projections with the gather and the gate fused.
  Elsewhere rows are gathered in permuted order, gate_up and down projections run as grouped GEMMs (`torch._grouped_mm` with int32 offsets on
  CUDA bf16, sm_90 and newer: no host sync, CUDA-graph capturable; a per-expert loop elsewhere, which reads the
  offsets on the host), the family's own gate (`_apply_gate`: concatenated or interleaved gate/up, gpt-oss's
  clamped SwiGLU) with its biases, and `kerngen.finalize` for the weighted sum (fp32, k ascending).
- router: its top-k by `kerngen.route` with the method that reproduces it (ROUTERS); logits are computed as the
  family computes them and weights returned in the dtype the family returns. Families that map onto no kerngen
  method are refused with the reason (REFUSED), before anything is patched.
- Llama-4 (its experts do not dispatch through ExpertsInterface): the block's forward; the router weight scales
  the expert's input and expert outputs are summed unweighted, as Llama4TextMoe does.
- gpt-oss on its MXFP4 checkpoint (transformers' Mxfp4GptOssMLP / Mxfp4GptOssExperts, whose forward calls OpenAI's
  triton_kernels and dispatches through no interface): the block's forward, its router and then the "kerngen"
  experts implementation, which runs `kerngen.experts`' MXFP4 path on the checkpoint's blocks and e8m0 scales
  (read back once from the triton_kernels tensors transformers loads them into) with gpt-oss's gate.
- fp8 experts (transformers' FP8Experts) dispatch through FP8ExpertsInterface, where the "kerngen" implementation
  is registered too: kerngen.experts' fp8 kernels.
CPU tensors run kerngen's torch references (`routing.reference`, `permute_reference`, `finalize.reference`).

Results differ from transformers only where kerngen is deliberately stricter (equal scores: the lower expert
index wins; NaN logits count as -inf; a row whose experts are all masked gets weight 0) and by rounding (fp32
accumulation; a different order of the same sums). Inference only: kerngen's kernels have no backward, so in
training mode routers run transformers' code and experts its "grouped_mm" implementation (MXFP4 blocks: their own
forward).

This module holds enable / disable; the experts side (the implementation, each block's BlockState) is
transformers_experts.py, the routers (ROUTERS, REFUSED, the patched forwards) transformers_routers.py.
"""
from __future__ import annotations

from torch import nn
try:   # a clear error where transformers is missing (the modules below import it too)
    from transformers.integrations import moe as _hf_moe  # noqa: F401
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] != "transformers":
        raise
    raise ModuleNotFoundError("kerngen.integrations.transformers needs transformers 5 or newer, which is not "
                              "installed: pip install 'kerngen[transformers]'", name=e.name) from None

from kerngen.errors import InputError, KerngenError
from kerngen.ops import permute as _pm
from . import transformers_experts as _kx
from . import transformers_graphs as _kg
from .transformers_experts import (MXFP4_EXPERTS, NAME, TILE, BlockState, experts_forward, fp8_activation,
                                   kernel_activation, mxfp4_arguments, state)
from .transformers_routers import (LLAMA4_BLOCK, REFUSED, ROUTERS, Router, _llama4_forward, _mxfp4_forward, _Refuse,
                                   _router_forward)

# the entry module's names: enable / disable here, the experts side in transformers_experts, the routers in
# transformers_routers
__all__ = ["enable", "disable", "UnsupportedModelError", "NAME", "TILE", "BlockState", "state", "experts_forward",
           "fp8_activation", "kernel_activation", "mxfp4_arguments", "MXFP4_EXPERTS", "LLAMA4_BLOCK", "ROUTERS",
           "REFUSED", "Router", "_pm"]
_BLOCK_FORWARDS = {"llama4": _llama4_forward, "mxfp4": _mxfp4_forward}   # enable's block forwards, by plan kind


class UnsupportedModelError(KerngenError):
    """A model family whose router kerngen cannot reproduce exactly (or a model with no MoE block)."""

    def __init__(self, family: str, module: str, reason: str):
        self.family, self.module, self.reason = family, module, reason
        super().__init__(f"kerngen.integrations.transformers: model family '{family}' ({module}) is not supported: "
                         f"{reason}")


def _check_call(fn: str, model, **flags) -> None:
    """enable / disable's arguments: a torch.nn.Module, and each flag=(value, allowed types) one of them (a bool is
    not an int here: "yes" or 1 for routers is a mistake, not a truthy value)."""
    if not isinstance(model, nn.Module):
        raise InputError(f"integrations.transformers.{fn}", "model", "a torch.nn.Module (the transformers model)",
                         type(model).__name__)
    for name, (value, types) in flags.items():
        if type(value) not in types:
            raise InputError(f"integrations.transformers.{fn}", name,
                             "True, False or None" if type(None) in types else "True or False", repr(value))


def _dispatches(m: nn.Module) -> bool:
    """An experts module decorated by transformers' use_experts_implementation."""
    return hasattr(m, "has_gate") and hasattr(m, "_is_expert_parallel") and hasattr(type(m), "_apply_gate")


def _family(model: nn.Module, m: nn.Module) -> str:
    cfg = getattr(m, "config", None) or getattr(model, "config", None)
    return getattr(cfg, "model_type", None) or type(model).__name__


def _plan(model: nn.Module, routers: bool, graphs: bool) -> list[tuple[str, nn.Module, str, object]]:
    """(name, module, kind, payload) of every patch enable makes (with graphs, each MoE block's graphed forward
    last); raises before anything is patched (MXFP4 experts' kerngen arguments are made here, so a checkpoint
    kerngen cannot read is refused first)."""
    plan, blocks = [], []
    for name, block in model.named_modules():
        ex = getattr(block, "experts", None)
        if type(block).__name__ == LLAMA4_BLOCK:
            if block.top_k != 1:
                raise UnsupportedModelError(_family(model, block), LLAMA4_BLOCK, f"num_experts_per_tok={block.top_k}; "
                                            "kerngen's top1_sigmoid picks one expert, and ranking sigmoids "
                                            "(sigmoid_bias) ties where transformers' top-k of the logits does not")
            plan.append((name, block, "llama4", None))
            blocks.append((name, block, "graph", None))
            continue
        if type(ex).__name__ == MXFP4_EXPERTS:
            if getattr(ex, "_is_hooked", False):
                raise UnsupportedModelError(_family(model, ex), MXFP4_EXPERTS, "its experts are sharded (expert or "
                                            "tensor parallel forward installed); kerngen serves whole MXFP4 experts")
            mxfp4_arguments(ex)
            plan.append((name, block, "mxfp4", None))
        elif not isinstance(ex, nn.Module) or not _dispatches(ex):
            continue
        else:
            plan.append((_join(name, "experts"), ex, "experts", None))
        blocks.append((name, block, "graph", None))
        if not routers:
            continue
        rname, router = next(((n, c) for n, c in block.named_children() if n in ("gate", "router")), (None, None))
        cls = type(router).__name__
        family = _family(model, ex)
        if cls in ROUTERS:
            try:
                kw = ROUTERS[cls].routing(router)
            except _Refuse as e:
                raise UnsupportedModelError(family, cls, str(e)) from None
            plan.append((_join(name, rname), router, "router", (ROUTERS[cls], kw, ex)))
            continue
        reason = REFUSED[cls](router) if cls in REFUSED else None
        raise UnsupportedModelError(family, cls, (reason or "no kerngen routing method is known to reproduce this "
                                                  "router") + "; enable(model, routers=False) keeps transformers' "
                                    "router and runs kerngen's experts path")
    if not plan:
        raise UnsupportedModelError(_family(model, model), type(model).__name__,
                                    "no MoE block (experts dispatching through transformers' ExpertsInterface, "
                                    f"Llama4TextMoe, or {MXFP4_EXPERTS}) was found")
    return plan + blocks if graphs else plan


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _patched(m: nn.Module) -> bool:
    return getattr(m.__dict__.get("forward"), "_kerngen", False)


def enable(model: nn.Module, *, routers: bool = True, graphs: bool | None = None,
           relayout: bool = True) -> list[str]:
    """Run every MoE block of `model` on kerngen; returns the qualified names of the patched modules.

    Experts get the "kerngen" experts implementation (set on their config); with routers=True (default) each
    router's top-k is kerngen's routing too, and a family whose router maps onto no kerngen method raises
    UnsupportedModelError naming it and the reason (nothing is patched then). routers=False keeps
    transformers' routers (any family whose experts dispatch through ExpertsInterface). gpt-oss's MXFP4 blocks
    (Mxfp4GptOssMLP) get a forward of their own, named by the block; their experts' checkpoint is checked (an
    InputError naming the module's attribute) and read back here. Each MoE block's eager inference forwards of
    decode sizes replay from CUDA graphs (transformers_graphs: graphs=None reads KERNGEN_BLOCK_GRAPHS, unset
    meaning at most GRAPH_TOKENS tokens; True every token count; False never). Experts that keep their weights
    transposed (gpt-oss and Llama-4 in bf16 / fp16: [E, H, 2I], [E, I, H]) get them stored, in place, as
    kerngen.experts reads them fastest (relayout: same shapes, values and memory, each parameter a transposed view
    of a row-major [E, 2I, H] / [E, H, I]; disable puts them back); relayout=False keeps them, read in place
    (slower, and past 16 tokens transformers' grouped GEMM). Calling it again changes nothing and returns the same
    names.
    """
    _check_call("enable", model, routers=(routers, (bool,)), graphs=(graphs, (bool, type(None))),
                relayout=(relayout, (bool,)))
    bound = _kg.tokens_bound(graphs)
    plan = _plan(model, routers, bound > 0)
    if relayout:
        for _, m, kind, _ in plan:
            ex = m if kind == "experts" else getattr(m, "experts", None) if kind == "llama4" else None
            if ex is not None and _kx.transposed(ex) and "_kerngen_relayout" not in ex.__dict__:
                row_major = ex.gate_up_proj.is_contiguous() and ex.down_proj.is_contiguous()
                if _kx.relayout(ex) and row_major:
                    ex._kerngen_relayout = True   # (disable makes them row-major again)
    previous = {}   # experts of one model share a config: read every previous value before setting any
    for _, m, kind, _ in plan:
        if kind == "experts":
            previous.setdefault(id(m.config), m.config._experts_implementation)
    for _, m, kind, payload in plan:
        if kind == "graph":
            current = m.__dict__.get("forward")
            if getattr(current, "graphs", None) is None:   # (enable again: graphed already)
                if current is not None and not getattr(current, "_kerngen", False):
                    m._kerngen_forward = current   # one set on the instance before: kept, and graphed
                m.forward = _kg.graphed(m, current if current is not None else type(m).forward.__get__(m), bound)
        elif kind == "experts":
            if previous[id(m.config)] != NAME:
                m._kerngen_previous = previous[id(m.config)]
            m.config._experts_implementation_internal = NAME   # this config only, as set_experts_implementation does
        elif not _patched(m):
            if "forward" in m.__dict__:   # one set on the instance before (by transformers or the user): kept
                m._kerngen_forward = m.__dict__["forward"]
            m.forward = _router_forward(m, *payload) if kind == "router" else _BLOCK_FORWARDS[kind](m)
    return list(dict.fromkeys(name for name, *_ in plan))


def disable(model: nn.Module) -> list[str]:
    """Undo enable: transformers' routers and the previous experts implementation; returns the restored names."""
    _check_call("disable", model)
    restored = []
    for name, m in model.named_modules():
        if _patched(m):
            del m.forward
            if "_kerngen_forward" in m.__dict__:
                m.forward = m.__dict__.pop("_kerngen_forward")
            restored.append(name)
        if "_kerngen_previous" in m.__dict__:
            m.config._experts_implementation_internal = m.__dict__.pop("_kerngen_previous")
            restored.append(name)
        if m.__dict__.pop("_kerngen_relayout", False):
            _kx.relayout(m, back=True)
        m.__dict__.pop("_kerngen_state", None)
        m.__dict__.pop(_kx._MXFP4_KEPT, None)
    return restored
