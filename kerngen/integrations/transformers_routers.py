"""The router side of kerngen.integrations.transformers: how each transformers router class computes its logits and
which kerngen routing method reproduces its top-k (ROUTERS), the classes no method reproduces (REFUSED), the
patched router forward, and the block forwards of Llama-4 and of gpt-oss on its MXFP4 checkpoint."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import kerngen
from kerngen.ops import permute as _pm
from kerngen.ops import routing as _rt
from . import transformers_experts as kx
from .transformers_experts import _KERNEL_WEIGHTS, TILE, BlockState, state


@dataclass(frozen=True)
class Router:
    """How one router class computes its logits, which kerngen method reproduces its top-k, and the dtype of
    the weights it returns ("float32", "logits": the logits' dtype, "hidden": the hidden states' dtype)."""
    logits: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    routing: Callable[[nn.Module], dict]          # route() keywords; raises _Refuse where nothing maps exactly
    weights: str
    bias: Callable[[nn.Module, tuple], torch.Tensor | None] = lambda router, args: None


class _Refuse(Exception):
    """Raised by a Router.routing function: this instance's settings map onto no kerngen method."""


def _linear(r, x):
    return F.linear(x, r.weight)


def _linear_fp32(r, x):                        # routers that keep an fp32 weight and upcast the hidden states
    return F.linear(x.float(), r.weight.float())


def _sigmoid_groups(r) -> dict:
    """DeepSeek-V3 / GLM-4.5 / Kimi: sigmoid, correction bias for selection, optional expert groups."""
    E, K = r.num_experts, r.top_k
    n, g = r.num_group or 1, r.topk_group or 1
    if K > g * (E // n):
        raise _Refuse(f"top_k={K} exceeds topk_group * experts per group = {g * (E // n)}; transformers then "
                      "picks masked experts with their unmasked weights")
    grouped = 1 < n and g < n                 # keeping every group selects as the ungrouped method does
    return dict(top_k=K, method="grouped_sigmoid_bias" if grouped else "sigmoid_bias", n_group=n if grouped else 1,
                topk_group=g if grouped else 1, routed_scaling_factor=_rsf(r.routed_scaling_factor),
                renormalize=bool(r.norm_topk_prob))


def _rsf(v) -> float:
    if not (isinstance(v, (int, float)) and 0 < v < float("inf")):
        raise _Refuse(f"routed_scaling_factor={v!r}; kerngen scales by a positive finite factor")
    return float(v)


def _softmax_topk(renormalize: bool | None = None):
    """Softmax over all experts, top-k, renormalized when the router's norm_topk_prob says (or always)."""
    return lambda r: dict(top_k=r.top_k, method="softmax_topk",
                          renormalize=bool(r.norm_topk_prob if renormalize is None else renormalize))


def _topk_softmax(r) -> dict:
    return dict(top_k=r.top_k, method="topk_softmax")


def _deepseek_v2(r) -> dict:
    if r.topk_method != "greedy":
        raise _Refuse(f"topk_method={r.topk_method!r} scores a group by its largest softmax probability and masks "
                      "the other groups with 0; kerngen groups only sigmoid + bias keys (sum of the top two)")
    return dict(top_k=r.top_k, method="softmax_topk", renormalize=False,
                routed_scaling_factor=_rsf(r.routed_scaling_factor))


# Router class name -> mapping; each entry mirrors that class's forward in transformers 5 (read it there).
ROUTERS = {
    "DeepseekV3TopkRouter": Router(_linear_fp32, _sigmoid_groups, "float32",
                                   lambda r, a: r.e_score_correction_bias),
    "Glm4MoeTopkRouter": Router(_linear_fp32, _sigmoid_groups, "float32",
                                lambda r, a: r.e_score_correction_bias),
    "NemotronHTopkRouter": Router(_linear_fp32, _sigmoid_groups, "float32", lambda r, a: r.e_score_correction_bias),
    "DeepseekV2TopkRouter": Router(_linear_fp32, _deepseek_v2, "float32"),
    "Qwen3MoeTopKRouter": Router(_linear, _softmax_topk(), "logits"),
    "Qwen3NextTopKRouter": Router(_linear, _softmax_topk(), "logits"),
    "Qwen2MoeTopKRouter": Router(_linear, _softmax_topk(), "logits"),
    "OlmoeTopKRouter": Router(_linear, _softmax_topk(), "logits"),
    "MixtralTopKRouter": Router(_linear, _softmax_topk(True), "float32"),
    "MiniMaxTopKRouter": Router(_linear, _softmax_topk(True), "float32"),
    # it divides by the sum without the 1e-20 kerngen adds: no difference unless the K sigmoids sum below
    # ~1.7e-13 (where 1e-20 stops being under half an ulp of the sum)
    "MiniMaxM2TopKRouter": Router(lambda r, x: F.linear(x.to(r.weight.dtype), r.weight),
                                  lambda r: dict(top_k=r.top_k, method="sigmoid_bias", renormalize=True), "float32",
                                  lambda r, a: a[0]),   # the block passes its e_score_correction_bias
    "GptOssTopKRouter": Router(lambda r, x: F.linear(x, r.weight, r.bias), _topk_softmax, "logits"),
    "GraniteMoeTopKRouter": Router(lambda r, x: F.linear(x, r.weight).float(), _topk_softmax, "hidden"),
}

# Router class name -> why no kerngen method reproduces it (None: these settings have no known reason, and the
# router is refused as unknown, as routers of every other class are).
REFUSED = {
    "PhimoeTopKRouter": lambda r: ("sparsemixer routing (also in eval mode): the second expert comes from a softmax "
                                   "masked by a jitter_eps threshold relative to the best logit"),
    "Ernie4_5_MoeTopKRouter": lambda r: ("experts are selected on softmax + a per-expert bias (moe_statics) and "
                                         "weights renormalized with clamp(min=moe_norm_min)"),
    "Lfm2MoeTopKRouter": lambda r: ("it renormalizes with 1e-6 added to the weight sum (kerngen: 1e-20)"
                                    if r.norm_topk_prob else None),
}
LLAMA4_BLOCK = "Llama4TextMoe"


def _route(logits: torch.Tensor, kw: dict, bias, weights_dtype: torch.dtype, tile: int,
           st: BlockState) -> kerngen.Routing:
    """Top-k and the permutation (tile rows a tile) by kerngen, into the block's workspace; weights in
    `weights_dtype`."""
    logits = _kernel_logits(logits)
    if logits.is_cuda:
        T, E = logits.shape
        wdt = weights_dtype if weights_dtype in _KERNEL_WEIGHTS else torch.float32   # the kernel writes these
        ws = st.workspace(T, E, kw["top_k"], tile, wdt, logits.device)
        r = kerngen.route(logits, bias=bias, tile=tile, workspace=ws, **kw)
        return r if r.topk_weights.dtype == weights_dtype else _with_weights(r, r.topk_weights.to(weights_dtype))
    ids, w = _rt.reference(logits, kw["top_k"], kw["method"], bias, kw.get("n_group", 1), kw.get("topk_group", 1),
                           kw.get("routed_scaling_factor", 1.0), kw.get("renormalize", True))
    return kerngen.Routing(ids, w.to(weights_dtype), **_pm.permute_reference(ids, logits.shape[1], tile), tile=tile)


def _kernel_logits(logits: torch.Tensor) -> torch.Tensor:
    """The logits in a dtype the routing kernels read (fp32 or bf16)."""
    return logits if logits.dtype in (torch.float32, torch.bfloat16) else logits.float()


def _with_weights(r: kerngen.Routing, w: torch.Tensor) -> kerngen.Routing:
    return _pm.mark_checked(dataclasses.replace(r, topk_weights=w), r.topk_ids.device)


def _router_forward(router: nn.Module, spec: Router, kw: dict, experts: nn.Module):
    original = type(router).forward
    weights = {"float32": lambda logits, x: torch.float32, "logits": lambda logits, x: logits.dtype,
               "hidden": lambda logits, x: x.dtype}[spec.weights]

    def forward(hidden_states, *args):
        if router.training:
            return original(router, hidden_states, *args)
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        logits = spec.logits(router, x)
        if torch.compiler.is_compiling():   # the custom op, nothing kept between calls (see _compiled_forward)
            ids, w = torch.ops.kerngen.route(_kernel_logits(logits),
                                             kw["top_k"], kw["method"], spec.bias(router, args), kw.get("n_group", 1),
                                             kw.get("topk_group", 1), kw.get("routed_scaling_factor", 1.0),
                                             kw.get("renormalize", True))
            return logits, w.to(weights(logits, x)), ids
        st = state(experts, experts)
        r = _route(logits, kw, spec.bias(router, args), weights(logits, x), st.tile(experts, x, kw["top_k"]), st)
        st.routing = r   # the experts take this permutation when they get these very ids
        return logits, r.topk_weights, r.topk_ids

    forward._kerngen = True
    return forward


def _llama4_forward(block: nn.Module):
    """Llama4TextMoe.forward on kerngen: top1_sigmoid routing, the weight applied to the expert's input."""
    original = type(block).forward
    kw = dict(top_k=1, method="top1_sigmoid")
    ex = block.experts

    def gate(h):
        g, u = h.chunk(2, dim=-1)
        return u * ex.act_fn(g)

    def forward(hidden_states):
        if block.training or torch.compiler.is_compiling():   # compiled: transformers' block (its grouped GEMMs)
            return original(block, hidden_states)
        x = hidden_states.reshape(-1, block.hidden_dim)
        logits = nn.Linear.forward(block.router, x)
        st = state(block, ex)
        tile = st.tile(ex, x, 1)   # kerngen.experts' tile where its kernels serve these tokens (weights read in place)
        r = _route(logits, kw, None, logits.dtype, tile, st)
        if tile != TILE:   # the weight scales each token's row before the GEMM (input_weights), as transformers does
            g = kerngen.experts(x, r, *kx.expert_weights(ex), activation=st.activation,
                                input_weights=r.topk_weights[:, 0], out=st.rows(r, x.shape[1], x))
        else:   # K = 1: permuted row j holds token permuted_to_token[j], so scaling x scales every row
            g = kx._expert_rows(x * r.topk_weights, r, ex.gate_up_proj, ex.down_proj, gate, True)
        out = block.shared_expert(x)
        out.add_(kx._finalize(g, r.expanded_to_permuted, torch.ones_like(r.topk_weights, dtype=torch.float32)))
        return out, logits

    forward._kerngen = True
    return forward


def _mxfp4_forward(block: nn.Module):
    """Mxfp4GptOssMLP.forward (gpt-oss's block on its MXFP4 checkpoint) on kerngen: the block's router (kerngen's
    where enable patched it: top-k of the logits, softmax over those K, weights in the logits' dtype, as
    triton_kernels' routing and the router module give them), then its experts with those ids and weights on
    kerngen.experts' MXFP4 path (experts_forward) instead of triton_kernels' matmul_ogs; returns (output [B, S, H]
    in the hidden states' dtype, router logits) as the block does."""
    original = block.forward   # the block's own (its class's, or one set on the instance)

    def forward(hidden_states):
        if block.training:
            return original(hidden_states)
        H = block.router.hidden_dim
        x = hidden_states.reshape(-1, H)
        logits, weights, ids = block.router(x)
        out = kx.experts_forward(block.experts, x, ids, weights)
        return out.reshape(hidden_states.shape[0], -1, H), logits

    forward._kerngen = True
    return forward
