"""tools/bench/generate.py on the CPU: tiny models of the three families (Qwen3-MoE, DeepSeek-V3, gpt-oss), one
decoder layer each, 4 greedy new tokens at batch 1 and 8, transformers' "grouped_mm" against kerngen (its torch
references on the CPU). The table is printed, both impls produce ids and kerngen's blocks were patched in.

Greedy ids: in float32 they are equal everywhere. In bf16 the Qwen3-MoE and gpt-oss routers score experts with
bf16 logits, and two experts now and then score exactly the same (8 significant bits): kerngen then takes the
lower expert index (its documented tie policy), torch.topk whichever it happens to, and the sequence may go
another way from there (seed 0, batch 8: one Qwen3-MoE sequence, at its 4th new token). So in bf16 a sequence may
differ only where its router scores hold such a tie, which the test checks."""
import pytest
import torch

pytest.importorskip("transformers")
from tests.helpers import one_thread  # noqa: E402
from tools.bench import generate as bench  # noqa: E402

ARGS = ["--device", "cpu", "--tiny", "--layers", "1", "--new-tokens", "4", "--batch", "1,8"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def bench_rows(monkeypatch, capsys, args):
    rows = []
    real = bench.run
    monkeypatch.setattr(bench, "run", lambda a: rows.extend(real(a)) or rows)
    assert bench.main(args) == 0
    out = capsys.readouterr().out
    assert "| model | layers (MoE) | batch | impl | tokens/s |" in out
    want = {(m, b, i) for m in bench.CONFIGS for b in (1, 8) for i in bench.IMPLS}
    assert {(r["model"], r["batch"], r["impl"]) for r in rows} == want
    for r in rows:
        assert r["note"] == "" and r["tok_s"] > 0 and r["moe_layers"] == 1, r
        assert r["ids"].shape == (r["batch"], 4) and r["ids"].dtype == torch.long
        assert (r["patched"] > 0) == (r["impl"] == "kerngen"), r
        assert f"| {r['model']} | 1 (1) | {r['batch']} | {r['impl']} |" in out
    return rows


def test_generate_float32_ids_equal(capsys, monkeypatch):
    for r in bench_rows(monkeypatch, capsys, ARGS + ["--dtype", "float32"]):
        assert r["equal"] == r["batch"] and r["first_diff"] is None, (r["model"], r["batch"], r["impl"])


def router_tie(name: str, ids: torch.Tensor) -> bool:
    """Whether transformers' router of the tiny bf16 model `name` scores the K-th and (K+1)-th experts of some
    token of `ids` equally."""
    model = bench.build_model(name, 1, 512, "cpu", tiny=True, init_std=0.1)
    bench.use(model, "grouped_mm")
    router = model.model.layers[0].mlp.gate
    seen = []
    hook = router.register_forward_hook(lambda m, args, out: seen.append(out[0]))
    with torch.no_grad():
        model(ids)
    hook.remove()
    K = model.config.num_experts_per_tok
    top = seen[0].float().topk(K + 1, dim=-1).values
    return bool((top[:, K - 1] == top[:, K]).any())


def test_generate_bf16_ids_equal_but_for_router_ties(capsys, monkeypatch):
    rows = bench_rows(monkeypatch, capsys, ARGS)
    ref = {(r["model"], r["batch"]): r for r in rows if r["impl"] == "grouped_mm"}
    for r in rows:
        if r["equal"] == r["batch"]:
            continue
        assert r["model"] != "deepseek-v3", "fp32 router logits: no ties expected"
        prompt = bench.prompt_ids(r["batch"], 16, 512)
        differs = (r["ids"] != ref[r["model"], r["batch"]]["ids"]).any(dim=1)
        seqs = torch.cat([prompt, ref[r["model"], r["batch"]]["ids"][:, :r["first_diff"]]], dim=1)[differs]
        assert router_tie(r["model"], seqs), (r["model"], r["batch"], "ids differ with no tie in the router")


def test_deepseek_layers_keep_moe():
    assert bench.make_config("deepseek-v3", 1, 512, tiny=True).first_k_dense_replace == 0
    cfg = bench.make_config("deepseek-v3", 3, 32000)
    assert cfg.first_k_dense_replace == 1 and cfg.n_routed_experts == 256 and cfg.hidden_size == 7168
    gpt = bench.make_config("gpt-oss-120b", 4, 32000)
    assert gpt.layer_types == ["sliding_attention", "full_attention"] * 2 and gpt.num_local_experts == 128


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        bench.parse(["--models", "no-such-model"])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            bench.parse(["--device", "cuda"])
    with pytest.raises(SystemExit):
        bench.parse(["--device", "cpu", "--compile"])
    with pytest.raises(SystemExit):
        bench.parse(["--device", "cpu", "--tiny", "--fresh-cache"])


def test_rounds_alternate_and_hooks_time_the_blocks(capsys, monkeypatch):
    """--rounds 3 --host-hooks: each impl timed three times, every other round in the opposite order; a row's
    tokens/s is the median of its rounds, its ratio the median of the rounds' ratios, the hooks' medians in the
    note, and no hook left on the model."""
    order, models = [], []
    real_time, real_build = bench.time_impl, bench.build_model
    monkeypatch.setattr(bench, "time_impl",
                        lambda model, impl, *a, **k: order.append(impl) or real_time(model, impl, *a, **k))
    monkeypatch.setattr(bench, "build_model", lambda *a, **k: models.append(real_build(*a, **k)) or models[-1])
    args = ["--device", "cpu", "--tiny", "--layers", "1", "--new-tokens", "2", "--batch", "1", "--models",
            "qwen3-30b-a3b", "--rounds", "3", "--host-hooks", "--dtype", "float32"]
    rows = []
    real_run = bench.run
    monkeypatch.setattr(bench, "run", lambda a: rows.extend(real_run(a)) or rows)
    assert bench.main(args) == 0
    assert order == ["grouped_mm", "kerngen", "kerngen", "grouped_mm", "grouped_mm", "kerngen"]
    assert [r["impl"] for r in rows] == ["grouped_mm", "kerngen"]
    ref, ker = rows
    assert ref["ratio"] == 1.0 and ref["note"].startswith("rounds 1.00 / 1.00 / 1.00")
    assert ker["block_us"] > 0 and ker["attn_us"] > 0 and "MoE block" in ker["note"]
    assert ker["equal"] == 1 and ker["first_diff"] is None
    out = capsys.readouterr().out
    assert "median of 3 rounds" in out and "| qwen3-30b-a3b | 1 (1) | 1 | kerngen |" in out
    for m in models[0].modules():
        assert not m._forward_hooks and not m._forward_pre_hooks


def test_merge_rounds_takes_medians_and_a_failed_round_fails_the_row():
    ids = torch.zeros(1, 2, dtype=torch.long)
    ok = lambda t: dict(tok_s=t, seconds=1 / t, ids=ids, patched=0, note="")  # noqa: E731
    rows = bench.merge_rounds(dict(model="m", batch=1), {"a": [ok(10), ok(12), ok(11)], "b": [ok(20), ok(18), ok(33)]})
    assert rows[0]["tok_s"] == 11 and rows[1]["tok_s"] == 20
    assert rows[1]["ratio"] == 2.0 and rows[1]["note"] == "rounds 2.00 / 1.50 / 3.00"
    failed = bench.merge_rounds(dict(model="m", batch=1), {"a": [ok(10), dict(note="failed: X")], "b": [ok(5), ok(5)]})
    assert "tok_s" not in failed[0] and failed[0]["note"] == "failed: X"
    assert "ratio" not in failed[1] and failed[1]["note"] == "a failed"


def test_use_switches_kerngen_with_and_without_block_graphs():
    model = bench.build_model("qwen3-30b-a3b", 1, 512, "cpu", tiny=True, init_std=0.1)
    block = model.model.layers[0].mlp
    assert "model.layers.0.mlp" in bench.use(model, "kerngen") and block.forward.graphs.max_tokens > 0
    assert "model.layers.0.mlp" not in bench.use(model, "kerngen-eager") and "forward" not in block.__dict__
    assert bench.use(model, "grouped_mm") == [] and "forward" not in block.__dict__


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "gpt-oss-120b"])
def test_one_static_cache_reused_gives_the_dynamic_cache_ids(name):
    """--compile's cache: one StaticCache reset before each generate() call keeps its tensors (the addresses the
    compiled decode's CUDA graphs record) and gives the ids of the default dynamic cache, call after call (on the
    CPU generate() does not compile: this checks the cache's reuse, not the compile)."""
    model = bench.build_model(name, 1, 512, "cpu", tiny=True, dtype=torch.float32)
    bench.use(model, "kerngen")
    ids = bench.prompt_ids(2, 16, 512)
    want = bench.generate(model, ids, 4, compiled=False)
    cache = bench.static_cache(model, ids.shape[1] + 4)
    first = bench.generate(model, ids, 4, compiled=True, cache=cache)
    ptrs = [t.data_ptr() for layer in cache.layers for t in (layer.keys, layer.values)]
    assert ptrs and all(ptrs)
    again = bench.generate(model, ids, 4, compiled=True, cache=cache)
    assert [t.data_ptr() for layer in cache.layers for t in (layer.keys, layer.values)] == ptrs
    assert torch.equal(first, want) and torch.equal(again, want)
