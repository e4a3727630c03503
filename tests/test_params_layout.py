"""Every CUDA kernel takes one by-value `struct Params` that Python packs from the op's field list (a
`kerngen.launch.Params`). A field added on one side only would shift every later field: the kernel would read
garbage, silently. Here the field names must match the C struct's in order, and each field's offset and the
struct's size, as the field list packs them, are checked by the compiler (static_assert on __builtin_offsetof /
sizeof) against the rendered source of every kernel family."""
import re

import pytest

from kerngen import render, tiers
from kerngen.compile import nvrtc_compile
from kerngen.errors import CompileError
from kerngen.launch import Params
from kerngen.ops import experts as ex
from kerngen.plan import spec_for
from kerngen.ops import finalize as fin
from kerngen.ops import permute as pm
from kerngen.ops import routing as rt


def struct_fields(source: str) -> list[str]:
    """Field names of `struct Params { ... };` in declaration order (comments dropped, `int a, b;` split)."""
    body = re.search(r"struct Params \{(.*?)\};", source, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    names = []
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        first, *rest = decl.split(",")
        names.append(re.findall(r"\w+", first)[-1])
        names += [re.findall(r"\w+", r)[-1] for r in rest]
    return names


def families():
    t = tiers.load()
    m = t.model("kimi-k3")
    yield "finalize small_batch", fin.spec(3584, 16, "bfloat16", "float32", 1, "sm_90a", tbl=t), fin.PARAMS
    yield "finalize large_batch", fin.spec(3584, 16, "bfloat16", "float32", 1024, "sm_90a", tbl=t), fin.PARAMS
    for T in (1, 4096):   # fused, then topk
        yield f"routing T={T}", rt.spec(m.num_experts, m.top_k, m.routing, T, "sm_90a", tbl=t), rt.PARAMS
    yield "permute histogram", pm.spec(m.num_experts, m.top_k, 4096, "sm_90a", t), pm.PARAMS
    yield "permute onepass", pm.spec(m.num_experts, m.top_k, 1, "sm_90a", t), pm.PARAMS
    yield "experts mma", ex.spec(7168, 2048, 8, "silu", 1, "sm_90a", t), ex.PARAMS
    for fmt, H, I, act in (("fp8", 7168, 2048, "silu"), ("mxfp4", 2880, 2880, "gpt_oss")):
        s = ex.spec(H, I, 8, act, 1, "sm_90a", t, fmt)
        yield f"experts mma {fmt}", s, ex.params_struct(s)
        for f16x in (False, True):   # the weight-only struct and the one with quantized activations' buffers
            x = spec_for(tiers.Rule("experts", "mma", {}, dict(warps=4, unroll=1, f16x=f16x)),
                         *ex.tag_constants(H, I, 8, act, fmt), "sm_90a")
            yield f"experts mma {fmt} f16x={f16x}", x, ex.PARAMS_A8 if f16x else ex.PARAMS_SCALED
    s = ex.spec(7168, 2048, 8, "silu", 1, "sm_90a", t, "fp8", a8=True)
    yield "experts mma fp8 a8", s, ex.PARAMS_A8


def check_layout(name, src, params: Params):
    fields = struct_fields(src)
    assert fields == list(params.c_names), (name, fields, params.c_names)
    checks = [f'static_assert(sizeof(Params) == {params.size}, "sizeof(Params) vs {params.format}");']
    checks += [f'static_assert(__builtin_offsetof(Params, {c}) == {params.offsets[n]}, "offset of {c} vs '
               f'{params.format}");' for n, c in zip(params.names, params.c_names)]
    nvrtc_compile(src + "\n" + "\n".join(checks) + "\n", "layout", "sm_90a", f"layout-{name}", None)


@pytest.mark.parametrize("name, spec, params", list(families()), ids=lambda v: v if isinstance(v, str) else "")
def test_python_packing_matches_the_kernel_params_struct(name, spec, params):
    assert spec.backend == "nvrtc"
    check_layout(name, render.render(spec), params)


def test_field_lists_pack_as_c_lays_out():
    """Natural alignment: a pointer after an int starts at the next multiple of 8, the size rounds up to 8."""
    assert (rt.PARAMS.format, pm.PARAMS.format, fin.PARAMS.format, ex.PARAMS.format) == (
        "10Qf6i4x", "9Q5i4x", "4Q3i4x", "11Q4i2f")
    p = Params(("a", "int"), ("b", "ptr"), ("c", "float"))
    assert (p.format, p.offsets, p.size) == ("i4xQf4x", {"a": 0, "b": 8, "c": 16}, 24)
    assert fin.PARAMS.c_names[0] == "in" and fin.PARAMS.names[0] == "in_"


def test_a_field_python_packs_elsewhere_fails_to_compile():
    """The permute fields with the ticket an int and the next field a pointer: same names, same size, later
    fields at other offsets, which only the offset checks see."""
    src = render.render(pm.spec(896, 16, 4096, "sm_90a", tiers.load()))
    shuffled = Params(*[(n, "int" if n == "ticket" else "ptr" if n == "tokens" else t) for n, t in pm.PARAMS.fields])
    assert shuffled.size == pm.PARAMS.size and shuffled.names == pm.PARAMS.names
    with pytest.raises(CompileError, match="offset of"):
        check_layout("permute-shuffled", src, shuffled)


def test_a_launch_by_name_packs_fields_in_order_and_zero_for_the_rest():
    """Params.launch / bind (what Launcher.launch and .bind are) on a stand-in launcher: no GPU needed."""
    import ctypes
    import struct
    import threading
    from types import SimpleNamespace

    launched = []
    st = SimpleNamespace(buf=ctypes.create_string_buffer(pm.PARAMS.size), cfg=SimpleNamespace(stream=None),
                         cfg_p=1, argv_p=2)
    stub = SimpleNamespace(_states={threading.get_ident(): st}, _state=None, _fn_p=3, _failed=None,
                           pack=struct.Struct("<" + pm.PARAMS.format),
                           _launch=lambda *a: launched.append(a) or 0, _bound=lambda *values: values)
    pm.PARAMS.launch(stub, 7, ids=11, ticket=19, tokens=5, max_rows=96)
    want = (11, 0, 0, 0, 0, 0, 0, 0, 19, 5, 0, 0, 0, 96)
    assert st.buf.raw == struct.pack("<" + pm.PARAMS.format, *want) and st.cfg.stream == 7
    assert launched == [(1, 3, 2, None)]
    assert rt.PARAMS.bind(stub, tokens=3, rsf=0.5, logits=1) == (1,) + (0,) * 9 + (0.5, 3) + (0,) * 5
    with pytest.raises(TypeError):
        fin.PARAMS.launch(stub, 0, in_=1, idx=2, wrong=3)   # a name the struct does not have
