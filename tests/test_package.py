"""kerngen as an installed package: its data travels with it, and its commands print no warnings.

Self-contained (no conftest fixtures): CI copies it out of the checkout and runs it against the installed
wheel with KERNGEN_EXPECT_INSTALLED=1, from a directory outside the checkout.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest

import kerngen
from kerngen import env, jit, ops, tiers, warmup

INSTALLED = os.environ.get("KERNGEN_EXPECT_INSTALLED") == "1"


def run(*args, tmp_path):
    e = {**os.environ, "KERNGEN_CACHE_DIR": str(tmp_path / "cache"), "PYTHONWARNINGS": "default"}
    return subprocess.run([sys.executable, *args], env=e, capture_output=True, text=True, cwd=tmp_path)


def test_the_shipped_table_and_templates_are_found_where_kerngen_is_imported_from():
    package = Path(kerngen.__file__).resolve().parent
    if INSTALLED:
        assert "site-packages" in package.parts, f"imported from {package}, not an installed copy"
        assert env.data_root() == package / "data"
    else:
        assert env.data_root() in (package.parent, package / "data")
    assert env.shipped_tiers().is_file() and (env.templates_dir() / "common" / "kerngen.cuh").is_file()


def test_every_rule_of_the_shipped_table_names_a_template_that_is_there():
    tbl = tiers.load()
    assert len(tbl.models) >= 10
    for rule in tbl.rules:
        stem = env.templates_dir() / rule.op.removesuffix("_tp") / rule.variant
        if rule.variant in ops.declared(rule.op).host:
            continue   # an all-reduce choice, or host code (latent_tail's unfused): no template of its own
        assert stem.with_suffix(".cu.j2").is_file() or stem.with_suffix(".py").is_file(), rule.source


def test_a_kernel_builds_from_the_installed_templates(tmp_path):
    from kerngen.cache import DiskCache
    tbl = tiers.load()
    spec = next(s for s in warmup.model_specs(tbl.model("mixtral-8x7b"), tbl, "sm_90a") if s.backend == "nvrtc")
    built = jit.build(spec, store=DiskCache(tmp_path / "cache"), strict=False)
    assert built.status == "compiled" and built.files["kernel.cubin"][:4] == b"\x7fELF"


@pytest.mark.parametrize("args", [
    ("-m", "kerngen", "tiers"),
    ("-m", "kerngen", "explain", "--op", "finalize", "--topk", "8", "--hidden", "4096", "--tokens", "8"),
    ("-c", "import kerngen, kerngen.integrations"),
])
def test_commands_print_no_warning(args, tmp_path):
    r = run(*args, tmp_path=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "Warning" not in r.stderr and "warning" not in r.stderr, r.stderr


def test_import_kerngen_loads_no_torch_and_its_ops_on_first_use(tmp_path):
    """The ops are imported on first access; torch.ops.kerngen.* are registered by `import kerngen` when torch
    is already imported, else with the first op."""
    code = ("import sys, kerngen\n"
            "assert 'torch' not in sys.modules and not set(kerngen.__all__) - set(dir(kerngen))\n"
            "from kerngen import route, PreRouting\n"
            "import torch\n"
            "assert kerngen.route is route and torch.ops.kerngen.route and kerngen.tiers.load()\n"
            "try:\n    kerngen.no_such_name\nexcept AttributeError as e:\n    print(e)\n")
    r = run("-c", code, tmp_path=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "module 'kerngen' has no attribute 'no_such_name'", r.stderr
    r = run("-c", "import torch, kerngen; print(torch.ops.kerngen.finalize.default)", tmp_path=tmp_path)
    assert r.returncode == 0 and "kerngen.finalize" in r.stdout, r.stderr


def test_the_namespace_holds_the_api_and_kerngens_own_modules_only():
    import types
    public = {n for n in dir(kerngen) if not n.startswith("_")}
    own = {n for n in public if isinstance(getattr(kerngen, n), types.ModuleType)
           and getattr(kerngen, n).__name__ == f"kerngen.{n}"}
    assert public - own == set(kerngen.__all__) - {"__version__"}, public - own - set(kerngen.__all__)
