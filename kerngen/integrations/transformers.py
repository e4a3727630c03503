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
CPU tensors run kerngen's torch references (`routing.reference`, `permute_reference`, `finalize.reference`).

Results differ from transformers only where kerngen is deliberately stricter (equal scores: the lower expert
index wins; NaN logits count as -inf; a row whose experts are all masked gets weight 0) and by rounding (fp32
accumulation; a different order of the same sums). Inference only: kerngen's kernels have no backward, so in
training mode routers run transformers' code and experts its "grouped_mm" implementation.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn
try:
    from transformers.integrations import moe as hf_moe
except ModuleNotFoundError as e:
    if (e.name or "").split(".")[0] != "transformers":
        raise
    raise ModuleNotFoundError("kerngen.integrations.transformers needs transformers 5 or newer, which is not "
                              "installed: pip install 'kerngen[transformers]'", name=e.name) from None

import kerngen
from kerngen.errors import KerngenError
from kerngen.ops import experts as _ex
from kerngen.ops import finalize as _fin
from kerngen.ops import permute as _pm
from kerngen.ops import routing as _rt

NAME = "kerngen"
# torch._grouped_mm takes groups of any size, so experts need no padding rows: T*K permuted rows exactly, and
# tile_to_expert is the expert of each row. Where kerngen.experts' kernels serve the block, the tile is theirs.
TILE = 1
_KERNEL_WEIGHTS = (torch.float32, torch.bfloat16)


class UnsupportedModelError(KerngenError):
    """A model family whose router kerngen cannot reproduce exactly (or a model with no MoE block)."""

    def __init__(self, family: str, module: str, reason: str):
        self.family, self.module, self.reason = family, module, reason
        super().__init__(f"kerngen.integrations.transformers: model family '{family}' ({module}) is not supported: "
                         f"{reason}")


# ------------------------------------------------------------------------------------------------ routers
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


class BlockState:
    """What one MoE block keeps between forwards, so a forward only launches: the activation of its experts'
    kernels (None: the grouped-GEMM path), their dispatch, the router's workspaces (grown to the most tokens
    seen) and the permutation the router hands to the experts."""
    __slots__ = ("activation", "fp8", "_dispatch", "_workspaces", "_rows", "routing")

    def __init__(self, experts: nn.Module | None):
        fp8 = fp8_activation(experts) if experts is not None else None
        self.fp8 = fp8 is not None   # transformers' FP8Experts: kerngen.experts' fp8 kernels at every token count
        self.activation = fp8 or (kernel_activation(experts) if experts is not None else None)
        self._dispatch = None
        self._workspaces: dict[tuple, kerngen.RoutingWorkspace] = {}
        self._rows: dict[int, torch.Tensor] = {}
        self.routing: kerngen.Routing | None = None   # set by the router, taken by the experts

    def tile(self, experts: nn.Module | None, x: torch.Tensor) -> int:
        """The permutation's tile: kerngen.experts' (its rule's) where its kernels serve these tokens, else TILE."""
        if self.activation is None or not x.is_cuda or x.dtype != torch.bfloat16:
            return TILE
        d = self._dispatch
        if d is None:
            w = experts.gate_up_proj
            if w.dtype not in _ex.FORMATS or w.shape[-1] % 8:
                return TILE
            d = self._dispatch = _ex.dispatch(w.shape[-1], w.shape[-2] // 2, self.activation, x.get_device(),
                                              _ex.FORMATS[w.dtype])
        s = d.spec(x.shape[0])
        return TILE if s is None else _ex.tile_of(s)

    def workspace(self, T: int, E: int, K: int, tile: int, weights_dtype: torch.dtype, device: torch.device):
        """The routing workspace of this tile and weight dtype, with room for T tokens (kept; grown by doubling)."""
        key = (tile, weights_dtype, E, K)
        ws = self._workspaces.get(key)
        if ws is None or ws.max_tokens < T or ws.device != device:
            size = max(T, 1) if ws is None else max(T, 2 * ws.max_tokens)
            ws = self._workspaces[key] = kerngen.RoutingWorkspace(size, E, K, tile, weights_dtype=weights_dtype,
                                                                  device=device)
        return ws

    def rows(self, routing: kerngen.Routing, H: int, like: torch.Tensor) -> torch.Tensor:
        """The expert output rows [rows, H] of this call, a buffer kept per row count (finalize reads it at once)."""
        n = routing.permuted_to_token.shape[0]
        out = self._rows.get(n)
        if out is None or out.shape[1] != H or out.device != like.device:
            out = self._rows[n] = torch.empty((n, H), dtype=like.dtype, device=like.device)
        return out


def state(module: nn.Module, experts: nn.Module | None = None) -> BlockState:
    """The BlockState a module (an experts module, or Llama-4's block) keeps, made on its first forward."""
    st = module.__dict__.get("_kerngen_state")
    if st is None:
        st = module.__dict__["_kerngen_state"] = BlockState(experts)
    return st


def _route(logits: torch.Tensor, kw: dict, bias, weights_dtype: torch.dtype, tile: int = TILE,
           st: BlockState | None = None) -> kerngen.Routing:
    """Top-k and the permutation (tile rows a tile) by kerngen, into the block's workspace; weights in
    `weights_dtype`."""
    if logits.dtype not in (torch.float32, torch.bfloat16):
        logits = logits.float()
    if logits.is_cuda:
        T, E = logits.shape
        wdt = weights_dtype if weights_dtype in _KERNEL_WEIGHTS else torch.float32   # the kernel writes these
        ws = (st or BlockState(None)).workspace(T, E, kw["top_k"], tile, wdt, logits.device)
        r = kerngen.route(logits, bias=bias, tile=tile, workspace=ws, **kw)
        return r if r.topk_weights.dtype == weights_dtype else _with_weights(r, r.topk_weights.to(weights_dtype))
    ids, w = _rt.reference(logits, kw["top_k"], kw["method"], bias, kw.get("n_group", 1), kw.get("topk_group", 1),
                           kw.get("routed_scaling_factor", 1.0), kw.get("renormalize", True))
    return kerngen.Routing(ids, w.to(weights_dtype), **_pm.permute_reference(ids, logits.shape[1], tile), tile=tile)


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
        st = state(experts, experts)
        r = _route(logits, kw, spec.bias(router, args), weights(logits, x), st.tile(experts, x), st)
        st.routing = r   # the experts take this permutation when they get these very ids
        return logits, r.topk_weights, r.topk_ids

    forward._kerngen = True
    return forward


# ------------------------------------------------------------------------------------------------ experts
_GATES = {"SiLUActivation": "silu", "SiLU": "silu", "GELUTanh": "gelu", "PytorchGELUTanh": "gelu"}


def fp8_activation(experts: nn.Module) -> str | None:
    """kerngen.experts' activation for transformers' FP8Experts that its fp8 kernels serve, else None: e4m3 gate
    and up concatenated, fp32 scales per 128 x 128 block, dynamic activations, the plain gate (no soft cap,
    clamp or OAI SwiGLU) with SiLU or tanh GeLU."""
    w = getattr(experts, "gate_up_proj", None)
    scale = getattr(experts, "gate_up_proj_scale_inv", None)
    if (not isinstance(w, torch.Tensor) or w.dtype != torch.float8_e4m3fn or not getattr(experts, "has_gate", False)
            or getattr(experts, "has_bias", True) or not isinstance(scale, torch.Tensor)
            or scale.dtype != torch.float32 or tuple(getattr(experts, "block_size", None) or ()) != (128, 128)
            or getattr(experts, "activation_scheme", None) != "dynamic"
            or any(getattr(experts, a, None) is not None for a in ("gate_softcap", "swiglu_alpha", "limit"))):
        return None
    return _GATES.get(type(getattr(experts, "act_fn", None)).__name__)


def kernel_activation(experts: nn.Module) -> str | None:
    """kerngen.experts' activation for an experts module its kernels serve, else None: gate and up concatenated
    as [E, 2I, H] (not transposed), the default gate with SiLU or tanh GeLU, no post-expert norm."""
    if (not getattr(experts, "has_gate", False) or not getattr(experts, "is_concatenated", True)
            or getattr(experts, "is_transposed", True) or getattr(experts, "has_post_expert_norm", True)
            or getattr(type(experts), "_apply_gate", None) is not hf_moe._default_apply_gate):
        return None
    return _GATES.get(type(getattr(experts, "act_fn", None)).__name__)


def _permutation(experts: nn.Module, st: BlockState, top_k_index: torch.Tensor, tile: int) -> kerngen.Routing:
    """The permutation of top_k_index: the one the kerngen router built from these very ids (and this tile), else
    a new one in the block's workspace."""
    r, st.routing = st.routing, None
    if r is not None and r.topk_ids is top_k_index and r.tile == tile:
        return r
    ids = top_k_index.to(torch.int32).contiguous()
    if ids.is_cuda:
        ws = st.workspace(ids.shape[0], experts.num_experts, ids.shape[1], tile, torch.float32, ids.device)
        return kerngen.permute(ids, num_experts=experts.num_experts, tile=tile, workspace=ws)
    return kerngen.Routing(ids, ids.new_empty((ids.shape[0], 0), dtype=torch.float32),
                           **_pm.permute_reference(ids, experts.num_experts, tile), tile=tile)


def _grouped_mm_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm's bf16 path on sm_90+: 16-byte aligned rows in and out."""
    return (x.is_cuda and x.dtype == w.dtype == torch.bfloat16 and w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0
            and torch.cuda.get_device_capability(x.device) >= (9, 0))


def _project(x, weight, transposed: bool, r: kerngen.Routing, bias, bounds: list | None):
    """Rows of x (grouped by expert as r.expert_offsets says) times their expert's matrix, plus its bias.

    weight is [E, out, in] (transformers' default layout, x @ weight[e].T) or, transposed, [E, in, out].
    bounds: the offsets on the host for the per-expert loop, None for the grouped GEMM.
    """
    if bounds is None:
        w = weight if transposed else weight.transpose(-2, -1)
        out = torch._grouped_mm(x.contiguous(), w, offs=r.expert_offsets[1:])
        if bias is not None:
            out = out + bias[r.tile_to_expert.clamp(min=0)]          # TILE = 1: the expert of each row
        return out
    rows_out = weight.shape[-1] if transposed else weight.shape[-2]
    out = x.new_zeros(x.shape[0], rows_out)
    for e, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if b > a:   # the arithmetic of transformers' per-expert loop
            y = x[a:b] @ weight[e] if transposed else F.linear(x[a:b], weight[e])
            out[a:b] = y if bias is None else y + bias[e]
    return out


def _expert_rows(x, r: kerngen.Routing, gate_up, down, gate: Callable, transposed: bool, gate_up_bias=None,
                 down_bias=None, post_norm: Callable | None = None) -> torch.Tensor:
    """gemm2_out [rows, H]: every permuted row through its expert (up projection, gate, down projection)."""
    # x[rows] gathers with 16-byte vectors, index_select's few-rows kernel does not; padding rows compute token 0
    xs = x[r.permuted_to_token.clamp(min=0)].to(down.dtype)
    loop = not (_grouped_mm_applies(xs, gate_up) and _grouped_mm_applies(xs, down))
    bounds = r.expert_offsets.tolist() if loop else None
    h = gate(_project(xs, gate_up, transposed, r, gate_up_bias, bounds))
    y = _project(h, down, transposed, r, down_bias, bounds)
    return y if post_norm is None else post_norm(y)


def _finalize(g: torch.Tensor, e2p: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """kerngen.finalize where its kernel applies (CUDA, bf16/fp16 rows of a width divisible by 8), else its
    torch reference (same arithmetic)."""
    if w.dtype not in _KERNEL_WEIGHTS:
        w = w.float()
    w = w.contiguous()
    if g.is_cuda and g.dtype in (torch.bfloat16, torch.float16) and g.shape[1] % 8 == 0:
        return kerngen.finalize(g, e2p, w)
    return _fin.reference(g, e2p, w)


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The "kerngen" experts implementation (transformers' signature; `self` is the family's experts module)."""
    if self.training:
        train = _FP8_TRAINING if getattr(self, "gate_up_proj", None) is not None and \
            self.gate_up_proj.dtype == torch.float8_e4m3fn else hf_moe.grouped_mm_experts_forward
        return train(self, hidden_states, top_k_index, top_k_weights)
    st = state(self, self)
    tile = st.tile(self, hidden_states)
    r = _permutation(self, st, top_k_index, tile)
    bias = (lambda name: getattr(self, name)) if self.has_bias else (lambda name: None)
    if st.fp8:   # fp8 weights: kerngen.experts at every size (its fp8 kernels, else its per-expert reference)
        x = hidden_states.to(torch.bfloat16).contiguous()   # its activations are bf16
        g = kerngen.experts(x, r, self.gate_up_proj, self.down_proj, activation=st.activation,
                            w13_scale=self.gate_up_proj_scale_inv, w2_scale=self.down_proj_scale_inv,
                            out=st.rows(r, x.shape[1], x) if x.is_cuda else None)
        return _finalize(g, r.expanded_to_permuted, top_k_weights).to(hidden_states.dtype)
    if tile != TILE:   # kerngen.experts' kernels: gather, both projections and the gate in two launches
        x = hidden_states.contiguous()
        g = kerngen.experts(x, r, self.gate_up_proj, self.down_proj, activation=st.activation,
                            b13=bias("gate_up_proj_bias"), b2=bias("down_proj_bias"),
                            out=st.rows(r, x.shape[1], x))
        return _finalize(g, r.expanded_to_permuted, top_k_weights).to(hidden_states.dtype)
    up, up_bias, act = (("gate_up_proj", "gate_up_proj_bias", self._apply_gate) if self.has_gate
                        else ("up_proj", "up_proj_bias", self.act_fn))
    g = _expert_rows(hidden_states, r, getattr(self, up), self.down_proj, act, self.is_transposed, bias(up_bias),
                     bias("down_proj_bias"), self.post_expert_norm if self.has_post_expert_norm else None)
    return _finalize(g, r.expanded_to_permuted, top_k_weights).to(hidden_states.dtype)


hf_moe.ExpertsInterface.register(NAME, experts_forward)
try:   # transformers' fine-grained fp8 experts dispatch through an interface of their own
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8ExpertsInterface
    FP8ExpertsInterface.register(NAME, experts_forward)
    _FP8_TRAINING = ALL_FP8_EXPERTS_FUNCTIONS["grouped_mm"]
except ImportError:   # a transformers without it has no FP8Experts to serve
    _FP8_TRAINING = hf_moe.grouped_mm_experts_forward


# ------------------------------------------------------------------------------------------------ Llama-4
def _llama4_forward(block: nn.Module):
    """Llama4TextMoe.forward on kerngen: top1_sigmoid routing, the weight applied to the expert's input."""
    original = type(block).forward
    kw = dict(top_k=1, method="top1_sigmoid")
    ex = block.experts

    def gate(h):
        g, u = h.chunk(2, dim=-1)
        return u * ex.act_fn(g)

    def forward(hidden_states):
        if block.training:
            return original(block, hidden_states)
        x = hidden_states.reshape(-1, block.hidden_dim)
        logits = nn.Linear.forward(block.router, x)
        r = _route(logits, kw, None, logits.dtype, TILE, state(block))
        # K = 1: permuted row j holds token permuted_to_token[j], so scaling x by its weight scales every row
        g = _expert_rows(x * r.topk_weights, r, ex.gate_up_proj, ex.down_proj, gate, True)
        out = block.shared_expert(x)
        out.add_(_finalize(g, r.expanded_to_permuted, torch.ones_like(r.topk_weights, dtype=torch.float32)))
        return out, logits

    forward._kerngen = True
    return forward


# ------------------------------------------------------------------------------------------------ enable
def _dispatches(m: nn.Module) -> bool:
    """An experts module decorated by transformers' use_experts_implementation."""
    return hasattr(m, "has_gate") and hasattr(m, "_is_expert_parallel") and hasattr(type(m), "_apply_gate")


def _family(model: nn.Module, m: nn.Module) -> str:
    cfg = getattr(m, "config", None) or getattr(model, "config", None)
    return getattr(cfg, "model_type", None) or type(model).__name__


def _plan(model: nn.Module, routers: bool) -> list[tuple[str, nn.Module, str, object]]:
    """(name, module, kind, payload) of every patch enable makes; raises before anything is patched."""
    plan = []
    for name, block in model.named_modules():
        ex = getattr(block, "experts", None)
        if type(block).__name__ == LLAMA4_BLOCK:
            if block.top_k != 1:
                raise UnsupportedModelError(_family(model, block), LLAMA4_BLOCK, f"num_experts_per_tok={block.top_k}; "
                                            "kerngen's top1_sigmoid picks one expert, and ranking sigmoids "
                                            "(sigmoid_bias) ties where transformers' top-k of the logits does not")
            plan.append((name, block, "llama4", None))
            continue
        if not isinstance(ex, nn.Module) or not _dispatches(ex):
            continue
        plan.append((_join(name, "experts"), ex, "experts", None))
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
                                    "or Llama4TextMoe) was found")
    return plan


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _patched(m: nn.Module) -> bool:
    return getattr(m.__dict__.get("forward"), "_kerngen", False)


def enable(model: nn.Module, *, routers: bool = True) -> list[str]:
    """Run every MoE block of `model` on kerngen; returns the qualified names of the patched modules.

    Experts get the "kerngen" experts implementation (set on their config); with routers=True (default) each
    router's top-k is kerngen's routing too, and a family whose router maps onto no kerngen method raises
    UnsupportedModelError naming it and the reason (nothing is patched then). routers=False keeps
    transformers' routers (any family whose experts dispatch through ExpertsInterface). Calling it again
    changes nothing and returns the same names.
    """
    plan = _plan(model, routers)
    previous = {}   # experts of one model share a config: read every previous value before setting any
    for _, m, kind, _ in plan:
        if kind == "experts":
            previous.setdefault(id(m.config), m.config._experts_implementation)
    for _, m, kind, payload in plan:
        if kind == "experts":
            if previous[id(m.config)] != NAME:
                m._kerngen_previous = previous[id(m.config)]
            m.config._experts_implementation_internal = NAME   # this config only, as set_experts_implementation does
        elif not _patched(m):
            m.forward = _llama4_forward(m) if kind == "llama4" else _router_forward(m, *payload)
    return [name for name, *_ in plan]


def disable(model: nn.Module) -> list[str]:
    """Undo enable: transformers' routers and the previous experts implementation; returns the restored names."""
    restored = []
    for name, m in model.named_modules():
        if _patched(m):
            del m.forward
            restored.append(name)
        if "_kerngen_previous" in m.__dict__:
            m.config._experts_implementation_internal = m.__dict__.pop("_kerngen_previous")
            restored.append(name)
        m.__dict__.pop("_kerngen_state", None)
    return restored
