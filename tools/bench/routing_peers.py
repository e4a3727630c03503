#!/usr/bin/env python3
"""Routing against SGLang's kernels: kerngen.route's top-k against SGLang's router for the model's method, and
kerngen.route with the permutation (one launch) against that router + SGLang's `moe_align_block_size` (its
small-numel Triton kernel where SGLang's dispatcher picks it: T*K <= 64 and E + 1 > 64). Same process, same
logits and bias, CUDA graphs; each case after a producer kernel (a 4 MB write that does not trigger early, its
own time taken off) and chained (back to back).

    python3 -m tools.bench.routing_peers --sglang DIR [--models kimi-k3,deepseek-v3,...]
                                         [--tokens 1,8,64,512,4096] [--block 16]

DIR holds SGLang's `sglang/kernels` package (the peers' tarball unpacked) and its `msgspec` dependency on
PYTHONPATH. The router of each method (`PEERS`): sigmoid with bias (DeepSeek-V3's grouped one included) SGLang's
`moe_fused_gate` (Triton; at Kimi K3's 896 experts and top 16 it dispatches to its own native-CUDA radix-select
router, `moe_route_radix`); softmax top-k (Qwen3, Mixtral; gpt-oss's softmax over the top k is the same with the
weights renormalized) its JIT CUDA `moe_topk_softmax`; Llama-4's top-1 sigmoid its `moe_topk_sigmoid`, each with
its outputs and scratch allocated once. Default: every model of the tier table. After timing, the peer's ids are
checked to be kerngen's as sets per token and its weights within 1e-5 of kerngen's (the two order ties
differently only on exactly equal scores, which random logits do not give). At one token the align step is the
faster of the dispatcher's pick and SGLang's one-warp `moe_align_single_token`, in each setting.
"""
from __future__ import annotations

import argparse
import importlib
import sys
import types

import torch

import kerngen
from kerngen.ops.permute_reference import align_reference
from .lib import elementwise_producer, graph_time_us, require_gpu

PEERS = {"sigmoid_bias": "moe_fused_gate", "grouped_sigmoid_bias": "moe_fused_gate",
         "softmax_topk": "moe_topk_softmax", "topk_softmax": "moe_topk_softmax", "top1_sigmoid": "moe_topk_sigmoid"}
CUSTOM_OP = "sglang.srt.utils.custom_op"   # SGLang's op registry, outside its kernels package


def sglang_moe(module: str):
    """sglang.kernels.ops.moe.<module>; where SGLang's custom-op registry (which its JIT routers' modules import,
    and which the kernels package does not hold) is missing, a stand-in decorator that registers nothing: the
    bench calls the functions themselves."""
    path = f"sglang.kernels.ops.moe.{module}"
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as e:
        if e.name != CUSTOM_OP:
            raise
    shim = types.ModuleType(CUSTOM_OP)
    shim.register_custom_op = lambda *args, **kw: (lambda fn: fn)
    sys.modules[CUSTOM_OP] = shim
    return importlib.import_module(path)


def peer_gate(m, logits: torch.Tensor, bias: torch.Tensor | None):
    """SGLang's router for model m's method, as a call returning (weights [T, K] fp32, ids [T, K]) into buffers
    made once (the peer at its best: no allocation a call)."""
    T, E = logits.shape
    K = m.top_k
    if PEERS[m.routing] == "moe_fused_gate":
        fused_gate = sglang_moe("moe_fused_gate").moe_fused_gate
        return lambda: fused_gate(logits, bias, K, scoring_func="sigmoid", renormalize=m.renormalize,
                                  routed_scaling_factor=m.routed_scaling_factor,
                                  apply_routed_scaling_factor_on_output=True, num_expert_group=m.n_group,
                                  topk_group=m.topk_group)
    w = torch.empty(T, K, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, K, dtype=torch.int32, device=logits.device)
    pow2 = E & (E - 1) == 0
    if PEERS[m.routing] == "moe_topk_softmax":   # the workspace as SGLang's topk_softmax sizes it
        out = sglang_moe("moe_topk_softmax").moe_topk_softmax_out
        ws = torch.empty(1 if pow2 and E <= 512 else T * E, dtype=torch.float32, device=logits.device)
        renorm = m.renormalize or m.routing == "topk_softmax"   # softmax over the top k = renormalized weights

        def softmax_gate():
            out(w, ids, logits, ws, renorm, 0.0, None)
            return w, ids
        return softmax_gate
    out = sglang_moe("moe_topk_sigmoid").moe_topk_sigmoid_out   # top1_sigmoid: sigmoid(logit) of the top one
    ws = torch.empty(1 if pow2 and E <= 256 else T * E, dtype=torch.float32, device=logits.device)

    def sigmoid_gate():
        out(logits, w, ids, ws, False, None, m.routed_scaling_factor, 0)
        return w, ids
    return sigmoid_gate


def default_models() -> str:
    """Every model of the tier table whose routing method has a peer."""
    return ",".join(n for n, m in kerngen.models().items() if m.routing in PEERS)


def timed(fn, producer) -> tuple[float, float]:
    """(after the producer, chained) µs per call."""
    both = graph_time_us(lambda: (producer(), fn()))
    return both - graph_time_us(producer), graph_time_us(fn)


def sglang_align(ids: torch.Tensor, E: int, block: int):
    """SGLang's align step as its dispatcher runs it (the "+1" bucket convention), buffers made once."""
    from sglang.kernels.ops.moe.moe_align import moe_align_block_size
    from sglang.kernels.ops.moe.moe_align_small_numel import SMALL_NUMEL_LIMIT, moe_align_small_numel
    T, K = ids.shape
    numel = T * K
    pad = numel * block if numel < E + 1 else numel + (E + 1) * (block - 1)
    pad = -(-pad // 4) * 4
    dev = ids.device
    sorted_ids = torch.empty(pad, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(-(-pad // block), dtype=torch.int32, device=dev)
    post = torch.empty(1, dtype=torch.int32, device=dev)
    cumsum = torch.empty(E + 2, dtype=torch.int32, device=dev)
    if numel <= SMALL_NUMEL_LIMIT and E + 1 > SMALL_NUMEL_LIMIT:
        return lambda i: moe_align_small_numel(i, E + 1, block, sorted_ids, expert_ids, post)
    return lambda i: moe_align_block_size(i, E + 1, block, sorted_ids, expert_ids, post, cumsum)


def case(name: str, T: int, block: int, producer) -> dict:
    m = kerngen.models()[name]
    E, K = m.num_experts, m.top_k
    gen = torch.Generator(device="cuda").manual_seed(T)
    logits = torch.randn(T, E, device="cuda", generator=gen)
    bias = torch.randn(E, device="cuda", generator=gen) * 0.05
    if PEERS[m.routing] != "moe_fused_gate":
        bias = None
    ws_topk = kerngen.RoutingWorkspace(T, E, K, None)
    ws_perm = kerngen.RoutingWorkspace(T, E, K, block)
    gate = peer_gate(m, logits, bias)
    w_peer, ids_peer = gate()
    align = sglang_align(ids_peer.to(torch.int32), E, block)

    def gate_align():
        w, i = gate()
        align(i)

    row = {"model": name, "E": E, "K": K, "T": T, "block": block}
    for label, fn in (("topk", lambda: kerngen.route(logits, bias=bias, model=name, workspace=ws_topk)),
                      ("perm", lambda: kerngen.route(logits, bias=bias, model=name, tile=block, workspace=ws_perm)),
                      ("gate", gate), ("gate_align", gate_align)):
        row[label + "_us"], row[label + "_chained_us"] = (round(v, 2) for v in timed(fn, producer))
    if T == 1:   # SGLang's one-warp align for a single token, where it is the faster: the peer at its best
        one = sglang_moe("moe_align_single_token").moe_align_single_token

        def gate_align_one():
            w, i = gate()
            one(i, block)
        t1 = tuple(round(v, 2) for v in timed(gate_align_one, producer))
        ids1 = gate()[1].to(torch.int32)
        got = one(ids1, block)
        want = align_reference(ids1, block, E)   # its used blocks: one an expert, experts ascending
        used = int(want[2])
        if not (torch.equal(got[0][:used], want[0][:used]) and torch.equal(got[1][:used // block],
                                                                            want[1][:used // block])
                and int(got[2][0]) == used):
            raise SystemExit(f"{name} T=1: SGLang's single-token align differs from moe_align_block_size's layout")
        row["gate_align_us"], row["gate_align_chained_us"] = (
            min(a, b) for a, b in zip((row["gate_align_us"], row["gate_align_chained_us"]), t1))
    r = kerngen.route(logits, bias=bias, model=name, workspace=ws_topk)
    w_peer, ids_peer = gate()
    torch.cuda.synchronize()
    ours_ids, order = r.topk_ids.long().sort(-1)
    peer_ids, porder = ids_peer.long().sort(-1)
    if not torch.equal(ours_ids, peer_ids):
        raise SystemExit(f"{name} T={T}: SGLang's ids differ from kerngen's")
    err = (r.topk_weights.float().gather(-1, order) - w_peer.float().gather(-1, porder)).abs().max().item()
    if err > 1e-5:
        raise SystemExit(f"{name} T={T}: SGLang's weights differ from kerngen's by {err}")
    return row


def markdown(rows: list[dict]) -> str:
    """The rows as docs/benchmarks.md's SGLang table (µs after a producer / chained; ratio = SGLang / kerngen)."""
    def pair(r, a, b):
        return f"{r[a]:.2f} / {r[b]:.2f}"

    def ratio(r, peer, ours):
        return f"{r[peer + '_us'] / r[ours + '_us']:.2f}× / {r[peer + '_chained_us'] / r[ours + '_chained_us']:.2f}×"
    out = ["| model | T | top-k µs | SGLang gate µs | ratio | route + permute µs | gate + align µs | ratio |",
           "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['model']} | {r['T']} | {pair(r, 'topk_us', 'topk_chained_us')} | "
                   f"{pair(r, 'gate_us', 'gate_chained_us')} | {ratio(r, 'gate', 'topk')} | "
                   f"{pair(r, 'perm_us', 'perm_chained_us')} | {pair(r, 'gate_align_us', 'gate_align_chained_us')} | "
                   f"{ratio(r, 'gate_align', 'perm')} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sglang", default=None, help="a folder to put first on sys.path (SGLang's kernels)")
    ap.add_argument("--models", default=None, help="comma-separated tier-table models (default: every one a peer "
                    "routes)")
    ap.add_argument("--tokens", default="1,8,64,512,4096")
    ap.add_argument("--block", type=int, default=16, help="the permutation's tile / SGLang's block size")
    ap.add_argument("--markdown", action="store_true", help="also print the rows as docs/benchmarks.md's table")
    a = ap.parse_args(argv)
    require_gpu("python3 -m tools.bench.routing_peers")
    if a.sglang:
        sys.path.insert(0, a.sglang)
    producer = elementwise_producer()
    print("µs per call (after a producer / chained); topk: ids + weights; perm: with the permutation")
    rows = []
    for name in (a.models or default_models()).split(","):
        for T in map(int, a.tokens.split(",")):
            r = case(name, T, a.block, producer)
            rows.append(r)
            print(f"{name:12s} T={T:5d} | topk {r['topk_us']:6.2f} / {r['topk_chained_us']:6.2f}  gate "
                  f"{r['gate_us']:6.2f} / {r['gate_chained_us']:6.2f}  ({r['gate_us'] / r['topk_us']:.2f}x / "
                  f"{r['gate_chained_us'] / r['topk_chained_us']:.2f}x) | perm {r['perm_us']:6.2f} / "
                  f"{r['perm_chained_us']:6.2f}  gate+align {r['gate_align_us']:6.2f} / "
                  f"{r['gate_align_chained_us']:6.2f}  ({r['gate_align_us'] / r['perm_us']:.2f}x / "
                  f"{r['gate_align_chained_us'] / r['perm_chained_us']:.2f}x)", flush=True)
    if a.markdown:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
