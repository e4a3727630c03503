"""latent_tail planning: which kernel a rule or shape gives (tag, constants), the struct Params of its launches, and
each build's CTAs checked against the template's limits (`persistent`): no tensors, no GPU (warmup, explain and the
tests read it); kerngen.ops.latent_tail launches.
"""
from __future__ import annotations

from .. import plan as plan_mod
from .. import tiers
from ..errors import InputError
from ..launch import Params
from ..occupancy import SM90, Launch
from ._common import SHORT, table
from .latent_tail_checks import OP

MAX_FUSED_TOKENS = 16          # the mma n-blocks of the fused kernel: two of 8 tokens
SMEM_PER_CTA = SM90.smem_per_cta   # sm_90 / sm_100: the most shared memory one CTA may use
# struct Params of templates/latent_tail/fused.cu.j2
PARAMS = Params(("g", "ptr"), ("idx", "ptr"), ("w", "ptr"), ("nw", "ptr"), ("up", "ptr"), ("shared", "ptr"),
                ("residual", "ptr"), ("out", "ptr"), ("ld", "int"), ("rows", "int"), ("tokens", "int"),
                ("eps", "float"))
PARAMS_SPLIT = Params(*PARAMS.fields, ("n", "ptr"))   # split builds: both kernels, the scratch n last
# struct AddParams of templates/latent_tail/norm_gemm.cu.j2
PARAMS_ADD = Params(("h", "ptr"), ("shared", "ptr"), ("residual", "ptr"), ("out", "ptr"), ("vectors", "int"))


# ---------------------------------------------------------------------------------------------- specs

def tag_constants(L: int, H: int, top_k: int, weights_dtype: str) -> tuple[str, dict]:
    """The cache tag and template constants of a fused build (the rule adds its params)."""
    return f"L{L}-H{H}-K{top_k}-bf16-w{SHORT[weights_dtype]}", {"L": L, "H": H, "K": top_k, "WDTYPE": weights_dtype}


def rule_spec(rule: tiers.Rule, L: int, H: int, top_k: int, weights_dtype: str, arch_: str) -> plan_mod.KernelSpec:
    """The spec of a latent_tail rule at this shape (an "unfused" spec names host code: nothing to build)."""
    return plan_mod.spec_for(rule, *tag_constants(L, H, top_k, weights_dtype), arch_)


def spec(L: int, H: int, top_k: int, weights_dtype: str, tokens: int, arch_: str,
         tbl: tiers.Table | None = None) -> plan_mod.KernelSpec:
    """The spec the tier table gives this shape at `tokens` (tools and tests; calls go through dispatch)."""
    rule = (tbl or table()).rule(OP, {"hidden": L, "top_k": top_k, "tokens": max(tokens, 1), "arch": arch_})
    return rule_spec(rule, L, H, top_k, weights_dtype, arch_)


def model_specs(model: tiers.Model, tbl: tiers.Table, arch_: str) -> list[plan_mod.KernelSpec]:
    """The fused and norm_gemm builds of a latent model (model_hidden set) over its token range; the unfused variant
    runs kerngen.finalize (its kernels are finalize's model_specs) and torch."""
    if not model.model_hidden:
        return []
    shape = {"hidden": model.hidden, "top_k": model.top_k, "num_experts": model.num_experts, "arch": arch_}
    out: list[plan_mod.KernelSpec] = []
    for rule in tbl.rules_for(OP, shape, model.tokens):
        if rule.variant != "unfused":
            s = rule_spec(rule, model.hidden, model.model_hidden, model.top_k, model.weights_dtype, arch_)
            if s not in out:
                out.append(s)
    return out


def explain_spec(tbl: tiers.Table, arch_: str, *, hidden: int, top_k: int, tokens: int, model: str | None = None,
                 model_hidden: int = 0, weights_dtype: str = "float32", **_shape) -> plan_mod.KernelSpec:
    """`kerngen explain --op latent_tail`: `hidden` is the latent width L; the projection's width is the model's
    model_hidden (else `model_hidden`, else L itself). Tokens the unfused host path serves have no kernel."""
    m = tbl.model(model) if model else None
    H = (m.model_hidden if m and m.model_hidden else 0) or model_hidden or hidden
    s = spec(hidden, H, top_k, weights_dtype, tokens, arch_, tbl)
    if s.variant == "unfused":
        raise InputError(OP, "tokens", f"a count a fused rule serves ({tokens} tokens run the unfused variant: "
                         "kerngen.finalize and torch, no kernel of its own)", str(tokens))
    return s


# ---------------------------------------------------------------------------------------------- launch objects

FUNCTION = "latent_tail_fused"
NORM, PROJ = "latent_tail_norm", "latent_tail_proj"   # the split build's two kernels
ADD = "latent_tail_add"   # a norm_gemm build's second kernel (the first is NORM)


def split(s: plan_mod.KernelSpec) -> bool:
    """A fused rule with split = true: the norm in a kernel of its own, the projection waiting on it (PDL)."""
    return s.variant == "fused" and bool(dict(s.params).get("split", False))


# fused params that only split builds take
SPLIT_ONLY = ("even_rows", "n_global", "proj_registers", "l2_lines", "weights_delay", "beside_norm", "norm_async",
              "next_early", "late_launch")


def even_rows(s: plan_mod.KernelSpec) -> bool:
    """A split rule with even_rows = true: each projection CTA takes an even share of up_proj's rows (a contiguous
    range, in tiles of 16 whose rows past it read as zeros) instead of 16-row items striding by the grid."""
    return bool(dict(s.params).get("even_rows", False))


def n_global(s: plan_mod.KernelSpec) -> bool:
    """A rule with n_global = true: the projection reads n from the scratch in global memory at each step (no
    copy into shared memory, no dynamic shared memory)."""
    return bool(dict(s.params).get("n_global", False))


def _norm_launch(s: plan_mod.KernelSpec) -> Launch:
    """latent_tail_norm's CTA (split and norm_gemm builds): a thread norm_vectors of the CTA's slice of
    ceil(L / 8 / cluster) vectors, rounded up to warps (the template's NORM_T), at most 1024."""
    p, L = dict(s.params), dict(s.constants)["L"]
    vs = -(-(L // 8) // p.get("cluster", 1))
    threads = -(-vs // (32 * p.get("norm_vectors", 1))) * 32
    if threads > 1024:
        raise InputError(OP, "tier params", "L / 8 / cluster / norm_vectors <= 1024 (a norm CTA's threads)",
                         f"{s.params} at L = {L}")
    return Launch(threads, 0, 1)


def persistent(s: plan_mod.KernelSpec) -> dict[str, Launch]:
    """The fused kernel's CTA (threads, dynamic shared memory) and the CTAs an SM its rule asks for, its params
    checked against the template's limits (the same as its static_asserts, as named errors); for a split build the
    projection's (persistent) and the norm kernel's (a cluster a token, one CTA an SM asked); for norm_gemm the norm
    kernel's and the add kernel's; none for the unfused
    variant (host code)."""
    if s.variant == "norm_gemm":
        return {NORM: _norm_launch(s), ADD: Launch(256, 0, 1)}
    if s.variant != "fused":
        return {}
    for name in SPLIT_ONLY:   # (checked here: explain and warmup too)
        if dict(s.params).get(name) and not split(s):
            raise InputError(OP, "tier params", f"{name} only with split = true", str(s.params))
    c, p = dict(s.constants), dict(s.params)
    L, K = c["L"], c["K"]
    mt, warps, cl = p["max_tokens"], p["warps"], p.get("cluster", 1)
    nt = 32 * warps
    vs = -(-(L // 8) // cl)
    vpt = -(-(mt * vs) // nt)
    nb = -(-mt // 8)
    dyn = mt * (L + 8) * 2
    red = max(warps - 1, 1) * nb * 4 * 32 * 4
    if split(s):
        norm = _norm_launch(s)
        dyn = 0 if n_global(s) else dyn   # (n_global: the projection keeps no copy of n)
        if red > 48 * 1024 or red + dyn > SMEM_PER_CTA:
            raise InputError(OP, "tier params", f"shared memory within the CTA's {SMEM_PER_CTA} bytes (static <= 48 KiB)",
                             f"{red} static + {dyn} dynamic bytes from {s.params} at L = {L}")
        return {NORM: norm, PROJ: Launch(nt, dyn, p.get("blocks_per_sm", 1))}
    static = mt * K * 8 + mt * vs * 4 + mt * 8 + red
    if mt > 16:
        raise InputError(OP, "tier params", "max_tokens at most 16 for the one-launch fused kernel (split: 32)",
                         str(s.params))
    if vpt > 8:
        raise InputError(OP, "tier params", "warps * 32 * 8 >= max_tokens * ceil(L / 8 / cluster) (at most 8 "
                         "(token, vector) pairs a thread)", f"{s.params} at L = {L}")
    if static > 48 * 1024 or static + dyn > SMEM_PER_CTA:
        raise InputError(OP, "tier params", f"shared memory within the CTA's {SMEM_PER_CTA} bytes (static <= 48 KiB)",
                         f"{static} static + {dyn} dynamic bytes from {s.params} at L = {L}, K = {K}")
    return {FUNCTION: Launch(nt, dyn, p.get("blocks_per_sm", 1))}
