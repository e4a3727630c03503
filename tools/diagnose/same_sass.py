#!/usr/bin/env python3
"""Same SASS before and after: every kernel the shipped models need, built from a git revision and from the
working tree, compared instruction by instruction. No GPU needed.

    python3 -m tools.diagnose.same_sass                                  # HEAD against the working tree, every shipped model
    python3 -m tools.diagnose.same_sass --rev abc1234 --models kimi-k3,deepseek-v3
    python3 -m tools.diagnose.same_sass --rev HEAD~1 --to HEAD --ops routing --allow routing-fused-E896

The kernels of a side are what `kerngen.warmup.model_specs` lists for each model of that side's tiers.toml
(`[models.*]`, no user tiers file): CUDA C++ and CuTe DSL alike (a CuTe object file embeds its cubin). Each side
builds in a subprocess that imports kerngen from its own tree (REV is `git archive`d once into the cache root),
with 2 compile processes, into the tool's own kernel cache (never the user's), kept for the next run. That cache
is content-addressed (the key hashes source, spec and toolchain) and there is one per version of the files that
compile outside what the key hashes (BUILD_FILES: the NVRTC flags), so a kernel both sides render alike compiles
once and both sides take that cubin: nothing to compare. The cubins that differ are disassembled here
(`cuobjdump -sass`) and compared per kernel function, opcodes and operands only: address comments and encodings
are dropped, and so is the key's hash inside CuTe function names. NVRTC 13.5 does not always give the same SASS
for the same source (the large routing kernels come out in two or three register/schedule variants, one build in
five or so), so a kernel that differs is built --repeat more times on each side, and it is the same when the two
sides share a variant.

Kernels are matched by KernelSpec.to_json() (the readable part of the key alone repeats: one model can use the same
variant with several launch parameter sets); a kernel whose spec changed pairs with the one left on the other side
under the same readable key. Exit status 1 when a kernel differs, exists on one side only, or fails to build,
unless an --allow substring of its readable key or spec JSON names it.
"""
from __future__ import annotations

import argparse
import difflib
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from importlib import import_module
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the working tree this tool belongs to
NORMALIZE_VERSION = 1                        # bump when normalize() changes: cached SASS is stored normalized
# files of a tree that turn a rendered source into an artifact outside what the cache key hashes (NVRTC flags)
BUILD_FILES = ("kerngen/compile.py", "kerngen/cute_backend.py", "kerngen/jit.py")
BRANCHES = ("BRA", "BRX", "BSSY", "CALL", "JMP", "JMX", "BREAK", "RET")   # operands that are code addresses


def default_cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kerngen-same-sass"


# ------------------------------------------------------------------------------------------------ SASS text
def normalize(sass: str, digest: str = "") -> dict[str, list[str]]:
    """`cuobjdump -sass` text -> {function: [instruction, ...]}: no address comments, no encodings, single spaces,
    and the key's hash (a CuTe function name holds it) replaced by <hash>."""
    functions: dict[str, list[str]] = {}
    body: list[str] | None = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            name = m.group(1).replace(digest, "<hash>") if digest else m.group(1)
            body = functions.setdefault(name, [])
            continue
        text = re.sub(r"/\*[^*]*\*/", "", line).strip()
        if body is None or not text or not re.match(r"(@!?U?P\w+\s+)?[A-Z]", text):
            continue   # headers (.headerflags, code for sm_90a), dot rows, encoding-only lines
        body.append(" ".join(text.split()))
    return functions


def _opcode(ins: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split(" ", 1)[0]


def _masked(ins: str) -> str:
    """The instruction with its code-address operand hidden: an insertion moves every branch target after it."""
    if _opcode(ins).split(".")[0] in BRANCHES:
        return re.sub(r"0x[0-9a-f]+(\s*;?)$", r"<addr>\1", ins)
    return ins


@dataclass
class Verdict:
    same: bool
    before: int                      # instructions, every function
    after: int
    lines: list[str] = field(default_factory=list)   # what differs, short


def compare(before: dict[str, list[str]], after: dict[str, list[str]], context: int = 6) -> Verdict:
    """Compare two normalized SASS texts (normalize()) function by function."""
    nb, na = sum(map(len, before.values())), sum(map(len, after.values()))
    if before == after:
        return Verdict(True, nb, na)
    lines = []
    for name in sorted(set(before) - set(after)):
        lines.append(f"{name[:100]}: only before ({len(before[name])} instructions)")
    for name in sorted(set(after) - set(before)):
        lines.append(f"{name[:100]}: only after ({len(after[name])} instructions)")
    for name in sorted(set(before) & set(after)):
        a, b = before[name], after[name]
        if a == b:
            continue
        ops = Counter(map(_opcode, b))
        ops.subtract(Counter(map(_opcode, a)))
        delta = ", ".join(f"{n:+d} {op}" for op, n in sorted(ops.items(), key=lambda kv: (-abs(kv[1]), kv[0]))
                          if n)[:240]
        ma, mb = [_masked(i) for i in a], [_masked(i) for i in b]
        where = "only branch targets" if ma == mb else (f"opcodes {delta}" if delta else "same opcode counts")
        lines.append(f"{name[:100]}: {len(a)} -> {len(b)} instructions; {where}")
        shown = 0
        for d in difflib.unified_diff(ma, mb, n=1, lineterm=""):
            if d.startswith(("---", "+++")):
                continue
            if d.startswith("@@"):
                d = "@@ instruction " + d.split()[1].lstrip("-").split(",")[0] + " @@"
            lines.append("    " + d)
            shown += 1
            if shown >= context:
                break
    return Verdict(False, nb, na, lines)


# ------------------------------------------------------------------------------------------------ the sides
def extract(rev: str, root: Path) -> tuple[Path, str]:
    """A tree of `rev` (git archive, extracted once under root/trees) and its commit."""
    r = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                       capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"same_sass: {rev!r} is not a commit of {ROOT}")
    sha = r.stdout.strip()
    tree = root / "trees" / sha
    if not (tree / ".complete").exists():
        tree.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{sha[:12]}-", dir=tree.parent))
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", sha], capture_output=True,
                                 check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        (tmp / ".complete").write_text(sha + "\n")
        try:
            os.replace(tmp, tree)
        except OSError:   # another run extracted it meanwhile
            subprocess.run(["rm", "-rf", str(tmp)], check=False)
    return tree, sha


def _build_digest(tree: Path) -> str:
    h = hashlib.sha256()
    for name in BUILD_FILES:
        p = tree / name
        h.update(name.encode() + b"\0" + (p.read_bytes() if p.exists() else b"") + b"\0")
    return h.hexdigest()[:12]


@dataclass
class Kernel:
    json: str                    # KernelSpec.to_json() of its tree
    key: str                     # cache key
    models: list[str]
    status: str                  # compiled | cached | failed
    error: str = ""
    blobs: dict[str, str] = field(default_factory=dict)   # artifact file -> sha256 of its bytes (root/blobs)

    @property
    def readable(self) -> str:
        return self.key.rsplit("-", 1)[0] if self.key else _readable_of_json(self.json)

    @property
    def digest(self) -> str:
        return self.key.rsplit("-", 1)[1] if self.key else ""

    @property
    def artifact(self) -> str:
        return hashlib.sha256(json.dumps(sorted(self.blobs.items())).encode()).hexdigest()


def _readable_of_json(text: str) -> str:
    d = json.loads(text)
    return f"{d['op']}-{d['variant']}-{d['tag']}-{d['arch']}"


def build_side(tree: Path, cache: Path, root: Path, models: str, arch: str, jobs: int, label: str,
               rebuild: list[str] | None = None, repeat: int = 0, ops: str = "all") -> list[Kernel]:
    """Build every kernel of `models` from `tree` in a subprocess that imports that tree's kerngen; or, with
    `rebuild` (spec JSONs), build those `repeat` more times each, every time into a fresh cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("KERNGEN_TIERS", "KERNGEN_STRICT", "PYTHONPATH")}
    env.update(PYTHONPATH=str(tree), KERNGEN_CACHE_DIR=str(cache), PYTHONDONTWRITEBYTECODE="1")
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = Path(f.name)
    try:
        t0 = time.perf_counter()
        args = {"tree": str(tree), "root": str(root), "models": models, "ops": ops, "arch": arch, "jobs": jobs,
                "out": str(out), "rebuild": rebuild or [], "repeat": repeat}
        # one working directory for every tree: a cubin's line info records it, so unchanged kernels stay
        # byte-identical and need no disassembly
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--side", json.dumps(args)], cwd=root,
                           env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"same_sass: building {label} ({tree}) failed:\n{r.stderr[-4000:]}")
        kernels = [Kernel(**k) for k in json.loads(out.read_text())]
    finally:
        out.unlink(missing_ok=True)
    n = Counter(k.status for k in kernels)
    what = (f"{len(rebuild)} kernels rebuilt {repeat} times" if rebuild else
            f"{len(kernels)} kernels ({n['compiled']} compiled, {n['cached']} cached, {n['failed']} failed)")
    print(f"{label}: {what} from {tree} in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return kernels


def _side_main(args: dict) -> None:
    """In the subprocess: build with the tree's own kerngen, store each artifact's files as blobs."""
    tree = Path(args["tree"]).resolve()
    sys.path.insert(0, str(tree))
    # an editable install maps `kerngen` to its checkout ahead of sys.path (a meta path finder): not here
    sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
    import kerngen
    from kerngen import cache as cache_mod
    from kerngen import tiers, warmup
    from kerngen.plan import KernelSpec
    if not Path(kerngen.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"kerngen imported from {kerngen.__file__}, not from {tree}")
    blobs = Path(args["root"]) / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    out = []

    def collect(results, cache_dir, used, status=None):
        store = cache_mod.DiskCache(cache_dir)
        for r in results:
            k = {"json": r.spec.to_json(), "key": r.key, "models": used.get(r.spec, []), "status": status or r.status,
                 "error": r.error, "blobs": {}}
            files = store.get(r.key) if r.status != "failed" else None
            if r.status != "failed" and files is None:
                k.update(status="failed", error="built, then not found in the cache")
            for name, data in sorted((files or {}).items()):
                sha = hashlib.sha256(data).hexdigest()
                if not (blobs / sha).exists():
                    tmp = blobs / f".{sha}.{os.getpid()}"
                    tmp.write_bytes(data)
                    os.replace(tmp, blobs / sha)
                k["blobs"][name] = sha
            out.append(k)

    if args["rebuild"]:
        specs = [KernelSpec.from_json(j) for j in args["rebuild"]]
        for _ in range(args["repeat"]):
            with tempfile.TemporaryDirectory(prefix="same-sass-") as tmp:
                collect(warmup.run(specs, tmp, args["jobs"], progress=False), tmp, {}, "rebuilt")
    else:
        tbl = tiers.load()
        names = sorted(tbl.models) if args["models"] == "all" else args["models"].split(",")
        specs, used = [], {}
        for name in names:
            if name not in tbl.models:
                print(f"same_sass: no model {name} in {tree}/tiers.toml", file=sys.stderr)
                continue
            ops = import_module("kerngen.ops").OPS if args["ops"] == "all" else tuple(args["ops"].split(","))
            for s in warmup.model_specs(tbl.model(name), tbl, args["arch"], ops):
                if s not in used:
                    specs.append(s)
                    used[s] = []
                if name not in used[s]:
                    used[s].append(name)
        cache_dir = os.environ["KERNGEN_CACHE_DIR"]
        collect(warmup.run(specs, cache_dir, args["jobs"], progress=False), cache_dir, used)
    Path(args["out"]).write_text(json.dumps(out))


def _sass_path(root: Path, artifact: str) -> Path:
    return root / "sass" / f"{artifact}.v{NORMALIZE_VERSION}.json.gz"


def _disassemble(root: str, blobs: dict[str, str], artifact: str) -> None:
    sys.path.insert(0, str(ROOT))
    from kerngen import resources
    files = {name: (Path(root) / "blobs" / sha).read_bytes() for name, sha in blobs.items()}
    path = _sass_path(Path(root), artifact)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(gzip.compress(json.dumps(normalize(resources.sass(files))).encode()))
    os.replace(tmp, path)


def sass_of(k: Kernel, root: Path) -> dict[str, list[str]]:
    """The normalized SASS of a built kernel (disassembled earlier by disassemble_all), its hash masked."""
    raw = json.loads(gzip.decompress(_sass_path(root, k.artifact).read_bytes()))
    if not k.digest:
        return raw
    return {name.replace(k.digest, "<hash>"): body for name, body in raw.items()}


def disassemble_all(kernels: list[Kernel], root: Path, jobs: int) -> None:
    todo = {k.artifact: k.blobs for k in kernels if k.blobs and k.status != "failed"
            and not _sass_path(root, k.artifact).exists()}
    if not todo:
        return
    t0 = time.perf_counter()
    if jobs <= 1:
        for artifact, blobs in todo.items():
            _disassemble(str(root), blobs, artifact)
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            for f in [pool.submit(_disassemble, str(root), blobs, a) for a, blobs in todo.items()]:
                f.result()
    print(f"disassembled {len(todo)} artifacts in {time.perf_counter() - t0:.0f}s", file=sys.stderr)


# ------------------------------------------------------------------------------------------------ comparing
@dataclass
class Row:
    name: str                     # readable key and launch parameters
    status: str                   # same | differs | only before | only after | failed
    verdict: Verdict | None
    before: Kernel | None
    after: Kernel | None

    def matches(self, pattern: str) -> bool:
        return any(pattern in text for k in (self.before, self.after) if k for text in (k.readable, k.json))


def _name(k: Kernel) -> str:
    params = json.loads(k.json).get("params", {})
    return k.readable + (" {" + ",".join(f"{a}={b}" for a, b in sorted(params.items())) + "}" if params else "")


def pair(before: list[Kernel], after: list[Kernel]) -> list[tuple[Kernel | None, Kernel | None]]:
    """Match by spec JSON; what is left pairs by readable key where that key is left once on each side."""
    by_json = {k.json: k for k in after}
    pairs, left_b = [], []
    for k in before:
        if k.json in by_json:
            pairs.append((k, by_json.pop(k.json)))
        else:
            left_b.append(k)
    left_a = list(by_json.values())
    count_b, count_a = Counter(k.readable for k in left_b), Counter(k.readable for k in left_a)
    by_readable = {k.readable: k for k in left_a if count_a[k.readable] == 1}
    for k in left_b:
        m = by_readable.pop(k.readable, None) if count_b[k.readable] == 1 else None
        pairs.append((k, m))
        if m is not None:
            left_a.remove(m)
    pairs += [(None, k) for k in left_a]
    return pairs


def _signature(k: Kernel, root: Path) -> str:
    return hashlib.sha256(json.dumps(sass_of(k, root), sort_keys=True).encode()).hexdigest()


def compare_kernels(before: list[Kernel], after: list[Kernel], root: Path, jobs: int = 2,
                    more_b: dict[str, list[Kernel]] | None = None,
                    more_a: dict[str, list[Kernel]] | None = None) -> list[Row]:
    """Rows for the kernels of two sides; identical artifacts need no disassembly. more_b / more_a: rebuilt copies
    by spec JSON; a kernel whose builds on the two sides share one SASS variant is the same."""
    more_b, more_a = more_b or {}, more_a or {}
    pairs = pair(before, after)
    disassemble_all([k for b, a in pairs if b and a and b.artifact != a.artifact
                     for k in (b, a, *more_b.get(b.json, ()), *more_a.get(a.json, ()))], root, jobs)
    rows = []
    for b, a in pairs:
        name = _name(a or b)
        if b is None or a is None:
            rows.append(Row(name, "only after" if b is None else "only before", None, b, a))
        elif b.status == "failed" or a.status == "failed":
            rows.append(Row(name, "failed", None, b, a))
        elif b.artifact == a.artifact:
            rows.append(Row(name, "same", Verdict(True, -1, -1), b, a))
        else:
            v = compare(sass_of(b, root), sass_of(a, root))
            builds_b = [b] + [k for k in more_b.get(b.json, []) if k.status != "failed"]
            builds_a = [a] + [k for k in more_a.get(a.json, []) if k.status != "failed"]
            if not v.same and len(builds_b) + len(builds_a) > 2:
                sig_b = Counter(_signature(k, root) for k in builds_b)
                sig_a = Counter(_signature(k, root) for k in builds_a)
                note = (f"the compiler gave {len(sig_b)} SASS variant(s) in {len(builds_b)} builds before, "
                        f"{len(sig_a)} in {len(builds_a)} after")
                if set(sig_b) & set(sig_a):
                    v = Verdict(True, v.before, v.after, [note + ", one shared: same up to that"])
                else:
                    v.lines.insert(0, note + ", none shared")
            rows.append(Row(name, "same" if v.same else "differs", v, b, a))
    return rows


def compare_trees(tree_b: Path, tree_a: Path, *, models: str = "all", ops: str = "all", arch: str = "sm_90a",
                  jobs: int = 2, root: Path | None = None, labels=("before", "after"), repeat: int = 4) -> list[Row]:
    """Build both trees' kernels and compare them; a kernel that differs is built `repeat` more times on each
    side (NVRTC does not always give the same SASS for the same source: the large routing kernels vary)."""
    root = Path(root or default_cache_root())
    sides, caches = [], []
    for tree, label in ((tree_b, labels[0]), (tree_a, labels[1])):
        caches.append(root / "kernels" / f"build-{_build_digest(tree)}")
        sides.append(build_side(tree, caches[-1], root, models, arch, jobs, label, ops=ops))
    rows = compare_kernels(sides[0], sides[1], root, jobs)
    differ = [r for r in rows if r.status == "differs"]
    if not repeat or not differ:
        return rows
    more = []
    for i, (tree, label) in enumerate(((tree_b, labels[0]), (tree_a, labels[1]))):
        specs = [(r.before if i == 0 else r.after).json for r in differ]
        found: dict[str, list[Kernel]] = {}
        for k in build_side(tree, caches[i], root, models, arch, jobs, label, rebuild=specs, repeat=repeat):
            found.setdefault(k.json, []).append(k)
        more.append(found)
    return compare_kernels(sides[0], sides[1], root, jobs, *more)


def report(rows: list[Row], allow: list[str], out=sys.stdout) -> int:
    """Print one line per kernel (and the differences); the exit status: 1 if anything not allowed is not same."""
    bad = 0
    for r in sorted(rows, key=lambda r: (r.status == "same", r.name)):
        allowed = r.status != "same" and any(r.matches(p) for p in allow)
        tag = r.status + (" (allowed)" if allowed else "")
        models = ",".join((r.after or r.before).models)
        size = ""
        if r.verdict:
            size = ("  identical artifact" if r.verdict.before < 0 else f"  {r.verdict.before} instructions"
                    if r.verdict.same else f"  {r.verdict.before} -> {r.verdict.after} instructions")
        print(f"{tag:<18} {r.name}{size}  [{models}]", file=out)
        if r.verdict:
            for line in r.verdict.lines:
                print(f"{'':<21}{line}", file=out)
        for k in (r.before, r.after):
            if k and k.status == "failed":
                print(f"{'':<21}{k.error[:400]}", file=out)
        bad += r.status != "same" and not allowed
    n = Counter(r.status for r in rows)
    print(f"\n{len(rows)} kernels: " + ", ".join(f"{c} {s}" for s, c in sorted(n.items())) +
          (f"; {bad} not allowed" if bad else ""), file=out)
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default="HEAD", help="the revision built as 'before' (default HEAD)")
    ap.add_argument("--to", default=None, help="a revision built as 'after' instead of the working tree")
    ap.add_argument("--models", default="all", help="all, or comma-separated model names of tiers.toml")
    ap.add_argument("--ops", default="all", help="all, or comma-separated ops of kerngen.ops.OPS (routing "
                                                 "covers the permutation)")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--allow", action="append", default=[], metavar="SUBSTRING",
                    help="a kernel whose readable key or spec JSON holds this may differ (repeatable)")
    ap.add_argument("--jobs", type=int, default=2, help="compile / disassembly processes per side (default 2)")
    ap.add_argument("--repeat", type=int, default=4,
                    help="builds more of each kernel that differs, per side, to tell the compiler's own variation "
                         "from a change (default 4; 0: none)")
    ap.add_argument("--cache-root", type=Path, default=None,
                    help=f"trees, kernel caches and SASS kept between runs (default {default_cache_root()})")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.side:
        _side_main(json.loads(a.side))
        return 0
    root = a.cache_root or default_cache_root()
    tree_b, sha_b = extract(a.rev, root)
    if a.to:
        tree_a, sha_a = extract(a.to, root)
        labels = (f"before {a.rev} ({sha_b[:10]})", f"after {a.to} ({sha_a[:10]})")
    else:
        tree_a, labels = ROOT, (f"before {a.rev} ({sha_b[:10]})", "after: working tree")
    rows = compare_trees(tree_b, tree_a, models=a.models, ops=a.ops, arch=a.arch, jobs=a.jobs, root=root,
                         labels=labels, repeat=a.repeat)
    print(f"{labels[0]} -> {labels[1]}, models {a.models}, {a.arch}")
    return report(rows, a.allow)


if __name__ == "__main__":
    sys.exit(main())
