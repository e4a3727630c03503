"""kerngen.occupancy: the CTAs an SM holds, worked by hand; every shipped persistent-grid rule asks for no more CTAs
an SM than its kernel's build holds; the launchers cap their grids at what fits; explain and warmup show it."""
import pytest

from kerngen import cli, env, jit, occupancy, resources, tiers, warmup
from kerngen.errors import InputError, KerngenError
from kerngen.occupancy import resident
from kerngen.ops import _common
from kerngen.ops import experts as ex
from kerngen.ops import latent_tail as lt
from kerngen.plan import spec_for

KIB = 1024


# ---------------------------------------------------------------------------------------------- the arithmetic

@pytest.mark.parametrize("regs, threads, smem, want, why", [
    (98, 256, 0, 2, "104 a thread: 3328 a warp, 4 warps a sub-partition, 16 warps: 2 CTAs of 8"),
    (54, 256, 0, 4, "56 a thread: 1792 a warp, 9 warps a sub-partition, 36 warps: 4 CTAs of 8"),
    (72, 256, 0, 3, "2304 a warp, 7 a sub-partition, 28 warps: 3 CTAs of 8"),
    (80, 128, 0, 6, "2560 a warp, 6 a sub-partition, 24 warps: 6 CTAs of 4"),
    (80, 32, 0, 24, "the register file is four sub-partitions: 24 one-warp CTAs, not 65536 // 2560 = 25"),
    (64, 1024, 0, 1, "a CTA of 32 warps at 64 registers fills the register file"),
    (65, 1024, 0, 0, "72 a thread: 32 warps would need 73728 registers"),
    (0, 1024, 0, 2, "no registers: 64 warp slots hold 2 CTAs of 32 warps"),
    (16, 96, 0, 21, "3 warps a CTA: 64 warp slots (2048 threads) hold 21"),
    (16, 32, 0, 32, "1 warp a CTA: 64 would fit the warp slots, 128 the registers; an SM holds 32 CTAs"),
    (16, 1025, 0, 0, "more than 1024 threads a CTA"),
    (32, 128, 100 * KIB, 2, "100 KiB + 1 KiB reserved a CTA: 2 in 228 KiB"),
    (32, 128, 48 * KIB, 4, "49 KiB a CTA: 4 in 228 KiB"),
    (32, 128, 56 * KIB, 4, "56 KiB + 1 KiB reserved: exactly 4 in 228 KiB"),
    (32, 128, 56 * KIB + 1, 3, "one byte more takes a 128-byte unit more: 3 in 228 KiB"),
    (32, 128, 227 * KIB, 1, "227 KiB, the most a CTA may use"),
    (32, 128, 227 * KIB + 1, 0, "past the most a CTA may use"),
    (72, 256, 57472 + 7488, 3, "latent_tail at 8 tokens: 64960 B + 1 KiB reserved, 3 in 228 KiB, 3 by registers"),
])
def test_resident_ctas_worked_by_hand(regs, threads, smem, want, why):
    assert resident("sm_90a", regs, threads, smem) == want, why


def test_sm_100a_holds_what_sm_90a_holds():
    for regs, threads, smem in ((98, 256, 0), (80, 32, 0), (32, 128, 100 * KIB), (64, 1024, 0)):
        assert resident("sm_100a", regs, threads, smem) == resident("sm_90a", regs, threads, smem)


def test_every_supported_target_has_limits():
    assert set(occupancy.LIMITS) == set(env.SUPPORTED)
    with pytest.raises(InputError, match="sm_80"):
        occupancy.limits("sm_80")


def test_a_usage_line_says_when_the_grid_is_capped_and_when_it_spills():
    capped = occupancy.Usage("experts_gemm1", 98, 2560, 0, 2, 4).line()
    assert "98 regs" in capped and "2 CTAs/SM fit, blocks_per_sm 4 (grid capped at 2)" in capped
    assert "capped" not in occupancy.Usage("experts_gemm2", 54, 0, 0, 4, 4).line()
    assert "SPILLS (16 B stack)" in occupancy.Usage("f", 255, 0, 16, None, None).line()
    assert "CTAs/SM" not in occupancy.Usage("routing_fused", 40, 0, 0, None, None).line()
    assert "7488 B shared + 57472 B dynamic" in occupancy.Usage("latent_tail_fused", 72, 7488, 0, 3, 2, 57472).line()


# ---------------------------------------------------------------------------------------------- the shipped rules

def persistent_specs():
    """Every experts and latent_tail kernel warmup builds for a shipped model at sm_90a, each once."""
    t = tiers.load()
    specs = {}
    for name, m in sorted(t.models.items()):
        specs.update(dict.fromkeys(warmup.model_specs(m, t, "sm_90a", ("experts", "latent_tail"))))
    return list(specs)


def _id(s):
    p = dict(s.params)
    return s.tag + (f"-{s.variant}" + (f"-max_tokens{p['max_tokens']}" if "max_tokens" in p else "")
                    if s.op == "latent_tail" else "")


@pytest.mark.parametrize("spec", persistent_specs(), ids=_id)
def test_no_shipped_rule_asks_for_more_ctas_than_an_sm_holds(spec, cache_dir):
    """The registers and shared memory are read from the build (what the template and the table say now)."""
    rows = warmup.usage(spec, jit.build(spec).files)
    launches = warmup.op_module(spec.op).persistent(spec)
    assert sorted(u.function for u in rows) == sorted(launches)
    over = [f"{spec.tag} {u.function}: REG {u.regs}, SHARED {u.shared} + {u.dynamic_smem} dynamic, "
            f"{u.resident} CTAs/SM fit < blocks_per_sm {u.per_sm}" for u in rows if u.per_sm > u.resident]
    assert not over, "\n".join(over)


# ---------------------------------------------------------------------------------------------- the launchers

class _Module:
    """A loaded module whose functions are their names (the occupancy query is stubbed by name)."""
    def function(self, name, device):
        return name


class _Launcher:
    def __init__(self, module, name, device, grid, block, params, smem=0, pdl=False):
        self.name, self.grid, self.block, self.smem = name, grid, block, smem


def _experts(**params):
    p = {"tile": 8, "warps": 8, "unroll": 2, "blocks_per_sm": 4, **params}
    tile = p.pop("tile")
    return spec_for(tiers.Rule("experts", "mma", {}, p), *ex.tag_constants(7168, 2048, tile, "silu"), "sm_90a")


def test_experts_grids_are_capped_at_what_each_kernel_fits(monkeypatch):
    """gemm1 fits 2 CTAs an SM, gemm2 8: at blocks_per_sm 4 on 132 SMs, 264 and 528 CTAs; asked once per kernel."""
    asked = []

    def fits(fn, threads, smem):
        asked.append((fn, threads, smem))
        return {"experts_gemm1": 2, "experts_gemm2": 8}[fn]

    monkeypatch.setattr(ex, "resolve", lambda spec: _Module())
    monkeypatch.setattr(ex, "Launcher", _Launcher)
    monkeypatch.setattr(_common, "resident", fits)
    monkeypatch.setattr(_common, "sm_count", lambda dev: 132)
    k = ex.Kernels(_experts(), 0)
    g1, g2 = k.launchers(1000)
    assert (g1.grid, g2.grid, g1.block) == ((2 * 132, 1, 1), (4 * 132, 1, 1), (256, 1, 1))
    assert k.launchers(1)[0].grid == (256, 1, 1)   # one work item a CTA: tiles * I / 8
    k.launchers(1000), k.launchers(3)
    assert sorted(asked) == [("experts_gemm1", 256, 0), ("experts_gemm2", 256, 0)]


def test_latent_tail_grid_is_capped_in_whole_clusters(monkeypatch):
    s = spec_for(tiers.Rule("latent_tail", "fused", {}, {"max_tokens": 8, "warps": 8, "unroll": 2, "cluster": 8,
                                                         "blocks_per_sm": 2}),
                 *lt.tag_constants(3584, 14336, 16, "float32"), "sm_90a")
    monkeypatch.setattr(lt, "resolve", lambda spec: _Module())
    monkeypatch.setattr(_common, "sm_count", lambda dev: 132)
    for fits, grid in ((3, 264), (2, 264), (1, 128)):   # 896 items; 132 CTAs in whole clusters of 8: 128
        monkeypatch.setattr(_common, "resident", lambda fn, threads, smem, n=fits: n)
        assert lt.launch_shape(s, 0) == ((grid, 1, 1), (256, 1, 1), 8 * 3592 * 2), fits
    monkeypatch.setattr(_common, "resident", lambda fn, threads, smem: 0)
    with pytest.raises(InputError, match="fits an SM"):
        lt.launch_shape(s, 0)


# ---------------------------------------------------------------------------------------------- explain, warmup

EXPERTS = ["--op", "experts", "--hidden", "2048", "--intermediate", "768", "--tokens", "1", "--arch", "sm_90a"]


def test_warmup_and_explain_show_registers_and_ctas_an_sm(cache_dir, capsys):
    assert cli.main(["explain", *EXPERTS]) == 0
    assert "registers and CTAs an SM show once built: kerngen warmup" in capsys.readouterr().out
    assert cli.main(["warmup", *EXPERTS, "--quiet", "--jobs", "1"]) == 0
    built = capsys.readouterr().out
    assert cli.main(["explain", *EXPERTS]) == 0
    explained = capsys.readouterr().out
    for fn in ("experts_gemm1", "experts_gemm2"):
        [w] = [line for line in built.splitlines() if line.strip().startswith(fn)]
        [e] = [line for line in explained.splitlines() if fn in line]
        assert " regs " in w and "CTAs/SM fit, blocks_per_sm 4" in w and e == f"kernel    {w.strip()}"


def test_without_cuobjdump_explain_and_warmup_say_so_in_one_line(cache_dir, capsys, monkeypatch):
    def missing():
        raise KerngenError("cuobjdump not found: install the CUDA toolkit or `pip install "
                                     "nvidia-cuda-cuobjdump`")

    monkeypatch.setattr(resources, "cuobjdump", missing)
    assert cli.main(["warmup", *EXPERTS, "--quiet", "--jobs", "1"]) == 0
    out = capsys.readouterr().out
    assert out.count("cuobjdump not found") == 1 and "regs" not in out
    assert cli.main(["explain", *EXPERTS]) == 0
    out = capsys.readouterr().out
    assert "kernels   registers and CTAs an SM not shown: cuobjdump not found" in out and "regs" not in out


def test_mma_loop_finds_the_innermost_tensor_core_loop_and_its_local_memory():
    """kerngen.resources.mma_loop on SASS text: the shortest backward branch's body holding an HMMA (an outer loop
    and a loop without one ignored), LOCAL where it holds an LDL / STL; None without such a loop; a missing function
    is a KerngenError."""
    import kerngen

    def fn(name, lines):
        return f"\t\tFunction : {name}\n" + "".join(f"        /*{16 * i:04x}*/                   {x} ;\n"
                                                   for i, x in enumerate(lines))
    body = ["MOV R1, c[0x0][0x28]", "IADD3 R2, R2, 0x1, RZ", "HMMA.16816.F32 R4, R8, R12, R4", "LDG.E R8, [R2.64]",
            "@P0 BRA 0x10", "LDL R3, [R1]", "@P1 BRA 0x0", "IADD3 R5, R5, 0x1, RZ", "@P2 BRA 0x70", "EXIT"]
    spilled = body[:3] + ["STL [R1], R3"] + body[4:]
    text = "\n\tcode for sm_90a\n" + fn("k1", body) + fn("k2", spilled) + fn("k3", ["BRA 0x0", "EXIT"])
    assert resources.mma_loop(text, "k1") == (4, False)   # 0x10 .. the first BRA
    assert resources.mma_loop(text, "k2") == (4, True)
    assert resources.mma_loop(text, "k3") is None
    with pytest.raises(kerngen.KerngenError, match="no function"):
        resources.mma_loop(text, "k4")
