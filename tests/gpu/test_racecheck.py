"""compute-sanitizer's racecheck over the routing kernels (`tools.diagnose.sanitize_run --routing`): the
KERNGEN_RACECHECK builds report nothing; the shipped builds report only the named-barrier pattern racecheck misreads
(route_token's stores of a token's picks, one_token_layout's loads of them after a __syncthreads(), in
routing_fused; tools/diagnose/racecheck_named_barrier.cu reproduces it)."""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.gpu]
ROOT = Path(__file__).resolve().parents[2]


def racecheck(flag: str, tmp_path) -> str:
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        pytest.skip("compute-sanitizer is not on PATH")
    env = {**os.environ, "KERNGEN_RACECHECK": flag, "KERNGEN_CACHE_DIR": str(tmp_path)}
    r = subprocess.run([tool, "--tool", "racecheck", "--racecheck-report", "all", "--print-limit", "100",
                        sys.executable, "-m", "tools.diagnose.sanitize_run", "--routing"],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    out = r.stdout + r.stderr
    assert r.returncode == 0 and "sanitize_run --routing: all results correct" in out, out[-3000:]
    return out


def test_the_racecheck_builds_report_nothing(tmp_path):
    out = racecheck("1", tmp_path)
    assert "RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)" in out, out[-3000:]


def test_the_shipped_builds_report_only_the_known_pattern(tmp_path):
    out = racecheck("0", tmp_path)
    writes = re.findall(r"Write Thread \(\d+,0,0\) at (.+?)\+0x[0-9a-f]+ in routing_fused\.cu:(\d+)", out)
    reads = re.findall(r"Read Thread \(\d+,0,0\) at (\w+)\(.*?\)\+0x[0-9a-f]+ in routing_fused\.cu:(\d+)", out)
    hazards = re.findall(r"Potential (\w+) hazard detected at __shared__", out)
    assert hazards and set(hazards) == {"RAW"} and len(writes) == len(reads) == len(hazards), out[-3000:]
    # (the stores are named by the kernel, or by route_token where the tool reports the inlined frame)
    assert all(w == "routing_fused" or re.match(r"(void )?route_token\b", w) for w, _ in writes), writes[:3]
    assert {r for r, _ in reads} == {"one_token_layout"}
    # the stores of the token's picks in route_token, their loads in one_token_layout (a line or two each)
    assert len({line for _, line in writes}) <= 2 and len({line for _, line in reads}) <= 2
