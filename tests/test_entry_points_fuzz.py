"""Every public entry point, called with arguments of wrong types and values, raises a kerngen error naming
an argument: never a TypeError / AttributeError from underneath (seeded, so a failure reproduces)."""
import random

import pytest
import torch

import kerngen

JUNK = [None, [2], (1, 2, 3), "x", "", 2.5, float("nan"), float("inf"), -1, 0, 10**30, True, {}, object(),
        torch.tensor(2), torch.zeros(3), torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2, 2),
        torch.zeros(3, 2, 4, dtype=torch.int32), torch.zeros(0, 2, dtype=torch.int32)]


def logits():
    return torch.randn(3, 64)


def e2p():
    return torch.zeros(3, 2, dtype=torch.int32)


def routing():
    from kerngen.ops import permute as pm
    ids = torch.zeros(3, 2, dtype=torch.int32)
    return kerngen.Routing(ids, torch.zeros(3, 2), **pm.permute_reference(ids, 8, 4), tile=4)


ENTRY_POINTS = {
    "route": (lambda **a: kerngen.route(**a),
              dict(logits=logits, top_k=lambda: 2, method=lambda: "sigmoid_bias", bias=lambda: None,
                   n_group=lambda: 1, topk_group=lambda: 1, routed_scaling_factor=lambda: 1.0,
                   renormalize=lambda: True, tile=lambda: None, local_experts=lambda: None, model=lambda: None,
                   workspace=lambda: None)),
    "permute": (lambda **a: kerngen.permute(a.pop("topk_ids"), **a),
                dict(topk_ids=e2p, num_experts=lambda: 8, tile=lambda: 4, local_experts=lambda: None,
                     workspace=lambda: None)),
    "finalize": (lambda **a: kerngen.finalize(a.pop("g"), a.pop("e2p"), a.pop("w"), **a),
                 dict(g=lambda: torch.zeros(6, 64, dtype=torch.bfloat16), e2p=e2p, w=lambda: torch.zeros(3, 2),
                      hidden=lambda: None, out=lambda: None)),
    "moe_tail": (lambda **a: kerngen.moe_tail(a.pop("g"), a.pop("e2p"), a.pop("w"), a.pop("nw"), **a),
                 dict(g=lambda: torch.zeros(6, 64, dtype=torch.bfloat16), e2p=e2p, w=lambda: torch.zeros(3, 2),
                      nw=lambda: torch.ones(64, dtype=torch.bfloat16), eps=lambda: 1e-6, shared=lambda: None,
                      residual=lambda: None, out=lambda: None)),
    "select_experts": (lambda **a: kerngen.select_experts(a.pop("h"), a.pop("g"), a.pop("topk"), a.pop("renorm"),
                                                          **a),
                       dict(h=lambda: None, g=logits, topk=lambda: 2, renorm=lambda: True,
                            num_expert_group=lambda: None, topk_group=lambda: None, scoring_func=lambda: "sigmoid",
                            routed_scaling_factor=lambda: 1.0, e_score_correction_bias=lambda: None)),
    "torch.ops.kerngen.route": (lambda **a: torch.ops.kerngen.route(a.pop("logits"), a.pop("top_k"), a.pop("method"),
                                                                    **a),
                                dict(logits=logits, top_k=lambda: 2, method=lambda: "softmax_topk")),
    "experts": (lambda **a: kerngen.experts(a.pop("x"), a.pop("routing"), a.pop("w13"), a.pop("w2"), **a),
                dict(x=lambda: torch.zeros(3, 16, dtype=torch.bfloat16), routing=routing,
                     w13=lambda: torch.zeros(8, 16, 16, dtype=torch.bfloat16),
                     w2=lambda: torch.zeros(8, 16, 8, dtype=torch.bfloat16), activation=lambda: "silu",
                     interleaved=lambda: False, b13=lambda: None, tile=lambda: None, alpha=lambda: 1.702,
                     w13_scale=lambda: None, out=lambda: None, scratch=lambda: None,
                     fp8_activations=lambda: False)),
    "torch.ops.kerngen.route_permute": (lambda **a: torch.ops.kerngen.route_permute(*a.values()),
                                        dict(logits=logits, top_k=lambda: 2, method=lambda: "softmax_topk",
                                             tile=lambda: 4)),
    "torch.ops.kerngen.finalize": (lambda **a: torch.ops.kerngen.finalize(*a.values()),
                                   dict(g=lambda: torch.zeros(6, 64, dtype=torch.bfloat16), e2p=e2p,
                                        w=lambda: torch.zeros(3, 2))),
    "torch.ops.kerngen.moe_tail": (lambda **a: torch.ops.kerngen.moe_tail(*a.values()),
                                   dict(g=lambda: torch.zeros(6, 64, dtype=torch.bfloat16), e2p=e2p,
                                        w=lambda: torch.zeros(3, 2), nw=lambda: torch.ones(64, dtype=torch.bfloat16))),
    "torch.ops.kerngen.latent_tail": (lambda **a: torch.ops.kerngen.latent_tail(*a.values()),
                                      dict(g=lambda: torch.zeros(6, 64, dtype=torch.bfloat16), e2p=e2p,
                                           w=lambda: torch.zeros(3, 2), nw=lambda: torch.ones(64, dtype=torch.bfloat16),
                                           up=lambda: torch.zeros(32, 64, dtype=torch.bfloat16))),
    "torch.ops.kerngen.moe_experts": (lambda **a: torch.ops.kerngen.moe_experts(*a.values()),
                                      dict(x=lambda: torch.zeros(3, 16, dtype=torch.bfloat16), ids=e2p,
                                           w=lambda: torch.zeros(3, 2),
                                           w13=lambda: torch.zeros(8, 16, 16, dtype=torch.bfloat16),
                                           w2=lambda: torch.zeros(8, 16, 8, dtype=torch.bfloat16),
                                           activation=lambda: "silu")),
    "PreRouting": (lambda **a: kerngen.PreRouting(**a),
                   dict(model=lambda: None, num_experts=lambda: 8, top_k=lambda: 2, method=lambda: "softmax_topk",
                        tile=lambda: None, local_experts=lambda: None, max_tokens=lambda: 4,
                        weights_dtype=lambda: torch.float32, device=lambda: "cpu")),
    "RoutingWorkspace": (lambda **a: kerngen.RoutingWorkspace(a.pop("T"), a.pop("E"), a.pop("K"), **a),
                         dict(T=lambda: 4, E=lambda: 64, K=lambda: 2, tile=lambda: None,
                              local_experts=lambda: None, device=lambda: "cpu")),
}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("seed", range(40))
def test_wrong_arguments_are_kerngen_errors(name, seed):
    fn, defaults = ENTRY_POINTS[name]
    rnd = random.Random(f"{name}-{seed}")
    args = {k: make() for k, make in defaults.items()}
    for k in rnd.sample(sorted(args), rnd.randint(1, 2)):
        args[k] = rnd.choice(JUNK)
    if name.startswith("torch.ops") and seed % 2:   # meta tensors: the shape-only implementations (torch.compile's)
        args = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    try:
        fn(**args)
    except kerngen.KerngenError:
        pass   # named; the kernels themselves never run on the CPU
    except RuntimeError as e:   # torch's dispatcher refusing a schema mismatch before kerngen is reached
        assert name.startswith("torch.ops") and ("expected" in str(e) or "argument" in str(e)), e


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_each_argument_replaced_by_each_junk_value_is_a_kerngen_error(name):
    """The same, exhaustively for one argument at a time (a tensor where tile goes once reached a comparison that
    torch refused: "Boolean value of Tensor ... is ambiguous")."""
    fn, defaults = ENTRY_POINTS[name]
    for arg in sorted(defaults):
        for junk in JUNK:
            args = {k: make() for k, make in defaults.items()}
            args[arg] = junk
            try:
                fn(**args)
            except kerngen.KerngenError:
                pass
            except RuntimeError as e:
                assert name.startswith("torch.ops") and ("expected" in str(e) or "argument" in str(e)), (arg, e)


def test_route_with_a_model_checks_the_expert_count_of_the_logits():
    with pytest.raises(kerngen.InputError, match="896"):
        kerngen.route(torch.randn(2, 64), model="kimi-k3")
    with pytest.raises(kerngen.InputError, match="model"):
        kerngen.route(torch.randn(2, 64), model=["kimi-k3"])


def test_preload_and_strict_name_a_wrong_argument():
    """preload's model is checked before the GPU is asked for (a name that is no model is the tier table's error on
    every machine), strict takes only True, False or None (strict("yes") once set the mode from a truthy string)."""
    for junk in JUNK:
        if junk is None or type(junk) is bool:
            continue
        with pytest.raises(kerngen.InputError, match="'on'"):
            kerngen.strict(junk)
        if not isinstance(junk, str):
            with pytest.raises(kerngen.InputError, match="'model'"):
                kerngen.preload(junk)
    with pytest.raises(kerngen.TierError, match="unknown model 'no-such-model'"):
        kerngen.preload("no-such-model")
