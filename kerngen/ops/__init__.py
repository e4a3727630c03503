"""The op registry, and the ops: each validates its inputs, asks its dispatch object for a kernel, packs arguments
and launches.

An op joins kerngen with one `Op` declaration below (or `register(Op(...))` at run time); importing it imports no
torch and no op module. The tier loader checks rules against its variants' params, `import kerngen` makes its
public names, kerngen/torch_ops.py registers its torch ops, and the CLI, warmup and explain read OPS (the ops with
kernels) and its shape flags.

The module of an op with kernels (kerngen.ops.<op>) offers the same seam, which warmup, the CLI (`explain`), the
tuner and the tests iterate over:
    model_specs(model, table, arch) -> [KernelSpec]   every kernel a model can dispatch to
    explain_spec(table, arch, *, experts, top_k, hidden, tokens, model=None, ...) -> KernelSpec
    kernel(spec, tokens, device)                       the launch object of one spec
    dispatch(device, **static shape) -> Dispatch       the shape's kernels, resolved once: an
                                                       OpDispatch(op, build), build(device, *, <static keywords>)
and keeps in that OpDispatch, its only cache, the calls it resolved (`dispatch.calls`: input signature -> launch
object and arguments) beside its dispatch objects and what its calls reuse (scratch buffers, `Dispatch.kept`), so
kerngen.clear() forgets it all; and optionally MAX_K, its largest top_k; the ops with persistent grids (experts,
latent_tail) one more, which explain, warmup and the tests read:
    persistent(spec) -> {function: occupancy.Launch}   each kernel's CTA and the CTAs an SM its rule asks for
Its torch.ops.kerngen ops (`Op.torch`) are defined in kerngen.ops.<op>_torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from importlib import import_module
from typing import Callable

INT32_MAX = 2**31 - 1                                 # every shape and param is a 32-bit int in the kernels
# The SM count where no GPU is asked: the H200's 132. The single stand-in for plan.sm_count(device) on CPU paths
# and stub launchers (device -1), and the grid bound the routing/permute tier params are checked against.
SMS = 132


@dataclass(frozen=True)
class Param:
    """One launch parameter of a variant: its type, its bounds, and whether a rule must give it."""
    kind: type                       # int | bool | str
    required: bool = False
    lo: int = 1
    hi: int = INT32_MAX
    step: int = 1
    choices: tuple[str, ...] = ()

    def problem(self, v) -> str | None:
        """What `v` should have been, or None if it fits."""
        if self.kind is bool:
            return None if isinstance(v, bool) else "true or false"
        if self.kind is str:
            return None if isinstance(v, str) and v in self.choices else "one of " + ", ".join(map(repr, self.choices))
        if isinstance(v, int) and not isinstance(v, bool) and self.lo <= v <= self.hi and v % self.step == 0:
            return None
        return f"an integer in [{self.lo}, {self.hi}]" + (f", a multiple of {self.step}" if self.step > 1 else "")


def _n(lo: int = 1, hi: int = INT32_MAX, *, required: bool = False, step: int = 1) -> Param:
    return Param(int, required, lo, hi, step)


FLAG, NEEDED_FLAG = Param(bool), Param(bool, required=True)
NVRTC, CUTE = Param(str, choices=("nvrtc",)), Param(str, required=True, choices=("cute",))


@dataclass(frozen=True)
class Op:
    """One op as the registry declares it: what the tier loader, `import kerngen`, torch_ops and the CLI read.

    params: each variant's launch params, read from its template (Jinja values; a CuTe module's compile_kernel
    keywords) and its op's launcher; a value the template reads without a default is required, `backend` picks the
    template kind (tests/test_tiers.py checks them against the templates). A tier rule may name any registered op.
    """
    name: str
    params: dict[str, dict[str, Param]]
    host: tuple[str, ...] = ()   # variants that are host code, not templates (all of them: an op without kernels)
    between: Callable[[str, dict], str | None] | None = None   # (variant, params) -> the constraint between params
    #                                                            they break (the launchers check it), or None
    public: dict[str, str] = field(default_factory=dict)   # kerngen.<name> -> "module.attribute" under kerngen.ops
    torch: tuple[str, ...] = ()   # its torch.ops.kerngen ops, defined in <module>_torch
    shape: tuple[str, ...] = ("top_k", "hidden")   # the shape its explain_spec needs (`kerngen explain` checks it)
    module: str = ""   # its module (default kerngen.ops.<name>), with the seam when it has kernels
    tunable: bool = False   # `kerngen tune` has candidates and a timer for it (kerngen.tune.TUNERS)

    @property
    def kernels(self) -> bool:
        """Whether it has kernels (its module then offers the seam; OPS lists it): not all its variants host code."""
        return not (self.host and set(self.params) <= set(self.host))

    @property
    def module_name(self) -> str:
        return self.module or f"{__name__}.{self.name}"


_REGISTRY: dict[str, Op] = {}
OPS: tuple[str, ...] = ()   # the registered ops with kernels, in order (rebound by register and unregister)


def register(op: Op) -> Op:
    """Add `op` to the registry (at run time: then call kerngen.tiers.reload(), and import its <module>_torch
    where it has torch ops and kerngen.torch_ops is already imported)."""
    global OPS
    if op.name in _REGISTRY:
        raise ValueError(f"op {op.name!r} is registered already")
    _REGISTRY[op.name] = op
    OPS = tuple(o.name for o in _REGISTRY.values() if o.kernels)
    return op


def unregister(name: str) -> None:
    """Take op `name` out of the registry (then call kerngen.tiers.reload())."""
    global OPS
    del _REGISTRY[name]
    OPS = tuple(o.name for o in _REGISTRY.values() if o.kernels)


def registered() -> tuple[Op, ...]:
    """Every registered op, in order: those a tier rule may name (OPS, and the ops without kernels: tail_tp)."""
    return tuple(_REGISTRY.values())


def declared(op: str) -> Op:
    """The declaration of registered op `op`."""
    if op not in _REGISTRY:
        raise KeyError(f"unknown op {op!r}; kerngen's ops are {', '.join(_REGISTRY)}")
    return _REGISTRY[op]


def params(op: str, variant: str) -> dict[str, Param] | None:
    """The launch params of `op`'s `variant`, None where no registered op declares them."""
    return _REGISTRY[op].params.get(variant) if op in _REGISTRY else None


def op_module(op: str):
    """The module of `op`, one of OPS."""
    if op not in OPS:
        raise KeyError(f"unknown op {op!r}; kerngen's ops are {', '.join(OPS)}")
    return import_module(_REGISTRY[op].module_name)


def tunable() -> tuple[str, ...]:
    """The registered ops `kerngen tune` times candidates for, in order."""
    return tuple(o.name for o in _REGISTRY.values() if o.tunable)


def public() -> dict[str, str]:
    """The public names the registered ops give kerngen: name -> "module.attribute" under kerngen.ops."""
    return {name: path for o in _REGISTRY.values() for name, path in o.public.items()}


# ------------------------------------------------------------------------------------------------ the ops
def _routing(variant: str, p: dict) -> str | None:
    if p["warps"] % p["warps_per_token"]:
        return f"param 'warps' ({p['warps']}) must be a multiple of 'warps_per_token' ({p['warps_per_token']})"
    if variant == "fused" and p["ctas"] * p["clusters"] > SMS:
        return f"params 'ctas' * 'clusters' must be at most {SMS}, got {p['ctas']} * {p['clusters']}"
    return None


register(Op("routing", {
    "fused": {"backend": NVRTC, "warps": _n(1, 32, required=True), "warps_per_token": _n(1, 32, required=True),
              "ctas": _n(1, 8, required=True), "clusters": _n(1, SMS, required=True),
              "max_tokens": _n(1, 64, required=True),   # a 64-bit token mask per expert
              "pdl": FLAG},   # the launch's programmatic-dependent-launch attribute (default true)
    "topk": {"backend": NVRTC, "warps": _n(1, 32, required=True), "warps_per_token": _n(1, 32, required=True),
             "early_trigger": FLAG, "pdl": FLAG}},
    between=_routing, public={"route": "routing.route", "PreRouting": "prerouting.PreRouting"},
    torch=("route", "route_permute"), shape=("experts", "top_k"), tunable=True))

register(Op("permute", {
    "onepass": {"backend": NVRTC, "threads": _n(32, 1024, step=32), "ctas": _n(1, SMS)},
    "histogram": {"backend": NVRTC, "tokens_per_block": _n(16, required=True)}},
    public={"permute": "permute.permute", "Routing": "permute.Routing", "RoutingWorkspace": "permute.RoutingWorkspace"},
    torch=("moe_align_block_size",), shape=("experts", "top_k")))

register(Op("finalize", {
    "small_batch": {"backend": NVRTC, "block_x": _n(1, 1024, required=True),
                    "loads_per_group": _n(1, 64, required=True), "early_read": NEEDED_FLAG, "pdl": FLAG,
                    "stream": FLAG},   # false: rows read with the default cache policy (not evict-first)
    "large_batch": {"backend": NVRTC, "vectors_per_thread": _n(1, 1024, required=True),
                    "unroll": _n(1, 64, required=True), "early_read": NEEDED_FLAG, "pdl": FLAG},
    "cute": {"backend": CUTE, "ctas": _n(1, 1024), "threads": _n(32, 1024), "max_loads": _n(1, 64), "pdl": FLAG}},
    public={"finalize": "finalize.finalize", "finalize_prepare": "finalize.prepare"}, torch=("finalize",), tunable=True))

register(Op("tail", {
    "tail": {"backend": CUTE, "threads": _n(32, 1024, required=True), "cluster": _n(1, 16), "max_loads": _n(1, 64),
             "branch_free": FLAG, "pdl": FLAG,
             "async_reduce": FLAG}},   # clusters: the partial sums by st.async, no second cluster barrier
    public={"moe_tail": "tail.moe_tail"}, torch=("moe_tail",), tunable=True))

register(Op("experts", {
    "mma": {"backend": NVRTC, "tile": _n(1, 32, required=True), "warps": _n(1, 16, required=True),
            "unroll": _n(1, 8, required=True), "blocks_per_sm": _n(1, 32), "pdl": FLAG,
            "gemm1_blocks": _n(1, 32),   # experts_gemm1's CTAs an SM where fewer than blocks_per_sm fit (two launches)
            "gemm2_blocks": _n(1, 32),   # experts_gemm2's CTAs an SM (and its register bound with min_blocks)
            "transposed": FLAG,   # false: weights stored transposed run torch._grouped_mm here
            "min_blocks": _n(1, 32),   # __launch_bounds__' CTAs an SM: a register bound
            "prefetch": FLAG,   # quantized builds: the next steps' weight loads issued first (default)
            "prefetch_x": FLAG,   # quantized builds with prefetch: the next steps' activations too
            "f16x": FLAG,   # fp8 / MXFP4 weights: activations carried as f16 (power-of-two scales)
            "mtiles": _n(1, 2),   # bf16 [E, N, K] or f16x: m16 tiles of weight rows an item takes (default 1)
            "pingpong": FLAG,   # with f16x and prefetch: two weight buffers take turns (no copies)
            "fused_x": _n(1, 16),   # with f16x: gemm1 quantizes x itself, calls of at most so many tokens
            "act_f16": FLAG,   # with f16x: gemm2 on the intermediate as f16 (default) or bf16 (false)
            "stage_act": FLAG,   # with fused_x: gemm2 copies its tile's f16 rows into shared memory
            "lean": FLAG,   # quantized, prefetch = false: whole K steps unchecked, fewer instructions a step
            "gcol": FLAG,   # MXFP4, 1-2 tokens: gemm1's mma columns each one 32-value group, its scale in fp32
            "wide": FLAG,   # with gcol: a lane reads 32 contiguous bytes of a row a step (two groups, 256-wide steps)
            "gemm1_unroll": _n(1, 8),   # with gcol: experts_gemm1's steps a load batch where not unroll
            "one_launch": FLAG,   # both GEMMs in one launch: tickets, GEMM2's items waiting on their tile's GEMM1
            "tickets": FLAG,   # two launches whose CTAs take their items from a counter (not a fixed stride)
            "early_l2": FLAG}},   # the first item's first weight bytes to L2 before the wait
    public={"experts": "experts.experts"}, torch=("moe_experts",), shape=("hidden", "intermediate"), tunable=True))


def _latent_tail(variant: str, p: dict) -> str | None:
    if variant == "fused" and p["max_tokens"] > 16 and not p.get("split"):
        return f"param 'max_tokens' must be at most 16 without split = true (split builds: 32), got {p['max_tokens']}"
    if variant == "norm_gemm" and p.get("addmm") and not p.get("gemm_bf16"):
        return "param 'addmm' needs gemm_bf16 = true (the sum shared + residual is rounded before the GEMM adds it)"
    return None


register(Op("latent_tail", {
    "fused": {"backend": NVRTC, "max_tokens": _n(1, 32, required=True), "warps": _n(1, 32, required=True),
              "unroll": _n(1, 8, required=True), "cluster": _n(1, 8), "blocks_per_sm": _n(1, 32), "pdl": FLAG,
              "early_weights": FLAG,   # the first weight steps loaded into registers before the wait
              "norm_loads": _n(1, 16),   # split: rows a norm thread loads at once (default 16)
              "norm_vectors": _n(1, 8),   # split: vectors a norm thread computes (default 1)
              "norm_async": FLAG,   # split: the norm CTAs' sums by st.async, no cluster barrier
              "even_rows": FLAG,   # split: each projection CTA an even share of up_proj's rows
              "n_global": FLAG,   # split: the projection reads n from global memory (no copy)
              "proj_registers": _n(32, 255),   # split: the projection's register bound
              "l2_lines": _n(0, 4096),   # split: lines of each first-item row sent toward L2
              "items_per_cta": _n(1, 64),   # the grid: at most ceil(items / items_per_cta) CTAs
              "weights_delay": _n(0, 100000),   # split: ns before the projection's first loads
              "late_launch": _n(0, 2),   # split: the norm kernel lets the projection launch once its routing (1)
              #                            or its rows (2) are in, not at entry (0)
              "beside_norm": FLAG,   # split: a projection CTA fewer an SM for each norm CTA
              "next_early": FLAG,   # split with early_weights: the next item's first steps loaded before the epilogue
              "split": FLAG},   # the norm in a first kernel of its own, the projection waiting on it
    "norm_gemm": {"backend": NVRTC, "cluster": _n(1, 8), "pdl": FLAG,   # norm kernel, torch.mm, add
                  "norm_loads": _n(1, 16),   # rows a norm thread loads at once (default 16)
                  "norm_vectors": _n(1, 8),   # vectors a norm thread computes (default 1)
                  "norm_async": FLAG,   # the norm CTAs' sums by st.async, no cluster barrier
                  "gemm_bf16": FLAG,   # the GEMM's h in bf16 (rounded before the adds)
                  "addmm": FLAG},   # with gemm_bf16: the norm kernel writes shared + residual, the GEMM adds it
    "unfused": {}},   # kerngen.finalize + torch (host code)
    host=("unfused",), between=_latent_tail, public={"latent_tail": "latent_tail.latent_tail"},
    torch=("latent_tail",), tunable=True))


def _tail_tp(variant: str, p: dict) -> str | None:
    if p["allreduce"] == "symm_mem" and "max_tokens" not in p:
        return "allreduce = \"symm_mem\" needs param 'max_tokens' (the rows of its symmetric buffer)"
    return None


# the fused tail with tensor parallelism: torch.distributed around tail's kernels, no kernel of its own
register(Op("tail_tp", {"allreduce": {"allreduce": Param(str, required=True, choices=("nccl", "symm_mem")),
                                      "max_tokens": _n()}}, host=("allreduce",), between=_tail_tp))
