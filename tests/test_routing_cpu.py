"""routing without a GPU: every tier compiles for sm_90a, inputs are validated, the references are consistent."""
import pytest
import torch

import kerngen
from kerngen import jit, tiers
from kerngen.cache import DiskCache
from kerngen.errors import InputError, TierError
from kerngen.ops import permute as pm
from kerngen.ops import routing as rt
from tests.helpers import assert_no_spills


def all_routing_specs():
    t = tiers.load()
    specs = []
    for m in t.models.values():
        specs += [s for s in rt.model_specs(m, t, "sm_90a") if s not in specs]
    generic = [  # beyond the shipped models: the limits and odd sizes
        dict(E=2048, K=32, method="grouped_sigmoid_bias", n_group=16, topk_group=4, bdtype="bfloat16"),
        dict(E=2048, K=32, method="softmax_topk", renormalize=False, wdtype="bfloat16"),
        dict(E=2048, K=1, method="top1_sigmoid", ldtype="bfloat16"),
        dict(E=1000, K=3, method="topk_softmax"),
        dict(E=33, K=5, method="sigmoid_bias"),
        dict(E=1, K=1, method="softmax_topk"),
    ]
    for g in generic:
        E, K, method = g.pop("E"), g.pop("K"), g.pop("method")
        for T in (1, 16, 17, 8192):
            s = rt.spec(E, K, method, T, "sm_90a", tbl=t, **g)
            if s not in specs:
                specs.append(s)
    for E, K in ((2048, 32), (1, 1), (1000, 3)):
        s = pm.spec(E, K, 100, "sm_90a", t)
        if s not in specs:
            specs.append(s)
    return specs


ENTRY = {"fused": [b"routing_fused"], "topk": [b"routing_topk"], "onepass": [b"permute_onepass"],
         "histogram": [b"permute_block_rank", b"permute_offsets", b"permute_place"]}


@pytest.mark.parametrize("spec", all_routing_specs(), ids=lambda s: f"{s.op}-{s.variant}-{s.tag}")
def test_every_routing_tier_compiles_to_sm90a_cubin(spec, tmp_path):
    built = jit.build(spec, store=DiskCache(tmp_path))
    cubin = built.files["kernel.cubin"]
    assert built.status == "compiled" and cubin[:4] == b"\x7fELF"
    for name in ENTRY[spec.variant]:
        assert name in cubin
    assert_no_spills(built.files)


def test_every_shipped_model_has_routing_and_permute_tiers():
    t = tiers.load()
    for m in t.models.values():
        ops = {(s.op, s.variant) for s in rt.model_specs(m, t, "sm_90a")}
        assert ("routing", "fused") in ops and ("permute", "histogram") in ops, m.name


def test_fused_rules_cover_their_token_range_with_max_tokens():
    """The fused kernel sizes its shared memory for max_tokens; routing.Route refuses more tokens at run time."""
    rules = [r for r in tiers.load().rules if r.op == "routing" and r.variant == "fused"]
    assert rules
    for r in rules:
        assert r.ranges["tokens"][1] <= r.params["max_tokens"] <= 64, r


def test_onepass_permute_rules_fit_in_shared_memory():
    """Each onepass rule's largest shape (most experts, top_k and tokens its ranges allow) fits in a CTA."""
    rules = [r for r in tiers.load().rules if r.op == "permute" and r.variant == "onepass"]
    assert rules
    for r in rules:
        E = r.ranges.get("num_experts", (1, tiers.MAX_EXPERTS))[1]
        K = min(r.ranges.get("top_k", (1, tiers.MAX_TOPK))[1], E)
        T = r.ranges["tokens"][1]
        assert pm.onepass_smem_bytes(E, K, T) <= pm.MAX_DYNAMIC_SMEM, r


def test_a_onepass_rule_too_large_for_shared_memory_is_a_tier_error():
    import dataclasses
    t = tiers.load()
    big = tiers.Rule(op="permute", variant="onepass", ranges={}, params={"ctas": 8, "threads": 256})
    t = dataclasses.replace(t, rules=(big,) + t.rules)
    with pytest.raises(TierError, match="shared memory"):
        pm.kernel(pm.spec(896, 16, 4096, "sm_90a", t), 4096, 0)


def test_a_onepass_grid_is_bounded_by_the_sm_count_of_tiers(monkeypatch):
    """permute's launcher bounds its CTAs by tiers.SMS, as routing's does, not by a number of its own."""
    import dataclasses
    s = pm.spec(896, 16, 1, "sm_90a")
    assert s.variant == "onepass" and pm.SMS is tiers.SMS
    monkeypatch.setattr(pm, "SMS", 4)
    over = dataclasses.replace(s, params=tuple({**dict(s.params), "ctas": 5}.items()))
    with pytest.raises(InputError, match=r"ctas in \[1, 4\]"):
        pm.Permute(over, 1, 0)


def test_explain_routing_names_the_fused_tier(capsys):
    from kerngen import cli
    assert cli.main(["explain", "--op", "routing", "--model", "kimi-k3", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "variant   fused" in out and "routing-fused-E896-K16-sgb" in out


# ------------------------------------------------------------------------------------------ validation
def logits_cpu(T=4, E=256, dtype=torch.float32):
    return torch.zeros(T, E, dtype=dtype)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(logits=torch.zeros(4, 3000), top_k=8, method="softmax_topk"), "logits"),
    (dict(logits=torch.zeros(4, 256, dtype=torch.float16), top_k=8, method="softmax_topk"), "logits"),
    (dict(logits=torch.zeros(256), top_k=8, method="softmax_topk"), "logits"),
    (dict(logits=logits_cpu(), top_k=0, method="softmax_topk"), "top_k"),
    (dict(logits=logits_cpu(), top_k=33, method="softmax_topk"), "top_k"),
    (dict(logits=logits_cpu(E=4), top_k=5, method="softmax_topk"), "top_k"),
    (dict(logits=logits_cpu(), top_k=2, method="top1_sigmoid"), "top_k"),
    (dict(logits=logits_cpu(), top_k=8, method="sparsemax"), "method"),
    (dict(logits=logits_cpu(), top_k=8, method="grouped_sigmoid_bias", n_group=3), "n_group"),
    (dict(logits=logits_cpu(), top_k=8, method="grouped_sigmoid_bias", n_group=8, topk_group=9), "topk_group"),
    (dict(logits=logits_cpu(), top_k=70, method="grouped_sigmoid_bias", n_group=8, topk_group=2), "top_k"),
    (dict(logits=logits_cpu(), top_k=8, method="sigmoid_bias", n_group=8, topk_group=4), "n_group"),
    (dict(logits=logits_cpu(), top_k=8, method="sigmoid_bias", bias=torch.zeros(255)), "bias"),
    (dict(logits=logits_cpu(), top_k=8, method="sigmoid_bias", bias=torch.zeros(256, dtype=torch.float16)), "bias"),
    (dict(logits=logits_cpu(), top_k=8, method="softmax_topk", bias=torch.zeros(256)), "bias"),
    (dict(logits=logits_cpu(), top_k=8, method="softmax_topk", tile=0), "tile"),
    (dict(logits=logits_cpu(), top_k=8, method="softmax_topk", tile=1025), "tile"),
    (dict(logits=logits_cpu(), top_k=8, method="softmax_topk", tile=128, local_experts=(250, 10)), "local_experts"),
    (dict(logits=logits_cpu(), top_k=8, method="softmax_topk", local_experts=(0, 0)), "local_experts"),
    (dict(logits=logits_cpu(), top_k=8, method="softmax_topk", routed_scaling_factor=-1.0), "routed_scaling_factor"),
    (dict(logits=logits_cpu(), top_k=8, method="softmax_topk"), "logits"),  # on the CPU
    (dict(logits=logits_cpu(E=896), model="kimi-k3", top_k=8), "top_k"),
    (dict(logits=logits_cpu(E=896), model="kimi-k3", method="softmax_topk"), "method"),
    (dict(logits=logits_cpu(E=896), model="kimi-k3", routed_scaling_factor=2.0), "routed_scaling_factor"),
])
def test_route_rejects_bad_input_naming_the_argument(kwargs, arg):
    logits = kwargs.pop("logits")
    with pytest.raises(InputError) as e:
        kerngen.route(logits, **kwargs)
    assert e.value.arg == arg and f"'{arg}'" in str(e.value)


def test_route_unknown_model_is_a_tier_error():
    with pytest.raises(TierError, match="unknown model"):
        kerngen.route(logits_cpu(), model="no-such-model")


@pytest.mark.parametrize("kwargs, arg", [
    (dict(topk_ids=torch.zeros(4, 8, dtype=torch.int64), num_experts=256, tile=128), "topk_ids"),
    (dict(topk_ids=torch.zeros(4, 8, dtype=torch.int32), num_experts=4000, tile=128), "num_experts"),
    (dict(topk_ids=torch.zeros(4, 8, dtype=torch.int32), num_experts=4, tile=128), "topk_ids.shape[1]"),
    (dict(topk_ids=torch.zeros(4, 8, dtype=torch.int32), num_experts=256, tile=2048), "tile"),
    (dict(topk_ids=torch.zeros(4, 8, dtype=torch.int32), num_experts=256, tile=8, local_experts=(-1, 4)),
     "local_experts"),
    (dict(topk_ids=torch.zeros(4, 8, dtype=torch.int32), num_experts=256, tile=8), "topk_ids"),  # CPU
])
def test_permute_rejects_bad_input_naming_the_argument(kwargs, arg):
    ids = kwargs.pop("topk_ids")
    with pytest.raises(InputError) as e:
        kerngen.permute(ids, **kwargs)
    assert e.value.arg == arg


def test_workspace_views_are_sized_for_the_worst_case():
    ws = kerngen.RoutingWorkspace(64, 256, 8, 16, local_experts=(32, 64), device="cpu")
    r = ws.result(10, 64)
    assert r.topk_ids.shape == (10, 8) and r.topk_weights.dtype == torch.float32
    assert r.expert_counts.shape == (64,) and r.expert_offsets.shape == (65,)
    assert r.permuted_to_token.shape == (10 * 8 + 64 * 15,)
    assert r.tile_to_expert.shape == ((10 * 8 + 64 * 15) // 16,)
    assert r.num_permuted_rows.dim() == 0 and int(r.num_permuted_rows) == -1   # "no previous call"
    assert bool((ws.p2t == -1).all()) and bool((ws.t2e == -1).all())
    with pytest.raises(InputError, match="tile"):
        kerngen.RoutingWorkspace(64, 256, 8, 0, device="cpu")


@pytest.mark.parametrize("separate", [False, True])
def test_a_new_workspace_starts_in_the_kernels_initial_state(separate):
    """Every permutation view -1 (num_rows: "no previous call") but the ticket, 0; separate=True (the custom ops'
    workspaces, whose outputs may not alias each other) puts each view in an allocation of its own."""
    ws = kerngen.RoutingWorkspace(600, 896, 16, 128, device="cpu", separate=separate)
    views = {n: getattr(ws, n) for n in ("counts", "offsets", "e2p", "p2t", "t2e", "num_rows", "hist", "ticket")}
    for name, v in views.items():
        assert bool((v == (0 if name == "ticket" else -1)).all()), name
    ptrs = [v.untyped_storage().data_ptr() for v in [ws.ids, ws.weights, *views.values()]]
    assert (len(set(ptrs)) == len(ptrs)) == separate


# ------------------------------------------------------------------------------------------ references
METHOD_CASES = [("softmax_topk", {}), ("softmax_topk", {"renormalize": False}), ("topk_softmax", {}),
                ("sigmoid_bias", {"routed_scaling_factor": 2.5}),
                ("grouped_sigmoid_bias", {"n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5}),
                ("top1_sigmoid", {})]


def mission_reference(s, K, method, bias=None, n_group=1, topk_group=1, rsf=1.0, renorm=True):
    """The routing semantics as plain pseudo-code, literally (valid for rows without ties, NaN or -inf)."""
    def topk(key, k):
        return torch.sort(key, dim=-1, descending=True, stable=True).indices[:, :k]
    T, E = s.shape
    if method == "softmax_topk":
        p = s.softmax(-1); i = topk(p, K); w = p.gather(-1, i)
        return i, (w / w.sum(-1, True) if renorm else w)
    if method == "topk_softmax":
        i = topk(s, K)
        return i, s.gather(-1, i).softmax(-1)
    if method == "top1_sigmoid":
        i = topk(s, 1)
        return i, torch.sigmoid(s.gather(-1, i))
    g = torch.sigmoid(s)
    b = g + bias
    if method == "grouped_sigmoid_bias":
        G = b.view(T, n_group, E // n_group).topk(2, -1).values.sum(-1)
        gi = topk(G, topk_group)
        keep = torch.zeros(T, n_group, dtype=torch.bool).scatter_(1, gi, True).repeat_interleave(E // n_group, 1)
        b = b.masked_fill(~keep, float("-inf"))
    i = topk(b, K)
    w = g.gather(-1, i)
    return i, w * rsf / (w.sum(-1, True) + 1e-20)


@pytest.mark.parametrize("method, kw", METHOD_CASES)
def test_reference_matches_the_mission_pseudo_code_on_plain_rows(method, kw):
    g = torch.Generator().manual_seed(1)
    s = torch.randn(64, 256, generator=g)
    K = 1 if method == "top1_sigmoid" else 8
    bias = torch.randn(256, generator=g) * 0.1 if "sigmoid_bias" in method else None
    ids, w = rt.reference(s, K, method, bias, **kw)
    mi, mw = mission_reference(s, K, method, bias, kw.get("n_group", 1), kw.get("topk_group", 1),
                               kw.get("routed_scaling_factor", 1.0), kw.get("renormalize", True))
    assert torch.equal(ids.long(), mi)
    torch.testing.assert_close(w, mw.float(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("method, kw", METHOD_CASES)
def test_reference_ties_lower_index_wins_and_nonfinite_last(method, kw):
    E = 256
    K = 1 if method == "top1_sigmoid" else 8
    s = torch.zeros(3, E)
    s[1, :] = float("-inf")
    s[1, [200, 7, 100]] = torch.tensor([1.0, 1.0, 0.5])      # 3 finite: 7, 200 (tie), then 100
    s[1, 50] = float("nan")
    s[2, :] = float("nan")
    ids, w = rt.reference(s, K, method, torch.zeros(E) if "sigmoid_bias" in method else None, **kw)
    if method != "grouped_sigmoid_bias":
        assert ids[0].tolist() == list(range(K))             # all equal: lowest indices
        want = [7, 200, 100, 0, 1, 2, 3, 4][:K]               # then the lowest-index -inf / NaN experts
        assert ids[1].tolist() == want
    assert ids[2].tolist() == list(range(K))
    assert torch.isfinite(w).all()
    if K > 1 and method != "grouped_sigmoid_bias":
        assert (w[1, 3:] == 0).all() and (w[2] == 0).all()


def test_reference_grouped_picks_only_from_the_best_groups():
    g = torch.Generator().manual_seed(3)
    s = torch.randn(128, 256, generator=g)
    bias = torch.randn(256, generator=g) * 0.1
    ids, _ = rt.reference(s, 8, "grouped_sigmoid_bias", bias, n_group=8, topk_group=4)
    assert all(len(set((ids[t] // 32).tolist())) <= 4 for t in range(128))


@pytest.mark.parametrize("tile", [1, 8, 16, 64, 128])
@pytest.mark.parametrize("local", [None, (0, 256), (64, 64), (250, 6)])
def test_permutation_reference_invariants(tile, local):
    g = torch.Generator().manual_seed(tile)
    T, K, E = 37, 8, 256
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int()
    ids[:5] = ids[:5] % 8                                     # crowd a few experts
    ids[:5] = torch.stack([torch.randperm(8, generator=g)[:K] for _ in range(5)]).int()
    p = pm.permute_reference(ids, E, tile, local)
    ls, nl = local or (0, E)
    x = ids.flatten().long() - ls
    is_local = (x >= 0) & (x < nl)
    cnt, off = p["expert_counts"].long(), p["expert_offsets"].long()
    rows = int(p["num_permuted_rows"])
    assert int(cnt.sum()) == int(is_local.sum()) and off[-1] == rows and rows % tile == 0
    assert torch.equal(off[1:] - off[:-1], (cnt + tile - 1) // tile * tile)
    e2p = p["expanded_to_permuted"].flatten().long()
    assert (e2p[~is_local] == -1).all()
    got = e2p[is_local]
    assert got.unique().numel() == got.numel()
    for e in torch.nonzero(is_local).flatten().tolist():
        xe = int(x[e])
        assert off[xe] <= e2p[e] < off[xe] + cnt[xe]
    for xe in range(nl):                                      # ascending expanded index within an expert
        rows_x = e2p[(x == xe) & is_local]
        assert torch.equal(rows_x, torch.arange(int(off[xe]), int(off[xe] + cnt[xe])))
    p2t = p["permuted_to_token"].long()
    assert p2t.numel() == T * K + nl * (tile - 1)
    assert torch.equal(p2t[e2p[is_local]], torch.nonzero(is_local).flatten() // K)
    assert int((p2t >= 0).sum()) == int(is_local.sum())
    t2e = p["tile_to_expert"].long()
    assert t2e.numel() == p2t.numel() // tile and (t2e[rows // tile:] == -1).all()
    for j in range(rows // tile):
        assert off[t2e[j]] <= j * tile < off[t2e[j] + 1]


@pytest.mark.parametrize("T,E,K,tile,local", [(1, 896, 16, 128, None), (3, 7, 3, 8, (2, 3)), (5, 256, 8, 1, (0, 5))])
def test_workspace_views_are_16_byte_aligned(T, E, K, tile, local):
    """finalize and moe_tail load expanded_to_permuted with 128-bit loads: every view must start aligned."""
    ws = pm.RoutingWorkspace(T, E, K, tile, local_experts=local, device="cpu")
    for name in ("ids", "weights", "counts", "offsets", "e2p", "p2t", "t2e", "num_rows", "hist", "ticket"):
        assert getattr(ws, name).data_ptr() % 16 == 0, name
    assert (ws.p2t == -1).all() and (ws.num_rows == -1).all() and (ws.ticket == 0).all()


@pytest.mark.parametrize("bad, message", [
    (dict(ctas=9), "ctas: 1 to 8"),
    (dict(max_tokens=65), "max_tokens: at most 64"),
    (dict(warps_per_token=3), "warps must be a multiple of warps_per_token"),
])
def test_fused_parameters_out_of_range_fail_to_compile_with_the_reason(bad, message, tmp_path):
    params = {**dict(warps=16, warps_per_token=8, ctas=8, clusters=4, max_tokens=16), **bad}
    tag, consts = rt.tag_constants(896, 16, "sigmoid_bias", 1, 1, True, "float32", "float32", "float32")
    s = kerngen.plan.spec_for(tiers.Rule(op="routing", variant="fused", ranges={}, params=params), tag, consts,
                              "sm_90a")
    with pytest.raises(kerngen.CompileError, match=message) as e:
        jit.build(s, store=DiskCache(tmp_path))
    assert e.value.source_path and open(e.value.source_path).read().count("routing_fused") == 1


@pytest.mark.parametrize("name,T", [("kimi-k3", 1), ("kimi-k3", 8), ("deepseek-v3", 8), ("qwen3-next-80b", 16)])
def test_phase_probe_instruments_the_fused_kernel(name, T):
    """tools/diagnose/routing_phases.py finds every phase boundary in the fused kernel of the shipped tiers and the
    instrumented source compiles for sm_90a (its anchors are template text: this fails when they drift)."""
    from kerngen.compile import nvrtc_compile
    from kerngen.render import render
    from tools.diagnose import routing_phases as probe
    m = tiers.load().model(name)
    s = rt.spec(m.num_experts, m.top_k, m.routing, T, "sm_90a", n_group=m.n_group, topk_group=m.topk_group,
                     renormalize=m.renormalize, bdtype="float32" if "bias" in m.routing else "none")
    assert s.variant == "fused"
    src = probe.instrument(render(s))
    assert src.count("KG_STAMP(") == probe.SLOTS + 1   # the macro's definition + one per slot
    cubin, _ = nvrtc_compile(src, "routing_phases", "sm_90a", "routing_phases", None)
    assert cubin[:4] == b"\x7fELF"


def test_reference_grouped_keeps_a_group_whose_second_key_is_minus_inf():
    # E=8, four groups of two: group 0 holds one finite key (3), group 2 holds one (1), the rest none.
    s = torch.tensor([[3.0, float("-inf"), float("-inf"), float("-inf"), 1.0, float("-inf"), float("-inf"),
                       float("-inf")]])
    ids, w = rt.reference(s, 2, "grouped_sigmoid_bias", torch.zeros(8), n_group=4, topk_group=2,
                          routed_scaling_factor=2.5)
    assert ids[0].tolist() == [0, 4]
    g = torch.sigmoid(torch.tensor([3.0, 1.0]))
    torch.testing.assert_close(w[0], g * 2.5 / (g.sum() + 1e-20), rtol=1e-6, atol=0)


@pytest.mark.parametrize("seed", range(20))
def test_reference_grouped_never_picks_minus_inf_while_kept_groups_hold_finite_keys(seed):
    gen = torch.Generator().manual_seed(seed)
    T, E, G, TG, K = 64, 64, 8, 4, 6
    s = torch.randn(T, E, generator=gen)
    s[torch.rand(T, E, generator=gen) < 0.8] = float("-inf")     # most groups keep one finite key or none
    ids, w = rt.reference(s, K, "grouped_sigmoid_bias", torch.randn(E, generator=gen) * 0.1, n_group=G,
                          topk_group=TG)
    finite = torch.isfinite(s).view(T, G, E // G)
    groups_with_finite = finite.any(-1).sum(-1)
    for t in range(T):
        picked = s[t, ids[t].long()]
        # every group with a finite key is kept while at most topk_group groups have one
        if groups_with_finite[t] <= TG:
            assert torch.isfinite(picked).sum() == min(K, int(finite[t].sum()))
        assert (w[t][~torch.isfinite(picked)] == 0).all()


@pytest.mark.parametrize("device", ["x", "meta", 3.5])
def test_workspace_device_must_be_cuda_or_cpu(device):
    with pytest.raises(InputError, match="device"):
        kerngen.RoutingWorkspace(4, 64, 2, device=device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
def test_gpu_calls_without_a_gpu_are_kerngen_errors():
    with pytest.raises(kerngen.DeviceError, match="needs a CUDA GPU"):
        kerngen.RoutingWorkspace(4, 64, 2)
    with pytest.raises(kerngen.DeviceError, match="needs a CUDA GPU"):
        kerngen.preload("kimi-k3")
    kerngen.strict(True)
    try:
        with pytest.raises(kerngen.DeviceError, match="needs a CUDA GPU"):
            kerngen.preload("kimi-k3")
    finally:
        kerngen.strict(None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
def test_kerngen_tune_without_a_gpu_is_a_clean_error(tmp_path):
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "kerngen", "tune", "--model", "mixtral-8x7b"], capture_output=True,
                       text=True, env={**os.environ, "KERNGEN_CACHE_DIR": str(tmp_path)}, cwd=tmp_path)
    assert r.returncode == 2 and "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr


def test_racecheck_builds_are_their_own_kernels_whose_idle_groups_meet_their_barriers(monkeypatch, tmp_path):
    """KERNGEN_RACECHECK: the fused routing kernel's idle token groups call idle_group_syncs (a key of their own, no
    spills, more barrier instructions); unset, the shipped source has no trace of it."""
    from kerngen import render, resources
    shipped = rt.spec(896, 16, "sigmoid_bias", 1, "sm_90a", bdtype="float32")
    monkeypatch.setenv("KERNGEN_RACECHECK", "1")
    checked = rt.spec(896, 16, "sigmoid_bias", 1, "sm_90a", bdtype="float32")
    assert checked.tag != shipped.tag and dict(checked.constants)["IDLE_SYNCS"] is True
    src, base = render.render(checked), render.render(shipped)
    assert "else idle_group_syncs();" in src and "idle_group_syncs" not in base and "ROUTE_SYNCS" not in base
    bars = []
    for s in (shipped, checked):
        built = jit.build(s, store=DiskCache(tmp_path))
        assert_no_spills(built.files)
        bars.append(resources.sass(built.files).count("BAR.SYNC"))
    assert bars[1] > bars[0]
    monkeypatch.setenv("KERNGEN_RACECHECK", "perhaps")
    with pytest.raises(kerngen.EnvError, match="KERNGEN_RACECHECK"):
        rt.spec(896, 16, "sigmoid_bias", 1, "sm_90a", bdtype="float32")


def _racecheck_specs():
    import os
    before = os.environ.get("KERNGEN_RACECHECK")
    os.environ["KERNGEN_RACECHECK"] = "1"
    try:   # the fused ones of every routing kernel the tiers compile test builds, as racecheck builds
        return [s for s in all_routing_specs() if s.variant == "fused"]
    finally:
        if before is None:
            del os.environ["KERNGEN_RACECHECK"]
        else:
            os.environ["KERNGEN_RACECHECK"] = before


@pytest.mark.parametrize("spec", _racecheck_specs(), ids=lambda s: f"{s.variant}-{s.tag}-{dict(s.params)}")
def test_every_racecheck_build_of_the_shipped_models_compiles(spec, tmp_path):
    """The KERNGEN_RACECHECK builds of every fused routing kernel the shipped models take and of the generic shapes
    (the full softmax and grouped methods among them): their idle groups call idle_group_syncs, routing groups meet
    the exact threshold's barriers anyway."""
    from kerngen import render
    assert dict(spec.constants)["IDLE_SYNCS"] is True
    src = render.render(spec)
    assert "else idle_group_syncs();" in src and "the exact threshold's barriers met anyway" in src
    built = jit.build(spec, store=DiskCache(tmp_path))
    assert built.files["kernel.cubin"][:4] == b"\x7fELF"
    assert_no_spills(built.files)


@pytest.mark.parametrize("variant,params", [
    ("topk", dict(warps=4, warps_per_token=4)),
    ("fused", dict(warps=16, warps_per_token=8, ctas=1, clusters=8, max_tokens=8)),
])
def test_a_routing_rule_may_launch_without_pdl(monkeypatch, variant, params):
    """`pdl = false` on a routing rule: its first launch (the top-k, or the fused top-k and permutation, and the
    ids-only launch) goes without the programmatic-dependent-launch attribute (a producer that never triggers, as a
    router GEMM, is only delayed by it); left out, with it, as before. The kernel's source is the same either way."""
    from kerngen import plan as plan_mod
    from kerngen import render
    from kerngen.ops import routing as rt
    seen = []

    class Stub:
        def __init__(self, module, name, device, grid, block, params, smem=0, pdl=False):
            seen.append((name, pdl))

    monkeypatch.setattr(rt, "Launcher", Stub)
    monkeypatch.setattr(rt, "resolve", lambda spec: None)
    tag, consts = rt.tag_constants(896, 16, "sigmoid_bias", 1, 1, True, "float32", "float32", "float32", False)
    specs = {}
    for pdl in (None, False, True):
        p = dict(params, **({} if pdl is None else {"pdl": pdl}))
        specs[pdl] = s = plan_mod.spec_for(tiers.Rule("routing", variant, {"tokens": (1, 8)}, p), tag, consts,
                                           "sm_90a")
        seen.clear()
        rt.Route(s, 1, 0, permute=False)
        assert seen and all(on == (pdl is not False) for _, on in seen), (pdl, seen)
    assert render.render(specs[False]) == render.render(specs[None]) == render.render(specs[True])
