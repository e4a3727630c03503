"""kerngen.integrations.transformers on the CPU against transformers itself: for each supported family a tiny
random model built from its config class (2 layers, 8 experts), its MoE block with kerngen against the "eager"
experts implementation and transformers' router (fp32 and bf16), the router's ids and weights, greedy
generate; refusals with their reason; enable idempotent, disable restoring transformers' code."""
import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402

import kerngen.integrations.transformers as kt  # noqa: E402
from kerngen.integrations import transformers_experts as kx  # noqa: E402
from kerngen.errors import KerngenError  # noqa: E402
from tests.helpers import experts_on_cpu, one_thread  # noqa: E402

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
MLA = dict(head_dim=8, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
           first_k_dense_replace=0)
# id -> (model_type, config overrides); ids name the routing case where one family has several
FAMILIES = {
    "deepseek_v3-grouped": ("deepseek_v3", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
                                                routed_scaling_factor=2.5, **MLA)),
    "deepseek_v3-kimi": ("deepseek_v3", dict(n_routed_experts=8, num_experts_per_tok=3, n_group=1, topk_group=1,
                                             routed_scaling_factor=2.827, **MLA)),
    "deepseek_v3-no-norm": ("deepseek_v3", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                                norm_topk_prob=False, **MLA)),
    "deepseek_v2": ("deepseek_v2", dict(n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=1.5, **MLA)),
    "glm4_moe": ("glm4_moe", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                                  first_k_dense_replace=0)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "qwen3_next": ("qwen3_next", dict(num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=16,
                                      linear_num_value_heads=2, linear_num_key_heads=1, linear_key_head_dim=8,
                                      linear_value_head_dim=8, layer_types=["linear_attention", "full_attention"])),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=16)),
    "olmoe": ("olmoe", dict(num_experts=8, num_experts_per_tok=2)),
    "mixtral": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    "minimax": ("minimax", dict(num_local_experts=8, num_experts_per_tok=2)),
    "minimax_m2": ("minimax_m2", dict(num_local_experts=8, num_experts_per_tok=2)),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=8, num_experts_per_tok=2,
                                layer_types=["sliding_attention", "full_attention"])),
    "granitemoe": ("granitemoe", dict(num_local_experts=8, num_experts_per_tok=2)),
    "nemotron_h": ("nemotron_h", dict(layers_block_type=["full_attention", "moe"], n_routed_experts=8, num_experts_per_tok=2,
                                      moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1)),  # no gate
    "llama4_text": ("llama4_text", dict(num_local_experts=8, num_experts_per_tok=1, intermediate_size_mlp=48)),
}
REFUSED = {   # families whose routers map onto no kerngen method
    "phimoe": ("phimoe", dict(num_local_experts=8, num_experts_per_tok=2)),
    "ernie4_5_moe": ("ernie4_5_moe", dict(moe_num_experts=8, moe_k=2)),
}
# max |kerngen - eager| / (|eager| + RMS of eager), per element.
# fp32: the same products; sums in another order (kerngen: each token's K rows in ascending k; eager: index_add_
# per expert) and router weights within 1e-6 relative (kerngen's sigmoid / softmax rounding): ~1e-6 seen.
# bf16: eager rounds each weighted expert row to bf16 and accumulates the K rows in bf16, kerngen accumulates in
# fp32 and rounds once: up to ~K bf16 steps (2**-8 each), 6.4e-3 seen. 2**-6 allows four. A wrong expert, row or
# weight moves the output by O(1) of this measure.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2 ** -6}
# bf16 through kerngen.experts' kernels (CUDA, decode sizes): gate and up stay fp32 into the activation, which is
# rounded once, where eager rounds the GEMM outputs, the activation and the product each to bf16. Both are off
# the exact (fp64) result, eager about twice as far (test_fused_experts_are_closer_to_exact_than_eager), so
# kerngen and eager differ by up to the sum: 0.019 seen, 2**-5 allowed.
TOL_FUSED = 2 ** -5


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


def tiny(case: str, seed: int = 0, **overrides):
    """The family's tiny CausalLM in eval mode, experts "eager"; expert and router weights N(0, 1/H) so routing is
    decisive and the MoE blocks dominate the residual stream (generate then depends on them)."""
    model_type, kw = {**FAMILIES, **REFUSED}[case]
    cfg = AutoConfig.for_model(model_type, **{**BASE, **kw, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "experts." in name or name.endswith(("gate.weight", "router.weight")):
                t.normal_(0, cfg.hidden_size ** -0.5)
            elif name.endswith(("e_score_correction_bias", "router.bias", "_proj_bias")):
                t.normal_(0, 0.1)
    if model_type != "llama4_text":   # Llama4's experts do not dispatch
        model.set_experts_implementation("eager")
    return model


def moe_blocks(model):
    """Llama4TextMoe blocks, and modules whose experts dispatch through transformers' ExpertsInterface."""
    return [m for m in model.modules()
            if type(m).__name__ == kt.LLAMA4_BLOCK or kt._dispatches(getattr(m, "experts", None))]


def run_block(block, x):
    with torch.no_grad():
        out = block(x)
    return out[0] if isinstance(out, tuple) else out   # gpt-oss and Llama-4 blocks also return router outputs


def rel_err(out, ref) -> float:
    o, r = out.float(), ref.float()
    return ((o - r).abs() / (r.abs() + r.pow(2).mean().sqrt())).max().item()


def inputs(model, T, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, T, model.config.hidden_size, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_block_matches_eager(case, dtype, monkeypatch):
    """Kerngen's experts path alone (transformers' router) and with kerngen routing, T = 1 and 13 tokens."""
    finalized = counting(monkeypatch, kx, "_finalize")
    model = tiny(case).to(dtype)
    block = moe_blocks(model)[0]
    for T in (1, 13):
        x = inputs(model, T, dtype)
        ref = run_block(block, x)
        if case != "llama4_text":
            kt.enable(model, routers=False)
            assert rel_err(run_block(block, x), ref) <= TOL[dtype]
        kt.enable(model)
        out = run_block(block, x)
        assert out.dtype == dtype and out.shape == ref.shape
        assert rel_err(out, ref) <= TOL[dtype], case
        kt.disable(model)
        assert torch.equal(run_block(block, x), ref)   # transformers' own code again
    assert len(finalized) == (2 if case == "llama4_text" else 4)   # the outputs came through kerngen


def counting(monkeypatch, obj, name: str) -> list:
    """Replace obj.name by a wrapper that records each call; returns the record."""
    calls, real = [], getattr(obj, name)
    monkeypatch.setattr(obj, name, lambda *a, **kw: calls.append(a) or real(*a, **kw))
    return calls


def test_experts_reuse_the_permutation_of_the_router(monkeypatch):
    model = tiny("qwen3_moe")
    kt.enable(model)
    permuted = counting(monkeypatch, kt._pm, "permute_reference")
    run_block(moe_blocks(model)[0], inputs(model, 5, torch.float32))
    assert len(permuted) == 1


def check_router(model, T: int) -> None:
    """The kerngen router against transformers' on T tokens: the same experts per token (kerngen ranks ties
    and the order within the top-k its own way: compared as sets), the same weights in the dtype transformers
    returns, int32 ids."""
    block = moe_blocks(model)[0]
    router = block.gate if hasattr(block, "gate") else block.router
    x = inputs(model, T, model.dtype).view(T, -1).to(model.device)
    args = (block.e_score_correction_bias,) if hasattr(block, "e_score_correction_bias") else ()   # MiniMax-M2
    with torch.no_grad():
        _, w_ref, ids_ref = router(x, *args)
        kt.enable(model)
        logits, w, ids = router(x, *args)
        kt.disable(model)
    assert ids.dtype == torch.int32 and w.dtype == w_ref.dtype and logits.shape == (T, 8)
    order, order_ref = ids.sort(-1), ids_ref.sort(-1)
    assert torch.equal(order.values.long(), order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", sorted(c for c in FAMILIES if c != "llama4_text"))
def test_router_ids_and_weights_match_transformers(case):
    check_router(tiny(case), 29)


@pytest.mark.parametrize("case", sorted(FAMILIES))
def test_greedy_generate_gives_the_same_ids(case):
    model = tiny(case)
    prompt = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        kt.enable(model)
        out = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, ref)


def test_greedy_generate_depends_on_the_experts():
    """The control for the test above: a wrong expert path changes the generated ids."""
    model = tiny("qwen3_moe")
    prompt = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
        kt.enable(model)
        for block in moe_blocks(model):
            block.experts.down_proj.neg_()
        out = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert not torch.equal(out, ref)


@pytest.mark.parametrize("case, overrides, words", [
    ("phimoe", {}, ["phimoe", "sparsemixer", "jitter"]),
    ("deepseek_v2", dict(topk_method="group_limited_greedy", n_group=4, topk_group=2),
     ["deepseek_v2", "group_limited_greedy"]),
    ("llama4_text", dict(num_experts_per_tok=2), ["llama4_text", "num_experts_per_tok=2"]),
    ("ernie4_5_moe", {}, ["ernie4_5_moe", "moe_statics"]),
])
def test_refuses_a_family_that_does_not_map_and_patches_nothing(case, overrides, words):
    model = tiny(case, **overrides)
    before = model.config._experts_implementation
    with pytest.raises(kt.UnsupportedModelError) as e:
        kt.enable(model)
    assert isinstance(e.value, KerngenError) and all(w in str(e.value) for w in words), str(e.value)
    assert model.config._experts_implementation == before
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_routers_false_runs_any_dispatching_family_on_kerngen_experts():
    """phimoe's router is refused, its experts are not: kerngen permutes transformers' int64 ids."""
    model = tiny("phimoe")
    block = moe_blocks(model)[0]
    x = inputs(model, 13, torch.float32)
    ref = run_block(block, x)
    assert kt.enable(model, routers=False) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts",
                                              "model.layers.0.mlp", "model.layers.1.mlp"]   # experts, graphed blocks
    assert rel_err(run_block(block, x), ref) <= TOL[torch.float32]


def test_enable_is_idempotent_and_disable_restores():
    model = tiny("qwen3_moe")
    assert kt.NAME in ALL_EXPERTS_FUNCTIONS   # registered on import: from_pretrained(experts_implementation=...)
    names = kt.enable(model)
    assert names == ([f"model.layers.{i}.mlp.{m}" for i in range(2) for m in ("experts", "gate")]
                     + [f"model.layers.{i}.mlp" for i in range(2)])   # the blocks: graphed forwards
    forward = model.model.layers[0].mlp.gate.forward
    assert kt.enable(model) == names and model.model.layers[0].mlp.gate.forward is forward
    assert model.config._experts_implementation == "kerngen"
    assert set(kt.disable(model)) == set(names)
    assert model.config._experts_implementation == "eager"
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert kt.disable(model) == []
    assert kt.enable(model) == names


def test_no_moe_block_is_refused():
    cfg = AutoConfig.for_model("llama", **{k: v for k, v in BASE.items() if k != "moe_intermediate_size"})
    with pytest.raises(kt.UnsupportedModelError, match="llama.*no MoE block"):
        kt.enable(AutoModelForCausalLM.from_config(cfg))


def test_expert_parallel_sentinel_ids_contribute_nothing():
    """Ids outside [0, E) (transformers' expert-parallel sentinel) are skipped, as the eager experts skip them."""
    experts = moe_blocks(tiny("mixtral"))[0].experts
    x = torch.randn(5, 32)
    ids = torch.randint(0, 8, (5, 2))
    ids[1, 0] = ids[3, 1] = 8
    w = torch.rand(5, 2)
    with torch.no_grad():
        ref = experts(x, ids, w)
        out = kt.experts_forward(experts, x, ids, w)
    assert rel_err(out, ref) <= TOL[torch.float32]


def test_training_mode_runs_transformers_code_with_gradients():
    model = tiny("mixtral")
    kt.enable(model)
    model.train()
    block = moe_blocks(model)[0]
    block(torch.randn(1, 4, 32)).sum().backward()
    assert block.gate.weight.grad is not None and block.experts.gate_up_proj.grad is not None


def test_readme_example_runs_as_written():
    import re
    from pathlib import Path
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Hugging Face transformers"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md", "exec"), {})


@pytest.mark.parametrize("case", ["qwen2_moe", "qwen3_next", "deepseek_v3-no-norm", "mixtral", "minimax_m2"])
def test_fused_experts_are_closer_to_exact_than_eager(case):
    """The rounding of kerngen.experts (its torch reference, which the GPU tests hold the kernels to) against
    transformers' own experts module run in fp64 on the same ids and weights, next to its bf16 eager run."""
    import copy

    import kerngen
    from kerngen.ops import experts as ex
    from kerngen.ops import finalize as fin
    from kerngen.ops import permute as pm
    model = tiny(case).to(torch.bfloat16)
    e = moe_blocks(model)[0].experts
    assert kt.kernel_activation(e) == "silu"
    e64 = copy.deepcopy(e).double()
    E, H = e.num_experts, e.gate_up_proj.shape[-1]
    errs = []
    for T in (13, 64):
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16)
        ids = torch.stack([torch.randperm(E, generator=g)[:4] for _ in range(T)]).int()
        w = torch.softmax(torch.randn(T, 4, generator=g), -1)
        with torch.no_grad():
            exact = e64(x.double(), ids.long(), w.double())
            eager = e(x, ids.long(), w.to(torch.bfloat16))
        r = kerngen.Routing(ids, w, **pm.permute_reference(ids, E, 8))
        rows = experts_on_cpu(x, r, e.gate_up_proj.data, e.down_proj.data, activation="silu")
        ours = fin.reference(rows, r.expanded_to_permuted, w)
        errs.append((rel_err(ours, exact), rel_err(eager, exact), rel_err(ours, eager)))
    for ours, eager, between in errs:
        assert ours <= TOL[torch.bfloat16] and between <= TOL_FUSED, errs
    assert sum(o for o, _, _ in errs) < sum(e for _, e, _ in errs), errs


def test_gpt_oss_and_llama4_experts_on_kerngen_arguments():
    """The gate arguments and transposed weight views the integration hands kerngen.experts give transformers' own
    experts modules (run in fp64) for gpt-oss (interleaved gate/up, biases, its clamped gate) and Llama-4 (gate
    then up, its experts fed rows grouped by expert), within the bf16 tolerance of the fused path."""
    import copy

    import kerngen
    from kerngen.ops import experts as ex
    from kerngen.ops import permute as pm
    for case in ("gpt_oss", "llama4_text"):
        model = tiny(case).to(torch.bfloat16)
        block = moe_blocks(model)[0]
        e = block.experts
        gate = kx.kernel_gate(e)
        w13, w2 = kx.expert_weights(e)
        assert kx.weights_layout(e) == "kn" and ex.weights_layout(w13, w2, "bf16") == "kn"
        assert w13.data_ptr() == e.gate_up_proj.data_ptr()           # views: nothing copied
        E, H = w13.shape[0], w13.shape[-1]
        with torch.no_grad():
            e.gate_up_proj.normal_(0, H ** -0.5)
            e.down_proj.normal_(0, w2.shape[-1] ** -0.5)
            if getattr(e, "has_bias", False):
                e.gate_up_proj_bias.normal_(0, 0.1)
                e.down_proj_bias.normal_(0, 0.1)
        e64 = copy.deepcopy(e).double()
        g = torch.Generator().manual_seed(0)
        if case == "gpt_oss":
            assert gate == dict(activation="gpt_oss", interleaved=True, alpha=e.alpha, limit=e.limit)
            T = 11
            x = torch.randn(T, H, generator=g).to(torch.bfloat16)
            ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)]).int()
            with torch.no_grad():   # the module's own per-expert loop, unweighted: one expert row per (t, k)
                exact = torch.stack([e64(x.double(), ids[:, k:k + 1].long(), torch.ones(T, 1, dtype=torch.float64))
                                     for k in range(2)], 1)
            r = kerngen.Routing(ids, torch.ones(T, 2), **pm.permute_reference(ids, E, 8))
            rows = experts_on_cpu(x, r, w13, w2, b13=e.gate_up_proj_bias.data, b2=e.down_proj_bias.data, **gate)
        else:
            assert gate == dict(activation="silu", interleaved=False)
            n = 3   # Llama4TextExperts.forward takes n rows of each expert in turn
            x = torch.randn(E * n, H, generator=g).to(torch.bfloat16)
            ids = (torch.arange(E * n) // n).int()[:, None]
            with torch.no_grad():
                exact = e64(x.double())[:, None]
            r = kerngen.Routing(ids, torch.ones(E * n, 1), **pm.permute_reference(ids, E, 8))
            rows = experts_on_cpu(x, r, w13, w2, **gate)
        ours = rows[r.expanded_to_permuted.long()]
        assert rel_err(ours.double(), exact) <= TOL_FUSED, case


@pytest.mark.parametrize("case", ["gpt_oss", "llama4_text"])
def test_transposed_weights_are_stored_as_kerngen_reads_them(case, tmp_path):
    """enable keeps a transposed family's expert weights (the same Parameters, shapes, values and memory) and stores them as
    kerngen.experts reads them fastest: their [E, 2I, H] / [E, H, I] views contiguous ("nk", every rule serves
    them); the block gives transformers' result; enable again changes nothing; disable makes them row-major again
    (transformers' own block bit for bit); relayout=False leaves them as they are ("kn"). `.to()` keeps the layout;
    save_pretrained writes them row-major."""
    model = tiny(case).to(torch.bfloat16)
    block = moe_blocks(model)[0]
    e = block.experts
    names = ("gate_up_proj", "down_proj")
    params = {n: getattr(e, n) for n in names}
    before = {n: p.detach().clone() for n, p in params.items()}
    ptrs = {n: p.data_ptr() for n, p in params.items()}
    assert kx.weights_layout(e) == "kn"
    x = inputs(model, 5, torch.bfloat16)
    ref = run_block(block, x)
    for _ in range(2):
        kt.enable(model)
        for n in names:
            p = getattr(e, n)
            assert p is params[n] and torch.equal(p, before[n]) and not p.is_contiguous()
            assert p.data_ptr() == ptrs[n]   # in place: a CUDA graph captured before reads the same memory
        assert kx.weights_layout(e) == "nk" and all(w.is_contiguous() for w in kx.expert_weights(e))
        assert rel_err(run_block(block, x), ref) <= TOL[torch.bfloat16]
    strides = e.gate_up_proj.stride()
    assert model.float().to(torch.bfloat16) is model and e.gate_up_proj.stride() == strides   # .to() keeps them
    model.save_pretrained(tmp_path)   # row-major on disk, the same values loaded back
    e2 = moe_blocks(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16))[0].experts
    assert all(getattr(e2, n).is_contiguous() and torch.equal(getattr(e2, n), before[n]) for n in names)
    kt.disable(model)
    assert all(getattr(e, n).is_contiguous() and torch.equal(getattr(e, n), before[n]) for n in names)
    assert torch.equal(run_block(block, x), ref)
    kt.enable(model, relayout=False)
    assert kx.weights_layout(e) == "kn" and all(getattr(e, n).is_contiguous() for n in names)
    kt.disable(model)


def test_relayout_without_memory_or_with_other_strides_keeps_the_layout(monkeypatch):
    """Where one expert's buffer cannot be had, or a weight is neither row-major nor kerngen's layout, the module's
    weights stay as they are (read in place: "kn"), with a warning naming the module; nothing is half moved."""
    model = tiny("gpt_oss").to(torch.bfloat16)
    e = moe_blocks(model)[0].experts
    before = {n: getattr(e, n).detach().clone() for n in ("gate_up_proj", "down_proj")}
    one = e.gate_up_proj[0].numel()
    real = torch.empty

    def empty(*size, **kw):
        if size in ((one,), ((one,),)):
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return real(*size, **kw)
    monkeypatch.setattr(torch, "empty", empty)
    with pytest.warns(RuntimeWarning, match="GptOssExperts's weights kept as they are .no memory"):
        kt.enable(model)
    monkeypatch.undo()
    assert all(getattr(e, n).is_contiguous() and torch.equal(getattr(e, n), t) for n, t in before.items())
    assert kx.weights_layout(e) == "kn" and "_kerngen_relayout" not in e.__dict__
    kt.disable(model)
    with torch.no_grad():   # every other value of a twice-as-wide tensor: neither layout
        e.down_proj.data = torch.stack([e.down_proj.data, e.down_proj.data], dim=-1).flatten(-2)[..., ::2]
    with pytest.warns(RuntimeWarning, match="neither row-major nor the transpose"):
        kt.enable(model)
    assert torch.equal(e.down_proj, before["down_proj"]) and e.gate_up_proj.is_contiguous()
    kt.disable(model)


def test_relayout_leaves_tensor_subclasses_as_they_are():
    """A weight that is a tensor subclass (a DTensor shard under tensor parallelism) is not relaid out."""
    class Sharded(torch.Tensor):
        pass
    model = tiny("gpt_oss").to(torch.bfloat16)
    e = moe_blocks(model)[0].experts
    e.gate_up_proj = torch.nn.Parameter(e.gate_up_proj.data.as_subclass(Sharded))
    kt.enable(model)
    assert e.gate_up_proj.is_contiguous() and e.down_proj.is_contiguous() and kx.weights_layout(e) == "kn"
    kt.disable(model)


@pytest.mark.parametrize("call, arg", [
    (lambda: kt.enable(None), "model"), (lambda: kt.enable("qwen3"), "model"), (lambda: kt.disable(3), "model"),
    (lambda: kt.enable(torch.nn.Linear(2, 2), routers="yes"), "routers"),
    (lambda: kt.enable(torch.nn.Linear(2, 2), graphs="maybe"), "graphs"),
    (lambda: kt.enable(torch.nn.Linear(2, 2), graphs=1), "graphs"),
    (lambda: kt.enable(torch.nn.Linear(2, 2), relayout=None), "relayout"),
])
def test_enable_and_disable_name_a_wrong_argument(call, arg):
    """Not a module, or a flag that is not a bool, is kerngen's InputError naming it (a model of None once reached
    named_modules: AttributeError), before anything is patched."""
    from kerngen.errors import InputError
    with pytest.raises(InputError) as e:
        call()
    assert e.value.arg == arg
