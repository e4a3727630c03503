"""Experts rules per weight format: `formats = [...]` names the formats a rule serves (left out: every format);
dispatch, warmup and the tools look rules up with the weights' format, and a bad field is a TierError naming it."""
import pytest

from kerngen import tiers
from kerngen.errors import TierError
from kerngen.ops import experts as ex

RULES = """schema = 1

[[tier]]
op = "experts"
variant = "mma"
formats = ["mxfp4"]
tokens = [1, 16]
params = { tile = 8, warps = 4, unroll = 1, blocks_per_sm = 2, prefetch = false }

[[tier]]
op = "experts"
variant = "mma"
tokens = [1, 16]
params = { tile = 8, warps = 8, unroll = 2, blocks_per_sm = 4 }
"""


def test_a_rule_serves_only_the_formats_it_names(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text(RULES)
    t = tiers.load(f)
    for fmt, warps in (("mxfp4", 4), ("fp8", 8), ("bf16", 8)):
        s = ex.spec(1024, 256, None, "silu", 4, "sm_90a", t, fmt)
        assert dict(s.params)["warps"] == warps and dict(s.constants)["FORMAT"] == fmt


def test_the_shipped_quantized_rules_are_their_own():
    t = tiers.load()
    for fmt in ("fp8", "mxfp4"):
        for T in (1, 16, 17, 256):
            r = t.rule("experts", {"hidden": 7168, "tokens": T, "arch": "sm_90a", "format": fmt})
            assert r.formats == (fmt,)
    assert t.rule("experts", {"hidden": 7168, "tokens": 1, "arch": "sm_90a", "format": "bf16"}).formats == ()


@pytest.mark.parametrize("field,why", [('formats = ["fp4"]', "non-empty list of 'bf16', 'fp8', 'mxfp4'"),
                                       ("formats = []", "non-empty list"), ('formats = "fp8"', "non-empty list")])
def test_a_bad_formats_field_is_a_tier_error_naming_it(tmp_path, field, why):
    f = tmp_path / "t.toml"
    f.write_text(RULES.replace('formats = ["mxfp4"]', field))
    with pytest.raises(TierError, match="formats") as e:
        tiers.parse(f)
    assert why in str(e.value)


def test_formats_is_for_experts_rules_only(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text('schema = 1\n\n[[tier]]\nop = "finalize"\nvariant = "small_batch"\nformats = ["fp8"]\n'
                 'params = { block_x = 16, loads_per_group = 2, early_read = false }\n')
    with pytest.raises(TierError, match="applies to op = \"experts\" rules only"):
        tiers.parse(f)
