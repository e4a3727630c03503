"""The tuner's output file: rules merged over token buckets, provenance, refusal to touch tiers.toml."""
import pytest
import torch

from kerngen import env, tiers, tune
from kerngen.errors import KerngenError
from tests.helpers import user_tiers


def test_merge_and_write_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "provenance", lambda: {"gpu": "NVIDIA H200", "sm_count": 132, "date": "2026-11-29"})
    model = tiers.load().model("kimi-k3")
    small = dict(block_x=16, loads_per_group=2, pdl=True, early_read=False)
    large = dict(vectors_per_thread=2, unroll=4, pdl=True, early_read=False)
    winners = [(1, 1.5, "small_batch", small), (8, 1.9, "small_batch", small), (64, 3.0, "large_batch", large),
               (4096, 120.0, "large_batch", large)]
    rules = tune._merge("finalize", model, winners)
    assert [(r.variant, r.ranges["tokens"]) for r in rules] == [("small_batch", (1, 36)), ("large_batch", (37, 8192))]
    out = tmp_path / "tuned.toml"
    tune.write(out, "kimi-k3", rules)
    t = tiers.load(out)
    r = t.rule("finalize", {"hidden": 3584, "top_k": 16, "tokens": 20})
    assert r.variant == "small_batch" and r.params == small and str(out) in r.source
    assert t.rule("finalize", {"hidden": 3584, "top_k": 16, "tokens": 37}).params == large
    assert "NVIDIA H200" in out.read_text()


def test_never_writes_the_shipped_table():
    with pytest.raises(KerngenError, match="refusing"):
        tune.write(env.shipped_tiers(), "kimi-k3", [])


def test_routing_rules_pin_the_expert_count_and_respect_max_tokens(tmp_path, monkeypatch):
    """A fused winner never serves more tokens than its max_tokens; routing rules key on E, not H."""
    monkeypatch.setattr(tune, "provenance", lambda: {"gpu": "NVIDIA H200", "date": "2026-11-29"})
    model = tiers.load().model("kimi-k3")
    fused = dict(warps=16, warps_per_token=8, ctas=8, clusters=4, max_tokens=16)
    topk = dict(warps=4, warps_per_token=4)
    winners = [(1, 6.9, "fused", fused), (16, 9.0, "fused", fused), (64, 20.0, "topk", topk)]
    rules = tune._merge("routing", model, winners)
    assert [(r.variant, r.ranges["tokens"]) for r in rules] == [("fused", (1, 16)), ("topk", (17, 8192))]
    assert all(r.ranges["num_experts"] == (896, 896) and "hidden" not in r.ranges for r in rules)
    out = tmp_path / "tuned.toml"
    tune.write(out, "kimi-k3", rules)
    t = tiers.load(out)
    assert t.rule("routing", {"num_experts": 896, "top_k": 16, "tokens": 16}).params == fused
    assert t.rule("routing", {"num_experts": 896, "top_k": 16, "tokens": 17}).params == topk
    assert t.rule("routing", {"num_experts": 384, "top_k": 8, "tokens": 16}).params != fused  # shipped rules


def test_every_op_has_candidates_that_the_tier_schema_accepts(tmp_path, monkeypatch):
    monkeypatch.setattr(tune, "provenance", lambda: {"gpu": "NVIDIA H200", "date": "2026-11-29"})
    model = tiers.load().model("kimi-k3")
    for op, (candidates, _) in tune.TUNERS.items():
        cands = list(candidates())
        assert len(cands) >= 4, op
        rules = tune._merge(op, model, [(1, 1.0, *cands[0]), (4096, 2.0, *cands[-1])])
        path = tmp_path / f"{op}.toml"
        tune.write(path, "kimi-k3", rules)   # write() re-parses what it wrote
        assert tiers.load(path).rules[0].op == op


def test_a_candidate_that_does_not_compile_for_the_shape_is_skipped_and_named(monkeypatch, capsys):
    """Candidates are generic; some do not fit a model (e.g. token groups beyond the shared memory of 2048
    experts). Those are skipped with the compiler's reason; a wrong result still stops the tuner."""
    from kerngen.errors import CompileError

    def timer(model, T, variant, params, ids_only=False):
        if params["warps"] == 16:
            raise CompileError("routing-topk-probe", 'probe.cu(358): error: static assertion failed with "shared '
                               'memory: fewer groups"', None)
        return 3.0 if params["warps"] == 4 else 2.0

    cands = lambda: iter([("topk", dict(warps=16, warps_per_token=1)), ("topk", dict(warps=4, warps_per_token=1)),
                          ("topk", dict(warps=8, warps_per_token=1))])
    monkeypatch.setitem(tune.TUNERS, "routing", (cands, timer))
    rules = tune.tune("kimi-k3", ["routing"], tokens=[1, 64], progress=False)
    assert [(r.params, r.permute) for r in rules] == [(dict(warps=8, warps_per_token=1), False),   # no tile
                                                      (dict(warps=8, warps_per_token=1), None)]
    out = capsys.readouterr().out
    assert "{'warps': 16, 'warps_per_token': 1} does not build for kimi-k3, skipped" in out
    assert "static assertion failed" in out


def test_no_candidate_compiling_is_an_error_naming_the_first_reason(monkeypatch):
    from kerngen.errors import CompileError

    def timer(model, T, variant, params, ids_only=False):
        raise CompileError("routing-topk-probe", "probe.cu(1): error: too big", None)

    monkeypatch.setitem(tune.TUNERS, "routing", (lambda: iter([("topk", dict(warps=16, warps_per_token=1))]), timer))
    with pytest.raises(KerngenError, match="no routing candidate compiles for kimi-k3(.|\n)*too big"):
        tune.tune("kimi-k3", ["routing"], tokens=[1], progress=False)


def test_routing_is_tuned_for_calls_without_a_tile_too(tmp_path, monkeypatch):
    """Route calls without a tile (ids and weights only) are timed on their own: their winners become permute =
    false rules ahead of the rules for every call, and the written file gives each kind of call its winner."""
    from kerngen.ops import routing as ro
    monkeypatch.setattr(tune, "provenance", lambda: {"gpu": "NVIDIA H200", "date": "2026-12-05"})

    def timer(model, T, variant, params, ids_only=False):
        fast = "topk" if ids_only else "fused"
        return 1.0 if variant == fast else 2.0

    cands = lambda: iter([("fused", dict(warps=16, warps_per_token=8, ctas=1, clusters=8, max_tokens=16)),  # noqa: E731
                          ("topk", dict(warps=8, warps_per_token=8))])
    monkeypatch.setitem(tune.TUNERS, "routing", (cands, timer))
    rules = tune.tune("kimi-k3", ["routing"], tokens=[1, 8], progress=False)
    assert [(r.variant, r.permute, r.ranges["tokens"]) for r in rules] == [("topk", False, (1, 8192)),
                                                                           ("fused", None, (1, 16))]
    out = tmp_path / "tuned.toml"
    tune.write(out, "kimi-k3", rules)
    monkeypatch.setenv("KERNGEN_ARCH", "sm_90a")

    def variant(permute, T):
        return ro.dispatch(-1, E=896, K=16, method="sigmoid_bias", n_group=1, topk_group=1, renormalize=True,
                           ldtype="float32", bdtype="float32", wdtype="float32", align=False,
                           permute=permute).spec(T).variant
    with user_tiers(tmp_path, monkeypatch, out.read_text()):
        assert [variant(False, T) for T in (1, 8)] == ["topk", "topk"]
        assert [variant(True, T) for T in (1, 8)] == ["fused", "fused"]


def test_experts_are_tuned_per_format_up_to_the_tokens_their_kernels_serve(tmp_path, monkeypatch):
    """deepseek-v3 ships fp8: its experts rules are tuned for bf16, fp8 and w8a8, each rule naming its format, the
    buckets past EXPERTS_MAX_TOKENS left out (torch._grouped_mm there), and the file loads with the table picking
    each format's winner; the fp8 candidates include the f16-activation shapes."""
    monkeypatch.setattr(tune, "provenance", lambda: {"gpu": "NVIDIA H200", "date": "2026-12-04"})
    timed = []

    def timer(model, T, variant, params, fmt="bf16"):
        timed.append((fmt, T))
        fast = {"bf16": dict(warps=8), "fp8": dict(f16x=True, prefetch_x=True), "w8a8": dict(prefetch_x=True)}[fmt]
        return 1.0 if all(params.get(k) == v for k, v in fast.items()) and params["tile"] == (8 if T <= 16 else 16) \
            else 2.0

    monkeypatch.setitem(tune.TUNERS, "experts", (tune.experts_candidates, timer))
    rules = tune.tune("deepseek-v3", ["experts"], tokens=[1, 16, 64, 256, 1024], progress=False)
    assert {fmt for fmt, _ in timed} == {"bf16", "fp8", "w8a8"} and max(T for _, T in timed) == 256
    assert all(r.op == "experts" and len(r.formats) == 1 for r in rules)
    assert max(r.ranges["tokens"][1] for r in rules) == 256
    out = tmp_path / "tuned.toml"
    tune.write(out, "deepseek-v3", rules)
    t = tiers.load(out)
    fp8 = t.rule("experts", {"hidden": 7168, "tokens": 8, "format": "fp8", "arch": "sm_90a"})
    assert fp8.params["f16x"] and fp8.params["tile"] == 8 and str(out) in fp8.source
    assert t.rule("experts", {"hidden": 7168, "tokens": 100, "format": "fp8", "arch": "sm_90a"}).params["tile"] == 16
    assert t.rule("experts", {"hidden": 7168, "tokens": 8, "format": "w8a8", "arch": "sm_90a"}).formats == ("w8a8",)
    assert t.rule("experts", {"hidden": 7168, "tokens": 8, "arch": "sm_90a"}).params["warps"] == 8   # bf16
    assert sum(1 for _, p in tune.experts_candidates("fp8") if p.get("mtiles") == 2) >= 2


def test_every_experts_candidate_is_a_valid_rule_for_its_format():
    from kerngen.ops import experts as ex
    for fmt in ("bf16", "fp8", "mxfp4", "w8a8"):
        for variant, params in tune.experts_candidates(fmt):
            tiers.check_params("experts", "experts", variant, params)
            ranges = {"tokens": (1, params["fused_x"])} if params.get("fused_x") else {}   # (fused_x: at most so many)
            ex.rule_spec(tiers.Rule("experts", variant, ranges, params), 7168, 2048, "silu", "sm_90a",
                         "fp8" if fmt == "w8a8" else fmt, "nk", fmt == "w8a8")


def test_latent_tail_is_tuned_for_latent_models_only_and_fused_rules_stop_at_their_max_tokens(monkeypatch, capsys):
    """kimi-k3 (model_hidden set): fused winners up to 8 tokens, norm_gemm beyond; a fused rule never serves more
    tokens than its max_tokens; a model without a latent width gets no latent_tail rules."""
    def timer(model, T, variant, params):
        if variant == "fused":
            return float("inf") if T > params["max_tokens"] else (1.0 if params == FUSED else 2.0)
        return 1.5 if T <= 8 else (1.0 if params == dict(cluster=1, pdl=True) else 1.2)

    FUSED = dict(max_tokens=8, warps=8, unroll=2, cluster=8, blocks_per_sm=2, pdl=True, split=True,
                 early_weights=True)
    monkeypatch.setitem(tune.TUNERS, "latent_tail", (tune.latent_tail_candidates, timer))
    rules = tune.tune("kimi-k3", ["latent_tail"], tokens=[1, 8, 16, 64, 512], progress=False)
    assert [(r.variant, r.ranges["tokens"]) for r in rules] == [("fused", (1, 8)), ("norm_gemm", (9, 8192))]
    assert rules[0].params == FUSED and rules[1].params == dict(cluster=1, pdl=True)
    assert rules[0].ranges["hidden"] == (3584, 3584) and rules[0].ranges["top_k"] == (16, 16)
    assert tune.tune("deepseek-v3", ["latent_tail"], tokens=[1], progress=False) == []
    assert "not a latent model" in capsys.readouterr().out


def test_every_latent_tail_candidate_is_a_valid_rule():
    from kerngen.ops import latent_tail as lt
    cands = list(tune.latent_tail_candidates())
    assert {v for v, _ in cands} == {"fused", "norm_gemm"}
    assert len(cands) == 64 + 8 + 8 + 8 + 4 + 4 + 2 + 2 + 3 + 4 + 6 + 2 + 32 + 8 + 6 + 6
    assert sum(p.get("addmm") is True for _, p in cands) == 6 and all(
        p.get("gemm_bf16") for _, p in cands if p.get("addmm"))
    assert sum(p.get("even_rows") is True for _, p in cands) == 8 + 4 + 2 + 1
    assert sum(p.get("n_global") is True for _, p in cands) == 8 + 4 + 4 + 2 + 2 + 3 + 4 + 6 + 2
    assert sum("l2_lines" in p for _, p in cands) == 7 + 3 + 4 + 6
    assert sum(p.get("next_early") is True for _, p in cands) == 3 + 4
    assert sum(p.get("late_launch") == 2 for _, p in cands) == 3 and sum("late_launch" in p for _, p in cands) == 4
    assert max(p.get("max_tokens", 0) for _, p in cands) == 32
    assert sum(p.get("norm_async") is True for _, p in cands) == 2 + 2 + 4 + 6
    assert sum(p.get("proj_registers") == 112 for _, p in cands) == 4
    for variant, params in cands:
        tiers.check_params("latent_tail", "latent_tail", variant, params)
        s = lt.rule_spec(tiers.Rule("latent_tail", variant, {}, params), 3584, 7168, 16, "float32", "sm_90a")
        assert lt.persistent(s)


def test_finalize_candidates_are_timed_in_both_settings(monkeypatch):
    """finalize's small_batch candidates come with and without programmatic dependent launch, and the tuner times
    each at the slower of back to back and behind an elementwise producer (PDL wins the first and costs in the
    second), where the other ops' candidates keep the back-to-back time."""
    cands = [p for v, p in tune.finalize_candidates() if v == "small_batch"]
    assert {p["pdl"] for p in cands} == {True, False}
    seen = []
    monkeypatch.setattr(tune, "graph_time_us", lambda fn, calls, replays: seen.append("chained") or 1.0)
    monkeypatch.setattr(tune, "both_settings_us", lambda fn, calls, replays: seen.append("both") or 2.0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    assert tune._checked_time(lambda: None, lambda: True, "x", 1, both=True) == 2.0
    assert tune._checked_time(lambda: None, lambda: True, "x", 1) == 1.0
    assert seen == ["both", "chained"]


def test_both_settings_is_the_slower_of_the_two(monkeypatch):
    from kerngen import timing
    monkeypatch.setattr(timing, "elementwise_producer", lambda: None)
    monkeypatch.setattr(timing, "after_producer_us", lambda step, producer, calls, replays: 1.5)
    for chained, want in ((1.0, 1.5), (2.0, 2.0)):
        monkeypatch.setattr(timing, "graph_time_us", lambda step, calls, replays: chained)
        assert timing.both_settings_us(lambda: None) == want


def test_tail_candidates_with_and_without_async_reduce():
    cands = list(tune.tail_candidates())
    assert len(cands) == 32 + 12 and sum(p.get("async_reduce") is True for _, p in cands) == 12
    assert all(p["cluster"] > 1 and p["branch_free"] for _, p in cands if p.get("async_reduce"))
    for variant, params in cands:
        tiers.check_params("tail", "tail", variant, params)


def test_a_fused_x_winner_serves_no_more_tokens_than_it_quantizes(monkeypatch):
    """gpt-oss-120b MXFP4: a fused_x build wins wherever one is timed (never past its fused_x: a build for at most so
    many tokens), so each fused_x rule ends at or below its fused_x and the next rule starts right after it."""
    monkeypatch.setattr(tune, "provenance", lambda: {"gpu": "NVIDIA H200", "date": "2026-12-04"})

    def timer(model, T, variant, params, fmt="bf16"):
        if params.get("fused_x"):
            return float("inf") if T > params["fused_x"] else 1.0
        return 2.0

    monkeypatch.setitem(tune.TUNERS, "experts", (tune.experts_candidates, timer))
    rules = sorted((r for r in tune.tune("gpt-oss-120b", ["experts"], tokens=[1, 2, 16, 64], progress=False)
                    if r.formats == ("mxfp4",)), key=lambda r: r.ranges["tokens"])
    fused = [r for r in rules if r.params.get("fused_x")]
    assert fused and rules[0].params.get("fused_x") and not rules[-1].params.get("fused_x")
    assert all(r.ranges["tokens"][1] <= r.params["fused_x"] for r in fused)
    assert [r.ranges["tokens"][0] for r in rules[1:]] == [r.ranges["tokens"][1] + 1 for r in rules[:-1]]


def test_the_registry_names_the_tunable_ops_and_the_cli_reads_it(tmp_path):
    """`kerngen tune --ops` takes the ops the registry marks tunable (those the tuner has candidates and a timer
    for): a name outside them is an InputError naming --ops, before any GPU or model is looked at."""
    import os
    import subprocess
    import sys
    from kerngen import ops
    assert set(ops.tunable()) == set(tune.TUNERS) and set(ops.tunable()) <= set(ops.OPS)
    env_ = {**os.environ, "KERNGEN_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "kerngen", "tune", "--model", "no-such-model", "--ops", "routing,permute"],
                       capture_output=True, text=True, env=env_, cwd=tmp_path)
    assert r.returncode == 2 and "'--ops'" in r.stderr and "got permute" in r.stderr and "Traceback" not in r.stderr
    h = subprocess.run([sys.executable, "-m", "kerngen", "tune", "--help"], capture_output=True, text=True, env=env_,
                       cwd=tmp_path)
    assert ",".join(ops.tunable()) in " ".join(h.stdout.split())
