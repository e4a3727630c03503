"""The README and docs/ as a newcomer reads them: every Python example runs (CPU ones here, the ones marked
"# needs a CUDA GPU" on a GPU), the "Adding a model" snippet is a valid user tiers file, every `kerngen`
command in a shell example parses, the set-up commands are the ones CI runs, and every link to a file
resolves."""
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GPU = "# needs a CUDA GPU"

if not README.is_file():
    pytest.skip("no README beside the tests (an installed copy)", allow_module_level=True)


def blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^ *```{lang}\n(.*?)^ *```$", path.read_text(), re.S | re.M)


def documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def examples(gpu: bool):
    return [pytest.param(code, id=f"{path.name}-{i}") for path in documents()
            for i, code in enumerate(blocks(path, "python")) if code.startswith(GPU) == gpu]


def run(code: str) -> None:
    if "transformers" in code:
        pytest.importorskip("transformers")
    exec(compile(code, "example", "exec"), {"__name__": "readme_example"})


@pytest.mark.parametrize("code", examples(gpu=False))
def test_a_cpu_example_runs(code):
    run(code)


@pytest.mark.gpu
@pytest.mark.parametrize("code", examples(gpu=True))
def test_a_gpu_example_runs(code, gpu_cache):
    run(code)


def test_the_quick_start_is_short_and_runs_on_the_cpu():
    text = README.read_text()
    quick = text[text.index("## Quick start"):text.index("\n## ", text.index("## Quick start") + 3)]
    assert len(quick.splitlines()) <= 60
    assert re.search(r"about \d+ minutes on \d+ CPU cores", " ".join(quick.split())), "how long the tests take"
    code = blocks(README, "python")[0]
    assert code in quick and not code.startswith(GPU) and "cuda" not in code


def test_the_adding_a_model_snippet_is_a_user_tiers_file(tmp_path, monkeypatch):
    from kerngen import tiers
    (snippet,) = blocks(README, "toml")
    user = tmp_path / "my.toml"
    user.write_text(snippet)
    name = re.search(r"^\[models\.([\w.-]+)\]", snippet, re.M).group(1)
    assert name in tiers.load(user).models                    # --tiers my.toml
    monkeypatch.setenv("KERNGEN_TIERS", str(user))
    assert tiers.load().models[name].num_experts > 0          # KERNGEN_TIERS=my.toml
    assert str(user) in tiers.load().files


def commands() -> list[str]:
    out = []
    for path in documents():
        for code in blocks(path, "bash"):
            for line in code.splitlines():
                line = line.split(" #", 1)[0].strip()
                for part in line.split("&&"):
                    words = shlex.split(part.strip())
                    while words and "=" in words[0]:   # VAR=value prefixes
                        words.pop(0)
                    if words[:1] == ["sudo"]:
                        words = words[1:]
                        while words and "=" in words[0]:
                            words.pop(0)
                    if words[:1] == ["kerngen"]:
                        out.append(" ".join(words))
    return out


def test_every_kerngen_command_in_a_shell_example_parses():
    from kerngen import cli
    found = commands()
    assert any(c.startswith("kerngen warmup") for c in found)
    for c in found:
        cli.parser().parse_args(shlex.split(c)[1:])   # SystemExit (argparse's error) fails the test


def test_the_setup_commands_are_the_ones_ci_runs():
    setup = blocks(README, "bash")[0].strip().splitlines()
    ci = (ROOT / ".ci" / "run").read_text().replace("pip install -q ", "pip install ")   # CI's is quiet
    assert len(setup) == 2 and all(line in ci for line in setup), setup


def test_every_link_to_a_file_resolves():
    for path in documents():
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", path.read_text()):
            assert (path.parent / target).exists(), f"{path.name} links to {target}"


def test_the_command_line_table_names_every_op_explain_takes():
    from kerngen import cli
    listed = re.search(r"OP is one of ([\w, ]+) \(", README.read_text()).group(1)
    assert listed.split(", ") == list(cli.shape_ops()), listed


def test_what_python_m_build_writes_is_ignored_by_git():
    import shutil
    import subprocess
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    for path in ("dist/kerngen-0.1.0-py3-none-any.whl", "dist/kerngen-0.1.0.tar.gz"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path
