"""kerngen's imports run one way: the op registry (kerngen.ops' declarations) → tiers → plan → render → compile →
trust → cache_entry → cache → jit → launch/dispatch → ops → warmup/tune/cli. Every import in the package, lazy ones
inside functions too, is read from the source: none reaches a module of a later tier, and the graph has no cycle.
(The modules the backend table names, tiers.BACKENDS' compiler and loader, are imported by name from jit and
launch: compile and cute_backend, launch; all below those. The op modules the registry names are imported by
name from kerngen.ops.op_module and torch_ops.)"""
import ast
from pathlib import Path

import kerngen

ROOT = Path(kerngen.__file__).parent
TIERS = [
    ("errors", "env"),
    ("ops",),                                    # the op registry: declarations only (the op modules: "ops.")
    ("tiers",),
    ("plan",),
    ("render",),
    ("compile", "cute_backend", "resources", "occupancy"),
    ("trust",),                                  # who may have written a cache: the policy cache applies
    ("cache_entry",),                            # an entry's files: read, checked, written, removed
    ("cache",),
    ("jit",),
    ("launch", "timing", "dispatch"),
    ("ops.",),                                   # ops may import each other (no cycle; permute below routing)
    ("adapters", "torch_ops"),
    ("warmup", "tune", "cli", "__main__", "__init__", "integrations."),
]


def tier(module: str) -> int:
    for i, names in enumerate(TIERS):
        if any(module in (n, n.rstrip(".")) or (n.endswith(".") and module.startswith(n)) for n in names):
            return i
    raise AssertionError(f"kerngen.{module} has no tier in tests/test_import_graph.py: add it where it belongs")


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" and len(rel.parts) > 1 else rel.parts
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known) -> set[str]:
    """The kerngen modules `name` imports anywhere in its source."""
    package = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    if name == "__init__":
        package = []
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names if a.name == "kerngen" or a.name.startswith("kerngen.")]
            targets = [t[len("kerngen."):] if t != "kerngen" else "__init__" for t in targets]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
            elif node.module and (node.module == "kerngen" or node.module.startswith("kerngen.")):
                base = []
            else:
                continue
            mod = ".".join(base + (node.module.split(".") if node.module else []))
            mod = mod[len("kerngen."):] if mod.startswith("kerngen.") else ("" if mod == "kerngen" else mod)
            targets = [f"{mod}.{a.name}".lstrip(".") for a in node.names if f"{mod}.{a.name}".lstrip(".") in known]
            if mod in known or not targets:
                targets.append(mod or "__init__")
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def graph() -> dict[str, set[str]]:
    known = modules()
    known_names = set(known) | {"__init__"}
    return {name: imports(name, path, known_names) for name, path in known.items()}


def test_no_module_imports_a_later_tier():
    upward = [f"kerngen.{m} (tier {tier(m)}) imports kerngen.{t} (tier {tier(t)})"
              for m, targets in graph().items() for t in targets if tier(t) > tier(m)]
    assert not upward, "\n".join(upward)


def test_the_import_graph_has_no_cycle():
    g, state, cycles = graph(), {}, []

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(g.get(m, ())):
            if state.get(t) == "open":
                cycles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "\n".join(cycles)


def test_permute_does_not_import_routing():
    assert "ops.routing" not in graph()["ops.permute"]


def test_the_graph_sees_lazy_imports():
    """A guard on the test itself: the lazy `from .ops import ...` inside functions are found."""
    g = graph()
    assert "ops.finalize" in g["tune"] and "launch" in g["warmup"] and "ops.permute" in g["ops.routing"]


def test_every_kerngen_name_the_tests_and_tools_use_exists():
    """The GPU tests and the tools run only where a GPU is: a kerngen attribute they name (`module.name` on an
    imported kerngen module, or `from kerngen.x import name`) that a change removed is found here, on the CPU."""
    import importlib
    repo = ROOT.parent
    missing = []
    for path in sorted([*repo.glob("tests/**/*.py"), *repo.glob("tools/**/*.py")]):
        tree = ast.parse(path.read_text())
        names = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update((a.asname or a.name, a.name) for a in node.names
                             if a.name.startswith("kerngen") and (a.asname or "." not in a.name))
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("kerngen"):
                module = importlib.import_module(node.module)
                for a in node.names:
                    if a.name == "*":
                        continue
                    if not hasattr(module, a.name):
                        try:
                            importlib.import_module(f"{node.module}.{a.name}")
                        except ImportError:
                            missing.append(f"{path.relative_to(repo)}:{node.lineno}: {node.module}.{a.name}")
                            continue
                    sub = getattr(module, a.name, None)
                    if sub is None or type(sub).__name__ == "module":
                        names[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names:
                module = importlib.import_module(names[node.value.id])
                if not hasattr(module, node.attr):
                    missing.append(f"{path.relative_to(repo)}:{node.lineno}: {names[node.value.id]}.{node.attr}")
    assert not missing, "names that no longer exist:\n" + "\n".join(missing)
