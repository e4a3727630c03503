"""The experts side of kerngen.integrations.transformers: the "kerngen" experts implementation (registered in
transformers' ExpertsInterface and FP8ExpertsInterface when imported), and the state each MoE block keeps between
forwards (BlockState: its experts' dispatch, the router's workspaces, the permutation handed to the experts)."""
from __future__ import annotations

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
import kerngen.torch_ops  # noqa: F401  (registers kerngen::moe_experts and kerngen::route for the compiled path)
from kerngen.ops import experts as _ex
from kerngen.ops import finalize as _fin
from kerngen.ops import permute as _pm

NAME = "kerngen"
# torch._grouped_mm takes groups of any size, so experts need no padding rows: T*K permuted rows exactly, and
# tile_to_expert is the expert of each row. Where kerngen.experts' kernels serve the block, the tile is theirs.
TILE = 1
_KERNEL_WEIGHTS = (torch.float32, torch.bfloat16)


class BlockState:
    """What one MoE block keeps between forwards, so a forward only launches: the activation of its experts'
    kernels (None: the grouped-GEMM path), their dispatch, the router's workspaces (grown to the most tokens
    seen) and the permutation the router hands to the experts."""
    __slots__ = ("activation", "gate", "layout", "fp8", "_dispatch", "_workspaces", "_rows", "routing")

    def __init__(self, experts: nn.Module | None):
        fp8 = fp8_activation(experts) if experts is not None else None
        self.fp8 = fp8 is not None   # transformers' FP8Experts: kerngen.experts' fp8 kernels at every token count
        self.gate = dict(activation=fp8) if fp8 else (kernel_gate(experts) if experts is not None else None)
        self.activation = None if self.gate is None else self.gate["activation"]
        self.layout = "nk" if self.gate is None or fp8 else weights_layout(experts)
        if self.layout is None:   # transposed weights kerngen.experts cannot read in place: the grouped GEMM
            self.gate = self.activation = None
        self._dispatch = None
        self._workspaces: dict[tuple, kerngen.RoutingWorkspace] = {}
        self._rows: torch.Tensor | None = None
        self.routing: kerngen.Routing | None = None   # set by the router, taken by the experts

    def tile(self, experts: nn.Module | None, x: torch.Tensor) -> int:
        """The permutation's tile: kerngen.experts' (its rule's) where its kernels serve these tokens, else TILE."""
        if self.activation is None or not x.is_cuda or x.dtype != torch.bfloat16:
            return TILE
        d = self._dispatch
        if d is None:
            w = expert_weights(experts)[0]   # [E, 2I, H] (a transposed view where the module keeps [E, H, 2I])
            if w.dtype not in _ex.FORMATS or w.shape[-1] % 8:
                return TILE
            d = self._dispatch = _ex.dispatch(w.shape[-1], w.shape[-2] // 2, self.activation, x.get_device(),
                                              _ex.FORMATS[w.dtype], self.layout)
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
        """The expert output rows [rows, H] of this call: the first rows of one buffer, grown to the most rows seen
        (finalize reads them at once)."""
        n = routing.permuted_to_token.shape[0]
        buf = self._rows
        if (buf is None or buf.shape[0] < n or buf.shape[1] != H or buf.dtype != like.dtype
                or buf.get_device() != like.get_device()):
            buf = self._rows = torch.empty((n, H), dtype=like.dtype, device=like.device)
        return buf[:n]


def state(module: nn.Module, experts: nn.Module | None = None) -> BlockState:
    """The BlockState a module (an experts module, or Llama-4's block) keeps, made on its first forward."""
    st = module.__dict__.get("_kerngen_state")
    if st is None:
        st = module.__dict__["_kerngen_state"] = BlockState(experts)
    return st


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


_LLAMA4_EXPERTS = "Llama4TextExperts"   # Llama4TextMoe's experts: transposed, gate then up, not the interface's
_GPT_OSS = "GptOssExperts"   # its _apply_gate: clamped at limit, sigmoid of alpha times the gate, interleaved columns


def kernel_gate(experts: nn.Module) -> dict | None:
    """kerngen.experts' gate arguments (activation, interleaved, alpha, limit) for an experts module its kernels
    serve, else None: no post-expert norm, and either the default gate (gate and up concatenated; also Llama-4's
    experts) with SiLU or tanh GeLU, or gpt-oss's (interleaved gate and up, clamped at `limit`, sigmoid of
    `alpha` times the gate). Transposed weights are read in place (expert_weights)."""
    if type(experts).__name__ == _LLAMA4_EXPERTS:   # up * act(gate), gate first
        act = _GATES.get(type(getattr(experts, "act_fn", None)).__name__)
        return None if act is None else dict(activation=act, interleaved=False)
    if not getattr(experts, "has_gate", False) or getattr(experts, "has_post_expert_norm", True):
        return None
    gate = getattr(type(experts), "_apply_gate", None)
    if gate is hf_moe._default_apply_gate and getattr(experts, "is_concatenated", True):
        act = _GATES.get(type(getattr(experts, "act_fn", None)).__name__)
        return None if act is None else dict(activation=act, interleaved=False)
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    if (type(experts).__name__ == _GPT_OSS and not getattr(experts, "is_concatenated", True)
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, limit)) and limit > 0):
        return dict(activation="gpt_oss", interleaved=True, alpha=float(alpha), limit=float(limit))
    return None


def kernel_activation(experts: nn.Module) -> str | None:
    """The activation of kernel_gate (None where kerngen.experts' kernels do not serve the module)."""
    g = kernel_gate(experts)
    return None if g is None else g["activation"]


def expert_weights(experts: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up_proj and down_proj as kerngen.experts takes them, [E, 2I, H] and [E, H, I]: the module's own
    tensors, or for transposed modules (gpt-oss, Llama-4: [E, H, 2I], [E, I, H]) their transposed views, which
    kerngen.experts reads in place."""
    w13, w2 = experts.gate_up_proj, experts.down_proj
    if getattr(experts, "is_transposed", False) or type(experts).__name__ == _LLAMA4_EXPERTS:
        return w13.transpose(1, 2), w2.transpose(1, 2)
    return w13, w2


def weights_layout(experts: nn.Module) -> str | None:
    """kerngen.experts' layout of the module's weights ("nk" or "kn"), None where it cannot read them in place."""
    w13, w2 = expert_weights(experts)
    fmt = _ex.FORMATS.get(w13.dtype)
    if fmt is None:
        return None
    try:
        return _ex.weights_layout(w13, w2, fmt)
    except kerngen.InputError:
        return None


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
    if torch.compiler.is_compiling():
        return _compiled_forward(self, hidden_states, top_k_index, top_k_weights)
    st = state(self, self)
    r = st.routing
    if r is not None and r.topk_ids is top_k_index:   # the router's permutation, built at these tokens' tile
        st.routing, tile = None, r.tile
    else:
        tile = st.tile(self, hidden_states)
        r = _permutation(self, st, top_k_index, tile)
    bias = (lambda name: getattr(self, name)) if self.has_bias else (lambda name: None)
    # kerngen.experts' kernels (gather, both projections and the gate in two launches) where they serve these
    # tokens; fp8 weights take kerngen.experts at every size (its fp8 kernels, else its per-expert reference)
    if st.fp8 or tile != TILE:
        x = (hidden_states.to(torch.bfloat16) if st.fp8 else hidden_states).contiguous()   # bf16 activations
        scales = dict(w13_scale=self.gate_up_proj_scale_inv, w2_scale=self.down_proj_scale_inv) if st.fp8 else {}
        w13, w2 = expert_weights(self)
        g = kerngen.experts(x, r, w13, w2, b13=bias("gate_up_proj_bias"), b2=bias("down_proj_bias"),
                            out=st.rows(r, x.shape[1], x) if x.is_cuda else None, **st.gate, **scales)
        return _finalize(g, r.expanded_to_permuted, top_k_weights).to(hidden_states.dtype)
    up, up_bias, act = (("gate_up_proj", "gate_up_proj_bias", self._apply_gate) if self.has_gate
                        else ("up_proj", "up_proj_bias", self.act_fn))
    g = _expert_rows(hidden_states, r, getattr(self, up), self.down_proj, act, self.is_transposed, bias(up_bias),
                     bias("down_proj_bias"), self.post_expert_norm if self.has_post_expert_norm else None)
    return _finalize(g, r.expanded_to_permuted, top_k_weights).to(hidden_states.dtype)


def _compiled_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
    """experts_forward under torch.compile: what the kernels serve is one custom op (kerngen::moe_experts:
    permutation, both projections, finalize), traced without a graph break and keeping nothing between calls
    (the compiled graph's CUDA graphs own the memory); anything else is transformers' "grouped_mm" code."""
    w13 = getattr(self, "gate_up_proj", None)
    fp8 = fp8_activation(self)
    gate = dict(activation=fp8) if fp8 is not None else kernel_gate(self)
    if gate is not None and (fp8 is not None or (hidden_states.dtype == w13.dtype == torch.bfloat16
                                                 and weights_layout(self) is not None)):
        w13, w2 = expert_weights(self)   # [E, 2I, H] and [E, H, I] (views where the module keeps them transposed)
        if fp8 is not None or w13.shape[-1] % 8 == 0:
            b13, b2 = (self.gate_up_proj_bias, self.down_proj_bias) if self.has_bias else (None, None)
            s13, s2 = (self.gate_up_proj_scale_inv, self.down_proj_scale_inv) if fp8 is not None else (None, None)
            x = hidden_states.to(torch.bfloat16).contiguous()
            rest = dict(gate)   # gpt-oss: interleaved, alpha, limit
            y = torch.ops.kerngen.moe_experts(x, top_k_index, top_k_weights, w13, w2, rest.pop("activation"), b13,
                                              b2, s13, s2, **rest)
            return y.to(hidden_states.dtype)
    ids = top_k_index.long()   # transformers' code, written for its routers' int64 ids
    if w13 is not None and w13.dtype == torch.float8_e4m3fn:
        return _FP8_TRAINING(self, hidden_states, ids, top_k_weights)
    return hf_moe.grouped_mm_experts_forward(self, hidden_states, ids, top_k_weights)


hf_moe.ExpertsInterface.register(NAME, experts_forward)
try:   # transformers' fine-grained fp8 experts dispatch through an interface of their own
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8ExpertsInterface
    FP8ExpertsInterface.register(NAME, experts_forward)
    _FP8_TRAINING = ALL_FP8_EXPERTS_FUNCTIONS["grouped_mm"]
except ImportError:   # a transformers without it has no FP8Experts to serve
    _FP8_TRAINING = hf_moe.grouped_mm_experts_forward


