"""kerngen's developer tools, run from the repository root as modules (`python3 -m tools.bench`):
bench (timings on a GPU against the peers and floors), sweep (launch-parameter sweeps for the tier table),
diagnose (same SASS, compute-sanitizer runs, kernel resources, routing phase probes)."""
