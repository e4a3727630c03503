"""Adding an op takes the places the README's "Adding an op" names, and no other: a toy op registered at run time
(its declaration given to kerngen.ops.register, its module, which is this file, its template, a tier rule in a user
file) is parsed by the tier loader, built by warmup (NVRTC, no GPU), explained by the CLI, and taken out again."""
import pytest

import kerngen
from kerngen import cli, env, ops, render, tiers, warmup
from kerngen.dispatch import Dispatch, OpDispatch
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


# the toy's declaration; its module (the seam warmup and explain read) is this one
TOY = ops.Op("toy", {"scale": {"backend": ops.NVRTC, "factor": ops.Param(int, required=True, hi=16)}}, module=__name__)


def _spec(table, arch, hidden, tokens):
    return spec_for(table.rule("toy", {"hidden": hidden, "tokens": tokens, "arch": arch}), f"H{hidden}",
                    {"H": hidden}, arch)


def model_specs(model, table, arch):
    return [_spec(table, arch, model.hidden, model.tokens[0])]


def explain_spec(table, arch, *, hidden, tokens, **_):
    return _spec(table, arch, hidden, tokens)


def kernel(spec, tokens, device):
    return None


def _dispatch(device, *, hidden):
    return Dispatch("toy", {"hidden": hidden}, lambda rule: spec_for(rule, f"H{hidden}", {"H": hidden}, "sm_90a"),
                    kernel, device, arch="sm_90a")


dispatch = OpDispatch("toy", _dispatch)   # its kernels per static shape and its resolved calls, as every op's


@pytest.fixture
def toy(tmp_path, monkeypatch):
    templates = tmp_path / "templates"
    (templates / "toy").mkdir(parents=True)
    for d in env.templates_dir().iterdir():   # the shipped templates, beside the toy's
        (templates / d.name).symlink_to(d)
    (templates / "toy" / "scale.cu.j2").write_text(TEMPLATE)
    monkeypatch.setattr(env, "templates_dir", lambda: templates)
    render._jinja.cache_clear()
    user = tmp_path / "toy.toml"
    user.write_text(USER)
    monkeypatch.setenv("KERNGEN_TIERS", str(user))
    monkeypatch.setenv("KERNGEN_CACHE_DIR", str(tmp_path / "cache"))
    ops.register(TOY)
    tiers.reload()
    try:
        yield tmp_path
    finally:
        ops.unregister("toy")
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
    assert cli._ops("toy") == ("toy",) and ops.OPS[-1] == "toy" and warmup.registry.OPS[-1] == "toy"
    d = dispatch(-1, hidden=256)   # the rules read once into the shape's dispatch object, kept until clear()
    assert d is dispatch(-1, hidden=256) and d.spec(4) == specs[0] and ("toy", -1, 256) in kerngen.dispatch.registry()
    kerngen.clear()
    assert dispatch(-1, hidden=256) is not d and not dispatch.calls
    with pytest.raises(kerngen.TierError, match=r"param 'factor' of toy variant 'scale' must be an integer in \["):
        tiers.check_params("t.toml", "toy", "scale", {"backend": "nvrtc", "factor": 17})   # [1, 16]


def test_a_registered_op_is_taken_out_again(toy):
    ops.unregister("toy")
    try:
        tiers.reload()
        assert "toy" not in ops.OPS
        with pytest.raises(kerngen.TierError, match="field 'op' must be one of"):
            tiers.load()   # the user file's toy rule
        with pytest.raises(KeyError, match="unknown op 'toy'"):
            ops.op_module("toy")
    finally:
        ops.register(TOY)
    with pytest.raises(ValueError, match="op 'toy' is registered already"):
        ops.register(TOY)


def test_a_rule_of_an_op_nobody_registered_is_a_tier_error(tmp_path):
    p = tmp_path / "t.toml"
    p.write_text('schema = 1\n[[tier]]\nop = "toy"\nvariant = "scale"\nparams = { factor = 3 }\n')
    with pytest.raises(kerngen.TierError, match="field 'op' must be one of"):
        tiers.parse(p)
