"""Device timing under CUDA graphs (used by the tuner and tools/bench)."""
from __future__ import annotations

import statistics

import torch


def graph_time_us(fn, calls: int = 20, replays: int = 30) -> float:
    """Median µs per call of `fn` captured `calls` times in one CUDA graph, over `replays` replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / calls)
    return statistics.median(times)


def after_producer_us(step, producer, calls: int = 20, replays: int = 30) -> float:
    """Median µs a call of `step` adds right behind a call of `producer` in one CUDA graph (their pair's time less
    the producer's own): `step` as it runs after another library's kernel, which gives it no early start."""
    return (graph_time_us(lambda: (producer(), step()), calls, replays)
            - graph_time_us(producer, calls, replays))


def elementwise_producer():
    """A 4 MB elementwise write on the current stream (torch's, so it never triggers a dependent's early start):
    the producer of after_producer_us that tools.bench and kerngen tune put before a step."""
    buf = torch.empty(2 << 20, dtype=torch.bfloat16, device="cuda")
    return lambda: buf.mul_(1.0)


def both_settings_us(step, calls: int = 20, replays: int = 30) -> float:
    """The slower of a step's two times: back to back (chained) and behind an elementwise producer. A choice by it is
    never the one that wins one setting by losing the other."""
    return max(graph_time_us(step, calls, replays), after_producer_us(step, elementwise_producer(), calls, replays))
