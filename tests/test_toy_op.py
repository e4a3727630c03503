"""Adding an op takes the places the README's "Adding an op" names, and no other: a toy op registered at run time
(its module in kerngen.ops.OPS, its template, its variant's params in tiers.PARAMS, a tier rule in a user file) is
parsed by the tier loader, built by warmup (NVRTC, no GPU) and explained by the CLI."""
import sys
import types

import pytest

import kerngen
from kerngen import cli, env, ops, render, tiers, warmup
from kerngen.plan import spec_for

TEMPLATE = '''// toy: out[i] = in[i] * {{ factor }} over H = {{ H }} floats
extern "C" __global__ void toy_scale(const float* in, float* out) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < {{ H }}) out[i] = in[i] * {{ factor }}.f;
}
'''

USER = '''schema = 1
[models.toy-model]
num_experts = 8
top_k = 2
hidden = 256
routing = "softmax_topk"
tokens = [1, 64]

[[tier]]
op = "toy"
variant = "scale"
hidden = [8, 4096]
params = { factor = 3 }
'''


def _toy_module():
    mod = types.ModuleType("kerngen.ops.toy")

    def spec_of(table, arch, hidden, tokens):
        return spec_for(table.rule("toy", {"hidden": hidden, "tokens": tokens, "arch": arch}), f"H{hidden}",
                        {"H": hidden}, arch)

    mod.model_specs = lambda model, table, arch: [spec_of(table, arch, model.hidden, model.tokens[0])]
    mod.explain_spec = lambda table, arch, *, hidden, tokens, **_: spec_of(table, arch, hidden, tokens)
    mod.kernel = lambda spec, tokens, device: None
    mod.dispatch = lambda *a, **k: None
    return mod


@pytest.fixture
def toy(tmp_path, monkeypatch):
    templates = tmp_path / "templates"
    (templates / "toy").mkdir(parents=True)
    for d in env.templates_dir().iterdir():   # the shipped templates, beside the toy's
        (templates / d.name).symlink_to(d)
    (templates / "toy" / "scale.cu.j2").write_text(TEMPLATE)
    monkeypatch.setattr(env, "templates_dir", lambda: templates)
    render._jinja.cache_clear()
    monkeypatch.setitem(sys.modules, "kerngen.ops.toy", _toy_module())
    monkeypatch.setattr(ops, "OPS", ops.OPS + ("toy",))
    nvrtc = tiers.PARAMS[("finalize", "small_batch")]["backend"]
    monkeypatch.setitem(tiers.PARAMS, ("toy", "scale"), {"backend": nvrtc, "factor": tiers._n(1, 16, required=True)})
    user = tmp_path / "toy.toml"
    user.write_text(USER)
    monkeypatch.setenv("KERNGEN_TIERS", str(user))
    monkeypatch.setenv("KERNGEN_CACHE_DIR", str(tmp_path / "cache"))
    tiers.reload()
    yield tmp_path
    render._jinja.cache_clear()
    monkeypatch.undo()
    tiers.reload()


def test_a_toy_op_is_parsed_built_and_explained_through_the_registry(toy, capsys):
    tbl = tiers.load()
    specs = [s for s in warmup.model_specs(tbl.model("toy-model"), tbl, "sm_90a") if s.op == "toy"]
    assert len(specs) == 1 and dict(specs[0].params)["factor"] == 3 and dict(specs[0].constants) == {"H": 256}
    results = warmup.run(specs, str(toy / "cache"), jobs=1, progress=False)
    assert [r.status for r in results] == ["compiled"], results[0].error
    assert "in[i] * 3.f" in render.render(specs[0])
    assert cli.main(["explain", "--op", "toy", "--model", "toy-model", "--tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "op        toy" in out and "variant   scale" in out and "cached    yes" in out, out
    assert cli._ops("toy") == ("toy",)


def test_a_rule_of_an_op_nobody_registered_is_a_tier_error(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text('schema = 1\n[[tier]]\nop = "toy"\nvariant = "scale"\nparams = { factor = 3 }\n')
    with pytest.raises(kerngen.TierError, match="field 'op' must be one of"):
        tiers.parse(p)
