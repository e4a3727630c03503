"""Checks of what the kernels are rather than how fast they run: same SASS between revisions (no GPU), every
kernel family once for compute-sanitizer, per-kernel resources, routing phase probes."""
