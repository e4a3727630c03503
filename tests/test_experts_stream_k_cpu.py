"""kerngen.experts' stream_k (bf16 builds, and f16x builds with act_f16 = false; no GPU): where splitting them saves
load batches in a row beyond its fixups' cost (stream_k_fix), each GEMM's items x K steps split evenly over the
grid, an item split between CTAs added in CTA order by the last of them; elsewhere the items in turn. The schedule's
arithmetic (as the kernels compute it) picks that way, covers every step once and names each split item's chunks and
slots; the builds of every shipped fp8 / MXFP4 model's 1-2-token rule and of the bf16 1-token rule at every shipped
shape compile within the CTAs an SM their rule asks for, without spills (fp8 aside) and with a K-step loop at most
8% longer than without stream_k; the shipped rules' sources do not change; the host sizes grids, counters and slots;
rules that cannot take it are refused; kerngen.resources.mma_loop, which finds the K-step loop in the SASS. The GPU
tests (tests/gpu/test_experts_quantized.py, tests/gpu/test_experts.py) check the bits."""
import pytest
import torch

from kerngen import jit, render, resources, tiers
from kerngen.cache import DiskCache
from kerngen.errors import TierError
from kerngen.ops import experts as ex
from tests.helpers import assert_no_spills
from tests.test_experts_fused_x_cpu import one_token_rules


def schedule(items: int, steps: int, grid: int, batch: int = 4, fix: int = 2):
    """The kernels' stream-K arithmetic (templates/experts/mma.cu.j2: sk_chunk, the item loops, sk_next, sk_gather) in
    Python, `batch` = WARPS x UNROLL steps loaded at once, `fix` = SK_FIX: the chunk length, per CTA its (chunk, item,
    lo, hi) pieces, per item the chunks sk_gather adds and the slot it reads of each."""
    U, rounds = items * steps, -(-items // grid)
    even = -(-U // grid)
    L = even if (-(-even // batch) + fix) * 10 < rounds * -(-steps // batch) * 9 else steps
    pieces = {}
    for c in range(grid):
        x = c * L
        while x < U:
            item = x // steps
            lo = x - item * steps
            hi = min(min(steps, lo + L - x % L), U - item * steps)
            k = (item * steps + hi - 1) // L   # sk_gather's chunk and lo, recomputed
            assert lo == max(k * L - item * steps, 0) and k % grid == c
            pieces.setdefault(c, []).append((k, item, lo, hi))
            y = item * steps + hi
            x = y if y % L else y + (grid - 1) * L
    gather = {}
    for item in range(items):
        first = item * steps
        c0, c1 = first // L, (first + steps - 1) // L
        gather[item] = [(c, 0 if c * L > first else 1) for c in range(c0, c1 + 1)]
    return L, pieces, gather


CASES = [  # items, steps, grid, batch, fix, split: gpt-oss-120b MXFP4 at T = 1 (1440 / 720 items at 1056 CTAs,
    # 4 warps, one step a batch), kimi-k3 (4096 / 3584), qwen3-30b-a3b bf16 (768 at 528, 8 warps x 2), deepseek-v3
    (1440, 23, 1056, 4, 2, True), (720, 23, 1056, 4, 2, False), (720, 23, 1056, 4, 0, True),
    (4096, 28, 1056, 4, 2, False), (3584, 16, 1056, 4, 2, False), (768, 32, 528, 16, 2, False),
    (768, 32, 528, 16, 0, True), (2048, 112, 528, 16, 0, False), (5, 23, 1056, 4, 2, True), (1440, 23, 132, 4, 0, False),
    (7, 3, 5, 1, 0, True), (1, 23, 4, 1, 0, True), (13, 1, 6, 1, 0, False), (20, 3, 5, 1, 0, False)]


@pytest.mark.parametrize("items,steps,grid,batch,fix,split", CASES)
def test_the_schedule_covers_every_step_once_and_names_each_split_items_slots(items, steps, grid, batch, fix, split):
    """Split evenly (one chunk a CTA) where that takes under 90% of the load batches in a row that whole items take,
    `fix` batches counted for the fixup, else the items in turn: every step once, each split item's chunks in order
    with the slots they wrote, a CTA's longest chain of steps the even share or the rounds of whole items."""
    L, pieces, gather = schedule(items, steps, grid, batch, fix)
    rounds = -(-items // grid)
    assert L == (-(-items * steps // grid) if split else steps)
    seen = {}
    for c, ps in pieces.items():
        slots = []
        for k, item, lo, hi in ps:
            assert 0 <= lo < hi <= steps
            for s in range(lo, hi):
                assert (item, s) not in seen
                seen[item, s] = k
            if (lo, hi) != (0, steps):   # a partial piece: the slot its chunk writes
                slots.append((k, 0 if lo > 0 else 1))
        assert len(slots) == len(set(slots))   # each slot written once
    assert len(seen) == items * steps
    for item in range(items):
        owners = sorted({seen[item, s] for s in range(steps)})
        assert [c for c, _ in gather[item]] == owners   # the chunks the last one adds, in chunk order
        if len(owners) > 1:   # each a partial piece, in the slot it wrote
            assert split
            for k, slot in gather[item]:
                (lo, hi), = [(lo, hi) for c in pieces for kk, it, lo, hi in pieces[c] if kk == k and it == item]
                assert (lo, hi) != (0, steps) and slot == (0 if lo > 0 else 1)
    chain = max(sum(hi - lo for _, _, lo, hi in ps) for ps in pieces.values())
    assert chain == (-(-items * steps // grid) if split else min(rounds, items) * steps)


def stream_k_specs(stream_k=True):
    """The 1-2-token rule of every shipped MXFP4 model (and fp8 ones at act_f16 = false), and the 1-token bf16 rule
    at every shipped model's shape, with stream_k (or without)."""
    out, sk = [], {"stream_k": True} if stream_k else {}
    for m, rule in one_token_rules():
        p = {**rule.params, "fused_x": 2, "act_f16": False, **sk}
        out.append(ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 2)}, p), m.hidden, m.intermediate,
                                m.activation, "sm_90a", m.experts_format))
    t = tiers.load()
    for m in sorted(t.models.values(), key=lambda m: m.name):
        if m.intermediate:
            rule = t.rule("experts", {"hidden": m.hidden, "tokens": 1, "arch": "sm_90a"})
            out.append(ex.rule_spec(tiers.Rule("experts", "mma", {}, {**rule.params, **sk}), m.hidden, m.intermediate,
                                    m.activation, "sm_90a"))
    return list(dict.fromkeys(out))


def step_loop(sass: str, function: str) -> int:
    """The instructions of `function`'s K-step loop, which touches no local memory."""
    n, local = resources.mma_loop(sass, function)
    assert not local, f"local memory in {function}'s K steps"
    return n


@pytest.mark.parametrize("spec", stream_k_specs(), ids=lambda s: s.tag)
def test_builds_compile_within_the_rules_bound_without_spills(spec, tmp_path):
    built = jit.build(spec, store=DiskCache(tmp_path))
    if dict(spec.constants)["FORMAT"] != "fp8":   # (fp8's rule at fused_x spills without stream_k too)
        assert_no_spills(built.files)
    p = dict(spec.params)   # the CTAs an SM the rule asks for still fit
    bound = 65536 // (32 * p["warps"] * max(p.get("min_blocks", 1), p.get("blocks_per_sm", 4)))
    usage = dict(resources.usage(built.files))
    assert all(usage[k]["REG"] <= bound for k in ("experts_gemm1", "experts_gemm2"))
    src = render.render(spec)
    assert "sk_gather<STEPS>" in src and "int* skc;" in src
    plain = next(s for s in stream_k_specs(stream_k=False) if s.tag == spec.tag)
    sass, plain_sass = resources.sass(built.files), resources.sass(jit.build(plain, store=DiskCache(tmp_path)).files)
    for f in ("experts_gemm1", "experts_gemm2"):   # the K steps: at most 8% more instructions than without it
        assert step_loop(sass, f) <= step_loop(plain_sass, f) * 1.08, f


def test_the_shipped_rules_do_not_take_it_and_their_source_has_none_of_it():
    t = tiers.load()
    for m in t.models.values():
        if not m.intermediate:
            continue
        for T in (1, 2, 8, 64):
            s = ex.spec(m.hidden, m.intermediate, None, m.activation, T, "sm_90a", t, m.experts_format or "bf16")
            if s is None:
                continue
            assert not dict(s.params).get("stream_k")
            src = render.render(s)
            assert "sk_gather" not in src and "skc" not in src


@pytest.mark.parametrize("over,layout", [(dict(f16x=False), "nk"), (dict(act_f16=True), "nk"),
                                         (dict(pingpong=True), "nk"), (dict(mtiles=2), "nk"),
                                         (dict(stage_act=True, act_f16=True), "nk"), ({}, "kn")])
def test_rules_that_cannot_take_it_are_refused(over, layout):
    p = {**dict(tile=8, warps=4, unroll=1, f16x=True, act_f16=False, stream_k=True), **over}
    with pytest.raises(TierError, match="stream_k"):
        ex.rule_spec(tiers.Rule("experts", "mma", {"tokens": (1, 2)}, p), 2880, 2880, "gpt_oss", "sm_90a",
                     "mxfp4", layout)


def test_the_host_sizes_grids_counters_and_slots(monkeypatch):
    """Grids: the persistent CTAs, at most the items' steps; fields: the struct with skc and sks; the counters zero,
    one an item of the larger GEMM, slots 2 x CTAs x 32 lanes x 4 NB floats; kept per stream, grown with the tiles;
    a caller's scratch gets buffers of the call's own."""
    monkeypatch.setenv("KERNGEN_EAGER_GRAPHS", "0")
    launched = []

    class Stub:
        def __init__(self, module, name, device, grid, block, params, smem=0, pdl=False):
            self.name, self.grid, self.params = name, grid, params

        def __call__(self, stream, *values):
            assert len(values) == len(self.params.names)
            launched.append((self.name, self.grid, dict(zip(self.params.names, values))))

    monkeypatch.setattr(ex, "resolve", lambda s: s)
    monkeypatch.setattr(ex, "Launcher", Stub)
    monkeypatch.setattr(ex._common, "persistent_ctas", lambda op, mod, name, dev, launch: 1056)
    stream = [0]
    monkeypatch.setattr(ex, "current_stream", lambda dev: stream[0])
    spec = next(s for s in stream_k_specs() if dict(s.constants)["H"] == 2880 and dict(s.params).get("f16x"))
    k = ex.Kernels(spec, 0)
    assert k.stream_k and ex.params_struct(spec) is ex.PARAMS_SK
    E, H, I = 128, 2880, 2880
    w13 = torch.zeros(E, 2 * I, H // 32, 16, dtype=torch.uint8)
    w2 = torch.zeros(E, H, I // 32, 16, dtype=torch.uint8)
    s13, s2 = torch.zeros(E, 2 * I, H // 32, dtype=torch.uint8), torch.zeros(E, H, I // 32, dtype=torch.uint8)

    def call(tiles, scratch=None):
        from types import SimpleNamespace
        r = SimpleNamespace(permuted_to_token=torch.zeros(tiles * 8, dtype=torch.int32),
                            tile_to_expert=torch.zeros(tiles, dtype=torch.int32),
                            num_permuted_rows=torch.zeros(1, dtype=torch.int32))
        x = torch.zeros(1, H, dtype=torch.bfloat16)
        out = torch.empty(tiles * 8, H, dtype=torch.bfloat16)
        launched.clear()
        k.run(x, r, w13, w2, out, None, None, None, True, 1.702, 7.0, s13, s2, 1, tiles, E, scratch)
        return {name: (grid, f) for name, grid, f in launched}

    got = call(4)
    assert set(got) == {"experts_gemm1", "experts_gemm2"}
    assert got["experts_gemm1"][0][0] == 1056 and got["experts_gemm2"][0][0] == 1056   # 1440 / 720 items x 23 steps
    (cnt, slots), ptrs = k._sk[0]
    assert got["experts_gemm1"][1]["skc"] == ptrs[0] == cnt.data_ptr() and got["experts_gemm2"][1]["sks"] == ptrs[1]
    assert cnt.dtype == torch.int32 and cnt.shape[0] == 4 * 360 and not cnt.any()
    assert slots.dtype == torch.float32 and slots.shape[0] == 2 * 1056 * 32 * 4
    assert call(4)["experts_gemm1"][1]["skc"] == ptrs[0]                       # kept
    assert call(8)["experts_gemm1"][1]["skc"] != ptrs[0] and k._sk[0][0][0].shape[0] == 8 * 360   # grown
    stream[0] = 7
    assert call(4)["experts_gemm1"][1]["skc"] not in (ptrs[0], k._sk[0][1][0])   # another stream: its own
    scratch = torch.empty(8 * 8, I, dtype=torch.bfloat16)
    own = call(8, scratch)["experts_gemm1"][1]["skc"]
    assert own not in (k._sk[0][1][0], k._sk[7][1][0])
    bf16 = next(s for s in stream_k_specs() if dict(s.constants)["H"] == 2880 and not dict(s.params).get("f16x"))
    k = ex.Kernels(bf16, 0)   # 64-wide steps: 45 an item; the bf16 struct with the counters and slots after it
    assert ex.params_struct(bf16) is ex.PARAMS_BF16_SK
    w13, w2 = torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), torch.zeros(E, H, I, dtype=torch.bfloat16)
    monkeypatch.setattr(ex._common, "persistent_ctas", lambda op, mod, name, dev, launch: 20000)
    k = ex.Kernels(bf16, 0)
    got = call(1)
    assert got["experts_gemm1"][0][0] == 360 * 45 and got["experts_gemm2"][0][0] == 180 * 45   # at most the steps
    assert set(got["experts_gemm2"][1]) == set(ex.PARAMS_BF16_SK.names)


def stream_k_tiers(tmp_path, monkeypatch) -> None:
    """KERNGEN_TIERS: a user file giving the shipped 1-2-token MXFP4 rule stream_k, the table reloaded (the caller
    unsets it and reloads)."""
    rule = next(r for r in tiers.load().rules if r.op == "experts" and r.formats == ("mxfp4",)
                and r.ranges["tokens"][0] == 1)
    params = ", ".join(f"{k} = {str(v).lower() if isinstance(v, bool) else v}" for k, v in rule.params.items())
    f = tmp_path / "sk.toml"
    f.write_text(f'schema = 1\n[[tier]]\nop = "experts"\nvariant = "mma"\nformats = ["mxfp4"]\ntokens = [1, 2]\n'
                 f'params = {{ {params}, stream_k = true }}\n')
    monkeypatch.setenv("KERNGEN_TIERS", str(f))
    tiers.reload()


def test_a_user_tier_file_reaches_dispatch(tmp_path, monkeypatch):
    """stream_k set in a user tiers file over gpt-oss-120b's 1-2-token MXFP4 rule: the dispatch's spec carries it."""
    stream_k_tiers(tmp_path, monkeypatch)
    try:
        d = ex.dispatch(-1, H=2880, I=2880, activation="gpt_oss", fmt="mxfp4")
        assert dict(d.spec(1).params).get("stream_k") and dict(d.spec(2).params).get("stream_k")
        assert not dict(d.spec(3).params).get("stream_k")
    finally:
        monkeypatch.delenv("KERNGEN_TIERS")
        tiers.reload()


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


def test_stream_k_fix_sets_the_fixups_cost_and_needs_stream_k():
    base = dict(tile=8, warps=8, unroll=2, blocks_per_sm=4)
    mk = lambda **p: ex.rule_spec(tiers.Rule("experts", "mma", {}, {**base, **p}), 2048, 768, "silu",  # noqa: E731
                                  "sm_90a")
    assert "constexpr int SK_FIX = 2;" in render.render(mk(stream_k=True))
    assert "constexpr int SK_FIX = 0;" in render.render(mk(stream_k=True, stream_k_fix=0))
    with pytest.raises(TierError, match="stream_k_fix without stream_k"):
        mk(stream_k_fix=1)
    with pytest.raises(TierError, match="stream_k_fix"):
        tiers.check_params("a rule", "experts", "mma", {**base, "stream_k": True, "stream_k_fix": 65})
