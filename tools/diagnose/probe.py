"""What the standalone GEMM probes of tools/diagnose share (wgmma_fp4, wgmma_smem): activations as two e4m3 terms, the
floor line, and a configuration checked against its reference, timed, and checked again."""
from __future__ import annotations


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def two_terms(x, torch):
    """x [T, K] -> (hi, lo, s): hi = e4m3(x / s), lo = e4m3(x / s - hi) with s = max|x_t| / 448 a token, so that
    (hi + lo) * s keeps about 8 bits of each value."""
    xf = x.float()
    s = xf.abs().amax(dim=1).clamp_min(1e-30) / 448.0
    v = xf / s[:, None]
    hi = v.to(torch.float8_e4m3fn)
    return hi, (v - hi.float()).to(torch.float8_e4m3fn), s


def floor_us(what: str, rows: int, k: int, nbytes: int, layers: int) -> float:
    """The streaming-read floor of `nbytes` (printed with the shape), µs."""
    from ..bench.lib import read_bandwidth_tbs
    tbs = read_bandwidth_tbs()
    floor = nbytes / (tbs * 1e12) * 1e6
    print(f"{rows} rows x K {k} {what} ({nbytes / 2**20:.1f} MiB with scales), {layers} layers cycled; "
          f"streaming read {tbs:.2f} TB/s: floor {floor:.2f} µs")
    return floor


def time_checked(tag: str, launch, layers, y, ref, floor: float, producer) -> None:
    """launch(layer) on the first layer checked against `ref` (y's first rows), then timed in a CUDA graph after
    `producer` with the layers cycled, then checked again; one line printed."""
    import torch

    from kerngen.timing import after_producer_us
    turn = [0]

    def step():
        launch(layers[turn[0] % len(layers)])
        turn[0] += 1

    errs, us = [], 0.0
    for timing in (False, True):
        if timing:
            us = after_producer_us(step, producer, calls=4 * len(layers))
        y.zero_()
        launch(layers[0])
        torch.cuda.synchronize()
        errs.append(((y[:ref.shape[0]] - ref).abs().max() / ref.abs().max()).item())
    print(f"{tag}:  {us:8.2f} µs  {100 * floor / us:5.1f}% of the floor  max err / max |ref| {errs[0]:.2e}"
          f" (after timing {errs[1]:.2e})")


def start(command: str):
    """After the GPU check (one line and exit 2 without one): (torch, a producer kernel, a seeded CUDA generator)."""
    from ..bench.lib import require_gpu
    require_gpu(command)
    import torch

    from kerngen.timing import elementwise_producer
    return torch, elementwise_producer(), torch.Generator(device="cuda").manual_seed(0)


def measure(tag: str, source: str, name: str, ctas: int, block: int, smem: int, layers, b, xs, y, tokens: int, ref,
            floor: float, producer) -> None:
    """Build one configuration of a probe whose parameters are (weights, their scales, B, token scales, y, rows,
    tokens) at `ctas` CTAs an SM (tools.bench.lib.probe_kernel; a build that fails is reported and skipped, ptxas's
    wgmma serialization notes printed) and time_checked() it, each layer a (weights, scales) pair."""
    import torch

    from kerngen.launch import current_stream

    from ..bench.lib import probe_kernel
    try:
        k, log = probe_kernel(source, name, ctas, block, "QQQQQqi4x", smem=smem)
    except Exception as e:   # noqa: BLE001 (a diagnostic: report and go on)
        print(f"{tag}: build failed: {e}")
        return
    if "serialized" in log:
        print(f"{tag}: {log.strip()}")
    dev, rows = torch.cuda.current_device(), ref.shape[1]
    time_checked(tag, lambda layer: k(current_stream(dev), layer[0].data_ptr(), layer[1].data_ptr(), b.data_ptr(),
                                      xs.data_ptr(), y.data_ptr(), rows, tokens), layers, y, ref, floor, producer)
