"""Builds kerngen's wheel with the shipped tier table and templates inside the package, as kerngen/data/.

They stay at the top of the repository (tiers.toml, templates/), where a source checkout and an editable
install read them (kerngen.env.data_root). Everything else is declared in pyproject.toml. The package tree
itself is mapped 1:1 (no package-dir entry of its own), so `pip install -e .` is a plain path entry: a folder
named kerngen in the working directory (the clone, seen from its parent) cannot shadow it.
"""
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

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


setup(cmdclass={"build_py": BuildPyWithData})
