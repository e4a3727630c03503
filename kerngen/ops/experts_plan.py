"""experts planning: which kernel a rule or shape gives (tag, constants, params), what a spec builds and launches
(GEMM kernels, quantizing launches, dynamic shared memory, its struct Params), and the seam's model_specs and
explain_spec. No tensors: warmup, explain and the tests read it without a GPU; kerngen.ops.experts launches.
"""
from __future__ import annotations

import dataclasses
import functools

from .. import plan as plan_mod
from .. import tiers
from ..errors import InputError, TierError
from ..launch import Params
from ._common import table
from .experts_checks import OP, QBLOCK, QUANTUM

MMA_MAX_TILE = 32   # rows of a tile the kernels take (up to four 8-row n-blocks of mma accumulators)
# struct Params of templates/experts/mma.cu.j2 (both kernels)
PARAMS = Params(("x", "ptr"), ("w13", "ptr"), ("b13", "ptr"), ("inw", "ptr"), ("w2", "ptr"), ("b2", "ptr"),
                ("p2t", "ptr"), ("t2e", "ptr"), ("nrows", "ptr"), ("act", "ptr"), ("out", "ptr"), ("tokens", "int"),
                ("experts", "int"), ("interleaved", "int"), ("tiles", "int"), ("a0", "float"), ("a1", "float"))
# the quantized builds' struct Params (fp8, mxfp4): the bf16 one, then the scales of w13 and w2
PARAMS_SCALED = Params(*PARAMS.fields, ("s13", "ptr"), ("s2", "ptr"))
# fp8 activations (fp8_activations=True): then x and the intermediate quantized, with their scales
QUANT_CTAS = 8   # fp8 activations: CTAs an SM of the quantizing kernels (8 warps each: a full SM)
PARAMS_A8 = Params(*PARAMS_SCALED.fields, ("xq", "ptr"), ("xsc", "ptr"), ("aq", "ptr"), ("asc", "ptr"))


def tag_constants(H: int, I: int, tile: int, activation: str, fmt: str = "bf16",
                  layout: str = "nk", a8: bool = False) -> tuple[str, dict]:
    """The cache tag and the template constants of one experts build (fmt: the weights' format, bf16, fp8 or
    mxfp4; layout: LAYOUTS, the "kn" builds marked KN, the "nk" ones as they always were; a8: fp8 weights with fp8
    activations, marked A8)."""
    kn = {"KN": 1} if layout == "kn" else {}
    if a8 and fmt != "fp8":
        raise InputError(OP, "fp8_activations", "True only with fp8 weights", f"True with {fmt} weights")
    a8c = {"A8": 1} if a8 else {}
    return (f"H{H}-I{I}-t{tile}-{activation}-{fmt}" + ("-kn" if kn else "") + ("-a8" if a8 else ""),
            {"H": H, "I": I, "TILE": tile, "ACT": activation, "FORMAT": fmt, **kn, **a8c})


def rule_spec(rule: tiers.Rule, H: int, I: int, activation: str, arch_: str, fmt: str = "bf16",
              layout: str = "nk", a8: bool = False) -> plan_mod.KernelSpec:
    """The kernel of an experts rule at this shape: the rule's `tile` param is the TILE constant (the routing
    tile its kernels take), its other params the launch shape. A rule with `transposed = false` serves
    contiguous weights only: for "kn" ones it is a TierError (torch._grouped_mm runs those tokens)."""
    params = dict(rule.params)
    tile = params.pop("tile")
    where = f"the experts rule for tokens {list(rule.ranges.get('tokens', ()))}"
    if params.get("f16x") and (fmt not in ("fp8", "mxfp4") or a8):
        raise TierError(f"{where} sets f16x, which only fp8 and MXFP4 weights with bf16 activations take (not "
                        f"{rule_format(fmt, a8)})")
    if params.get("lean") and (fmt == "bf16" or a8 or layout == "kn" or params.get("prefetch", True)):
        raise TierError(f"{where} sets lean, which fp8 and MXFP4 weights with bf16 or f16 activations take with "
                        "prefetch = false")
    if params.get("pingpong") and not (params.get("f16x") and params.get("prefetch", True)):
        raise TierError(f"{where} sets pingpong without f16x and prefetch: only the f16-activation builds that load "
                        "the next steps ahead take it")
    fused = params.get("fused_x", 0)
    if (fused or not params.get("act_f16", True)) and not params.get("f16x"):
        raise TierError(f"{where} sets fused_x or act_f16, which only the f16-activation builds (f16x) take")
    if fused and (type(fused) is not int or rule.ranges.get("tokens", (1, 1 << 30))[1] > fused
                  or fused_smem(fused, max(H, I)) > FUSED_SMEM):
        raise TierError(f"{where} sets fused_x = {fused!r}: the most tokens its experts_gemm1 quantizes itself, at "
                        f"least the rule's last token count, and fused_x rows of {max(H, I)} f16 values in "
                        f"{FUSED_SMEM // 1024} KiB of shared memory")
    if params.get("stage_act") and not (fused and params.get("act_f16", True)):
        raise TierError(f"{where} sets stage_act without fused_x (its slots: a tile's rows at most) or with "
                        "act_f16 = false")
    if params.get("gcol") and not (fmt == "mxfp4" and 0 < fused <= 2 and params.get("lean") and tile >= 2
                                   and not params.get("act_f16", True) and params.get("mtiles", 1) == 1
                                   and not params.get("stage_act")):
        raise TierError(f"{where} sets gcol, which MXFP4 weights take with fused_x = 1 or 2, lean, act_f16 = false, "
                        "one m16 tile of weight rows an item (mtiles = 1) and tiles of 2 rows or more")
    if params.get("wide") and not params.get("gcol"):
        raise TierError(f"{where} sets wide without gcol: only gcol's experts_gemm1 reads two groups a lane a step")
    if "gemm1_unroll" in params and not params.get("gcol"):
        raise TierError(f"{where} sets gemm1_unroll without gcol: only gcol's experts_gemm1 takes a load batch of "
                        "its own (the other builds' GEMMs share unroll)")
    if params.get("one_launch") and (a8 or quant_launches(params, a8) or params.get("early_l2")
                                     or params.get("stage_act")):
        raise TierError(f"{where} sets one_launch, which builds without quantizing launches take (bf16 activations, "
                        "or f16x with fused_x and act_f16 = false), without early_l2 and stage_act")
    if params.get("one_launch") and ("gemm1_blocks" in params or "gemm2_blocks" in params):
        raise TierError(f"{where} sets gemm1_blocks or gemm2_blocks with one_launch: both GEMMs then run in one "
                        "launch, of blocks_per_sm CTAs an SM")
    if params.get("tickets") and (params.get("one_launch") or params.get("early_l2")):
        raise TierError(f"{where} sets tickets with one_launch (whose items are tickets already) or early_l2 (which "
                        "sends a CTA's fixed first item toward L2)")
    if not params.get("act_f16", True) and params.get("mtiles", 1) != 1:
        raise TierError(f"{where} sets act_f16 = false with mtiles: GEMM2 on the bf16 intermediate takes one m16 "
                        "tile of weight rows an item")
    if params.get("mtiles", 1) != 1 and not params.get("f16x") and (fmt != "bf16" or layout == "kn"):
        raise TierError(f"{where} sets mtiles, which bf16 weights stored [E, N, K] and the f16-activation builds "
                        f"(f16x) take (not {rule_format(fmt, a8)} weights{' stored transposed' if layout == 'kn' else ''}"
                        f"{'' if fmt == 'bf16' else ' without f16x'})")
    if not params.pop("transposed", True) and layout == "kn":
        raise TierError(f"{where} serves contiguous weights only (transposed = false): transposed ones run "
                        "torch._grouped_mm there")
    return plan_mod.spec_for(dataclasses.replace(rule, params=params),
                             *tag_constants(H, I, tile, activation, fmt, layout, a8), arch_)


def rule_format(fmt: str, a8: bool) -> str:
    """The `formats` entry of the tier rules serving these weights: their format, or w8a8 for fp8 activations."""
    return "w8a8" if a8 else fmt


def spec(H: int, I: int, tile: int | None, activation: str, tokens: int, arch_: str,
         tbl: tiers.Table | None = None, fmt: str = "bf16", layout: str = "nk", a8: bool = False,
         experts: int = 0, top_k: int = 0) -> plan_mod.KernelSpec:
    """The kernel the tier table gives this shape at `tokens` (tools and tests; calls go through dispatch), built
    for routing tile `tile` (None: the rule's own); experts / top_k as dispatch takes them."""
    rule = (tbl or table()).rule(OP, {**rule_shape(H, fmt, a8, experts, top_k), "tokens": max(tokens, 1),
                                      "arch": arch_})
    if tile is not None:
        rule = dataclasses.replace(rule, params={**rule.params, "tile": tile})
    return rule_spec(rule, H, I, activation, arch_, fmt, layout, a8)


def rule_shape(H: int, fmt: str, a8: bool, experts: int, top_k: int) -> dict:
    """The shape the experts rules match (besides tokens and arch): num_experts and top_k, which together say how
    many rows an expert's tiles hold at T tokens (T * top_k / num_experts on average); 0 where not known, which no
    rule keyed on them matches."""
    return {"hidden": H, "format": rule_format(fmt, a8), "num_experts": experts, "top_k": top_k}


def tile_of(s: plan_mod.KernelSpec) -> int:
    return dict(s.constants)["TILE"]


def quantizes_activations(s: plan_mod.KernelSpec) -> bool:
    """Does spec `s` take its activations quantized by two launches of its own: fp8 (A8) or f16 (the rule's f16x)?"""
    return bool(dict(s.constants).get("A8") or dict(s.params).get("f16x"))


SYNC_LINE = 32   # one_launch: int32 counters a 128-byte line (templates/experts/mma.cu.j2's SYNC_LINE)
FUSED_SMEM = 200 * 1024   # the most dynamic shared memory fused_x / stage_act rows may take a CTA (an SM: 227 KiB)


def fused_smem(rows: int, cols: int) -> int:
    """Bytes of dynamic shared memory for `rows` f16 rows of `cols` values and their fp32 scales per 128 columns."""
    return rows * (2 * cols + 4 * -(-cols // QBLOCK))


def dynamic_smem(s: plan_mod.KernelSpec) -> dict[str, int]:
    """Each GEMM's dynamic shared memory: fused_x rows of x (experts_gemm1), with stage_act rows of the intermediate
    (experts_gemm2); none otherwise. one_launch: experts_gemm12's, GEMM1's."""
    p, c = dict(s.params), dict(s.constants)
    fx = p.get("fused_x", 0) if p.get("f16x") else 0
    if one_launch(s):
        return {"experts_gemm12": fused_smem(fx, c["H"])}
    return {"experts_gemm1": fused_smem(fx, c["H"]),
            "experts_gemm2": fused_smem(fx, c["I"]) if fx and p.get("stage_act") and p.get("act_f16", True) else 0}


def quant_kernels(s: plan_mod.KernelSpec) -> tuple[str, ...]:
    """The quantizing launches of spec `s`: with quantized activations experts_quant_x, unless experts_gemm1
    quantizes x itself (the rule's fused_x), and experts_quant_act, unless experts_gemm2 reads the bf16 intermediate
    (act_f16 = false); fp8 activations (A8) take both."""
    return quant_launches(dict(s.params), bool(dict(s.constants).get("A8")))


def quant_launches(p: dict, a8: bool) -> tuple[str, ...]:
    """quant_kernels of a rule's params `p` (a8: fp8 activations)."""
    if not (a8 or p.get("f16x")):
        return ()
    return ((("experts_quant_x",) if a8 or not p.get("fused_x") else ())
            + (("experts_quant_act",) if a8 or p.get("act_f16", True) else ()))


def one_launch(s: plan_mod.KernelSpec) -> bool:
    """Does spec `s` run both GEMMs as one launch (experts_gemm12)? Its rule's one_launch, for contiguous weights
    whose intermediate rows are whole 128-byte lines (I % 64 == 0); otherwise the two launches."""
    c = dict(s.constants)
    return bool(dict(s.params).get("one_launch")) and not c.get("KN") and c["I"] % 64 == 0


def tickets(s: plan_mod.KernelSpec) -> bool:
    """Do spec `s`'s two GEMM launches take their items as tickets from counters in sync (the rule's tickets)?"""
    return bool(dict(s.params).get("tickets")) and not one_launch(s)


def uses_sync(s: plan_mod.KernelSpec) -> bool:
    """Does spec `s` take a sync buffer (counters zeroed by each launch's last CTA): one_launch or tickets?"""
    return one_launch(s) or tickets(s)


def sync_ints(tiles: int) -> int:
    """The sync buffer for this many tiles, in int32, a counter a 128-byte line: one_launch's tickets, CTAs done,
    then each tile's; tickets' GEMM1 tickets and CTAs done, then GEMM2's (at least four lines)."""
    return SYNC_LINE * (2 + max(tiles, 2))


def gemm_kernels(s: plan_mod.KernelSpec) -> tuple[str, ...]:
    """The GEMM kernels spec `s` builds and launches (dynamic_smem's): experts_gemm12 where one_launch(s), else
    experts_gemm1 and experts_gemm2."""
    return tuple(dynamic_smem(s))


def params_struct(s: plan_mod.KernelSpec) -> Params:
    """The launch fields of spec `s`'s struct Params: bf16 weights PARAMS, quantized ones their scales too
    (PARAMS_SCALED), and with quantized activations (A8, f16x) their buffers (PARAMS_A8)."""
    base = (PARAMS_A8 if quantizes_activations(s)
            else PARAMS_SCALED if dict(s.constants).get("FORMAT", "bf16") != "bf16" else PARAMS)
    return _with_sync(base) if uses_sync(s) else base


@functools.cache
def _with_sync(base: Params) -> Params:
    """one_launch's and tickets' struct Params: `base`, then the sync buffer (one struct, and launcher code, per
    base)."""
    return Params(*base.fields, ("sync", "ptr"))


def model_specs(model: tiers.Model, tbl: tiers.Table, arch_: str) -> list[plan_mod.KernelSpec]:
    """Every experts kernel `model` can dispatch to over its token range (models with an intermediate size), for
    bf16 weights (also read transposed where `experts_layout` is "kn") and for the format its checkpoints ship in
    (`experts_format`; fp8 also with fp8 activations, the w8a8 rules)."""
    if not model.intermediate:
        return []
    out: list[plan_mod.KernelSpec] = []
    builds = dict.fromkeys((("bf16", "nk", False), ("bf16", model.experts_layout, False),
                            (model.experts_format, "nk", False), (model.experts_format, "nk", True)))
    for fmt, layout, a8 in builds:   # bf16 (both layouts where the model's are transposed), the format it ships in
        if a8 and fmt != "fp8":      # (fp8: with fp8 activations too)
            continue
        for lo, _ in tiers.token_pieces(tbl.rules, OP, model.tokens):
            try:
                rule = tbl.rule(OP, {**rule_shape(model.hidden, fmt, a8, model.num_experts, model.top_k),
                                     "tokens": lo, "arch": arch_})
                s = rule_spec(rule, model.hidden, model.intermediate, model.activation, arch_, fmt, layout, a8)
            except TierError:
                continue   # these tokens run torch._grouped_mm
            if s not in out:
                out.append(s)
    return out


def explain_format(tbl: tiers.Table, model: str | None, experts_format: str | None) -> tuple[str, bool]:
    """(weight format, fp8 activations) of `--experts-format` (one of tiers.RULE_FORMATS: w8a8 = fp8 weights with fp8
    activations), else of the weight format `model` ships, else bf16."""
    if experts_format is not None and experts_format not in tiers.RULE_FORMATS:
        raise InputError(OP, "--experts-format", f"one of {', '.join(tiers.RULE_FORMATS)}", repr(experts_format))
    fmt = experts_format or (tbl.model(model).experts_format if model else "bf16")
    return ("fp8", True) if fmt == "w8a8" else (fmt, False)


def explain_rule(tbl: tiers.Table, arch_: str, *, hidden: int, tokens: int, model: str | None = None,
                 experts: int | None = None, top_k: int | None = None, experts_format: str | None = None,
                 **_shape) -> tiers.Rule:
    """The experts rule `kerngen explain --op experts` names: for `experts_format` (else the weight format `model`
    ships, else bf16), experts and top_k as dispatch takes them (None: not known)."""
    fmt, a8 = explain_format(tbl, model, experts_format)
    return tbl.rule(OP, {**rule_shape(hidden, fmt, a8, experts or 0, top_k or 0), "tokens": max(tokens, 1),
                         "arch": arch_})


def explain_spec(tbl: tiers.Table, arch_: str, *, hidden: int, tokens: int, intermediate: int = 0,
                 activation: str = "silu", model: str | None = None, experts_format: str | None = None,
                 **shape) -> plan_mod.KernelSpec:
    """The experts kernel `kerngen explain --op experts` names (intermediate and activation from `model`, else
    given; the weight format `experts_format`, else the model's, else bf16; experts and top_k, where given, as
    dispatch takes them): explain_rule's."""
    m = tbl.model(model) if model else None
    I, act = (m.intermediate, m.activation) if m else (intermediate, activation)
    if not I:
        raise InputError(OP, "intermediate", "the experts' intermediate size (a model with `intermediate`, or "
                         "--intermediate)", repr(I))
    fmt, a8 = explain_format(tbl, model, experts_format)
    quantum = QUANTUM.get(fmt)   # as kerngen.experts checks the weights of the format
    if quantum and (hidden % quantum or I % quantum):
        raise InputError(OP, "--hidden", f"H and I multiples of {quantum} for {rule_format(fmt, a8)} weights",
                         f"H = {hidden}, I = {I}")
    rule = explain_rule(tbl, arch_, hidden=hidden, tokens=tokens, model=model, experts_format=experts_format, **shape)
    return rule_spec(rule, hidden, I, act, arch_, fmt, a8=a8)
