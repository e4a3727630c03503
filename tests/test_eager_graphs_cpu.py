"""KERNGEN_EAGER_GRAPHS' policy without a GPU (the driver calls stubbed): a launch sequence met once launches
itself, the second time it is captured and replayed, then replayed; never while the caller's stream captures; the
oldest graph goes past `size`; a shape whose captures are not reused turns it off; the flag reaches the experts
kernels (unset: calls of at most EAGER_GRAPH_TOKENS tokens) and a bad value is an EnvError."""
from types import SimpleNamespace

import pytest
import torch

import kerngen
from kerngen import env, launch
from kerngen.ops import experts as ex


@pytest.fixture
def driver(monkeypatch):
    """Stubbed capture and launch: the lists of captured field tuples and of graph launches (handle, stream)."""
    rec = {"captured": [], "launched": [], "capturing": set(), "destroyed": []}

    def instantiate(self, launches, fields):
        rec["captured"].append(fields)
        return 1000 + len(rec["captured"])

    monkeypatch.setattr(launch.EagerGraphs, "_instantiate", instantiate)
    monkeypatch.setattr(launch.EagerGraphs, "_destroy", lambda self, h: rec["destroyed"].append(h))
    monkeypatch.setattr(launch, "graph_launch", lambda h, s: rec["launched"].append((h, s)))
    monkeypatch.setattr(launch, "stream_capturing", lambda s: s in rec["capturing"])
    return rec


def test_second_sighting_captures_then_replays(driver):
    g = launch.EagerGraphs(0, size=4)
    f = (1, 2, 3.0)
    assert not g.launch(7, ["gemm1", "gemm2"], f)        # met once: the caller launches
    assert g.launch(7, ["gemm1", "gemm2"], f)            # again: captured and replayed
    assert g.launch(8, ["gemm1", "gemm2"], f)            # and replayed, on any stream
    assert driver["captured"] == [f] and driver["launched"] == [(1001, 7), (1001, 8)]
    assert (g.captures, g.hits) == (1, 1)
    assert not g.launch(7, ["gemm1", "gemm2"], (1, 2, 4.0))   # other fields: their own first sighting


def test_never_while_the_callers_stream_captures(driver):
    g = launch.EagerGraphs(0)
    f = (5,)
    driver["capturing"].add(9)
    for _ in range(3):
        assert not g.launch(9, ["k"], f)
    assert driver["captured"] == [] and driver["launched"] == []
    assert g.launch(7, ["k"], f)             # the capture over: met before (while it captured), captured and replayed
    assert not g.launch(9, ["k"], f)         # a hit too is launched by the caller there
    assert driver["captured"] == [f] and driver["launched"] == [(1001, 7)]


def test_a_first_sighting_asks_the_driver_nothing(driver, monkeypatch):
    """Fields never met before cost dictionary work only: the capture query waits for a second sighting."""
    asked = []
    monkeypatch.setattr(launch, "stream_capturing", lambda s: asked.append(s) or False)
    g = launch.EagerGraphs(0)
    for i in range(10):
        assert not g.launch(1, ["k"], (i,))
    assert asked == [] and g.launch(1, ["k"], (3,)) and asked == [1]


def test_the_oldest_graph_goes(driver):
    g = launch.EagerGraphs(0, size=2)
    for i in range(3):                  # three sequences, each captured on its second call and hit twice
        for _ in range(4):
            assert g.launch(1, ["k"], (i,)) or _ == 0
    assert set(g._graphs) == {(1,), (2,)} and driver["destroyed"] == [1001] and not g.off
    assert not g.launch(1, ["k"], (0,))   # met again, as new


def test_captures_never_reused_turn_it_off(driver):
    g = launch.EagerGraphs(0, size=2)
    for i in range(2):                  # each captured on its second call, then never again
        g.launch(1, ["k"], (i,))
        g.launch(1, ["k"], (i,))
    assert g.off and g.hits == 0
    assert not g.launch(1, ["k"], (0,)) and len(driver["captured"]) == 2   # plain launches from now on


def test_the_flag_reaches_the_experts_kernels(monkeypatch):
    spec = ex.spec(2048, 768, 8, "silu", 1, "sm_90a")
    monkeypatch.setattr(ex, "resolve", lambda s: s)
    monkeypatch.setattr(ex._common, "persistent_ctas", lambda *a: 528)
    monkeypatch.setenv("KERNGEN_EAGER_GRAPHS", "1")
    k = ex.Kernels(spec, 0)
    assert isinstance(k.graphs, launch.EagerGraphs) and k.graph_tokens == 2**31 - 1   # every token count
    assert ex.Kernels(spec, -1).graphs is None   # stub launchers (CPU tensors): never
    monkeypatch.setenv("KERNGEN_EAGER_GRAPHS", "0")
    assert ex.Kernels(spec, 0).graphs is None
    for unset in ("", " "):   # the default: decode token counts
        monkeypatch.setenv("KERNGEN_EAGER_GRAPHS", unset)
        k = ex.Kernels(spec, 0)
        assert isinstance(k.graphs, launch.EagerGraphs) and k.graph_tokens == ex.EAGER_GRAPH_TOKENS == 4
    monkeypatch.delenv("KERNGEN_EAGER_GRAPHS")
    assert env.eager_graphs() is None and ex.Kernels(spec, 0).graph_tokens == ex.EAGER_GRAPH_TOKENS
    monkeypatch.setenv("KERNGEN_EAGER_GRAPHS", "sometimes")
    with pytest.raises(kerngen.EnvError, match="KERNGEN_EAGER_GRAPHS"):
        env.eager_graphs()


def test_a_failed_capture_turns_it_off_with_a_warning(driver, monkeypatch):
    def fail(self, launches, fields):
        raise kerngen.DeviceError("instantiating a CUDA graph failed: CUDA_ERROR_NOT_SUPPORTED")
    monkeypatch.setattr(launch.EagerGraphs, "_instantiate", fail)
    g = launch.EagerGraphs(0)
    assert not g.launch(1, ["k"], (3,))
    with pytest.warns(RuntimeWarning, match="eager CUDA graphs turned off"):
        assert not g.launch(1, ["k"], (3,))   # the caller launches them itself
    assert g.off and not g.launch(1, ["k"], (3,))


@pytest.mark.parametrize("flag,replayed", [(None, {1, 4}), ("1", {1, 4, 5, 16}), ("0", set())])
def test_the_token_counts_that_replay(driver, monkeypatch, flag, replayed):
    """experts' Kernels.run: a call sequence repeated three times is launched, captured, replayed, at the token
    counts the flag lets through (unset: at most EAGER_GRAPH_TOKENS); the rest launch their kernels each call."""
    from tests.test_dispatch import StubLauncher
    if flag is None:
        monkeypatch.delenv("KERNGEN_EAGER_GRAPHS", raising=False)
    else:
        monkeypatch.setenv("KERNGEN_EAGER_GRAPHS", flag)
    monkeypatch.setattr(ex, "resolve", lambda s: s)
    monkeypatch.setattr(ex._common, "persistent_ctas", lambda *a: 528)
    monkeypatch.setattr(ex, "Launcher", StubLauncher)
    monkeypatch.setattr(ex, "current_stream", lambda dev: 5)
    E, H, I = 16, 256, 64
    k = ex.Kernels(ex.spec(H, I, 8, "silu", 1, "sm_90a"), 0)
    w13, w2 = torch.zeros(E, 2 * I, H, dtype=torch.bfloat16), torch.zeros(E, H, I, dtype=torch.bfloat16)
    for T in (1, 4, 5, 16):
        tiles = min(4 * T, E)   # the buffers a routing of T tokens, top-4, tile 8 has (the kernels are stubs)
        r = SimpleNamespace(permuted_to_token=torch.zeros(tiles * 8, dtype=torch.int32),
                            tile_to_expert=torch.zeros(tiles, dtype=torch.int32),
                            num_permuted_rows=torch.zeros(1, dtype=torch.int32))
        x = torch.zeros(T, H, dtype=torch.bfloat16)
        out = torch.empty(r.permuted_to_token.shape[0], H, dtype=torch.bfloat16)
        StubLauncher.log, before = [], len(driver["launched"])
        for _ in range(3):
            k.run(x, r, w13, w2, out, None, None, None, False, 0.0, 0.0, None, None, T,
                  r.tile_to_expert.shape[0], E)
        graphs = len(driver["launched"]) - before
        assert (graphs, len(StubLauncher.log)) == ((2, 2) if T in replayed else (0, 6)), (T, flag)
