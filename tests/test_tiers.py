"""Tier table parsing, validation messages, layering and dispatch."""
import dataclasses

import pytest

from kerngen import env, tiers
from kerngen.errors import TierError

SHIPPED = {"deepseek-v3", "kimi-k2", "kimi-k3", "glm-4.5", "qwen3-235b-a22b", "qwen3-30b-a3b",
           "qwen3-next-80b", "gpt-oss-120b", "llama-4-maverick", "mixtral-8x7b"}


MODEL = "schema = 1\n[models.m]\nnum_experts = 8\ntop_k = 2\nhidden = 64\nrouting = 'softmax_topk'\ntokens = [1, 8]\n"
RULE = "schema = 1\n[[tier]]\nop = '{op}'\nvariant = '{variant}'\nparams = {{ {params} }}\n"


def write(tmp_path, text, name="t.toml"):
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return p


def test_shipped_models_have_mission_constants():
    t = tiers.load()
    assert SHIPPED <= set(t.models)
    ds = t.model("deepseek-v3")
    assert (ds.num_experts, ds.top_k, ds.hidden, ds.routing, ds.n_group, ds.topk_group, ds.routed_scaling_factor) \
        == (256, 8, 7168, "grouped_sigmoid_bias", 8, 4, 2.5)
    k3 = t.model("kimi-k3")
    assert (k3.num_experts, k3.top_k, k3.hidden, k3.routing, k3.routed_scaling_factor) == (896, 16, 3584, "sigmoid_bias", 2.5)
    assert t.model("kimi-k2").routed_scaling_factor == pytest.approx(2.827)
    assert t.model("gpt-oss-120b").routing == "topk_softmax"
    assert t.model("llama-4-maverick").top_k == 1


def test_every_model_dispatches_finalize_over_its_range():
    t = tiers.load()
    for m in t.models.values():
        for T in (m.tokens[0], 8, 64, m.tokens[1]):
            r = t.rule("finalize", {"hidden": m.hidden, "top_k": m.top_k, "num_experts": m.num_experts, "tokens": T})
            assert r.op == "finalize"


@pytest.mark.parametrize("text, needle", [
    ("schema = 2\n", "field 'schema' must be 1"),
    (MODEL[len("schema = 1\n"):], "missing required field 'schema': a tiers file starts with `schema = 1`"),
    ("schema = 1\nfoo = 3\n", "unknown top-level key 'foo'"),
    ("schema = 1\n[models.m]\nnum_experts = 8\ntop_k = 2\nhidden = 64\ntokens = [1, 8]\n", "[models.m]: field 'routing'"),
    ("schema = 1\n[models.m]\nnum_experts = 3000\ntop_k = 2\nhidden = 64\nrouting = 'softmax_topk'\ntokens = [1, 8]\n",
     "'num_experts' must be an integer in [1, 2048]"),
    ("schema = 1\n[models.m]\nnum_experts = 8\ntop_k = 9\nhidden = 64\nrouting = 'softmax_topk'\ntokens = [1, 8]\n",
     "'top_k'"),
    ("schema = 1\n[models.m]\nnum_experts = 10\ntop_k = 2\nhidden = 64\nrouting = 'grouped_sigmoid_bias'\n"
     "n_group = 4\ntokens = [1, 8]\n", "'n_group' (4) must divide num_experts (10)"),
    ("schema = 1\n[models.m]\nnum_experts = 8\ntop_k = 2\nhidden = 60\nrouting = 'softmax_topk'\ntokens = [1, 8]\n",
     "multiple of 8"),
    ("schema = 1\n[models.m]\nnum_experts = 8\ntop_k = 2\nhidden = 64\nrouting = 'softmax_topk'\n", "'tokens'"),
    ("schema = 1\n[models.m]\nnum_experts = 8\ntop_k = 2\nhidden = 64\nrouting = 'softmax_topk'\ntokens = [1, 8]\ncolor = 1\n",
     "unknown field 'color'"),
    ("schema = 1\n[[tier]]\nop = 'finalise'\nvariant = 'x'\n", "[[tier]] #1: field 'op'"),
    ("schema = 1\n[[tier]]\nop = 'finalize'\n", "[[tier]] #1: missing required field 'variant'"),
    ("schema = 1\n[[tier]]\nop = 'finalize'\nvariant = 'x'\ntokens = [9, 1]\n", "field 'tokens' must be an inclusive range"),
    ("schema = 1\n[[tier]]\nop = 'finalize'\nvariant = 'x'\nparams = { a = [1] }\n", "'params' must be a table of scalars"),
    ("schema = 1\n[[tier]]\nop = 'routing'\nvariant = 'topk'\npermute = 1\n"
     "params = { warps = 4, warps_per_token = 4 }\n",
     "field 'permute' must be true or false, got 1"),
    ("schema = 1\n[[tier]]\nop = 'finalize'\nvariant = 'small_batch'\npermute = false\n"
     "params = { block_x = 16, loads_per_group = 2, early_read = false }\n",
     "field 'permute' applies to op = \"routing\" rules only, not finalize"),
    ("schema = 1\n[tier]\nop = 'finalize'\n", "write [[tier]]"),
    ("schema = 1\n[models\n", "not valid TOML"),
    (b"schema = 1\n# caf\xe9\n", "not UTF-8 text (byte 16)"),
    ("schema = true\n", "field 'schema' must be 1, got True"),
    ("schema = 1\nmodels = 5\n", "'models' must be a table of models"),
    ("schema = 1\ntier = [5]\n", "[[tier]] #1: must be a table"),
    ("schema = 1\nprovenance = 5\n", "'provenance' must be a table"),
    (MODEL + "tile = 128\n", "field 'tile' is not a model field: give the permutation's tile to the call"),
    (MODEL + "experts_format = 'int4'\n", "field 'experts_format' must be one of bf16, fp8, mxfp4, got 'int4'"),
    (MODEL + "routed_scaling_factor = inf\n", "'routed_scaling_factor' must be a positive finite number, got inf"),
    (MODEL + "routed_scaling_factor = nan\n", "'routed_scaling_factor' must be a positive finite number, got nan"),
    (MODEL + "routed_scaling_factor = 1000000000000000000000000000000000000000000000000000000000000000000000000000000000"
     "0000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
     "00000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000"
     "000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000\n",
     "'routed_scaling_factor' must be a positive finite number"),
    (MODEL.replace("tokens = [1, 8]", "tokens = [1, 1000000000000000000000000000000]"),
     "[models.m]: field 'tokens' must be an inclusive range [lo, hi] of integers with 0 <= lo <= hi <= 2147483647"),
    (MODEL.replace("hidden = 64", "hidden = 1000000000000000000000000000000"),
     "field 'hidden' must be an integer in [8, 2147483647]"),
    (RULE.format(op="finalize", variant="../../somewhere/evil", params='backend = "cute"'),
     "[[tier]] #1: field 'variant' must be the name of a variant of finalize (known: cute, large_batch, small_batch)"),
    (RULE.format(op="finalize", variant="huge_batch", params="block_x = 16"),
     "[[tier]] #1: unknown variant 'huge_batch' of finalize for backend 'nvrtc'"),
    (RULE.format(op="finalize", variant="small_batch", params='backend = "cute"'),
     "variant 'small_batch' of finalize is built by backend 'nvrtc' (finalize/small_batch.cu.j2), not 'cute'"),
    (RULE.format(op="finalize", variant="cute", params='backend = "cuda"'), "param 'backend' must be one of nvrtc, cute"),
    (RULE.format(op="finalize", variant="cute", params=""),
     "variant 'cute' of finalize is built by backend 'cute' (finalize/cute.py), not 'nvrtc': set params.backend"),
    (RULE.format(op="finalize", variant="small_batch", params="block_x = 16, early_read = false"),
     "[[tier]] #1: missing param 'loads_per_group' (finalize variant 'small_batch' needs block_x, loads_per_group, "
     "early_read)"),
    (RULE.format(op="finalize", variant="small_batch", params="block_X = 16, loads_per_group = 2, early_read = false"),
     "[[tier]] #1: unknown param 'block_X' of finalize variant 'small_batch' (known: backend, block_x,"),
    (RULE.format(op="routing", variant="topk", params='warps = "8", warps_per_token = 2'),
     "[[tier]] #1: param 'warps' of routing variant 'topk' must be an integer in [1, 32], got '8'"),
    (RULE.format(op="routing", variant="topk", params="warps = 8, warps_per_token = 3"),
     "param 'warps' (8) must be a multiple of 'warps_per_token' (3)"),
    (RULE.format(op="routing", variant="fused", params="warps = 8, warps_per_token = 8, ctas = 8, clusters = 4, "
                 "max_tokens = 65"), "param 'max_tokens' of routing variant 'fused' must be an integer in [1, 64]"),
    (RULE.format(op="permute", variant="onepass", params="threads = 500"), "a multiple of 32"),
    (RULE.format(op="tail", variant="tail", params='backend = "cute", threads = 128, pdl = 1'),
     "param 'pdl' of tail variant 'tail' must be true or false, got 1"),
    (RULE.format(op="tail_tp", variant="nccl", params='allreduce = "nccl"'),
     "unknown variant 'nccl' of tail_tp (known: allreduce)"),
    (RULE.format(op="tail_tp", variant="allreduce", params='allreduce = "symm_mem"'),
     "allreduce = \"symm_mem\" needs param 'max_tokens'"),
])
def test_bad_files_name_file_table_and_field(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(TierError) as e:
        tiers.parse(p)
    assert needle in str(e.value) and str(p) in str(e.value)


def test_the_docs_name_every_required_model_field():
    doc = env.CHECKOUT / "docs" / "tiers.md"
    if not doc.is_file():
        pytest.skip("no docs/ beside the package (an installed copy)")
    required = [f.name for f in dataclasses.fields(tiers.Model) if f.name != "name"
                and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    text = " ".join(doc.read_text().split())
    sentence = text.split("gives a model's shape and router:", 1)[1].split(" are required", 1)[0]
    assert required and all(f"`{f}`" in sentence for f in required), (required, sentence)


def test_user_file_layers_over_shipped(tmp_path):
    p = write(tmp_path, """schema = 1
[models.tiny]
num_experts = 16
top_k = 2
hidden = 256
routing = "softmax_topk"
tokens = [1, 64]

[models.kimi-k3]
num_experts = 896
top_k = 16
hidden = 3584
routing = "sigmoid_bias"
routed_scaling_factor = 3.0
tokens = [1, 128]

[[tier]]
op = "finalize"
variant = "large_batch"
hidden = [256, 256]
params = { vectors_per_thread = 1, unroll = 2, early_read = false }
""")
    t = tiers.load(p)
    assert "tiny" in t.models and "deepseek-v3" in t.models
    assert t.model("kimi-k3").routed_scaling_factor == 3.0
    r = t.rule("finalize", {"hidden": 256, "top_k": 2, "tokens": 1})
    assert r.params == {"vectors_per_thread": 1, "unroll": 2, "early_read": False} and str(p) in r.source
    shipped = t.rule("finalize", {"hidden": 512, "top_k": 2, "tokens": 1})
    assert "small_batch" == shipped.variant


def test_repeated_models_calls_stat_nothing_and_see_a_changed_kerngen_tiers(tmp_path, monkeypatch):
    import os

    import kerngen
    one = write(tmp_path, MODEL.replace("models.m", "models.one"), "one.toml")
    two = write(tmp_path, MODEL.replace("models.m", "models.two"), "two.toml")
    stats = []
    for name in ("stat", "lstat"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, **kw: stats.append(a[0]) or _real(*a, **kw))

    monkeypatch.setenv("KERNGEN_TIERS", str(one))
    assert "one" in kerngen.models() and "deepseek-v3" in kerngen.models()
    stats.clear()
    for _ in range(3):
        assert "one" in kerngen.models()
    assert stats == []

    monkeypatch.setenv("KERNGEN_TIERS", str(two))
    assert {"two"} <= set(kerngen.models()) and "one" not in kerngen.models()
    stats.clear()
    kerngen.models()
    assert stats == []

    monkeypatch.delenv("KERNGEN_TIERS")
    assert not {"one", "two"} & set(kerngen.models())


def test_no_matching_rule_says_how_to_fix(tmp_path):
    p = write(tmp_path, "schema = 1\n")
    t = tiers.Table(models={}, rules=(), files=(str(p),))
    with pytest.raises(TierError, match="add a \\[\\[tier\\]\\] rule"):
        t.rule("finalize", {"hidden": 64, "top_k": 2, "tokens": 1})
    with pytest.raises(TierError, match="unknown model 'nope'"):
        tiers.load().model("nope")


def test_rules_for_splits_token_range():
    t = tiers.load()
    m = t.model("kimi-k3")
    shape = {"hidden": m.hidden, "top_k": m.top_k, "arch": "sm_90a"}
    variants = [r.variant for r in t.rules_for("finalize", shape, m.tokens)]
    assert variants[0] == "small_batch" and "large_batch" in variants and variants[-1] == "cute"
    sm90 = [r for r in t.rules if r.op == "finalize" and (not r.arch or "sm_90a" in r.arch)
            and r.ranges.get("top_k", (1, 64))[1] >= m.top_k]
    assert len(variants) == len(sm90)   # every finalize rule of the H200 for its top_k serves kimi-k3
    small_k = t.rules_for("finalize", {"hidden": 2880, "top_k": 4, "arch": "sm_90a"}, (1, 8192))
    assert [r.variant for r in small_k] == ["small_batch", "small_batch", "cute", "cute"]
    only_small = t.rules_for("finalize", {"hidden": m.hidden, "top_k": m.top_k}, (1, 4))
    assert [r.variant for r in only_small] == ["small_batch"] and only_small[0].ranges["tokens"][0] == 1


def test_a_directory_is_not_a_tier_file(tmp_path):
    with pytest.raises(TierError, match=f"tier file {tmp_path} is a directory"):
        tiers.parse(tmp_path)


def test_a_variant_is_a_name_never_a_path(tmp_path):
    from kerngen.errors import InputError
    from kerngen.plan import KernelSpec
    evil = '{"op":"finalize","variant":"../../x/evil","backend":"cute","tag":"t","constants":{},"params":{},"arch":"sm_90a"}'
    with pytest.raises(InputError, match="variant"):
        KernelSpec.from_json(evil)
    with pytest.raises(InputError, match="argument 'variant' must be a name"):
        KernelSpec("finalize", "../x", "cute", "t", (), (), "sm_90a")
    with pytest.raises(InputError, match="argument 'tag'"):
        KernelSpec("finalize", "cute", "cute", "H8/../../x", (), (), "sm_90a")
    with pytest.raises(InputError, match="max_loads"):   # --spec params are checked like a rule's
        KernelSpec.from_json(evil.replace("../../x/evil", "cute").replace('"params":{}', '"params":{"max_loads":"8"}'))


def _template_values(name: str) -> set[str]:
    """The lowercase values (params; constants are uppercase) a Jinja template and its includes read."""
    import jinja2
    import jinja2.meta
    from kerngen import env
    j = jinja2.Environment(loader=jinja2.FileSystemLoader(str(env.templates_dir())))
    ast = j.parse(j.loader.get_source(j, name)[0])
    names = {n for n in jinja2.meta.find_undeclared_variables(ast) if n.islower()}
    for inc in jinja2.meta.find_referenced_templates(ast):
        names |= _template_values(inc)
    return names


def _compile_kernel_keywords(path) -> set[str]:
    import ast
    tree = ast.parse(path.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "compile_kernel")
    return {a.arg for a in fn.args.kwonlyargs if a.arg.islower()}


def test_params_table_matches_the_templates():
    """Every value a template reads is a param of its variant, and every template has a params entry."""
    from kerngen import ops
    for op in ("routing", "permute", "finalize", "tail"):
        for variant in tiers.variants(op):
            schema = ops.params(op, variant)
            assert schema is not None, f"{op}/{variant}: a template without params in its op's declaration"
            backend = "cute" if schema["backend"].required else "nvrtc"
            path = tiers.template_path(op, variant, backend)
            if backend == "cute":
                assert _compile_kernel_keywords(path) == set(schema) - {"backend"}, (op, variant)
            else:
                assert _template_values(f"{op}/{variant}.cu.j2") <= set(schema), (op, variant)
    assert {o.name for o in ops.registered()} == {*ops.OPS, "tail_tp"}   # tail_tp: host code only
