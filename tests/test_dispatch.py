"""Dispatch once: the op registry, the token buckets against the tier table, and a hot path that, after the first
call of a shape, touches no file, no tier table and no compiler. On this CPU machine the ops run their dispatch
up to the launch with stub launchers (`_common.KERNEL_DEVICES` lets CPU tensors take the kernels' path)."""
import builtins
import inspect
import os

import pytest
import torch

import kerngen
from kerngen import dispatch, jit, ops, tiers, warmup
from kerngen.ops import OPS, _common, experts, finalize, latent_tail, op_module, permute, routing, tail, tail_tp
from kerngen.plan import plan

OP_MODULES = (routing, permute, finalize, tail, experts, latent_tail)


def test_the_registry_lists_every_op_with_kernels_and_each_has_the_seam():
    with_kernels = {o.name for o in ops.registered() if o.name != "tail_tp"}   # tail_tp runs torch.distributed
    assert set(OPS) == with_kernels and not ops.declared("tail_tp").kernels
    assert warmup.registry is ops   # warmup reads the registry itself, at each call
    for op in OPS:
        mod = op_module(op)
        for name in ("model_specs", "explain_spec", "kernel", "dispatch"):
            assert callable(getattr(mod, name, None)), f"kerngen.ops.{op} lacks {name}"
        assert all(callable(getattr(torch.ops.kerngen, n)) for n in ops.declared(op).torch), op   # its torch ops
        params = list(inspect.signature(mod.dispatch).parameters.values())   # dispatch(device, *, static shape)
        assert params[0].name == "device" and all(p.kind is p.KEYWORD_ONLY for p in params[1:]), op
        assert isinstance(mod.dispatch, dispatch.OpDispatch) and mod.dispatch.op == op   # the op's one cache:
        assert dispatch.calls(op) is mod.dispatch.calls and dispatch.calls(op).op == op   # its resolved calls too
        assert not any(isinstance(v, dict) and k.startswith("_fast") for k, v in vars(mod).items())
    params = list(inspect.signature(tail_tp.dispatch).parameters.values())   # tail_tp's too (no kernels, no seam)
    assert params[0].name == "device" and all(p.kind is p.KEYWORD_ONLY for p in params[1:])
    with pytest.raises(KeyError, match="unknown op"):
        op_module("tail_tp")
    registered = {o for o in dir(torch.ops.kerngen) if not o.startswith("_") and o != "name"}
    assert registered == {n for o in ops.registered() for n in o.torch}   # every torch op belongs to an op


def test_every_ops_dispatch_is_called_the_same_way_and_keyed_by_its_static_values():
    """dispatch(device, **static): one dispatch object per (device, static values), whichever order or defaults the
    keywords come in; a keyword the op's build does not take, or one it needs left out, is a TypeError naming its
    keywords; clear() forgets the objects."""
    shape = dict(H=256, I=128, activation="silu")
    d = experts.dispatch(-1, **shape)
    assert experts.dispatch(-1, activation="silu", I=128, H=256, fmt="bf16", top_k=0) is d
    assert experts.dispatch(-1, **shape, top_k=8) is not d and experts.dispatch(0, **shape) is not d
    assert ("experts", -1, 256, 128, "silu", "bf16", "nk", False, 0, 0) in dispatch.registry()
    with pytest.raises(TypeError, match=r"\(device, \*, hidden, top_k, dtype, weights_dtype\); unknown: K"):
        finalize.dispatch(-1, hidden=256, K=4, dtype="bfloat16", weights_dtype="float32", top_k=4)
    with pytest.raises(TypeError, match="missing: weights_dtype"):
        finalize.dispatch(-1, hidden=256, top_k=4, dtype="bfloat16")
    with pytest.raises(TypeError, match="a dispatch build takes"):
        dispatch.OpDispatch("bad", lambda device, hidden: None)
    kerngen.clear()
    assert experts.dispatch(-1, **shape) is not d


@pytest.mark.parametrize("op", OPS)
def test_explain_spec_takes_the_common_keywords(op):
    tbl = tiers.load()
    m = tbl.model("deepseek-v3")
    s = op_module(op).explain_spec(tbl, "sm_90a", experts=m.num_experts, top_k=m.top_k, hidden=m.hidden, tokens=8,
                                   model="deepseek-v3")
    assert s.op == op and s.arch == "sm_90a"


def test_every_model_spec_comes_from_the_registry():
    tbl = tiers.load()
    for m in tbl.models.values():
        specs = warmup.model_specs(m, tbl, "sm_90a")
        assert {s.op for s in specs} <= set(OPS)
        assert {"routing", "permute", "finalize", "tail"} <= {s.op for s in specs}, m.name


TOKENS = (0, 1, 2, 7, 8, 9, 16, 17, 63, 64, 65, 255, 256, 257, 511, 512, 513, 1024, 4095, 4096, 4097, 8192, 70000)


@pytest.mark.parametrize("name", sorted(tiers.load().models))
def test_buckets_pick_what_the_table_picks(name):
    """The bisect over the rules' token pieces gives, at every token count, the spec a full rule scan gives."""
    tbl = tiers.load()
    m = tbl.model(name)
    tag_fin = finalize.tag_constants(m.hidden, m.top_k, "bfloat16", "float32")
    d = finalize.dispatch(-1, hidden=m.hidden, top_k=m.top_k, dtype="bfloat16", weights_dtype="float32")
    tag_perm = permute.with_align(f"E{m.num_experts}-K{m.top_k}", {"E": m.num_experts, "K": m.top_k}, False)
    dp = permute.dispatch(-1, E=m.num_experts, K=m.top_k, align=False)
    for T in TOKENS:
        assert d.spec(T) == plan(tbl, "finalize", {"hidden": m.hidden, "top_k": m.top_k, "tokens": max(T, 1)},
                                 *tag_fin, "sm_90a"), (name, T)
        assert dp.spec(T) == plan(tbl, "permute", {"num_experts": m.num_experts, "top_k": m.top_k,
                                                   "tokens": max(T, 1)}, *tag_perm, "sm_90a"), (name, T)
        if m.intermediate:
            tile = experts.tile_for(m.hidden, m.intermediate, m.activation, T, -1, experts=m.num_experts,
                                    top_k=m.top_k)
            want = [r for r in tbl.rules if r.op == "experts" and r.matches(
                {"hidden": m.hidden, "tokens": max(T, 1), "arch": "sm_90a", "num_experts": m.num_experts,
                 "top_k": m.top_k})]
            assert tile == (want[0].params["tile"] if want else None), (name, T)


def test_the_experts_tile_is_the_rules():
    tbl = tiers.load()
    rules = [r for r in tbl.rules if r.op == "experts"]
    assert rules and all("tile" in r.params for r in rules)
    for r in rules:   # each with the weights it serves (w8a8: fp8 weights with fp8 activations)
        lo, hi = r.ranges["tokens"]
        f = r.formats[0] if r.formats else "bf16"
        fmt, a8 = ("fp8", True) if f == "w8a8" else (f, False)
        E, K = r.ranges.get("num_experts", (0, 256))[1], r.ranges.get("top_k", (8,))[0]   # (256 / 8: none keyed)
        for T in (lo, hi):
            assert experts.tile_for(7168, 2048, "silu", T, -1, fmt, "nk", a8, E, K) == r.params["tile"], (r, T)
            s = experts.dispatch(-1, H=7168, I=2048, activation="silu", fmt=fmt, layout="nk", a8=a8, experts=E,
                                 top_k=K).spec(T)
            assert dict(s.constants)["TILE"] == r.params["tile"] and "tile" not in dict(s.params)


class StubLauncher:
    """Stands in for launch.Launcher: records each launch by kernel name."""
    log: list = []

    def __init__(self, module, name, device, grid, block, params, smem=0, pdl=False):
        self.name, self.grid = name, grid

    def launch(self, stream, **fields):
        StubLauncher.log.append(self.name)

    def __call__(self, stream, *args):
        StubLauncher.log.append(self.name)


def _cute_stub(*args):
    StubLauncher.log.append("cute")


@pytest.fixture
def stub_gpu(monkeypatch):
    """The ops' dispatch on CPU tensors with stub launchers: resolve returns a stub, launches are recorded."""
    monkeypatch.setattr(_common, "KERNEL_DEVICES", ("cuda", "cpu"))
    for mod in OP_MODULES:
        monkeypatch.setattr(mod, "resolve", lambda spec: _cute_stub, raising=False)
        monkeypatch.setattr(mod, "current_stream", lambda dev: 0, raising=False)
        if hasattr(mod, "Launcher"):
            monkeypatch.setattr(mod, "Launcher", StubLauncher)
    monkeypatch.setattr(experts, "sm_count", lambda dev: 132)
    kerngen.clear()
    StubLauncher.log = []
    yield StubLauncher.log
    kerngen.clear()


def _calls():
    """One call of every public op the ordinary way, on CPU tensors."""
    g = torch.Generator().manual_seed(0)
    m = tiers.load().model("kimi-k3")
    E, K, H, I = 128, 8, 256, 64
    logits = torch.randn(4, E, generator=g)
    kimi = torch.randn(4, m.num_experts, generator=g)
    bias = torch.randn(m.num_experts, generator=g)
    ws = kerngen.RoutingWorkspace(4, m.num_experts, m.top_k, 128, device="cpu")
    ws8 = kerngen.RoutingWorkspace(4, E, K, 8, device="cpu")
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(4)]).int()
    x = torch.randn(4, H, generator=g).bfloat16()
    w13 = torch.randn(E, 2 * I, H, generator=g).bfloat16()
    w2 = torch.randn(E, H, I, generator=g).bfloat16()
    rows = torch.randn(4 * K, H, generator=g).bfloat16()
    e2p = torch.randperm(4 * K, generator=g).int().view(4, K)
    w = torch.rand(4, K, generator=g)
    nw = torch.ones(H).bfloat16()
    out = torch.empty(4, H, dtype=torch.bfloat16)
    r8 = kerngen.route(logits, top_k=K, method="softmax_topk", tile=8, workspace=ws8)
    eout = torch.empty(r8.permuted_to_token.shape[0], H, dtype=torch.bfloat16)
    up = torch.randn(2 * H, H, generator=g).bfloat16()                 # latent H -> model 2H
    sh = torch.randn(4, 2 * H, generator=g).bfloat16()
    lout = torch.empty(4, 2 * H, dtype=torch.bfloat16)
    e2p20 = torch.randint(0, 4 * K, (20, K), generator=g).int()        # past the fused rules: the unfused path
    w20 = torch.rand(20, K, generator=g)
    n = permute.max_rows(4, K, E, 8)
    sorted_ids, block_ids, post_pad = (torch.empty(m, dtype=torch.int32) for m in (n, -(-n // 8), 1))
    return {
        "route model= workspace=": lambda: kerngen.route(kimi, bias=bias, model="kimi-k3", tile=128, workspace=ws),
        "route model=": lambda: kerngen.route(kimi, bias=bias, model="kimi-k3", tile=128),
        "route explicit, workspace=": lambda: kerngen.route(logits, top_k=K, method="softmax_topk", tile=8,
                                                           workspace=ws8),
        "route explicit": lambda: kerngen.route(logits, top_k=K, method="softmax_topk", renormalize=True, tile=8),
        "route without tile": lambda: kerngen.route(logits, top_k=K, method="softmax_topk"),
        "permute": lambda: kerngen.permute(ids, num_experts=E, tile=8),
        "permute workspace=": lambda: kerngen.permute(ids, num_experts=E, tile=8, workspace=ws8),
        "permute_align_into": lambda: permute.permute_align_into(ids, E, 8, sorted_ids, block_ids, post_pad),
        "experts out=": lambda: kerngen.experts(x, r8, w13, w2, out=eout),
        "experts": lambda: kerngen.experts(x, r8, w13, w2),
        "finalize out=": lambda: kerngen.finalize(rows, e2p, w, out=out),
        "finalize": lambda: kerngen.finalize(rows, e2p, w),
        "moe_tail": lambda: kerngen.moe_tail(rows, e2p, w, nw, shared=x, residual=x),
        "latent_tail out=": lambda: kerngen.latent_tail(rows, e2p, w, nw, up, shared=sh, residual=sh, out=lout),
        "latent_tail": lambda: kerngen.latent_tail(rows, e2p, w, nw, up),
        "latent_tail unfused": lambda: kerngen.latent_tail(rows, e2p20, w20, nw, up),
        "experts tile_for": lambda: StubLauncher.log.append(experts.tile_for(H, I, "silu", 4, -1)),
    }


def hot_path_guard(monkeypatch, run) -> None:
    """run() with the filesystem (os.stat, os.lstat, open), the tier table, rule scans, the compiler and new
    dispatch objects watched: any use fails the test (recorded, not raised inside: a warning's linecache may stat
    a file, which is not the hot path's)."""
    touched = []

    def forbidden(what, real=None):
        def record(*a, **k):
            touched.append(what)
            if real is None:
                raise AssertionError(f"{what} on the hot path")
            return real(*a, **k)
        return record

    with monkeypatch.context() as mp:
        mp.setattr(os, "stat", forbidden("os.stat", os.stat))
        mp.setattr(os, "lstat", forbidden("os.lstat", os.lstat))
        mp.setattr(builtins, "open", forbidden("open", builtins.open))
        mp.setattr(tiers, "load", forbidden("tiers.load"))
        mp.setattr(tiers.Table, "rule", forbidden("a rule scan"))
        mp.setattr(jit, "build", forbidden("jit.build"))
        mp.setattr(dispatch, "Dispatch", forbidden("a new Dispatch"))
        run()
    assert not touched, touched


def test_after_the_first_call_the_hot_path_reads_no_file_and_no_table(stub_gpu, monkeypatch):
    calls = _calls()
    n0 = len(stub_gpu)
    for fn in calls.values():
        fn()
    first = stub_gpu[n0:]
    assert {"routing_fused", "routing_topk"} & set(first) and {"experts_gemm1", "experts_gemm12"} & set(first)
    assert "cute" in first
    built = dispatch.registry()
    assert {k[0] for k in built} == set(OPS)

    launched = {}

    def each():
        for name, fn in calls.items():
            n = len(stub_gpu)
            fn()
            launched[name] = len(stub_gpu) - n

    hot_path_guard(monkeypatch, each)
    assert all(launched.values()), launched
    assert stub_gpu[n0 + len(first):] == first   # the same launches, in the same order
    assert dispatch.registry().keys() == built.keys()


def test_reload_and_clear_forget_every_dispatch(stub_gpu):
    logits = torch.randn(3, 64)
    kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    assert dispatch.registry() and dispatch.calls("routing")
    tiers.reload()
    assert not dispatch.registry() and not dispatch.calls("routing")
    kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    kerngen.clear()
    assert not dispatch.registry() and not dispatch.calls("routing")


def test_a_wrong_argument_after_a_good_call_is_still_named(stub_gpu):
    """The signature fast path skips checks only for arguments like the last ones'."""
    logits = torch.randn(3, 64)
    ws = kerngen.RoutingWorkspace(3, 64, 4, 8, device="cpu")
    kerngen.route(logits, top_k=4, method="softmax_topk", tile=8, workspace=ws)
    with pytest.raises(kerngen.InputError) as e:
        kerngen.route(logits, top_k=5, method="softmax_topk", tile=8, workspace=ws)
    assert e.value.arg == "workspace"
    with pytest.raises(kerngen.InputError) as e:
        kerngen.route(logits[:, :32], top_k=4, method="softmax_topk", tile=8, workspace=ws)
    assert e.value.arg == "workspace"
    with pytest.raises(kerngen.InputError) as e:
        kerngen.route(logits.t().contiguous().t(), top_k=4, method="softmax_topk", tile=8)
    assert e.value.arg == "logits"
    with pytest.raises(kerngen.InputError) as e:
        kerngen.route(torch.randn(3, 64), model="kimi-k3")
    assert e.value.arg == "logits"
    for bad in (dict(tile=8.0), dict(top_k=4.0), dict(renormalize=1)):   # equal to the good values, not of their kind
        with pytest.raises(kerngen.InputError) as e:
            kerngen.route(logits, **{**dict(top_k=4, method="softmax_topk", tile=8, workspace=ws), **bad})
        assert e.value.arg in bad
    ids = torch.zeros(3, 4, dtype=torch.int32)
    kerngen.permute(ids, num_experts=64, tile=8)
    for bad in (dict(tile=8.0), dict(num_experts=64.0), dict(pad_sorted_ids=0)):
        with pytest.raises(kerngen.InputError) as e:
            kerngen.permute(ids, **{**dict(num_experts=64, tile=8), **bad})
        assert e.value.arg in bad
    g, e2p, w = torch.randn(8, 64).bfloat16(), torch.zeros(2, 4, dtype=torch.int32), torch.rand(2, 4)
    kerngen.finalize(g, e2p, w)
    with pytest.raises(kerngen.InputError) as e:
        kerngen.finalize(g, e2p, w[:, :3].contiguous())
    assert e.value.arg == "topk_weights"


def test_route_results_without_workspace_are_fresh(stub_gpu):
    """Without workspace= each call returns buffers of its own (a later call does not overwrite them)."""
    logits = torch.randn(3, 64)
    a = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    b = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    assert a.topk_ids.data_ptr() != b.topk_ids.data_ptr()
    assert a.permuted_to_token.data_ptr() != b.permuted_to_token.data_ptr()
    assert int(a.num_permuted_rows) == -1 and a.tile == b.tile == 8   # the initial state: nothing ran (stubs)
    ws = kerngen.RoutingWorkspace(3, 64, 4, 8, device="cpu")
    c = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8, workspace=ws)
    d = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8, workspace=ws)
    assert c is d   # a workspace's results are views built once per token count


def test_calls_into_given_buffers_allocate_nothing(stub_gpu, monkeypatch):
    """route / permute with workspace=, experts / finalize with out=, moe_align_block_size into its buffers: no
    allocation after the first call (the experts' intermediate and the align scratch are the dispatch's)."""
    calls = {k: v for k, v in _calls().items() if "workspace=" in k or "out=" in k or "into" in k}
    for fn in calls.values():
        fn()

    def no_alloc(*a, **k):
        raise AssertionError("an allocation on the hot path")

    with monkeypatch.context() as mp:
        for name in ("empty", "full", "zeros", "empty_like", "full_like", "zeros_like"):
            mp.setattr(torch, name, no_alloc)
        for fn in calls.values():
            fn()


@pytest.mark.parametrize("T", [0, 1, 5])
def test_fresh_buffers_match_a_new_workspace(stub_gpu, T):
    """The fast fresh buffers of a call without workspace= hold what a new RoutingWorkspace holds."""
    logits = torch.randn(T, 64)
    r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    r2 = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    ws = kerngen.RoutingWorkspace(max(T, 1), 64, 4, 8, device="cpu").result(T, 64)
    for f in ("topk_ids", "expert_counts", "expert_offsets", "expanded_to_permuted", "permuted_to_token",
              "tile_to_expert", "num_permuted_rows"):
        a, b = getattr(r, f), getattr(ws, f)
        assert a.shape == b.shape and a.dtype == b.dtype, f
        if f != "topk_ids":
            assert torch.equal(a, b), f
    assert r.checked == ws.checked and r2.checked == r.checked
    assert r.permuted_to_token.data_ptr() != r2.permuted_to_token.data_ptr()


def test_calls_without_workspace_take_their_dropped_buffers_again(stub_gpu, monkeypatch):
    """route / permute without workspace= on one stream hand out the last call's buffers again once nothing refers
    to them (its Routing dropped, no tensor of it and no view of one kept): no new allocation; a kept result, a
    kept tensor, a view of one, another stream or another thread gets new buffers. (A capture never takes them
    again: fresh() checks is_current_stream_capturing on CUDA devices.)"""
    from kerngen.ops import permute as pm
    assert pm._USE_COUNT is not None   # torch keeps the count this relies on
    made = []
    split = torch.split_with_sizes
    monkeypatch.setattr(torch, "split_with_sizes", lambda *a, **k: made.append(1) or split(*a, **k))
    logits = torch.randn(3, 64)

    def route() -> int:   # a call whose result is dropped at once: new buffers made for it (0 or 1)
        n = len(made)
        kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
        return len(made) - n

    assert [route(), route(), route()] == [1, 0, 0]
    kept = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
    assert route() == 1 and route() == 0   # the kept result's buffers are not taken; the next call's are
    del kept
    for keep in (lambda r: r.topk_ids, lambda r: r.expanded_to_permuted.view(-1), lambda r: r.num_permuted_rows):
        r = kerngen.route(logits, top_k=4, method="softmax_topk", tile=8)
        held = keep(r)
        del r
        assert route() == 1, keep   # a tensor of it, or a view of one, kept
        del held
    assert route() == 0   # nothing kept
    monkeypatch.setattr(routing, "current_stream", lambda dev: 1)
    assert route() == 1 and route() == 0   # another stream: new buffers, then that stream's again
    import threading
    got = []
    t = threading.Thread(target=lambda: got.append(route()))
    t.start()
    t.join()
    assert got == [1]   # another thread: new buffers
    ids = torch.randint(0, 64, (3, 4), dtype=torch.int32)

    def permute() -> int:
        n = len(made)
        kerngen.permute(ids, num_experts=64, tile=8)
        return len(made) - n

    assert [permute(), permute()] == [1, 0]
    kept = kerngen.permute(ids, num_experts=64, tile=8)
    assert permute() == 1
    del kept


def test_top_k_calls_without_a_tile_take_their_dropped_buffers_again(stub_gpu, monkeypatch):
    """route without a tile (ids and weights only) reuses its dropped buffers as the permuting calls do: one split a
    new buffer, none when the last result was dropped; held results stay distinct, a kept view keeps them."""
    made = []
    split = torch.split_with_sizes
    monkeypatch.setattr(torch, "split_with_sizes", lambda *a, **k: made.append(1) or split(*a, **k))
    logits = torch.randn(2, 64)

    def route() -> int:
        n = len(made)
        kerngen.route(logits, top_k=4, method="softmax_topk")
        return len(made) - n

    assert [route(), route(), route()] == [1, 0, 0]
    a = kerngen.route(logits, top_k=4, method="softmax_topk")
    b = kerngen.route(logits, top_k=4, method="softmax_topk")
    assert a.topk_ids.data_ptr() != b.topk_ids.data_ptr() and a.topk_weights.data_ptr() != b.topk_weights.data_ptr()
    assert a.tile is None and a.permuted_to_token is None and a.topk_ids.shape == (2, 4)
    assert a.topk_weights.dtype == torch.float32 and a.topk_ids.data_ptr() % 16 == a.topk_weights.data_ptr() % 16 == 0
    held = b.topk_weights[:, :2]
    del a, b
    assert route() == 1 and route() == 0   # b's buffers held through a view: new ones, then those again
    del held


def test_what_calls_without_workspace_keep_is_bounded(stub_gpu):
    """Calls without workspace= keep a prototype of their buffers only at decode sizes; the experts' intermediate
    is one buffer per stream, grown to the most tiles seen, whatever the token counts."""
    from kerngen.ops.permute import FRESH_PROTO_TOKENS, RoutingWorkspace
    for T in (1, FRESH_PROTO_TOKENS, FRESH_PROTO_TOKENS + 1):
        kerngen.route(torch.randn(T, 64), top_k=4, method="softmax_topk", tile=8)
    kept = {sig[1][0]: hit[1] for sig, hit in dispatch.calls("routing").items()}
    assert isinstance(kept[1], RoutingWorkspace) and isinstance(kept[FRESH_PROTO_TOKENS], RoutingWorkspace)
    assert not isinstance(kept[FRESH_PROTO_TOKENS + 1], RoutingWorkspace)
    r = kerngen.route(torch.randn(FRESH_PROTO_TOKENS + 1, 64), top_k=4, method="softmax_topk", tile=8)
    assert r.topk_ids.shape == (FRESH_PROTO_TOKENS + 1, 4) and int(r.num_permuted_rows) == -1
    g = torch.Generator().manual_seed(0)
    H, I, E = 256, 64, 16
    w13 = torch.randn(E, 2 * I, H, generator=g).bfloat16()
    w2 = torch.randn(E, H, I, generator=g).bfloat16()
    for T in (2, 3, 16, 4):
        x = torch.randn(T, H, generator=g).bfloat16()
        kerngen.experts(x, kerngen.route(torch.randn(T, E), top_k=2, method="softmax_topk", tile=8), w13, w2)
    d = experts.dispatch(-1, H=H, I=I, activation="silu", experts=E, top_k=2)
    assert {id(d.kernel(T)) for T in (2, 3, 16, 4)} == {id(d.kernel(2))}   # one launch object for the bucket
    assert len(d.kernel(2)._act) == 1 and len(d.kernel(2)._sync) <= 1


def _live_tensors() -> dict[int, torch.Tensor]:
    import gc
    gc.collect()
    return {id(o): o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel()}


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_the_custom_ops_keep_no_tensor_of_their_calls(stub_gpu, fmt):
    """torch.compile's CUDA graphs own what their calls allocate and refuse a graph whose allocations outlive it
    untracked: after kerngen::route and kerngen::moe_experts (their CUDA implementations, first calls included:
    the dispatch is built then) only their outputs are alive."""
    from kerngen.ops import experts_torch, routing_torch
    g = torch.Generator().manual_seed(0)
    T, H, I, E, K = 3, 256, 64, 128, 8
    x = torch.randn(T, H, generator=g).bfloat16()
    if fmt == "bf16":
        w13, w2 = torch.randn(E, 2 * I, H, generator=g).bfloat16(), torch.randn(E, H, I, generator=g).bfloat16()
        scales = (None, None)
    else:   # gpt-oss's blocks and e8m0 scales: w2's last dims are I/32, 16
        w13 = torch.randint(0, 256, (E, 2 * I, H // 32, 16), generator=g, dtype=torch.uint8)
        w2 = torch.randint(0, 256, (E, H, I // 32, 16), generator=g, dtype=torch.uint8)
        scales = (torch.full((E, 2 * I, H // 32), 127, dtype=torch.uint8),
                  torch.full((E, H, I // 32), 127, dtype=torch.uint8))
    logits = torch.randn(T, E, generator=g)
    for call in range(2):
        before = _live_tensors()
        ids, w = routing_torch.route._init_fn(logits, K, "softmax_topk", None, 1, 1, 1.0, True)
        y = experts_torch.moe_experts._init_fn(x, ids, w, w13, w2, "silu", None, None, *scales)
        assert y.shape == (T, H)
        new = [t for k, t in _live_tensors().items() if k not in before]
        outputs = {t.untyped_storage().data_ptr() for t in (ids, w, y)}
        kept = [(tuple(t.shape), t.dtype) for t in new if t.untyped_storage().data_ptr() not in outputs]
        assert not kept, call
        del ids, w, y


def test_experts_take_the_callers_scratch_and_keep_none(stub_gpu):
    """scratch= is the kernels' intermediate: given, the per-stream buffer is never made; left out, it is."""
    g = torch.Generator().manual_seed(0)
    T, H, I, E, K = 4, 256, 64, 128, 8
    x = torch.randn(T, H, generator=g).bfloat16()
    w13, w2 = torch.randn(E, 2 * I, H, generator=g).bfloat16(), torch.randn(E, H, I, generator=g).bfloat16()
    r = kerngen.route(torch.randn(T, E, generator=g), top_k=K, method="softmax_topk", tile=8)
    rows = r.permuted_to_token.shape[0]
    k = experts.dispatch(x.get_device(), H=H, I=I, activation="silu", experts=E, top_k=K).kernel(T)
    kerngen.experts(x, r, w13, w2, scratch=torch.empty(rows, I, dtype=torch.bfloat16))
    assert k._act == {} and stub_gpu.count("experts_gemm1") + stub_gpu.count("experts_gemm12") == 1
    kerngen.experts(x, r, w13, w2)
    assert [tuple(a.shape) for a in k._act.values()] == [(experts._pow2(rows // 8) * 8, I)]   # tiles of 8


def test_identity_rows_are_kept_by_the_dispatch_object_and_forgotten_by_clear():
    """The TP tails' finalize arguments for summed rows: kept in the dispatch object of the call they feed."""
    cpu = torch.device("cpu")
    d = tail_tp.dispatch(-1, hidden=256, world_size=2)
    idx, ones = _common.identity_rows(d.kept, 4, cpu)
    assert idx.dtype == torch.int32 and idx.flatten().tolist() == [0, 1, 2, 3] and ones.shape == (4, 1)
    assert bool(ones.eq(1).all()) and _common.identity_rows(d.kept, 4, cpu)[0] is idx
    assert tail_tp.dispatch(-1, hidden=256, world_size=2) is d and d.require(4).params["allreduce"] == "nccl"
    kerngen.clear()
    d2 = tail_tp.dispatch(-1, hidden=256, world_size=2)
    assert d2 is not d and not d2.kept


def test_the_align_scratch_is_the_dispatch_objects(stub_gpu):
    """moe_align_block_size's scratch workspace lives in the align dispatch object of its shape, one per block size,
    grown to the most tokens seen, and goes with it on clear()."""
    E, K = 16, 2
    d = permute.dispatch(-1, E=E, K=K, align=True)

    def align(T, block):
        ids = torch.randint(0, E, (T, K), dtype=torch.int32)
        n = permute.max_rows(T, K, E, block)
        bufs = [torch.empty(m, dtype=torch.int32) for m in (n, -(-n // block), 1)]
        permute.permute_align_into(ids, E, block, *bufs)
        return d.kept[("align scratch", block)]

    ws = align(3, 4)
    assert ws.max_tokens == 3 and ws.layout == "align" and align(2, 4) is ws and align(3, 8) is not ws
    assert align(5, 4).max_tokens == 5
    kerngen.clear()
    assert permute.dispatch(-1, E=E, K=K, align=True).kept == {}


def _held(roots) -> list:
    """Tensors and RoutingWorkspaces reachable from `roots` through containers and kerngen's own objects (functions,
    modules and classes are not followed)."""
    import gc
    seen, found, todo = set(), [], list(roots)
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, (torch.Tensor, permute.RoutingWorkspace)):
            found.append(o)
            if isinstance(o, torch.Tensor):
                continue
        if isinstance(o, (dict, list, tuple, set)) or type(o).__module__.startswith("kerngen."):
            todo.extend(gc.get_referents(o))
    return found


def test_clear_forgets_every_buffer_the_calls_keep(stub_gpu):
    """What the calls keep (per-stream scratch, the align scratch, prototypes of fresh buffers) is held by the dispatch
    objects and the Calls and by nothing else: after kerngen.clear() none of it is alive."""
    import gc
    import weakref
    calls = _calls()
    for fn in calls.values():
        fn()
    held = _held([*dispatch.registry().values(), *(dispatch.calls(op) for op in OPS)])
    kinds = {type(o).__name__ for o in held}
    assert {"Tensor", "RoutingWorkspace"} <= kinds, kinds
    refs = [weakref.ref(o) for o in held]
    del held
    kerngen.clear()
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    assert not alive, [(type(o).__name__, tuple(getattr(o, "shape", ()))) for o in alive]


def test_no_op_keeps_a_cache_of_its_own():
    """The dispatch objects and the Calls are the only per-shape state: no module of kerngen.ops assigns an empty
    dict, list or set at module level (a cache; the op registry's table of declarations aside), and clear() has no
    hooks to call."""
    import ast
    from pathlib import Path
    def empty(v) -> bool:
        return ((isinstance(v, (ast.Dict, ast.List, ast.Set)) and not any(ast.iter_child_nodes(v)))
                or (isinstance(v, ast.Call) and getattr(v.func, "id", None) in ("dict", "list", "set") and not v.args))

    caches = []
    for path in sorted(Path(_common.__file__).parent.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None and empty(node.value):
                if ast.unparse(node.targets[0] if isinstance(node, ast.Assign) else node.target) != "_REGISTRY":
                    caches.append(f"{path.name}:{node.lineno}")
    assert not caches, caches
    assert not hasattr(dispatch, "on_clear") and not hasattr(dispatch, "_on_clear")
    for mod, name in ((permute, "_scratch"), (_common, "_identity"), (_common, "_modules"), (tail_tp, "_symm")):
        assert not hasattr(mod, name), (mod.__name__, name)
