"""`pip install -e .` as the README's set-up command does it, into a fresh environment: kerngen then imports
from any directory, the clone's parent too (where a folder named kerngen, the clone itself, sits in the
working directory and must not shadow the package as an empty namespace), and only kerngen: the repository's
tools, tests and templates are not importable from elsewhere."""
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = shutil.ignore_patterns(".git", "cache", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                              ".cute", ".whl")


def test_an_editable_install_imports_the_package_from_the_clones_parent(tmp_path):
    if not (ROOT / "pyproject.toml").is_file():
        import pytest
        pytest.skip("no pyproject.toml beside the tests (an installed copy)")
    clone = tmp_path / "kerngen"   # as `git clone .../kerngen` names it
    shutil.copytree(ROOT, clone, ignore=SKIP)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                        "--disable-pip-version-check", "-e", str(clone)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # kerngen's dependencies (torch, ...) from this interpreter's environment, without its own kerngen: a
    # path listed in a .pth file is searched, but the .pth files inside it are not run
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "zz_outer.pth").write_text("\n".join([*site.getsitepackages(), site.getusersitepackages()]) + "\n")
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # only what the install put on the path
    probe = ("import importlib.util\nimport kerngen\nfrom kerngen import env\n"
             "print(kerngen.__file__)\nprint(env.data_root())\nprint(callable(kerngen.route))\n"
             "print([n for n in ('tools', 'tests', 'templates') if importlib.util.find_spec(n)])\n")
    r = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True, text=True, env=clean)
    assert r.returncode == 0, r.stderr
    # the package alone: the repository's other folders are not top-level packages of the environment
    assert r.stdout.split() == [str(clone / "kerngen" / "__init__.py"), str(clone), "True", "[]"], r.stdout
