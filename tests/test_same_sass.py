"""tools/diagnose/same_sass.py without a GPU: SASS text is compared by instruction, not by address or encoding; a tree built
against itself is the same; a changed instruction differs, and only --allow lets it through."""
import io
import json
from pathlib import Path

import pytest

from tools.diagnose import same_sass as ss

ROOT = Path(__file__).resolve().parents[1]



# cuobjdump -sass as it prints a cubin (two functions; the second a CuTe name holding its key's hash)
SASS = """
	code for sm_90a
	.target	sm_90a

		Function : permute_place
	.headerflags	@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
                                                                           /* 0x000fe20000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                      /* 0x0000000000007919 */
                                                                           /* 0x000e2e0000002100 */
        /*0020*/              @!P0 BRA 0x60 ;                              /* 0x00000008008c8947 */
                                                                           /* 0x000fec0003800000 */
        /*0030*/                   STG.E desc[UR4][R2.64], R0 ;            /* 0x0000000002007986 */
                                                                           /* 0x000fe2000c101904 */
        /*0040*/                   EXIT ;                                  /* 0x000000000000794d */
                                                                           /* 0x000fea0003800000 */
        /*0050*/                   BRA 0x50;                               /* 0xfffffffc00fc7947 */
                                                                           /* 0x000fc0000383ffff */
		..........

		Function : kernel_cutlass_kerngen_tail_H64_sm_90a_0123456789abTail_0
	.headerflags	@"EF_CUDA_ACCELERATORS EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
                                                                           /* 0x000fe20000000800 */
        /*0010*/                   EXIT ;                                  /* 0x000000000000794d */
                                                                           /* 0x000fea0003800000 */
"""


def test_normalize_keeps_opcodes_and_operands_only():
    f = ss.normalize(SASS, "0123456789ab")
    assert list(f) == ["permute_place", "kernel_cutlass_kerngen_tail_H64_sm_90a_<hash>Tail_0"]
    assert f["permute_place"] == ["LDC R1, c[0x0][0x28] ;", "S2R R0, SR_TID.X ;", "@!P0 BRA 0x60 ;",
                                  "STG.E desc[UR4][R2.64], R0 ;", "EXIT ;", "BRA 0x50;"]


def test_other_addresses_and_encodings_are_the_same_sass():
    moved = SASS.replace("/*00", "/*01").replace("0x000fe2", "0x000fe4")
    assert ss.compare(ss.normalize(SASS), ss.normalize(moved)).same


def test_a_changed_instruction_differs_and_says_where():
    changed = SASS.replace("STG.E desc[UR4][R2.64], R0", "STG.E.64 desc[UR4][R2.64], R4")
    v = ss.compare(ss.normalize(SASS), ss.normalize(changed))
    assert not v.same and (v.before, v.after) == (8, 8)
    assert "permute_place: 6 -> 6 instructions; opcodes -1 STG.E, +1 STG.E.64" in v.lines[0]
    assert "    -STG.E desc[UR4][R2.64], R0 ;" in v.lines and "    +STG.E.64 desc[UR4][R2.64], R4 ;" in v.lines


def test_an_inserted_instruction_is_shown_rather_than_the_branch_targets_it_moves():
    inserted = SASS.replace("        /*0030*/", "        /*0030*/  MEMBAR.SC.GPU ;\n        /*0040*/").replace(
        "BRA 0x60", "BRA 0x70")
    v = ss.compare(ss.normalize(SASS), ss.normalize(inserted))
    assert not v.same and "6 -> 7 instructions; opcodes +1 MEMBAR.SC.GPU" in v.lines[0]
    assert [line.strip() for line in v.lines if line.strip().startswith(("+", "-"))] == ["+MEMBAR.SC.GPU ;"]


def test_a_function_on_one_side_only_differs():
    a = ss.normalize(SASS)
    b = {k: v for k, v in a.items() if k == "permute_place"}
    v = ss.compare(a, b)
    assert not v.same and "only before" in v.lines[0]


def kernel(json_, key, blobs=None):
    return ss.Kernel(json=json_, key=key, models=["m"], status="cached", blobs=blobs or {"kernel.cubin": key})


def spec_json(params):
    return json.dumps({"op": "routing", "variant": "fused", "backend": "nvrtc", "tag": "E8", "constants": {},
                       "params": params, "arch": "sm_90a"}, sort_keys=True)


def test_kernels_pair_by_spec_then_by_a_readable_key_left_once():
    """Two rules give one readable key; a changed parameter set pairs with the one left over."""
    b = [kernel(spec_json({"ctas": 1}), "routing-fused-E8-sm_90a-aaaaaaaaaaaa"),
         kernel(spec_json({"ctas": 8}), "routing-fused-E8-sm_90a-bbbbbbbbbbbb")]
    a = [kernel(spec_json({"ctas": 8}), "routing-fused-E8-sm_90a-bbbbbbbbbbbb"),
         kernel(spec_json({"ctas": 2}), "routing-fused-E8-sm_90a-cccccccccccc")]
    pairs = ss.pair(b, a)
    assert [(x.json, y.json) for x, y in pairs] == [(b[1].json, a[0].json), (b[0].json, a[1].json)]
    assert ss.pair(b, a[:1]) == [(b[1], a[0]), (b[0], None)]


def test_the_working_tree_against_itself_is_the_same_sass(tmp_path):
    """The whole path on one small model's finalize kernels (CUDA C++ and CuTe): two subprocess builds, pairing,
    then a real disassembly compared with itself and with one instruction changed."""
    rows = ss.compare_trees(ROOT, ROOT, models="mixtral-8x7b", ops="finalize", root=tmp_path, repeat=0)
    assert rows and {r.status for r in rows} == {"same"}
    assert {json.loads(r.after.json)["backend"] for r in rows} == {"nvrtc", "cute"}
    assert ss.report(rows, [], out=io.StringIO()) == 0

    k = next(r.after for r in rows if json.loads(r.after.json)["variant"] == "small_batch")
    ss.disassemble_all([k], tmp_path, jobs=1)
    sass = ss.sass_of(k, tmp_path)
    assert list(sass) == ["finalize_small_batch"] and len(sass["finalize_small_batch"]) > 50
    assert ss.compare(sass, sass).same
    body = sass["finalize_small_batch"]
    i = next(i for i, ins in enumerate(body) if ins.startswith("FADD"))
    changed = {"finalize_small_batch": body[:i] + ["FFMA R0, R1, R2, R3 ;"] + body[i + 1:]}
    v = ss.compare(sass, changed)
    assert not v.same and "+1 FFMA" in v.lines[0]

    row = ss.Row(ss._name(k), "differs", v, k, k)
    assert ss.report([row], [], out=io.StringIO()) == 1
    assert ss.report([row], ["finalize-small_batch-H4096"], out=io.StringIO()) == 0


def test_an_unknown_revision_is_refused_by_name(tmp_path):
    with pytest.raises(SystemExit, match="'no-such-revision' is not a commit"):
        ss.main(["--rev", "no-such-revision", "--cache-root", str(tmp_path)])
