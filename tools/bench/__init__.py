"""Benchmarks on a GPU: kerngen against torch, torch.compile and the peers, in CUDA graphs, beside the floors.
`python3 -m tools.bench` runs the op table; each module here is also a command (`python3 -m tools.bench.experts`)."""
