"""The fused routing kernel on plain CTAs (ctas = 1) at 2 to 16 tokens, which no shipped rule picks (they use one
CTA only at T = 1) but the tuner's candidates and user rules do: with several token groups in a CTA, a group ORs
its picks into the shared masks while the others may still be clearing them, unless a barrier orders the two.
A lost pick shows as a count short by one and two rows colliding, so ids and the whole permutation are compared
exactly, many times per token count."""
import pytest
import torch

import kerngen
from kerngen import tiers
from kerngen.ops import permute as pm
from tests.gpu.test_routing import check, make, make_bias, model_args

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("gpu_cache")]

CONFIGS = [   # token groups per CTA: 8, 4, 8, 2
    dict(warps=16, warps_per_token=2, ctas=1, clusters=4, max_tokens=16),
    dict(warps=16, warps_per_token=4, ctas=1, clusters=1, max_tokens=16),
    dict(warps=8, warps_per_token=1, ctas=1, clusters=2, max_tokens=16),
    dict(warps=16, warps_per_token=8, ctas=1, clusters=8, max_tokens=16),   # the shipped T = 1 shape, at T >= 2
]
MODELS = ["kimi-k3", "deepseek-v3", "kimi-k2", "mixtral-8x7b", "llama-4-maverick"]
REPEATS = 6


def toml_value(v):
    return str(v).lower() if isinstance(v, bool) else str(v)


@pytest.fixture
def ctas1_tiers(request, tmp_path, monkeypatch):
    """A user tiers file sending every routing call of 1 to 16 tokens to the fused kernel with `params`; routes
    planned before (or by other tests) are forgotten while it is in force."""
    params = request.param
    path = tmp_path / "ctas1.toml"
    path.write_text('schema = 1\n\n[[tier]]\nop = "routing"\nvariant = "fused"\ntokens = [1, 16]\n'
                    "params = { " + ", ".join(f"{k} = {toml_value(v)}" for k, v in params.items()) + " }\n")
    monkeypatch.setenv("KERNGEN_TIERS", str(path))
    kerngen.clear()
    yield params
    kerngen.clear()


@pytest.mark.parametrize("tile", [4, 128])   # tile < T (counts and a scan) and tile >= T (bitmap popcounts)
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("ctas1_tiers", CONFIGS, indirect=True,
                         ids=lambda p: "w{warps}x{warps_per_token}c{ctas}k{clusters}m{max_tokens}".format(**p))
def test_fused_on_plain_ctas_matches_the_reference_at_2_to_16_tokens(ctas1_tiers, name, tile):
    m, kw = model_args(name)
    E = m.num_experts
    bias = make_bias(E, m.routing)
    ws = pm.RoutingWorkspace(16, E, m.top_k, tile)
    for T in range(2, 17):
        rule = tiers.load().rule("routing", {"num_experts": E, "top_k": m.top_k, "tokens": T})
        assert (rule.variant, rule.params["ctas"]) == ("fused", 1), rule
        for rep in range(REPEATS):
            # ids and weights against rt.reference, the permutation against pm.permute_reference, every field
            check(make(T, E, seed=1000 * T + rep), kw, bias=bias, tile=tile, workspace=ws)


@pytest.mark.parametrize("tile", [None, 16])
@pytest.mark.parametrize("variant,params", [
    ("topk", dict(warps=4, warps_per_token=4, early_trigger=True, pdl=False)),
    ("fused", dict(warps=16, warps_per_token=8, ctas=1, clusters=8, max_tokens=8, pdl=False)),
])
def test_rules_without_pdl_match_the_reference(tmp_path, monkeypatch, variant, params, tile):
    """A routing rule with `pdl = false` (its first launch without the programmatic-dependent-launch attribute),
    each call right behind a torch kernel that writes the logits: ids, weights and the permutation as the reference,
    kimi-k3 at 1 to 8 tokens, many times."""
    path = tmp_path / "nopdl.toml"
    path.write_text(f'schema = 1\n\n[[tier]]\nop = "routing"\nvariant = "{variant}"\nnum_experts = [896, 896]\n'
                    "tokens = [1, 8]\nparams = { " + ", ".join(f"{k} = {toml_value(v)}" for k, v in params.items())
                    + " }\n")
    monkeypatch.setenv("KERNGEN_TIERS", str(path))
    kerngen.clear()
    try:
        m, kw = model_args("kimi-k3")
        E = m.num_experts
        bias = make_bias(E, m.routing)
        ws = pm.RoutingWorkspace(8, E, m.top_k, tile)
        for T in range(1, 9):
            rule = tiers.load().rule("routing", {"num_experts": E, "top_k": m.top_k, "tokens": T})
            assert rule.variant == variant and rule.params["pdl"] is False, rule
            for rep in range(REPEATS):
                logits = make(T, E, seed=100 * T + rep)
                logits.mul_(1.0)   # the producer: a torch kernel, which never triggers its dependents
                check(logits, kw, bias=bias, tile=tile, workspace=ws)
    finally:
        kerngen.clear()
