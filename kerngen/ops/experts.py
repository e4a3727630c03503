"""experts: the decode expert GEMMs over the permuted rows of a Routing (deferred finalize).

For every permuted row r of token t = permuted_to_token[r] and local expert e = tile_to_expert[r // tile]:

    h   = xs[t] @ w13[e].T + b13[e]             (fp32; xs = x, or bf16(x * input_weights[t]) for Llama-4)
    a   = bf16(ACT(gate(h), up(h)))             the [rows, I] intermediate
    out = bf16(a @ w2[e].T + b2[e])             (fp32) -> kerngen.finalize / moe_tail

Padding rows (token -1) of `out` are left unwritten by the kernel (zero in the reference); finalize never reads
them. Shapes an "experts" tier rule serves with a tile of at most MAX_TILE rows run templates/experts/mma.cu.j2
(tensor cores, a persistent grid); any other shape on CUDA runs torch._grouped_mm, and CPU tensors run the
reference.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import plan as plan_mod
from .. import tiers
from ..errors import InputError, TierError
from ..launch import Launcher, Params, current_stream
from ._common import arch, check_aligned, check_tensor, resolve, sm_count, table

OP = "experts"
ACTIVATIONS = tiers.EXPERT_ACTIVATIONS
VARIANTS = ("mma",)
MAX_TILE = 16   # rows of a tile the kernels take (two 8-row n-blocks of mma accumulators)
# struct Params of templates/experts/mma.cu.j2 (both kernels)
PARAMS = Params(("x", "ptr"), ("w13", "ptr"), ("b13", "ptr"), ("inw", "ptr"), ("w2", "ptr"), ("b2", "ptr"),
                ("p2t", "ptr"), ("t2e", "ptr"), ("nrows", "ptr"), ("act", "ptr"), ("out", "ptr"), ("tokens", "int"),
                ("experts", "int"), ("interleaved", "int"), ("tiles", "int"), ("a0", "float"), ("a1", "float"))
_BF16 = (torch.bfloat16,)


def activate(h: torch.Tensor, I: int, activation: str, interleaved: bool, alpha: float = 1.702, limit: float = 7.0,
             beta: float = 1.0, linear_beta: float = 0.0) -> torch.Tensor:
    """ACT(gate, up) of fp32 rows h [.., 2I] in fp32. gelu is the tanh approximation (gelu_pytorch_tanh)."""
    g, u = (h[..., 0::2], h[..., 1::2]) if interleaved else (h[..., :I], h[..., I:])
    if activation == "silu":
        return F.silu(g) * u
    if activation == "gelu":
        return F.gelu(g, approximate="tanh") * u
    if activation == "gpt_oss":
        g, u = g.clamp(max=limit), u.clamp(-limit, limit)
        return (u + 1) * (g * torch.sigmoid(alpha * g))
    lin = linear_beta * torch.tanh(u / linear_beta) if linear_beta > 0 else u
    return beta * torch.tanh(g / beta) * torch.sigmoid(g) * lin


def reference(x, routing, w13, w2, *, activation="silu", interleaved=False, b13=None, b2=None, input_weights=None,
              tile=None, alpha=1.702, limit=7.0, beta=1.0, linear_beta=0.0) -> torch.Tensor:
    """Plain torch, row by row of the permutation. Rounding points: xs = bf16(x * input_weights) (fp32 product);
    h = xs @ w13[e].T accumulated in fp32, b13 added in fp32, not rounded; the activation in fp32, rounded once to
    bf16 (the intermediate); out = a @ w2[e].T in fp32, b2 added in fp32, rounded to bf16. Padding rows are 0."""
    p2t, t2e = routing.permuted_to_token.long(), routing.tile_to_expert.long()
    tile = tile or infer_tile(routing)
    I, H = w2.shape[2], w2.shape[1]
    xs = x if input_weights is None else (x.float() * input_weights.float()[:, None]).to(x.dtype)
    out = torch.zeros(p2t.shape[0], H, dtype=x.dtype, device=x.device)
    rows = torch.nonzero(p2t >= 0).flatten()
    experts = t2e[rows // tile]
    for e in experts.unique().tolist():
        r = rows[experts == e]
        h = xs[p2t[r]].float() @ w13[e].float().T
        if b13 is not None:
            h = h + b13[e].float()
        a = activate(h, I, activation, interleaved, alpha, limit, beta, linear_beta).to(x.dtype)
        y = a.float() @ w2[e].float().T
        if b2 is not None:
            y = y + b2[e].float()
        out[r] = y.to(x.dtype)
    return out


def infer_tile(routing) -> int:
    """The routing's tile from its buffer sizes: len(permuted_to_token) = T*K + num_local*(tile - 1)."""
    T, K = routing.expanded_to_permuted.shape
    nl = routing.expert_offsets.shape[0] - 1
    cap = routing.permuted_to_token.shape[0]
    tile = (cap - T * K) // nl + 1 if nl > 0 else 0
    if nl < 1 or (cap - T * K) % nl or not 1 <= tile <= 1024 or routing.tile_to_expert.shape[0] != cap // tile:
        raise InputError(OP, "routing", "the Routing of kerngen.route(..., tile=...) or kerngen.permute (its "
                         "buffer sizes give the tile); or pass tile=", f"permuted_to_token of {cap} rows")
    return tile


def check_args(x, routing, w13, w2, activation, interleaved, b13, b2, input_weights, tile) -> tuple[int, int, int]:
    """Every argument, with a message naming it; returns (tile, H, I)."""
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
    check_tensor(OP, "w13", w13, dtypes=_BF16, ndim=3, device=dev, contiguous=True)
    check_tensor(OP, "w2", w2, dtypes=_BF16, ndim=3, device=dev, contiguous=True)
    if w13.shape[0] != nl:
        raise InputError(OP, "w13", f"[E, 2I, H] with E = {nl}, the routing's local experts",
                         f"shape {tuple(w13.shape)}")
    I = w13.shape[1] // 2
    if w13.shape[1] % 2 or w13.shape[2] != H or I < 1:
        raise InputError(OP, "w13", f"[{nl}, 2I, {H}] (gate_up_proj: 2I rows of x's width H = {H})",
                         f"shape {tuple(w13.shape)}")
    if tuple(w2.shape) != (nl, H, I):
        raise InputError(OP, "w2", f"of shape {(nl, H, I)} (down_proj [E, H, I])", f"shape {tuple(w2.shape)}")
    if H % 8 or I % 8:
        raise InputError(OP, "w13", "H and I multiples of 8 (16-byte vectors)", f"H = {H}, I = {I}")
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
        tile = infer_tile(routing)
    elif not isinstance(tile, int) or isinstance(tile, bool) or not 1 <= tile <= 1024:
        raise InputError(OP, "tile", "the routing's tile, an integer in [1, 1024]", repr(tile))
    if routing.tile_to_expert.shape[0] * tile > routing.permuted_to_token.shape[0]:
        raise InputError(OP, "tile", "the tile the routing was built with", f"{tile}")
    return tile, H, I


def _check_act_params(activation, alpha, limit, beta, linear_beta):
    for name, v, positive in (("alpha", alpha, False), ("limit", limit, activation == "gpt_oss"),
                              ("beta", beta, activation == "situglu"), ("linear_beta", linear_beta, False)):
        if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or (positive and v <= 0)
                or (name == "linear_beta" and v < 0)):
            raise InputError(OP, name, "a finite number (limit, beta > 0; linear_beta >= 0)", repr(v))


def tag_constants(H: int, I: int, tile: int, activation: str) -> tuple[str, dict]:
    """The cache tag and the template constants of one experts build."""
    return f"H{H}-I{I}-t{tile}-{activation}-bf16", {"H": H, "I": I, "TILE": tile, "ACT": activation}


def spec(H: int, I: int, tile: int, activation: str, tokens: int, arch_: str, tbl=None) -> plan_mod.KernelSpec:
    """The kernel spec the tier table gives this shape."""
    return plan_mod.plan(tbl or table(), OP, {"hidden": H, "tokens": tokens}, *tag_constants(H, I, tile, activation),
                         arch_)


class Kernels:
    """The two launches of the mma variant for one grid (tiles) on one device: a persistent grid of
    blocks_per_sm CTAs per SM (at most one per item) looping over the used tiles' items."""
    __slots__ = ("gemm1", "gemm2", "device")

    def __init__(self, s: plan_mod.KernelSpec, tiles: int, device: int):
        if s.variant not in VARIANTS:
            raise InputError(OP, "tier variant", " or ".join(VARIANTS), s.variant)
        c, p = dict(s.constants), dict(s.params)
        warps, H, I = p["warps"], c["H"], c["I"]
        mod = resolve(s)
        pdl = bool(p.get("pdl", False))
        ctas = p.get("blocks_per_sm", 4) * sm_count(device)
        grid1, grid2 = (min(ctas, tiles * -(-I // 8)), 1, 1), (min(ctas, tiles * -(-H // 16)), 1, 1)
        self.gemm1 = Launcher(mod, "experts_gemm1", device, grid1, (32 * warps, 1, 1), PARAMS, pdl=pdl)
        self.gemm2 = Launcher(mod, "experts_gemm2", device, grid2, (32 * warps, 1, 1), PARAMS, pdl=pdl)
        self.device = device

    def __call__(self, x, routing, w13, w2, out, act, *, interleaved=False, b13=None, b2=None, input_weights=None,
                 a0=0.0, a1=0.0) -> torch.Tensor:
        """Both launches on the current stream over arguments experts() has checked; act [tiles*tile, I] and out
        [rows, H] are the caller's."""
        T = x.shape[0]
        inw = None if input_weights is None else input_weights.float().reshape(T).contiguous()
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        args = dict(x=x.data_ptr(), w13=w13.data_ptr(), b13=ptr(b13), inw=ptr(inw), w2=w2.data_ptr(), b2=ptr(b2),
                    p2t=routing.permuted_to_token.data_ptr(), t2e=routing.tile_to_expert.data_ptr(),
                    nrows=routing.num_permuted_rows.data_ptr(), act=act.data_ptr(), out=out.data_ptr(), tokens=T,
                    experts=w13.shape[0], interleaved=int(interleaved), tiles=routing.tile_to_expert.shape[0],
                    a0=float(a0), a1=float(a1))
        stream = current_stream(self.device)
        self.gemm1.launch(stream, **args)
        self.gemm2.launch(stream, **args)
        return out


def kernel(s: plan_mod.KernelSpec, tiles: int, device: int) -> Kernels:
    """The launches of experts spec `s` over `tiles` routing tiles (the grid follows the tiles, not the tokens)."""
    return Kernels(s, tiles, device)


_kernels: dict[tuple, Kernels | None] = {}


def _kernel(H, I, tile, activation, T, tiles, dev) -> Kernels | None:
    """The kernels for this shape, or None where no rule serves it (the grouped-GEMM path)."""
    key = (H, I, tile, activation, T, tiles, dev)
    if key not in _kernels:
        k = None
        try:
            if tile <= MAX_TILE:
                k = kernel(spec(H, I, tile, activation, T, arch(dev)), tiles, dev)
        except TierError:
            k = None
        _kernels[key] = k
    return _kernels[key]


def rows_tile(tokens: int) -> int:
    """The kernels' routing tile at this token count: 8 rows up to 16 tokens, 16 beyond (one tile holds all of
    an expert's rows at decode sizes)."""
    return 8 if tokens <= 16 else 16


def tile_for(H: int, I: int, activation: str, tokens: int, device: int) -> int | None:
    """rows_tile(tokens) where a rule serves this shape's kernels, else None (torch._grouped_mm needs no tile)."""
    try:
        spec(H, I, 8, activation, tokens, arch(device))
    except TierError:
        return None
    return rows_tile(tokens)


def model_specs(model: tiers.Model, tbl: tiers.Table, arch_: str) -> list[plan_mod.KernelSpec]:
    """Every experts kernel `model` can dispatch to over its token range (models with an intermediate size)."""
    if not model.intermediate:
        return []
    H, I = model.hidden, model.intermediate
    lo, hi = model.tokens
    edges = {lo, hi, 16, 17} | {t for r in tbl.rules if r.op == OP for t in r.ranges.get("tokens", ())}
    out: list[plan_mod.KernelSpec] = []
    for T in sorted(t for t in edges if lo <= t <= hi):   # each token piece starts or ends at one of these
        tile = rows_tile(T)
        try:
            rule = tbl.rule(OP, {"hidden": H, "tokens": T, "arch": arch_})
        except TierError:
            continue
        s = plan_mod.spec_for(rule, *tag_constants(H, I, tile, model.activation), arch_)
        if s not in out:
            out.append(s)
    return out


def clear() -> None:
    """Forget the loaded kernels (after the tier table or the cache changed)."""
    _kernels.clear()


def _grouped(xs, routing, w13, w2, b13, b2, tile, I, act) -> torch.Tensor:
    """torch._grouped_mm over the padded expert groups (h rounded to bf16, as a grouped GEMM returns it)."""
    offs = routing.expert_offsets[1:]
    t2e = routing.tile_to_expert
    tile_of_row = (torch.arange(xs.shape[0], device=xs.device) // tile).clamp(max=max(t2e.shape[0] - 1, 0))
    expert = t2e[tile_of_row].clamp(min=0)
    h = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs).float()
    if b13 is not None:
        h = h + b13[expert].float()
    a = act(h).to(torch.bfloat16)
    y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    return y if b2 is None else (y.float() + b2[expert].float()).to(torch.bfloat16)


def experts(x: torch.Tensor, routing, w13: torch.Tensor, w2: torch.Tensor, *, activation: str = "silu",
            interleaved: bool = False, b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
            input_weights: torch.Tensor | None = None, tile: int | None = None, alpha: float = 1.702,
            limit: float = 7.0, beta: float = 1.0, linear_beta: float = 0.0,
            out: torch.Tensor | None = None) -> torch.Tensor:
    """Expert output rows [rows, H] bf16 in permuted order (row = expanded_to_permuted[t, k]) for finalize.

    x [T, H] bf16; routing: a kerngen.Routing with its permutation (route(..., tile=...) or permute; tile is
    read from its buffer sizes unless given); w13 [E, 2I, H] bf16 (gate_up_proj: gate rows then up rows, or
    interleaved=True for gpt-oss's row pairs); w2 [E, H, I] (down_proj); E = the routing's local experts.
    b13 [E, 2I], b2 [E, H] optional bf16 biases; input_weights [T] (Llama-4: x rows scaled before the GEMM).
    activation: silu (SwiGLU), gelu (tanh approximation, times up), gpt_oss (alpha, limit), situglu (beta,
    linear_beta). No host synchronisation: CUDA-graph capturable.
    """
    tile, H, I = check_args(x, routing, w13, w2, activation, interleaved, b13, b2, input_weights, tile)
    _check_act_params(activation, alpha, limit, beta, linear_beta)
    p2t = routing.permuted_to_token
    rows = p2t.shape[0]
    if out is None:
        out = torch.empty((rows, H), dtype=x.dtype, device=x.device)
    else:
        check_tensor(OP, "out", out, dtypes=_BF16, ndim=2, device=x.device, contiguous=True)
        if tuple(out.shape) != (rows, H):
            raise InputError(OP, "out", f"of shape {(rows, H)}", f"shape {tuple(out.shape)}")
    a0, a1 = (alpha, limit) if activation == "gpt_oss" else (beta, linear_beta)
    kw = dict(activation=activation, interleaved=interleaved, b13=b13, b2=b2, input_weights=input_weights,
              tile=tile, alpha=alpha, limit=limit, beta=beta, linear_beta=linear_beta)
    if not x.shape[0] or not rows:   # no tokens: no row holds an expert output
        return out
    if x.device.type != "cuda":
        out.copy_(reference(x, routing, w13, w2, **kw))
        return out
    T, dev = x.shape[0], x.get_device()
    tiles = routing.tile_to_expert.shape[0]
    k = _kernel(H, I, tile, activation, T, tiles, dev) if tiles else None
    if k is None:
        xs = x if input_weights is None else (x.float() * input_weights.float().reshape(T, 1)).to(x.dtype)
        xs = xs[p2t.clamp(min=0)]
        act = lambda h: activate(h, I, activation, interleaved, alpha, limit, beta, linear_beta)  # noqa: E731
        out.copy_(_grouped(xs, routing, w13, w2, b13, b2, tile, I, act))
        return out
    act = torch.empty((tiles * tile, I), dtype=x.dtype, device=x.device)
    return k(x, routing, w13, w2, out, act, interleaved=interleaved, b13=b13, b2=b2, input_weights=input_weights,
             a0=a0, a1=a1)
