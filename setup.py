"""Builds kerngen's wheel with the shipped tier table and templates inside the package, as kerngen/data/.

They stay at the top of the repository (tiers.toml, templates/), where a source checkout and an editable
install read them (kerngen.env.data_root). Everything else is declared in pyproject.toml.

`pip install -e .` installs a finder for the package `kerngen` alone, first on sys.meta_path: the repository's
other folders (tools, tests, templates) are not importable from elsewhere, and a folder named kerngen in the
working directory (the clone, seen from its parent) cannot shadow the package.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

ROOT = Path(__file__).resolve().parent
DATA_SUFFIXES = (".j2", ".cuh", ".py")   # CUDA C++ templates and headers, CuTe DSL template modules


def shipped_data() -> list[str]:
    """tiers.toml and every template file, relative to the repository root."""
    templates = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "templates").rglob("*")
                       if p.is_file() and p.name.endswith(DATA_SUFFIXES) and "__pycache__" not in p.parts)
    return ["tiers.toml", *templates]


class BuildPyWithData(build_py):
    """build_py, plus tiers.toml and templates/ copied to kerngen/data/ (not for an editable install, which
    reads the repository's own files)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for rel in shipped_data():
            target = Path(self.build_lib, "kerngen", "data", rel)
            self.mkpath(str(target.parent))
            self.copy_file(str(ROOT / rel), str(target))

    def get_outputs(self, include_bytecode=True):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):
            return outputs
        return outputs + [str(Path(self.build_lib, "kerngen", "data", rel)) for rel in shipped_data()]


FINDER = """\
import sys
from importlib.machinery import PathFinder

ROOT = {root!r}


class KerngenFinder:
    \"\"\"The package kerngen of the checkout at ROOT, before any path entry (an editable install).\"\"\"

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        return PathFinder.find_spec(fullname, [ROOT]) if fullname == "kerngen" else None


if KerngenFinder not in sys.meta_path:
    sys.meta_path.insert(0, KerngenFinder)
"""


class PackageFinder:
    """An editable wheel's content: the finder module and the .pth line that imports it at start-up."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def __call__(self, wheel, files, mapping):
        wheel.writestr("__editable___kerngen_finder.py", FINDER.format(root=str(ROOT)).encode())
        wheel.writestr("__editable__.kerngen.pth", b"import __editable___kerngen_finder\n")


class EditableWheel(editable_wheel):
    """`pip install -e .`: the package alone through PackageFinder, not the repository root on sys.path."""

    def _select_strategy(self, name, tag, build_lib):
        return PackageFinder()


setup(cmdclass={"build_py": BuildPyWithData, "editable_wheel": EditableWheel})
