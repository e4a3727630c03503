"""kerngen command line: warmup, explain, tune, tiers, cache."""
from __future__ import annotations

import argparse
import difflib
import os
import sys

# Nothing imported here imports torch: the op modules (warmup.op_module) are imported once the model and the
# target are checked, so a wrong argument is refused at once.
from . import cache as cache_mod
from . import env, jit, tiers, trust, warmup
from . import ops as op_registry
from .errors import CacheError, InputError, KerngenError, TierError
from .plan import VERSION

def shape_ops() -> tuple[str, ...]:
    """The ops `explain --op` and `warmup --op` know: the registry's (kerngen.ops.OPS, read at each call)."""
    return op_registry.OPS


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _table(args) -> tiers.Table:
    return tiers.load(args.tiers) if getattr(args, "tiers", None) else tiers.load()


def _model(tbl: tiers.Table, name: str) -> tiers.Model:
    """The model `name`; a misspelt one is a TierError that names the closest known names first."""
    try:
        return tbl.model(name)
    except TierError as e:
        close = difflib.get_close_matches(name, list(tbl.models), n=3, cutoff=0.6)
        if not close:
            raise
        hint, text = f"did you mean {' or '.join(repr(c) for c in close)}?", str(e)
        head = f"unknown model '{name}'"
        raise TierError(text.replace(head, f"{head} ({hint})", 1) if head in text else f"{hint} {text}") from None


def _arches(text: str | None) -> list[str]:
    """The compile targets of --arch (else KERNGEN_ARCH, else sm_90a), each one kerngen builds for."""
    if text is None:
        where = "KERNGEN_ARCH" if os.environ.get("KERNGEN_ARCH", "").strip() else "--arch"
        return [env.check_supported(env.default_arch(), where)]
    arches = [env.check_arch(a.strip(), "--arch") for a in text.split(",") if a.strip()]
    if not arches:
        raise InputError("command line", "--arch", "one or more targets, comma separated, e.g. sm_90a", repr(text))
    return [env.check_supported(a, "--arch") for a in dict.fromkeys(arches)]


def _ops(text: str | None) -> tuple[str, ...]:
    ops = tuple(o.strip() for o in text.split(",")) if text else op_registry.OPS
    for op in ops:
        if op not in op_registry.OPS:
            raise InputError("warmup", "--ops", f"a comma separated subset of {','.join(op_registry.OPS)}",
                             repr(text))
    return ops


def _differences(specs) -> dict:
    """For kernels whose keys read the same but for the hash (one op, variant, shape and arch, other params or
    constants), the values that tell them apart, e.g. "warps=8 max_tokens=16"; others get ""."""
    groups: dict[tuple, list] = {}
    for s in specs:
        groups.setdefault((s.op, s.variant, s.tag, s.arch), []).append(s)
    out = {}
    for group in groups.values():
        values = [{**dict(s.constants), **dict(s.params)} for s in group]   # a param left out reads "unset"
        names = list(dict.fromkeys(k for v in values for k in v))
        differ = [k for k in names if len({repr(v.get(k, "unset")) for v in values}) > 1]
        for s, v in zip(group, values):
            out[s] = " ".join(f"{k}={v.get(k, 'unset')}" for k in differ) if len(group) > 1 else ""
    return out


def cmd_warmup(args) -> int:
    tbl = _table(args)
    names = sorted(tbl.models) if args.all else list(dict.fromkeys(args.model or []))
    if not names and not args.op and not args.spec:
        print("kerngen warmup: give --model NAME (repeatable), --all, --op with a shape, or --spec", file=sys.stderr)
        return 2
    models = [_model(tbl, name) for name in names]
    ops = _ops(args.ops)
    from .plan import KernelSpec
    specs = [KernelSpec.from_json(text) for text in args.spec or []]
    for s in specs:
        env.check_supported(s.arch, "--spec")
    arches = _arches(args.arch) if not args.spec else []
    for arch in arches:
        if args.op:  # one shape's kernel, e.g. the one a strict-mode miss names
            specs.append(_shape_spec("warmup", args, tbl, arch, args.op)[0])
            continue
        for model in models:
            specs += warmup.model_specs(model, tbl, arch, ops)
    specs = list(dict.fromkeys(specs))
    names = names or [_plural(len(specs), "kernel")]
    store = cache_mod.default()
    if found := trust.root_problem(store.root):
        raise CacheError(f"warmup: {trust.refusal(store.root, *found)}; nothing was compiled")
    if problem := store.write_problem():
        print(f"kerngen warmup: cache directory {store.root} cannot be written ({problem}): the kernels it holds "
              "are used, the ones it lacks are compiled but cannot be stored. Make it writable, or set "
              "KERNGEN_CACHE_DIR to a writable directory", file=sys.stderr, flush=True)
    jobs = args.jobs or min(len(specs), os.cpu_count() or 1)
    results, secs = warmup.timed(warmup.run, specs, str(store.root), jobs, progress=not args.quiet)
    differ = _differences([r.spec for r in results])
    for r in results:
        print(f"  {r.status:9s} {r.key or r.spec.op + '-' + r.spec.variant}"
              + (f"  [{differ[r.spec]}]" if differ[r.spec] else "")
              + (f"  ({r.seconds:.2f}s{'' if r.stored else ', not stored'})" if r.status == "compiled" else "")
              + (f"\n    {r.error}" if r.error else ""))
        for line in r.usage:
            print(f"    {line}")
    for why in dict.fromkeys(r.usage_error for r in results if r.usage_error):
        print(f"kerngen warmup: registers and CTAs an SM not shown: {why}")
    return _report(results, names, arches or sorted({s.arch for s in specs}), secs, store.root)


def _report(results, names, arches, secs, root) -> int:
    """The summary line; the exit status is 1 when a kernel failed or the cache did not get one compiled."""
    n = {s: sum(r.status == s for r in results) for s in ("compiled", "cached", "failed")}
    lost = [r for r in results if r.status == "compiled" and not r.stored]
    print(f"kerngen warmup {', '.join(names)} [{', '.join(arches)}]: {_plural(len(results), 'kernel')}, "
          f"{n['compiled']} compiled ({n['compiled'] - len(lost)} stored), {n['cached']} cached, {n['failed']} failed "
          f"in {secs:.1f}s -> {root}")
    if lost:
        print(f"kerngen warmup: {len(lost)} of {_plural(n['compiled'], 'compiled kernel')} could not be stored in "
              f"{root} ({lost[0].note}); the cache lacks them. Free space or make it writable and run this again, "
              "or set KERNGEN_CACHE_DIR to a writable directory", file=sys.stderr)
    return 1 if n["failed"] or lost else 0


def _shape(args, tbl: tiers.Table) -> dict:
    """The shape flags as plain values (a --model fills experts, top_k, hidden and the experts' intermediate
    size and activation from the tier table)."""
    model = args.model[0] if isinstance(args.model, list) else args.model
    shape = {"experts": args.experts, "top_k": args.topk, "hidden": args.hidden, "tokens": args.tokens,
             "dtype": args.dtype, "weights_dtype": args.weights_dtype, "model": model,
             "intermediate": args.intermediate, "activation": args.activation,
             "experts_format": getattr(args, "experts_format", None)}
    if model:
        m = _model(tbl, model)
        shape.update(experts=m.num_experts, top_k=m.top_k, hidden=m.hidden,
                     intermediate=getattr(m, "intermediate", 0) or args.intermediate,
                     activation=getattr(m, "activation", args.activation))
    return shape


def _explainer(cmd: str, op: str):
    """kerngen.ops.<op>.explain_spec, or an InputError naming the ops that have one."""
    fn = getattr(warmup.op_module(op), "explain_spec", None)
    if fn is None:
        known = [o for o in shape_ops() if getattr(warmup.op_module(o), "explain_spec", None)]
        raise InputError(cmd, "--op", f"one of {', '.join(known)} (kerngen.ops.{op} cannot name one shape's kernel "
                         "yet)", repr(op))
    return fn


def _shape_spec(cmd: str, args, tbl: tiers.Table, arch: str, op: str):
    """The one kernel a shape given on the command line (or a model's shape at --tokens) dispatches to, and
    that shape."""
    shape = _shape(args, tbl)
    _check_shape(cmd, op, shape)
    return _explainer(cmd, op)(tbl, arch, **shape), shape


def _check_shape(cmd: str, op: str, shape: dict) -> None:
    """The shape flags the op names (its declaration's shape: kerngen.ops.Op.shape), checked as the op checks its
    tensors: a shape the op would reject is not compiled."""
    where, needs = f"{cmd} --op {op}", op_registry.declared(op).shape
    for name in (n for n in FLAGS if n in needs):
        if shape[name] is None:
            others = " / ".join(FLAGS[n] for n in FLAGS if n in needs and n != "top_k")
            expected = {"top_k": f"given (or --model NAME), with {others} as the op needs",
                        "hidden": "given (or --model NAME)"}
            raise InputError(where, FLAGS[name], expected.get(name, "given (or --model NAME whose tier entry has it)"),
                             "none")
    topk, experts, hidden, tokens = shape["top_k"], shape["experts"], shape["hidden"], shape["tokens"]
    if "top_k" in needs:
        max_k = getattr(warmup.op_module(op), "MAX_K", tiers.MAX_TOPK)
        if not 1 <= topk <= max_k:
            raise InputError(where, "--topk", f"an integer in [1, {max_k}]", str(topk))
    if "experts" in needs and not topk <= experts <= tiers.MAX_EXPERTS:
        raise InputError(where, "--experts", f"an integer in [--topk = {topk}, {tiers.MAX_EXPERTS}]", str(experts))
    if "hidden" in needs and (hidden < 8 or hidden % 8 or hidden > tiers.INT32_MAX):
        raise InputError(where, "--hidden", "a multiple of 8, at least 8 (rows are read in 16-byte vectors)",
                         str(hidden))
    if not 1 <= tokens <= tiers.INT32_MAX:
        raise InputError(where, "--tokens", f"an integer in [1, {tiers.INT32_MAX}]", str(tokens))


FLAGS = {"top_k": "--topk", "experts": "--experts", "hidden": "--hidden", "intermediate": "--intermediate"}


def cmd_explain(args) -> int:
    tbl = _table(args)
    if not args.op and not args.model:
        raise InputError("explain", "--op", "given with its shape (or --model NAME: every op of the model)", "none")
    model = _model(tbl, args.model) if args.model else None   # a misspelt model is one error, not one per op
    arch = _arches(args.arch)[0]
    store = cache_mod.default()
    if args.op:
        _explain_one(args, tbl, arch, store, args.op)
        return 0
    for i, op in enumerate(shape_ops()):   # every op of the model, at --tokens
        print("" if i == 0 else "\n", end="")
        if not warmup.model_specs(model, tbl, arch, ops=[op]):   # (latent_tail: only latent MoE models)
            print(f"op        {op}\nnot used  {args.model} has no {op} kernel (warmup builds none for it)")
            continue
        try:
            _explain_one(args, tbl, arch, store, op)
        except KerngenError as e:
            print(f"op        {op}\nnot explained: {e}")
    return 0


def _explain_one(args, tbl: tiers.Table, arch: str, store: cache_mod.DiskCache, op: str) -> None:
    spec, shape = _shape_spec("explain", args, tbl, arch, op)
    own = getattr(warmup.op_module(op), "explain_rule", None)   # an op whose rules match more than these keys
    if own is not None:
        rule = own(tbl, arch, **shape)
    else:
        known = {"num_experts": shape["experts"], "top_k": shape["top_k"], "hidden": shape["hidden"],
                 "tokens": shape["tokens"], "arch": arch}
        rule = tbl.rule(op, {k: v for k, v in known.items() if v})   # a range without a value holds
    key = jit.key_of(spec)
    files = store.get(key, (tiers.BACKENDS[spec.backend].artifact,))
    print(f"op        {op}\ntier      {rule.source}\nvariant   {spec.variant} ({spec.backend})\n"
          f"params    {dict(spec.params)}\nconstants {dict(spec.constants)}\narch      {arch}\nkey       {key}\n"
          f"cached    {'yes' if files is not None else 'no'} ({store.root / key})")
    _explain_usage(spec, files, args.model)


def _explain_usage(spec, files, model: str | None = None) -> None:
    """One line per kernel function of a cached build (registers, shared memory, spills, CTAs an SM), read from
    the artifact; else how to build it (the warmup of `model` where it needs the kernel)."""
    if files is None:
        print(f"kernels   registers and CTAs an SM show once built: {warmup.warmup_command(spec, model)}")
        return
    try:
        rows = warmup.usage(spec, files)
    except KerngenError as e:
        print(f"kernels   registers and CTAs an SM not shown: {e}")
        return
    for u in rows:
        print(f"kernel    {u.line()}")


def cmd_tune(args) -> int:
    from . import tune
    from .ops._common import require_gpu
    names = [o.strip() for o in args.ops.split(",") if o.strip()]
    unknown = [o for o in names if o not in op_registry.tunable()]
    if unknown or not names:
        raise InputError("tune", "--ops", "a comma separated subset of " + ",".join(op_registry.tunable()),
                         args.ops if not unknown else ",".join(unknown))
    _model(tiers.load(), args.model)
    require_gpu("kerngen tune")   # it times candidates on this GPU
    tokens = args.tokens or tune.DEFAULT_TOKENS
    out = args.out or (str(env.user_tiers()) if env.user_tiers() else f"kerngen-tuned-{args.model}.toml")
    rules = tune.tune(args.model, names, tokens, progress=not args.quiet)
    tune.write(out, args.model, rules)
    for r in rules:
        print(f"  {r.op:9s} tokens {r.ranges['tokens'][0]}..{r.ranges['tokens'][1]:<6d} {r.variant:12s} {r.params}"
              f"  ({r.source})")
    print(f"wrote {_plural(len(rules), 'rule')} to {out}; use them with KERNGEN_TIERS={out} (warmup and dispatch)")
    return 0


def cmd_tiers(args) -> int:
    tbl = _table(args)
    print("files: " + ", ".join(tbl.files))
    print(f"{'model':20s} {'E':>5s} {'K':>3s} {'hidden':>6s}  routing")
    for name, m in sorted(tbl.models.items()):
        extra = f" n_group={m.n_group} topk_group={m.topk_group}" if m.n_group > 1 else ""
        print(f"{name:20s} {m.num_experts:5d} {m.top_k:3d} {m.hidden:6d}  {m.routing}{extra} "
              f"rsf={m.routed_scaling_factor:g}")
    print("rules:")
    for r in tbl.rules:
        rng = " ".join([f"{k}={lo}..{hi}" for k, (lo, hi) in r.ranges.items()]
                       + ([f"arch={','.join(r.arch)}"] if r.arch else [])) or "any shape"
        print(f"  {r.op:9s} {r.variant:22s} {rng:40s} {r.params}")
    return 0


def cmd_cache(args) -> int:
    store = cache_mod.DiskCache(env.cache_dir(), quiet=True)   # what is wrong is printed here
    keys = store.keys()
    if store.distrust():
        print(f"kerngen cache: {trust.refusal(store.root, store.refusal_reason, store.distrust())}",
              file=sys.stderr)
    if args.action == "ls":
        for k in keys:   # every checksum checked, nothing removed (that is verify's)
            meta = store.meta(k) or {}
            print(f"{k}  {store.check(k, _artifacts(meta)) or 'ok'}  {meta.get('compile_seconds', '?')}s")
        print(f"{len(keys)} {'entry' if len(keys) == 1 else 'entries'} in {store.root}")
    elif args.action == "verify":
        return _verify(store, keys)
    elif args.action == "clear":
        if keys and not store.is_marked():
            raise KerngenError(f"cache clear: {store.root} has no {cache_mod.MARKER} marker, so it is not provably a "
                               "kerngen cache; nothing was removed. Check KERNGEN_CACHE_DIR, or delete the entries "
                               "by hand")
        removed = sum(store.remove(k) for k in keys)
        print(f"removed {removed} {'entry' if removed == 1 else 'entries'} from {store.root}")
    return 1 if store.refusal_reason == "unusable" else 0


def _artifacts(meta: dict | None) -> tuple[str, ...]:
    """The artifact an entry's backend needs (as its loader would ask for it), by its meta.json."""
    backend = tiers.BACKENDS.get((meta or {}).get("backend"))
    return (backend.artifact,) if backend else ()


def _verify(store: cache_mod.DiskCache, keys: list[str]) -> int:
    """Check every entry's checksums (and that it holds its backend's artifact); bad ones are removed where the
    cache may remove them."""
    bad = removed = 0
    for k in keys:
        if store.get(k, _artifacts(store.meta(k))) is None and store.miss_reason.get(k) != "building":
            gone = not os.path.lexists(store.root / k)
            bad, removed = bad + 1, removed + gone
            print(f"  {k}  {store.miss_reason.get(k)}{'  (removed)' if gone else ''}")
    why = "" if store.is_marked() or not bad else f"; {store.root} has no {cache_mod.MARKER} marker, so none is removed"
    print(f"{len(keys) - bad} ok, {bad} bad, {removed} removed in {store.root}{why}")
    return 1 if bad or store.refusal_reason == "unusable" else 0


def _at_least(lo: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = lo - 1
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be an integer >= {lo}, got {text!r}")
        return v
    return parse


def _token_list(text: str) -> list[int]:
    return [_at_least(1)(t.strip()) for t in text.split(",")]


def _shape_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("one shape (--op), or with --model its shape at --tokens")
    g.add_argument("--op", choices=shape_ops(), help="the op whose kernel for this shape is meant")
    g.add_argument("--experts", type=int, help="number of routed experts E (routing, permute)")
    g.add_argument("--topk", "--top-k", dest="topk", type=int,
                   help="experts per token K (routing, permute, finalize, tail)")
    g.add_argument("--hidden", type=int, help="hidden size H, a multiple of 8 (finalize, tail, experts)")
    g.add_argument("--intermediate", type=int, help="the experts' intermediate size I (experts)")
    g.add_argument("--activation", default="silu", choices=tiers.EXPERT_ACTIVATIONS, help="the experts' gate (experts)")
    g.add_argument("--experts-format", choices=tiers.RULE_FORMATS,
                   help="the experts' weight format (experts; default: the --model's, else bf16); w8a8: fp8 weights "
                   "with fp8 activations")
    g.add_argument("--tokens", type=_at_least(1), default=1,
                   help="token count T the kernel is dispatched for (default 1)")
    g.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"), help="activation dtype")
    g.add_argument("--weights-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="dtype of the top-k weights")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kerngen", description=__doc__)
    p.add_argument("--version", action="version", version=f"kerngen {VERSION}")
    sub = p.add_subparsers(dest="cmd", metavar="{warmup,explain,tune,tiers,cache}")
    arch_help = (f"target(s), comma separated: {', '.join(env.SUPPORTED)} (default: KERNGEN_ARCH or sm_90a)")
    w = sub.add_parser("warmup", help="precompile the kernels of models into the cache (no GPU needed)")
    w.add_argument("--model", action="append", help="model name from the tier table (repeatable)")
    w.add_argument("--all", action="store_true", help="every model of the tier table")
    w.add_argument("--arch", help=arch_help)
    w.add_argument("--ops", help=f"comma separated subset of {','.join(op_registry.OPS)} (default: all)")
    w.add_argument("--jobs", type=_at_least(0), default=0, help="parallel compile processes (default: CPU count)")
    w.add_argument("--tiers", help="user tiers file layered over the shipped one")
    w.add_argument("--quiet", action="store_true", help="no progress bar (there is one only on a terminal)")
    w.add_argument("--spec", action="append", help="one kernel spec as JSON (strict-mode misses print it)")
    _shape_args(w)
    w.set_defaults(fn=cmd_warmup)
    e = sub.add_parser("explain", help="show the tier, variant, params and cache key a shape dispatches to",
                       description="The kernel one op dispatches to for one shape (--op and its shape), or every "
                       "op of a model at --tokens (--model NAME without --op).")
    e.add_argument("--model", help="model name from the tier table: its shape (every op of it without --op)")
    e.add_argument("--arch", help=arch_help.replace("target(s), comma separated", "target"))
    _shape_args(e)
    e.add_argument("--tiers", help="user tiers file layered over the shipped one")
    e.set_defaults(fn=cmd_explain)
    u = sub.add_parser("tune", help="time candidate kernels on this GPU and write the winners to a tiers file")
    u.add_argument("--model", required=True, help="model name from the tier table")
    u.add_argument("--ops", default="routing,finalize,tail",
                   help="comma separated subset of " + ",".join(op_registry.tunable()) + " (default: %(default)s)")
    u.add_argument("--tokens", type=_token_list, help="comma separated token buckets")
    u.add_argument("--out", help="tiers file to write (default: KERNGEN_TIERS or kerngen-tuned-MODEL.toml)")
    u.add_argument("--quiet", action="store_true", help="no progress bar (there is one only on a terminal)")
    u.set_defaults(fn=cmd_tune)
    t = sub.add_parser("tiers", help="list models and tier rules")
    t.add_argument("--tiers", help="user tiers file layered over the shipped one")
    t.set_defaults(fn=cmd_tiers)
    c = sub.add_parser("cache", help="inspect the kernel cache")
    c.add_argument("action", choices=("ls", "verify", "clear"),
                   help="ls: list entries; verify: check every checksum, removing bad entries; clear: remove all")
    c.set_defaults(fn=cmd_cache)
    return p


def main(argv=None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.cmd is None:   # bare `kerngen`: what it can do
        p.print_help()
        return 0
    try:
        env.lock_timeout(), env.strict(), env.default_arch()   # one clear error here, not one per kernel later
        rc = args.fn(args)
        sys.stdout.flush()   # a closed pipe (`kerngen tiers | head`) surfaces here, inside the handler
        return rc
    except KerngenError as e:
        print(f"kerngen: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away: no traceback, and no second error when Python flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141   # as a shell reports a process ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
