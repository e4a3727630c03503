"""The experts side of kerngen.integrations.transformers: the "kerngen" experts implementation (registered in
transformers' ExpertsInterface and FP8ExpertsInterface when imported; gpt-oss's MXFP4 experts, which dispatch through
neither, reach it through their block's patched forward), and the state each MoE block keeps between forwards
(BlockState: its experts' static shape, the router's workspaces, the permutation handed to the experts)."""
from __future__ import annotations

import warnings
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
from kerngen.errors import InputError
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
    kernels (None: the grouped-GEMM path), kerngen.experts' arguments for quantized experts, their static shape, the
    router's workspaces (grown to the most tokens seen) and the permutation the router hands to the experts."""
    __slots__ = ("activation", "gate", "layout", "quantized", "_shape", "_workspaces", "_rows", "_kept", "routing")

    def __init__(self, experts: nn.Module | None):
        # FP8Experts, Mxfp4GptOssExperts: kerngen.experts at every token count (its kernels, else its reference)
        self.quantized = quantized_arguments(experts) if experts is not None else None
        if self.quantized is not None:
            self.gate = {k: v for k, v in self.quantized.items() if k in _GATE_ARGS}
            self.layout = "nk"   # quantized weights: their checkpoint layout
        else:
            self.gate = kernel_gate(experts) if experts is not None else None
            self.layout = "nk" if self.gate is None else weights_layout(experts)
            if self.layout is None:   # transposed weights kerngen.experts cannot read in place: the grouped GEMM
                self.gate = None
        self.activation = None if self.gate is None else self.gate["activation"]
        self._shape = None
        self._workspaces: dict[tuple, kerngen.RoutingWorkspace] = {}
        self._rows: torch.Tensor | None = None
        self._kept: list = []   # workspaces and rows outgrown: kept (a CUDA graph captured before may use them)
        self.routing: kerngen.Routing | None = None   # set by the router, taken by the experts

    def tile(self, experts: nn.Module | None, x: torch.Tensor, top_k: int) -> int:
        """The permutation's tile: kerngen.experts' (its rule's, for these tokens, the module's experts and top_k)
        where its kernels serve these tokens, else TILE."""
        if self.activation is None or not x.is_cuda or x.dtype != torch.bfloat16:
            return TILE
        shape = self._shape
        if shape is None:
            # [E, 2I, H] (a transposed view where the module keeps [E, H, 2I]), MXFP4 blocks [E, 2I, H/32, 16]
            w = expert_weights(experts)[0] if self.quantized is None else self.quantized["w13"]
            H = w.shape[2] * _ex.MX_GROUP if w.dtype == torch.uint8 else w.shape[2]
            if w.dtype not in _ex.FORMATS or H % 8:
                return TILE
            shape = self._shape = dict(H=H, I=w.shape[1] // 2, activation=self.activation, fmt=_ex.FORMATS[w.dtype],
                                       layout=self.layout, experts=w.shape[0])
        # the dispatch object looked up, not kept: kerngen.clear() forgets it with what it holds
        s = _ex.dispatch(x.get_device(), **shape, top_k=top_k).spec(x.shape[0])
        return TILE if s is None else _ex.tile_of(s)

    def workspace(self, T: int, E: int, K: int, tile: int, weights_dtype: torch.dtype, device: torch.device):
        """The routing workspace of this tile and weight dtype, with room for T tokens (kept; grown by doubling)."""
        key = (tile, weights_dtype, E, K)
        ws = self._workspaces.get(key)
        if ws is None or ws.max_tokens < T or ws.device != device:
            size = max(T, 1) if ws is None else max(T, 2 * ws.max_tokens)
            if ws is not None:
                self._kept.append(ws)
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
            if buf is not None:
                self._kept.append(buf)
            rows = n if buf is None else max(n, 2 * buf.shape[0])   # (doubling: a bounded number kept)
            buf = self._rows = torch.empty((rows, H), dtype=like.dtype, device=like.device)
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


# transformers' gpt-oss experts on the MXFP4 checkpoint (integrations/mxfp4.py); their block, Mxfp4GptOssMLP, calls
# OpenAI's triton_kernels and dispatches through no interface: enable patches the block (transformers_routers)
MXFP4_EXPERTS = "Mxfp4GptOssExperts"
_MXFP4_KEPT = "_kerngen_mxfp4"   # the module's kerngen.experts arguments, kept on it (mxfp4_arguments)
_GATE_ARGS = ("activation", "interleaved", "alpha", "limit")


def mxfp4_arguments(experts: nn.Module) -> dict | None:
    """kerngen.experts' arguments for transformers' Mxfp4GptOssExperts, None for any other module: w13 / w2 and
    their scales the checkpoint's blocks and e8m0 scales (mxfp4_checkpoint), b13 / b2 its biases in bf16 (the
    checkpoints' are bf16, which transformers widens to fp32 exactly), gpt-oss's gate (interleaved, the module's
    alpha and limit). Made on the first call and kept on the module (enable makes them, outside any compiled region
    or CUDA-graph capture; disable drops them), so weights changed afterwards are not seen. An InputError names the
    module's attribute that is missing or of the wrong shape or dtype."""
    if type(experts).__name__ != MXFP4_EXPERTS:
        return None
    args = experts.__dict__.get(_MXFP4_KEPT)
    if args is None:
        E, H, I = experts.num_experts, experts.hidden_size, experts.intermediate_size
        w13, s13 = mxfp4_checkpoint(experts, "gate_up_proj", 2 * I, H)
        w2, s2 = mxfp4_checkpoint(experts, "down_proj", H, I)
        b13, b2 = (_bias(experts, name, (E, n)) for name, n in (("gate_up_proj_bias", 2 * I), ("down_proj_bias", H)))
        args = dict(w13=w13, w2=w2, w13_scale=s13, w2_scale=s2, b13=b13, b2=b2, activation="gpt_oss",
                    interleaved=True, alpha=float(experts.alpha), limit=float(experts.limit))
        if not torch.compiler.is_compiling():
            experts.__dict__[_MXFP4_KEPT] = args
    return args


def mxfp4_checkpoint(experts: nn.Module, proj: str, N: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks [E, N, K/32, 16], scales [E, N, K/32]), uint8, of one projection of an Mxfp4GptOssExperts as the
    checkpoint holds them: its `{proj}_blocks` and `{proj}_scales` (the checkpoint's names) where it has them, else
    read back from the triton_kernels tensors transformers loads them into (`{proj}`,
    `{proj}_precision_config.weight_scale`) as transformers' Mxfp4ReverseDeserialize reads them for saving: a copy,
    the module keeping its own (the experts' quantized bytes are then twice in memory)."""
    blocks, scales = getattr(experts, f"{proj}_blocks", None), getattr(experts, f"{proj}_scales", None)
    source = ""
    if blocks is None and scales is None:
        w = getattr(experts, proj, None)
        s = getattr(getattr(experts, f"{proj}_precision_config", None), "weight_scale", None)
        if _triton_tensor(w) and _triton_tensor(s):
            scales = _unswizzled(s).transpose(-1, -2).contiguous()
            blocks = _unswizzled(w).transpose(-1, -2).reshape(*scales.shape, -1).contiguous()
            source = f" (read back from {proj} and {proj}_precision_config)"
    E = experts.num_experts
    for name, t, shape, what in ((f"{proj}_blocks", blocks, (E, N, K // _ex.MX_GROUP, _ex.MX_GROUP // 2),
                                  "the checkpoint's MXFP4 blocks, two e2m1 values a byte"),
                                 (f"{proj}_scales", scales, (E, N, K // _ex.MX_GROUP), "the checkpoint's e8m0 scales")):
        if (not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or tuple(t.shape) != shape
                or not t.is_contiguous()):
            got = (f"{t.dtype} {tuple(t.shape)}{'' if t.is_contiguous() else ', not contiguous'}"
                   if isinstance(t, torch.Tensor) else f"{type(t).__name__} (and no triton_kernels tensors "
                   f"{proj} / {proj}_precision_config.weight_scale, as transformers loads the checkpoint)")
            raise InputError(MXFP4_EXPERTS, name, f"contiguous uint8 {shape}: {what}", got + source)
    return blocks, scales


def _triton_tensor(t) -> bool:
    """A triton_kernels Tensor (its data and layout in `storage`), as transformers holds loaded MXFP4 weights."""
    return not isinstance(t, torch.Tensor) and hasattr(getattr(t, "storage", None), "layout")


def _unswizzled(t) -> torch.Tensor:
    return t.storage.layout.unswizzle_data(t.storage.data)


def _bias(experts: nn.Module, name: str, shape: tuple) -> torch.Tensor:
    b = getattr(experts, name, None)
    if not isinstance(b, torch.Tensor) or tuple(b.shape) != shape or not b.is_floating_point():
        raise InputError(MXFP4_EXPERTS, name, f"a floating-point {shape} tensor",
                         f"{b.dtype} {tuple(b.shape)}" if isinstance(b, torch.Tensor) else type(b).__name__)
    return b.detach().to(torch.bfloat16).contiguous()


def quantized_arguments(experts: nn.Module) -> dict | None:
    """kerngen.experts' arguments (weights, scales, biases, gate) for the quantized experts it serves at every
    token count: transformers' FP8Experts (fp8_activation) and gpt-oss's Mxfp4GptOssExperts (mxfp4_arguments);
    None for any other module."""
    mx = mxfp4_arguments(experts)
    if mx is not None:
        return mx
    act = fp8_activation(experts)
    if act is None:
        return None
    return dict(w13=experts.gate_up_proj, w2=experts.down_proj, w13_scale=experts.gate_up_proj_scale_inv,
                w2_scale=experts.down_proj_scale_inv, activation=act)


_LLAMA4_EXPERTS = "Llama4TextExperts"   # Llama4TextMoe's experts: transposed, gate then up, not the interface's
_WEIGHTS = ("gate_up_proj", "down_proj")
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
    if transposed(experts):
        return w13.transpose(1, 2), w2.transpose(1, 2)
    return w13, w2


def transposed(experts: nn.Module) -> bool:
    """The module keeps its weights transposed ([E, H, 2I], [E, I, H]: gpt-oss, Llama-4)."""
    return getattr(experts, "is_transposed", False) or type(experts).__name__ == _LLAMA4_EXPERTS


def relayout(experts: nn.Module, *, back: bool = False) -> bool:
    """Store a transposed module's bf16 / fp16 weights as kerngen.experts reads them fastest, in place: each
    parameter keeps its shape, values and memory, which then holds the [E, 2I, H] / [E, H, I] matrices row by row
    (the parameter a transposed view of them), so expert_weights are contiguous and every kernel rule serves them
    ("nk"). back=True: row-major again, as transformers made them. One expert's matrix at a time goes through a
    buffer of that size; where even that is not there (or a weight is neither row-major nor kerngen's layout),
    the module keeps its layout (read in place: "kn") and a warning says so. Returns whether the module's weights
    are now kerngen's layout."""
    if not transposed(experts) or not all(isinstance(getattr(experts, n, None), torch.Tensor) for n in _WEIGHTS):
        return False
    params = [getattr(experts, n) for n in _WEIGHTS]
    if any(p.dtype not in (torch.bfloat16, torch.float16) or p.dtype != params[0].dtype or p.dim() != 3
           or p.is_meta or type(p) not in (nn.Parameter, torch.Tensor) for p in params):   # (DTensor: as it is)
        return False

    def ours(t):   # kerngen's layout: the transposed view of a contiguous tensor
        return t.transpose(1, 2).is_contiguous()

    todo = [p for p in params if (ours(p) if back else not ours(p))]
    if any(not (ours(p) if back else p.is_contiguous()) for p in todo):
        warnings.warn(f"kerngen: {type(experts).__name__}'s weights kept as they are (strides "
                      f"{[tuple(p.stride()) for p in todo]}: neither row-major nor the transpose of row-major)",
                      RuntimeWarning, stacklevel=3)
        return False
    try:
        buf = torch.empty(max(p[0].numel() for p in todo), dtype=todo[0].dtype, device=todo[0].device) if todo \
            else None
    except torch.OutOfMemoryError:
        warnings.warn(f"kerngen: {type(experts).__name__}'s weights kept as they are (no memory for one expert's "
                      f"matrix, {tuple(todo[0].shape[1:])}); kerngen.experts reads them in place, slower past 16 "
                      "tokens", RuntimeWarning, stacklevel=3)
        return False
    with torch.no_grad():
        for p in todo:
            E, A, B = p.shape   # row-major: [E, A, B]; kerngen's: [E, B, A] row-major, transposed
            src = p.data if not back else p.data.transpose(1, 2)   # the contiguous tensor over the memory now
            flat = src.view(E, A * B)
            tmp = buf[:A * B]
            for e in range(E):   # each expert's matrix transposed into the buffer, then back into its own memory
                tmp.view(src.shape[2], src.shape[1]).copy_(src[e].t())
                flat[e].copy_(tmp)
            p.data = flat.view(E, B, A).transpose(1, 2) if not back else flat.view(E, A, B)
    return all(ours(p) for p in params)


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
    if self.training and type(self).__name__ != MXFP4_EXPERTS:   # MXFP4 experts: inference only in transformers too
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
        tile = st.tile(self, hidden_states, top_k_index.shape[1])
        r = _permutation(self, st, top_k_index, tile)
    # kerngen.experts' kernels (gather, both projections and the gate in two launches) where they serve these
    # tokens; quantized weights (fp8, MXFP4) take kerngen.experts at every size (its kernels, else its per-expert
    # reference) with bf16 activations, and on CPU tensors its checks and reference
    if st.quantized is not None or tile != TILE:
        if st.quantized is not None:
            x, kw = hidden_states.to(torch.bfloat16).contiguous(), st.quantized
        else:
            x, (w13, w2) = hidden_states.contiguous(), expert_weights(self)
            b13, b2 = (self.gate_up_proj_bias, self.down_proj_bias) if self.has_bias else (None, None)
            kw = dict(w13=w13, w2=w2, b13=b13, b2=b2, **st.gate)
        if x.is_cuda:
            g = kerngen.experts(x, r, out=st.rows(r, x.shape[1], x), **kw)
        else:   # a CPU entry point: kerngen.experts' checks, then its reference
            _ex.check(x, r, cuda=False, **kw)
            g = _ex.reference(x, r, **kw)
        return _finalize(g, r.expanded_to_permuted, top_k_weights).to(hidden_states.dtype)
    bias = (lambda name: getattr(self, name)) if self.has_bias else (lambda name: None)
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
    q = quantized_arguments(self)   # fp8 and MXFP4 experts: the op at every token count
    w13 = getattr(self, "gate_up_proj", None)
    if q is None and hidden_states.dtype == getattr(w13, "dtype", None) == torch.bfloat16:
        gate = kernel_gate(self)
        if gate is not None and weights_layout(self) is not None:
            w13, w2 = expert_weights(self)   # [E, 2I, H] and [E, H, I] (views where the module keeps them transposed)
            if w13.shape[-1] % 8 == 0:
                b13, b2 = (self.gate_up_proj_bias, self.down_proj_bias) if self.has_bias else (None, None)
                q = dict(w13=w13, w2=w2, b13=b13, b2=b2, **gate)
    if q is not None:
        x = hidden_states.to(torch.bfloat16).contiguous()
        rest = {k: q[k] for k in ("interleaved", "alpha", "limit") if k in q}   # gpt-oss's gate
        y = torch.ops.kerngen.moe_experts(x, top_k_index, top_k_weights, q["w13"], q["w2"], q["activation"],
                                          q.get("b13"), q.get("b2"), q.get("w13_scale"), q.get("w2_scale"), **rest)
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


