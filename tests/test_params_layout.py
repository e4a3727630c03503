"""Every CUDA kernel takes one by-value `struct Params` that Python packs with a struct-module format. A field
added on one side only would shift every later field: the kernel would read garbage, silently. Here each
field's offset and the struct's size, as Python packs them, are checked by the compiler (static_assert on
__builtin_offsetof / sizeof) against the rendered source of every kernel family."""
import re
import struct

import pytest

from kerngen import render, tiers
from kerngen.compile import nvrtc_compile
from kerngen.errors import CompileError
from kerngen.ops import finalize as fin
from kerngen.ops import permute as pm
from kerngen.ops import routing as rt


def packed_fields(fmt: str) -> list[int]:
    """Byte offset of each non-padding field of the little-endian, unaligned format `fmt`."""
    offsets, at = [], 0
    for count, code in re.findall(r"(\d*)([a-zA-Z?])", fmt):
        for _ in range(int(count or 1)):
            if code != "x":
                offsets.append(at)
            at += struct.calcsize("<" + code)
    return offsets


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
    yield "finalize small_batch", fin.spec(3584, 16, "bfloat16", "float32", 1, "sm_90a", tbl=t), fin.FMT
    yield "finalize large_batch", fin.spec(3584, 16, "bfloat16", "float32", 1024, "sm_90a", tbl=t), fin.FMT
    for T in (1, 4096):   # fused, then topk
        yield f"routing T={T}", rt.spec(m.num_experts, m.top_k, m.routing, T, "sm_90a", tbl=t), rt.ROUTE_FMT
    yield "permute", pm.spec(m.num_experts, m.top_k, 4096, "sm_90a", t), pm.PERMUTE_FMT


def check_layout(name, src, fmt):
    fields, offsets = struct_fields(src), packed_fields(fmt)
    assert len(fields) == len(offsets), (name, fields, fmt)
    checks = [f'static_assert(sizeof(Params) == {struct.calcsize("<" + fmt)}, "sizeof(Params) vs {fmt}");']
    checks += [f'static_assert(__builtin_offsetof(Params, {f}) == {o}, "offset of {f} vs {fmt}");'
               for f, o in zip(fields, offsets)]
    nvrtc_compile(src + "\n" + "\n".join(checks) + "\n", "layout", "sm_90a", f"layout-{name}", None)


@pytest.mark.parametrize("name, spec, fmt", list(families()), ids=lambda v: v if isinstance(v, str) else "")
def test_python_packing_matches_the_kernel_params_struct(name, spec, fmt):
    check_layout(name, render.render(spec), fmt)


def test_a_field_python_packs_elsewhere_fails_to_compile():
    """The permute format with the ticket packed as an int plus padding and the next field as a pointer: same
    field count, same size, later fields at other offsets, which only the offset checks see."""
    src = render.render(pm.spec(896, 16, 4096, "sm_90a", tiers.load()))
    assert pm.PERMUTE_FMT == "9Q5i4x"
    with pytest.raises(CompileError, match="offset of"):
        check_layout("permute-shuffled", src, "8Qi4xQ4i")
