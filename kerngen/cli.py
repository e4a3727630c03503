"""kerngen command line: warmup, explain, tiers, cache."""
from __future__ import annotations

import argparse
import os
import sys

from . import cache as cache_mod
from . import env, jit, tiers, warmup
from .errors import CacheError, InputError, KerngenError


def _table(args) -> tiers.Table:
    return tiers.load(args.tiers) if getattr(args, "tiers", None) else tiers.load()


def _arches(text: str | None) -> list[str]:
    if text is None:
        return [env.default_arch()]
    arches = [env.check_arch(a.strip(), "--arch") for a in text.split(",") if a.strip()]
    if not arches:
        raise InputError("command line", "--arch", "one or more targets, comma separated, e.g. sm_90a", repr(text))
    return arches


def _ops(text: str | None) -> tuple[str, ...]:
    ops = tuple(o.strip() for o in text.split(",")) if text else warmup.OPS
    for op in ops:
        if op not in warmup.OPS:
            raise InputError("warmup", "--ops", f"a comma separated subset of {','.join(warmup.OPS)}",
                             repr(text))
    return ops


def cmd_warmup(args) -> int:
    tbl = _table(args)
    names = sorted(tbl.models) if args.all else (args.model or [])
    if not names and not args.op and not args.spec:
        print("kerngen warmup: give --model NAME (repeatable), --all, --op with a shape, or --spec", file=sys.stderr)
        return 2
    ops = _ops(args.ops)
    from .plan import KernelSpec
    specs = [KernelSpec.from_json(text) for text in args.spec or []]
    arches = _arches(args.arch) if not args.spec else []
    for arch in arches:
        if args.op:  # one shape's kernel, e.g. the one a strict-mode miss names
            specs.append(_shape_spec("warmup", args, tbl, arch)[0])
            continue
        for name in names:
            specs += warmup.model_specs(tbl.model(name), tbl, arch, ops)
    specs = list(dict.fromkeys(specs))
    names = names or [f"{len(specs)} kernel(s)"]
    store = cache_mod.default()
    if problem := cache_mod.path_problem(store.root):
        raise CacheError(f"warmup: cache directory {store.root} is not used: {problem}, so nothing could "
                         "be stored there. Use a directory owned by you (or root) that only its owner can write, "
                         "or set KERNGEN_CACHE_DIR to one")
    jobs = args.jobs or min(len(specs), os.cpu_count() or 1)
    results, secs = warmup.timed(warmup.run, specs, str(store.root), jobs, progress=not args.quiet)
    for r in results:
        print(f"  {r.status:9s} {r.key or r.spec.op + '-' + r.spec.variant}"
              + (f"  ({r.seconds:.2f}s{'' if r.stored else ', not stored'})" if r.status == "compiled" else "")
              + (f"\n    {r.error}" if r.error else ""))
    return _report(results, names, arches or sorted({s.arch for s in specs}), secs, store.root)


def _report(results, names, arches, secs, root) -> int:
    """The summary line; the exit status is 1 when a kernel failed or the cache did not get one compiled."""
    n = {s: sum(r.status == s for r in results) for s in ("compiled", "cached", "failed")}
    lost = [r for r in results if r.status == "compiled" and not r.stored]
    print(f"kerngen warmup {', '.join(names)} [{', '.join(arches)}]: {len(results)} kernels, {n['compiled']} compiled "
          f"({n['compiled'] - len(lost)} stored), {n['cached']} cached, {n['failed']} failed in {secs:.1f}s -> {root}")
    if lost:
        print(f"kerngen warmup: {len(lost)} of {n['compiled']} compiled kernels could not be stored in {root} "
              f"({lost[0].note}); the cache lacks them. Free space or make it writable and run this again, or set "
              "KERNGEN_CACHE_DIR to a writable directory", file=sys.stderr)
    return 1 if n["failed"] or lost else 0


def _shape(args, tbl: tiers.Table) -> dict:
    """The shape flags as plain values (a --model fills experts, top_k and hidden from the tier table)."""
    model = args.model[0] if isinstance(args.model, list) else args.model
    shape = {"experts": args.experts, "top_k": args.topk, "hidden": args.hidden, "tokens": args.tokens,
             "dtype": args.dtype, "weights_dtype": args.weights_dtype, "model": model}
    if model:
        m = tbl.model(model)
        shape.update(experts=m.num_experts, top_k=m.top_k, hidden=m.hidden)
    return shape


def _shape_spec(cmd: str, args, tbl: tiers.Table, arch: str):
    """The one kernel a shape given on the command line (or a model's shape at --tokens) dispatches to, and
    that shape."""
    shape = _shape(args, tbl)
    _check_shape(cmd, args.op, shape)
    return warmup.op_module(args.op).explain_spec(tbl, arch, **shape), shape


def _check_shape(cmd: str, op: str, shape: dict) -> None:
    """The shape flags, checked as the op checks its tensors: a shape the op would reject is not compiled."""
    where, topk, experts, hidden, tokens = (f"{cmd} --op {op}", shape["top_k"], shape["experts"], shape["hidden"],
                                            shape["tokens"])
    if topk is None:
        raise InputError(where, "--topk", "given (or --model NAME), with --experts / --hidden as the op needs", "none")
    max_k = getattr(warmup.op_module(op), "MAX_K", tiers.MAX_TOPK)
    if not 1 <= topk <= max_k:
        raise InputError(where, "--topk", f"an integer in [1, {max_k}]", str(topk))
    if op == "routing":
        if not topk <= experts <= tiers.MAX_EXPERTS:
            raise InputError(where, "--experts", f"an integer in [--topk = {topk}, {tiers.MAX_EXPERTS}]",
                             str(experts))
    elif hidden < 8 or hidden % 8 or hidden > tiers.INT32_MAX:
        raise InputError(where, "--hidden", "a multiple of 8, at least 8 (rows are read in 16-byte vectors)",
                         str(hidden))
    if not 1 <= tokens <= tiers.INT32_MAX:
        raise InputError(where, "--tokens", f"an integer in [1, {tiers.INT32_MAX}]", str(tokens))


def cmd_explain(args) -> int:
    tbl = _table(args)
    arch = _arches(args.arch)[0]
    spec, shape = _shape_spec("explain", args, tbl, arch)
    rule = tbl.rule(args.op, {"num_experts": shape["experts"] or 0, "top_k": shape["top_k"], "hidden": shape["hidden"],
                              "tokens": shape["tokens"], "arch": arch})
    key = jit.key_of(spec)
    store = cache_mod.default()
    cached = store.get(key, (tiers.BACKENDS[spec.backend].artifact,)) is not None
    print(f"op        {args.op}\ntier      {rule.source}\nvariant   {spec.variant} ({spec.backend})\n"
          f"params    {dict(spec.params)}\nconstants {dict(spec.constants)}\narch      {arch}\nkey       {key}\n"
          f"cached    {'yes' if cached else 'no'} ({store.root / key})")
    return 0


def cmd_tune(args) -> int:
    from . import tune
    from .ops._common import require_gpu
    require_gpu("kerngen tune")   # it times candidates on this GPU
    ops = args.ops.split(",")
    tokens = args.tokens or tune.DEFAULT_TOKENS
    out = args.out or (str(env.user_tiers()) if env.user_tiers() else f"kerngen-tuned-{args.model}.toml")
    rules = tune.tune(args.model, ops, tokens, progress=not args.quiet)
    tune.write(out, args.model, rules)
    for r in rules:
        print(f"  {r.op:9s} tokens {r.ranges['tokens'][0]}..{r.ranges['tokens'][1]:<6d} {r.variant:12s} {r.params}"
              f"  ({r.source})")
    print(f"wrote {len(rules)} rules to {out}; use them with KERNGEN_TIERS={out} (warmup and dispatch)")
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
        print(f"kerngen cache: {store.root} is not used (its entries could be another user's code): "
              f"{store.distrust()}", file=sys.stderr)
    if args.action == "ls":
        for k in keys:
            meta = store.meta(k) or {}
            print(f"{k}  {'ok' if meta else 'incomplete'}  {meta.get('compile_seconds', '?')}s")
        print(f"{len(keys)} entries in {store.root}")
    elif args.action == "verify":
        return _verify(store, keys)
    elif args.action == "clear":
        if keys and not store.is_marked():
            raise KerngenError(f"cache clear: {store.root} has no {cache_mod.MARKER} marker, so it is not provably a "
                               "kerngen cache; nothing was removed. Check KERNGEN_CACHE_DIR, or delete the entries "
                               "by hand")
        removed = sum(store.remove(k) for k in keys)
        print(f"removed {removed} entries from {store.root}")
    return 0


def _verify(store: cache_mod.DiskCache, keys: list[str]) -> int:
    """Check every entry's checksums (and that it holds its backend's artifact); bad ones are removed where the
    cache may remove them."""
    bad = removed = 0
    for k in keys:
        backend = tiers.BACKENDS.get((store.meta(k) or {}).get("backend"))
        if store.get(k, (backend.artifact,) if backend else ()) is None and store.miss_reason.get(k) != "building":
            gone = not os.path.lexists(store.root / k)
            bad, removed = bad + 1, removed + gone
            print(f"  {k}  {store.miss_reason.get(k)}{'  (removed)' if gone else ''}")
    why = "" if store.is_marked() or not bad else f"; {store.root} has no {cache_mod.MARKER} marker, so none is removed"
    print(f"{len(keys) - bad} ok, {bad} bad, {removed} removed in {store.root}{why}")
    return 1 if bad else 0


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


def _shape_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument("--op", required=required, choices=("routing", "finalize", "tail"), help="op of one shape")
    p.add_argument("--experts", type=int, default=0)
    p.add_argument("--topk", type=int)
    p.add_argument("--hidden", type=int, default=0)
    p.add_argument("--tokens", type=_at_least(1), default=1)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--weights-dtype", default="float32", choices=("float32", "bfloat16"))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kerngen", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("warmup", help="precompile the kernels of models into the cache (no GPU needed)")
    w.add_argument("--model", action="append", help="model name from the tier table (repeatable)")
    w.add_argument("--all", action="store_true", help="every model of the tier table")
    w.add_argument("--arch", help="target(s), comma separated, e.g. sm_90a (default: KERNGEN_ARCH or sm_90a)")
    w.add_argument("--ops", help="comma separated subset of routing,finalize,tail")
    w.add_argument("--jobs", type=_at_least(0), default=0, help="parallel compile processes (default: CPU count)")
    w.add_argument("--tiers", help="user tiers file layered over the shipped one")
    w.add_argument("--quiet", action="store_true", help="no progress bar")
    w.add_argument("--spec", action="append", help="one kernel spec as JSON (strict-mode misses print it)")
    _shape_args(w, required=False)
    w.set_defaults(fn=cmd_warmup)
    e = sub.add_parser("explain", help="show the tier, variant, params and cache key a shape dispatches to")
    e.add_argument("--model")
    e.add_argument("--arch")
    _shape_args(e, required=True)
    e.add_argument("--tiers")
    e.set_defaults(fn=cmd_explain)
    u = sub.add_parser("tune", help="time candidate kernels on this GPU and write the winners to a tiers file")
    u.add_argument("--model", required=True)
    u.add_argument("--ops", default="routing,finalize,tail", help="comma separated subset of routing,finalize,tail")
    u.add_argument("--tokens", type=_token_list, help="comma separated token buckets")
    u.add_argument("--out", help="tiers file to write (default: KERNGEN_TIERS or kerngen-tuned-MODEL.toml)")
    u.add_argument("--quiet", action="store_true")
    u.set_defaults(fn=cmd_tune)
    t = sub.add_parser("tiers", help="list models and tier rules")
    t.add_argument("--tiers")
    t.set_defaults(fn=cmd_tiers)
    c = sub.add_parser("cache", help="inspect the kernel cache")
    c.add_argument("action", choices=("ls", "verify", "clear"))
    c.set_defaults(fn=cmd_cache)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        env.lock_timeout(), env.strict(), env.default_arch()   # one clear error here, not one per kernel later
        return args.fn(args)
    except KerngenError as e:
        print(f"kerngen: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
