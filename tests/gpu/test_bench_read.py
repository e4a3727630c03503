"""The benches' "read" columns on the GPU: tools.bench.experts and tools.bench.latent_tail time, beside kerngen, a
kernel that only reads the bytes their floor counts, after the same producer; one small case each runs end to end
and reports a read time between the floor's and a few times kerngen's."""
import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.usefixtures("gpu_cache")]


def test_experts_bench_reads_the_floors_bytes(tmp_path, capsys):
    from tools.bench import experts
    out = tmp_path / "rows.json"
    assert experts.main(["--models", "qwen3-30b-a3b", "--tokens", "1,8", "--layers", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())   # (a list of rows)
    assert {r["T"] for r in rows} == {1, 8}
    for r in rows:
        assert 0.5 * r["floor_us"] < r["read_us"] < 4 * r["us"], r
    printed = capsys.readouterr().out
    assert " read " in printed and "% of read)" in printed


def test_latent_tail_bench_reads_up_projs_bytes(tmp_path):
    from tools.bench import latent_tail
    out = tmp_path / "rows.json"
    assert latent_tail.main(["--tokens", "1", "--layers", "2", "--json", str(out)]) == 0
    (r,) = json.loads(out.read_text())["rows"]
    assert 0.5 * r["floor_us"] < r["read_us"] < 4 * r["kerngen_us"], r
