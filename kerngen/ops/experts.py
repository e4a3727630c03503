"""experts: the decode expert GEMMs over the permuted rows of a Routing (deferred finalize).

For every permuted row r of token t = permuted_to_token[r] and local expert e = tile_to_expert[r // tile]:

    h   = xs[t] @ w13[e].T + b13[e]             (fp32; xs = x, or bf16(x * input_weights[t]) for Llama-4)
    a   = bf16(ACT(gate(h), up(h)))             the [rows, I] intermediate
    out = bf16(a @ w2[e].T + b2[e])             (fp32) -> kerngen.finalize / moe_tail

Padding rows (token -1) of `out` are left unwritten by the kernel (zero in the reference); finalize never reads
them. Shapes an "experts" tier rule serves with a tile of at most MMA_MAX_TILE rows run templates/experts/mma.cu.j2
(tensor cores, a persistent grid); any other shape runs torch._grouped_mm (bf16 weights) or the per-expert reference
(fp8, MXFP4). CUDA tensors only, as every op that launches kernels: on the CPU, torch.ops.kerngen.moe_experts or
`reference`. This module launches; which kernel a shape takes and what it builds is experts_plan.py's, the
reference experts_reference.py's, the input checks experts_checks.py's (all re-exported here).
"""
from __future__ import annotations

import math

import torch

from .. import plan as plan_mod
from .. import tiers
from ..errors import InputError
from .. import env
from ..launch import EagerGraphs, Launcher, current_stream
from ..occupancy import Launch
from ..dispatch import Dispatch, OpDispatch
from . import _common
from . import permute as permute_op
from ._common import arch, check_tensor, resolve, sm_count, table
from .experts_checks import (ACTIVATIONS, E2M1, FORMATS, FP8, LAYOUTS, MX_GROUP, OP, QBLOCK, _BF16,  # noqa: F401
                             _check_act_params, _check_scales, check, check_args, infer_tile, weights_layout)
from .experts_reference import (activate, dequantize, fp8_round_trip, quantize_f16, quantize_fp8,  # noqa: F401
                                reference)
from .experts_plan import (FUSED_SMEM, MMA_MAX_TILE, PARAMS, PARAMS_A8, PARAMS_SCALED, QUANT_CTAS,  # noqa: F401
                           SYNC_LINE, dynamic_smem, explain_rule, explain_spec, fused_smem, gemm_kernels,
                           model_specs, one_launch, params_struct, quant_kernels, quant_launches,
                           quantizes_activations, rule_format, rule_shape, rule_spec, spec, sync_ints, tag_constants,
                           tickets, tile_of, uses_sync)

VARIANTS = ("mma",)
# KERNGEN_EAGER_GRAPHS unset: eager calls of at most so many tokens replay repeated launches from a CUDA graph (one
# driver call where two to four cost the host ~5 us each; past decode sizes the GPU's work hides the launches and the
# graph would only lose the early start of programmatic dependent launch)
EAGER_GRAPH_TOKENS = 4


class Kernels:
    """The mma variant of one spec on one device: two launches (one with one_launch) on a persistent grid of
    blocks_per_sm CTAs per SM (no more than an SM holds of each kernel, and at most one per work item) looping over
    the used tiles' items. The grid follows the routing's tile count, so the launchers are kept per tile count; the
    intermediate scratch (and the sync buffer of one_launch's or tickets' counters) per stream."""
    __slots__ = ("spec", "tile", "device", "scaled", "a8", "x16", "qx", "fused_x", "_mod", "_warps", "_pdl", "_ctas",
                 "_H", "_I", "_grids", "_act", "_kept", "_cols", "_q", "_quants", "_no_q", "graphs", "graph_tokens",
                 "_per_tile", "one", "sync_buf", "_sync")

    def __init__(self, s: plan_mod.KernelSpec, device: int):
        if s.variant not in VARIANTS:
            raise InputError(OP, "tier variant", " or ".join(VARIANTS), s.variant)
        c, p = dict(s.constants), dict(s.params)
        self.spec, self.tile, self.device = s, c["TILE"], device
        self.scaled = c.get("FORMAT", "bf16") != "bf16"   # a quantized build: its scales are launch fields
        self.a8 = bool(c.get("A8"))   # fp8 activations: two quantizing launches and their buffers besides
        self.x16 = bool(p.get("f16x"))   # f16 activations: the same, f16 buffers
        self._quants = quant_kernels(s)   # the quantizing launches it makes (none: fused_x, act_f16 = false)
        self.qx = bool(self._quants)   # their buffers are needed
        self._no_q = (0,) * 4 if quantizes_activations(s) and not self.qx else ()   # the struct's buffer fields, unused
        self.fused_x = p.get("fused_x", 0) if self.x16 else 0   # gemm1 quantizes x itself: at most so many tokens
        self._warps, self._H, self._I = p["warps"], c["H"], c["I"]
        mt = p.get("mtiles", 1) if self.x16 or not self.scaled else 1   # m16 tiles of weight rows an item takes
        self._cols = (16, 32) if c.get("KN") else (8 * mt, 16 * mt)   # an item's columns: GEMM1, GEMM2
        self._per_tile = (-(-self._I // self._cols[0]), -(-self._H // self._cols[1]))   # items a tile: GEMM1, GEMM2
        self.one = one_launch(s)   # both GEMMs in one launch, whose tickets and counts live in _sync (per stream)
        self.sync_buf = uses_sync(s)   # one_launch or tickets: a sync buffer a stream
        self._sync: dict[int, torch.Tensor] = {}
        self._mod = resolve(s)
        self._pdl = bool(p.get("pdl", False))
        self._ctas = {name: _common.persistent_ctas(OP, self._mod, name, device, launch)
                      for name, launch in self.persistent(s).items()}
        self._grids: dict[int, tuple[Launcher, Launcher]] = {}
        self._act: dict[int, torch.Tensor] = {}
        self._kept: list = []   # per-stream buffers outgrown: kept (a CUDA graph captured before may read them)
        self._q: dict[int, tuple] = {}
        # KERNGEN_EAGER_GRAPHS: repeated eager calls of at most graph_tokens tokens replay their launches from a CUDA
        # graph (unset: decode sizes, EAGER_GRAPH_TOKENS; device -1: stub launchers, never)
        mode = env.eager_graphs()
        self.graphs = EagerGraphs(device) if device >= 0 and mode is not False else None
        self.graph_tokens = tiers.INT32_MAX if mode else EAGER_GRAPH_TOKENS

    @staticmethod
    def persistent(s: plan_mod.KernelSpec) -> dict[str, Launch]:
        """Each kernel's CTA (32 * warps threads; dynamic shared memory only for fused_x and stage_act rows,
        dynamic_smem) and the CTAs an SM its rule asks for; with fp8 or f16 activations also the quantizing
        kernels' (8 warps, a warp a group, grids striding over the groups with up to QUANT_CTAS CTAs an SM);
        gemm1_blocks, where given, is experts_gemm1's CTAs an SM (its registers may hold fewer than GEMM2's), and
        gemm2_blocks experts_gemm2's (with min_blocks also its register bound: two steps a batch at fewer CTAs)."""
        p = dict(s.params)
        bps = p.get("blocks_per_sm", 4)
        own = {"experts_gemm1": p.get("gemm1_blocks", bps), "experts_gemm2": p.get("gemm2_blocks", bps)}
        out = {name: Launch(32 * p["warps"], dyn, own.get(name, bps)) for name, dyn in dynamic_smem(s).items()}
        out.update(dict.fromkeys(quant_kernels(s), Launch(256, 0, QUANT_CTAS)))
        return out

    def launchers(self, tiles: int) -> tuple[Launcher, ...]:
        """gemm1, gemm2 (and with fp8 or f16 activations quant_x, gemm1, quant_act, gemm2; one_launch: gemm12 alone)
        for this many tiles."""
        pair = self._grids.get(tiles)
        if pair is None and self.one:   # tickets: every CTA on the grid takes them, so none past the items
            grid = (min(self._ctas["experts_gemm12"], tiles * sum(self._per_tile)), 1, 1)
            pair = self._grids[tiles] = (
                Launcher(self._mod, "experts_gemm12", self.device, grid, (32 * self._warps, 1, 1),
                         params_struct(self.spec), dynamic_smem(self.spec)["experts_gemm12"], pdl=self._pdl),)
        if pair is None:
            block = (32 * self._warps, 1, 1)
            grid1 = (min(self._ctas["experts_gemm1"], tiles * self._per_tile[0]), 1, 1)
            grid2 = (min(self._ctas["experts_gemm2"], tiles * self._per_tile[1]), 1, 1)
            params = params_struct(self.spec)
            dyn = dynamic_smem(self.spec)
            pair = (Launcher(self._mod, "experts_gemm1", self.device, grid1, block, params, dyn["experts_gemm1"],
                             pdl=self._pdl),
                    Launcher(self._mod, "experts_gemm2", self.device, grid2, block, params, dyn["experts_gemm2"],
                             pdl=self._pdl))
            if self.qx:   # a warp per 128 values; grids striding over the rows (x: at most tiles * tile)
                def quant(name, cols):
                    if name not in self._quants:
                        return ()
                    grid = (max(1, min(self._ctas[name], -(-tiles * self.tile * -(-cols // QBLOCK) // 8))), 1, 1)
                    return (Launcher(self._mod, name, self.device, grid, (256, 1, 1), params, pdl=self._pdl),)
                pair = (quant("experts_quant_x", self._H) + pair[:1] + quant("experts_quant_act", self._I)
                        + pair[1:])
            self._grids[tiles] = pair
        return pair

    def quant_scratch(self, stream: int, T: int, tiles: int, device: torch.device) -> tuple[tuple, tuple]:
        """fp8 or f16 activations: (x and the intermediate quantized and their scales, their launch fields), one set
        per stream, grown to the most tokens and tiles seen."""
        q = self._q.get(stream)
        if q is None or q[0][0].shape[0] < T or q[0][2].shape[0] < tiles * self.tile:
            T = max(_pow2(T), 0 if q is None else q[0][0].shape[0])
            rows = max(_pow2(tiles) * self.tile, 0 if q is None else q[0][2].shape[0])
            self._outgrown(q)
            q = self._q[stream] = self.quant_buffers(T, rows, device)
        return q

    def _outgrown(self, buf) -> None:
        """Keep a per-stream buffer that a larger one replaces: a CUDA graph captured on that stream (the caller's,
        or kerngen's block graphs') launches with its pointers. Sizes grow by powers of two, so what is kept is at
        most as large as what is in use."""
        if buf is not None:
            self._kept.append(buf)

    def quant_buffers(self, T: int, rows: int, device: torch.device) -> tuple[tuple, tuple]:
        """New buffers for x [T, H] and the intermediate [rows, I] quantized (e4m3 bytes or f16) and their scales
        per 128 columns, with their launch fields."""
        H, I, dt = self._H, self._I, torch.float16 if self.x16 else torch.uint8
        shapes = (((T, H), dt), ((T, -(-H // QBLOCK)), torch.float32), ((rows, I), dt),
                  ((rows, -(-I // QBLOCK)), torch.float32))
        sizes = [-(-math.prod(shape) * d.itemsize // 16) * 16 for shape, d in shapes]   # 16-byte aligned pieces
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)   # one allocation (a per-call cost)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        bufs = tuple(flat[o:o + math.prod(shape) * d.itemsize].view(d).view(shape)
                     for o, (shape, d) in zip(offsets, shapes))
        return bufs, tuple(t.data_ptr() for t in bufs)

    def scratch(self, stream: int, tiles: int, device: torch.device) -> torch.Tensor:
        """The intermediate (at least [tiles * tile, I]; the kernels read its first rows), one buffer per stream,
        reused call after call on it and grown to the most tiles seen."""
        act = self._act.get(stream)
        if act is None or act.shape[0] < tiles * self.tile:
            self._outgrown(act)
            act = self._act[stream] = torch.empty((_pow2(tiles) * self.tile, self._I), dtype=torch.bfloat16,
                                                  device=device)
        return act

    def sync(self, stream: int, tiles: int, device: torch.device) -> torch.Tensor:
        """one_launch and tickets: the stream's counters (int32, each on its own 128 bytes; one_launch: tickets, CTAs
        done, each tile's GEMM1 items; tickets: GEMM1's tickets and CTAs done, then GEMM2's; zero between launches:
        the last CTA of each launch zeroes what it used), grown to the most tiles seen."""
        sync = self._sync.get(stream)
        if sync is None or sync.shape[0] < sync_ints(tiles):
            self._outgrown(sync)
            sync = self._sync[stream] = new_sync(_pow2(tiles), device)
        return sync

    def __call__(self, x, routing, w13, w2, out, act=None, *, interleaved=False, b13=None, b2=None,
                 input_weights=None, a0=0.0, a1=0.0, w13_scale=None, w2_scale=None) -> torch.Tensor:
        """Both launches on the current stream over arguments experts() has checked; out [rows, H] is the
        caller's, act [tiles*tile, I] too if given (else this stream's scratch)."""
        return self.run(x, routing, w13, w2, out, b13, b2, input_weights, interleaved, a0, a1, w13_scale, w2_scale,
                        x.shape[0], routing.tile_to_expert.shape[0], w13.shape[0], act)

    def run(self, x, routing, w13, w2, out, b13, b2, input_weights, interleaved, a0, a1, w13_scale, w2_scale, T,
            tiles, experts_, act=None) -> torch.Tensor:
        """__call__ with the counts experts() already knows: the launch fields packed in order, no keywords."""
        if T > self.fused_x > 0:
            raise InputError(OP, "x", f"at most {self.fused_x} tokens for this build (its rule's fused_x)",
                             f"{T} tokens")
        stream = current_stream(self.device)
        own = act is None   # the caller's scratch: its quantized activations are this call's too, not kept
        if own:
            act = self.scratch(stream, tiles, x.device)
        pair = self.launchers(tiles)
        inw = 0 if input_weights is None else input_weights.float().reshape(T).contiguous().data_ptr()
        fields = (x.data_ptr(), w13.data_ptr(), 0 if b13 is None else b13.data_ptr(), inw, w2.data_ptr(),
                  0 if b2 is None else b2.data_ptr(), routing.permuted_to_token.data_ptr(),
                  routing.tile_to_expert.data_ptr(), routing.num_permuted_rows.data_ptr(), act.data_ptr(),
                  out.data_ptr(), T, experts_, int(interleaved), tiles, a0, a1)
        if self.scaled:
            fields += (w13_scale.data_ptr(), w2_scale.data_ptr())
        if self.qx:
            q = (self.quant_scratch(stream, T, tiles, x.device) if own
                 else self.quant_buffers(T, tiles * self.tile, x.device))   # (alive until the launches are queued)
            fields += q[1]
        else:
            fields += self._no_q
        if self.sync_buf:   # the caller's scratch: counters of this call's own too (zeroed here; nothing kept)
            sync = self.sync(stream, tiles, x.device) if own else new_sync(tiles, x.device)
            fields += (sync.data_ptr(),)
        if self.graphs is None or T > self.graph_tokens or not self.graphs.launch(stream, pair, fields):
            for launch in pair:
                launch(stream, *fields)
        return out


persistent = Kernels.persistent   # the ops' seam (kerngen.ops): what explain, warmup and the tests size from


def _pow2(n: int) -> int:
    """The least power of two >= n (1 for 0): the sizes per-stream buffers grow through."""
    return 1 << max(0, n - 1).bit_length()


def new_sync(tiles: int, device) -> torch.Tensor:
    """Zeroed one_launch counters for this many tiles."""
    return torch.zeros(sync_ints(tiles), dtype=torch.int32, device=device)


def kernel(s: plan_mod.KernelSpec, tokens: int, device: int) -> Kernels:
    """The launches of experts spec `s` on `device` (any token count: the grid follows the routing's tiles)."""
    return Kernels(s, device)


def _dispatch(device: int, *, H: int, I: int, activation: str, fmt: str = "bf16", layout: str = "nk",
              a8: bool = False, experts: int = 0, top_k: int = 0) -> Dispatch:
    """The experts kernels of this shape, weight format and layout on `device` (a8: fp8 activations, fp8 weights'
    rules), per token bucket (None where no rule serves: torch._grouped_mm for bf16, the per-expert reference for
    fp8). experts: the experts whose weights the call holds (w13.shape[0]), top_k: the routing's K; 0 where not
    known (rules keyed on them then do not match)."""
    a = arch(device)
    return Dispatch(OP, rule_shape(H, fmt, a8, experts, top_k),
                    lambda rule: rule_spec(rule, H, I, activation, a, fmt, layout, a8),
                    kernel, device, arch=a, per_token=False)


dispatch = OpDispatch(OP, _dispatch)


def tile_for(H: int, I: int, activation: str, tokens: int, device: int, fmt: str = "bf16",
             layout: str = "nk", a8: bool = False, experts: int = 0, top_k: int = 0) -> int | None:
    """The routing tile kerngen.experts' kernels (for weights in `fmt` and `layout`; a8: fp8 activations; experts
    and top_k as dispatch takes them) take at this token count (the rule's `tile`), or None where no rule serves
    these tokens (torch._grouped_mm needs no tile)."""
    s = dispatch(device, H=H, I=I, activation=activation, fmt=fmt, layout=layout, a8=a8, experts=experts,
                 top_k=top_k).spec(tokens)
    return None if s is None else tile_of(s)


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
            limit: float = 7.0, beta: float = 1.0, linear_beta: float = 0.0, w13_scale: torch.Tensor | None = None,
            w2_scale: torch.Tensor | None = None, out: torch.Tensor | None = None,
            scratch: torch.Tensor | None = None, fp8_activations: bool = False) -> torch.Tensor:
    """Expert output rows [rows, H] bf16 in permuted order (row = expanded_to_permuted[t, k]) for finalize.

    x [T, H] bf16; routing: a kerngen.Routing with its permutation (route(..., tile=...) or permute; tile is
    read from its buffer sizes unless given); w13 [E, 2I, H] bf16 (gate_up_proj: gate rows then up rows, or
    interleaved=True for gpt-oss's row pairs); w2 [E, H, I] (down_proj); E = the routing's local experts.
    Both contiguous, or (bf16) both the transposes of contiguous tensors, read in place: transformers' gpt-oss and
    Llama-4 store gate_up_proj [E, H, 2I] and down_proj [E, I, H], passed as gate_up_proj.transpose(1, 2) and
    down_proj.transpose(1, 2) (LAYOUTS).
    b13 [E, 2I], b2 [E, H] optional bf16 biases; input_weights [T] (Llama-4: x rows scaled before the GEMM).
    activation: silu (SwiGLU), gelu (tanh approximation, times up), gpt_oss (alpha, limit), situglu (beta,
    linear_beta). No host synchronisation: CUDA-graph capturable.
    fp8 weights (DeepSeek-V3, Kimi K2): w13 / w2 float8_e4m3fn with w13_scale [E, 2I/128, H/128] and w2_scale
    [E, H/128, I/128] fp32 (the dequantized weight is w * its block's scale; H and I multiples of 128); the
    kernels widen the weights in registers (exactly: to bf16, or to f16 where the tier rule sets f16x and the
    activations travel as f16 with power-of-two scales, quantize_f16) and apply each block's scale to the fp32 sums.
    MXFP4 weights (gpt-oss): w13 [E, 2I, H/32, 16] / w2 [E, H, I/32, 16] uint8 blocks (two e2m1 values a byte,
    low nibble first) with w13_scale [E, 2I, H/32] / w2_scale [E, H, I/32] uint8 e8m0 scales (2^(s - 127));
    widened to bf16 with the scale applied in registers (exact for scale bytes 2..252); H, I multiples of 64.
    fp8_activations (fp8 weights only, opt-in): x and the intermediate are quantized to e4m3 per row and 128 columns
    (quantize_fp8: DeepSeek-V3's reference and vLLM's block-fp8 GEMM compute this way) and multiplied on fp8 tensor
    cores, each block's fp32 sum scaled by both scales; the result differs from the default's by that quantization.
    Token counts no rule serves run the per-expert reference on the GPU for fp8 and MXFP4 weights (it reads
    which experts were hit on the host).
    scratch: the kernels' intermediate, bf16 contiguous [rows, I] or longer (rows = the routing's permuted
    rows); by default one buffer kept per stream. Pass one per call where memory the call leaves behind must
    not persist: inside a CUDA-graph pool that something else manages (torch.compile's CUDA graphs); the
    quantized activations of the builds that take them (f16x, fp8_activations) are then allocated per call too.
    CUDA tensors only, as every kernel op (a CPU tensor is an InputError naming it): on the CPU,
    torch.ops.kerngen.moe_experts (the same checks, then the references) or `reference`.
    """
    try:   # kerngen-built routings carry their checked layout; the signature pins what check_args establishes
        sig = (x.dtype, x.shape, x.is_contiguous(), x.get_device(), routing.checked, tile, w13.dtype, w13.shape,
               w13.stride(), w13.get_device(), w2.dtype, w2.shape, w2.stride(), w2.get_device(),
               None if b13 is None else (b13.dtype, b13.shape, b13.is_contiguous(), b13.get_device()),
               None if b2 is None else (b2.dtype, b2.shape, b2.is_contiguous(), b2.get_device()),
               None if input_weights is None else (input_weights.dtype, input_weights.shape,
                                                   input_weights.get_device()),
               None if w13_scale is None else (w13_scale.dtype, w13_scale.shape, w13_scale.is_contiguous(),
                                               w13_scale.get_device()),
               None if w2_scale is None else (w2_scale.dtype, w2_scale.shape, w2_scale.is_contiguous(),
                                              w2_scale.get_device()),
               activation, interleaved, alpha, limit, beta, linear_beta, out is None,
               type(interleaved), type(tile), fp8_activations, type(fp8_activations))   # True == 1 and 8 == 8.0: the kinds are pinned too
        hit = _calls.get(sig) if sig[4] is not None else None
    except (AttributeError, TypeError):   # not tensors, a foreign routing, unhashable values: checked below
        sig, hit = None, None
    if hit is None or (x.data_ptr() | w13.data_ptr() | w2.data_ptr()) % 16 or (
            w13_scale is not None and (w13_scale.data_ptr() | w2_scale.data_ptr()) % 2):   # (MXFP4: 16-bit loads)
        hit = _calls.remember(sig if sig is not None and sig[4] is not None else None,
                       _prepare(x, routing, w13, w2, activation, interleaved, b13, b2, input_weights, tile, alpha,
                                limit, beta, linear_beta, w13_scale, w2_scale, fp8_activations))
    k, tile, H, I, a0, a1, dev, fmt, tiles, experts_ = hit
    p2t = routing.permuted_to_token
    rows = p2t.shape[0]
    if out is None:
        out = torch.empty((rows, H), dtype=x.dtype, device=x.device)
    elif (out.dtype != torch.bfloat16 or out.shape != (rows, H) or not out.is_contiguous()
          or out.get_device() != dev):
        check_tensor(OP, "out", out, dtypes=_BF16, ndim=2, device=x.device, contiguous=True)
        raise InputError(OP, "out", f"of shape {(rows, H)}", f"shape {tuple(out.shape)}")
    if scratch is not None and (scratch.dtype != torch.bfloat16 or scratch.dim() != 2 or scratch.shape[1] != I
                                or scratch.shape[0] < rows or not scratch.is_contiguous()
                                or scratch.get_device() != dev):
        raise InputError(OP, "scratch", f"a contiguous bf16 [>= {rows}, {I}] tensor on {x.device}",
                         f"{scratch.dtype} {tuple(scratch.shape)} on {scratch.device}"
                         f"{'' if scratch.is_contiguous() else ', not contiguous'}")
    T = x.shape[0]
    if not T or not rows:   # no tokens: no row holds an expert output
        return out
    if k is not None:
        return k.run(x, routing, w13, w2, out, b13, b2, input_weights, interleaved, a0, a1, w13_scale, w2_scale, T,
                     tiles, experts_, scratch)
    kw = dict(activation=activation, interleaved=interleaved, b13=b13, b2=b2, input_weights=input_weights,
              tile=tile, alpha=alpha, limit=limit, beta=beta, linear_beta=linear_beta, w13_scale=w13_scale,
              w2_scale=w2_scale, fp8_activations=fp8_activations)
    if fmt != "bf16":   # quantized weights no rule serves: the per-expert reference, on the GPU
        out.copy_(reference(x, routing, w13, w2, **kw))
        return out
    xs = x if input_weights is None else (x.float() * input_weights.float().reshape(T, 1)).to(x.dtype)
    xs = xs[p2t.clamp(min=0)]
    act = lambda h: activate(h, I, activation, interleaved, alpha, limit, beta, linear_beta)  # noqa: E731
    out.copy_(_grouped(xs, routing, w13, w2, b13, b2, tile, I, act))
    return out


_calls = dispatch.calls   # input signature -> (kernels or None, tile, H, I, a0, a1, device, format, tiles,
#                                      local experts)


def _prepare(x, routing, w13, w2, activation, interleaved, b13, b2, input_weights, tile, alpha, limit, beta,
             linear_beta, w13_scale=None, w2_scale=None, fp8_activations=False) -> tuple:
    """Full checks, then the kernels serving this call (None: the grouped GEMM or the per-expert reference)."""
    tile, H, I, fmt, layout = check(x, routing, w13, w2, activation=activation, interleaved=interleaved, b13=b13,
                                    b2=b2, input_weights=input_weights, tile=tile, alpha=alpha, limit=limit, beta=beta,
                                    linear_beta=linear_beta, w13_scale=w13_scale, w2_scale=w2_scale,
                                    fp8_activations=fp8_activations)
    a0, a1 = (alpha, limit) if activation == "gpt_oss" else (beta, linear_beta)
    dev = x.get_device()
    k = None
    if tile <= MMA_MAX_TILE and routing.tile_to_expert.shape[0]:
        d = dispatch(dev, H=H, I=I, activation=activation, fmt=fmt, layout=layout, a8=fp8_activations,
                     experts=w13.shape[0], top_k=routing.topk_ids.shape[1])
        k = d.kernel(x.shape[0])
        if k is not None and k.tile != tile:   # a routing built with another tile: the same rule at that tile
            k = _at_tile(d, k.spec, tile)
    return (k, tile, H, I, float(a0), float(a1), dev, fmt, routing.tile_to_expert.shape[0], w13.shape[0])


def _at_tile(d: Dispatch, s: plan_mod.KernelSpec, tile: int) -> Kernels:
    """The kernels of spec `s` built for routing tile `tile` instead of its rule's, kept by the dispatch object."""
    key = ("tile", s, tile)
    k = d.kept.get(key)
    if k is None:
        c = dict(s.constants)
        rule = tiers.Rule(OP, s.variant, {}, {**dict(s.params), "backend": s.backend})
        at = plan_mod.spec_for(rule, *tag_constants(c["H"], c["I"], tile, c["ACT"], c["FORMAT"],
                                                    "kn" if c.get("KN") else "nk", bool(c.get("A8"))), s.arch)
        k = d.kept[key] = Kernels(at, d.device)
    return k
