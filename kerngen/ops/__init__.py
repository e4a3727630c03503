"""The ops: each validates its inputs, asks the planner for a kernel, packs arguments and launches."""
