"""kerngen.env: every variable's bad values are EnvErrors naming it, and docs/environment.md lists each variable
env.py reads (and no other)."""
import os
import re
import subprocess
import sys

import pytest

from kerngen import env
from kerngen.errors import EnvError


@pytest.mark.parametrize("var, value, read", [
    ("KERNGEN_LOCK_TIMEOUT", "abc", env.lock_timeout),
    ("KERNGEN_LOCK_TIMEOUT", "-1", env.lock_timeout),
    ("KERNGEN_LOCK_TIMEOUT", "nan", env.lock_timeout),
    ("KERNGEN_ARCH", "banana", env.default_arch),
    ("KERNGEN_ARCH", "sm_90a/../x", env.default_arch),
    ("KERNGEN_STRICT", "maybe", env.strict),
])
def test_a_bad_value_names_the_variable(monkeypatch, var, value, read):
    monkeypatch.setenv(var, value)
    with pytest.raises(EnvError) as e:
        read()
    assert e.value.var == var and f"{var}={value!r}" in str(e.value) and "unset it" in str(e.value)


@pytest.mark.parametrize("var, value, read, expected", [
    ("KERNGEN_LOCK_TIMEOUT", "2.5", env.lock_timeout, 2.5),
    ("KERNGEN_LOCK_TIMEOUT", "0", env.lock_timeout, 0.0),
    ("KERNGEN_ARCH", "sm_100a", env.default_arch, "sm_100a"),
    ("KERNGEN_STRICT", " Yes ", env.strict, True),
    ("KERNGEN_STRICT", "off", env.strict, False),
    ("KERNGEN_STRICT", "", env.strict, False),
])
def test_good_values_are_read(monkeypatch, var, value, read, expected):
    monkeypatch.setenv(var, value)
    assert read() == expected


@pytest.mark.parametrize("var, value", [("KERNGEN_ARCH", "banana"), ("KERNGEN_LOCK_TIMEOUT", "abc"),
                                        ("KERNGEN_STRICT", "2")])
def test_the_command_line_reports_a_bad_variable_in_one_line(tmp_path, var, value):
    r = subprocess.run([sys.executable, "-m", "kerngen", "warmup", "--op", "finalize", "--topk", "8", "--hidden",
                        "1024"], capture_output=True, text=True,
                       env={**os.environ, "KERNGEN_CACHE_DIR": str(tmp_path), var: value})
    assert r.returncode == 2 and r.stderr.startswith(f"kerngen: environment variable {var}=")
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1 and not os.listdir(tmp_path)


def _variables(table: str) -> list[str]:
    return [v for row in re.findall(r"^\|\s*`?([A-Z][A-Z_, `]+?)`?\s*\|", table, re.M)
            for v in re.split(r"[`, ]+", row) if v and v != "variable"]


def test_the_documented_table_is_what_env_py_reads():
    doc = env.CHECKOUT / "docs" / "environment.md"
    if not doc.is_file():
        pytest.skip("no docs/ beside the package (an installed copy)")
    source = (env.PACKAGE / "env.py").read_text()
    read = set(re.findall(r"(?:environ\.get|_flag)\(\"([A-Z_]+)\"", source)) - {"XDG_CACHE_HOME"}
    assert set(_variables(doc.read_text())) == read and len(read) >= 6
    assert not _variables(env.__doc__)   # the table is written once, in docs/


def test_an_unsupported_target_names_the_supported_ones(monkeypatch):
    for arch in ("sm_80", "sm_89", "sm_120a"):
        with pytest.raises(EnvError, match=r"sm_90a \(H100, H200\), sm_100a \(B200, GB200\)"):
            env.check_supported(arch, "KERNGEN_ARCH")
    assert env.check_supported("sm_100a", "--arch") == "sm_100a"


def test_a_bad_strict_flag_is_an_error_on_the_cpu_route_and_at_a_shapes_first_dispatch(monkeypatch):
    import torch

    import kerngen.torch_ops  # noqa: F401  (registers torch.ops.kerngen.*)
    from kerngen import dispatch
    never_built = dispatch.OpDispatch("test-op", lambda device, *, shape: pytest.fail("built despite the bad flag"))
    monkeypatch.setenv("KERNGEN_STRICT", "maybe")
    ids = torch.tensor([[0, 1]], dtype=torch.int32)
    calls = [lambda: torch.ops.kerngen.route(torch.randn(2, 8), 2, "softmax_topk"),
             lambda: kerngen.select_experts(None, torch.randn(2, 8), 2, True),
             lambda: kerngen.adapters.moe_align_block_size(ids, 4, 2),
             lambda: torch.ops.kerngen.finalize(torch.zeros(2, 8, dtype=torch.bfloat16), ids, torch.ones(1, 2)),
             lambda: never_built(-1, shape=1)]
    for call in calls:
        with pytest.raises(EnvError, match="KERNGEN_STRICT"):
            call()
    monkeypatch.setenv("KERNGEN_STRICT", "0")
    assert torch.ops.kerngen.route(torch.randn(2, 8), 2, "softmax_topk")[0].shape == (2, 2)
