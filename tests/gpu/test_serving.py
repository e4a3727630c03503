"""Serving safety on the GPU: strict mode on a cold cache, warmup, then preload with zero compiles."""
import pytest
import torch

import kerngen
from kerngen import warmup
from kerngen.plan import target_arch
from kerngen.tiers import load

pytestmark = pytest.mark.gpu


def test_strict_cold_cache_raises_then_warmup_then_preload(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNGEN_CACHE_DIR", str(tmp_path))
    user = tmp_path / "tiers.toml"
    user.write_text('schema = 1\n[models.strict-probe]\nnum_experts = 24\ntop_k = 3\nhidden = 1112\n'
                    'routing = "softmax_topk"\ntokens = [1, 64]\n')
    monkeypatch.setenv("KERNGEN_TIERS", str(user))
    g = torch.randn(24, 1112, device="cuda").to(torch.bfloat16)
    e2p = torch.randint(0, 24, (5, 3), device="cuda", dtype=torch.int32)
    w = torch.rand(5, 3, device="cuda")
    kerngen.strict(True)
    try:
        with pytest.raises(kerngen.CacheMissError, match="kerngen warmup --model strict-probe"):
            kerngen.finalize(g, e2p, w)
        tbl = load()
        specs = warmup.model_specs(tbl.model("strict-probe"), tbl, target_arch())
        assert {s.backend for s in specs} == {"nvrtc", "cute"}   # both backends' builds in the same workers
        assert warmup._cuda_initialized()   # so the pool's workers are spawned, not forked
        results = warmup.run(specs, str(tmp_path), jobs=2, progress=False)
        # a kernel whose worker failed is built again in this process (status compiled, a note): that is a failure
        # of the spawned workers all the same, which this test is here to see
        failed = [f"{r.spec.op} {dict(r.spec.params)}:\n{r.error or r.note}" for r in results
                  if r.status != "compiled" or r.note]
        assert not failed, "\n\n".join(failed)
        report = kerngen.preload("strict-probe")
        assert report["kernels"] == len(specs) and report["compiled"] == 0
        out = kerngen.finalize(g, e2p, w)
        assert torch.equal(out, kerngen.ops.finalize.reference(g, e2p, w))
    finally:
        kerngen.strict(None)
