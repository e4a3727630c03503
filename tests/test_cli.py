"""The kerngen command line, end to end in a temporary cache, with no GPU."""
import os
import subprocess
import sys
import time

import pytest


def kerngen(*args, cache, check=True):
    env = {**os.environ, "KERNGEN_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "kerngen", *args], env=env, capture_output=True, text=True,
                          check=check)


def test_warmup_compiles_then_rerun_compiles_nothing(tmp_path):
    first = kerngen("warmup", "--model", "kimi-k3", "--arch", "sm_90a", "--jobs", "2", cache=tmp_path).stdout
    assert "0 failed" in first and " 0 compiled" not in first and str(tmp_path) in first
    second = kerngen("warmup", "--model", "kimi-k3", "--arch", "sm_90a", cache=tmp_path).stdout
    assert " 0 compiled" in second and "0 failed" in second
    ls = kerngen("cache", "ls", cache=tmp_path).stdout
    assert "finalize-small_batch-H3584-K16-bf16-wf32-sm_90a-" in ls
    assert "0 bad" in kerngen("cache", "verify", cache=tmp_path).stdout
    assert (tmp_path / "CACHEDIR.TAG").is_file()   # the first lock marked the directory as kerngen's


def test_explain_names_tier_variant_key_and_cache_state(tmp_path):
    out = kerngen("explain", "--op", "finalize", "--topk", "16", "--hidden", "3584", "--tokens", "1024",
                  cache=tmp_path).stdout
    assert "large_batch" in out and "tiers.toml [[tier]]" in out and "cached    no" in out
    assert "key       finalize-large_batch-H3584-K16-bf16-wf32-sm_90a-" in out


@pytest.mark.parametrize("args", [("--model", "qwen3-30b-a3b", "--tokens", "256"),
                                  ("--model", "deepseek-v3", "--tokens", "64"),
                                  ("--hidden", "2048", "--intermediate", "768", "--tokens", "256"),
                                  ("--hidden", "2048", "--intermediate", "768", "--experts", "128", "--topk", "8",
                                   "--tokens", "256")])
def test_explain_names_the_experts_rule_whose_kernel_it_prints(tmp_path, args):
    """The tier line is the rule the printed params come from: the weight format a model ships (deepseek-v3: fp8),
    and the rules keyed on num_experts / top_k only where both are known."""
    from kerngen import tiers
    out = kerngen("explain", "--op", "experts", *args, cache=tmp_path).stdout
    source = next(line.split(None, 1)[1] for line in out.splitlines() if line.startswith("tier "))
    rule = next(r for r in tiers.load().rules if r.source == source)
    params = {k: v for k, v in rule.params.items() if k not in ("tile", "backend", "transposed")}   # (nk weights)
    assert f"params    {dict(sorted(params.items()))}" in out
    assert f"-t{rule.params['tile']}-" in out


@pytest.mark.parametrize("fmt", ["bf16", "fp8", "w8a8", "mxfp4"])
def test_explain_takes_the_experts_weight_format(tmp_path, fmt):
    """--experts-format picks the rules of that format (w8a8: fp8 weights with fp8 activations) for a shape given on
    the command line or over a model's own format, and names the kernel the model's warmup builds (the same key);
    a shape the format's weights cannot have is the experts op's own error."""
    from kerngen import jit, tiers, warmup
    tbl = tiers.load()
    args = ("explain", "--op", "experts", "--model", "deepseek-v3", "--tokens", "8", "--experts-format", fmt)
    out = kerngen(*args, cache=tmp_path).stdout
    source = next(line.split(None, 1)[1] for line in out.splitlines() if line.startswith("tier "))
    rule = next(r for r in tbl.rules if r.source == source)
    assert rule.formats == ("w8a8",) if fmt == "w8a8" else fmt in (rule.formats or ("bf16",))
    assert ("'A8': 1" in out) == (fmt == "w8a8") and f"'FORMAT': '{'fp8' if fmt == 'w8a8' else fmt}'" in out
    key = next(line.split()[1] for line in out.splitlines() if line.startswith("key "))
    if fmt != "mxfp4":   # deepseek-v3's warmup builds its fp8 and w8a8 kernels and bf16 ones
        assert key in {jit.key_of(s) for s in warmup.model_specs(tbl.model("deepseek-v3"), tbl, "sm_90a")}
    odd = kerngen("explain", "--op", "experts", "--hidden", "2880", "--intermediate", "2880", "--experts-format",
                  fmt, cache=tmp_path, check=False)
    if fmt in ("fp8", "w8a8"):
        assert odd.returncode != 0 and "multiples of 128" in odd.stderr and "Traceback" not in odd.stderr
    else:
        assert odd.returncode == 0, odd.stderr


def test_top_k_is_spelled_either_way(tmp_path):
    """--top-k (the name of the top_k argument everywhere else) is --topk's other spelling: the same kernel."""
    args = ("explain", "--op", "finalize", "--hidden", "3584", "--tokens", "8")
    one = kerngen(*args, "--topk", "16", cache=tmp_path).stdout
    two = kerngen(*args, "--top-k", "16", cache=tmp_path).stdout
    assert one == two and "K16" in one


def test_unknown_model_is_a_clean_error(tmp_path):
    r = kerngen("warmup", "--model", "nope", cache=tmp_path, check=False)
    assert r.returncode == 2 and "unknown model 'nope'" in r.stderr and "Traceback" not in r.stderr


def test_tiers_lists_models(tmp_path):
    out = kerngen("tiers", cache=tmp_path).stdout
    assert "deepseek-v3" in out and "grouped_sigmoid_bias" in out


def test_verify_and_clear_touch_only_kerngen_entries(tmp_path):
    from kerngen.cache import DiskCache
    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "a.jpg").write_bytes(b"\xff\xd8")
    (tmp_path / "notes.txt").write_text("mine")
    bad = tmp_path / "finalize-small_batch-H64-K2-bf16-wf32-sm_90a-000000000000"
    bad.mkdir()   # key-shaped and incomplete, but nothing says the directory is kerngen's
    r = kerngen("cache", "verify", cache=tmp_path, check=False)
    assert r.returncode == 1 and "0 ok, 1 bad, 0 removed" in r.stdout and "has no CACHEDIR.TAG marker" in r.stdout
    r = kerngen("cache", "clear", cache=tmp_path, check=False)
    assert r.returncode == 2 and "no CACHEDIR.TAG marker" in r.stderr and "Traceback" not in r.stderr
    assert bad.is_dir()
    DiskCache(tmp_path)._prepare_root()   # as the first lock or entry marks it
    assert "0 ok, 1 bad, 1 removed" in kerngen("cache", "verify", cache=tmp_path, check=False).stdout
    assert not bad.exists()
    bad.mkdir()
    assert "removed 1 entry from" in kerngen("cache", "clear", cache=tmp_path).stdout
    assert (tmp_path / "photos" / "a.jpg").read_bytes() == b"\xff\xd8" and (tmp_path / "notes.txt").is_file()
    assert not bad.exists() and (tmp_path / "CACHEDIR.TAG").is_file()


def test_a_variant_that_is_a_path_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "somewhere").mkdir()
    ran = tmp_path / "ran"
    (tmp_path / "somewhere" / "evil.py").write_text(f"open({str(ran)!r}, 'w').write('x')\n")
    rel = "../" * 12 + str(tmp_path / "somewhere" / "evil").lstrip("/")
    user = tmp_path / "evil.toml"
    user.write_text(f'schema = 1\n[[tier]]\nop = "finalize"\nvariant = "{rel}"\nparams = {{ backend = "cute" }}\n')
    cache = tmp_path / "cache"
    for args in (("tiers", "--tiers", str(user)), ("warmup", "--model", "kimi-k3", "--ops", "finalize", "--tiers",
                                                    str(user))):
        r = kerngen(*args, cache=cache, check=False)
        assert r.returncode == 2 and "field 'variant' must be the name of a variant of finalize" in r.stderr
        assert str(user) in r.stderr and "[[tier]] #1" in r.stderr and "Traceback" not in r.stderr
    assert not ran.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["evil.toml", "somewhere"]


def test_a_directory_as_tiers_file_is_a_clean_error(tmp_path):
    r = kerngen("tiers", "--tiers", str(tmp_path), cache=tmp_path / "cache", check=False)
    assert r.returncode == 2 and "is a directory" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, needle", [
    (("warmup", "--op", "finalize", "--topk", "8", "--hidden", "3583"), "argument '--hidden' must be a multiple of 8"),
    (("warmup", "--op", "finalize", "--topk", "8", "--hidden", "0"), "argument '--hidden' must be a multiple of 8"),
    (("warmup", "--op", "tail", "--topk", "40", "--hidden", "1024"), "argument '--topk' must be an integer in [1, 32]"),
    (("explain", "--op", "finalize", "--topk", "0", "--hidden", "1024"),
     "argument '--topk' must be an integer in [1, 64], got 0"),
    (("explain", "--op", "routing", "--topk", "8", "--experts", "4"), "argument '--experts' must be an integer in"),
    (("explain", "--op", "routing", "--topk", "8"), "argument '--experts' must be given (or --model NAME"),
    (("explain", "--op", "permute", "--topk", "8", "--tokens", "4"), "argument '--experts' must be given"),
    (("explain", "--op", "finalize", "--topk", "8"), "argument '--hidden' must be given (or --model NAME), got none"),
    (("warmup", "--op", "tail", "--topk", "8"), "argument '--hidden' must be given"),
    (("explain", "--op", "experts", "--hidden", "1024"), "argument '--intermediate' must be given"),
    (("warmup", "--op", "finalize", "--topk", "8", "--hidden", "1024", "--arch", "banana"),
     "argument '--arch' must be an exact GPU target"),
    (("warmup", "--model", "kimi-k3", "--ops", "routing,foo"), "argument '--ops' must be a comma separated subset"),
    (("warmup", "--spec", "{not json"), "argument 'JSON' must be the object a strict-mode miss prints"),
    (("warmup", "--model", "kimi-k3", "--jobs", "-1"), "argument --jobs: must be an integer >= 0"),
    (("explain", "--op", "finalize", "--topk", "8", "--hidden", "1024", "--tokens", "0"),
     "argument --tokens: must be an integer >= 1"),
])
def test_bad_flags_are_clean_errors_that_name_them(tmp_path, args, needle):
    r = kerngen(*args, cache=tmp_path / "c", check=False)
    assert r.returncode == 2 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert "key " not in r.stdout and not (tmp_path / "c").exists()


def test_warmup_that_stores_nothing_says_so_before_compiling_and_fails(tmp_path):
    root = f"/proc/kerngen-{tmp_path.name}/cache"   # a directory that cannot be made, even by root
    r = subprocess.run([sys.executable, "-m", "kerngen", "warmup", "--op", "finalize", "--topk", "8", "--hidden",
                        "1024", "--arch", "sm_90a,sm_100a", "--quiet"], env={**os.environ, "KERNGEN_CACHE_DIR": root},
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = r.stdout
    assert r.returncode == 1 and "2 compiled (0 stored)" in out and "Traceback" not in out, out
    assert out.index(f"cache directory {root} cannot be written") < out.index("  compiled  finalize-")
    assert "2 of 2 compiled kernels could not be stored" in out


@pytest.mark.parametrize("args", [("warmup", "--model", "kimi-k3", "--quiet"), ("cache", "ls"), ("cache", "verify")])
def test_a_cache_dir_that_is_a_file_or_below_one_is_one_message(tmp_path, args):
    (tmp_path / "f").write_text("a file where a directory should be")
    roots = (tmp_path / "f", tmp_path / "f" / "cache")
    results = [kerngen(*args, cache=root, check=False) for root in roots]
    said = [r.stderr.replace(f"cache directory {root} ", "cache directory ROOT ") for r, root in zip(results, roots)]
    assert said[0] == said[1] and f"{tmp_path / 'f'} is not a directory" in said[0], said
    expected = 2 if args[0] == "warmup" else 1
    assert [r.returncode for r in results] == [expected, expected] and "Traceback" not in said[0]
    assert "compiled" not in results[0].stdout + results[1].stdout   # refused before compiling anything


def test_strict_mode_command_for_a_user_model_names_its_tiers_file(tmp_path, monkeypatch):
    from kerngen import tiers, warmup
    user = tmp_path / "mine.toml"
    user.write_text('schema = 1\n[models.tiny]\nnum_experts = 16\ntop_k = 2\nhidden = 256\n'
                    'routing = "softmax_topk"\ntokens = [1, 64]\n')
    monkeypatch.setenv("KERNGEN_TIERS", str(user))
    tbl = tiers.load()
    spec = warmup.model_specs(tbl.model("tiny"), tbl, "sm_90a")[0]
    assert warmup.warmup_command(spec) == f"kerngen warmup --model tiny --arch sm_90a --tiers {user}"
    # jit words the miss through the command kerngen/__init__.py hands it (jit never imports warmup)
    import kerngen
    from kerngen.cache import DiskCache
    from kerngen.jit import build
    with pytest.raises(kerngen.CacheMissError, match="kerngen warmup --model tiny --arch sm_90a"):
        build(spec, store=DiskCache(tmp_path / "cache"), strict=True)


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90", "sm_120a"])
def test_an_arch_kerngen_cannot_build_is_refused_up_front(tmp_path, arch, monkeypatch, capsys):
    r = kerngen("warmup", "--model", "kimi-k3", "--arch", f"sm_90a,{arch}", cache=tmp_path / "c", check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr and not (tmp_path / "c").exists(), r.stderr
    assert (f"argument '--arch' must be a target kerngen builds for: sm_90a (H100, H200), sm_100a (B200, GB200), "
            f"got '{arch}'") in r.stderr and r.stdout == ""
    if arch == "sm_90":
        assert "did you mean sm_90a?" in r.stderr
    from kerngen import cli
    monkeypatch.setenv("KERNGEN_CACHE_DIR", str(tmp_path / "c"))
    t0 = time.perf_counter()
    assert cli.main(["warmup", "--model", "kimi-k3", "--arch", arch]) == 2   # what the command does after imports
    assert time.perf_counter() - t0 < 2 and not (tmp_path / "c").exists()
    assert "sm_90a (H100, H200), sm_100a (B200, GB200)" in capsys.readouterr().err


def test_an_unsupported_arch_is_refused_in_under_two_seconds_without_torch(tmp_path):
    """The whole command, interpreter start and imports included: the CLI reaches its argument checks without
    importing torch (about 2 s on its own on a 2-core CPU box); locally it takes about 0.4 s, so the bound
    leaves room for a loaded machine."""
    t0 = time.perf_counter()
    r = kerngen("warmup", "--model", "kimi-k3", "--arch", "sm_80", cache=tmp_path / "c", check=False)
    seconds = time.perf_counter() - t0
    assert r.returncode == 2 and "sm_90a (H100, H200), sm_100a (B200, GB200)" in r.stderr, r.stderr
    assert seconds < 2, f"{seconds:.2f}s"
    assert not (tmp_path / "c").exists()
    probe = ("import runpy, sys; sys.argv = ['kerngen', 'warmup', '--model', 'kimi-k3', '--arch', 'sm_80']\n"
             "try:\n    runpy.run_module('kerngen', run_name='__main__')\n"
             "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       env={**os.environ, "KERNGEN_CACHE_DIR": str(tmp_path / "c")})
    assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr


def test_an_unsupported_kerngen_arch_is_refused_naming_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNGEN_ARCH", "sm_89")
    for args in (("warmup", "--model", "kimi-k3"), ("explain", "--op", "finalize", "--topk", "8", "--hidden", "1024")):
        r = kerngen(*args, cache=tmp_path / "c", check=False)
        assert r.returncode == 2 and "environment variable KERNGEN_ARCH='sm_89'" in r.stderr, r.stderr
        assert "sm_90a (H100, H200), sm_100a (B200, GB200)" in r.stderr and not (tmp_path / "c").exists()


def test_version_and_bare_kerngen_print_what_it_is(tmp_path):
    from kerngen import __version__
    assert kerngen("--version", cache=tmp_path).stdout.strip() == f"kerngen {__version__}"
    r = kerngen(cache=tmp_path, check=False)
    assert r.returncode == 0 and "usage: kerngen" in r.stdout and "warmup" in r.stdout and "explain" in r.stdout


def test_a_closed_pipe_ends_quietly(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "kerngen", "tiers"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "KERNGEN_CACHE_DIR": str(tmp_path)})
    p.stdout.close()   # as `kerngen tiers | head` leaves it once head has read its lines
    err = p.stderr.read().decode()
    assert p.wait() == 141 and err == "", err


def test_every_flag_has_help():
    import argparse

    from kerngen import cli
    commands = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    missing = [f"{name} {' '.join(a.option_strings) or a.dest}" for name, p in commands.items() for a in p._actions
               if not a.help]
    assert not missing
    text = commands["explain"].format_help()
    for words in ("number of routed experts", "experts per token", "hidden size", "token count"):
        assert words in text


def test_one_kernel_is_singular_and_same_named_keys_say_what_differs(tmp_path):
    out = kerngen("warmup", "--op", "finalize", "--topk", "8", "--hidden", "1024", "--quiet", cache=tmp_path).stdout
    assert "kerngen warmup 1 kernel [sm_90a]: 1 kernel, 1 compiled" in out and "kernel(s)" not in out
    out = kerngen("warmup", "--model", "mixtral-8x7b", "--ops", "finalize", "--quiet", cache=tmp_path).stdout
    lines = [line.split() for line in out.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    shown = {}
    for fields in lines:
        name = fields[1].rsplit("-", 1)[0]   # the key without its hash
        shown.setdefault(name, []).append(" ".join(f for f in fields[2:] if not f.startswith("(")))
    repeated = {name: labels for name, labels in shown.items() if len(labels) > 1}
    assert repeated, out   # the shipped table has same-shape finalize kernels with other params
    for labels in repeated.values():
        assert len(set(labels)) == len(labels) and all(label.startswith("[") for label in labels), out


def test_a_misspelt_model_gets_the_closest_names(tmp_path):
    for args in (("warmup", "--model", "kimi-k"), ("explain", "--model", "mixtral-8x7", "--tokens", "8")):
        r = kerngen(*args, cache=tmp_path / "c", check=False)
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert f"unknown model '{args[2]}' (did you mean '" in r.stderr and "known models:" in r.stderr, r.stderr


def test_explain_a_model_without_op_explains_each_of_its_ops(tmp_path):
    from kerngen import ops as kerngen_ops, warmup
    out = kerngen("explain", "--model", "kimi-k3", "--tokens", "8", cache=tmp_path).stdout
    ops = [line.split()[1] for line in out.splitlines() if line.startswith("op ")]
    assert ops == list(dict.fromkeys(("routing", "permute", *kerngen_ops.OPS))), out
    explained = [op for op in ops if getattr(warmup.op_module(op), "explain_spec", None)]
    assert out.count("key       ") == len(explained) >= 3, out


def test_explain_a_model_names_its_own_warmup_and_skips_the_ops_it_has_no_kernel_of(tmp_path):
    """qwen3-30b-a3b shares its routing kernel with qwen3-235b-a22b: the build command is its own warmup; it is no
    latent MoE, so latent_tail is named as unused, not explained at a made-up shape."""
    out = kerngen("explain", "--model", "qwen3-30b-a3b", "--tokens", "1", cache=tmp_path).stdout
    hints = [line for line in out.splitlines() if line.startswith("kernels ")]
    assert hints and all("kerngen warmup --model qwen3-30b-a3b " in line for line in hints), out
    assert "not used  qwen3-30b-a3b has no latent_tail kernel" in out and "latent_tail-" not in out, out


@pytest.mark.parametrize("op, shape", [("permute", ("--experts", "64", "--topk", "8")),
                                       ("experts", ("--hidden", "2048", "--intermediate", "768"))])
def test_explain_knows_the_ops_warmup_builds(tmp_path, op, shape):
    from kerngen import warmup
    r = kerngen("explain", "--op", op, *shape, "--tokens", "4", cache=tmp_path, check=False)
    if getattr(warmup.op_module(op), "explain_spec", None) is None:
        assert r.returncode == 2 and f"kerngen.ops.{op} cannot name one shape's kernel yet" in r.stderr
        pytest.skip(f"kerngen.ops.{op} has no explain_spec")
    assert r.returncode == 0 and f"op        {op}" in r.stdout and f"key       {op}-" in r.stdout, r.stderr


def test_cache_ls_checks_checksums_and_verify_says_it_removed_what_it_did(tmp_path):
    from kerngen import jit
    from kerngen.cache import DiskCache
    from kerngen.ops import finalize as fin
    good, bad = (jit.build(fin.spec(1024, k, "bfloat16", "float32", 1, "sm_90a"), store=DiskCache(tmp_path)).key
                 for k in (4, 8))
    cubin = tmp_path / bad / "kernel.cubin"
    cubin.write_bytes(cubin.read_bytes()[:-1] + bytes([cubin.read_bytes()[-1] ^ 1]))   # one bit changed
    ls = kerngen("cache", "ls", cache=tmp_path).stdout
    assert f"{good}  ok" in ls and f"{bad}  corrupt (checksum mismatch in kernel.cubin)" in ls, ls
    assert cubin.is_file()   # ls reads only
    r = kerngen("cache", "verify", cache=tmp_path, check=False)
    assert r.returncode == 1 and f"{bad}  corrupt  (removed)" in r.stdout and "1 ok, 1 bad, 1 removed" in r.stdout
    assert "rebuilding" not in r.stderr and "removed" in r.stderr and not (tmp_path / bad).exists()
