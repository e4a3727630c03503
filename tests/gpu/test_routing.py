"""routing on the GPU against the torch reference: ids bitwise, weights to 1e-6, permutation exactly."""
import pytest
import torch

import kerngen
from kerngen import tiers
from kerngen.ops import permute as pm
from kerngen.ops import routing as rt
from kerngen.ops.finalize import reference as finalize_reference
from tests.helpers import user_tiers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("gpu_cache")]

TOKENS = [1, 2, 3, 4, 5, 8, 16, 32, 64, 256, 1024, 4096, 16384]
MODELS = sorted(tiers.load().models)
PERM_FIELDS = ("expert_counts", "expert_offsets", "expanded_to_permuted", "permuted_to_token", "tile_to_expert",
               "num_permuted_rows")


def model_args(name):
    m = tiers.load().model(name)
    return m, dict(top_k=m.top_k, method=m.routing, n_group=m.n_group, topk_group=m.topk_group,
                   routed_scaling_factor=m.routed_scaling_factor, renormalize=m.renormalize)


def make(T, E, *, dtype=torch.float32, seed=0, ties=False, ninf=0.0, nan=0.0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if ties:   # few distinct values: many exact ties
        s = torch.randint(-3, 3, (T, E), device="cuda", generator=g).float() * 0.5
    else:
        s = torch.randn(T, E, device="cuda", generator=g) * 2
    if ninf:
        s = torch.where(torch.rand(T, E, device="cuda", generator=g) < ninf, float("-inf"), s)
    if nan:
        s = torch.where(torch.rand(T, E, device="cuda", generator=g) < nan, float("nan"), s)
    return s.to(dtype).contiguous()


def make_bias(E, method, seed=0, dtype=torch.float32, ties=False):
    if "sigmoid_bias" not in method:
        return None
    if ties:
        return torch.zeros(E, device="cuda", dtype=dtype)
    g = torch.Generator(device="cuda").manual_seed(seed + 7)
    return (torch.randn(E, device="cuda", generator=g) * 0.05).to(dtype)


def check(logits, kw, *, bias=None, tile=None, local=None, workspace=None):
    r = kerngen.route(logits, bias=bias, tile=tile, local_experts=local, workspace=workspace, **kw)
    ids, w = rt.reference(logits, kw["top_k"], kw["method"], bias, kw.get("n_group", 1), kw.get("topk_group", 1),
                          kw.get("routed_scaling_factor", 1.0), kw.get("renormalize", True))
    assert r.topk_ids.dtype == torch.int32 and r.topk_ids.shape == ids.shape
    bad = (r.topk_ids != ids).any(-1).nonzero().flatten()
    assert bad.numel() == 0, f"{bad.numel()} rows differ, first t={bad[0].item()}: " \
        f"{r.topk_ids[bad[0]].tolist()} vs {ids[bad[0]].tolist()}"
    if r.topk_weights.dtype == torch.float32:
        torch.testing.assert_close(r.topk_weights, w, rtol=1e-6, atol=1e-12)
    else:
        torch.testing.assert_close(r.topk_weights.float(), w, rtol=1e-2, atol=1e-6)
    if tile is not None:
        check_permutation(r, ids, logits.shape[1], tile, local)
    return r


def check_permutation(r, ids, E, tile, local):
    ref = pm.permute_reference(ids, E, tile, local)
    for f in PERM_FIELDS:
        got = getattr(r, f)
        assert got.shape == ref[f].shape and torch.equal(got, ref[f]), f


@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("name", MODELS)
def test_every_model_every_token_count(name, T):
    m, kw = model_args(name)
    logits = make(T, m.num_experts, seed=T)
    check(logits, kw, bias=make_bias(m.num_experts, m.routing, T), tile=128)


@pytest.mark.parametrize("T", [1, 5, 16, 300, 4096])
@pytest.mark.parametrize("name", MODELS)
def test_exact_ties_with_bf16_logits(name, T):
    m, kw = model_args(name)
    logits = make(T, m.num_experts, dtype=torch.bfloat16, seed=T, ties=True)
    check(logits, kw, bias=make_bias(m.num_experts, m.routing, ties=True), tile=16)


@pytest.mark.parametrize("T", [3, 16, 100, 2048])
@pytest.mark.parametrize("name", MODELS)
def test_minus_inf_and_nan(name, T):
    m, kw = model_args(name)
    logits = make(T, m.num_experts, seed=T, ninf=0.9, nan=0.05)
    logits[0] = float("-inf")
    if T > 1:
        logits[1] = float("nan")
    check(logits, kw, bias=make_bias(m.num_experts, m.routing, T), tile=8)


@pytest.mark.parametrize("T", [1, 5, 8, 64, 300])
@pytest.mark.parametrize("case", ["plain", "ties", "ninf", "one_lane"])
@pytest.mark.parametrize("name", MODELS)
def test_ids_only_calls_on_hard_rows(name, case, T):
    """Calls without a tile (ids and weights only: the permute = false rules, kimi-k3's top-k of 4 warps a token whose
    threshold is the least of its warps' estimates) on exact ties, mostly -inf / NaN rows, and rows whose finite keys
    all sit in one lane's experts (the warps' estimates then hold zeros and the exact threshold runs)."""
    m, kw = model_args(name)
    E = m.num_experts
    bias = make_bias(E, m.routing, T, ties=case == "ties")
    if case == "ties":
        logits = make(T, E, dtype=torch.bfloat16, seed=T, ties=True)
    elif case == "ninf":
        logits = make(T, E, seed=T, ninf=0.95, nan=0.02)
    else:
        logits = make(T, E, seed=T)
        if case == "one_lane":   # finite keys only at experts 0, 128, 256, ... (lane 0 of warp 0 on 4 warps a token)
            keep = torch.zeros_like(logits, dtype=torch.bool)
            keep[:, ::128] = True
            keep[:, 1] = True
            logits[~keep] = float("-inf")
    check(logits, kw, bias=bias)


@pytest.mark.parametrize("T", [1, 8, 16, 300])
@pytest.mark.parametrize("seed", range(4))
def test_grouped_groups_with_one_finite_key_are_kept(seed, T):
    """deepseek-v3 (8 groups of 32, 4 kept): rows where most groups hold a single finite key."""
    m, kw = model_args("deepseek-v3")
    logits = make(T, m.num_experts, seed=seed + 100)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep[:, ::32] = True                                        # one finite key per group ...
    keep[:, 1::64] = seed % 2 == 1                              # ... and two in every other group on odd seeds
    logits[~keep] = float("-inf")
    r = check(logits, kw, bias=make_bias(m.num_experts, m.routing, seed), tile=8)
    # every group holds a finite key, so each of the 4 kept groups gives at least one finite pick
    assert torch.isfinite(logits.gather(1, r.topk_ids.long())).sum(-1).min() >= 4


@pytest.mark.parametrize("tile", [1, 8, 16, 64, 128])
@pytest.mark.parametrize("local", [None, (0, 64), (100, 28), (255, 1)])
@pytest.mark.parametrize("T", [1, 4, 16, 17, 1000])
def test_expert_parallel_ranges_and_tiles(T, local, tile):
    _, kw = model_args("deepseek-v3")
    logits = make(T, 256, seed=T + tile)
    check(logits, kw, bias=make_bias(256, kw["method"]), tile=tile, local=local)


@pytest.mark.parametrize("T", [2, 16, 64, 4096])
@pytest.mark.parametrize("case", [
    dict(E=2048, top_k=32, method="grouped_sigmoid_bias", n_group=16, topk_group=4, routed_scaling_factor=1.5),
    dict(E=2048, top_k=32, method="softmax_topk", renormalize=False),
    dict(E=1000, top_k=3, method="topk_softmax"),
    dict(E=33, top_k=5, method="sigmoid_bias", renormalize=False),
    dict(E=1, top_k=1, method="softmax_topk"),
    dict(E=600, top_k=1, method="top1_sigmoid"),
], ids=lambda c: f"E{c['E']}-K{c['top_k']}-{c['method']}")
def test_generic_shapes(case, T):
    case = dict(case)
    E = case.pop("E")
    logits = make(T, E, dtype=torch.bfloat16, seed=E + T)
    check(logits, case, bias=make_bias(E, case["method"], dtype=torch.bfloat16), tile=64, local=(0, E))


def test_ids_and_weights_without_tile_and_bf16_weights():
    m, kw = model_args("kimi-k3")
    logits = make(40, 896, seed=3)
    bias = make_bias(896, m.routing)
    r = check(logits, kw, bias=bias)
    assert r.expert_counts is None and r.permuted_to_token is None
    ws = kerngen.RoutingWorkspace(64, 896, 16, None, weights_dtype=torch.bfloat16)
    check(logits, kw, bias=bias, workspace=ws)
    check(logits[:3], kw, bias=bias, workspace=ws)


def test_model_argument_fills_the_constants():
    m, kw = model_args("deepseek-v3")
    logits = make(8, 256, seed=1)
    bias = make_bias(256, m.routing)
    a = kerngen.route(logits, bias=bias, model="deepseek-v3", tile=128)
    b = kerngen.route(logits, bias=bias, tile=128, **kw)
    assert torch.equal(a.topk_ids, b.topk_ids) and torch.equal(a.topk_weights, b.topk_weights)
    assert torch.equal(a.expanded_to_permuted, b.expanded_to_permuted)


def test_workspace_reuse_keeps_the_tail_minus_one():
    m, kw = model_args("kimi-k3")
    bias = make_bias(896, m.routing)
    ws = kerngen.RoutingWorkspace(4096, 896, 16, 16)
    for T in (4096, 7, 2000, 1, 16, 3000):
        r = check(make(T, 896, seed=T), kw, bias=bias, tile=16, workspace=ws)
        rows = int(r.num_permuted_rows)
        assert (ws.p2t[rows:] == -1).all() and (ws.t2e[rows // 16:] == -1).all()
        assert int(ws.ticket) == 0   # permute_offsets' last CTA hands the ticket back for the next call


@pytest.mark.parametrize("name", ["kimi-k3", "qwen3-30b-a3b"])
def test_calls_without_workspace_that_take_dropped_buffers_again_stay_correct(name):
    """Calls without workspace= whose previous result was dropped write into its buffers again (no allocation):
    each result equals the reference, with any token count up to the prototype's and after a call on another
    stream; a result still held is left as it was."""
    m, kw = model_args(name)
    E = m.num_experts
    bias = make_bias(E, m.routing)
    for T in (1, 5, 64):
        for seed in range(4):   # each call's result dropped before the next
            check(make(T, E, seed=seed), kw, bias=bias, tile=16)
        held = check(make(T, E, seed=10), kw, bias=bias, tile=16)
        snapshot = {f: getattr(held, f).clone() for f in ("topk_ids", "topk_weights", *PERM_FIELDS)}
        check(make(T, E, seed=11), kw, bias=bias, tile=16)
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            check(make(T, E, seed=12), kw, bias=bias, tile=16)
        torch.cuda.current_stream().wait_stream(side)
        check(make(T, E, seed=13), kw, bias=bias, tile=16)
        torch.cuda.synchronize()
        for f, want in snapshot.items():
            assert torch.equal(getattr(held, f), want), f


@pytest.mark.parametrize("T", [8, 2048])
@pytest.mark.parametrize("name", ["kimi-k3", "deepseek-v3"])
def test_inside_a_cuda_graph(name, T):
    m, kw = model_args(name)
    E = m.num_experts
    bias = make_bias(E, m.routing)
    ws = kerngen.RoutingWorkspace(T, E, m.top_k, 128)
    x = make(T, E, seed=0)
    kerngen.route(x, bias=bias, tile=128, workspace=ws, **kw)       # build and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        r = kerngen.route(x, bias=bias, tile=128, workspace=ws, **kw)
    for seed in (1, 2, 3):
        x.copy_(make(T, E, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        ids, w = rt.reference(x, m.top_k, m.routing, bias, m.n_group, m.topk_group, m.routed_scaling_factor)
        assert torch.equal(r.topk_ids, ids)
        torch.testing.assert_close(r.topk_weights, w, rtol=1e-6, atol=1e-12)
        check_permutation(r, ids, E, 128, None)


@pytest.mark.parametrize("T", [1, 9, 16, 333, 5000])
@pytest.mark.parametrize("local", [None, (8, 100)])
def test_permute_from_external_ids(T, local):
    E, K, tile = 128, 8, 16
    g = torch.Generator(device="cuda").manual_seed(T)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).int()
    r = kerngen.permute(ids, num_experts=E, tile=tile, local_experts=local)
    check_permutation(r, ids, E, tile, local)


ONEPASS_CONFIGS = [dict(ctas=1, threads=32), dict(ctas=3, threads=96), dict(ctas=32, threads=512),
                   dict(ctas=7, threads=1024)]


@pytest.mark.parametrize("params", ONEPASS_CONFIGS, ids=lambda p: "c{ctas}t{threads}".format(**p))
@pytest.mark.parametrize("E,K", [(128, 8), (896, 16), (5, 5), (1000, 3)])
def test_onepass_permute_any_grid_distinct_and_repeated_ids(params, E, K):
    """The one-pass permutation for every grid shape a tier may pick: top-k ids (distinct in a token) and ids
    that repeat an expert within a token (the counting fallback), tiles and expert-parallel ranges; one workspace
    through calls of falling and rising T, so the rows a longer call used beyond a shorter one go back to -1."""
    import dataclasses
    from kerngen.launch import current_stream
    from kerngen.plan import target_arch
    tbl = tiers.load()
    tbl = dataclasses.replace(tbl, rules=(tiers.Rule(op="permute", variant="onepass", ranges={}, params=params),)
                              + tbl.rules)
    dev = torch.cuda.current_device()
    g = torch.Generator(device="cuda").manual_seed(E + K)
    for tile, local in ((1, None), (8, (E // 3, E - E // 3)), (128, None)):
        ls, nl = local or (0, E)
        ws = pm.RoutingWorkspace(333, E, K, tile, local_experts=(ls, nl))
        for T in (333, 0, 1, 31, 32, 33, 200, 5):
            p = pm.kernel(pm.spec(E, K, max(T, 1), target_arch(dev), tbl), T, dev)
            for repeated in (False, True):
                if repeated:   # random ids in [-2, E + 2): repeats within a token, and ids outside the range
                    ids = torch.randint(-2, E + 2, (T, K), device="cuda", generator=g, dtype=torch.int32)
                else:
                    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:K] for _ in range(T)]).int() \
                        if T else torch.empty(0, K, dtype=torch.int32, device="cuda")
                p(current_stream(dev), ids.data_ptr(), ws, T, tile, ls, nl)
                r = ws.result(T, nl)
                check_permutation(r, ids, E, tile, local)
                rows = int(r.num_permuted_rows)
                assert (ws.p2t[rows:] == -1).all() and (ws.t2e[rows // tile:] == -1).all(), (T, tile, repeated)


@pytest.mark.parametrize("T", [3, 16, 700])
@pytest.mark.parametrize("local", [None, (32, 64)])
def test_permutation_feeds_finalize(T, local):
    """Tokens through an identity 'expert' that scales by (expert + 1): finalize gives sum_k w * (id + 1) * x."""
    m, kw = model_args("deepseek-v3")
    H, tile = 256, 64
    logits = make(T, 256, seed=T)
    r = kerngen.route(logits, bias=make_bias(256, m.routing), tile=tile, local_experts=local, **kw)
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    rows = r.permuted_to_token.numel()
    tok = r.permuted_to_token.long()
    expert = torch.full((rows,), -1, dtype=torch.long, device="cuda")
    tiles = torch.repeat_interleave(r.tile_to_expert.long(), tile)
    expert[:tiles.numel()] = tiles + (local[0] if local else 0)
    gemm2 = torch.where((tok >= 0)[:, None], x[tok.clamp(min=0)].float() * (expert + 1).float()[:, None],
                        torch.zeros(rows, H, device="cuda")).to(torch.bfloat16)
    out = kerngen.finalize(gemm2, r.expanded_to_permuted, r.topk_weights)
    assert torch.equal(out, finalize_reference(gemm2, r.expanded_to_permuted, r.topk_weights))
    ls, nl = local or (0, 256)
    ids = r.topk_ids.long()
    w = torch.where((ids >= ls) & (ids < ls + nl), r.topk_weights, torch.zeros_like(r.topk_weights))
    want = ((w * (ids + 1).float()).sum(-1, keepdim=True) * x.float())
    torch.testing.assert_close(out.float(), want, rtol=3e-2, atol=3e-2)


FUSED_CONFIGS = [   # beyond the shipped rules: 64-bit token masks, one CTA, odd cluster counts, one warp per token
    dict(warps=16, warps_per_token=2, ctas=8, clusters=3, max_tokens=64),
    dict(warps=16, warps_per_token=4, ctas=2, clusters=1, max_tokens=64),
    dict(warps=8, warps_per_token=1, ctas=1, clusters=5, max_tokens=33),
    dict(warps=16, warps_per_token=16, ctas=4, clusters=2, max_tokens=8),
]


@pytest.mark.parametrize("params", FUSED_CONFIGS,
                         ids=lambda p: "w{warps}x{warps_per_token}c{ctas}k{clusters}m{max_tokens}".format(**p))
@pytest.mark.parametrize("name", ["kimi-k3", "deepseek-v3", "kimi-k2"])
def test_fused_configurations_any_tier_may_pick(name, params):
    """Every fused parameter set a tier or `kerngen tune` may choose is exact, at every T it can serve."""
    from kerngen.launch import current_stream
    from kerngen.plan import spec_for, target_arch
    m, kw = model_args(name)
    E, K, dev = m.num_experts, m.top_k, torch.cuda.current_device()
    tag, consts = rt.tag_constants(E, K, m.routing, m.n_group, m.topk_group, m.renormalize, "float32",
                                   "float32" if "sigmoid_bias" in m.routing else "none", "float32")
    spec = spec_for(tiers.Rule(op="routing", variant="fused", ranges={}, params=params), tag, consts, target_arch(dev))
    for T in sorted({1, 7, params["max_tokens"] // 2 + 1, params["max_tokens"]}):
        r = rt.kernel(spec, T, dev)
        logits = make(T, E, seed=T)
        bias = make_bias(E, m.routing, T)
        ws = pm.RoutingWorkspace(T, E, K, 16)
        for _ in range(2):   # the second call also clears what the first left beyond its rows
            r.run(current_stream(dev), logits, bias, ws, T, 16, 0, E, float(m.routed_scaling_factor))
        ids, _ = rt.reference(logits, K, m.routing, bias, m.n_group, m.topk_group, m.routed_scaling_factor,
                              m.renormalize)
        assert torch.equal(ws.ids[:T], ids), (T, params)
        check_permutation(ws.result(T, E), ids, E, 16, None)


IDS_ONLY_RULES = {   # permute = false user rules (calls without a tile), each a shape the tuner may pick
    "topk 4x4": 'variant = "topk"\ntokens = [1, 64]\nparams = { warps = 4, warps_per_token = 4, early_trigger = true }',
    "topk 16x16": 'variant = "topk"\ntokens = [1, 64]\nparams = { warps = 16, warps_per_token = 16 }',
    "fused plain": 'variant = "fused"\ntokens = [1, 8]\n'
                   'params = { warps = 8, warps_per_token = 8, ctas = 1, clusters = 1, max_tokens = 8 }',
}


@pytest.mark.parametrize("rule", IDS_ONLY_RULES)
@pytest.mark.parametrize("name", ["kimi-k3", "deepseek-v3", "qwen3-30b-a3b"])
def test_rules_for_calls_without_a_tile(rule, name, tmp_path, monkeypatch):
    """A permute = false rule serves route() without a tile (ids and weights, against the reference, ties and -inf
    included) while calls with a tile keep the shipped rules (the permutation checked too)."""
    m, kw = model_args(name)
    text = (f'schema = 1\n\n[[tier]]\nop = "routing"\npermute = false\nnum_experts = [{m.num_experts}, '
            f'{m.num_experts}]\n{IDS_ONLY_RULES[rule]}\n')
    with user_tiers(tmp_path, monkeypatch, text):
        for T in (1, 3, 8):
            bias = make_bias(m.num_experts, m.routing, seed=T)
            for logits in (make(T, m.num_experts, seed=T), make(T, m.num_experts, seed=T, ties=True, ninf=0.2)):
                check(logits, kw, bias=bias)
                check(logits, kw, bias=bias, tile=16)
