"""The kerngen command line, end to end in a temporary cache, with no GPU."""
import subprocess
import sys

import pytest


def kerngen(*args, cache, check=True):
    import os
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
    assert "removed 1 entries" in kerngen("cache", "clear", cache=tmp_path).stdout
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


def test_warmup_that_stores_nothing_says_so_and_fails(tmp_path):
    (tmp_path / "f").write_text("a file where the cache directory should be")
    r = kerngen("warmup", "--op", "finalize", "--topk", "8", "--hidden", "1024", "--arch", "sm_90a,sm_100a",
                "--quiet", cache=tmp_path / "f", check=False)
    assert r.returncode == 1 and "2 compiled (0 stored)" in r.stdout
    assert "2 of 2 compiled kernels could not be stored" in r.stderr and "Traceback" not in r.stderr


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
