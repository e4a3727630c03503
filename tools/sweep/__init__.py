"""Launch-parameter sweeps on a GPU whose winners become tier rules (`python3 -m tools.sweep.finalize`)."""
