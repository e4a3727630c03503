#!/usr/bin/env python3
"""End-to-end eager decode: greedy `model.generate()` of transformers 5 MoE models, transformers' own experts
implementation ("grouped_mm") against kerngen (`kerngen.integrations.transformers.enable`), same model object,
same weights, same prompt, one process.

    python3 -m tools.bench.generate [--models qwen3-30b-a3b,deepseek-v3,gpt-oss-120b] [--batch 1,8]
                                    [--new-tokens 64] [--prompt 16] [--layers N] [--impl grouped_mm,kerngen]
                                    [--device cuda] [--compile] [--vocab 32000] [--repeats 1]
                                    [--rounds 1] [--host-hooks]
    python3 -m tools.bench.generate --device cpu --tiny --layers 1 --new-tokens 4     # CPU smoke run

Models: built from a transformers config (Qwen3MoeConfig, DeepseekV3Config, GptOssConfig) at the public
checkpoints' dimensions (CONFIGS below; --tiny: small made-up dimensions of the same structure), with only
--layers decoder layers (default per model: DEFAULT_LAYERS; DeepSeek-V3's first_k_dense_replace is 1 where
there are 2 layers or more, else 0, so MoE layers are always present), the vocabulary reduced to --vocab
(default 32000; the real ones are 151936 / 129280 / 201088: only the embedding and LM head shrink), default RoPE
(no YaRN), bf16, random weights from transformers' own initialisation (normal, std --init-std, seed --seed;
DeepSeek's correction bias N(0, 0.05)) so logits are of a sane size (--dtype float32 for exact comparisons).
Nothing is downloaded.

Timing: per (model, batch, impl), one warm-up `generate` and then --repeats timed ones (the best), wall clock
between torch.cuda.synchronize() calls: B * new_tokens / seconds, prefill of the --prompt tokens included.
Eager: the default dynamic cache, no torch.compile. --compile: transformers' compiled decode (a static cache,
which makes generate() torch.compile the forward on CUDA, "reduce-overhead": CUDA graphs; a fresh compile per
impl), best effort: a failure is reported in the row. The static cache is one StaticCache an impl, passed to every
generate() call (`cache=`) and reset before each. With cache_implementation="static" instead (--fresh-cache)
generate() allocates a new cache each call, whose new addresses make the CUDA graphs (recorded on the cache's
addresses) record again in each call, and a short run times those recordings too.

--rounds N: the impls timed N times each, round after round, every other round in the opposite order (the host of
a GPU machine drifts and differs from run to run): a row's tokens/s is the median of its rounds and its ratio the
median of the rounds' ratios (each against the first impl's time in the same round), the rounds' ratios in the note.
--host-hooks: the host time of each call of the MoE blocks (the module holding the experts) and of the attention
modules during the timed calls (forward hooks, no synchronisation: the Python and launch cost of the call), their
medians in the note.

Greedy ids: every impl's new tokens compared with the first impl's: equal sequences out of B, and the first
position (0-based, among the new tokens) where any sequence differs. Random-weight logits are close to each
other, so a one-ulp difference in a layer's output (kerngen accumulates the top-k sum in fp32; transformers in
the weights' dtype) can flip an argmax; equal router scores are broken towards the lower expert index by kerngen
and as torch.topk happens to by transformers: with bf16 router logits (Qwen3-MoE, gpt-oss) two experts tie
now and then (bf16 has 8 significant bits), and from there the two runs may pick different experts.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback

import torch

IMPLS = ("grouped_mm", "kerngen")
KERNGEN_IMPLS = {"kerngen": None, "kerngen-eager": False}   # impl -> enable's graphs

# name: (transformers config class, the public checkpoint's dimensions, tiny dimensions of the same structure)
CONFIGS = {
    "qwen3-30b-a3b": ("Qwen3MoeConfig",
                      dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=32, num_key_value_heads=4,
                           head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
                           tie_word_embeddings=False),
                      dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
                           tie_word_embeddings=False)),
    "deepseek-v3": ("DeepseekV3Config",
                    dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                         num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
                         routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
                         v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
                         norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False),
                    dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4,
                         num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=2.5,
                         kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                         n_group=4, topk_group=2, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
                         tie_word_embeddings=False)),
    "gpt-oss-120b": ("GptOssConfig",
                     dict(hidden_size=2880, intermediate_size=2880, num_local_experts=128, num_experts_per_tok=4,
                          num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
                          rms_norm_eps=1e-5, attention_bias=True, swiglu_limit=7.0, tie_word_embeddings=False),
                     dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                          rms_norm_eps=1e-5, attention_bias=True, swiglu_limit=7.0, tie_word_embeddings=False)),
}
# Decoder layers by default: a few, MoE ones included (deepseek-v3: 1 dense + 2 MoE, ~46 GB of bf16 weights)
DEFAULT_LAYERS = {"qwen3-30b-a3b": 4, "deepseek-v3": 3, "gpt-oss-120b": 4}


def make_config(name: str, layers: int, vocab: int, tiny: bool = False, init_std: float = 0.02):
    """The transformers config of model `name` with `layers` decoder layers and a `vocab`-token vocabulary."""
    import transformers
    cls_name, real, small = CONFIGS[name]
    kw = dict(small if tiny else real, num_hidden_layers=layers, vocab_size=vocab, initializer_range=init_std,
              max_position_embeddings=4096, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    if name == "deepseek-v3":
        kw["first_k_dense_replace"] = 1 if layers >= 2 else 0
    if name == "gpt-oss-120b":   # alternating sliding / full attention, sliding first, as the checkpoint
        kw["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    return getattr(transformers, cls_name)(**kw)


def build_model(name: str, layers: int, vocab: int, device: str, tiny: bool = False, seed: int = 0,
                init_std: float = 0.02, dtype=torch.bfloat16):
    """transformers' causal LM of model `name`, random weights (transformers' init, seeded), eval, on `device`."""
    from transformers import AutoModelForCausalLM
    cfg = make_config(name, layers, vocab, tiny, init_std)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model = model.to(device).eval()
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    with torch.no_grad():
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):   # zeros from the init; the checkpoint's are not
                b.copy_(torch.randn(b.shape, generator=gen, device=device, dtype=torch.float32) * 0.05)
        for n, p in model.named_parameters():
            if not torch.isfinite(p).all():
                raise RuntimeError(f"{name}: parameter {n} is not initialised (non-finite values)")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def moe_layers(model) -> int:
    return sum(1 for m in model.modules() if hasattr(m, "gate_up_proj") or type(m).__name__.endswith("Experts"))


def use(model, impl: str) -> list[str]:
    """Switch every MoE block of `model` to `impl`: "kerngen" (routers and experts; its blocks' decode forwards
    replayed from CUDA graphs, enable's default), "kerngen-eager" (the same, every launch from the host:
    graphs=False) or one of transformers' experts implementations ("grouped_mm", "eager", ...) with transformers'
    routers. Returns the modules kerngen patched (none for transformers' implementations)."""
    import kerngen.integrations.transformers as kt
    kt.disable(model)
    ours = impl in KERNGEN_IMPLS
    _set_experts(model, "grouped_mm" if ours else impl)   # kerngen: what disable() restores
    if not ours:
        return []
    names = kt.enable(model, graphs=KERNGEN_IMPLS[impl])
    if not names:
        raise RuntimeError("kerngen.integrations.transformers.enable patched nothing")
    return names


def _set_experts(model, impl: str) -> None:
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(impl)
    else:   # a transformers 5 without the setter: the attribute it sets
        for m in model.modules():
            if getattr(m, "config", None) is not None and hasattr(m.config, "_experts_implementation_internal"):
                m.config._experts_implementation_internal = impl


def sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def generate(model, ids, new_tokens: int, compiled: bool, cache=None):
    """Greedy generate() of `new_tokens` tokens; compiled: transformers' compiled decode on `cache` (a StaticCache,
    reset first) or, without one, on a static cache generate() allocates itself."""
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False, pad_token_id=0)
    if compiled and cache is not None:
        cache.reset()
        kw["cache"] = cache
    elif compiled:
        kw["cache_implementation"] = "static"
    else:
        kw["disable_compile"] = True
    with torch.no_grad():
        return model.generate(ids, **kw)


def static_cache(model, tokens: int):
    """A StaticCache of `tokens` positions for `model` (allocated on its first use, then reused by every call)."""
    from transformers import StaticCache
    return StaticCache(config=model.config.get_text_config(decoder=True), max_cache_len=tokens)


def reset_compiled(model) -> None:
    model.__dict__.pop("_compiled_call", None)
    model.__dict__.pop("_last_compile_config", None)
    torch._dynamo.reset()


def host_hooks(model) -> tuple[dict[str, list[float]], list]:
    """Forward hooks timing each call's host seconds of the MoE blocks (each module holding an experts module) and
    the attention modules: ({"block": [...], "attn": [...]}, the hook handles)."""
    times: dict[str, list[float]] = {"block": [], "attn": []}
    groups = {"block": [m for m in model.modules()
                        if any(type(c).__name__.endswith("Experts") for c in m.children())],
              "attn": [m for m in model.modules() if type(m).__name__.endswith("Attention")]}
    handles = []
    for key, mods in groups.items():
        for m in mods:
            start = [0.0]
            handles.append(m.register_forward_pre_hook(
                lambda mod, args, s=start: s.__setitem__(0, time.perf_counter())))
            handles.append(m.register_forward_hook(
                lambda mod, args, out, s=start, k=key: times[k].append(time.perf_counter() - s[0])))
    return times, handles


def time_impl(model, impl, ids, new_tokens, compiled, repeats, device, hooks: bool = False,
              fresh_cache: bool = False) -> dict:
    """One row: tokens/s of `impl` (best of `repeats` after a warm-up) and its generated ids; with `hooks` the
    median host µs of a MoE block's and an attention module's call during the timed calls; compiled: one static
    cache for all of its calls unless `fresh_cache`."""
    patched = use(model, impl)
    cache = None
    if compiled:
        reset_compiled(model)
        cache = None if fresh_cache else static_cache(model, ids.shape[1] + new_tokens)
    out = generate(model, ids, new_tokens, compiled, cache)   # warm-up (compiles, builds kernels, fills caches)
    sync(device)
    times, handles = host_hooks(model) if hooks else ({}, [])
    best = float("inf")
    try:
        for _ in range(repeats):
            t = time.perf_counter()
            out = generate(model, ids, new_tokens, compiled, cache)
            sync(device)
            best = min(best, time.perf_counter() - t)
    finally:
        for h in handles:
            h.remove()
    new = out[:, ids.shape[1]:].cpu()
    if new.shape[1] != new_tokens:
        raise RuntimeError(f"generated {new.shape[1]} tokens, asked for {new_tokens}")
    row = dict(seconds=best, tok_s=ids.shape[0] * new_tokens / best, ids=new, patched=len(patched))
    row.update({f"{k}_us": statistics.median(v) * 1e6 for k, v in times.items() if v})
    return row


def compare(ref: torch.Tensor, ids: torch.Tensor) -> tuple[int, int | None]:
    """(sequences equal to ref, first differing position among the new tokens or None)."""
    same = (ref == ids)
    equal = int(same.all(dim=1).sum())
    diff = (~same).any(dim=0).nonzero()
    return equal, (int(diff[0]) if diff.numel() else None)


def prompt_ids(batch: int, prompt: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """The random prompt of a batch: [batch, prompt] ids in [1, vocab) (0 is the pad id)."""
    return torch.randint(1, vocab, (batch, prompt), generator=torch.Generator().manual_seed(seed + batch))


def run(a) -> list[dict]:
    rows = []
    for name in a.models:
        layers = a.layers or (1 if a.tiny else DEFAULT_LAYERS[name])
        try:
            model = build_model(name, layers, a.vocab, a.device, a.tiny, a.seed, a.init_std, getattr(torch, a.dtype))
        except Exception as e:   # reported, the other models still run
            rows.append(dict(model=name, layers=layers, batch=None, impl="-", note=f"build failed: {_err(e)}"))
            print(f"{name}: build failed: {_err(e)}", file=sys.stderr, flush=True)
            continue
        n_moe = moe_layers(model)
        for B in a.batch:
            ids = prompt_ids(B, a.prompt, a.vocab, a.seed).to(a.device)
            rounds: dict[str, list[dict]] = {impl: [] for impl in a.impl}
            for rnd in range(a.rounds):
                for impl in (a.impl if rnd % 2 == 0 else a.impl[::-1]):
                    got = dict(note="")
                    try:
                        got.update(time_impl(model, impl, ids, a.new_tokens, a.compile, a.repeats, a.device,
                                             a.host_hooks, a.fresh_cache))
                    except Exception as e:   # reported in the row, never dropped
                        got["note"] = f"{'compile ' if a.compile else ''}failed: {_err(e)}"
                        if a.traceback:
                            traceback.print_exc()
                    rounds[impl].append(got)
                    print(f"  {name} B={B} {impl}" + (f" round {rnd}" if a.rounds > 1 else "") + ": "
                          + (f"{got['tok_s']:.1f} tok/s" if "tok_s" in got else got["note"]), file=sys.stderr,
                          flush=True)
            rows.extend(merge_rounds(dict(model=name, layers=layers, moe_layers=n_moe, batch=B), rounds))
        use(model, a.impl[0] if a.impl[0] not in KERNGEN_IMPLS else "grouped_mm")
        del model
        if torch.device(a.device).type == "cuda":
            torch.cuda.empty_cache()
    return rows


def merge_rounds(base: dict, rounds: dict[str, list[dict]]) -> list[dict]:
    """One row an impl from its rounds (impl -> one result a round, the first impl first): tokens/s the median of
    its rounds, ids those of its last round compared with the first impl's, ratio the median of the rounds' ratios
    to the first impl's tokens/s in the same round; a round that failed fails the row."""
    ref_impl = next(iter(rounds))
    out = []
    for impl, res in rounds.items():
        row = dict(base, impl=impl, note="")
        failed = [r["note"] for r in res if "tok_s" not in r]
        if failed:
            row["note"] = failed[0]
            out.append(row)
            continue
        row.update({k: v for k, v in res[-1].items() if k not in ("tok_s", "seconds", "note")})
        row["tok_s"] = statistics.median(r["tok_s"] for r in res)
        for k in ("block_us", "attn_us"):
            if all(k in r for r in res):
                row[k] = statistics.median(r[k] for r in res)
        ref = rounds[ref_impl]
        if all("tok_s" in r for r in ref):
            ratios = [r["tok_s"] / q["tok_s"] for r, q in zip(res, ref)]
            row["ratio"] = statistics.median(ratios)
            row["equal"], row["first_diff"] = compare(ref[-1]["ids"], row["ids"])
            if len(res) > 1:
                row["note"] = "rounds " + " / ".join(f"{x:.2f}" for x in ratios)
        else:
            row["note"] = f"{ref_impl} failed"
        if "block_us" in row:
            row["note"] = (row["note"] + "; " if row["note"] else "") + \
                f"host µs a call: MoE block {row['block_us']:.1f}, attention {row.get('attn_us', float('nan')):.1f}"
        out.append(row)
    return out


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:120]}"


def table(rows: list[dict], ref_impl: str) -> str:
    head = (f"| model | layers (MoE) | batch | impl | tokens/s | × {ref_impl} | greedy ids = {ref_impl} "
            "| first diff | note |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        has = "ratio" in r
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} | {} |".format(
            r["model"], f"{r['layers']} ({r.get('moe_layers', '-')})", r.get("batch") or "-", r["impl"],
            f"{r['tok_s']:.1f}" if "tok_s" in r else "-", f"{r['ratio']:.2f}" if has else "-",
            f"{r['equal']}/{r['batch']}" if has else "-",
            ("-" if r.get("first_diff") is None else r["first_diff"]) if has else "-", r.get("note", "")))
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(CONFIGS))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=16, help="prompt tokens (random ids)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default: per model, see the doc)")
    ap.add_argument("--impl", default=",".join(IMPLS),
                    help="comma list: kerngen, kerngen-eager (no block graphs) and transformers' experts "
                         "implementations (grouped_mm, eager)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile", action="store_true", help="transformers' compiled decode (static cache)")
    ap.add_argument("--fresh-cache", action="store_true",
                    help="--compile: a new static cache each generate() call (cache_implementation='static'), "
                         "not one cache an impl reused")
    ap.add_argument("--tiny", action="store_true", help="small made-up dimensions (CPU smoke run)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 32000; --tiny 512)")
    ap.add_argument("--repeats", type=int, default=1, help="timed generate() calls after the warm-up (best)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the impls this many times, alternating their order (medians; see the doc)")
    ap.add_argument("--host-hooks", action="store_true",
                    help="the median host µs of a MoE block's and an attention module's call (see the doc)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--traceback", action="store_true", help="print the whole traceback of a failed row")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="the model's dtype (float32: no equal bf16 router scores, for exact id comparisons)")
    ap.add_argument("--init-std", type=float, default=None, help="weights' std (default 0.02; --tiny 0.1)")
    a = ap.parse_args(argv)
    a.models = a.models.split(",")
    for n in a.models:
        if n not in CONFIGS:
            ap.error(f"unknown model {n!r}; known: {', '.join(CONFIGS)}")
    try:
        a.batch = [int(b) for b in a.batch.split(",")]
    except ValueError:
        ap.error(f"--batch: a comma list of integers, got {a.batch!r}")
    a.impl = a.impl.split(",")
    if a.vocab is None:
        a.vocab = 512 if a.tiny else 32000
    if a.init_std is None:
        a.init_std = 0.1 if a.tiny else 0.02
    if (min(a.batch) < 1 or a.new_tokens < 1 or a.prompt < 1 or (a.layers is not None and a.layers < 1)
            or a.rounds < 1 or a.repeats < 1):
        ap.error("--batch, --new-tokens, --prompt, --layers, --rounds and --repeats are positive")
    if torch.device(a.device).type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA GPU here (torch.cuda.is_available() is False); use --device cpu --tiny")
    if a.fresh_cache and not a.compile:
        ap.error("--fresh-cache: a static cache is --compile's (eager decode takes the dynamic cache)")
    if a.compile and torch.device(a.device).type != "cuda":
        ap.error("--compile: transformers compiles generate()'s forward on CUDA only")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    try:
        import transformers
        import kerngen.integrations.transformers  # noqa: F401  (registers the "kerngen" experts implementation)
    except ImportError as e:
        print(f"generate: needs transformers 5 ({e})", file=sys.stderr)
        return 2
    dev = torch.cuda.get_device_name() if torch.device(a.device).type == "cuda" else "CPU"
    print(f"{dev}, torch {torch.__version__}, transformers {transformers.__version__}, {a.dtype}, "
          f"{'tiny dims' if a.tiny else 'real dims'}, vocab {a.vocab}, prompt {a.prompt}, "
          f"{a.new_tokens} new tokens, greedy, {'compiled (static cache)' if a.compile else 'eager'}, "
          f"best of {a.repeats} after 1 warm-up" + (f", median of {a.rounds} rounds" if a.rounds > 1 else "")
          + "\n", flush=True)
    rows = run(a)
    print(table(rows, a.impl[0]), flush=True)
    return 1 if any("tok_s" not in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
